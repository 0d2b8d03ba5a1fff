"""The teacher side of distillation: the run's documents (self-distilled records and real
text, split train/val by document id), the :class:`TeacherCache` of the base model's hidden
states and greedy tokens (memmaps, filled resumably by :func:`extract_hidden`), batch packing
and the drafting vocabulary chosen from the cached greedy tokens.

Everything here is data the heads are trained on; nothing here trains.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...errors import FileFormatError
from .config import SOURCES, SPLIT_TRAIN, SPLIT_VAL, TrainConfig


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


def _shares(sources: list[str], n_distill: int, distill_share: float, budget: int) -> dict[str, int]:
    """Each source's tokens of a data set of ``budget`` tokens: distilled text up to its share, the rest split
    evenly between the other sources."""
    share = {"distill": min(n_distill, int(distill_share * budget))} if "distill" in sources else {}
    others = [s for s in sources if s != "distill"]
    for s in others:
        share[s] = (budget - share.get("distill", 0)) // max(len(others), 1)
    return share


def build_sequences(tokenizer, cfg: TrainConfig, log=print) -> tuple[list[TokenSeq], dict]:
    """The run's documents under the token budget, and a manifest describing them."""
    from ..data import datasets as D

    rng = np.random.default_rng(cfg.seed)
    vf, budget = cfg.val_fraction, cfg.max_tokens
    pools: dict[str, list[TokenSeq]] = {}
    manifest: dict[str, Any] = {"sources": {}, "excluded": "HumanEval, GSM8K test, MT-Bench (never read)"}
    if "distill" in cfg.sources and cfg.distill_dir and Path(cfg.distill_dir).is_dir():
        records, manifest["distill_snapshot"] = read_distill(cfg.distill_dir)
        seqs = [
            TokenSeq(
                "distill",
                tuple(r["prompt_ids"] + r["response_ids"]),
                len(r["prompt_ids"]) - 1,
                int(held_out(f"{r['source']}:{r['prompt_id']}", vf, cfg.seed)),
            )
            for _, r in records
        ]
        pools["distill"] = [seqs[i] for i in rng.permutation(len(seqs))]
    sys_len = system_prefix_len(tokenizer)
    if "gsm8k" in cfg.sources:
        chats = D.gsm8k_train_chats(tokenizer)  # GSM8K *train* only
        seqs = [
            TokenSeq(
                "gsm8k",
                tuple(tokenizer(c, add_special_tokens=False)["input_ids"]),
                sys_len,
                int(held_out(f"gsm8k-train-{i}", vf, cfg.seed)),
            )
            for i, c in enumerate(chats)
        ]
        pools["gsm8k"] = [seqs[i] for i in rng.permutation(len(seqs))]
    if "stdlib" in cfg.sources:
        index = D.EvalIndex(D.evaluation_texts())
        chunks = list(D.stdlib_source_chunks(max_chars=3 * cfg.max_seq_len))
        kept = [(i, c) for i, c in enumerate(chunks) if index.hit(c) is None]
        manifest["stdlib_dropped_for_eval_overlap"] = len(chunks) - len(kept)
        order = rng.permutation(len(kept))
        pools["stdlib"] = [
            TokenSeq(
                "stdlib",
                tuple(tokenizer(kept[k][1], add_special_tokens=False)["input_ids"]),
                0,
                int(held_out(f"stdlib-{kept[k][0]}", vf, cfg.seed)),
            )
            for k in order[:20_000]
        ]
    n_distill = sum(len(s.ids) for s in pools.get("distill", []))
    share = _shares(list(pools), n_distill, cfg.distill_share, budget)
    skipped = _shares(list(pools), n_distill, cfg.distill_share, cfg.train_offset)
    out: list[TokenSeq] = []
    for name, pool in pools.items():
        for split, frac in ((SPLIT_TRAIN, 1 - vf), (SPLIT_VAL, vf)):
            docs = [s for s in pool if s.split == split]
            if split == SPLIT_TRAIN and cfg.train_offset:  # what the earlier round's _take took
                docs = docs[len(_take(docs, int(skipped[name] * frac))) :]
            docs = _take(docs, int(share[name] * frac))
            pieces = [p for d in docs for p in cut(d, cfg.max_seq_len)]
            out += pieces
            manifest["sources"].setdefault(name, {})[("train", "val")[split]] = {
                "documents": len(docs),
                "sequences": len(pieces),
                "tokens": sum(len(p.ids) for p in pieces),
            }
    manifest["total_tokens"] = sum(len(s.ids) for s in out)
    log(f"data: {json.dumps(manifest['sources'])}")
    return out, manifest


class TeacherCache:
    """Token ids, hidden states (float16) and greedy tokens of every sequence, as memmaps.

    ``seqs`` rows are (offset, length, start, split, source index); position p of sequence k
    lives at row offset+p of ``tokens``, ``hidden`` [total, H] (the last state, after the final
    norm: the teacher's logits) and ``greedy``. ``feature_layers``: further base hidden-state
    indices kept for drafters that read them (EAGLE-3's fused states), ``features`` [total, n, H].
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        meta = json.loads((self.root / "manifest.json").read_text())
        self.manifest, self.hidden_size, total = meta, meta["hidden_size"], meta["total_tokens"]
        self.feature_layers: tuple[int, ...] = tuple(meta.get("feature_layers", ()))
        self.seqs = np.load(self.root / "seqs.npy")
        self.tokens = np.memmap(self.root / "tokens.i32", dtype=np.int32, mode="r", shape=(total,))
        self.hidden = np.memmap(self.root / "hidden.f16", dtype=np.float16, mode="r+", shape=(total, self.hidden_size))
        self.greedy = np.memmap(self.root / "greedy.i32", dtype=np.int32, mode="r+", shape=(total,))
        self.features = None
        if self.feature_layers:
            self.features = np.memmap(
                self.root / "features.f16",
                dtype=np.float16,
                mode="r+",
                shape=(total, len(self.feature_layers), self.hidden_size),
            )

    @staticmethod
    def create(
        root: str | Path, seqs: Sequence[TokenSeq], hidden_size: int, manifest: dict, feature_layers: Sequence[int] = ()
    ) -> "TeacherCache":
        """A new, empty cache of ``seqs``; ``feature_layers``: the hidden-state indices kept besides the last."""
        root = Path(root)
        feature_layers = [int(i) for i in feature_layers]
        if any(i < 0 for i in feature_layers) or len(set(feature_layers)) != len(feature_layers):
            raise ValueError(f"feature_layers must be distinct hidden-state indices >= 0, got {feature_layers}")
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
        if feature_layers:
            np.memmap(
                root / "features.f16", dtype=np.float16, mode="w+", shape=(total, len(feature_layers), hidden_size)
            ).flush()
        meta = {
            **manifest,
            "hidden_size": hidden_size,
            "total_tokens": total,
            "num_sequences": len(seqs),
            "feature_layers": feature_layers,
        }
        (root / "manifest.json").write_text(json.dumps(meta, indent=1))  # written last: marks a complete layout
        return TeacherCache(root)

    def flush(self) -> None:
        for array in (self.hidden, self.greedy, self.features):
            if array is not None:
                array.flush()

    def ids(self, k: int) -> np.ndarray:
        o, n = self.seqs[k, :2]
        return self.tokens[o : o + n]

    def _progress(self) -> dict:
        path = self.root / "extract.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def copied(self) -> list[int]:
        """Sequences whose rows were copied from another cache (:func:`copy_rows`), not computed."""
        return list(self._progress().get("copied", []))

    def extraction_batches(self) -> tuple[list[list[int]], list[int], int]:
        """Extraction batches (length-sorted, packed; copied sequences left out), indices of
        those done, batch size used."""
        path = self.root / "extract.json"
        state = self._progress()
        size = state.get("batch_tokens", 4096)
        lengths = self.seqs[:, 1]
        copied = set(state.get("copied", []))
        batches = pack([k for k in np.argsort(lengths, kind="stable") if k not in copied], lengths, size)
        if state and state.get("of", len(batches)) != len(batches):
            raise ValueError(
                f"{path}: extraction used another batch layout ({state['of']} batches, not {len(batches)})"
            )
        done = state.get("done", list(range(state.get("batches", 0))))  # older files: a prefix count
        return batches, done, size

    @property
    def ready(self) -> np.ndarray:
        """Mask of sequences whose hidden states are extracted."""
        batches, done, _ = self.extraction_batches()
        mask = np.zeros(len(self.seqs), bool)
        mask[[k for b in done for k in batches[b]]] = True
        mask[self.copied] = True
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

    def check_layers(self, layers: Sequence[int]) -> None:
        """Refuse (naming the folder) heads that read hidden states this cache does not keep."""
        missing = [i for i in layers if i != -1 and i not in self.feature_layers]
        if missing:
            raise ValueError(
                f"{self.root}: the heads read base hidden states {missing}, this cache keeps the last "
                f"one and {list(self.feature_layers) or 'no others'}: build a new cache (a fresh "
                "--work-dir) for these heads"
            )

    def batch(self, ks: Sequence[int], layers: Sequence[int] = (-1,)) -> dict[str, Tensor]:
        """Right-padded tensors of sequences ``ks``: ids, hidden (float32, the last state), greedy,
        valid/supervised masks, and (``layers`` other than ``(-1,)``) ``features``: the states at
        hidden-state indices ``layers`` (-1: the last) concatenated, [B, T, len(layers) * H]."""
        self.check_layers(layers)
        lens = self.seqs[ks, 1]
        b, t = len(ks), int(lens.max())
        ids, greedy = np.zeros((b, t), np.int64), np.zeros((b, t), np.int64)
        hidden = np.zeros((b, t, self.hidden_size), np.float32)
        fused = tuple(layers) != (-1,)
        features = np.zeros((b, t, len(layers), self.hidden_size), np.float32) if fused else None
        pos = np.arange(t)[None]
        for r, k in enumerate(ks):
            o, n = self.seqs[k, :2]
            ids[r, :n], greedy[r, :n], hidden[r, :n] = (
                self.tokens[o : o + n],
                self.greedy[o : o + n],
                self.hidden[o : o + n],
            )
            for j, i in enumerate(layers if fused else ()):
                features[r, :n, j] = (
                    hidden[r, :n] if i == -1 else self.features[o : o + n, self.feature_layers.index(i)]
                )
        valid = pos < lens[:, None]
        sup = valid & (pos >= self.seqs[ks, 2][:, None])
        out = {
            "ids": torch.from_numpy(ids),
            "hidden": torch.from_numpy(hidden),
            "greedy": torch.from_numpy(greedy),
            "valid": torch.from_numpy(valid),
            "sup": torch.from_numpy(sup),
        }
        if fused:
            out["features"] = torch.from_numpy(features.reshape(b, t, -1))
        return out


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


def _teacher_rows(
    model: nn.Module, cache: TeacherCache, ks: Sequence[int], dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Last hidden states [B, T, H], greedy tokens [B, T] and the cache's further states
    [B, T, n, H] (``None`` when it keeps none) of sequences ``ks`` (right-padded)."""
    device = next(model.parameters()).device
    lens = cache.seqs[ks, 1]
    ids = np.zeros((len(ks), int(lens.max())), np.int64)
    for r, k in enumerate(ks):
        ids[r, : lens[r]] = cache.ids(k)
    ids_t = torch.from_numpy(ids).to(device)
    mask = (torch.arange(ids.shape[1])[None] < torch.from_numpy(lens)[:, None]).long().to(device)
    layers = list(cache.feature_layers)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        out = model(
            input_ids=ids_t, attention_mask=mask, output_hidden_states=[*layers, -1] if layers else -1, use_cache=False
        )
    states = out.hidden_states
    extra = torch.stack([states[i] for i in layers], dim=2).float().cpu().numpy() if layers else None
    return states[-1].float().cpu().numpy(), out.logits.argmax(-1).cpu().numpy(), extra


def copy_rows(model: nn.Module, cache: TeacherCache, source: TeacherCache, dtype: str, log=print) -> list[int]:
    """Copy the rows of every sequence of ``cache`` that ``source`` holds extracted (same token
    ids), so that adding data to a finished cache costs only the new sequences' forwards.

    A sequence's rows depend on its own tokens only (causal model, no packing), so a copy equals
    a recomputation up to the rounding of another batch shape. ``source`` must come from the same
    base model and teacher precision: another hidden size, precision or recorded model is refused,
    and the shortest copied sequence is recomputed with ``model`` (rows of another model of the
    same shapes are refused too), each naming the folder.
    """
    if source.hidden_size != cache.hidden_size:
        raise ValueError(f"{source.root}: hidden size {source.hidden_size}, this cache needs {cache.hidden_size}")
    missing = [i for i in cache.feature_layers if i not in source.feature_layers]
    if missing:
        raise ValueError(
            f"{source.root}: keeps hidden states {list(source.feature_layers)} besides the last, this "
            f"cache needs {list(cache.feature_layers)}: rows can only be copied from a cache that keeps "
            "every layer this one keeps"
        )
    picks = [source.feature_layers.index(i) for i in cache.feature_layers]  # this cache's layers in the source's
    src_dtype = source._progress().get("dtype", "float32")
    if src_dtype != dtype:
        raise ValueError(f"{source.root}: extracted in {src_dtype}, this cache in {dtype}")
    models = [(c.manifest.get("built_with") or {}).get("model") for c in (source, cache)]
    if models[0] != models[1]:
        raise ValueError(f"{source.root}: built for base model {models[0]!r}, this cache for {models[1]!r}")
    index = {source.ids(k).tobytes(): k for k in np.nonzero(source.ready)[0]}
    copied = []
    for k in range(len(cache.seqs)):
        j = index.get(cache.ids(k).tobytes())
        if j is None:
            continue
        (o, n), (so, _) = cache.seqs[k, :2], source.seqs[j, :2]
        cache.hidden[o : o + n], cache.greedy[o : o + n] = source.hidden[so : so + n], source.greedy[so : so + n]
        if cache.features is not None:
            cache.features[o : o + n] = source.features[so : so + n][:, picks]
        copied.append(k)
    cache.flush()
    if copied:
        k = min(copied, key=lambda k: cache.seqs[k, 1])
        o, n = cache.seqs[k, :2]
        h, greedy, _ = _teacher_rows(model, cache, [k], dtype)
        want = np.asarray(cache.hidden[o : o + n], np.float32)
        far = np.abs(h[0, :n] - want).max() > 0.05 * np.abs(want).max()
        if far or (greedy[0, :n] != cache.greedy[o : o + n]).mean() > 0.1:
            raise ValueError(
                f"{source.root}: its rows differ from this model's (sequence {k} recomputed): "
                "a cache of another base model cannot be reused"
            )
    log(
        f"extract: {len(copied)} of {len(cache.seqs)} sequences "
        f"({int(cache.seqs[copied, 1].sum()) if copied else 0} tokens) copied from {source.root}"
    )
    return copied


@torch.no_grad()
def extract_hidden(
    model: nn.Module,
    cache: TeacherCache,
    batch_tokens: int = 4096,
    log=print,
    dtype: str = "float32",
    reuse: TeacherCache | None = None,
) -> None:
    """Fill ``cache.hidden`` / ``cache.greedy`` with the base model's outputs; resumes by batch.

    Sequences run right-padded in length-sorted batches (:func:`extraction_order`);
    ``extract.json`` lists the finished batches. ``dtype="bfloat16"`` runs the forward under
    bfloat16 autocast (weights stay float32): faster on CPUs with AMX, its teacher distributions
    close to float32's (docs/training.md). ``reuse``: a cache whose matching sequences are
    copied (:func:`copy_rows`) before anything is computed. A bar shows the batches on a terminal.
    """
    progress = cache.root / "extract.json"
    lengths = cache.seqs[:, 1]
    if not progress.exists():  # the layout is fixed once: a resumed extraction keeps it and its precision
        copied = copy_rows(model, cache, reuse, dtype, log) if reuse is not None else []
        _write_json(progress, {"done": [], "copied": copied, "batch_tokens": batch_tokens, "dtype": dtype})
    state = cache._progress()
    dtype, copied = state.get("dtype", "float32"), state.get("copied", [])
    batches, done, batch_tokens = cache.extraction_batches()
    done_set = set(done)
    todo = [b for b in extraction_order(len(batches)) if b not in done_set]
    if not todo:
        return
    t0, n_tok = time.perf_counter(), 0
    log(f"extract: {len(todo)} of {len(batches)} batches to go ({int(lengths.sum())} tokens in all)")
    for j, b in enumerate(tqdm(todo, desc="teacher cache", unit="batch", disable=None)):
        ks = batches[b]
        lens = lengths[ks]
        h, greedy, extra = _teacher_rows(model, cache, ks, dtype)
        for r, k in enumerate(ks):
            o, n = cache.seqs[k, :2]
            cache.hidden[o : o + n], cache.greedy[o : o + n] = h[r, :n], greedy[r, :n]
            if extra is not None:
                cache.features[o : o + n] = extra[r, :n]
        cache.flush()
        done.append(b)
        n_tok += int(lens.sum())
        filled = [k for d in done for k in batches[d]] + copied
        _write_json(
            progress,
            {
                "done": done,
                "copied": copied,
                "of": len(batches),
                "batch_tokens": batch_tokens,
                "dtype": dtype,
                "tokens": int(lengths[filled].sum()),
            },
        )
        if (j + 1) % 10 == 0 or j + 1 == len(todo):
            log(f"extract: {len(done)}/{len(batches)} batches  {n_tok / (time.perf_counter() - t0):.0f} tokens/s")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def open_cache(path: str | Path) -> TeacherCache:
    """The teacher cache in ``path``: a cache folder, a ``train-heads`` work folder (its ``data/``) or a
    ``build-drafter`` work folder (its ``train/data/``)."""
    root = Path(path)
    for where in (root, root / "data", root / "train" / "data"):
        if (where / "manifest.json").exists():
            return TeacherCache(where)
    raise FileNotFoundError(
        f"{path}: no teacher cache here (no manifest.json in it, in its data/ or in its train/data/ folder)"
    )


#: the settings a teacher cache's documents follow from (its manifest's ``built_with``)
BUILT_WITH = ("model", "max_tokens", "train_offset", "distill_share", "val_fraction", "max_seq_len", "seed", "sources")


def _check_built_with(root: Path, manifest: dict[str, Any], cfg: TrainConfig, log) -> None:
    """The run trains on the documents the cache was built with. A cache built for another ``train_offset`` holds
    another round's text: refused. Other settings that differ are said (the cache's documents are used, as
    before: a second drafter trains on a first one's cache without repeating its flags)."""
    built = manifest.get("built_with") or {}

    def differs(k: str) -> bool:
        return k in built and built[k] != json.loads(json.dumps(getattr(cfg, k)))

    if differs("train_offset") or (cfg.train_offset and "train_offset" not in built):
        raise FileFormatError(
            root / "manifest.json",
            f"this teacher cache was built for train_offset={built.get('train_offset', 0)}, this run asks for "
            f"{cfg.train_offset}: another round's documents; use another --work-dir",
        )
    notes = [f"{k}={built[k]!r}" for k in BUILT_WITH if differs(k)]
    if notes:
        log(f"the teacher cache in {root} was built with {', '.join(notes)}: training on its documents")


def prepare_teacher_cache(model, tokenizer, cfg: TrainConfig, log=print, extract: bool = True) -> TeacherCache:
    """Build (once) and fill (resumably; ``extract=False``: as far as it got) ``WORK/data``."""
    root = Path(cfg.work_dir) / "data"
    base = model.config.get_text_config()
    layers = [i for i in cfg.heads_feature_layers(base) or () if i != -1]
    if not (root / "manifest.json").exists():
        seqs, manifest = build_sequences(tokenizer, cfg, log)
        manifest["built_with"] = {k: getattr(cfg, k) for k in BUILT_WITH}
        TeacherCache.create(root, seqs, base.hidden_size, manifest, feature_layers=layers)
    cache = TeacherCache(root)
    _check_built_with(root, cache.manifest, cfg, log)
    cache.check_layers(layers)
    if extract:
        reuse = open_cache(cfg.reuse_cache) if cfg.reuse_cache else None
        extract_hidden(model, cache, cfg.extract_batch_tokens, log, cfg.teacher_dtype, reuse)
    elif not cache.complete:
        log(
            f"using the partly extracted cache: {int(cache.seqs[cache.ready, 1].sum())} of "
            f"{int(cache.seqs[:, 1].sum())} tokens"
        )
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
