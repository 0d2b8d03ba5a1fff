"""The demo model's ``generate``, eager against compiled decoding, plain and EntMTP, in tokens per second.

Per held-out prompt (the first ``--prompts`` of each ``data/prompts/unseen-*.jsonl``, chat template,
greedy, ``--max-new-tokens``), each round times eager plain ``generate`` (its dynamic cache) and
plain ``generate`` on the compiled path (:func:`entmtp_hf.decoding.compiled.compiled_generation`: a
static cache of 512 slots, the forward compiled once; that compile runs before the timing, and its
seconds are reported), back to back, and where the model has CPU kernels (``enable_entmtp``'s default)
plain ``generate`` on the compiled path inside ``applied_kernels(model)``, its graph multiplying on the
kernels EntMTP's calls use (``compiled-kernels``); with ``--entmtp``, also EntMTP with the task's shipped bank
(``load_demo()``'s drafter and banks, code/math/chat -> humaneval/gsm8k/chat) eager and on the same
compiled path (every graph its timed calls take compiled in a warm-up before the timing: the same greedy
call, since a step may fall back to a one-token verification, a graph of its own); with ``--gguf FILE``
(repeatable), also llama.cpp's plain decoding of that file (``scripts/llamacpp_baseline.py``: the same
token ids, greedy) in the same rotation, so that both are timed under the same load. Prints and saves
(``--out``) the median tokens/s per task and method, the ratios of compiled EntMTP to each of the others,
and whether each output equals its own plain decoding's token for token (eager EntMTP against eager
plain; compiled EntMTP against compiled plain on the same kernels, ``compiled-kernels`` where the model
has them: the same graphs and the same eager prefill): where not, the first differing position and the
model's logit gap there between the two tokens (a near-zero gap is a tie that rounding decides, as bf16
and int8 weights make more likely). ``--calibrate``
measures the step costs (eager, on the model's CPU kernels) before the timing, so the banks rank their trees
on this machine's costs rather than as stored; the per-call compiled path reads the same table.

    python scripts/compile_generate.py --precision fp32 --out docs/results/compile-forward/xeon-generate-fp32.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from entmtp_hf.calibration import calibrate
from entmtp_hf.costs.fingerprint import machine_fingerprint
from entmtp_hf.cpu_kernels import applied_kernels, kernel_routing
from entmtp_hf.decoding.compiled import compiled_call, compiled_generation
from entmtp_hf.demo import config_for, load_demo
from entmtp_hf.demo.compare import find_mismatch
from entmtp_hf.tools.checkpoint import write_json
from entmtp_hf.tools.models import PRECISIONS

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"
TASKS = ("code", "math", "chat")
BANK_TASKS = ("humaneval", "gsm8k", "chat")


def held_out_ids(tokenizer, per_task: int) -> list[tuple[str, list[int]]]:
    """(task, token ids): the first ``per_task`` prompts of each ``data/prompts/unseen-TASK.jsonl``, chat template
    applied with a generation prompt."""
    prompts = []
    for task in TASKS:
        for line in (PROMPTS / f"unseen-{task}.jsonl").read_text().splitlines()[:per_task]:
            chat = [{"role": "user", "content": json.loads(line)["prompt"]}]
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
            prompts.append((task, list(ids)))
    return prompts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--entmtp", action="store_true", help="also EntMTP with the shipped banks, eager and compiled")
    ap.add_argument("--gguf", type=Path, action="append", default=[], help="also llama.cpp on this GGUF file")
    ap.add_argument("--calibrate", action="store_true", help="rank the banks' trees on costs measured first")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, bank_dir = load_demo(precision=args.precision)
    if args.calibrate:
        calibrate(model, refresh=True)
    fast = compiled_generation(max_cache_len=512)
    bank = {task: {"entmtp_config": config_for(bank_dir, name)} for task, name in zip(TASKS, BANK_TASKS)}
    kinds = ["eager", "compiled", *(("compiled-kernels",) if kernel_routing(model) else ())]
    kinds += ["entmtp", "entmtp-compiled"] if args.entmtp else []
    engines = {}
    if args.gguf:
        from llamacpp_baseline import load, tokens_per_s

        loaded = load([str(f) for f in args.gguf], args.threads)
        engines = {f"llama.cpp {Path(f).stem}": llm for f, llm in loaded.items()}

    def extra(kind: str, task: str) -> dict:
        return {**(bank[task] if kind.startswith("entmtp") else {}), **(fast if "compiled" in kind else {})}

    greedy = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "min_new_tokens": args.max_new_tokens}
    prompts = [(task, torch.tensor([ids])) for task, ids in held_out_ids(tok, args.prompts)]
    t0 = time.perf_counter()
    model.generate(prompts[0][1], max_new_tokens=2, do_sample=False, **fast)  # compiles plain decoding's graph
    for task, ids in prompts if args.entmtp else ():  # and every graph EntMTP's timed calls take: greedy, the
        model.generate(ids, **greedy, **extra("entmtp-compiled", task))  # same steps (a fallback to one token too)
    compile_s = time.perf_counter() - t0
    methods = kinds + list(engines)
    speed = {(task, kind): [] for task in TASKS for kind in methods}
    same = {}
    for r in range(args.rounds):
        for i, (task, ids) in enumerate(prompts):
            outs = {}
            for kind in methods[r % len(methods) :] + methods[: r % len(methods)]:  # who goes first rotates
                if kind in engines:
                    speed[task, kind].append(tokens_per_s(engines[kind], ids[0].tolist(), args.max_new_tokens))
                    continue
                t0 = time.perf_counter()
                with applied_kernels(model) if kind == "compiled-kernels" else nullcontext():
                    outs[kind] = model.generate(ids, **greedy, **extra(kind, task))[0, ids.shape[1] :]
                speed[task, kind].append(len(outs[kind]) / (time.perf_counter() - t0))
            checks = (("compiled", "eager"), ("compiled-kernels", "eager"), ("entmtp", "eager"))
            own_plain = "compiled-kernels" if "compiled-kernels" in outs else "compiled"
            for kind, reference in (*checks, ("entmtp-compiled", own_plain)):
                if kind in outs:
                    with torch.no_grad():
                        differ = find_mismatch(outs[reference].tolist(), outs[kind].tolist(), model, ids[0].tolist())
                    same[f"{task}-{i}/{kind}"] = True if differ is None else differ
    median = {(task, kind): statistics.median(v) for (task, kind), v in speed.items()}
    ratios = {
        f"{task}/entmtp-compiled:{other}": round(median[task, "entmtp-compiled"] / median[task, other], 3)
        for task in TASKS
        for other in methods
        if "entmtp-compiled" in methods and other != "entmtp-compiled"
    }
    compiles = compiled_call(model, fast["compile_config"]).compile_seconds
    result = {
        "what": "generate, greedy, tokens/s (median per task over prompts and rounds), eager vs compiled",
        "model": "SmolLM2-135M-Instruct",
        "precision": args.precision,
        "processor": machine_fingerprint(torch.device("cpu"), torch.float32).processor,
        "threads": args.threads,
        "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens,
        "prompts_per_task": args.prompts,
        "rounds": args.rounds,
        "calibrated": args.calibrate,
        "compile_s": round(compile_s, 1),
        "graphs_compiled": [[what, round(s, 1)] for what, s in compiles],
        "gguf": [f.name for f in args.gguf],
        "tokens_per_s": {f"{task}/{kind}": round(v, 2) for (task, kind), v in median.items()},
        "entmtp_compiled_ratios": ratios,
        "identical": same,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
