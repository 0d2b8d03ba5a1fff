"""Greedy EntMTP against plain ``generate`` on prompts longer than a sliding window.

    python scripts/long_prompt_check.py --model gemma-3-270m --min-tokens 700 --out runs/long-prompt.json

A demo model with its shipped drafter and banks (``load_demo(model=...)``). For each task, one
prompt built from the task's evaluation basket, its prompts joined in completion form until it
is at least ``--min-tokens`` tokens long (Gemma 3's window is 512: the verification forward then
attends across the window's edge, and the sliding layers' cache wraps), ending with one of the
task's prompts; then plain greedy ``generate`` and greedy EntMTP with the task's bank, on the
model's CPU kernels (``enable_entmtp``'s default), token for token. A divergence is named with
the base model's logit gap there. Prints one line per task and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def long_prompt(tokenizer, task: str, min_tokens: int) -> list[int]:
    """The task's basket prompts in completion form, joined until ``min_tokens`` tokens, the last
    one (the one answered) closing the text."""
    from entmtp_hf.tools.data.tasks import evaluation_basket

    prompts = [p.render(tokenizer) for p in evaluation_basket(task, 64)]
    ids, k = list(prompts[-1]), len(prompts) - 2
    while len(ids) < min_tokens and k >= 0:
        ids = prompts[k] + ids
        k -= 1
    if len(ids) < min_tokens:
        raise ValueError(f"task {task!r}: its basket makes only {len(ids)} tokens, fewer than {min_tokens}")
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tasks", nargs="+", default=["humaneval", "gsm8k", "chat"])
    parser.add_argument("--min-tokens", type=int, default=700)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="runs/long-prompt.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from entmtp_hf.demo import config_for, load_demo
    from entmtp_hf.demo.compare import find_mismatch

    model, tokenizer, bank_dir = load_demo(model=args.model)
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    rows = []
    for task in args.tasks:
        ids = torch.tensor([long_prompt(tokenizer, task, args.min_tokens)])
        greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
        t0 = time.perf_counter()
        plain = model.generate(ids, **greedy)[0, ids.shape[1] :].tolist()
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, **greedy, entmtp_config=config_for(bank_dir, task), return_dict_in_generate=True)
        tree_s = time.perf_counter() - t0
        new = out.sequences[0, ids.shape[1] :].tolist()
        diff = find_mismatch(plain, new, model, ids[0].tolist())
        stats = out.entmtp_stats
        row = {
            "task": task,
            "prompt_tokens": ids.shape[1],
            "sliding_window": window,
            "new_tokens": len(new),
            "identical": diff is None,
            "mismatch": diff,
            "plain_s": round(plain_s, 2),
            "entmtp_s": round(tree_s, 2),
            "mean_accept_length": stats.get("mean_accept_length"),
            "plain_decoding": bool(stats.get("plain_decoding")),
        }
        rows.append(row)
        print(
            f"{task}: {row['prompt_tokens']} prompt tokens (window {window}), {len(new)} new: "
            f"{'identical' if diff is None else 'DIVERGES: ' + json.dumps(diff)}; tokens per step "
            f"{row['mean_accept_length']:.2f}, {plain_s:.1f} s plain, {tree_s:.1f} s EntMTP",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
