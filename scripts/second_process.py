"""How long a new process takes to its first tokens, eager against compiled decoding, plain and EntMTP.

Each measurement is a fresh Python process (timed from its launch to its exit) that loads the demo
model (``load_demo(precision=...)``, or with ``compile=True``) and generates ``--tokens`` greedy tokens
for the demo's math prompt, plainly or with EntMTP and the gsm8k bank. A compiled process runs
twice on one new inductor folder (``TORCHINDUCTOR_CACHE_DIR``, where the package also saves its
compiled graphs): cold (nothing compiled on this machine) then warm (what every later process
pays). Eager runs are timed after one untimed run, so all processes start with the OS's file
cache warm. Prints a table and writes the figures as JSON.

    python scripts/second_process.py --out docs/results/compile-forward/intel-xeon-second-process.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = ("plain", "entmtp")


def child(method: str, compiled: bool, tokens: int, precision: str) -> None:
    """One process's work: load, generate, print the graphs it compiled or loaded as JSON."""
    from entmtp_hf.decoding.compiled import compiled_call
    from entmtp_hf.demo import DEMO_PROMPTS, config_for, load_demo

    model, tok, bank_dir = load_demo(precision=precision, compile=compiled)
    text = dict(DEMO_PROMPTS)["gsm8k"]
    chat = [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    extra = {"entmtp_config": config_for(bank_dir, "gsm8k")} if method == "entmtp" else {}
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **extra)
    graphs = compiled_call(model, model.generation_config.compile_config).compile_seconds if compiled else []
    print("GRAPHS " + json.dumps([[what, round(s, 1)] for what, s in graphs]))


def timed(method: str, compiled: bool, tokens: int, precision: str, env: dict[str, str]) -> tuple[float, list]:
    """Seconds from launching a child process to its exit, and the graphs it reported."""
    cmd = [sys.executable, __file__, "--child", method, "--tokens", str(tokens), "--precision", precision]
    cmd += ["--compiled"] if compiled else []
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{method} (compiled={compiled}) failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("GRAPHS "))
    return seconds, json.loads(line.removeprefix("GRAPHS "))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32", help="load_demo(precision=...)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=METHODS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.compiled, args.tokens, args.precision)
        return 0
    rows = {}
    for method in METHODS:
        env = dict(os.environ)
        timed(method, False, args.tokens, args.precision, env)  # the OS's file cache, not measured
        eager, _ = timed(method, False, args.tokens, args.precision, env)
        with tempfile.TemporaryDirectory() as folder:
            env["TORCHINDUCTOR_CACHE_DIR"] = folder
            cold, cold_graphs = timed(method, True, args.tokens, args.precision, env)
            warm, warm_graphs = timed(method, True, args.tokens, args.precision, env)
        rows[method] = {
            "eager_s": round(eager, 1),
            "compiled_cold_s": round(cold, 1),
            "compiled_warm_s": round(warm, 1),
            "warm_over_eager_s": round(warm - eager, 1),
            "graphs_cold": cold_graphs,
            "graphs_warm": warm_graphs,
        }
        print(
            f"{method}: eager {eager:.1f} s, compiled cold {cold:.1f} s, warm {warm:.1f} s "
            f"({warm - eager:+.1f} s over eager); graphs warm: {warm_graphs}",
            flush=True,
        )
    import torch

    from entmtp_hf.costs.fingerprint import machine_fingerprint

    result = {
        "what": f"process launch to exit after {args.tokens} greedy tokens of the demo's math prompt",
        "precision": args.precision,
        "processor": machine_fingerprint(torch.device("cpu"), torch.float32).processor,
        "torch": torch.__version__,
        "methods": rows,
    }
    if args.out:
        from entmtp_hf.tools.checkpoint import write_json

        write_json(args.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
