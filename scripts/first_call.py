"""What a new user's first calls cost: each ``generate`` call timed twice on a fresh cost cache, then
the measurement the docs point to (``calibrate``), timed per batch size.

    python scripts/first_call.py --out runs/first-call.json

The demo model with its shipped drafter and banks (which re-rank their trees with this
machine's step costs). In one process, on an empty cache folder:

1. the same ``generate`` call twice at batch size 1 (24 new tokens), then twice at batch size 4:
   the first of each pair pays whatever a first call pays (nothing is measured there);
2. ``calibrate(model, batch_sizes=[1, 2, 4])`` (every batch size a batch of 4 ranks at), with the
   seconds each size took;
3. both calls again, now ranked on the measured costs.

Prints a table and writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch


def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/first-call.json")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument(
        "--model-cache",
        default=None,
        help="where the demo model is cached already (default: fetched into the fresh cache folder)",
    )
    args = parser.parse_args()
    os.environ["ENTMTP_HF_CACHE"] = tempfile.mkdtemp(prefix="entmtp-first-call-")  # a fresh cost cache
    from entmtp_hf import calibrate
    from entmtp_hf.demo import DEMO_PROMPTS, config_for, load_demo
    from entmtp_hf.tools.machine import hardware_string

    t0 = time.perf_counter()
    model, tokenizer, bank_dir = load_demo(cache_dir=args.model_cache)
    loaded = time.perf_counter() - t0
    config = config_for(bank_dir, "chat")
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for _, t in DEMO_PROMPTS
    ] + ["Name three rivers in Europe."]
    tokenizer.padding_side = "left"
    one = tokenizer(texts[:1], return_tensors="pt")
    four = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(
        max_new_tokens=args.tokens,
        do_sample=False,
        entmtp_config=config,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    calls = {1: lambda: model.generate(**one, **kwargs), 4: lambda: model.generate(**four, **kwargs)}
    result: dict = {
        "hardware": hardware_string(),
        "threads": torch.get_num_threads(),
        "load_s": loaded,
        "new_tokens": args.tokens,
        "uncalibrated": {},
        "calibrated": {},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b, call in calls.items():
            first, again = _timed(call), _timed(call)
            result["uncalibrated"][b] = {"first_s": first, "again_s": again, "extra_s": first - again}
    result["warnings"] = sorted({str(w.message) for w in caught})
    per_size = {}
    for b in (1, 2, 4):
        t = time.perf_counter()
        calibrate(model, batch_sizes=[b])
        per_size[b] = time.perf_counter() - t
    result["calibrate_s"] = per_size
    for b, call in calls.items():
        first, again = _timed(call), _timed(call)
        result["calibrated"][b] = {"first_s": first, "again_s": again, "extra_s": first - again}
    lines = [
        f"{result['hardware']}, {result['threads']} threads; demo model loaded in {loaded:.1f} s",
        "",
        "| | batch 1 | batch 4 |",
        "|---|---|---|",
    ]
    for phase in ("uncalibrated", "calibrated"):
        r = result[phase]
        lines.append(
            f"| {phase}: first call / again (s) | {r[1]['first_s']:.2f} / {r[1]['again_s']:.2f} | "
            f"{r[4]['first_s']:.2f} / {r[4]['again_s']:.2f} |"
        )
    lines.append(
        "| calibrate (s), batch sizes 1 / 2 / 4 | " + " / ".join(f"{per_size[b]:.1f}" for b in (1, 2, 4)) + " | |"
    )
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
