"""``entmtp-hf export``: the engines' rules on tree shape, the projections, the outputs as each
engine parses them, the JSON file and the command line end to end."""

from __future__ import annotations

import ast
import itertools
import json
import shlex

import pytest

from entmtp_hf.banks.bank import SHIPPED_DIR, SUFFIX, TopologyBank, shipped_bank_path
from entmtp_hf.tools.cli import main
from entmtp_hf.tools.export import bank_source, export
from entmtp_hf.tools.export_engines import DRAFTERS, sglang_budget
from entmtp_hf.tools.export_shapes import (
    accept_bounds,
    best_chain,
    contiguous,
    top1_chain,
    within_budget,
    within_depth,
)
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

#: every shipped bank and task, found on disk so that a bank added later is checked too
SHIPPED = sorted(
    (folder.name, f.name[: -len(SUFFIX)])
    for folder in SHIPPED_DIR.iterdir()
    if folder.is_dir()
    for f in folder.glob(f"*{SUFFIX}")
)
TARGETS = [(engine, drafter) for engine, drafters in DRAFTERS.items() for drafter in drafters]


def _stored_choice_is_plain(name: str, task: str) -> bool:
    bank = TopologyBank.from_pretrained(shipped_bank_path(name), task)
    return bank.trees[bank.scheduler.static].num_nodes == 1


#: the shipped banks whose stored EntMTP* is a tree (Gemma 3 270M's search machine, on F.linear,
#: kept plain decoding on every task: its banks re-rank where they run, and export says so)
SHIPPED_TREES = [bank for bank in SHIPPED if not _stored_choice_is_plain(*bank)]
SHIPPED_PLAIN = [bank for bank in SHIPPED if bank not in SHIPPED_TREES]


@pytest.mark.parametrize("engine,drafter", TARGETS)
def test_a_shipped_bank_whose_choice_is_plain_decoding_exports_nothing_to_set_up(banks, engine, drafter):
    assert ("gemma-3-270m-cpu-eagle", "chat") in SHIPPED_PLAIN
    for name, task in SHIPPED_PLAIN:
        result = export(banks[(name, task)], engine, drafter)
        assert result["config"] == {} and result["engine_options"] == {}


def test_every_shipped_bank_is_listed():
    assert ("published-defaults", "default") in SHIPPED and ("smollm2-135m-cpu-eagle", "gsm8k") in SHIPPED
    assert len(SHIPPED) >= 7


@pytest.fixture(scope="module")
def banks() -> dict[tuple[str, str], TopologyBank]:
    return {(name, task): TopologyBank.from_pretrained(shipped_bank_path(name), task) for name, task in SHIPPED}


def paths(choices) -> frozenset:
    return frozenset(tuple(c) for c in choices)


# ============================================================================ what each engine takes
def is_tree(nodes: frozenset) -> bool:
    return all(len(p) == 1 or p[:-1] in nodes for p in nodes)


def gapless(nodes: frozenset, up_to_depth: int | None = None) -> bool:
    checked = (p for p in nodes if up_to_depth is None or len(p) <= up_to_depth)
    return all(p[-1] == 0 or p[:-1] + (p[-1] - 1,) in nodes for p in checked)


def level_uniform(nodes: frozenset) -> bool:
    """vLLM's tree: one child count per level, the children ranks 0..k-1 of every node of the level."""
    depth = max(map(len, nodes), default=0)
    level = [()]
    for d in range(1, depth + 1):
        kids = [sorted(p[-1] for p in nodes if len(p) == d and p[:-1] == q) for q in level]
        if any(k != list(range(len(kids[0]))) for k in kids):
            return False
        level = [p for p in nodes if len(p) == d]
    return True


def sglang_can_build(nodes: frozenset, steps: int, topk: int, tokens: int) -> bool:
    """The tree is one SGLang's EAGLE drafting can select under the budget (eagle_utils.py)."""
    depth = max(map(len, nodes), default=0)
    inner = [{p[:-1] for p in nodes if len(p) == d + 1} for d in range(depth)]
    return (
        depth <= steps
        and tokens == len(nodes) + 1
        and max(p[-1] for p in nodes) < topk
        and all(len(parents) <= topk for parents in inner)
        and tokens - 1 <= topk + (steps - 1) * topk**2
        and (topk != 1 or tokens == steps + 1)
    )


def check_config(result: dict) -> frozenset:
    """The exported config parsed as its engine documents it; returns the tree it describes."""
    engine, drafter, config = result["engine"], result["drafter"], result["config"]
    if engine == "vllm" and result["vllm_tree"]:
        tree = ast.literal_eval(config["speculative_token_tree"])
        assert isinstance(tree, list) and all(isinstance(t, tuple) and all(isinstance(r, int) for r in t) for t in tree)
        assert tree == sorted(tree, key=lambda t: (len(t), t))  # breadth-first, as SpeculativeConfig sorts it
        assert config["num_speculative_tokens"] == len(tree) and level_uniform(paths(tree))
        assert result["engine_options"] == {"attention_backend": "TREE_ATTN"}
        assert any("verifies drafted tokens as a chain" in n for n in result["notes"])
        return paths(tree)
    if engine == "vllm":  # a chain of num_speculative_tokens: no tree, no tree backend
        chain = paths((0,) * d for d in range(1, config["num_speculative_tokens"] + 1))
        assert config["method"] == ("medusa" if drafter == "medusa" else "eagle3") and chain == paths(result["tree"])
        assert set(config) == {"method", "num_speculative_tokens"} and result["engine_options"] == {}
        return chain
    if engine == "trtllm":
        if drafter == "eagle" and "eagle_choices" not in config:  # a chain: the one-model EAGLE-3's max_draft_len
            chain = paths((0,) * d for d in range(1, config["max_draft_len"] + 1))
            assert set(config) == {"decoding_type", "max_draft_len"} and chain == paths(result["tree"])
            return chain
        key = "medusa_choices" if drafter == "medusa" else "eagle_choices"
        choices = config[key]
        assert isinstance(choices, list)
        assert all(isinstance(c, list) and all(type(r) is int for r in c) for c in choices)
        if drafter == "medusa":
            assert config["max_draft_len"] == len(choices) and gapless(paths(choices), up_to_depth=1)
        else:
            assert config["max_draft_len"] == max(map(len, choices))
            assert config["max_total_draft_tokens"] == len(choices)
            assert config["eagle3_one_model"] is False and gapless(paths(choices))
            assert paths(choices) != paths((0,) * d for d in range(1, len(choices) + 1))  # never a chain (#10325)
        return paths(choices)
    steps, topk, tokens = (
        config[k] for k in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    )
    assert all(type(v) is int and v >= 1 for v in (steps, topk, tokens))
    assert sglang_can_build(paths(result["tree"]), steps, topk, tokens)
    return paths(result["tree"])


# ============================================================================ the shipped banks
@pytest.mark.parametrize("engine,drafter", TARGETS)
@pytest.mark.parametrize("name,task", SHIPPED_TREES)
def test_shipped_banks_export_to_every_engine(banks, name, task, engine, drafter):
    bank = banks[(name, task)]
    result = export(bank, engine, drafter)
    source = bank.trees[bank.scheduler.static]
    assert result["source_tree"]["tree"] == source.choices
    described = check_config(result)
    assert described == paths(result["tree"]) and is_tree(described)
    assert described == paths(source.choices) - paths(result["dropped"])  # the tree or its projection
    if engine != "vllm":  # the shipped trees have gapless siblings: TensorRT-LLM and SGLang take them whole
        assert not result["dropped"] and described == paths(source.choices)


@pytest.mark.parametrize("drafter", DRAFTERS["vllm"])
@pytest.mark.parametrize("name,task", SHIPPED_TREES)
def test_every_shipped_bank_goes_to_vllm_as_a_chain(banks, name, task, drafter):
    """vLLM verifies drafts as a chain: no bank may hand it a branching tree or the tree backend."""
    bank = banks[(name, task)]
    result = export(bank, "vllm", drafter)
    n = result["config"]["num_speculative_tokens"]
    assert result["tree"] == [[0] * d for d in range(1, n + 1)] and n >= 1
    assert "speculative_token_tree" not in result["config"] and result["engine_options"] == {}
    source = bank.trees[bank.scheduler.static]
    assert n <= source.num_nodes - 1  # never verifies more tokens than the bank's own tree
    if drafter == "eagle" and bank.frontier:  # the chain's figure is the best among the tree's chain prefixes
        exact = {bank.trees[k].depth: v for k, v in bank.frontier.items() if is_chain_choices(bank.trees[k].choices)}
        best = max(v for d, v in exact.items() if 1 <= d <= len(top1_chain(paths(source.choices))))
        assert exact[n] == best and all(exact[d] < best for d in exact if d < n)


def is_chain_choices(choices) -> bool:
    return all(list(c) == [0] * len(c) for c in choices)


def brute_force_vllm(source: Tree, frontier) -> frozenset:
    """The largest level-uniform subtree, ties to the higher frontier lower bound: by enumeration."""
    all_paths = list(source.paths)
    best, best_key = frozenset(), (-1, -1.0)
    for n in range(len(all_paths) + 1):
        for subset in itertools.combinations(all_paths, n):
            s = frozenset(subset)
            if is_tree(s) and gapless(s) and level_uniform(s):
                key = (len(s), max((v for f, v in frontier if f <= s), default=0.0))
                best, best_key = (s, key) if key > best_key else (best, best_key)
    return best


@pytest.mark.parametrize("name,task", [bank for bank in SHIPPED_TREES if bank[0] != "published-defaults"])  # enumerable
def test_vllm_tree_option_is_the_largest_uniform_subtree(banks, name, task):
    bank = banks[(name, task)]
    source = bank.trees[bank.scheduler.static]
    frontier = [(paths(bank.trees[k].choices), v) for k, v in bank.frontier.items()]
    result = export(bank, "vllm", vllm_tree=True)
    check_config(result)
    assert result["vllm_tree"] and paths(result["tree"]) == brute_force_vllm(source, frontier)


def test_vllm_tree_option_is_refused_elsewhere(banks):
    bank = banks[("smollm2-135m-cpu", "gsm8k")]
    for engine, drafter in (("vllm", "medusa"), ("trtllm", "eagle"), ("sglang", "eagle")):
        with pytest.raises(ValueError, match="--vllm-tree"):
            export(bank, engine, drafter, vllm_tree=True)


def test_best_chain_is_the_shortest_prefix_with_the_best_figure():
    chain3 = paths([[0], [0, 0], [0, 0, 0]])
    frontier = [(frozenset(), 1.0), (paths([[0]]), 1.5), (paths([[0], [1]]), 1.6), (paths([[0], [0, 0]]), 1.8)]
    assert best_chain(chain3 | paths([[1]]), frontier) == paths([[0], [0, 0]])  # no figure shows [0,0,0] paying
    assert best_chain(chain3, frontier + [(chain3, 1.9)]) == chain3
    assert best_chain(chain3, [(frozenset(), 1.0)]) == chain3  # no chain figure: the whole chain
    assert best_chain(paths([[1], [1, 0]]), frontier) == frozenset()  # no top-1 chain: plain decoding
    bank = synthetic_bank([[0], [1], [0, 0], [0, 0, 0]], [[[0]], [[0], [0, 0]]], values=(1.5, 1.8))
    result = export(bank, "vllm")
    assert result["tree"] == [[0], [0, 0]] and result["config"] == {"method": "eagle3", "num_speculative_tokens": 2}
    assert result["dropped"] == [[1], [0, 0, 0]] and check_config(result)


def test_the_shipped_chat_chain_goes_to_trtllm_eagle_without_eagle_choices(banks):
    """`export smollm2-135m-cpu --task chat --to trtllm --drafter eagle --tree 1`: the case of #10325."""
    result = export(banks[("smollm2-135m-cpu", "chat")], "trtllm", "eagle", tree="1")
    assert result["tree"] == [[0]] and result["config"] == {"decoding_type": "Eagle", "max_draft_len": 1}


def test_trtllm_eagle_takes_a_chain_as_max_draft_len_and_a_tree_as_eagle_choices():
    chain = export(synthetic_bank([[0], [0, 0], [0, 0, 0]]), "trtllm", "eagle")
    assert chain["config"] == {"decoding_type": "Eagle", "max_draft_len": 3} and check_config(chain)
    assert any("#10325" in n for n in chain["notes"])
    tree = export(synthetic_bank([[0], [1], [0, 0]]), "trtllm", "eagle")
    assert tree["config"]["eagle_choices"] == [[0], [1], [0, 0]] and tree["config"]["eagle3_one_model"] is False


def test_sglang_notes_name_the_backends_that_take_topk_above_1():
    wide = export(synthetic_bank([[0], [1], [0, 0]]), "sglang")
    assert wide["config"]["speculative_eagle_topk"] == 2
    note = next(n for n in wide["notes"] if n.startswith("topk > 1"))
    assert "flashinfer or fa3" in note and "refuses triton" in note and "#26866" in note and "page_size 1" in note
    chain = export(synthetic_bank([[0], [0, 0]]), "sglang")
    assert chain["config"]["speculative_eagle_topk"] == 1 and not any(n.startswith("topk > 1") for n in chain["notes"])


def test_published_defaults_mc_sim_7b_63(banks):
    bank = banks[("published-defaults", "default")]
    for engine, drafter in (("trtllm", "medusa"), ("trtllm", "eagle"), ("sglang", "eagle")):
        result = export(bank, engine, drafter)
        assert paths(result["tree"]) == paths(MC_SIM_7B_63) and not result["dropped"]  # Medusa's own tree fits
    sglang = export(bank, "sglang")["config"]
    assert (
        sglang["speculative_num_steps"],
        sglang["speculative_eagle_topk"],
        sglang["speculative_num_draft_tokens"],
    ) == (4, 10, 64)
    assert export(bank, "trtllm")["config"]["max_draft_len"] == 63
    vllm_tree = paths(export(bank, "vllm", vllm_tree=True)["tree"])  # ten first-level nodes with one child each
    assert vllm_tree == paths([[r] for r in range(10)] + [[r, 0] for r in range(10)])
    for drafter in ("eagle", "medusa"):  # no frontier: the tree's whole top-1 chain
        assert export(bank, "vllm", drafter)["config"]["num_speculative_tokens"] == 4
    assert export(bank, "vllm")["tokens_per_step"] == {
        "estimate": "the bank carries no acceptance frontier: no modelled tokens per step"
    }


def test_tokens_per_step_are_frontier_bounds(banks):
    bank = banks[("smollm2-135m-cpu", "gsm8k")]
    static = bank.scheduler.static
    tps = export(bank, "vllm")["tokens_per_step"]
    assert tps["source"] == bank.frontier[static]
    lo, hi = tps["exported_bounds"]
    assert 1.0 <= lo <= hi <= tps["source"]
    assert tps["lost_bounds"] == pytest.approx([tps["source"] - hi, tps["source"] - lo])
    same = export(bank, "trtllm")["tokens_per_step"]
    assert same["exported_bounds"] == [same["source"]] * 2 and same["lost_bounds"] == [0.0, 0.0]
    assert "not modelled" in export(bank, "sglang")["tokens_per_step"]["estimate"]


def test_scheduler_note_machine_entries_and_batch_size(banks):
    bank = banks[("smollm2-135m-cpu", "gsm8k")]
    result = export(bank, "trtllm", batch_size=8)
    note = result["scheduler"]
    assert note["policy"] == bank.scheduler.policy and note["static"]["index"] == bank.scheduler.static
    assert note["conservative"]["index"] == bank.scheduler.conservative
    assert note["aggressive"]["index"] == bank.scheduler.aggressive
    assert result["batch_size"] == 8 and "batch-1" in result["batch_note"] and "batch size 8" in result["batch_note"]
    xeon = next(t for t in bank.machine_tables() if "Xeon" in t.fingerprint["processor"] and t.batch_size == 1)
    on_xeon = export(bank, "trtllm", machine="xeon")
    assert on_xeon["source_tree"]["index"] == bank.scheduler_for(xeon).static
    xeon4 = next(t for t in bank.machine_tables() if "Xeon" in t.fingerprint["processor"] and t.batch_size == 4)
    in_fours = export(bank, "trtllm", machine="xeon", batch_size=4)  # the entry calibrated at that batch size
    assert (
        in_fours["source_tree"]["index"] == bank.scheduler_for(xeon4).static
        and "batch size 4" in in_fours["batch_note"]
    )
    assert export(bank, "trtllm", machine=xeon4.key)["source_tree"]["index"] == bank.scheduler_for(xeon4).static
    with pytest.raises(ValueError, match="matches 0"):
        export(bank, "trtllm", machine="xeon", batch_size=3)
    assert export(bank, "trtllm", tree="aggressive")["source_tree"]["index"] == bank.scheduler.aggressive
    with pytest.raises(ValueError, match="matches 0"):
        export(bank, "trtllm", machine="no such machine")
    with pytest.raises(ValueError, match="--tree"):
        export(bank, "trtllm", tree=str(len(bank.trees)))  # one past the last tree
    with pytest.raises(ValueError, match="drafters"):
        export(bank, "sglang", "medusa")
    assert "Hydra" in result["notes"][0]


# ============================================================================ synthetic trees
def synthetic_bank(source, frontier_trees=(), values=()) -> TopologyBank:
    """A bank whose last tree is ``source``, with an optional nested frontier before it."""
    trees = [Tree.root_only(), *map(Tree.from_choices, frontier_trees), Tree.from_choices(source)]
    meta = {"scheduler": {"static": len(trees) - 1}}
    if values:
        meta["trees"] = [{"mean_accept_length": v} for v in (1.0, *values)] + [{}]
        meta["frontier"] = {"trees": list(range(len(values) + 1))}
    return TopologyBank("synthetic", trees, metadata=meta)


def test_a_gap_between_siblings_is_cut_for_top_k_drafters():
    bank = synthetic_bank([[0], [2], [2, 0], [0, 0], [0, 2]])
    for engine in ("vllm", "sglang"):
        result = export(bank, engine)
        assert [2] in result["dropped"] and [2, 0] in result["dropped"] and [0, 2] in result["dropped"]
        check_config(result)
    eagle = export(bank, "trtllm", "eagle")
    assert paths(eagle["tree"]) == paths([[0], [0, 0]])
    medusa = export(bank, "trtllm", "medusa")  # Medusa heads rank per level: only the first level must be gapless
    assert paths(medusa["tree"]) == paths([[0], [0, 0], [0, 2]]) and check_config(medusa)
    assert contiguous(paths([[0], [0, 1]])) == paths([[0]])
    assert contiguous(paths([[0], [0, 1]]), up_to_depth=1) == paths([[0], [0, 1]])


def test_vllm_tree_needs_one_child_count_per_level():
    bank = synthetic_bank([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    result = export(bank, "vllm", vllm_tree=True)
    kept = paths(result["tree"])
    assert level_uniform(kept) and len(kept) == 4  # [0],[1],[0,0],[1,0]: the largest uniform subtree
    assert kept == paths([[0], [1], [0, 0], [1, 0]])
    assert result["dropped"] == [[0, 1], [0, 0, 0]]


def test_vllm_medusa_is_the_top_1_chain_and_depth_is_capped():
    bank = synthetic_bank([[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]])
    result = export(bank, "vllm", "medusa", max_depth=3)
    assert paths(result["tree"]) == paths([[0], [0, 0], [0, 0, 0]]) and result["config"]["num_speculative_tokens"] == 3
    assert result["projection"][0]["dropped"] == [[0, 0, 0, 0]]  # --max-depth, then the chain
    assert top1_chain(paths([[1], [1, 0]])) == frozenset()
    assert within_depth(paths([[0], [0, 0]]), 1) == paths([[0]])


def test_a_node_budget_keeps_the_frontier_s_most_valuable_nodes():
    source = [[0], [1], [0, 0], [0, 0, 0], [2]]
    frontier = [[[0]], [[0], [0, 0]], [[0], [0, 0], [0, 0, 0]]]
    bank = synthetic_bank(source, frontier, values=(1.5, 1.8, 2.0))
    result = export(bank, "trtllm", max_nodes=3)
    assert paths(result["tree"]) == paths([[0], [0, 0], [0, 0, 0]])  # not the breadth-first [0], [1], [2]
    tps = result["tokens_per_step"]
    assert tps["exported_bounds"] == [2.0, 2.0]
    assert tps["source_bounds"] == [2.0, None] and tps["lost_bounds"] == [0.0, None]  # no frontier tree holds it all
    no_order = lambda p: float("inf")  # noqa: E731 - without a frontier: breadth-first
    assert within_budget(paths(source), 3, no_order) == paths([[0], [1], [2]])
    ranked_high = {(1,): 0.0}  # a rank-1 node needs its rank-0 sibling first: no gap is created
    assert within_budget(paths([[0], [1], [0, 0]]), 1, lambda p: ranked_high.get(p, 5.0)) == paths([[0]])
    sglang = export(bank, "sglang", max_nodes=2)
    assert len(sglang["tree"]) == 2 and check_config(sglang)


def test_accept_bounds_and_the_sglang_budget():
    frontier = [(paths([]), 1.0), (paths([[0]]), 1.5), (paths([[0], [0, 0]]), 1.8)]
    assert accept_bounds(paths([[0], [1]]), frontier) == (1.5, None)
    assert accept_bounds(paths([[0]]), frontier) == (1.5, 1.5)
    chain = Tree.chain(3)
    assert sglang_budget(chain) == (3, 1, 4)
    wide_below = Tree.from_choices([[0], [1], [2], [0, 0], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1]])
    assert sglang_budget(wide_below) == (3, 3, 9)  # three first-level nodes expanded: topk 3


def test_plain_decoding_exports_no_speculation():
    bank = synthetic_bank([[0]])
    result = export(bank, "vllm", tree="0")
    assert result["tree"] == [] and result["config"] == {}


# ============================================================================ the command line
def _sections(out: str) -> tuple[str, str]:
    """The Python snippet and the last block (command line or YAML) of the CLI's output."""
    blocks = out.split("\n\n# ")
    python = next(b for b in blocks if b.startswith("Python")).split("\n", 1)[1]
    return python, blocks[-1].split("\n", 1)[1]


def test_cli_end_to_end_vllm_with_json_file(tmp_path, capsys):
    out_file = tmp_path / "export.json"
    bank = str(shipped_bank_path("smollm2-135m-cpu"))
    assert main(["export", bank, "--task", "gsm8k", "--to", "vllm", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    python, command = _sections(out)
    ast.parse(python)
    line = next(ln for ln in command.splitlines() if ln.startswith("vllm serve"))
    argv = shlex.split(line)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert "--attention-backend" not in argv and "speculative_token_tree" not in spec
    tree = [(0,) * d for d in range(1, spec["num_speculative_tokens"] + 1)]
    data = json.loads(out_file.read_text())
    expected = {
        "engine",
        "drafter",
        "vllm_tree",
        "task",
        "bank",
        "revision",
        "source_tree",
        "tree",
        "config",
        "engine_options",
        "dropped",
        "projection",
        "tokens_per_step",
        "scheduler",
        "machine",
        "batch_size",
        "batch_note",
        "notes",
        "sources",
    }
    assert set(data) == expected and data["engine"] == "vllm" and data["bank"] == bank and data["vllm_tree"] is False
    assert data["tree"] == [list(t) for t in tree] and data["config"] == {k: spec[k] for k in data["config"]}
    assert isinstance(data["dropped"], list) and all(isinstance(p, list) for p in data["dropped"])
    assert {"source", "source_bounds", "exported_bounds", "lost_bounds", "estimate"} <= set(data["tokens_per_step"])
    assert all(isinstance(s, str) for s in data["sources"]) and data["batch_size"] == 1


def test_cli_trtllm_and_sglang_outputs_parse(capsys):
    assert main(["export", "published-defaults", "--task", "default", "--to", "trtllm"]) == 0
    out = capsys.readouterr().out
    python, yaml = _sections(out)
    ast.parse(python)
    choices = json.loads(next(ln for ln in yaml.splitlines() if "medusa_choices:" in ln).split(":", 1)[1])
    assert paths(choices) == paths(MC_SIM_7B_63)
    assert main(["export", "smollm2-135m-cpu", "--task", "chat", "--to", "sglang", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    python, command = _sections(out)
    ast.parse(python)
    argv = shlex.split(next(ln for ln in command.splitlines() if "sglang.launch_server" in ln))
    flags = {
        k: argv[argv.index(k) + 1]
        for k in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")
    }
    assert all(v.isdigit() for v in flags.values()) and "batch size 4" in out


def test_cli_errors_are_one_line_and_exit_2(capsys):
    assert main(["export", "smollm2-135m-cpu", "--task", "gsm8k", "--to", "vllm", "--machine", "nowhere"]) == 2
    assert "entmtp-hf export: error: --machine" in capsys.readouterr().err
    assert main(["export", "smollm2-135m-cpu", "--task", "nope", "--to", "vllm"]) == 2
    assert "no task 'nope'" in capsys.readouterr().err
    assert bank_source("smollm2-135m-cpu") == shipped_bank_path("smollm2-135m-cpu")
    assert bank_source("me/my-banks") == "me/my-banks"
