"""One rank of the tensor-parallel check, run by ``torchrun`` from ``tests/test_tensor_parallel.py``.

Loads the saved tiny model with ``tp_plan="auto"`` (its projections and LM head sharded across the
ranks), attaches the saved heads, and writes whether greedy EntMTP equals plain ``generate`` for a
chain and mc_sim_7b_63 on every prompt, with what it saw of the sharding, to ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63

CHAIN = [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]


def main(model_dir: str, heads_dir: str, out_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float64).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    enable_entmtp(model, heads_dir)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (1, 3 + i), generator=g) for i in range(3)]
    report = {
        "sharded_q_proj": isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor),
        "sharded_lm_head": isinstance(model.lm_head.weight, DTensor),
        "runs": [],
    }
    for name, tree in (("chain", CHAIN), ("mc_sim_7b_63", MC_SIM_7B_63)):
        for ids in prompts:
            ref = model.generate(ids, max_new_tokens=30, do_sample=False)
            out = model.generate(
                ids,
                max_new_tokens=30,
                do_sample=False,
                entmtp_config=EntMTPConfig(tree=tree),
                return_dict_in_generate=True,
            )
            report["runs"].append(
                {
                    "tree": name,
                    "equal": bool(torch.equal(out.sequences, ref)),
                    "tokens": out.sequences[0].tolist(),
                    "longest_accept": max(out.entmtp_stats["accept_lengths"]),
                }
            )
    rank = int(os.environ["RANK"])
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
