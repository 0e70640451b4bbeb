"""`flashgen tune` on the GPU: one small key end to end (compiles the hdim-64 forward candidates of the SM80 path
and, on sm_90a, of the Hopper forward, ~1-2 min on 16 cores), then the written file drives dispatch."""
import json

import pytest

from flashgen import cli, dispatch, tuning

pytestmark = pytest.mark.gpu


@pytest.fixture
def private_tuning_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_TUNING_DIR", str(tmp_path))
    dispatch.reload_tuning()
    yield tmp_path
    monkeypatch.undo()
    dispatch.reload_tuning()   # later tests dispatch without this file


def test_tune_one_key_then_dispatch_uses_it(private_tuning_dir, capsys):
    gpu, arch = dispatch.device_name(0), dispatch.device_arch(0)
    out = tuning.user_file(gpu)
    rc = cli.main(["tune", "--hdim", "64", "--causal", "0", "--seqlen", "2048", "--family", "fwd", "--family", "fwd_sm90",
                   "--budget-minutes", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "| bf16 | 64 | no | 2048 | fwd |" in printed
    data = json.loads(out.read_text())
    assert data["gpu"] == gpu and data["arch"] == arch and len(data["entries"]) == 1
    entry = data["entries"][0]
    assert (entry["dtype"], entry["hdim"], entry["causal"], entry["seqlen"]) == ("bf16", 64, False, 2048)
    assert "bwd" not in entry and entry["measured"]["fwd"]["default"][1] > 0
    # The tuner cleared its overrides; dispatch now reads the file (reloaded by the tuner) for this key only.
    assert not dispatch._fwd_tile_overrides
    t = dispatch.fwd_traits(arch, gpu, "bf16", 64, False, seqlen_q=2048, seqlen_k=2048)
    assert [t.block_m, t.block_n, t.num_warps] == entry["fwd"]
    k = dispatch.fwd_kernel(0, __import__("torch").bfloat16, 64, False, seqlen_q=1000, seqlen_k=1000)
    assert [k.traits.block_m, k.traits.block_n, k.traits.num_warps] == entry["fwd"]
