"""Regime analysis (the paper's Appendix A): which per-step signals predict accept length?

From the records of a benchmark run (``results.json``), every EntMTP generation is traced
again, step by step, without re-running the decode loop: one teacher-forced forward of the
base model over prompt + output gives the base distribution at every position, and the
heads are fed the accepted hidden states exactly as the loop feeds them (``observe`` the
prompt, then each step's accepted positions), so each step's greedy draft chain is rebuilt.
Step ``k`` starts at position ``r_k`` (``r_0`` = first new token, ``r_{k+1} = r_k + a_k``).

Features of step ``k`` use only what is known when the step starts:

* ``entropy``: entropy (nats) of the base distribution at ``r_k - 1`` (the one the root was
  chosen from) and its EMA over block starts with windows 4, 8, 12, 16, 24, 32, 64
  (``entropy_ema<w>``, smoothing 2/(w+1)); ``base_top1``: its top-1 probability;
* ``accept_ema8``, ``accept_last4_{mean,min,max}``: earlier accept lengths ``a_0..a_{k-1}``;
* ``head_confidence``: head 0's top-1 probability; ``head_entropy``: mean entropy of the heads
  along the drafted chain; ``chain_value``: ``p0 * p_1 * ... * p_D``;
* ``head_agreement``: fraction of positions on which this step's chain agrees with the
  previous step's chain (both predicted them); NaN when they share none.

Target: ``a_k``, the accept length (tokens the step added). The last step of a generation is
dropped (stopping may cut it). Per task: Pearson r of each feature against ``a_k``; AUROC
of a small MLP predicting ``a_k == 1`` on a test split *by sample* (prompt): every step of
one prompt is on one side, whatever the method. Heatmap: features × tasks (r values).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..scheduling.features import ema, top1_and_entropy
from ..trees.tree import Tree
from . import pyplot
from .bench.methods import METHODS
from .checkpoint import json_safe

ENTROPY_WINDOWS = (4, 8, 12, 16, 24, 32, 64)
FEATURES = (
    "entropy",
    *(f"entropy_ema{w}" for w in ENTROPY_WINDOWS),
    "base_top1",
    "accept_ema8",
    "accept_last4_mean",
    "accept_last4_min",
    "accept_last4_max",
    "head_confidence",
    "head_entropy",
    "chain_value",
    "head_agreement",
)
DEFAULT_METHODS = ("entmtp-static",)


@dataclass
class Trace:
    """Per-step features (``[steps, len(FEATURES)]``) and accept lengths of one generation."""

    task: str
    sample: str  # the prompt id: the unit of the train/test split
    method: str
    features: np.ndarray
    accept: np.ndarray


# ============================================================================ tracing
def _agreement(prev_start: int, prev_chain: list[int], start: int, chain: list[int]) -> float:
    """Share of drafted positions both chains cover on which they agree (NaN if none)."""
    both = [p for p in range(start + 1, start + len(chain)) if prev_start < p < prev_start + len(prev_chain)]
    if not both:
        return math.nan
    return sum(prev_chain[p - prev_start] == chain[p - start] for p in both) / len(both)


def _history(accepts: list[int]) -> list[float]:
    if not accepts:
        return [math.nan] * 4
    e = None
    for a in accepts:
        e = ema(e, float(a), 8)
    last = accepts[-4:]
    return [e, sum(last) / len(last), min(last), max(last)]


@torch.no_grad()
def trace_generation(
    model, heads, prompt_ids: Sequence[int], output_ids: Sequence[int], accept_lengths: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild the per-step features of one EntMTP generation; ``(features, accept)``."""
    device = next(model.parameters()).device
    seq = list(prompt_ids) + list(output_ids)
    start = len(prompt_ids)
    seq_ids = torch.tensor([seq], device=device)
    out = model(input_ids=seq_ids, output_hidden_states=heads.hidden_states_request)
    top1, entropy = (x.tolist() for x in top1_and_entropy(out.logits[0].float()))
    hidden = heads.features(out.hidden_states)[0]
    chain_buffers = Tree.chain(heads.num_heads).buffers(next(heads.parameters()).device, hidden.dtype)
    state = heads.new_state(model)
    heads.observe(state, hidden[:start], tokens=seq_ids[0, :start])
    rows, targets, emas = [], [], {w: None for w in ENTROPY_WINDOWS}
    prev, r = None, start
    for k, a in enumerate(accept_lengths[:-1]):  # the last step may be cut by stopping
        if r >= len(seq):
            break
        prop = heads.propose(state, torch.tensor(seq[r], device=hidden.device), chain_buffers)
        chain, probs = prop.tokens.tolist(), prop.probs.tolist()
        ents = prop.entropy.tolist() if prop.entropy is not None else [math.nan] * len(chain)
        h, p0 = entropy[r - 1], top1[r - 1]
        for w in ENTROPY_WINDOWS:
            emas[w] = ema(emas[w], h, w)
        agree = _agreement(prev[0], prev[1], r, chain) if prev else math.nan
        rows.append(
            [
                h,
                *(emas[w] for w in ENTROPY_WINDOWS),
                p0,
                *_history(list(accept_lengths[:k])),
                probs[1],
                float(np.mean(ents[1:])),
                p0 * float(np.prod(probs[1:])),
                agree,
            ]
        )
        targets.append(a)
        prev = (r, chain)
        nxt = min(r + a, len(seq))
        heads.observe(state, hidden[r:nxt], tokens=seq_ids[0, r:nxt])
        r = nxt
    return np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURES)), np.asarray(targets, dtype=np.float64)


def trace_results(
    results: dict, heads_by_family: dict, model, methods: Sequence[str] = DEFAULT_METHODS, progress: bool = False
) -> list[Trace]:
    """Traces of every record of ``methods`` (each needs its heads family in ``heads_by_family``;
    ``progress``: a bar over the records)."""
    traces = []
    for r in tqdm(results["records"], desc="regime traces", unit="record", disable=not progress):
        if r["method"] not in methods or not r.get("accept_lengths"):
            continue
        family = METHODS[r["method"]].heads if r["method"] in METHODS else "hydra"
        heads = heads_by_family.get(family)
        if heads is None:
            raise ValueError(f"no {family} heads to trace {r['method']} with")
        prompt_ids = results["prompts"][r["task"]][r["prompt_index"]]["input_ids"]
        feats, acc = trace_generation(model, heads, prompt_ids, r["output_ids"], r["accept_lengths"])
        traces.append(Trace(r["task"], r["prompt_id"], r["method"], feats, acc))
    return traces


# ============================================================================ statistics
def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson r over the pairs where both are finite; NaN with < 3 pairs or no variance."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    return float((dx * dy).sum()) / den if den > 0 else math.nan


def auroc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney U with mid-ranks for ties); NaN if one class."""
    s, lab = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    n_pos, n_neg = int(lab.sum()), int((~lab).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # mid-ranks over runs of equal scores
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[lab].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def split_by_sample(groups: Sequence[str], test_fraction: float = 0.3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Boolean train / test row masks with whole samples on each side (never split a sample)."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    names = sorted(set(groups))
    if len(names) < 2:
        raise ValueError(f"a split by sample needs >= 2 samples, got {len(names)}")
    random.Random(seed).shuffle(names)
    n_test = min(max(1, round(len(names) * test_fraction)), len(names) - 1)
    test_names = set(names[:n_test])
    test = np.array([g in test_names for g in groups])
    check_disjoint([g for g, t in zip(groups, test) if not t], [g for g, t in zip(groups, test) if t])
    return ~test, test


def check_disjoint(train_groups: Sequence[str], test_groups: Sequence[str]) -> None:
    """Refuse a split in which some sample has rows on both sides (leakage across steps)."""
    both = set(train_groups) & set(test_groups)
    if both:
        raise ValueError(f"train and test share samples {sorted(both)[:5]}: split by sample, not by row")


def mlp_auroc(
    x: np.ndarray,
    y: np.ndarray,
    groups: Sequence[str],
    *,
    test_fraction: float = 0.3,
    seed: int = 0,
    hidden: int = 16,
    epochs: int = 300,
) -> dict[str, Any]:
    """Test AUROC of a small MLP classifying ``y`` (bool) from ``x``, split by sample.

    Features are standardised with the training rows' statistics; NaNs become 0 (the
    training mean) after standardisation.
    """
    train, test = split_by_sample(groups, test_fraction, seed)
    mu = np.nanmean(np.where(np.isfinite(x[train]), x[train], np.nan), axis=0)
    sd = np.nanstd(np.where(np.isfinite(x[train]), x[train], np.nan), axis=0)
    mu, sd = np.nan_to_num(mu), np.where(np.isfinite(sd) & (sd > 0), sd, 1.0)
    z = np.nan_to_num((x - mu) / sd, nan=0.0, posinf=0.0, neginf=0.0)
    xt, yt = torch.tensor(z[train], dtype=torch.float32), torch.tensor(y[train], dtype=torch.float32)
    info = {
        "n_train": int(train.sum()),
        "n_test": int(test.sum()),
        "train_samples": len({g for g, t in zip(groups, train) if t}),
        "test_samples": len({g for g, t in zip(groups, test) if t}),
        "positive_rate": float(np.mean(y)) if len(y) else math.nan,
    }
    if yt.numel() == 0 or float(yt.min()) == float(yt.max()):
        return info | {"auroc": math.nan, "note": "training rows hold one class only"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(z.shape[1], hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )
        opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-3)
        pos = float(yt.sum())
        loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((len(yt) - pos) / pos))
        for _ in range(epochs):
            opt.zero_grad()
            loss = loss_fn(net(xt)[:, 0], yt)
            loss.backward()
            opt.step()
        with torch.no_grad():
            scores = net(torch.tensor(z[test], dtype=torch.float32))[:, 0].numpy()
    return info | {"auroc": auroc(scores, y[test])}


def analyse(traces: list[Trace], *, seed: int = 0) -> dict[str, dict]:
    """Per task: steps, samples, Pearson r per feature vs accept length, MLP AUROC for a = 1."""
    out = {}
    for task in dict.fromkeys(t.task for t in traces):
        ts = [t for t in traces if t.task == task and len(t.accept)]
        if not ts:
            continue
        x = np.concatenate([t.features for t in ts])
        a = np.concatenate([t.accept for t in ts])
        groups = [t.sample for t in ts for _ in range(len(t.accept))]
        res = {
            "steps": int(len(a)),
            "samples": len(set(groups)),
            "mean_accept": float(a.mean()),
            "pearson": {f: pearson(x[:, i], a) for i, f in enumerate(FEATURES)},
        }
        try:
            res["mlp_accept_eq_1"] = mlp_auroc(x, (a == 1).astype(np.float64), groups, seed=seed)
        except ValueError as e:
            res["mlp_accept_eq_1"] = {"auroc": math.nan, "note": str(e)}
        out[task] = res
    return out


def heatmap(analysis: dict[str, dict], path: str | os.PathLike, title: str = "Pearson r with accept length") -> Path:
    """Features × tasks heatmap of r values (like the paper's Fig. 3)."""
    plt = pyplot()
    tasks = list(analysis)
    r = np.array([[analysis[t]["pearson"][f] for t in tasks] for f in FEATURES], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(1.3 * len(tasks) + 3, 0.36 * len(FEATURES) + 1.2))
    im = ax.imshow(np.nan_to_num(r), cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_yticks(range(len(FEATURES)), FEATURES, fontsize=8)
    for i in range(r.shape[0]):
        for j in range(r.shape[1]):
            ax.text(j, i, "n/a" if not np.isfinite(r[i, j]) else f"{r[i, j]:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def analyse_results(
    results: dict,
    ctx,
    out_dir: str | os.PathLike,
    methods: Sequence[str] = DEFAULT_METHODS,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Trace, analyse and write ``regime.json``, ``regime_heatmap.png`` and ``regime.md`` into ``out_dir``."""
    traces = trace_results(results, ctx.heads, ctx.model, methods, progress=progress)
    if not traces:
        raise ValueError(f"no records of {list(methods)} with accept lengths in these results")
    analysis = analyse(traces, seed=seed)
    # Pooled figures mix drafters whose confidences differ; each method is also analysed alone.
    traced = list(dict.fromkeys(t.method for t in traces))
    by_method = {m: analyse([t for t in traces if t.method == m], seed=seed) for m in traced} if len(traced) > 1 else {}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": "entmtp-regime",
        "format_version": 1,
        "methods": list(methods),
        "features": list(FEATURES),
        "target": "accept length of the step (tokens added)",
        "split": "by sample (prompt id), 30% test",
        "source": results.get("environment", {}).get("date_utc"),
        "tasks": analysis,
        "by_method": by_method,
        "traces": [
            {
                "task": t.task,
                "sample": t.sample,
                "method": t.method,
                "features": t.features.tolist(),
                "accept": t.accept.tolist(),
            }
            for t in traces
        ],
    }
    (out_dir / "regime.json").write_text(json.dumps(json_safe(doc), allow_nan=False), encoding="utf-8")
    heatmap(analysis, out_dir / "regime_heatmap.png", f"Pearson r with accept length ({', '.join(methods)})")
    (out_dir / "regime.md").write_text(regime_markdown(doc) + "\n", encoding="utf-8")
    return doc


def _cell(x: float | None, fmt: str) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:{fmt}}"


def _analysis_table(analysis: dict[str, dict], features: Sequence[str]) -> list[str]:
    tasks = list(analysis)
    lines = ["| feature | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for f in features:
        lines.append(f"| {f} | " + " | ".join(_cell(analysis[t]["pearson"].get(f), "+.2f") for t in tasks) + " |")
    aur = [analysis[t]["mlp_accept_eq_1"].get("auroc") for t in tasks]
    lines.append("| **MLP AUROC (a = 1)** | " + " | ".join(_cell(a, ".2f") for a in aur) + " |")
    steps = [f"{analysis[t]['steps']} steps / {analysis[t]['samples']} samples" for t in tasks]
    lines.append("| rows | " + " | ".join(steps) + " |")
    return lines


def regime_markdown(doc: dict) -> str:
    """Table of r values (features × tasks) and the MLP AUROC row: one per method when several
    were traced (then the pooled table last)."""
    by_method = doc.get("by_method") or {}
    if not by_method:
        return "\n".join(_analysis_table(doc["tasks"], doc["features"]))
    lines: list[str] = []
    for method, analysis in by_method.items():
        lines += [f"### {method}", "", *_analysis_table(analysis, doc["features"]), ""]
    lines += ["### all methods pooled", "", *_analysis_table(doc["tasks"], doc["features"])]
    return "\n".join(lines)


# ============================================================================ CLI
def _regime(args: argparse.Namespace) -> int:
    from .bench.context import load_context
    from .bench.results import read_results
    from .machine import set_threads

    set_threads(args.threads)
    results = read_results(args.results)
    random_heads = any(str(v).startswith("random") for v in results.get("context", {}).get("heads", {}).values())
    ctx = load_context(
        args.model,
        heads={"hydra": args.hydra_heads, "medusa": args.medusa_heads, "eagle": args.eagle_heads},
        random_missing=random_heads or args.random_heads,
        device=args.device,
    )
    out = Path(args.out) if args.out else Path(args.results).parent
    doc = analyse_results(results, ctx, out, tuple(args.methods), seed=args.seed, progress=True)
    print(regime_markdown(doc))
    print(f"wrote {out / 'regime.json'}, {out / 'regime_heatmap.png'}, {out / 'regime.md'}")
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register ``entmtp-hf regime``."""
    p = sub.add_parser(
        "regime",
        help="per-step regime analysis of a bench run (Pearson r, AUROC, heatmap)",
        description="Trace the EntMTP records of RESULTS.json step by step and correlate "
        "per-step features with the accept length.",
    )
    p.add_argument("results", help="results.json written by entmtp-hf bench")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="methods whose records are traced")
    p.add_argument("--model", default=None, help="base model (default: the demo model)")
    p.add_argument("--hydra-heads", default=None)
    p.add_argument("--medusa-heads", default=None)
    p.add_argument("--eagle-heads", default=None)
    p.add_argument("--random-heads", action="store_true", help="random heads where trained ones are missing")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default: next to RESULTS)")
    p.set_defaults(func=_regime)
