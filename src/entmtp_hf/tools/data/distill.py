"""Self-distillation: a base model's own greedy answers to math, code and chat prompts.

    python -m entmtp_hf.tools.data.distill --out data/distill [--model gemma-3-270m]

Prompts come from :mod:`entmtp_hf.tools.data.datasets`: GSM8K train (math), standard-library
docstrings (code), Spec-Bench chat rows and prompts the model writes itself (chat: it
plays the user and completes an opener, just before the prompt is answered; see
:class:`SelfPrompts`). Sources take turns window by window, so whatever has finished is
balanced. Every prompt is answered greedily in left-padded batches and one compact JSON
line per prompt is appended to ``OUT/distill-<source>.jsonl``::

    {"source": "math", "prompt_id": "gsm8k-train-12", "prompt_ids": [...], "response_ids": [...]}

``prompt_ids`` is the chat-templated prompt (for a model without a chat template, a base
model, the prompt's completion form: :func:`~entmtp_hf.tools.data.datasets.completion_text`);
``response_ids`` ends with EOS unless the
answer hit ``--max-new-tokens``. Runs resume: prompts already on disk are skipped,
so an interrupted run is restarted with the same command. Progress goes to
``OUT/progress.log``; the disjointness check against the evaluation prompts to
``OUT/disjointness.json``. :func:`distill` is the same run as a function (what
``entmtp-hf build-drafter`` calls), with a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import load_base_model
from . import datasets as D


class Log:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def read_records(path: Path) -> list[dict]:
    """The complete JSON lines of ``path``; a torn last line (killed mid-write) is cut off."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        raw = raw[: raw.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(raw))
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def append_records(path: Path, records: list[dict]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


@torch.inference_mode()
def generate_batch(
    model, prompt_ids: list[list[int]], max_new_tokens: int, pad_id: int, eos_id: int, sample_seed: int | None = None
) -> list[list[int]]:
    """Generate for a batch of token-id prompts (left padded); each answer is cut right
    after its first EOS. Greedy unless ``sample_seed`` is given (then T=0.9, top-p 0.95)."""
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompt_ids):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kwargs = dict(do_sample=False)
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
        kwargs = dict(do_sample=True, temperature=0.9, top_p=0.95, top_k=0)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        **kwargs,
    )
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return answers


def user_turn_ids(tokenizer, opener: str) -> list[int]:
    """A chat whose last turn is the user's, left open after ``opener`` (no end-of-turn),
    so the model continues the user's message."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "\x00"}], add_generation_prompt=False, tokenize=False
    )
    text = chat[: chat.index("\x00")] + opener
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class SelfPrompts:
    """Chat prompts the model writes itself, made on demand just before they are answered.

    For each opener of :func:`entmtp_hf.tools.data.datasets.user_openers` the model plays the
    user and continues the opener (sampled: T=0.9, top-p 0.95, at most 64 tokens; the seed of a
    batch is ``seed + crc32(first prompt id)``). Results go to ``OUT/questions.jsonl``
    (``question`` is null when unusable) and are reused on resume. A question is dropped
    when it is empty, repeats an earlier question of the file (normalised), or hits an
    evaluation prompt; the counts go to ``disjointness.json`` under ``chat:self-written``.
    """

    def __init__(self, model, tok, out: Path, index: D.EvalIndex, batch_size: int, seed: int, log: Log, report: dict):
        self.model, self.tok, self.index, self.log = model, tok, index, log
        self.path, self.report_path = out / "questions.jsonl", out / "disjointness.json"
        self.batch_size, self.seed, self.report = batch_size, seed, report
        self.questions: dict[str, str | None] = {}
        self.owner: dict[str, str] = {}  # normalised question -> first prompt id with it
        for r in read_records(self.path):
            self._add(r["prompt_id"], r["question"])

    def _add(self, prompt_id: str, question: str | None) -> None:
        self.questions[prompt_id] = question
        if question:
            self.owner.setdefault(D.normalize(question), prompt_id)

    def ensure(self, openers: list[D.Prompt]) -> None:
        """Write the questions of ``openers`` that are not on disk yet."""
        missing = [p for p in openers if p.prompt_id not in self.questions]
        for b in range(0, len(missing), self.batch_size):
            batch = missing[b : b + self.batch_size]
            t0 = time.perf_counter()
            seed = self.seed + zlib.crc32(batch[0].prompt_id.encode())
            answers = generate_batch(
                self.model,
                [user_turn_ids(self.tok, p.text) for p in batch],
                64,
                self.tok.pad_token_id,
                self.tok.eos_token_id,
                sample_seed=seed,
            )
            recs = [
                {
                    "prompt_id": p.prompt_id,
                    "question": D.complete_opener(p.text, self.tok.decode(a, skip_special_tokens=True)),
                }
                for p, a in zip(batch, answers)
            ]
            append_records(self.path, recs)
            for r in recs:
                self._add(r["prompt_id"], r["question"])
            rate = sum(map(len, answers)) / (time.perf_counter() - t0)
            self.log(f"questions written: {len(self.questions)}  {rate:.0f} tok/s")
        self._write_report()

    def resolve(self, opener: D.Prompt) -> D.Prompt | None:
        """The chat prompt written for ``opener``, or ``None`` when it was dropped."""
        q = self.questions[opener.prompt_id]
        if not q or self.owner[D.normalize(q)] != opener.prompt_id or self.index.hit(q):
            return None
        return D.Prompt("chat", opener.prompt_id, q)

    def _write_report(self) -> None:
        written = [(pid, q) for pid, q in self.questions.items()]
        hits = [q for _, q in written if q and self.index.hit(q)]
        self.report["chat:self-written"] = {
            "written": len(written),
            "empty_or_unusable": sum(q is None for _, q in written),
            "duplicates": sum(1 for pid, q in written if q and self.owner[D.normalize(q)] != pid),
            "eval_hits": len(hits),
            "examples": [h[:120] for h in hits[:3]],
        }
        self.report_path.write_text(json.dumps(self.report, indent=1) + "\n")


SOURCES = ("math", "code", "chat")


def check_sources(sources: tuple[str, ...]) -> None:
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown or not sources:
        raise ValueError(f"unknown or no prompt sources {unknown or list(sources)}: choose from {list(SOURCES)}")


def source_pools(sources: tuple[str, ...], entry_points: list[str]) -> dict[str, list[D.Prompt]]:
    """The prompt pools of ``sources`` (math: GSM8K train, code: stdlib docstrings without
    HumanEval's entry points, chat: Spec-Bench chat rows), before the disjointness check."""
    check_sources(sources)
    make = {
        "math": D.gsm8k_train_prompts,
        "chat": D.spec_bench_chat_prompts,
        "code": lambda: D.stdlib_code_prompts(exclude_names=entry_points),
    }
    return {name: make[name]() for name in SOURCES if name in sources}


def build_pool(
    out: Path,
    log: Log,
    window: int,
    seed: int,
    self_openers: bool,
    *,
    sources: tuple[str, ...] = SOURCES,
    question_rounds: int = 1,
):
    """All prompts of ``sources`` interleaved by source, the evaluation index and the
    disjointness report.

    Self-written chat prompts (``question_rounds`` rounds of openers; with ``chat`` among the
    sources) enter as their openers (ids ``self-...``); their text is written and checked
    later, by :class:`SelfPrompts`."""
    index = D.EvalIndex(D.evaluation_texts())
    pools = source_pools(sources, [p["entry_point"] for p in D.humaneval_problems()])
    spec = D.read_jsonl(D.SPEC_BENCH)
    report = D.disjointness_report(
        {
            **{k: [p.text for p in v] for k, v in pools.items()},
            "excluded:spec_bench_math_reasoning": [r["turns"][0] for r in spec if r["category"] == "math_reasoning"],
        },
        index,
    )
    kept = {k: D.drop_overlapping(v, index) for k, v in pools.items()}
    report["kept"] = {k: len(v) for k, v in kept.items()}
    if self_openers and "chat" in kept:
        openers = D.user_openers(question_rounds)
        kept["chat"] += openers
        report["kept"]["chat:self-written openers"] = len(openers)
    report["environment"] = D.environment()
    path = out / "disjointness.json"
    if path.exists():  # a run over some sources keeps the earlier checks of the others
        earlier, others = json.loads(path.read_text()), set(SOURCES) - set(sources)

        def of_others(entries: dict) -> dict:  # keys are "<source>" or "<source>:<detail>"
            return {k: v for k, v in entries.items() if k.split(":")[0] in others}

        report = {**of_others(earlier), **report}
        report["kept"] = {**of_others(earlier.get("kept", {})), **report["kept"]}
    path.write_text(json.dumps(report, indent=1) + "\n")
    log(f"pool sizes after the disjointness check: {report['kept']}")
    return D.interleave(kept, window, seed), index, report


@dataclass
class DistillConfig:
    """One distillation run (what :func:`distill` and ``python -m entmtp_hf.tools.data.distill`` take)."""

    out: Path
    model: str | None = None  # a demo model's name, a Hub id or a folder; None: the default demo model
    batch_size: int = 48
    window: int = 1
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    limit: int | None = None
    self_questions: bool = True
    sources: tuple[str, ...] = SOURCES
    question_rounds: int = 1
    seed: int = 1234
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.out, self.sources = Path(self.out), tuple(self.sources)
        check_sources(self.sources)
        if self.question_rounds < 1:
            raise ValueError(f"question_rounds must be >= 1, got {self.question_rounds}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


def distill(cfg: DistillConfig, model=None, tok=None, *, deadline: float | None = None, progress: bool = True) -> dict:
    """Answer the pool's prompts (resuming what ``cfg.out`` holds) until done, or until
    ``time.perf_counter()`` passes ``deadline`` (checked after each batch, whose lines are on
    disk by then). ``model``/``tok``: an already loaded model (else ``cfg.model`` is loaded in
    ``cfg.dtype``). A tokenizer without a chat template (a base model's) gets every prompt in
    completion form (:func:`~entmtp_hf.tools.data.datasets.completion_text`) and no
    self-written questions (they need a user turn). Returns what was done."""
    from tqdm.auto import tqdm

    cfg.out.mkdir(parents=True, exist_ok=True)
    log = Log(cfg.out / "progress.log")
    if model is None:
        model, tok = load_base_model(model_id=cfg.model, dtype=getattr(torch, cfg.dtype))
    chat = D.has_chat_template(tok)
    log(
        f"answering in {next(model.parameters()).dtype}, batches of {cfg.batch_size}, "
        f"{'chat template' if chat else 'completion prompts (no chat template)'}"
    )
    window = cfg.window * cfg.batch_size
    order, index, report = build_pool(
        cfg.out,
        log,
        window,
        cfg.seed,
        cfg.self_questions and chat,
        sources=cfg.sources,
        question_rounds=cfg.question_rounds,
    )
    order = order[: cfg.limit]
    selfs = SelfPrompts(model, tok, cfg.out, index, cfg.batch_size, cfg.seed, log, report)

    done: set[tuple[str, str]] = set()
    for path in sorted(cfg.out.glob("distill-*.jsonl")):
        done.update((r["source"], r["prompt_id"]) for r in read_records(path))
    todo = [p for p in order if (p.source, p.prompt_id) not in done]
    log(f"start: {len(order)} prompts, {len(order) - len(todo)} already done, {len(todo)} to go")

    t_start, n_tok, n_done, stopped = time.perf_counter(), 0, 0, False
    bar = tqdm(total=len(order), initial=len(order) - len(todo), desc="distill", unit="prompt", disable=not progress)
    for w in range(0, len(todo), window):
        if stopped:
            break
        # A window holds one source (interleave() takes `window` prompts per source).
        prompts = todo[w : w + window]
        is_self = [p.prompt_id.startswith("self-") for p in prompts]
        selfs.ensure([p for p, s in zip(prompts, is_self) if s])
        prompts = [selfs.resolve(p) if s else p for p, s in zip(prompts, is_self)]
        skipped = sum(p is None for p in prompts)
        chunk = [(p, D.render_prompt(tok, p)) for p in prompts if p is not None]
        skipped += sum(len(ids) > cfg.max_prompt_tokens for _, ids in chunk)
        n_done += skipped
        bar.update(skipped)
        chunk = sorted((c for c in chunk if len(c[1]) <= cfg.max_prompt_tokens), key=lambda c: len(c[1]))
        for b in range(0, len(chunk), cfg.batch_size):
            batch = chunk[b : b + cfg.batch_size]
            answers = generate_batch(
                model, [ids for _, ids in batch], cfg.max_new_tokens, tok.pad_token_id, tok.eos_token_id
            )
            recs = [
                {"source": p.source, "prompt_id": p.prompt_id, "prompt_ids": ids, "response_ids": a}
                for (p, ids), a in zip(batch, answers)
            ]
            by_source: dict[str, list[dict]] = {}
            for r in recs:
                by_source.setdefault(r["source"], []).append(r)
            for source, rs in by_source.items():
                append_records(cfg.out / f"distill-{source}.jsonl", rs)
            n_done += len(batch)
            n_tok += sum(map(len, answers))
            bar.update(len(batch))
            rate = n_tok / (time.perf_counter() - t_start)
            left = len(todo) - n_done
            eta_h = left * (n_tok / n_done) / rate / 3600
            log(
                f"{batch[0][0].source:4s} prompts {len(order) - left}/{len(order)}  "
                f"tokens {n_tok} this run  {rate:.0f} tok/s  ETA {eta_h:.1f} h"
            )
            if deadline is not None and time.perf_counter() > deadline and left > 0:
                log(f"stopping at the deadline: {left} prompts left (run again to continue)")
                stopped = True
                break
    bar.close()
    if not stopped:
        log("done")
    return {"prompts": len(order), "answered_this_run": n_done, "tokens_this_run": n_tok, "complete": not stopped}


def main(argv: list[str] | None = None) -> int:
    """``python -m entmtp_hf.tools.data.distill``: a bad input is one line and exit status 2, as in ``entmtp-hf``."""
    from ..reporting import LOCAL_OR_HUB, check_input, report_errors

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (resumed if present)")
    ap.add_argument(
        "--model",
        default=None,
        help="base model: a demo model's name (gemma-3-270m), a Hub id or a folder; default: the "
        "demo model SmolLM2-135M-Instruct. Without a chat template the prompts go in completion form",
    )
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument(
        "--window", type=int, default=1, help="batches per source in turn; prompts are length-sorted inside a window"
    )
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are skipped")
    ap.add_argument("--limit", type=int, default=None, help="stop after this many prompts (tests)")
    ap.add_argument(
        "--no-self-questions", action="store_true", help="leave out the chat prompts the model writes itself"
    )
    ap.add_argument(
        "--sources", default=",".join(SOURCES), help="comma-separated prompt sources to answer (math, code, chat)"
    )
    ap.add_argument(
        "--question-rounds",
        type=int,
        default=1,
        help="rounds of self-written chat questions: each round completes every opener "
        "again with another seed (more chat prompts; earlier rounds are kept)",
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="bfloat16 generates faster on CPUs with AMX; the answers are data "
        "for the heads, whose targets are recomputed in float32 at training time",
    )
    args = ap.parse_args(argv)
    sources = tuple(x.strip() for x in args.sources.split(",") if x.strip())
    try:  # before the model loads
        check_sources(sources)
    except ValueError as e:
        ap.error(f"--sources {args.sources!r}: {e}")
    if args.question_rounds < 1:
        ap.error(f"--question-rounds must be >= 1, got {args.question_rounds}")
    torch.set_num_threads(args.threads)

    def run() -> int:
        if args.model is not None:
            check_input("--model", args.model, LOCAL_OR_HUB)
        distill(
            DistillConfig(
                args.out,
                args.model,
                args.batch_size,
                args.window,
                args.max_new_tokens,
                args.max_prompt_tokens,
                args.limit,
                not args.no_self_questions,
                sources,
                args.question_rounds,
                args.seed,
                args.dtype,
            )
        )
        return 0

    return report_errors("entmtp_hf.tools.data.distill", run)


if __name__ == "__main__":
    raise SystemExit(main())
