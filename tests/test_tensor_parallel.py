"""Tensor parallelism inside transformers: ``from_pretrained(..., tp_plan="auto")`` under ``torchrun``.

Two CPU processes (gloo) load a tiny Llama whose projections and LM head are sharded across them
(DTensors); the heads are replicated and draft through the base model's sharded LM head. Greedy
EntMTP must equal plain ``generate`` on both ranks, for a chain and mc_sim_7b_63.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from tiny import fitted_heads, tiny_model

WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_greedy_entmtp_equals_generate_on_both_ranks_under_tensor_parallel(tmp_path):
    model = tiny_model()
    heads = fitted_heads(model, "hydra", "mlp", use_base_lm_head=True)
    model.save_pretrained(tmp_path / "model")
    heads.save_pretrained(tmp_path / "heads")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        str(tmp_path / "model"),
        str(tmp_path / "heads"),
        str(tmp_path),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["sharded_q_proj"] and report["sharded_lm_head"]  # the model really is split
        assert {r["tree"] for r in report["runs"]} == {"chain", "mc_sim_7b_63"}
        assert all(r["equal"] for r in report["runs"]), [r for r in report["runs"] if not r["equal"]]
        assert max(r["longest_accept"] for r in report["runs"]) >= 2  # trees were accepted beyond the root
    assert [r["tokens"] for r in reports[0]["runs"]] == [r["tokens"] for r in reports[1]["runs"]]
