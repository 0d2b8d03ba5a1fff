"""The serving engines ``entmtp-hf export`` writes a tree for, each registered with its drafters.

An engine registers itself (:func:`register_engine`: how its settings are written out) and each
drafter family it runs a tree with (:func:`register_target`: the shape rules the tree must meet, the
engine's keyword arguments for a tree, what else to know, and the engine files all of it was read
from; docs/export.md has the versions). The export and its command line read these tables only, so
an engine or a drafter is added here, in one section, without touching them.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..trees.tree import Tree
from .export_shapes import (
    TOPK,
    Frontier,
    Rule,
    best_chain,
    budget_rules,
    child_ranks,
    contiguous,
    largest_uniform,
    top1_chain,
)

HYDRA_NOTE = (
    "No engine runs Hydra heads: this is the bank's tree for its own heads, to be drafted by the "
    "engine's drafter family; tokens per step are the bank's figures for its heads on its task."
)


# ============================================================================ the registry
Settings = tuple[dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class Engine:
    """A serving engine: how its settings are written out (``snippet(config, engine_options)``);
    ``picks_tree``: it builds its tree each step from the drafter's scores (tokens per step not modelled)."""

    name: str
    snippet: Callable[[dict[str, Any], dict[str, Any]], str]
    picks_tree: bool = False


@dataclass(frozen=True)
class Target:
    """An engine running a tree with one drafter family: the rules the tree must meet (``shape(frontier,
    max_nodes)``, after the user's depth cap), the engine settings a tree is written as (its keyword
    arguments and the other engine options it needs), what else to know (``notes``), and the engine
    files all of it was read from. ``branching``: the variant that writes a branching tree
    (``--vllm-tree``), if the engine has one."""

    engine: str
    drafter: str
    sources: tuple[str, ...]
    shape: Callable[[Frontier, int | None], list[Rule]]
    settings: Callable[[Tree], Settings]
    notes: Callable[[Tree], list[str]]
    branching: Target | None = None


ENGINES: dict[str, Engine] = {}
#: (engine, drafter or variant) -> what exporting to it takes
TARGETS: dict[tuple[str, str], Target] = {}
#: the drafter families each engine runs a tree with, in registration order; the first is the default
DRAFTERS: dict[str, tuple[str, ...]] = {}


def register_engine(
    name: str, snippet: Callable[[dict[str, Any], dict[str, Any]], str], *, picks_tree: bool = False
) -> None:
    """Register a serving engine under ``name`` (what ``--to`` takes); its drafters follow with
    :func:`register_target`. A name registered already is refused (``ValueError``)."""
    if name in ENGINES:
        raise ValueError(f"engine {name!r} is registered already")
    ENGINES[name] = Engine(name, snippet, picks_tree)
    DRAFTERS[name] = ()


def register_target(target: Target) -> None:
    """Register a drafter family of a registered engine (and its branching variant); the engine's
    first registered drafter is its default. A pair registered already is refused (``ValueError``)."""
    if target.engine not in ENGINES:
        raise ValueError(f"register the engine {target.engine!r} before its drafters")
    for t in (target, target.branching) if target.branching else (target,):
        if (t.engine, t.drafter) in TARGETS:
            raise ValueError(f"{t.engine} with {t.drafter} is registered already")
        TARGETS[(t.engine, t.drafter)] = t
    DRAFTERS[target.engine] += (target.drafter,)


def engine_config(target: tuple[str, str], tree: Tree) -> Settings:
    """The engine's own keyword names and values for ``tree``, and the other engine options it needs."""
    return ({}, {}) if tree.num_nodes == 1 else TARGETS[target].settings(tree)


def engine_notes(target: tuple[str, str], tree: Tree) -> list[str]:
    """What else the engine needs or does with this tree, from its sources."""
    return [HYDRA_NOTE, *TARGETS[target].notes(tree)]


def snippet(engine: str, config: dict[str, Any], options: dict[str, Any]) -> str:
    """The text to paste into the engine's setup; nothing to set up when the bank chose plain decoding."""
    if not config:
        return "# the bank's choice is plain decoding: leave speculative decoding off\n"
    return ENGINES[engine].snippet(config, options)


# ============================================================================ writing settings
def _py(value: Any) -> str:
    """A Python literal with double quotes, as the engines' documentation writes them."""
    return repr(value) if isinstance(value, bool) else json.dumps(value)


def _kwargs(config: Mapping[str, Any], indent: str = "    ") -> str:
    return "".join(f"{indent}{k}={_py(v)},\n" for k, v in config.items())


def is_chain(tree: Tree) -> bool:
    """Whether the tree is the top-1 chain ``[0], [0, 0], ...`` (one drafted node per level)."""
    return tree.num_nodes - 1 == tree.depth and all(set(p) == {0} for p in tree.paths)


# ============================================================================ TensorRT-LLM
def trtllm_medusa(tree: Tree) -> Settings:
    return {"decoding_type": "Medusa", "max_draft_len": tree.num_nodes - 1, "medusa_choices": tree.choices}, {}


def trtllm_eagle(tree: Tree) -> Settings:
    if is_chain(tree):  # the one-model EAGLE-3 drafts a chain of max_draft_len
        return {"decoding_type": "Eagle", "max_draft_len": tree.num_nodes - 1}, {}
    return {
        "decoding_type": "Eagle",
        "max_draft_len": tree.depth,
        "max_total_draft_tokens": tree.num_nodes - 1,
        "eagle_choices": tree.choices,
        "eagle3_one_model": False,
    }, {}


def trtllm_eagle_notes(tree: Tree) -> list[str]:
    if is_chain(tree):
        return [
            "a chain: the one-model EAGLE-3 (the default) drafts max_draft_len tokens; no "
            "eagle_choices (a chain written as eagle_choices with eagle3_one_model=False crashes "
            "on 1.2.0rc6: TensorRT-LLM#10325)"
        ]
    return [
        "eagle_choices needs the two-model EAGLE-3 (eagle3_one_model=False); deprecated in "
        "TensorRT-LLM#11761 and removed in #18210: use a release from before it"
    ]


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


register_engine("trtllm", lambda config, options: trtllm_snippet(config))
register_target(
    Target(
        "trtllm",
        "medusa",
        sources=(
            "tensorrt_llm/llmapi/llm_args.py (MedusaDecodingConfig)",
            "tensorrt_llm/runtime/medusa_utils.py (_medusa_setup, get_medusa_tree)",
            "tensorrt_llm/models/medusa/config.py (max_draft_len 63, num_medusa_heads 4)",
        ),
        shape=lambda frontier, max_nodes: [
            Rule("the first level's ranks 0..k-1 without gaps", lambda s: contiguous(s, 1)),
            *budget_rules(max_nodes, frontier),
        ],
        settings=trtllm_medusa,
        notes=lambda tree: [
            f"TensorRT backend only; the checkpoint needs num_medusa_heads >= {tree.depth} and "
            f"the engine max_draft_len >= {tree.num_nodes - 1} (default 63)"
        ],
    )
)
register_target(
    Target(
        "trtllm",
        "eagle",
        sources=(
            "tensorrt_llm/llmapi/llm_args.py (EagleDecodingConfig.check_eagle_choices)",
            "tensorrt_llm/_torch/speculative/spec_tree_manager.py (top_k_list per node)",
            "NVIDIA/TensorRT-LLM#11761 (deprecated), #18210 (removed), #10325 (a chain as eagle_choices crashes)",
        ),
        shape=lambda frontier, max_nodes: [TOPK, *budget_rules(max_nodes, frontier)],
        settings=trtllm_eagle,
        notes=trtllm_eagle_notes,
    )
)


# ============================================================================ vLLM
def choices_literal(tree: Tree) -> str:
    """vLLM's ``speculative_token_tree``: a Python literal of a list of tuples, breadth-first."""
    return str(list(tree.paths))


#: what vLLM does with a branching speculative_token_tree, said wherever one is exported
VLLM_TREE_NOTE = (
    "vLLM verifies drafted tokens as a chain (v1/sample/rejection_sampler.py: draft i against the "
    "target's prediction at flattened position i-1; the tree rejection sampler vllm#22752 was closed "
    "unmerged): a branching tree is checked breadth-first as one chain, gains nothing, and a sibling "
    "matching by chance can be accepted on the wrong prefix"
)


def vllm_eagle_tree_shape(frontier: Frontier, max_nodes: int | None) -> list[Rule]:
    """Top-k children, and the largest level-uniform subtree (within the node cap: no separate budget rule)."""
    caps = f" within {max_nodes} drafted nodes (--max-nodes)" if max_nodes else ""
    uniform = Rule(
        f"every node of a level has the same number of children{caps}",
        lambda s: largest_uniform(s, max_nodes, frontier),
    )
    return [TOPK, uniform]


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


register_engine("vllm", vllm_snippet)
register_target(
    Target(
        "vllm",
        "eagle",
        sources=(
            "vllm/v1/sample/rejection_sampler.py (draft i checked against the target at position i-1: a chain)",
            "vllm/config/speculative.py (num_speculative_tokens)",
            "vllm-project/vllm#22752 (tree rejection sampler, closed unmerged)",
        ),
        shape=lambda frontier, max_nodes: [
            Rule(
                "vLLM verifies drafts as a chain: the tree's top-1 chain, as long as the bank's figures support",
                lambda s: best_chain(s, frontier),
            ),
            *budget_rules(max_nodes, frontier),
        ],
        # a chain: the same keys before and after vllm#42121
        settings=lambda tree: ({"method": "eagle3", "num_speculative_tokens": tree.num_nodes - 1}, {}),
        notes=lambda tree: [
            "a chain of num_speculative_tokens drafts, valid on releases before and after vllm#42121 "
            "(which removed tree attention); method 'eagle' for EAGLE-1 drafts",
            VLLM_TREE_NOTE,
        ],
        branching=Target(
            "vllm",
            "eagle-tree",
            sources=(
                "vllm/config/speculative.py (speculative_token_tree, breadth-first sort, unchecked)",
                "vllm/v1/spec_decode/eagle.py (child_drafts_per_level: one top-k per level)",
                "vllm/v1/attention/backends/tree_attn.py",
                "vllm/v1/sample/rejection_sampler.py (a chain)",
                "vllm-project/vllm#42121 (tree attention removed)",
            ),
            shape=vllm_eagle_tree_shape,
            settings=lambda tree: (
                {
                    "method": "eagle3",
                    "num_speculative_tokens": tree.num_nodes - 1,
                    "speculative_token_tree": choices_literal(tree),
                },
                {"attention_backend": "TREE_ATTN"},
            ),
            notes=lambda tree: [
                "--vllm-tree: speculative_token_tree needs the TREE_ATTN attention backend (before "
                "vllm#26315: VLLM_ATTENTION_BACKEND=TREE_ATTN) and a release between vllm#20401 and "
                "vllm#42121 (0.18.0 has it)",
                VLLM_TREE_NOTE,
            ],
        ),
    )
)
register_target(
    Target(
        "vllm",
        "medusa",
        sources=("vllm/v1/spec_decode/medusa.py (argmax of each head)",),
        shape=lambda frontier, max_nodes: [
            Rule("a top-1 chain: one argmax per Medusa head", top1_chain),
            *budget_rules(max_nodes, frontier),
        ],
        settings=lambda tree: ({"method": "medusa", "num_speculative_tokens": tree.num_nodes - 1}, {}),
        notes=lambda tree: ["vLLM's Medusa drafts the argmax of each head: a top-1 chain, one token per head"],
    )
)


# ============================================================================ SGLang
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


def sglang_eagle(tree: Tree) -> Settings:
    steps, topk, tokens = sglang_budget(tree)
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": tokens,
    }, {}


def sglang_eagle_notes(tree: Tree) -> list[str]:
    notes = [
        "SGLang builds its tree each step from the drafter's scores: this budget makes the exported tree one "
        "it can build; EAGLE for EAGLE-2 drafts"
    ]
    if tree.num_nodes > 1 and sglang_budget(tree)[1] > 1:
        notes.append(
            "topk > 1: with page_size > 1 it needs the flashinfer or fa3 attention backend (server_args.py "
            "refuses triton and the others); SpecV2 (the overlap worker) takes it at page_size 1 since "
            "sglang#26866 and falls back to v1 above; trtllm_mha needs topk 1"
        )
    return notes


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


register_engine("sglang", lambda config, options: sglang_snippet(config), picks_tree=True)
register_target(
    Target(
        "sglang",
        "eagle",
        sources=(
            "python/sglang/srt/speculative/eagle_utils.py (select_top_k_tokens, organize_draft_results)",
            "python/sglang/srt/server_args.py (topk 1 => num_draft_tokens = num_steps + 1; topk > 1 with "
            "page_size > 1 needs flashinfer or fa3)",
            "sgl-project/sglang#26866 (SpecV2 with topk > 1 at page_size 1)",
        ),
        shape=lambda frontier, max_nodes: [TOPK, *budget_rules(max_nodes, frontier)],
        settings=sglang_eagle,
        notes=sglang_eagle_notes,
    )
)
