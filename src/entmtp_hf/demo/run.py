"""The embedded default: the demo model with its shipped heads and banks, in one line.

``load_demo()`` returns SmolLM2-135M-Instruct (see :mod:`entmtp_hf.demo_model`) with the
shipped Hydra heads enabled, its tokenizer and the folder of its shipped tree banks.
``python -m entmtp_hf.demo`` (what ``make demo`` runs) answers a coding, a math and a chat
prompt with EntMTP while the text streams, then measures tokens per step, tokens/s and
the speedup over vanilla ``generate`` on the same prompts in the same run, and over plain
decoding with every linear layer on oneDNN (:func:`entmtp_hf.layouts.onednn_linears`): on a
CPU where that kernel is much faster than MKL, that is the part of the speedup that is not
the kernel. A greedy output that leaves vanilla's is named with the base model's logit gap there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from ..tools.bench.checks import find_mismatch
from . import DEMO_PROMPTS, config_for, load_demo
from ..cpu_kernels import onednn_linears
from ..scheduling.policies import POLICIES

def _encode(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return ids["input_ids"]


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _mismatch_text(m: dict) -> str:
    """Where a greedy output left vanilla's, and whether the base model's logits tied there."""
    gap = m.get("logit_gap")
    if gap is None:
        return f"{m['task']} from token {m.get('position')} on"
    tie = ", a floating-point tie: the tree's forward rounds differently from the one-token one" if abs(gap) < 1e-3 else ""
    return f"{m['task']} from token {m.get('position')} on (logit gap there {gap:.4f}{tie})"


def run_demo(max_new_tokens: int = 128, repeats: int = 1, policy: str | None = None) -> dict:
    """Stream the three prompts with EntMTP, then time EntMTP, vanilla and the kernel reference on them."""
    t0 = time.perf_counter()
    model, tokenizer, bank_dir = load_demo()
    print(f"loaded the demo model and heads in {time.perf_counter() - t0:.1f}s; banks: {bank_dir}\n")
    torch.manual_seed(0)
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    configs = {task: config_for(bank_dir, task, policy) for task, _ in DEMO_PROMPTS}
    inputs = [(task, _encode(tokenizer, text), text) for task, text in DEMO_PROMPTS]

    # warm-up, excluded from the timings
    model.generate(inputs[0][1], max_new_tokens=8, do_sample=False)
    model.generate(inputs[0][1], max_new_tokens=8, do_sample=False, entmtp_config=configs[inputs[0][0]])

    for task, ids, text in inputs:
        print(f"### [{task}] {text}\n")
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        model.generate(ids, streamer=streamer, entmtp_config=configs[task], **greedy)
        print()

    rows, ent_tps, van_tps, dnn_tps, taus, mismatches = [], [], [], [], [], []
    for task, ids, _ in inputs:
        for _ in range(repeats):  # interleaved, so machine drift hits every method alike
            ref, t_van = _timed(lambda: model.generate(ids, **greedy))
            with onednn_linears(model):  # the kernel reference: plain decoding with oneDNN's products
                plain, t_dnn = _timed(lambda: model.generate(ids, **greedy))
            out, t_ent = _timed(
                lambda: model.generate(ids, entmtp_config=configs[task], return_dict_in_generate=True, **greedy)
            )
            n_van, n_dnn, n_ent = (x.shape[1] - ids.shape[1] for x in (ref, plain, out.sequences))
            stats = out.entmtp_stats
            van_tps.append(n_van / t_van)
            dnn_tps.append(n_dnn / t_dnn)
            ent_tps.append(n_ent / t_ent)
            taus.append(stats["mean_accept_length"])
            if not torch.equal(out.sequences, ref):
                n = ids.shape[1]
                diff = find_mismatch(ref[0, n:].tolist(), out.sequences[0, n:].tolist(), model, ids[0].tolist())
                mismatches.append({"task": task, **(diff or {})})
            rows.append((task, stats["mean_accept_length"], n_ent / t_ent, n_van / t_van, n_dnn / t_dnn))

    print(f"{'task':<10} {'tau':>6} {'EntMTP tok/s':>13} {'vanilla tok/s':>14} {'speedup':>8}   "
          f"{'vanilla-onednn tok/s':>21} {'speedup':>8}")  # fmt: skip
    for task, tau, ent, van, dnn in rows:
        print(f"{task:<10} {tau:>6.2f} {ent:>13.1f} {van:>14.1f} {ent / van:>7.2f}x   {dnn:>21.1f} {ent / dnn:>7.2f}x")
    summary = {
        "mean_accept_length": statistics.mean(taus),
        "entmtp_tokens_per_s": statistics.median(ent_tps),
        "vanilla_tokens_per_s": statistics.median(van_tps),
        "vanilla_onednn_tokens_per_s": statistics.median(dnn_tps),
        "speedup": statistics.median(e / v for e, v in zip(ent_tps, van_tps)),
        "speedup_over_onednn": statistics.median(e / d for e, d in zip(ent_tps, dnn_tps)),
        "identical_to_vanilla": not mismatches,
        "mismatches": mismatches,
    }
    same = "yes" if not mismatches else "no: " + "; ".join(_mismatch_text(m) for m in mismatches)
    print(
        f"\nmean tokens per step (tau) {summary['mean_accept_length']:.2f}; "
        f"median tokens/s EntMTP {summary['entmtp_tokens_per_s']:.1f} vs vanilla {summary['vanilla_tokens_per_s']:.1f}; "
        f"median speedup {summary['speedup']:.2f}x; greedy output identical to vanilla: {same}\n"
        f"vanilla-onednn is plain generate with every linear layer on oneDNN (the kernel EntMTP's verification "
        f"uses where it was timed faster): median speedup over it {summary['speedup_over_onednn']:.2f}x, "
        f"what speculation adds beyond the kernel"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="EntMTP on the embedded demo model")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method")
    parser.add_argument("--policy", choices=POLICIES, default=None)
    args = parser.parse_args(argv)
    run_demo(args.max_new_tokens, args.repeats, args.policy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
