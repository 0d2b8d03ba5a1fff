"""llama.cpp's plain decoding of the demo model: the CPU user's yardstick, on the prompts of compile_generate.py.

GGUF files of the demo model's own weights (``convert_hf_to_gguf.py MODEL --outtype f32|bf16|q8_0`` of the
llama.cpp release that ``llama-cpp-python`` vendors; the demo model's folder is
``entmtp_hf.tools.models.demo_model_dir()``) are timed per held-out prompt (the first ``--prompts`` of each
``data/prompts/unseen-*.jsonl``, the Hugging Face chat template's token ids, exactly what
``scripts/compile_generate.py`` feeds ``generate``): greedy (``top_k=1``), ``--max-new-tokens`` tokens, prompt
evaluation included, the files rotated per round. Prints and saves (``--out``) the median tokens/s per file
and task. Needs ``pip install llama-cpp-python`` (it builds llama.cpp from source: minutes).

    python scripts/llamacpp_baseline.py smollm2-f32.gguf smollm2-bf16.gguf smollm2-q8_0.gguf --out runs/llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from compile_generate import TASKS, held_out_ids  # the same prompts and token ids

from entmtp_hf.tools.checkpoint import write_json
from entmtp_hf.tools.models import DEFAULT_DEMO, demo_model_dir


def load(files: list[str], threads: int) -> dict:
    """llama.cpp models of ``files``, by file: ``threads`` threads for prompt and decoding, 1024 positions."""
    from llama_cpp import Llama

    return {
        f: Llama(model_path=f, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False) for f in files
    }


def tokens_per_s(llm, ids: list[int], max_new_tokens: int) -> float:
    """llama.cpp's greedy decoding of ``max_new_tokens`` after the prompt ``ids`` (evaluated in the time)."""
    t0, n = time.perf_counter(), 0
    for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        n += 1
        if n == max_new_tokens:
            break
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="+", type=Path, help="GGUF files of the demo model")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from llama_cpp import __version__
    from transformers import AutoTokenizer

    prompts = held_out_ids(AutoTokenizer.from_pretrained(demo_model_dir(None, DEFAULT_DEMO)), args.prompts)
    files = [str(f) for f in args.gguf]
    models = load(files, args.threads)
    speed = {(f, task): [] for f in files for task in TASKS}
    for r in range(args.rounds):
        for task, ids in prompts:
            for f in files[r % len(files) :] + files[: r % len(files)]:
                speed[f, task].append(tokens_per_s(models[f], ids, args.max_new_tokens))
    result = {
        "what": "llama.cpp plain decoding, greedy (top_k=1), tokens/s, median per file and task, prompt included",
        "llama_cpp_python": __version__,
        "threads": args.threads,
        "prompts_per_task": args.prompts,
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": {f"{Path(f).stem}/{task}": round(statistics.median(v), 2) for (f, task), v in speed.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
