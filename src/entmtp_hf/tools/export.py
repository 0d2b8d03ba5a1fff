"""``entmtp-hf export``: a bank's tree as the settings of TensorRT-LLM, vLLM or SGLang.

An engine takes one fixed tree (TensorRT-LLM), a chain (vLLM, which verifies drafts as a chain
whatever tree it drafted) or only a budget (SGLang), and each has rules on the tree's shape. The
export takes the bank's EntMTP* tree (``bank.scheduler.static``, or a stored machine entry's),
projects it onto the largest subtree (or chain) the engine takes, says which
nodes that dropped and what it costs in tokens per step by the bank's acceptance frontier, and
prints the engine's own keyword arguments and command-line flags. Every rule names the engine
file it was read from; docs/export.md has the versions and the details.

No engine runs Hydra heads: the tree suits the engine's own drafter family (Medusa heads or an
EAGLE draft model), and the bank's tokens per step are those of the bank's heads.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Callable, Iterator, Mapping

from ..banks.bank import SHIPPED_DIR, SchedulerDefaults, TopologyBank, shipped_bank_path
from ..errors import EntMTPError
from ..trees.tree import Path, Tree, canonical_order
from .checkpoint import write_json

Paths = frozenset[Path]
Frontier = list[tuple[Paths, float]]

#: the drafter families each engine runs a tree with; the first is the default
DRAFTERS: dict[str, tuple[str, ...]] = {
    "trtllm": ("medusa", "eagle"),
    "vllm": ("eagle", "medusa"),
    "sglang": ("eagle",),
}

#: where each engine's rules were read (docs/export.md has the versions)
SOURCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("trtllm", "medusa"): (
        "tensorrt_llm/llmapi/llm_args.py (MedusaDecodingConfig)",
        "tensorrt_llm/runtime/medusa_utils.py (_medusa_setup, get_medusa_tree)",
        "tensorrt_llm/models/medusa/config.py (max_draft_len 63, num_medusa_heads 4)",
    ),
    ("trtllm", "eagle"): (
        "tensorrt_llm/llmapi/llm_args.py (EagleDecodingConfig.check_eagle_choices)",
        "tensorrt_llm/_torch/speculative/spec_tree_manager.py (top_k_list per node)",
        "NVIDIA/TensorRT-LLM#11761 (deprecated), #18210 (removed), #10325 (a chain as eagle_choices crashes)",
    ),
    ("vllm", "eagle"): (
        "vllm/v1/sample/rejection_sampler.py (draft i checked against the target at position i-1: a chain)",
        "vllm/config/speculative.py (num_speculative_tokens)",
        "vllm-project/vllm#22752 (tree rejection sampler, closed unmerged)",
    ),
    ("vllm", "eagle-tree"): (
        "vllm/config/speculative.py (speculative_token_tree, breadth-first sort, unchecked)",
        "vllm/v1/spec_decode/eagle.py (child_drafts_per_level: one top-k per level)",
        "vllm/v1/attention/backends/tree_attn.py",
        "vllm/v1/sample/rejection_sampler.py (a chain)",
        "vllm-project/vllm#42121 (tree attention removed)",
    ),
    ("vllm", "medusa"): ("vllm/v1/spec_decode/medusa.py (argmax of each head)",),
    ("sglang", "eagle"): (
        "python/sglang/srt/speculative/eagle_utils.py (select_top_k_tokens, organize_draft_results)",
        "python/sglang/srt/server_args.py (topk 1 => num_draft_tokens = num_steps + 1; topk > 1 with "
        "page_size > 1 needs flashinfer or fa3)",
        "sgl-project/sglang#26866 (SpecV2 with topk > 1 at page_size 1)",
    ),
}

HYDRA_NOTE = (
    "No engine runs Hydra heads: this is the bank's tree for its own heads, to be drafted by the "
    "engine's drafter family; tokens per step are the bank's figures for its heads on its task."
)


# ============================================================================ shape rules
def first_gap(children: set[int]) -> int:
    """How many child ranks 0, 1, 2, ... a node has before the first missing one."""
    k = 0
    while k in children:
        k += 1
    return k


def child_ranks(paths: Paths) -> dict[Path, set[int]]:
    """Parent path (the root is ``()``) -> the ranks of its children."""
    kids: dict[Path, set[int]] = {}
    for p in paths:
        kids.setdefault(p[:-1], set()).add(p[-1])
    return kids


def within_depth(paths: Paths, depth: int | None) -> Paths:
    """The nodes at most ``depth`` deep (an engine drafts one level per head or draft step)."""
    return paths if depth is None else frozenset(p for p in paths if len(p) <= depth)


def contiguous(paths: Paths, up_to_depth: int | None = None) -> Paths:
    """The nodes whose siblings of lower rank are all there, at depths up to ``up_to_depth``.

    A top-k drafter drafts a node's k children as ranks 0..k-1; a rank behind a gap would be
    drafted as another token. Its subtree goes with it.
    """
    kept: set[Path] = set()
    for p in canonical_order(paths):  # parents first, then ranks in order
        rooted = len(p) == 1 or p[:-1] in kept
        closed = p[-1] == 0 or p[:-1] + (p[-1] - 1,) in kept or (up_to_depth is not None and len(p) > up_to_depth)
        if rooted and closed:
            kept.add(p)
    return frozenset(kept)


def top1_chain(paths: Paths) -> Paths:
    """The top-1 chain ``[0], [0, 0], ...`` inside the tree: what one argmax per head drafts."""
    chain, p = set(), (0,)
    while p in paths:
        chain.add(p)
        p = p + (0,)
    return frozenset(chain)


def uniform_subtrees(paths: Paths) -> Iterator[Paths]:
    """Every subtree in which all nodes of a level have the same children ranks 0..k-1."""
    gaps = {parent: first_gap(ranks) for parent, ranks in child_ranks(paths).items()}

    def grow(level: list[Path], kept: Paths) -> Iterator[Paths]:
        yield kept
        for k in range(1, min(gaps.get(p, 0) for p in level) + 1):
            nxt = [p + (r,) for p in level for r in range(k)]
            yield from grow(nxt, kept | frozenset(nxt))

    return grow([()], frozenset())


def best_chain(paths: Paths, frontier: Frontier) -> Paths:
    """The prefix of the tree's top-1 chain that the bank's figures support best.

    vLLM verifies drafts as a chain, so only the tree's chain ``[0], [0, 0], ...`` counts; each of
    its prefixes verifies no more tokens than the tree did. A prefix's figure is the frontier's
    lower bound (exact for a frontier chain); the shortest prefix reaching the best figure wins, as
    a longer one costs draft steps that no figure shows paying. Without any chain figure (no
    frontier, or none inside the chain) the whole chain is kept.
    """
    chain = sorted(top1_chain(paths), key=len)
    figures = [
        max((v for s, v in frontier if s and s <= frozenset(chain[:k])), default=None) for k in range(1, len(chain) + 1)
    ]
    known = [(v, -k) for k, v in enumerate(figures, start=1) if v is not None]
    if not known:
        return frozenset(chain)
    return frozenset(chain[: -max(known)[1]])


def largest_uniform(paths: Paths, budget: int | None, frontier: Frontier) -> Paths:
    """The largest level-uniform subtree within ``budget`` nodes; ties go to the higher frontier bound."""
    fits = (s for s in uniform_subtrees(paths) if budget is None or len(s) <= budget)
    return max(fits, key=lambda s: (len(s), accept_bounds(s, frontier)[0] or 0.0))


def frontier_priority(frontier: Frontier) -> Callable[[Path], float]:
    """A node's value order: the size of the first frontier tree holding it (the search added the
    most valuable node first); nodes of no frontier tree come last."""
    first: dict[Path, int] = {}
    for s, _ in sorted(frontier, key=lambda item: len(item[0])):
        for p in s:
            first.setdefault(p, len(s))
    return lambda p: first.get(p, float("inf"))


def within_budget(paths: Paths, budget: int | None, priority: Callable[[Path], float]) -> Paths:
    """The ``budget`` most valuable nodes that still form a tree, creating no gap between siblings.

    A node is ranked after everything it needs (its parent and its next-lower sibling), so every
    prefix of the order is a valid tree.
    """
    if budget is None or len(paths) <= budget:
        return paths
    rank: dict[Path, float] = {}
    for p in canonical_order(paths):  # what a node needs comes before it in this order
        needs = [q for q in (p[:-1], p[:-1] + (p[-1] - 1,)) if q in rank]
        rank[p] = max([priority(p), *(rank[q] for q in needs)])
    order = sorted(paths, key=lambda p: (rank[p], len(p), p))
    return frozenset(order[:budget])


@dataclass(frozen=True)
class Rule:
    """One requirement of an engine, in words, and the projection onto the trees that meet it."""

    text: str
    project: Callable[[Paths], Paths]


def rules_for(target: tuple[str, str], max_depth: int | None, max_nodes: int | None, frontier: Frontier) -> list[Rule]:
    """The rules of ``target`` (engine, drafter variant) in the order they apply, with the user's
    depth and node caps where given."""
    caps = f" within {max_nodes} drafted nodes (--max-nodes)" if max_nodes else ""
    depth = [Rule(f"at most {max_depth} levels (--max-depth)", lambda s: within_depth(s, max_depth))]
    depth = depth if max_depth else []
    budget = (
        [
            Rule(
                f"at most {max_nodes} drafted nodes (--max-nodes), the most valuable first",
                lambda s: within_budget(s, max_nodes, frontier_priority(frontier)),
            )
        ]
        if max_nodes
        else []
    )
    topk = Rule("each node's children are its top-k: ranks 0..k-1 without gaps", contiguous)
    if target == ("trtllm", "medusa"):
        return [*depth, Rule("the first level's ranks 0..k-1 without gaps", lambda s: contiguous(s, 1)), *budget]
    if target == ("vllm", "medusa"):
        return [*depth, Rule("a top-1 chain: one argmax per Medusa head", top1_chain), *budget]
    if target == ("vllm", "eagle"):
        chain = Rule(
            "vLLM verifies drafts as a chain: the tree's top-1 chain, as long as the bank's figures support",
            lambda s: best_chain(s, frontier),
        )
        return [*depth, chain, *budget]
    if target == ("vllm", "eagle-tree"):
        uniform = Rule(
            f"every node of a level has the same number of children{caps}",
            lambda s: largest_uniform(s, max_nodes, frontier),
        )
        return [*depth, topk, uniform]
    return [*depth, topk, *budget]


def project(tree: Tree, rules: list[Rule]) -> tuple[Tree, list[dict[str, Any]]]:
    """The tree after every rule, and what each rule dropped."""
    paths, steps = frozenset(tree.paths), []
    for rule in rules:
        kept = rule.project(paths)
        steps.append({"rule": rule.text, "dropped": [list(p) for p in canonical_order(paths - kept)]})
        paths = kept
    return Tree.from_choices(canonical_order(paths)), steps


# ============================================================================ tokens per step
def frontier_of(bank: TopologyBank) -> Frontier:
    """The bank's acceptance frontier as (node set, debiased tokens per step) pairs."""
    return [(frozenset(bank.trees[k].paths), value) for k, value in bank.frontier.items()]


def accept_bounds(paths: Paths, frontier: Frontier) -> tuple[float | None, float | None]:
    """Tokens per step of a tree bounded by the frontier: the largest frontier tree inside it and
    the smallest one around it (a tree's greedy accept length never drops when nodes are added)."""
    lower = max((v for s, v in frontier if s <= paths), default=None)
    upper = min((v for s, v in frontier if paths <= s), default=None)
    return lower, upper


def tokens_per_step(source: Tree, exported: Tree, frontier: Frontier, dynamic: bool) -> dict[str, Any]:
    """The source tree's tokens per step, the exported tree's bounds, and the loss between them."""
    if not frontier:
        return {"estimate": "the bank carries no acceptance frontier: no modelled tokens per step"}
    src_lo, src_hi = accept_bounds(frozenset(source.paths), frontier)
    out = {"source": src_lo if src_lo == src_hi else None, "source_bounds": [src_lo, src_hi]}
    if dynamic:
        return {**out, "estimate": "the engine picks its tree each step from the drafter's scores: not modelled"}
    lo, hi = accept_bounds(frozenset(exported.paths), frontier)
    lost = [None if None in (src_lo, hi) else max(src_lo - hi, 0.0), None if None in (src_hi, lo) else src_hi - lo]
    return {
        **out,
        "exported_bounds": [lo, hi],
        "lost_bounds": lost,
        "estimate": "frontier bounds: the largest frontier tree inside the tree (lower) and the smallest "
        "one around it (upper)",
    }


# ============================================================================ engine settings
def choices_literal(tree: Tree) -> str:
    """vLLM's ``speculative_token_tree``: a Python literal of a list of tuples, breadth-first."""
    return str(list(tree.paths))


def sglang_budget(tree: Tree) -> tuple[int, int, int]:
    """The smallest (num_steps, eagle_topk, num_draft_tokens) under which SGLang can build ``tree``.

    Each draft step adds a level and expands the topk best nodes by topk children each, so the
    depth bounds the steps, and both a node's highest child rank and a level's count of nodes with
    children bound topk; the draft tokens count the root.
    """
    kids = child_ranks(frozenset(tree.paths))
    inner = [sum(1 for parent in kids if len(parent) == d) for d in range(1, tree.depth)]
    topk = max([max(r) + 1 for r in kids.values()] + inner)
    return tree.depth, topk, tree.num_nodes


def is_chain(tree: Tree) -> bool:
    """Whether the tree is the top-1 chain ``[0], [0, 0], ...`` (one drafted node per level)."""
    return tree.num_nodes - 1 == tree.depth and all(set(p) == {0} for p in tree.paths)


def engine_config(target: tuple[str, str], tree: Tree) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's own keyword names and values for ``tree``, and the other engine options it needs."""
    if tree.num_nodes == 1:
        return {}, {}
    drafted, choices = tree.num_nodes - 1, tree.choices
    if target == ("trtllm", "medusa"):
        return {"decoding_type": "Medusa", "max_draft_len": drafted, "medusa_choices": choices}, {}
    if target == ("trtllm", "eagle") and is_chain(tree):  # the one-model EAGLE-3 drafts a chain of max_draft_len
        return {"decoding_type": "Eagle", "max_draft_len": drafted}, {}
    if target == ("trtllm", "eagle"):
        return {
            "decoding_type": "Eagle",
            "max_draft_len": tree.depth,
            "max_total_draft_tokens": drafted,
            "eagle_choices": choices,
            "eagle3_one_model": False,
        }, {}
    if target == ("vllm", "medusa"):
        return {"method": "medusa", "num_speculative_tokens": drafted}, {}
    if target == ("vllm", "eagle"):  # a chain: the same keys before and after vllm#42121
        return {"method": "eagle3", "num_speculative_tokens": drafted}, {}
    if target == ("vllm", "eagle-tree"):
        tree_text = choices_literal(tree)
        return {"method": "eagle3", "num_speculative_tokens": drafted, "speculative_token_tree": tree_text}, {
            "attention_backend": "TREE_ATTN"
        }
    steps, topk, tokens = sglang_budget(tree)
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": tokens,
    }, {}


#: what vLLM does with a branching speculative_token_tree, said wherever one is exported
VLLM_TREE_NOTE = (
    "vLLM verifies drafted tokens as a chain (v1/sample/rejection_sampler.py: draft i against the "
    "target's prediction at flattened position i-1; the tree rejection sampler vllm#22752 was closed "
    "unmerged): a branching tree is checked breadth-first as one chain, gains nothing, and a sibling "
    "matching by chance can be accepted on the wrong prefix"
)


def engine_notes(target: tuple[str, str], tree: Tree) -> list[str]:
    """What else the engine needs or does with this tree, from its sources."""
    topk = sglang_budget(tree)[1] if tree.num_nodes > 1 else 1
    sglang = [
        "SGLang builds its tree each step from the drafter's scores: this budget makes the exported tree one "
        "it can build; EAGLE for EAGLE-2 drafts"
    ]
    if topk > 1:
        sglang.append(
            "topk > 1: with page_size > 1 it needs the flashinfer or fa3 attention backend (server_args.py "
            "refuses triton and the others); SpecV2 (the overlap worker) takes it at page_size 1 since "
            "sglang#26866 and falls back to v1 above; trtllm_mha needs topk 1"
        )
    notes = {
        ("trtllm", "medusa"): [
            f"TensorRT backend only; the checkpoint needs num_medusa_heads >= {tree.depth} and "
            f"the engine max_draft_len >= {tree.num_nodes - 1} (default 63)"
        ],
        ("trtllm", "eagle"): [
            "a chain: the one-model EAGLE-3 (the default) drafts max_draft_len tokens; no "
            "eagle_choices (a chain written as eagle_choices with eagle3_one_model=False crashes "
            "on 1.2.0rc6: TensorRT-LLM#10325)"
        ]
        if is_chain(tree)
        else [
            "eagle_choices needs the two-model EAGLE-3 (eagle3_one_model=False); deprecated in "
            "TensorRT-LLM#11761 and removed in #18210: use a release from before it"
        ],
        ("vllm", "eagle"): [
            "a chain of num_speculative_tokens drafts, valid on releases before and after vllm#42121 "
            "(which removed tree attention); method 'eagle' for EAGLE-1 drafts",
            VLLM_TREE_NOTE,
        ],
        ("vllm", "eagle-tree"): [
            "--vllm-tree: speculative_token_tree needs the TREE_ATTN attention backend (before "
            "vllm#26315: VLLM_ATTENTION_BACKEND=TREE_ATTN) and a release between vllm#20401 and "
            "vllm#42121 (0.18.0 has it)",
            VLLM_TREE_NOTE,
        ],
        ("vllm", "medusa"): ["vLLM's Medusa drafts the argmax of each head: a top-1 chain, one token per head"],
        ("sglang", "eagle"): sglang,
    }
    return [HYDRA_NOTE, *notes[target]]


# ============================================================================ snippets
def _py(value: Any) -> str:
    """A Python literal with double quotes, as the engines' documentation writes them."""
    return repr(value) if isinstance(value, bool) else json.dumps(value)


def _kwargs(config: Mapping[str, Any], indent: str = "    ") -> str:
    return "".join(f"{indent}{k}={_py(v)},\n" for k, v in config.items())


def trtllm_snippet(config: dict[str, Any]) -> str:
    """The LLM API's decoding config in Python, and the same keys as LLM-API YAML."""
    kind = config["decoding_type"]
    kwargs = {k: v for k, v in config.items() if k != "decoding_type"}
    draft = "<Medusa heads>" if kind == "Medusa" else "<EAGLE-3 draft model>"
    yaml = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in config.items())
    return (
        f"# Python (TensorRT-LLM LLM API)\nfrom tensorrt_llm import LLM\nfrom tensorrt_llm.llmapi import "
        f"{kind}DecodingConfig\n\nspeculative_config = {kind}DecodingConfig(\n{_kwargs(kwargs)}"
        f"    speculative_model={_py(draft)},\n)\n"
        f'llm = LLM("<target model>", speculative_config=speculative_config)\n\n'
        f"# YAML (trtllm-serve / trtllm-bench --config FILE)\nspeculative_config:\n{yaml}"
        f"  speculative_model: {draft}\n"
    )


def vllm_snippet(config: dict[str, Any], options: dict[str, Any]) -> str:
    """``LLM(..., speculative_config={...})`` and the same as ``vllm serve`` flags."""
    draft = "<Medusa heads>" if config["method"] == "medusa" else "<EAGLE-3 draft model>"
    spec = {"method": config["method"], "model": draft, **{k: v for k, v in config.items() if k != "method"}}
    body = "".join(f"        {json.dumps(k)}: {_py(v)},\n" for k, v in spec.items())
    flags = "".join(f" --{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in options.items())
    return (
        f'# Python (vLLM)\nfrom vllm import LLM\n\nllm = LLM(\n    model="<target model>",\n{_kwargs(options)}'
        f"    speculative_config={{\n{body}    }},\n)\n\n# command line\n"
        f"vllm serve '<target model>'{flags} --speculative-config {shlex.quote(json.dumps(spec))}\n"
    )


def sglang_snippet(config: dict[str, Any]) -> str:
    """``sglang.Engine(...)`` keyword arguments and the same as ``sglang.launch_server`` flags."""
    args = {
        "speculative_algorithm": config["speculative_algorithm"],
        "speculative_draft_model_path": "<EAGLE-3 draft model>",
        **config,
    }
    flags = " ".join(f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in args.items())
    return (
        f'# Python (SGLang)\nimport sglang as sgl\n\nengine = sgl.Engine(\n    model_path="<target model>",\n'
        f"{_kwargs(args)})\n\n# command line\npython3 -m sglang.launch_server --model-path '<target model>' "
        f"{flags}\n"
    )


def snippet(engine: str, config: dict[str, Any], options: dict[str, Any]) -> str:
    """The text to paste into the engine's setup; nothing to set up when the bank chose plain decoding."""
    if not config:
        return "# the bank's choice is plain decoding: leave speculative decoding off\n"
    if engine == "trtllm":
        return trtllm_snippet(config)
    return vllm_snippet(config, options) if engine == "vllm" else sglang_snippet(config)


# ============================================================================ the export
def pick_tree(scheduler: SchedulerDefaults, which: str, num_trees: int) -> int:
    """The bank tree to export: static (EntMTP*), the hysteresis pair's conservative/aggressive, or an index."""
    if which in ("static", "conservative", "aggressive"):
        return getattr(scheduler, which)
    if not which.isdigit() or int(which) >= num_trees:
        raise ValueError(
            f"--tree must be static, conservative, aggressive or an index below {num_trees}, got {which!r}"
        )
    return int(which)


def machine_scheduler(bank: TopologyBank, machine: str | None, batch_size: int = 1) -> SchedulerDefaults:
    """The stored scheduler, or that of the bank's machine entry at ``batch_size`` whose fingerprint
    key is ``machine`` or whose processor name contains it (the entry a calibration on that machine
    stored; an entry's full key, with its ``-b<B>``, picks that entry whatever the batch size)."""
    if machine is None:
        return bank.scheduler
    tables = bank.machine_tables()

    def named(t) -> bool:
        return machine == t.fingerprint.get("key") or machine.lower() in str(t.fingerprint.get("processor", "")).lower()

    found = [t for t in tables if t.key == machine] or [t for t in tables if t.batch_size == batch_size and named(t)]
    if len(found) != 1:
        known = [f"{t.key} ({t.fingerprint.get('processor')}, batch size {t.batch_size})" for t in tables]
        raise ValueError(
            f"--machine {machine!r} matches {len(found)} of the bank's machine entries at batch size "
            f"{batch_size}: {known}"
        )
    return bank.scheduler_for(found[0])


def scheduler_note(bank: TopologyBank, scheduler: SchedulerDefaults, exported: int) -> dict[str, Any]:
    """What the bank's scheduler would have switched between, which an engine with one tree does not."""

    def tree(k: int) -> dict[str, Any]:
        t = bank.trees[k]
        return {"index": k, "num_nodes": t.num_nodes, "depth": t.depth, "tokens_per_step": bank.frontier.get(k)}

    s = scheduler
    switched = {
        "static": f"the static tree {s.static}",
        "hysteresis": f"trees {s.conservative} and {s.aggressive} "
        f"(T-/T+) on {s.feature} at tau_on {s.tau_on:g} / tau_off {s.tau_off:g}",
        "ladder": f"the ladder {list(s.ladder)} on {s.ladder_feature}",
        "value": f"the value policy's trees {list(s.value)}",
    }.get(s.policy, f"the {s.policy} policy")
    text = (
        f"The bank's default policy is {s.policy}: in generate it runs {switched}. An engine runs one tree "
        f"(SGLang: one budget) for every step: tree {exported} is exported."
    )
    return {
        "policy": s.policy,
        "static": tree(s.static),
        "conservative": tree(s.conservative),
        "aggressive": tree(s.aggressive),
        "tau_on": s.tau_on,
        "tau_off": s.tau_off,
        "feature": s.feature,
        "text": text,
    }


def batch_note(batch_size: int, machine: str | None) -> str:
    """Which batch size the exported tree was chosen for: a machine entry's, or the stored batch-1 choice."""
    if machine is not None:
        return f"ranked with the machine entry's step costs at batch size {batch_size}"
    note = "the bank's stored (batch-1) choice"
    return (
        note
        if batch_size == 1
        else (
            f"{note}, not ranked for batch size {batch_size}: pass --machine with an "
            "entry calibrated at that size (entmtp-hf calibrate --batch-sizes)"
        )
    )


def export(
    bank: TopologyBank,
    engine: str,
    drafter: str | None = None,
    *,
    tree: str = "static",
    machine: str | None = None,
    max_depth: int | None = None,
    max_nodes: int | None = None,
    batch_size: int = 1,
    vllm_tree: bool = False,
) -> dict[str, Any]:
    """The export of one bank task to one engine, as the JSON the CLI writes (``vllm_tree``: vLLM's
    branching ``speculative_token_tree`` instead of the chain it verifies)."""
    if engine not in DRAFTERS:
        raise ValueError(f"engine must be one of {sorted(DRAFTERS)}, got {engine!r}")
    drafter = drafter or DRAFTERS[engine][0]
    if drafter not in DRAFTERS[engine]:
        raise ValueError(f"{engine} runs a tree with drafters {DRAFTERS[engine]}, not {drafter!r}")
    if vllm_tree and (engine, drafter) != ("vllm", "eagle"):
        raise ValueError(f"--vllm-tree is vLLM's EAGLE speculative_token_tree, not {engine} with {drafter}")
    target = (engine, "eagle-tree" if vllm_tree else drafter)
    scheduler = machine_scheduler(bank, machine, batch_size)
    index = pick_tree(scheduler, tree, len(bank))
    source, frontier = bank.trees[index], frontier_of(bank)
    exported, steps = project(source, rules_for(target, max_depth, max_nodes, frontier))
    config, options = engine_config(target, exported)
    return {
        "engine": engine,
        "drafter": drafter,
        "vllm_tree": vllm_tree,
        "task": bank.task,
        "source_tree": {"index": index, "num_nodes": source.num_nodes, "depth": source.depth, "tree": source.choices},
        "tree": exported.choices,
        "config": config,
        "engine_options": options,
        "dropped": [p for step in steps for p in step["dropped"]],
        "projection": steps,
        "tokens_per_step": tokens_per_step(source, exported, frontier, dynamic=engine == "sglang"),
        "scheduler": scheduler_note(bank, scheduler, index),
        "machine": machine,
        "batch_size": batch_size,
        "batch_note": batch_note(batch_size, machine),
        "notes": engine_notes(target, exported),
        "sources": list(SOURCES[target]),
    }


def _number(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"


def report_lines(result: dict[str, Any]) -> list[str]:
    """The export's report as comment lines above the snippet."""
    src, tps = result["source_tree"], result["tokens_per_step"]
    lines = [
        f"# entmtp-hf export: task {result['task']} -> {result['engine']} ({result['drafter']} drafter)",
        f"# bank tree {src['index']}: {src['num_nodes']} nodes, depth {src['depth']}; exported: "
        f"{len(result['tree']) + 1} nodes",
    ]
    lines += [f"# dropped ({step['rule']}): {step['dropped']}" for step in result["projection"] if step["dropped"]]
    if "source_bounds" not in tps:
        lines.append(f"# tokens per step: {tps['estimate']}")
    elif "exported_bounds" in tps and not result["dropped"]:
        lines.append(f"# tokens per step: {_number(tps['source'])}, the bank tree's: nothing dropped")
    elif "exported_bounds" in tps:
        (lo, hi), (lost_lo, lost_hi) = tps["exported_bounds"], tps["lost_bounds"]
        lines.append(
            f"# tokens per step: bank tree {_number(tps['source'])}; exported {_number(lo)}..{_number(hi)}; "
            f"lost {_number(lost_lo)}..{_number(lost_hi)} ({tps['estimate']})"
        )
    else:
        lines.append(f"# tokens per step: bank tree {_number(tps.get('source'))} ({tps['estimate']})")
    lines += [f"# {result['scheduler']['text']}", f"# batch size {result['batch_size']}: {result['batch_note']}"]
    return lines + [f"# note: {n}" for n in result["notes"]]


# ============================================================================ CLI
def bank_source(name: str) -> str | FilePath:
    """A folder, a shipped bank's name (``smollm2-135m-cpu``) or a Hub repo id, in that order."""
    if FilePath(name).is_dir() or not (SHIPPED_DIR / name).is_dir():
        return name
    return shipped_bank_path(name)


def _write_out(out: str, result: dict[str, Any]) -> FilePath:
    """The export as JSON in ``out``; a path that cannot be written is refused in one line."""
    try:
        return write_json(out, result)
    except OSError as e:
        raise EntMTPError(f"--out {out}: cannot write the export there ({e.strerror or e})") from None


def _run(args: argparse.Namespace) -> int:
    if args.out and os.path.isdir(args.out):  # refused before any work, like any bad argument
        raise EntMTPError(f"--out {args.out} is a folder; give the path of the JSON file to write")
    bank = TopologyBank.from_pretrained(bank_source(args.bank), task=args.task, revision=args.revision)
    result = export(
        bank,
        args.to,
        args.drafter,
        tree=args.tree,
        machine=args.machine,
        max_depth=args.max_depth,
        max_nodes=args.max_nodes,
        batch_size=args.batch_size,
        vllm_tree=args.vllm_tree,
    )
    result["bank"], result["revision"] = args.bank, args.revision
    print("\n".join(report_lines(result)) + "\n")
    print(snippet(result["engine"], result["config"], result["engine_options"]), end="")
    if args.out:
        print(f"# wrote {_write_out(args.out, result)}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a bank's tree as TensorRT-LLM, vLLM or SGLang speculative-decoding settings",
        description="Project a bank task's EntMTP* tree onto what the engine accepts, report the dropped nodes and "
        "the modelled tokens per step lost, and print the engine's keyword arguments and flags.",
    )
    p.add_argument("bank", help="bank folder, shipped bank name (smollm2-135m-cpu, published-defaults) or Hub repo id")
    p.add_argument("--task", required=True, help="task of the bank")
    p.add_argument("--to", required=True, choices=sorted(DRAFTERS), help="the engine")
    p.add_argument(
        "--drafter",
        default=None,
        help="trtllm: medusa (default) or eagle; vllm: eagle (default) or medusa; sglang: eagle",
    )
    p.add_argument("--tree", default="static", help="static (EntMTP*, default), conservative, aggressive or an index")
    p.add_argument("--machine", default=None, help="use this stored machine entry's scheduler (key or processor name)")
    p.add_argument("--max-depth", type=_positive, default=None, help="deepest level the drafter drafts (e.g. heads)")
    p.add_argument("--max-nodes", type=_positive, default=None, help="most drafted nodes the engine takes")
    p.add_argument("--batch-size", type=_positive, default=1, help="serving batch size (banks are batch-1 today)")
    p.add_argument(
        "--vllm-tree",
        action="store_true",
        help="vLLM: write a branching speculative_token_tree (TREE_ATTN; releases between vllm#20401 and "
        "#42121, e.g. 0.18.0) instead of the chain; vLLM still verifies it as a chain",
    )
    p.add_argument("--revision", default=None, help="Hub revision of BANK")
    p.add_argument("--out", default=None, help="also write the export as JSON to this file")
    p.set_defaults(func=_run)
