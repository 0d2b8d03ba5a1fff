"""TopologyBank: file format round trips, validation of bad files, Hub cache and upload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_standin import MiniHubServer, fake_cache
from huggingface_hub import constants as hf_constants
from safetensors.torch import save_file

import entmtp_hf.banks.format as bank_format
from entmtp_hf.banks.bank import (
    BankFormatError,
    SchedulerDefaults,
    TopologyBank,
    default_thresholds,
    encode_tree,
    model_card,
    published_defaults_bank,
    shipped_bank_path,
)
from entmtp_hf.costs.table import CostTable
from entmtp_hf.errors import EntMTPError
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

META = {
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "heads": "hydra-mlp",
    "hardware": "2-core CPU",
    "trees": [
        {"num_nodes": 1, "mean_accept_length": 1.0},
        {"num_nodes": 4, "mean_accept_length": 1.8, "tokens_per_s": 21.5, "biased_accept_length": 1.9},
    ],
    "scheduler": {"static": 1, "conservative": 0, "aggressive": 1, "tau_on": 0.02, "tau_off": 0.01},
    "calibration": {"prompts": 20, "dataset": "gsm8k"},
}


def small_bank(task: str = "gsm8k") -> TopologyBank:
    return TopologyBank(task, [Tree.root_only(), [[0], [1], [0, 0]]], META)


# ---------------------------------------------------------------- round trips and card
def test_round_trip_keeps_trees_and_metadata(tmp_path: Path) -> None:
    bank = small_bank()
    path = bank.save_pretrained(tmp_path)
    assert path == tmp_path / "gsm8k.safetensors"
    loaded = TopologyBank.from_pretrained(tmp_path, task="gsm8k")
    assert loaded == bank and loaded.metadata == META
    assert loaded.trees == (Tree.root_only(), Tree.from_choices([[0], [1], [0, 0]]))
    assert loaded.scheduler == SchedulerDefaults(1, 0, 1, 0.02, 0.01, (0, 1), (0.02,))
    assert encode_tree(Tree.root_only()).shape == (0, 0)
    assert encode_tree(loaded.tree(1)).tolist() == [[0, -1], [1, -1], [0, 0]]
    assert len(loaded) == 2 and "gsm8k" in repr(loaded)


def test_second_task_keeps_first_and_card_lists_both(tmp_path: Path) -> None:
    small_bank("gsm8k").save_pretrained(tmp_path)
    published_defaults_bank().save_pretrained(tmp_path)
    small_bank("gsm8k").save_pretrained(tmp_path)  # replacing a task keeps the others
    assert TopologyBank.list_tasks(tmp_path) == ["default", "gsm8k"]
    assert TopologyBank.from_pretrained(tmp_path, "default") == published_defaults_bank()
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: entmtp-hf\ntags:\n")
    assert "## Task `default`" in card and "## Task `gsm8k`" in card
    assert "| 2 | 64 | 4 | 10/28/23/2 | mc_sim_7b_63 |" in card
    assert "| 1 | 4 | 2 | 2/1 | 1.8 | 1.9 | 21.5 |" in card
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "default.safetensors", "gsm8k.safetensors"]


def test_shipped_bank_matches_its_builder() -> None:
    folder = shipped_bank_path("published-defaults")
    assert TopologyBank.list_tasks(folder) == ["default"]
    bank = TopologyBank.from_pretrained(folder, "default")
    assert bank == published_defaults_bank(), "rewrite it with published_defaults_bank().save_pretrained(its folder)"
    assert bank.tree(2) == Tree.from_choices(MC_SIM_7B_63) and bank.tree(1) == Tree.chain(4)
    assert (folder / "README.md").read_text() == model_card(folder)
    with pytest.raises(ValueError, match="no shipped bank 'nope'"):
        shipped_bank_path("nope")


def _machine(processor: str, forward: dict[int, float], **fingerprint) -> CostTable:
    return CostTable(
        {"key": processor, "processor": processor, **fingerprint}, "m", forward, (0.0, 0.0, 0.0), (0.0, 0.0), forward[1]
    )


def searched_bank() -> TopologyBank:
    """A bank as a search leaves it: a frontier with timed speed-ups, then two machines' entries."""
    trees = [Tree.root_only(), Tree.chain(1), Tree.chain(2)]
    per_tree = [
        {"mean_accept_length": 1.0, "speedup_vs_plain": 0.96},
        {"mean_accept_length": 1.5, "speedup_vs_plain": 1.31, "tokens_per_s": 26.2},
        {"mean_accept_length": 1.8, "speedup_vs_plain": 1.12},
    ]
    bank = TopologyBank(
        "chat",
        trees,
        {
            "hardware": "AMD EPYC, 2 cores",
            "trees": per_tree,
            "frontier": {"trees": [0, 1, 2]},
            "calibration": {"vanilla_tokens_per_s": 20.0},
            "scheduler": {"static": 1, "policy": "static"},
        },
    )
    fast = _machine("Fast CPU", {1: 10.0, 2: 10.5, 3: 11.0}, device="cpu", threads=2, dtype="float32", torch="2.13")
    slow = _machine("Slow CPU", {1: 10.0, 2: 20.0, 3: 30.0})
    return bank.with_machine(fast).with_machine(slow)


def test_the_card_shows_measured_and_modelled_speed_ups_and_how_to_use_the_bank(tmp_path: Path) -> None:
    searched_bank().save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert 'entmtp_config=EntMTPConfig(bank="<this repo id or folder>", task="chat")' in card
    assert "from entmtp_hf import EntMTPConfig, enable_entmtp" in card
    assert "| 1 | 2 | 1 | 1 | 1.5 | 26.2 | 1.31 |" in card  # the trees' table has the speed-up column
    assert (
        "Measured on AMD EPYC, 2 cores (plain `generate`: 20 tokens/s) by the search that wrote this bank: "
        r"EntMTP\* = tree 1 (2 nodes) at ×1.31 the speed of plain decoding; the fastest timed tree: tree 1 "
        "(2 nodes) at ×1.31."
    ) in card
    assert (
        "| Fast CPU (cpu, 2 threads, float32, torch 2.13) | tree 2 (3 nodes) | off | ×1.64 | ×1.64, tree 2 (3 nodes) |"
        in card
    )
    assert "| Slow CPU | plain decoding (the root alone) | off | ×1 | ×0.75, tree 1 (2 nodes) |" in card


def test_a_machine_entrys_speed_ups_are_checked() -> None:
    entry = searched_bank().machines[0]
    for speedups, message in [
        ([1.2], "must map tree indices"),
        ({"7": 1.2}, "names tree '7'"),
        ({"1": "fast"}, "finite number"),
    ]:
        with pytest.raises(ValueError, match=message):
            TopologyBank(
                "t", [Tree.root_only(), Tree.chain(1), Tree.chain(2)], {"machines": [{**entry, "speedups": speedups}]}
            )


# ---------------------------------------------------------------- construction checks
def test_scheduler_defaults_when_absent() -> None:
    bank = TopologyBank("t", [Tree.root_only(), Tree.chain(1), Tree.chain(2), Tree.chain(3)])
    assert bank.scheduler == SchedulerDefaults(3, 0, 3, 0.01, 0.01, (0, 1, 2, 3), default_thresholds(3))
    assert default_thresholds(3) == (0.001, 0.007071, 0.05) and default_thresholds(1, 0.02) == (0.02,)
    one = TopologyBank("t", [Tree.chain(2), Tree.chain(3)], {"scheduler": {"tau_off": 0.005}})
    assert (one.scheduler.tau_on, one.scheduler.tau_off, one.scheduler.thresholds) == (0.005, 0.005, (0.005,))
    assert SchedulerDefaults.from_metadata(bank.scheduler.to_dict(), 4) == bank.scheduler
    value = TopologyBank(
        "t",
        [Tree.chain(2), Tree.from_choices([[0], [1]])],
        {"scheduler": {"policy": "value", "value": [0, 1], "value_costs": [1.0, 1.0]}},
    )
    assert SchedulerDefaults.from_metadata(value.scheduler.to_dict(), 2) == value.scheduler


@pytest.mark.parametrize(
    "task, trees, meta, message",
    [
        ("../evil", [[]], None, "not a safe file stem"),
        ("", [[]], None, "not a safe file stem"),
        ("t", [], None, "at least one tree"),
        ("t", [Tree.chain(2), Tree.chain(1)], None, "smallest first"),
        ("t", [[[1, 0]]], None, r"tree 0: .*has no parent"),
        ("t", [[]], {"x": object()}, "JSON-serialisable"),
        ("t", [[]], {"x": float("nan")}, "JSON-serialisable"),
        ("t", [[]], {"base_model": 3}, "must be a string"),
        ("t", [[]], {"task": "other"}, "set by the bank"),
        ("t", [[]], {"trees": [{}, {}]}, "list of 1 dicts"),
        ("t", [[]], {"trees": [{"num_nodes": 2}]}, "tree 0 has 1"),
        ("t", [[]], {"trees": [{"tokens_per_s": "fast"}]}, "finite number"),
        ("t", [[]], {"scheduler": {"static": 1}}, "only 1 trees"),
        ("t", [[], [[0]]], {"scheduler": {"ladder": [0, 2], "thresholds": [0.1]}}, "ladder entry 1 is tree 2"),
        ("t", [[]], {"scheduler": {"tau_on": 0.01, "tau_off": 0.02}}, "tau_off"),
        ("t", [[], [[0]]], {"scheduler": {"ladder": [1, 0]}}, "strictly increasing"),
        ("t", [[], [[0]]], {"scheduler": {"thresholds": [0.1, 0.2]}}, "needs 1 thresholds"),
        ("t", [[], [[0]], [[0], [1]]], {"scheduler": {"thresholds": [0.2, 0.1]}}, "thresholds must be strictly"),
        ("t", [[], [[0]]], {"scheduler": {"conservative": 1, "aggressive": 0}}, "conservative"),
        ("t", [[]], {"scheduler": {"tau": 0.1}}, "unknown scheduler keys"),
        ("t", [[]], {"scheduler": {"policy": "fastest"}}, "policy must be one of"),
        ("t", [[]], {"scheduler": {"feature": "entropy"}}, "feature must be one of"),
        ("t", [[]], {"scheduler": {"ladder_feature": 3}}, "ladder_feature must be one of"),
        ("t", [[[2**31]]], None, "int32"),
        ("t", [[], [[0]]], {"scheduler": {"value": [0, 2], "value_costs": [1, 1]}}, "value entry 1 is tree 2"),
        ("t", [[], [[0]]], {"scheduler": {"value": [0, 1], "value_costs": [1]}}, "one positive cost per value tree"),
        ("t", [[], [[0]]], {"scheduler": {"value": [0, 1], "value_costs": [1, 0]}}, "one positive cost per value tree"),
        ("t", [[], [[0]]], {"scheduler": {"value": 1, "value_costs": [1]}}, "value must be a list"),
        ("t", [[], [[0]]], {"scheduler": {"policy": "value"}}, "needs the trees it picks from"),
    ],
)
def test_constructor_rejects(task, trees, meta, message) -> None:
    with pytest.raises(ValueError, match=message):
        TopologyBank(task, trees, meta)


# ---------------------------------------------------------------- bad files
def _write(path: Path, tensors: dict, meta: dict | str | None) -> Path:
    header = None if meta is None else {"entmtp_bank": meta if isinstance(meta, str) else json.dumps(meta)}
    save_file(tensors, str(path), metadata=header)
    return path


def _good_meta(**changes) -> dict:
    return {"format_version": 1, "task": "t", "num_trees": 1, **changes}


I32 = torch.int32
BAD_FILES = {
    "no metadata": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, None, "no 'entmtp_bank'"),
    "metadata not JSON": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, "{oops", "not valid JSON"),
    "metadata not object": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, "[1]", "JSON object"),
    "format version": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, _good_meta(format_version=2), "format_version 2"),
    "float dtype": ({"tree.0": torch.zeros(1, 1)}, _good_meta(), "dtype F32; expected I32"),
    "wrong ndim": ({"tree.0": torch.zeros(2, dtype=I32)}, _good_meta(), r"shape \[2\]"),
    "negative rank": ({"tree.0": torch.tensor([[-2]], dtype=I32)}, _good_meta(), "negative values"),
    "inner padding": ({"tree.0": torch.tensor([[0, -1, 0]], dtype=I32)}, _good_meta(), "padding must be on the right"),
    "empty path": ({"tree.0": torch.tensor([[-1]], dtype=I32)}, _good_meta(), "is empty"),
    "orphan path": ({"tree.0": torch.tensor([[1, 0]], dtype=I32)}, _good_meta(), "has no parent"),
    "repeated path": ({"tree.0": torch.tensor([[0], [0]], dtype=I32)}, _good_meta(), "repeats path"),
    "too few trees": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, _good_meta(num_trees=2), r"\['tree.1'\] are missing"),
    "extra tensor": ({"tree.0": torch.zeros(0, 0, dtype=I32), "x": torch.zeros(1)}, _good_meta(), r"\['x'\] unexp"),
    "scheduler index": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, _good_meta(scheduler={"static": 3}), "only 1 trees"),
    "task mismatch": ({"tree.0": torch.zeros(0, 0, dtype=I32)}, _good_meta(task="u"), "does not match the file name"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_names_file_and_problem(tmp_path: Path, case: str) -> None:
    tensors, meta, message = BAD_FILES[case]
    path = _write(tmp_path / "t.safetensors", tensors, meta)
    with pytest.raises(BankFormatError, match=message) as err:
        TopologyBank.from_pretrained(tmp_path, "t")
    assert str(path) in str(err.value) and err.value.path == str(path)


def _corrupt_bytes(good: bytes) -> dict[str, bytes]:
    header = b'{"__metadata__": {"entmtp_bank": "{}"}, "tree.0": {"dtype": '
    return {
        "cut in half": good[: len(good) // 2],
        "cut at the end": good[:-3],
        "garbage": bytes(range(256)) * 2,
        "empty": b"",
        "broken header JSON": len(header).to_bytes(8, "little") + header,
    }


@pytest.mark.parametrize("case", ["cut in half", "cut at the end", "garbage", "empty", "broken header JSON"])
def test_corrupt_safetensors(tmp_path: Path, case: str) -> None:
    good = small_bank("t").save_pretrained(tmp_path / "good").read_bytes()
    path = tmp_path / "t.safetensors"
    path.write_bytes(_corrupt_bytes(good)[case])
    with pytest.raises(BankFormatError, match="not a readable safetensors file") as err:
        TopologyBank.from_file(path)
    assert str(path) in str(err.value)


def test_missing_file_and_missing_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BankFormatError, match="file not found"):
        TopologyBank.from_file(tmp_path / "gone.safetensors")
    monkeypatch.setattr(bank_format, "MAX_FILE_BYTES", 100)  # the reader lives in bank_format
    with pytest.raises(BankFormatError, match="above the 100-byte limit"):
        TopologyBank.from_file(small_bank("big").save_pretrained(tmp_path / "big"))
    monkeypatch.undo()
    small_bank("gsm8k").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has no task 'math'; tasks there: \['gsm8k'\]") as err:
        TopologyBank.from_pretrained(tmp_path, "math")
    assert str(tmp_path) in str(err.value)
    (tmp_path / "junk.safetensors").write_bytes(b"junk")  # a corrupt neighbour does not block saving
    small_bank("gsm8k").save_pretrained(tmp_path)
    assert "## Task `junk`\n\nUnreadable bank file: not a readable" in (tmp_path / "README.md").read_text()


# ---------------------------------------------------------------- Hub cache, offline
def test_hub_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small_bank("gsm8k").save_pretrained(tmp_path / "src")
    published_defaults_bank().save_pretrained(tmp_path / "src")
    commit = fake_cache(tmp_path / "hub", tmp_path / "src")
    # huggingface_hub reads these env vars at import time: patch the constants it consults.
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert TopologyBank.from_pretrained("org/name", task="gsm8k") == small_bank("gsm8k")
    assert TopologyBank.from_pretrained("org/name", "default", revision=commit) == published_defaults_bank()
    assert TopologyBank.list_tasks("org/name") == ["default", "gsm8k"]
    with pytest.raises(ValueError, match=r"'org/name' .*no task 'math' in the local cache.*\['default', 'gsm8k'\]"):
        TopologyBank.from_pretrained("org/name", task="math")
    with pytest.raises(ValueError, match="neither a local folder nor a valid Hub repo id"):
        TopologyBank.from_pretrained("./not/a/folder", task="math")
    with pytest.raises(EntMTPError, match=rf"revision 'v9' of Hub repo 'org/name' is not in the local cache.*{commit}"):
        TopologyBank.from_pretrained("org/name", task="gsm8k", revision="v9")  # a missing revision, not a missing task


def test_hub_cache_offline_through_env_vars(tmp_path: Path) -> None:
    """Same, configured the way users do it: environment variables in a fresh process."""
    small_bank("gsm8k").save_pretrained(tmp_path / "src")
    fake_cache(tmp_path / "hub", tmp_path / "src")
    code = (
        "from entmtp_hf.banks.bank import TopologyBank as B; "
        "print(B.list_tasks('org/name'), B.from_pretrained('org/name', 'gsm8k').metadata['heads'])"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['gsm8k'] hydra-mlp"


# ---------------------------------------------------------------- upload to the Hub stand-in
def test_a_revision_the_hub_does_not_have_is_named_as_such(mini_hub: MiniHubServer) -> None:
    published_defaults_bank().push_to_hub("org/name", token="hf_test")
    assert TopologyBank.from_pretrained("org/name", task="default") == published_defaults_bank()
    with pytest.raises(EntMTPError, match="has no revision 'nosuch'"):
        TopologyBank.from_pretrained("org/name", task="default", revision="nosuch")
    with pytest.raises(EntMTPError, match="no task 'math'"):
        TopologyBank.from_pretrained("org/name", task="math")


def test_push_to_hub_adds_tasks_and_card(mini_hub: MiniHubServer) -> None:
    info = published_defaults_bank().push_to_hub("org/name", token="hf_test")
    assert info.oid == mini_hub.refs["main"] and info.commit_message.endswith("task default")
    small_bank("gsm8k").push_to_hub("org/name", token="hf_test", commit_message="add gsm8k")
    assert sorted(mini_hub.files) == ["README.md", "default.safetensors", "gsm8k.safetensors"]
    card = mini_hub.files["README.md"].decode()
    assert "## Task `default`" in card and "## Task `gsm8k`" in card
    assert TopologyBank.list_tasks("org/name", token="hf_test") == ["default", "gsm8k"]
    assert TopologyBank.from_pretrained("org/name", "gsm8k", token="hf_test") == small_bank("gsm8k")
    with pytest.raises(ValueError, match=r"no task 'math'; tasks there: \['default', 'gsm8k'\]"):
        TopologyBank.from_pretrained("org/name", "math", token="hf_test")
