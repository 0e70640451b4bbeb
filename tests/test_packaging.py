"""A wheel carries the templates, the generated set and the tuning files: an installed (non-editable) flashgen renders,
checks and finds its tuning data."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_templates_and_generated(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "whl"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next((tmp_path / "whl").glob("flashgen-*.whl"))
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code = ("import codegen.render as r, flashgen, sys; "
            "assert str(r.templates_dir()).startswith(sys.argv[1]), r.templates_dir(); "
            "from codegen.heuristics import fwd_traits; assert 'FwdSm80' in r.render(fwd_traits('sm_90a','bf16',128,0)); "
            "assert r.check_generated(r.generated_dir()) == [], r.check_generated(r.generated_dir()); "
            "import flashgen.tuning as t; d = t.shipped_dir(); assert str(d).startswith(sys.argv[1]), d; "
            "assert (d / 'README.md').is_file(); assert len(list(d.glob('*.json'))) == int(sys.argv[2])")
    shipped = len(list((ROOT / "flashgen" / "tuning_data").glob("*.json")))
    r = subprocess.run([sys.executable, "-c", code, str(site), str(shipped)], capture_output=True, text=True, cwd=tmp_path,
                       env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr
