"""The device check script, run here on a tiny random model: the same code a GPU runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_the_check_runs_on_this_cpu_at_the_tiny_size(tmp_path):
    assert (
        gpu_check.main(["--device", "cpu", "--tiny", "--dtypes", "bfloat16", "--tokens", "8", "--out", str(tmp_path)])
        == 0
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    part = report["dtypes"]["bfloat16"]
    assert all(r["identical"] for r in part["identity"].values())
    assert set(map(int, part["forward_ms"])) == set(gpu_check.SIZES)
    timing = part["timing"]["gsm8k"]["tokens_per_s"]
    assert {"vanilla", "vanilla-compiled", "pld", "hydra-default", "entmtp-static", "entmtp-static-compiled"} <= set(
        timing
    )
    assert all(v > 0 for v in timing.values())
    for task in part["timing"].values():  # every route ran; compiled EntMTP equals compiled plain generate
        assert not task["errors"] and task["compiled_identity"]
        assert all(r["identical"] for r in task["compiled_identity"])
    assert "Greedy identity: 6 of 6" in (tmp_path / "gpu_check.md").read_text()


def test_without_cuda_the_script_says_so(tmp_path, capsys):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
