"""Second hardening round, items 6-9: bank machine entries, export output paths, EAS and policy
settings, refused pickles in the CLI. Each reproducer is refused with the project's own error
naming the field or file (the CLI: exit status 2 and one line, nothing left behind), and a
seeded, bounded fuzz over the same surfaces finds no other kind of error.

``ENTMTP_FUZZ_EXAMPLES`` raises the number of fuzz cases per surface for a longer run.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bad_files import bank_parts, write_bank
from test_generation import enabled, prompts

from entmtp_hf import ConfigError, EntMTPConfig
from entmtp_hf.banks.bank import BankFormatError, TopologyBank
from entmtp_hf.banks.format import SchedulerDefaults
from entmtp_hf.costs.table import CostTable
from entmtp_hf.errors import EntMTPError, FileFormatError
from entmtp_hf.scheduling.eas import EASConfig, EASController
from entmtp_hf.scheduling.features import FEATURES
from entmtp_hf.scheduling.policies import (
    NEEDS_ENTROPIES,
    NEEDS_FEATURE,
    NEEDS_VALUES,
    Scheduler,
    get_policy,
    policy_aliases,
    policy_names,
)
from entmtp_hf.tools.cli import main
from entmtp_hf.trees.tree import Tree

EXAMPLES = int(os.environ.get("ENTMTP_FUZZ_EXAMPLES", "150"))
CHAIN = [[0], [0, 0]]
TREES = [[[0]], CHAIN, [[0], [0, 0], [1]]]


def _no_temporary_files(root: Path) -> None:
    stray = list(root.rglob(".*.tmp"))
    assert not stray, f"temporary files left behind: {stray}"


# ----------------------------------------------------------------------------- 6: machine entries
def machine_bank() -> TopologyBank:
    """A bank with an acceptance frontier and one machine's entry (costs, scheduler, speed-ups)."""
    trees = [Tree.root_only(), Tree.chain(1), Tree.chain(2)]
    per_tree = [{"mean_accept_length": 1.0}, {"mean_accept_length": 1.5}, {"mean_accept_length": 1.8}]
    bank = TopologyBank("t", trees, {"trees": per_tree, "frontier": {"trees": [0, 1, 2]}})
    table = CostTable(
        {"key": "cpu-a", "processor": "CPU A"}, "m", {1: 10.0, 2: 10.5, 3: 11.0}, (0.1, 0.1, 0.1), (0.1, 0.01), 10.0
    )
    return bank.with_machine(table)


def write_machine_bank(folder: Path, mutate) -> Path:
    """``machine_bank`` written as a file after ``mutate(entry)`` changed its machine entry."""
    tensors, meta = bank_parts(machine_bank())
    mutate(meta["machines"][0])
    folder.mkdir(parents=True, exist_ok=True)
    return write_bank(folder / "t.safetensors", tensors, meta)


@pytest.mark.parametrize("scheduler", [1, True, [1], "static", 0.5])
def test_a_machine_scheduler_that_is_not_an_object_is_refused_by_every_reader(tmp_path, capsys, tiny_cache, scheduler):
    path = write_machine_bank(tmp_path, lambda entry: entry.update(scheduler=scheduler))
    message = r"t\.safetensors: metadata\['machines'\]\[0\]: scheduler must be a JSON object or null, got"
    with pytest.raises(BankFormatError, match=message) as err:
        TopologyBank.from_file(path)
    assert err.value.path == str(path)
    model = enabled(tiny_cache)
    with pytest.raises(FileFormatError, match=message):
        model.generate(prompts(1)[0], max_new_tokens=3, entmtp_config=EntMTPConfig(bank=str(tmp_path), task="t"))
    assert main(["export", str(tmp_path), "--task", "t", "--to", "vllm"]) == 2
    err_lines = capsys.readouterr().err.splitlines()
    assert len(err_lines) == 1 and "scheduler must be a JSON object" in err_lines[0] and str(path) in err_lines[0]


def test_a_machine_entry_read_back_intact():
    path_free = machine_bank()
    entry = path_free.machines[0]
    assert SchedulerDefaults.from_metadata(entry["scheduler"], 3) == path_free.scheduler_for(
        path_free.machine_tables()[0]
    )


# ----------------------------------------------------------------------------- 7: export --out
def test_export_to_an_existing_folder_is_refused_before_any_work(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["export", "published-defaults", "--task", "default", "--to", "vllm", "--out", str(folder)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "--out" in captured.err and "is a folder" in captured.err
    assert list(folder.iterdir()) == []
    _no_temporary_files(tmp_path)


@pytest.mark.parametrize("out", ["/proc/x.json", "/dev/null/x.json", "{tmp}/file/x.json", "{tmp}/" + "x" * 300])
def test_export_to_a_path_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, capsys, out):
    (tmp_path / "file").write_text("a file, not a folder")
    out = out.format(tmp=tmp_path)
    assert main(["export", "published-defaults", "--task", "default", "--to", "vllm", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"entmtp-hf export: error: --out {out}: cannot write")
    _no_temporary_files(tmp_path)
    assert not Path("/proc/.x.json.tmp").exists()


def test_export_writes_into_new_folders(tmp_path, capsys):
    out = tmp_path / "a" / "b" / "x.json"
    assert main(["export", "published-defaults", "--task", "default", "--to", "vllm", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["engine"] == "vllm"
    _no_temporary_files(tmp_path)


# ----------------------------------------------------------------------------- 8: EAS and policy settings
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(window=0), "window"),
        (dict(window=2**63), "window"),
        (dict(k_max=2**63), "k_max"),
        (dict(k_max=True), "k_max"),
        (dict(warmup_tokens=-1), "warmup_tokens"),
        (dict(warmup_length=2.0), "warmup_length"),
        (dict(min_length="1"), "min_length"),
        (dict(fork_min_history=0), "fork_min_history"),
        (dict(thresholds=2.0), "thresholds"),
        (dict(thresholds=()), "thresholds"),
        (dict(thresholds=("3", 2.0, 1.5)), r"thresholds\[0\]"),
        (dict(thresholds=(3.0, math.nan, 1.5)), r"thresholds\[1\]"),
        (dict(band_edges=None), "band_edges"),
        (dict(band_edges=(1.0, math.inf)), r"band_edges\[1\]"),
        (dict(fork_margin="2"), "fork_margin"),
        (dict(fork_margin=torch.tensor([1.0, 2.0])), "fork_margin"),
        (dict(fork_margin=math.inf), "fork_margin"),
        (dict(fork_ratio=[]), "fork_ratio"),
        (dict(fork_ratio=0.5), "fork_ratio"),
        (dict(detect_forks="no"), "detect_forks"),
    ],
)
def test_every_bad_eas_field_is_a_config_error_naming_it(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^EASConfig\.{field}: ") as err:
        EASConfig(**kwargs)
    assert err.value.field.startswith("EASConfig." + field.split("\\")[0])


def test_eas_settings_from_a_file_name_the_file(tmp_path):
    path = tmp_path / "eas.json"
    for text in ('{"window": 0}', '{"fork_margin": "2"}', '{"thresholds": 2.0}', "[1]", "{", '{"k_mx": 1}'):
        path.write_text(text)
        with pytest.raises(FileFormatError, match=r"eas\.json: not valid EAS settings") as err:
            EASConfig.from_json(path)
        assert err.value.path == str(path)


def test_eas_integers_are_bounded_where_they_would_overflow():
    cfg = EASConfig(window=4096, fork_min_history=8, k_max=1024)
    assert EASController(cfg, k_max=4).k_max == 4
    with pytest.raises(ConfigError, match="EASController.k_max"):
        EASController(cfg, k_max=2**63)


@pytest.mark.parametrize("policy", [[1], {"static": 1}, 1, "EntMTP", ""])
def test_a_bad_policy_is_a_config_error_naming_the_field_and_the_registered_policies(policy):
    with pytest.raises(
        ConfigError, match=r"must be one of \['static', 'hysteresis', 'ladder', 'value', 'entropy'\]"
    ) as err:
        EntMTPConfig(tree=[[0]], policy=policy)
    assert err.value.field == "EntMTPConfig.policy"


def test_eas_without_a_policy_on_several_trees_is_refused_when_built():
    with pytest.raises(ConfigError, match="the entropy policy truncates one tree"):
        EntMTPConfig(trees=TREES, eas=EASConfig())


# ----------------------------------------------------------------------------- 9: refused pickles in the CLI
class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_convert_heads_refusing_a_pickle_says_so_in_one_line(tmp_path, capsys):
    src, marker = tmp_path / "medusa", tmp_path / "pwned"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1, "base_model_name_or_path": "nobody/base"})
    )
    torch.save({"0.0.linear.weight": _Evil(str(marker))}, src / "medusa_lm_head.pt")
    assert main(["convert-heads", str(src), str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    line = captured.err
    assert str(src / "medusa_lm_head.pt") in line and "refused or unreadable pickle" in line
    assert "nothing in it was run" in line and "re-save" in line and "weights_only=False" not in line
    assert not marker.exists() and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the fuzz
#: values of every JSON type, at and beyond the limits
JSON_VALUES: list[Any] = [
    0,
    1,
    -1,
    2,
    3,
    2**31,
    2**63,
    10**200,
    0.5,
    -0.5,
    1e308,
    -1e308,
    "",
    "x",
    "static",
    "value",
    "best_path_value",
    [],
    [0],
    [1, 0],
    [0, 1, 2],
    [0.1],
    [0.2, 0.1],
    {},
    {"a": 1},
    {"mode": "replace"},
    True,
    False,
    None,
]
#: and what a Python caller can pass besides
PY_VALUES: list[Any] = [
    *JSON_VALUES,
    math.nan,
    math.inf,
    -math.inf,
    torch.tensor([1.0, 2.0]),
    torch.tensor(1.0),
    torch.tensor(3),
    np.float32(0.5),
    np.int64(2),
    (3.0,),
    (1.0, 2.0),
    b"x",
    {1},
    object(),
    -(2**63),
]
SCHEDULER_KEYS = [*SchedulerDefaults.__dataclass_fields__, "tau"]


def _check(action, allowed: type[BaseException] = EntMTPError) -> BaseException | None:
    """Run ``action``; any exception but the project's is a failure."""
    try:
        action()
    except allowed as e:
        return e
    return None


def _entry_mutation(rng: random.Random):
    def mutate(entry: dict) -> None:
        for _ in range(rng.randint(1, 3)):
            part = rng.choice(["scheduler", "costs", "speedups", "entry"])
            if part == "entry":
                entry[rng.choice(["scheduler", "costs", "speedups", "extra"])] = rng.choice(JSON_VALUES)
            elif rng.random() < 0.3 or not isinstance(entry.get(part), dict):
                entry[part] = rng.choice(JSON_VALUES)
            else:
                keys = SCHEDULER_KEYS if part == "scheduler" else [*entry[part], "x"]
                entry[part][rng.choice(keys)] = rng.choice(JSON_VALUES)

    return mutate


def test_fuzz_bank_machine_entries(tmp_path):
    rng = random.Random(49)
    refused = 0
    for case in range(EXAMPLES):
        folder = tmp_path / str(case)
        path = write_machine_bank(folder, _entry_mutation(rng))
        error = _check(
            lambda: TopologyBank.from_file(path).scheduler_for(TopologyBank.from_file(path).machine_tables()[0])
        )
        if error is not None:
            assert isinstance(error, FileFormatError) and error.path == str(path), (case, error)
            refused += 1
    assert refused > EXAMPLES // 4  # the mutations do reach the checks


def test_fuzz_export_output_paths(tmp_path, capsys):
    rng = random.Random(7)
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    names = [
        "/proc/x.json",
        "/proc/self/x.json",
        "/dev/null/x.json",
        "/sys/x.json",
        "{t}/folder",
        "{t}/file",
        "{t}/file/x.json",
        "{t}/new/deep/x.json",
        "{t}/ok.json",
        "{t}/folder/",
        "{t}/" + "y" * 260 + ".json",
        "{t}/.hidden.json",
        "{t}/sp ace.json",
        "{t}/x.json.tmp",
    ]
    for case in range(min(EXAMPLES, 60)):
        out = rng.choice(names).format(t=tmp_path)
        rc = main(
            ["export", "published-defaults", "--task", "default", "--to", rng.choice(["vllm", "trtllm"]), "--out", out]
        )
        err = capsys.readouterr().err
        assert rc in (0, 2), (case, out)
        if rc == 2:
            assert err.count("\n") == 1 and err.startswith("entmtp-hf export: error: --out"), (case, out, err)
        else:
            assert json.loads(Path(out).read_text())["task"] == "default"
        _no_temporary_files(tmp_path)


EAS_FIELDS = [f for f in EASConfig.__dataclass_fields__]


def test_fuzz_eas_settings():
    rng = random.Random(8)
    built = 0
    for case in range(EXAMPLES * 4):
        kwargs = {name: rng.choice(PY_VALUES) for name in rng.sample(EAS_FIELDS, rng.randint(1, 3))}

        def run() -> None:
            cfg = EASConfig(**kwargs)
            ctrl = EASController(cfg, k_max=rng.choice([None, 0, 3, 12]))
            for _ in range(3):
                ctrl.chain_length([rng.random() * 4 for _ in range(6)], limit=rng.choice([None, 0, 2]))
                ctrl.observe_verified(2, 1, 2)
            EntMTPConfig(tree=CHAIN, eas=cfg).resolve(2)

        error = _check(run)
        assert error is None or isinstance(error, ConfigError), (case, kwargs, error)
        built += error is None
    assert built > 0


def _reading(scheduler: Scheduler, rng: random.Random) -> Any:
    if scheduler.needs == NEEDS_FEATURE:
        return rng.random()
    if scheduler.needs == NEEDS_VALUES:
        return [rng.random() for _ in range(scheduler.num_trees)]
    return rng.randrange(scheduler.num_trees) if scheduler.needs == NEEDS_ENTROPIES else None


def test_fuzz_policy_values():
    rng = random.Random(9)
    names = [*policy_names(), *policy_aliases()]
    resolved = 0
    for case in range(EXAMPLES * 4):
        source = rng.choice([{"tree": rng.choice(TREES)}, {"trees": TREES[: rng.randint(1, 3)]}])
        kwargs = {**source, "policy": rng.choice(names + PY_VALUES[:8] + [[1], {}])}
        for name in rng.sample(
            ["tau_on", "tau_off", "thresholds", "costs", "feature", "feature_window"], rng.randint(0, 3)
        ):
            kwargs[name] = rng.choice(PY_VALUES + [list(FEATURES)[rng.randrange(len(FEATURES))], [0.05, 0.1]])

        def run() -> None:
            plan = EntMTPConfig(**kwargs).resolve(4)
            scheduler = plan.new_scheduler()
            for _ in range(4):
                assert 0 <= scheduler.choose(_reading(scheduler, rng)) < len(plan.trees)

        error = _check(run)
        assert error is None or isinstance(error, ConfigError), (case, kwargs, error)
        resolved += error is None
        spec_name = rng.choice(names + [1, [1]])
        arguments = {
            k: rng.choice(PY_VALUES)
            for k in rng.sample(
                ["static_index", "low", "high", "tau_on", "tau_off", "thresholds", "costs", "level"], rng.randint(0, 2)
            )
        }
        error = _check(lambda: Scheduler(spec_name, rng.choice([1, 2, 3, 0, 2**63, True, 2.0]), **arguments))
        assert error is None or isinstance(error, ConfigError), (spec_name, arguments, error)
    assert resolved > 0 and get_policy("EntMTP*").name == "static"
