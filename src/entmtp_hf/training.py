"""Training draft heads by distillation from the frozen base model (``entmtp-hf train-heads``).

Recipe (docs/training.md has the commands and the measured numbers):

1. **Data.** Token sequences from the self-distilled records of :mod:`entmtp_hf.distill`
   (chat-templated prompt + the base model's greedy response; rows are supervised from the
   last prompt position on, where drafting starts) and real text from :mod:`entmtp_hf.data`
   (GSM8K *train* question/answer chats, Python standard-library source). No evaluation
   text: no HumanEval, GSM8K test or MT-Bench; stdlib chunks sharing a 13-gram with an
   evaluation prompt are dropped. Documents go to a held-out split by a hash of their id.
2. **Teacher cache.** One pass of the base model writes every position's last hidden state
   h_t (after the final norm, so ``lm_head(h_t)`` are the logits) as float16 and its greedy
   token argmax(logits_t) into memmaps under ``WORK/data`` (resumable, by batch).
3. **Drafting vocabulary.** The K most frequent greedy tokens of the training split.
4. **Loss.** Head i at row t drafts token t+i+2, so its teacher is the base distribution at
   position t+i+1: p_i,t = softmax(W' h_{t+i+1}) with W' the base LM head rows of the
   drafting vocabulary (the full distribution renormalised over it). Loss per head is
   KL(p || q) averaged over supervised rows (+ ``ce_weight`` x CE on argmax p); heads are
   weighted ``head_decay**i``.
5. **Training** with :class:`accelerate.Accelerator` (the same code runs under
   ``accelerate launch``): AdamW, warm-up + cosine/linear decay, gradient clipping,
   checkpoints (heads, optimiser, scheduler, data cursor, RNG) every ``save_every`` steps.
   ``--resume`` continues from the newest checkpoint; an epoch's batch order is a pure
   function of (seed, epoch), so a resumed run is identical to an uninterrupted one.

The data set is a snapshot taken when ``WORK/data`` is first built (the distilled files and
their line counts are listed in ``WORK/data/manifest.json``); to train on newer distilled
records, point ``--work-dir`` at a fresh folder.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .heads import HEADS_REGISTRY, DraftHeads

DEMO_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOURCES = ("distill", "gsm8k", "stdlib")
SPLIT_TRAIN, SPLIT_VAL = 0, 1


# ============================================================================ config
@dataclass
class TrainConfig:
    """Everything a heads-training run depends on (saved with every checkpoint)."""

    model: str | None = field(default=None, metadata={"help": "base model id/folder; None = demo model"})
    family: str = "hydra"
    arch: str = "mlp"
    num_heads: int = 4
    num_layers: int = 1
    draft_vocab_size: int = 8192
    work_dir: str = "runs/heads"
    run_name: str | None = None
    output: str | None = None
    init_from: str | None = None
    distill_dir: str | None = "data/distill"
    sources: tuple[str, ...] = SOURCES
    max_tokens: int = 600_000
    distill_share: float = 0.6
    val_fraction: float = 0.04
    max_seq_len: int = 512
    batch_tokens: int = 2048
    extract_batch_tokens: int = 4096
    epochs: int = 2
    max_steps: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    ce_weight: float = 0.0
    head_decay: float = 0.8
    mixed_precision: str = "no"
    save_every: int = 50
    eval_every: int = 200
    keep_checkpoints: int = 2
    save_dtype: str = "float16"
    seed: int = 0
    tau_prompts: int = 6
    tau_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.family not in HEADS_REGISTRY:
            raise ValueError(f"family must be one of {sorted(HEADS_REGISTRY)}, got {self.family!r}")
        if self.schedule not in ("cosine", "linear"):
            raise ValueError(f"schedule must be 'cosine' or 'linear', got {self.schedule!r}")
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"save_dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}")
        bad = set(self.sources) - set(SOURCES)
        if bad:
            raise ValueError(f"unknown data sources {sorted(bad)}; choose from {SOURCES}")
        if self.num_heads < 1 or self.batch_tokens < self.max_seq_len or self.draft_vocab_size < 1:
            raise ValueError("need num_heads >= 1, batch_tokens >= max_seq_len and draft_vocab_size >= 1")
        self.sources = tuple(self.sources)
        self.run_name = self.run_name or f"{self.family}-{self.arch}"


# ============================================================================ data
@dataclass(frozen=True)
class TokenSeq:
    """One training document: token ids, first supervised row, split (0 train, 1 val)."""

    source: str
    ids: tuple[int, ...]
    start: int = 0
    split: int = SPLIT_TRAIN


def held_out(key: str, fraction: float, seed: int) -> bool:
    """Stable split by document id: the same document lands in the same split every time."""
    return zlib.crc32(f"{seed}:{key}".encode()) % 10_000 < fraction * 10_000


def cut(seq: TokenSeq, max_len: int) -> list[TokenSeq]:
    """Pieces of at most ``max_len`` tokens, each keeping the rows still to be supervised."""
    pieces = []
    for lo in range(0, len(seq.ids), max_len):
        ids, start = seq.ids[lo : lo + max_len], max(0, seq.start - lo)
        if len(ids) - 1 > start:  # at least one supervised row with a next position
            pieces.append(TokenSeq(seq.source, ids, start, seq.split))
    return pieces


def read_distill(distill_dir: str | Path) -> tuple[list[tuple[str, dict]], dict[str, int]]:
    """Complete records of ``distill-*.jsonl`` (a torn last line is ignored) and line counts."""
    records, snapshot = [], {}
    for path in sorted(Path(distill_dir).glob("distill-*.jsonl")):
        raw = path.read_bytes()
        lines = [ln for ln in raw[: raw.rfind(b"\n") + 1].decode().splitlines() if ln.strip()]
        snapshot[path.name] = len(lines)
        records += [(f"{path.name}:{i}", json.loads(ln)) for i, ln in enumerate(lines)]
    return records, snapshot


def system_prefix_len(tokenizer) -> int:
    """Tokens shared by every chat (the template's system preamble): not supervised."""
    if not getattr(tokenizer, "chat_template", None):
        return 0
    a, b = (tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False) for c in ("x y", "1 2"))
    ia, ib = tokenizer(a, add_special_tokens=False)["input_ids"], tokenizer(b, add_special_tokens=False)["input_ids"]
    return next((i for i, (p, q) in enumerate(zip(ia, ib)) if p != q), min(len(ia), len(ib)))


def _take(items: Iterable[TokenSeq], budget: int) -> list[TokenSeq]:
    out, total = [], 0
    for s in items:
        if total >= budget:
            break
        out.append(s)
        total += len(s.ids)
    return out


def build_sequences(tokenizer, cfg: TrainConfig, log=print) -> tuple[list[TokenSeq], dict]:
    """The run's documents under the token budget, and a manifest describing them."""
    from . import data as D

    rng = np.random.default_rng(cfg.seed)
    vf, budget = cfg.val_fraction, cfg.max_tokens
    pools: dict[str, list[TokenSeq]] = {}
    manifest: dict[str, Any] = {"sources": {}, "excluded": "HumanEval, GSM8K test, MT-Bench (never read)"}
    if "distill" in cfg.sources and cfg.distill_dir and Path(cfg.distill_dir).is_dir():
        records, manifest["distill_snapshot"] = read_distill(cfg.distill_dir)
        seqs = [TokenSeq("distill", tuple(r["prompt_ids"] + r["response_ids"]), len(r["prompt_ids"]) - 1,
                         int(held_out(f"{r['source']}:{r['prompt_id']}", vf, cfg.seed))) for _, r in records]
        pools["distill"] = [seqs[i] for i in rng.permutation(len(seqs))]
    sys_len = system_prefix_len(tokenizer)
    if "gsm8k" in cfg.sources:
        chats = D.gsm8k_train_chats(tokenizer)  # GSM8K *train* only
        seqs = [TokenSeq("gsm8k", tuple(tokenizer(c, add_special_tokens=False)["input_ids"]), sys_len,
                         int(held_out(f"gsm8k-train-{i}", vf, cfg.seed))) for i, c in enumerate(chats)]
        pools["gsm8k"] = [seqs[i] for i in rng.permutation(len(seqs))]
    if "stdlib" in cfg.sources:
        index = D.EvalIndex(D.evaluation_texts())
        chunks = list(D.stdlib_source_chunks(max_chars=3 * cfg.max_seq_len))
        kept = [(i, c) for i, c in enumerate(chunks) if index.hit(c) is None]
        manifest["stdlib_dropped_for_eval_overlap"] = len(chunks) - len(kept)
        order = rng.permutation(len(kept))
        pools["stdlib"] = [TokenSeq("stdlib", tuple(tokenizer(kept[k][1], add_special_tokens=False)["input_ids"]), 0,
                                    int(held_out(f"stdlib-{kept[k][0]}", vf, cfg.seed))) for k in order[:20_000]]
    n_distill = sum(len(s.ids) for s in pools.get("distill", []))
    share = {"distill": min(n_distill, int(cfg.distill_share * budget))} if "distill" in pools else {}
    others = [s for s in pools if s != "distill"]
    for s in others:
        share[s] = (budget - share.get("distill", 0)) // max(len(others), 1)
    out: list[TokenSeq] = []
    for name, pool in pools.items():
        for split, frac in ((SPLIT_TRAIN, 1 - vf), (SPLIT_VAL, vf)):
            docs = _take((s for s in pool if s.split == split), int(share[name] * frac))
            pieces = [p for d in docs for p in cut(d, cfg.max_seq_len)]
            out += pieces
            manifest["sources"].setdefault(name, {})[("train", "val")[split]] = {
                "documents": len(docs), "sequences": len(pieces), "tokens": sum(len(p.ids) for p in pieces)}
    manifest["total_tokens"] = sum(len(s.ids) for s in out)
    log(f"data: {json.dumps(manifest['sources'])}")
    return out, manifest


class TeacherCache:
    """Token ids, hidden states (float16) and greedy tokens of every sequence, as memmaps.

    ``seqs`` rows are (offset, length, start, split, source index); position p of sequence k
    lives at row offset+p of ``tokens``, ``hidden`` [total, H] and ``greedy``.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        meta = json.loads((self.root / "manifest.json").read_text())
        self.manifest, self.hidden_size, total = meta, meta["hidden_size"], meta["total_tokens"]
        self.seqs = np.load(self.root / "seqs.npy")
        self.tokens = np.memmap(self.root / "tokens.i32", dtype=np.int32, mode="r", shape=(total,))
        self.hidden = np.memmap(self.root / "hidden.f16", dtype=np.float16, mode="r+", shape=(total, self.hidden_size))
        self.greedy = np.memmap(self.root / "greedy.i32", dtype=np.int32, mode="r+", shape=(total,))

    @staticmethod
    def create(root: str | Path, seqs: Sequence[TokenSeq], hidden_size: int, manifest: dict) -> "TeacherCache":
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        lengths = np.array([len(s.ids) for s in seqs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        total = int(lengths.sum())
        src = {name: i for i, name in enumerate(SOURCES)}
        rows = [(o, n, s.start, s.split, src[s.source]) for o, n, s in zip(offsets, lengths, seqs)]
        np.save(root / "seqs.npy", np.array(rows, dtype=np.int64).reshape(-1, 5))
        np.fromiter((t for s in seqs for t in s.ids), dtype=np.int32, count=total).tofile(root / "tokens.i32")
        np.memmap(root / "hidden.f16", dtype=np.float16, mode="w+", shape=(total, hidden_size)).flush()
        np.memmap(root / "greedy.i32", dtype=np.int32, mode="w+", shape=(total,)).flush()
        meta = {**manifest, "hidden_size": hidden_size, "total_tokens": total, "num_sequences": len(seqs)}
        (root / "manifest.json").write_text(json.dumps(meta, indent=1))  # written last: marks a complete layout
        return TeacherCache(root)

    def ids(self, k: int) -> np.ndarray:
        o, n = self.seqs[k, :2]
        return self.tokens[o : o + n]

    def extraction_batches(self) -> tuple[list[list[int]], list[int], int]:
        """Extraction batches (length-sorted, packed), indices of those done, batch size used."""
        path = self.root / "extract.json"
        state = json.loads(path.read_text()) if path.exists() else {}
        size = state.get("batch_tokens", 4096)
        lengths = self.seqs[:, 1]
        batches = pack(np.argsort(lengths, kind="stable"), lengths, size)
        if state and state.get("of", len(batches)) != len(batches):
            raise ValueError(f"{path}: extraction used another batch layout ({state['of']} batches, not {len(batches)})")
        done = state.get("done", list(range(state.get("batches", 0))))  # older files: a prefix count
        return batches, done, size

    @property
    def ready(self) -> np.ndarray:
        """Mask of sequences whose hidden states are extracted."""
        batches, done, _ = self.extraction_batches()
        mask = np.zeros(len(self.seqs), bool)
        mask[[k for b in done for k in batches[b]]] = True
        return mask

    @property
    def complete(self) -> bool:
        batches, done, _ = self.extraction_batches()
        return len(done) >= len(batches)

    def restrict(self, indices: np.ndarray) -> None:
        """Use only these sequences from now on (a run's data snapshot)."""
        mask = np.zeros(len(self.seqs), bool)
        mask[indices] = True
        if not self.ready[mask].all():
            raise ValueError(f"{self.root}: the run's data snapshot names sequences that are not extracted")
        self._subset = mask

    def split(self, split: int) -> np.ndarray:
        """Extracted sequences of a split (within the run's snapshot, if restricted)."""
        subset = getattr(self, "_subset", None)
        return np.nonzero((self.seqs[:, 3] == split) & (self.ready if subset is None else subset))[0]

    def batch(self, ks: Sequence[int]) -> dict[str, Tensor]:
        """Right-padded tensors of sequences ``ks``: ids, hidden (float32), greedy, valid/supervised masks."""
        lens = self.seqs[ks, 1]
        b, t = len(ks), int(lens.max())
        ids, greedy = np.zeros((b, t), np.int64), np.zeros((b, t), np.int64)
        hidden = np.zeros((b, t, self.hidden_size), np.float32)
        pos = np.arange(t)[None]
        for r, k in enumerate(ks):
            o, n = self.seqs[k, :2]
            ids[r, :n], greedy[r, :n], hidden[r, :n] = self.tokens[o : o + n], self.greedy[o : o + n], self.hidden[o : o + n]
        valid = pos < lens[:, None]
        sup = valid & (pos >= self.seqs[ks, 2][:, None])
        return {"ids": torch.from_numpy(ids), "hidden": torch.from_numpy(hidden), "greedy": torch.from_numpy(greedy),
                "valid": torch.from_numpy(valid), "sup": torch.from_numpy(sup)}


def pack(order: Sequence[int], lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Consecutive sequences of ``order`` grouped so that (rows x longest) <= batch_tokens."""
    batches, cur, longest = [], [], 0
    for k in order:
        n = int(lengths[k])
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(int(k))
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


def epoch_batches(ks: np.ndarray, lengths: np.ndarray, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """An epoch's batches: a pure function of (seed, epoch); lengths are grouped to limit padding."""
    rng = np.random.default_rng([seed, epoch])
    perm = ks[rng.permutation(len(ks))]
    window = 64
    grouped = [k for w in range(0, len(perm), window) for k in sorted(perm[w : w + window], key=lambda k: lengths[k])]
    batches = pack(grouped, lengths, batch_tokens)
    return [batches[i] for i in rng.permutation(len(batches))]


def extraction_order(n: int) -> list[int]:
    """Batch order of the extraction: alternately the longest and the shortest remaining
    batch, so a partly extracted cache mixes long (code) and short (chat, math) sequences."""
    lo, hi, out = 0, n - 1, []
    while lo <= hi:
        out.append(hi)
        hi -= 1
        if lo <= hi:
            out.append(lo)
            lo += 1
    return out


@torch.no_grad()
def extract_hidden(model: nn.Module, cache: TeacherCache, batch_tokens: int = 4096, log=print) -> None:
    """Fill ``cache.hidden`` / ``cache.greedy`` with the base model's outputs; resumes by batch.

    Sequences run right-padded in length-sorted batches (:func:`extraction_order`);
    ``extract.json`` lists the finished batches.
    """
    progress = cache.root / "extract.json"
    lengths = cache.seqs[:, 1]
    if progress.exists():  # a resumed extraction keeps its batch layout
        batches, done, batch_tokens = cache.extraction_batches()
    else:
        batches, done = pack(np.argsort(lengths, kind="stable"), lengths, batch_tokens), []
    done_set = set(done)
    todo = [b for b in extraction_order(len(batches)) if b not in done_set]
    if not todo:
        return
    device = next(model.parameters()).device
    t0, n_tok = time.perf_counter(), 0
    log(f"extract: {len(todo)} of {len(batches)} batches to go ({int(lengths.sum())} tokens in all)")
    for j, b in enumerate(todo):
        ks = batches[b]
        lens = lengths[ks]
        ids = np.zeros((len(ks), int(lens.max())), np.int64)
        for r, k in enumerate(ks):
            ids[r, : lens[r]] = cache.ids(k)
        ids_t = torch.from_numpy(ids).to(device)
        mask = (torch.arange(ids.shape[1])[None] < torch.from_numpy(lens)[:, None]).long().to(device)
        out = model(input_ids=ids_t, attention_mask=mask, output_hidden_states=-1, use_cache=False)
        h, greedy = out.hidden_states[-1].float().cpu().numpy(), out.logits.argmax(-1).cpu().numpy()
        for r, k in enumerate(ks):
            o, n = cache.seqs[k, :2]
            cache.hidden[o : o + n], cache.greedy[o : o + n] = h[r, :n], greedy[r, :n]
        cache.hidden.flush()
        cache.greedy.flush()
        done.append(b)
        n_tok += int(lens.sum())
        _write_json(progress, {"done": done, "of": len(batches), "batch_tokens": batch_tokens,
                               "tokens": int(lengths[[k for d in done for k in batches[d]]].sum())})
        if (j + 1) % 10 == 0 or j + 1 == len(todo):
            log(f"extract: {len(done)}/{len(batches)} batches  {n_tok / (time.perf_counter() - t0):.0f} tokens/s")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def prepare_teacher_cache(model, tokenizer, cfg: TrainConfig, log=print, extract: bool = True) -> TeacherCache:
    """Build (once) and fill (resumably; ``extract=False``: as far as it got) ``WORK/data``."""
    root = Path(cfg.work_dir) / "data"
    if not (root / "manifest.json").exists():
        seqs, manifest = build_sequences(tokenizer, cfg, log)
        manifest["built_with"] = {k: getattr(cfg, k) for k in ("model", "max_tokens", "distill_share", "val_fraction",
                                                                "max_seq_len", "seed", "sources")}
        TeacherCache.create(root, seqs, model.config.get_text_config().hidden_size, manifest)
    cache = TeacherCache(root)
    if extract:
        extract_hidden(model, cache, cfg.extract_batch_tokens, log)
    elif not cache.complete:
        log(f"using the partly extracted cache: {int(cache.seqs[cache.ready, 1].sum())} of "
            f"{int(cache.seqs[:, 1].sum())} tokens")
    return cache


# ============================================================================ vocabulary
def draft_vocabulary(tokens: Tensor | np.ndarray, k: int, vocab_size: int) -> Tensor:
    """The ``k`` most frequent ids of ``tokens`` (ties: smaller id), padded with the
    smallest unused ids when fewer than ``k`` distinct ids occur. Returned in frequency order."""
    counts = torch.bincount(torch.as_tensor(np.asarray(tokens)).long().reshape(-1), minlength=vocab_size)
    k = min(k, vocab_size)
    # stable sort on -count keeps equal counts in id order
    return torch.sort(-counts[:vocab_size], stable=True).indices[:k].clone()


def coverage(vocab: Tensor, tokens: Tensor | np.ndarray) -> float:
    """Fraction of ``tokens`` that lie in ``vocab``."""
    t = torch.as_tensor(np.asarray(tokens)).long().reshape(-1)
    return float(torch.isin(t, vocab).float().mean()) if t.numel() else float("nan")


def supervised_tokens(cache: TeacherCache, split: int) -> np.ndarray:
    """Greedy tokens at the supervised positions of a split (what heads will be asked for)."""
    parts = [cache.greedy[o + s : o + n] for o, n, s, _, _ in cache.seqs[cache.split(split)]]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


# ============================================================================ loss
def teacher_logprobs(hidden: Tensor, lm_weight: Tensor, lm_bias: Tensor | None = None) -> Tensor:
    """log softmax of the base logits restricted to the drafting vocabulary: [B, T, V']."""
    return torch.log_softmax(F.linear(hidden.float(), lm_weight.float(),
                                      None if lm_bias is None else lm_bias.float()), dim=-1)


def head_targets(teacher_logp: Tensor, sup: Tensor, valid: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """Teacher of head i: row t <-> position t+i+1 ([B, T-i-1, V']), and the row mask."""
    n = teacher_logp.shape[1] - i - 1
    return teacher_logp[:, i + 1 :], sup[:, :n] & valid[:, i + 1 :]


def distill_loss(student: list[Tensor], teacher_logp: Tensor, sup: Tensor, valid: Tensor,
                 ce_weight: float = 0.0, head_decay: float = 1.0) -> tuple[Tensor, list[float]]:
    """Weighted mean over heads of KL(teacher || student) (+ CE on the teacher argmax)."""
    losses, weights = [], []
    for i, logits in enumerate(student):
        target, rows = head_targets(teacher_logp, sup, valid, i)
        if not rows.any():
            continue
        t, q = target[rows], torch.log_softmax(logits[rows].float(), dim=-1)
        loss = (t.exp() * (t - q)).sum(-1).mean()
        if ce_weight:
            loss = (1 - ce_weight) * loss + ce_weight * F.nll_loss(q, t.argmax(-1))
        losses.append(loss)
        weights.append(head_decay**i)
    if not losses:
        zero = sum(s.sum() for s in student) * 0.0
        return zero, []
    total = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
    return total, [l.item() for l in losses]


class HeadsObjective(nn.Module):
    """Heads + the frozen base embeddings and LM head; ``forward(batch)`` returns the loss.

    One module so that ``accelerator.prepare`` (DDP) sees the training forward.
    """

    def __init__(self, heads: DraftHeads, embed: nn.Module, lm_head: nn.Module, ce_weight: float, head_decay: float):
        super().__init__()
        self.heads, self.embed, self.lm_head = heads, embed, lm_head
        self.embed.requires_grad_(False)
        self.lm_head.requires_grad_(False)
        self.ce_weight, self.head_decay = ce_weight, head_decay

    def forward(self, ids: Tensor, hidden: Tensor, valid: Tensor, sup: Tensor, **_: Tensor) -> tuple[Tensor, list[float]]:
        student = self.heads.forward_train(hidden, ids, self.embed, self.lm_head)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):  # teacher in float32
            w, b = self.heads._base_lm_rows(self.lm_head)
            teacher = teacher_logprobs(hidden, w, b)
        return distill_loss(student, teacher, sup, valid, self.ce_weight, self.head_decay)


# ============================================================================ evaluation
@torch.no_grad()
def evaluate_heads(heads: DraftHeads, embed: nn.Module, lm_head: nn.Module, cache: TeacherCache,
                   batch_tokens: int = 4096, ks: np.ndarray | None = None) -> dict[str, Any]:
    """Per head: top-1 / top-5 agreement with the base greedy token at t+i+2 and mean KL."""
    ks = cache.split(SPLIT_VAL) if ks is None else ks
    n = heads.num_heads
    hit1, hit5, kl, rows_n = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    was_training = heads.training
    heads.eval()
    device = next(heads.parameters()).device
    vocab = heads.draft_vocab.to(device) if heads.draft_vocab is not None else None
    for batch in pack(ks, cache.seqs[:, 1], batch_tokens):
        b = {k: v.to(device) for k, v in cache.batch(batch).items()}
        student = heads.forward_train(b["hidden"], b["ids"], embed, lm_head)
        w, bias = heads._base_lm_rows(lm_head)
        teacher = teacher_logprobs(b["hidden"], w, bias)
        for i, logits in enumerate(student):
            target, rows = head_targets(teacher, b["sup"], b["valid"], i)
            if not rows.any():
                continue
            top = logits[rows].float().topk(min(5, logits.shape[-1]), dim=-1).indices
            top = vocab[top] if vocab is not None else top
            truth = b["greedy"][:, i + 1 :][rows]
            hit1[i] += (top[:, 0] == truth).sum().item()
            hit5[i] += (top == truth[:, None]).any(-1).sum().item()
            t, q = target[rows], torch.log_softmax(logits[rows].float(), dim=-1)
            kl[i] += (t.exp() * (t - q)).sum().item()
            rows_n[i] += rows.sum().item()
    heads.train(was_training)
    d = np.maximum(rows_n, 1)
    return {"top1": (hit1 / d).round(4).tolist(), "top5": (hit5 / d).round(4).tolist(),
            "kl": (kl / d).round(4).tolist(), "rows": rows_n.astype(int).tolist()}


def tau_prompts(cache: TeacherCache, tokenizer, count: int, seed: int, val_fraction: float) -> list[list[int]]:
    """Held-out chat prompts: half from held-out distilled records, the rest held-out GSM8K train questions."""
    from . import data as D

    ks = [k for k in cache.split(SPLIT_VAL) if cache.seqs[k, 4] == SOURCES.index("distill")]
    out = [cache.ids(k)[: cache.seqs[k, 2] + 1].tolist() for k in ks[: (count + 1) // 2]]
    for i, p in enumerate(D.gsm8k_train_prompts()):
        if len(out) >= count:
            break
        if held_out(f"gsm8k-train-{i}", val_fraction, seed):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                                tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@torch.no_grad()
def measure_tau(model, heads: DraftHeads, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                tree: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Mean accepted tokens per step of greedy EntMTP decoding with ``tree`` (default mc_sim_7b_63)."""
    from .config import EntMTPConfig
    from .generation import disable_entmtp, enable_entmtp
    from .tree import MC_SIM_7B_63

    enable_entmtp(model, copy.deepcopy(heads).float())
    steps, accepted, t0 = 0, 0, time.perf_counter()
    try:
        for p in prompts:
            ids = torch.tensor([list(p)], device=next(model.parameters()).device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, return_dict_in_generate=True,
                                 entmtp_config=EntMTPConfig(tree=tree or MC_SIM_7B_63))
            st = out.entmtp_stats
            steps += st["steps"]
            accepted += sum(st["accept_lengths"])
    finally:
        disable_entmtp(model)
    return {"mean_accept_length": accepted / max(steps, 1), "steps": steps, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "seconds": round(time.perf_counter() - t0, 1)}


# ============================================================================ training
def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine or linear decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return min_ratio + (1 - min_ratio) * decay


@torch.no_grad()
def warm_start(heads: DraftHeads, hidden_rms: float = 1.0) -> DraftHeads:
    """Start every head as "base LM head on c_t": zero block linears, identity on the c_t slice
    of Hydra's first-block projection; a prefix layer starts as (scaled) identity."""
    h = heads.config.hidden_size
    for blocks in heads.mlps:
        for block in blocks:
            nn.init.zeros_(block.linear.weight)
            nn.init.zeros_(block.linear.bias)
            res = block.res_connection
            if isinstance(res, nn.Linear):
                res.weight.zero_()
                res.weight[:, :h] = torch.eye(h, dtype=res.weight.dtype, device=res.weight.device)
                res.bias.zero_()
    prefix = getattr(heads, "prefix_embeding_layer", None)
    if prefix is not None:
        layer = prefix.layers[0]
        for name, p in layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        prefix.norm.weight.fill_(hidden_rms)
    return heads


class RunLog:
    """Timestamped lines to stdout and ``path`` (main process only)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@dataclass
class Cursor:
    """Where a run stands: optimiser steps done, epoch, next batch index in that epoch."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0


def checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def save_checkpoint(run: Path, cursor: Cursor, heads: DraftHeads, optimizer, scheduler, cfg: TrainConfig,
                    metrics: dict | None = None) -> Path:
    """Atomically write heads (float32) + optimiser + scheduler + RNG + cursor; keep the newest few."""
    from safetensors.torch import save_file

    final = run / "checkpoints" / f"step-{cursor.step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}, str(tmp / "heads.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
    _write_json(tmp / "state.json", {"cursor": asdict(cursor), "config": asdict(cfg), "metrics": metrics or {}})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(run)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, heads: DraftHeads, optimizer, scheduler, cfg: TrainConfig) -> Cursor:
    """Restore what :func:`save_checkpoint` wrote; refuses a checkpoint of different heads."""
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    old = state["config"]
    for key in ("family", "arch", "num_heads", "num_layers", "draft_vocab_size", "seed", "batch_tokens"):
        if old[key] != getattr(cfg, key):
            raise ValueError(f"{path}: checkpoint has {key}={old[key]!r}, this run {getattr(cfg, key)!r}")
    heads.load_state_dict(load_file(str(path / "heads.safetensors")))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["torch_rng"])
    return Cursor(**state["cursor"])


class _Batches(torch.utils.data.Dataset):
    """Item j is the collated batch ``batches[j]`` of the cache (a DataLoader of batch size 1)."""

    def __init__(self, cache: TeacherCache, batches: list[list[int]]):
        self.cache, self.batches = cache, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, j: int) -> dict[str, Tensor]:
        return self.cache.batch(self.batches[j])


def _first(items: list) -> Any:
    return items[0]


def total_steps(cfg: TrainConfig, cache: TeacherCache, num_processes: int) -> int:
    ks, lengths = cache.split(SPLIT_TRAIN), cache.seqs[:, 1]
    n = sum(len(epoch_batches(ks, lengths, cfg.batch_tokens, cfg.seed, e)) // num_processes for e in range(cfg.epochs))
    return min(n, cfg.max_steps) if cfg.max_steps else n


def train_heads(cfg: TrainConfig, model=None, tokenizer=None, *, resume: bool = False, cache: TeacherCache | None = None,
                max_minutes: float | None = None, stop_after: int | None = None, measure: bool = True,
                command: str | None = None, accelerator=None, extract: bool = True) -> dict[str, Any]:
    """Train (or resume) one set of heads; writes checkpoints under ``WORK/RUN`` and the final
    heads to ``cfg.output`` (default ``WORK/RUN/final``). Returns the run summary.

    ``max_minutes`` / ``stop_after`` (steps in this call) end the call early with a checkpoint
    (and final heads from the current weights); ``resume=True`` later continues the schedule.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    acc = accelerator or Accelerator(mixed_precision=cfg.mixed_precision)
    run = Path(cfg.work_dir) / cfg.run_name
    run.mkdir(parents=True, exist_ok=True)
    log = RunLog(run / "train.log", acc.is_main_process)
    started = time.perf_counter()
    if model is None:
        from .demo_model import load_base_model

        model, tokenizer = load_base_model(cfg.model)
    model.to(acc.device).eval().requires_grad_(False)
    if cache is None:
        if acc.is_main_process:
            prepare_teacher_cache(model, tokenizer, cfg, log, extract=extract)
        acc.wait_for_everyone()
        cache = TeacherCache(Path(cfg.work_dir) / "data")

    snapshot = run / "sequences.npy"  # the sequences this run trains on, fixed at its start
    if resume and snapshot.exists():
        cache.restrict(np.load(snapshot))
    elif acc.is_main_process:
        np.save(snapshot, np.nonzero(cache.ready)[0])
    vocab_size = model.config.get_text_config().vocab_size
    if cfg.init_from:  # continue training given heads (their drafting vocabulary included) on this data
        heads = init_heads_from(cfg, model)
        dv = heads.draft_vocab.cpu()
    else:
        dv = draft_vocabulary(supervised_tokens(cache, SPLIT_TRAIN), cfg.draft_vocab_size, vocab_size)
        torch.manual_seed(cfg.seed)  # the random part of the initialisation (prefix layer)
        heads = HEADS_REGISTRY[cfg.family].for_model(model, cfg.num_heads, cfg.num_layers, cfg.arch, dv,
                                                       use_base_lm_head=True).float()
        k = cache.split(SPLIT_TRAIN)[:50]
        sample = np.concatenate([cache.hidden[o : o + n] for o, n in cache.seqs[k, :2]]).astype(np.float32)
        warm_start(heads, float(np.sqrt((sample**2).mean(-1)).mean()))
    heads.config.base_model_name_or_path = cfg.model or DEMO_HUB_ID
    cov = coverage(dv, supervised_tokens(cache, SPLIT_VAL))
    objective = HeadsObjective(heads, model.get_input_embeddings(), model.get_output_embeddings(),
                               cfg.ce_weight, cfg.head_decay)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = total_steps(cfg, cache, acc.num_processes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio))
    cursor = Cursor()
    found = checkpoints(run) if resume else []
    if found:
        cursor = load_checkpoint(found[-1], heads, optimizer, scheduler, cfg)
        if not torch.equal(heads.draft_vocab.cpu(), dv):
            raise ValueError(f"{found[-1]}: drafting vocabulary differs from this data's; wrong --work-dir?")
        log(f"resumed from {found[-1].name}: step {cursor.step}, epoch {cursor.epoch}, batch {cursor.batch}")
    elif resume:
        log("no checkpoint found: starting from scratch")
    objective, optimizer = acc.prepare(objective, optimizer)
    unwrapped = acc.unwrap_model(objective).heads
    log(f"{cfg.family}/{cfg.arch}: {sum(p.numel() for p in heads.parameters()) / 1e6:.2f}M parameters, "
        f"draft vocab {len(dv)} (held-out greedy coverage {cov:.4f}), {total} steps, "
        f"{len(cache.split(SPLIT_TRAIN))} train / {len(cache.split(SPLIT_VAL))} val sequences")

    ks, lengths = cache.split(SPLIT_TRAIN), cache.seqs[:, 1]
    bar = tqdm(total=total, initial=cursor.step, disable=not acc.is_main_process, desc=cfg.run_name)
    deadline = started + 60 * max_minutes if max_minutes else None
    stopped_early, params = False, [p for p in objective.parameters() if p.requires_grad]
    first_step, losses = cursor.step, []
    while cursor.step < total and not stopped_early:
        batches = epoch_batches(ks, lengths, cfg.batch_tokens, cfg.seed, cursor.epoch)
        usable = len(batches) // acc.num_processes * acc.num_processes
        loader = acc.prepare_data_loader(torch.utils.data.DataLoader(
            _Batches(cache, batches[cursor.batch : usable]), batch_size=1, collate_fn=_first))
        t0 = time.perf_counter()
        for b in loader:
            loss, per_head = objective(**b)
            acc.backward(loss)
            if cfg.grad_clip:
                acc.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            now = time.perf_counter()
            cursor.step, cursor.batch = cursor.step + 1, cursor.batch + acc.num_processes
            cursor.train_tokens += int(b["valid"].sum()) * acc.num_processes
            cursor.train_seconds, t0 = cursor.train_seconds + now - t0, now
            bar.update(1)
            losses.append(round(loss.item(), 5))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if cursor.step % 10 == 0:
                log(f"step {cursor.step}/{total} epoch {cursor.epoch} loss {loss.item():.4f} heads "
                    f"{[round(x, 3) for x in per_head]} lr {scheduler.get_last_lr()[0]:.2e} "
                    f"{cursor.train_tokens / max(cursor.train_seconds, 1e-9):.0f} tok/s")
            if cfg.eval_every and cursor.step % cfg.eval_every == 0 and acc.is_main_process:
                log(f"eval step {cursor.step}: {json.dumps(evaluate_heads(unwrapped, *_base_io(model), cache))}")
            out_of_time = (deadline is not None and now > deadline) or cursor.step - first_step == stop_after
            if cursor.step % cfg.save_every == 0 or cursor.step >= total or out_of_time:
                if acc.is_main_process:
                    save_checkpoint(run, cursor, unwrapped, optimizer, scheduler, cfg)
                acc.wait_for_everyone()
            if cursor.step >= total:
                break
            if out_of_time:
                log(f"stopping at step {cursor.step} of {total} (time/step budget): checkpoint saved")
                stopped_early = True
                break
        else:
            cursor.epoch, cursor.batch = cursor.epoch + 1, 0
    bar.close()
    saved = checkpoints(run)
    if cursor.step > 0 and (not saved or saved[-1].name != f"step-{cursor.step:07d}") and acc.is_main_process:
        save_checkpoint(run, cursor, unwrapped, optimizer, scheduler, cfg)
    summary: dict[str, Any] = {}
    if acc.is_main_process:
        summary = finalize(cfg, model, tokenizer, unwrapped, cache, cursor, total, cov, run, log,
                           measure=measure, command=command)
        summary["loss_curve"] = losses
    acc.wait_for_everyone()
    return summary


def init_heads_from(cfg: TrainConfig, model) -> DraftHeads:
    """Heads loaded from ``cfg.init_from`` (float32, on the model's device), checked against ``cfg``."""
    heads = DraftHeads.from_pretrained(cfg.init_from).float()
    c = heads.config
    got = (c.family, c.head_arch, c.num_heads, c.num_layers, c.draft_vocab_size, c.use_base_lm_head)
    want = (cfg.family, cfg.arch, cfg.num_heads, cfg.num_layers, cfg.draft_vocab_size, True)
    if got != want:
        raise ValueError(f"--init-from {cfg.init_from}: heads are {got}, this run wants {want} "
                         "(family, arch, heads, layers, draft vocab size, base LM head)")
    return heads.to(next(model.parameters()).device)


def _base_io(model) -> tuple[nn.Module, nn.Module]:
    return model.get_input_embeddings(), model.get_output_embeddings()


def half_copy(heads: DraftHeads, dtype: str) -> DraftHeads:
    """A copy of ``heads`` whose floating tensors are in ``dtype`` (ids stay integer)."""
    return copy.deepcopy(heads).to(getattr(torch, dtype))


def finalize(cfg: TrainConfig, model, tokenizer, heads: DraftHeads, cache: TeacherCache, cursor: Cursor, total: int,
             cov: float, run: Path, log, *, measure: bool = True, command: str | None = None) -> dict[str, Any]:
    """Validate, measure tau, save the shipped (half-precision) heads with a model card."""
    out = Path(cfg.output) if cfg.output else run / "final"
    half_copy(heads, cfg.save_dtype).save_pretrained(out)
    # validate what ships, loaded back from disk as a user would (then run in float32)
    shipped = DraftHeads.from_pretrained(out).float()
    metrics = evaluate_heads(shipped, *_base_io(model), cache)
    extract = json.loads((cache.root / "extract.json").read_text())
    summary = {
        "config": asdict(cfg), "command": command, "steps": cursor.step, "total_steps": total,
        "epochs_done": round(cursor.train_tokens / max(1, int(cache.seqs[cache.split(SPLIT_TRAIN), 1].sum())), 2),
        "train_tokens_seen": cursor.train_tokens, "train_seconds": round(cursor.train_seconds),
        "train_tokens_per_s": round(cursor.train_tokens / max(cursor.train_seconds, 1e-9), 1),
        "extract": extract, "data": used_data(cache), "draft_vocab_size": int(len(heads.draft_vocab)),
        "draft_vocab_val_coverage": round(cov, 4), "validation": metrics,
        "validation_fp32_weights": evaluate_heads(heads, *_base_io(model), cache),
        "weights_bytes": os.path.getsize(out / "model.safetensors"),
    }
    if measure and cfg.tau_prompts > 0 and tokenizer is not None:
        prompts = tau_prompts(cache, tokenizer, cfg.tau_prompts, cfg.seed, cfg.val_fraction)
        summary["tau_mc_sim_7b_63"] = measure_tau(model, shipped, prompts, cfg.tau_new_tokens)
    (out / "README.md").write_text(model_card(summary, heads), encoding="utf-8")
    _write_json(run / "summary.json", summary)
    log(f"final: {json.dumps({k: summary[k] for k in ('steps', 'validation', 'weights_bytes')})}")
    if "tau_mc_sim_7b_63" in summary:
        log(f"tau: {summary['tau_mc_sim_7b_63']}")
    log(f"heads written to {out}")
    return summary


def used_data(cache: TeacherCache) -> dict[str, dict[str, dict[str, int]]]:
    """Sequences and tokens actually trained / validated on, per source."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for split, name in ((SPLIT_TRAIN, "train"), (SPLIT_VAL, "val")):
        ks = cache.split(split)
        for i, src in enumerate(SOURCES):
            sel = ks[cache.seqs[ks, 4] == i]
            if len(sel):
                out.setdefault(src, {})[name] = {"sequences": len(sel), "tokens": int(cache.seqs[sel, 1].sum())}
    return out


def model_card(s: dict[str, Any], heads: DraftHeads) -> str:
    """The shipped heads' README: what they are, how they were trained, how well they draft."""
    c, hc, v = s["config"], heads.config, s["validation"]
    rows = "\n".join(f"| {i} | t+{i + 2} | {v['top1'][i]:.3f} | {v['top5'][i]:.3f} | {v['kl'][i]:.3f} | {v['rows'][i]} |"
                     for i in range(hc.num_heads))
    data = "\n".join(f"| {name} | {d.get('train', {}).get('tokens', 0)} | {d.get('val', {}).get('tokens', 0)} |"
                     for name, d in (s["data"] or {}).items())
    tau = s.get("tau_mc_sim_7b_63")
    sources = (s["data"] or {}).keys()
    described = {
        "distill": "`distill`: the base model's own greedy answers (`entmtp_hf.distill`) to GSM8K-train, Python "
                   "standard-library docstring and chat prompts",
        "gsm8k": "`gsm8k`: GSM8K *train* questions with their reference answers as chats",
        "stdlib": "`stdlib`: Python standard-library source",
    }
    about = "; ".join(described[k] for k in SOURCES if k in sources)
    start = (f"Training started from the heads in `{c['init_from']}` (same drafting vocabulary) instead of the "
             "warm start." if c.get("init_from") else "Training started from the warm start (every head = base LM "
             "head on c_t).")
    tau_line = (f"Greedy EntMTP decoding with the `mc_sim_7b_63` tree on {tau['prompts']} held-out prompts "
                f"(held-out distilled prompts, then held-out GSM8K-train questions; {tau['max_new_tokens']} new tokens "
                f"each): **mean accepted tokens per step τ = "
                f"{tau['mean_accept_length']:.3f}** ({tau['steps']} steps)." if tau else "τ not measured.")
    return f"""---
library_name: entmtp-hf
tags:
- speculative-decoding
- {hc.family}
base_model: {hc.base_model_name_or_path}
---

# {hc.family.capitalize()} draft heads for {hc.base_model_name_or_path}

{hc.num_heads} {hc.family} heads (`{hc.head_arch}`, {hc.num_layers} block(s) each, hidden size {hc.hidden_size})
drafting over a {hc.draft_vocab_size}-token vocabulary with the base model's own LM head rows
(`use_base_lm_head=True`), stored in {c['save_dtype']} ({s['weights_bytes'] / 1e6:.1f} MB).
Head i drafts token t+i+2 from the base model's last hidden state at t (Hydra: and the
embeddings of the tokens in between). The base model verifies every draft, so outputs are
unchanged.

```python
from entmtp_hf.generation import enable_entmtp
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.tree import MC_SIM_7B_63
enable_entmtp(model, "<this folder>")   # heads are cast to the model's dtype
out = model.generate(ids, max_new_tokens=128, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
```

## Training

Distillation from the frozen base model: head i at row t learns the base model's
next-token distribution at position t+i+1, restricted to the drafting vocabulary and
renormalised, with KL(teacher || head) (CE weight {c['ce_weight']}, head weights
{c['head_decay']}^i). Trained with `entmtp-hf train-heads`:

```
{s.get('command') or '(API call)'}
```

{start}
AdamW lr {c['lr']}, {c['schedule']} schedule with {c['warmup_steps']} warm-up steps, clip {c['grad_clip']},
batches of ≤ {c['batch_tokens']} tokens, {s['steps']} of {s['total_steps']} steps
({s['train_tokens_seen']} tokens seen, ≈ {s['epochs_done']} epochs, {s['train_seconds']} s,
{s['train_tokens_per_s']} tokens/s on the training machine).

Data (tokens; documents split train/val by a hash of their id):

| source | train | val |
|---|---|---|
{data}

{about}. No evaluation text was used: no HumanEval, no GSM8K test, no MT-Bench (stdlib
chunks and distillation prompts sharing a word 13-gram with any of them were dropped).

## Validation (held-out split, teacher-forced)

Drafting vocabulary: the {hc.draft_vocab_size} most frequent greedy tokens of the training
split; it covers {s['draft_vocab_val_coverage']:.4f} of the held-out greedy tokens.
Accuracy = the head's top-k (over the drafting vocabulary) contains the base model's
greedy token.

| head | drafts | top-1 | top-5 | KL (nats) | rows |
|---|---|---|---|---|---|
{rows}

{tau_line}
"""


# ============================================================================ CLI
_HELP = {
    "model": "base model (Hub id or folder); default: the demo model SmolLM2-135M-Instruct",
    "family": "heads family: hydra or medusa", "arch": "head architecture: mlp or (hydra) prefix-mlp",
    "work_dir": "folder of the teacher cache (WORK/data) and runs (WORK/RUN); keep it out of git",
    "run_name": "run folder name under WORK (default FAMILY-ARCH)",
    "output": "folder for the final heads (default WORK/RUN/final)",
    "init_from": "start from these heads (a heads folder; keeps their drafting vocabulary) instead of a warm start",
    "distill_dir": "folder of distill-*.jsonl self-distilled records", "sources": "comma-separated data sources",
    "max_tokens": "token budget of the data set (train + val)", "distill_share": "largest share of distilled data",
    "batch_tokens": "padded tokens per batch", "max_steps": "stop after this many steps (else EPOCHS epochs)",
    "ce_weight": "weight of CE on the teacher argmax mixed into the KL loss",
    "head_decay": "head i's loss weight is HEAD_DECAY**i", "save_dtype": "precision of the shipped heads",
    "mixed_precision": "accelerate mixed precision: no, bf16 or fp16",
    "tau_prompts": "held-out prompts for the final tau measurement (0: skip)",
}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    for f in TrainConfig.__dataclass_fields__.values():
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if f.name == "sources":
            p.add_argument(flag, default=",".join(SOURCES), help=_HELP["sources"])
        elif default is None or isinstance(default, str):
            p.add_argument(flag, default=default, help=_HELP.get(f.name))
        else:
            p.add_argument(flag, type=type(default), default=default, help=_HELP.get(f.name))
    p.set_defaults(max_steps=None)


def _train_command(args: argparse.Namespace) -> int:
    import shlex
    import sys

    if args.threads:
        torch.set_num_threads(args.threads)
    values = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__}
    values["sources"] = tuple(s for s in values["sources"].split(",") if s)
    values["max_steps"] = int(values["max_steps"]) if values["max_steps"] else None
    cfg = TrainConfig(**values)
    command = "entmtp-hf " + shlex.join(sys.argv[1:]) if sys.argv and "train-heads" in sys.argv else None
    if args.extract_only:
        from .demo_model import load_base_model

        model, tok = load_base_model(cfg.model)
        Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
        prepare_teacher_cache(model, tok, cfg, RunLog(Path(cfg.work_dir) / "extract.log"))
        return 0
    train_heads(cfg, resume=args.resume, max_minutes=args.max_minutes, measure=not args.no_tau, command=command,
                extract=not args.skip_extract)
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf train-heads``."""
    p = sub.add_parser(
        "train-heads",
        help="train Hydra/Medusa draft heads by distillation from the frozen base model",
        description="Build a data set (self-distilled records + real text, no evaluation sets), cache the base "
        "model's hidden states once, and train draft heads on the base model's own next-token distributions. "
        "Runs unchanged under `accelerate launch`.",
    )
    _add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of WORK/RUN")
    p.add_argument("--extract-only", action="store_true", help="only build and fill the teacher cache")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (checkpoint + final heads) after this many minutes; --resume continues")
    p.add_argument("--no-tau", action="store_true", help="skip the final tau measurement")
    p.add_argument("--skip-extract", action="store_true",
                   help="train on the sequences extracted so far instead of finishing the extraction first")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=_train_command)
