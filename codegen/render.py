"""Jinja rendering of kernel traits into CUDA C++ sources, and the generated/ tree with its manifest."""
from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path

import jinja2

from .traits import KernelTraits, traits_from_dict

_HERE = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """templates/ of a checkout, else the copy installed as package data (flashgen/templates)."""
    env = os.environ.get("FLASHGEN_TEMPLATES_DIR")
    if env:
        return Path(env)
    checkout = _HERE.parent / "templates"
    if checkout.is_dir():
        return checkout
    import flashgen
    return Path(flashgen.__file__).resolve().parent / "templates"


def include_dir() -> Path:
    return templates_dir() / "include"


def generated_dir() -> Path:
    checkout = _HERE.parent / "generated"
    if (_HERE.parent / "templates").is_dir():
        return checkout
    import flashgen
    return Path(flashgen.__file__).resolve().parent / "generated"


@lru_cache(maxsize=None)
def _env(root: str) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(root), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                              autoescape=False)


def render(traits: KernelTraits) -> str:
    """Rendered source for `traits`: deterministic, same traits -> byte-identical text."""
    tmpl = _env(str(templates_dir())).get_template(traits.template)
    return tmpl.render(**traits.template_values())


def templates_hash() -> str:
    """Hash of every template and header: a rendered source #includes headers, so the cache key and
    `flashgen check` must see header edits too."""
    h = hashlib.sha256()
    root = templates_dir()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def headers_hash(source: str) -> str:
    """Hash of the project headers a rendered source includes, followed transitively (quoted includes, resolved
    under include_dir()): a kernel's cache key changes with an edit to one of its headers and no other, so editing
    the Hopper forward's header leaves the SM80 kernels cached."""
    root, seen = include_dir(), {}
    todo = _INCLUDE.findall(source)
    while todo:
        name = todo.pop()
        if name not in seen:
            p = root / name
            seen[name] = p.read_bytes() if p.is_file() else b"<not a project header>"
            todo += _INCLUDE.findall(seen[name].decode(errors="replace"))
    h = hashlib.sha256()
    for name in sorted(seen):
        h.update(name.encode() + b"\0" + seen[name] + b"\0")
    return h.hexdigest()


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


MANIFEST = "manifest.json"


def source_path(out_dir: Path, traits: KernelTraits) -> Path:
    return Path(out_dir) / traits.arch / f"{traits.name}.cu"


def write_generated(traits_list: list[KernelTraits], out_dir: Path) -> list[Path]:
    """Render into out_dir/<arch>/<name>.cu and merge the entries into out_dir/manifest.json.
    The selected archs' entries are replaced; other archs' stay."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir) or {"archs": {}}
    archs = sorted({t.arch for t in traits_list})
    paths = []
    for arch in archs:
        arch_dir = out_dir / arch
        arch_dir.mkdir(parents=True, exist_ok=True)
        entries = []
        keep = set()
        for t in (t for t in traits_list if t.arch == arch):
            src = render(t)
            p = source_path(out_dir, t)
            if not p.exists() or p.read_text() != src:
                p.write_text(src)
            keep.add(p.name)
            paths.append(p)
            entries.append({"name": t.name, "source": p.relative_to(out_dir).as_posix(),
                            "sha256": sha256(src), "traits": t.to_dict()})
        for stale in arch_dir.glob("*.cu"):
            if stale.name not in keep:
                stale.unlink()
        manifest["archs"][arch] = sorted(entries, key=lambda e: e["name"])
    manifest["templates_sha256"] = templates_hash()
    manifest["archs"] = dict(sorted(manifest["archs"].items()))
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return paths


def read_manifest(out_dir: Path) -> dict | None:
    p = Path(out_dir) / MANIFEST
    return json.loads(p.read_text()) if p.exists() else None


def check_generated(out_dir: Path) -> list[str]:
    """Differences between out_dir and what codegen + templates render now (empty list: up to date)."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    if manifest is None:
        return [f"{out_dir / MANIFEST} is missing"]
    problems = []
    if manifest.get("templates_sha256") != templates_hash():
        problems.append("templates/ changed since generated/ was rendered (templates_sha256 differs)")
    for arch, entries in manifest["archs"].items():
        listed = set()
        for e in entries:
            t = traits_from_dict(e["traits"])
            p = out_dir / e["source"]
            listed.add(p.name)
            if t.name != e["name"]:
                problems.append(f"{e['name']}: codegen now names these traits {t.name}")
                continue
            src = render(t)
            if not p.exists():
                problems.append(f"{p}: missing")
            elif p.read_text() != src:
                problems.append(f"{p}: differs from the current render")
            if sha256(src) != e["sha256"]:
                problems.append(f"{e['name']}: manifest sha256 differs from the current render")
        for extra in (out_dir / arch).glob("*.cu"):
            if extra.name not in listed:
                problems.append(f"{extra}: not in the manifest")
    return problems
