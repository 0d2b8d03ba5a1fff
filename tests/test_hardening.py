"""Untrusted bank files and heads folders: every reproducer of the hardening issue is refused
fast, with the project's error type and a message naming the file (or field) and the limit."""

from __future__ import annotations

import json
import resource
import time
import zipfile
from pathlib import Path

import pytest
import torch
from bad_files import (
    H,
    V,
    bank_reproducers,
    heads_reproducers,
    medusa_published_state,
    own_heads,
    small_banks,
    write_folder,
)
from safetensors.torch import save_file

from entmtp_hf.banks.bank import MAX_TREES, BankFormatError, TopologyBank
from entmtp_hf.errors import ConfigError, EntMTPError, FileFormatError
from entmtp_hf.files import check_relative_name, nesting_depth, parse_json, resolve_inside
from entmtp_hf.heads import HeadsConfig, HeadsLoadError, HeadsMismatchError, MedusaHeads, load_heads
from entmtp_hf.trees.retrieval import MAX_NUM_TOKENS, RetrievalConfig
from entmtp_hf.trees.tree import Tree


class Budget:
    """A refusal must be fast and must not allocate what the file asks for."""

    def __init__(self, seconds: float = 1.0, megabytes: int = 200) -> None:
        self.seconds, self.kb = seconds, megabytes * 1024

    def __enter__(self) -> "Budget":
        self.start, self.rss = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.rss
        assert elapsed < self.seconds, f"took {elapsed:.2f} s"
        assert grown < self.kb, f"peak memory grew by {grown // 1024} MB"


# ----------------------------------------------------------------------------- shared readers
def test_bounded_json_reader() -> None:
    assert nesting_depth('{"a": "[[[[\\"[[", "b": [[1], {}]}', 10) == 3  # strings are skipped
    assert nesting_depth(b"[" * 10**6, 5) == 6  # stops right after the limit
    for text, message in [
        ("[" * 50 + "]" * 50, "nests deeper than the limit of 8"),
        ("9" * 200, "200 digits"),
        ("[1e999]", "overflows"),
        ("[NaN]", "NaN"),
        ("{", "not valid JSON"),
        (b"\xff", "not valid"),
    ]:
        with pytest.raises(FileFormatError, match=message) as err:
            parse_json(text, "some/file.json", max_bytes=1000, max_depth=8)
        assert err.value.path == "some/file.json"
    with pytest.raises(FileFormatError, match="1001 bytes, above the limit of 1000"):
        parse_json("[" + "0," * 499 + "0]", "f", max_bytes=1000, max_depth=8)
    assert parse_json('{"a": [1, 2.5, "x"]}', "f", max_bytes=100, max_depth=2) == {"a": [1, 2.5, "x"]}


def test_paths_stay_inside(tmp_path: Path) -> None:
    assert resolve_inside(tmp_path, "sub/../a.bin", "idx") == str(tmp_path / "a.bin")
    for name in ("../a.bin", "/etc/passwd", "sub/../../a.bin", "", 3, "."):
        with pytest.raises(FileFormatError, match="idx: "):
            resolve_inside(tmp_path, name, "idx")
    assert check_relative_name("shards/model-00001.safetensors", "idx") == "shards/model-00001.safetensors"
    for name in ("../a", "/abs", "a/../b", "a\\b", "C:/x", None):
        with pytest.raises(FileFormatError, match="idx: "):
            check_relative_name(name, "idx")


# ----------------------------------------------------------------------------- banks
@pytest.mark.parametrize("case", ["B1", "B2", "B3", "B4"])
def test_bank_reproducers_are_refused(tmp_path: Path, case: str) -> None:
    path, message = bank_reproducers(tmp_path)[case]
    with Budget(), pytest.raises(BankFormatError, match=message) as err:
        TopologyBank.from_file(path)
    assert isinstance(err.value, FileFormatError) and err.value.path == str(path)


def test_deep_neighbour_does_not_break_saving(tmp_path: Path) -> None:
    """B1's second symptom: the README rewrite reads every bank of the folder."""
    bank_reproducers(tmp_path)
    small_banks()["t"].save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "## Task `b1`\n\nUnreadable bank file: 'entmtp_bank' header metadata nests deeper" in card
    assert "## Task `t`" in card and TopologyBank.from_pretrained(tmp_path, "t") == small_banks()["t"]


def test_constructor_applies_the_reader_limits() -> None:
    """Whatever can be built can be saved and read back: the limits are the same."""
    deep: list = []
    for _ in range(40):
        deep = [deep]
    cases = [
        ([[]] * (MAX_TREES + 1), None, "at most 1024 trees"),
        ([Tree.chain(65)], None, "depth 65, above"),
        ([[[i] for i in range(4096)]], None, "4097 nodes, above"),
        ([[]], {"x": deep}, "nests deeper"),
        ([[]], {"x": "y" * 2**20}, "above the limit of 1048576"),
        ([[]], {"scheduler": {"tau_on": 10**400}}, "tau_on must be a finite number"),
    ]
    for trees, meta, message in cases:
        with pytest.raises(ValueError, match=message):
            TopologyBank("t", trees, meta)


def test_retrieval_config_is_bounded() -> None:
    for kw, field in [
        ({"num_tokens": 10**12}, "num_tokens"),
        ({"max_ngram": 10**6}, "max_ngram"),
        ({"min_ngram": "2"}, "min_ngram"),
        ({"num_tokens": True}, "num_tokens"),
        ({"mode": []}, "mode"),
    ]:
        with pytest.raises(ConfigError) as err:
            RetrievalConfig(**kw)
        assert err.value.field == f"RetrievalConfig.{field}"
    assert RetrievalConfig(num_tokens=MAX_NUM_TOKENS).num_tokens == MAX_NUM_TOKENS


def test_shipped_banks_still_load_fast() -> None:
    from entmtp_hf.banks.bank import SHIPPED_DIR

    files = sorted(SHIPPED_DIR.glob("*/*.safetensors"))
    start = time.perf_counter()
    banks = [TopologyBank.from_file(f) for f in files]
    # a guard against order-of-magnitude regressions (a check per number of a 64-tree frontier), not a
    # benchmark: the seven banks load in 0.4-0.9 s on a 2-core machine under noise
    assert len(banks) == len(files) >= 4 and time.perf_counter() - start < 2.0


def test_header_shapes_are_checked_before_reading(tmp_path: Path) -> None:
    """Width above the depth limit, or a wide all-padding tensor, never reach the decoder."""
    meta = {"format_version": 1, "task": "t", "num_trees": 1}
    from bad_files import write_bank

    for tensor, message in [
        (torch.zeros(1, 65, dtype=torch.int32), "depth 65, above the limit of 64"),
        (torch.full((2, 3), -1, dtype=torch.int32), "is empty"),
        (torch.tensor([[0, -1]], dtype=torch.int32), "2 columns but its tree has depth 1"),
    ]:
        path = write_bank(tmp_path / "t.safetensors", {"tree.0": tensor}, meta)
        with pytest.raises(BankFormatError, match=message):
            TopologyBank.from_file(path)


# ----------------------------------------------------------------------------- heads
REPRODUCERS = [
    "H1 hidden_act",
    "H1 rope_theta",
    "H1 head_dim",
    "H2 hidden_size",
    "H2 num_heads",
    "H2 num_layers",
    "H2 zero-size pickle",
    "H3 deep",
    "H3 digits",
    "H4 zero-width medusa",
    "H6 relative",
    "H6 absolute",
    "H6 through a subfolder",
]


@pytest.mark.parametrize("case", REPRODUCERS)
def test_heads_reproducers_are_refused(tmp_path: Path, case: str) -> None:
    folder, filename, message = heads_reproducers(tmp_path)[case]
    with Budget(), pytest.raises(HeadsLoadError, match=message) as err:
        load_heads(folder)
    assert isinstance(err.value, FileFormatError) and err.value.path == str(folder / filename)


def test_sizes_are_checked_against_the_weights_before_allocating(tmp_path: Path) -> None:
    """A config within the limits but far larger than its weights allocates nothing."""
    own_heads("medusa").save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    write_folder(
        tmp_path / "big",
        {
            "config.json": {**cfg, "hidden_size": 60000, "vocab_size": 2**21},
            "model.safetensors": (tmp_path / "ok" / "model.safetensors").read_bytes(),
        },
    )
    with Budget(), pytest.raises(HeadsLoadError, match=r"model\.safetensors: .*wrong shapes: lm_heads\.0\.weight"):
        load_heads(tmp_path / "big")
    write_folder(
        tmp_path / "dtype",
        {
            "config.json": cfg,
            "model.safetensors": {
                k: v.to(torch.int32) if k == "mlps.0.0.linear.weight" else v
                for k, v in own_heads("medusa").state_dict().items()
            },
        },
    )
    with pytest.raises(HeadsLoadError, match=r"wrong dtypes: mlps\.0\.0\.linear\.weight torch\.int32"):
        load_heads(tmp_path / "dtype")


def test_pickles_that_would_grow_are_refused(tmp_path: Path) -> None:
    sd = medusa_published_state(1, 1)
    expanded = {**sd, "0.1.weight": torch.zeros(1).expand(V, H)}
    write_folder(tmp_path / "expand", {"config.json": {"medusa_num_heads": 1}, "medusa_lm_head.pt": expanded})
    with pytest.raises(HeadsLoadError, match=r"medusa_lm_head\.pt: tensors that repeat their storage.*0\.1\.weight"):
        load_heads(tmp_path / "expand")
    folder = write_folder(tmp_path / "zip", {"config.json": {"medusa_num_heads": 1}, "medusa_lm_head.pt": sd})
    plain = zipfile.ZipFile(folder / "medusa_lm_head.pt")
    with zipfile.ZipFile(tmp_path / "packed.pt", "w", zipfile.ZIP_DEFLATED) as packed:
        for info in plain.infolist():
            packed.writestr(info.filename, plain.read(info))
    (tmp_path / "packed.pt").replace(folder / "medusa_lm_head.pt")
    with pytest.raises(HeadsLoadError, match="compressed entries"):
        load_heads(folder)
    (folder / "medusa_lm_head.pt").write_bytes(b"\x80\x02}q\x00.")  # a bare (legacy) pickle of {}
    with pytest.raises(HeadsLoadError, match="not a torch.save zip archive"):
        load_heads(folder)
    torch.save({**sd, "extra": [1, 2]}, folder / "medusa_lm_head.pt")
    with pytest.raises(HeadsLoadError, match="entries that are not named tensors: extra"):
        load_heads(folder)


def test_sharded_medusa2_inside_the_folder_loads(tmp_path: Path) -> None:
    sd = {f"medusa_head.{k}": v for k, v in medusa_published_state(2, 1).items()}
    names = sorted(sd)
    first, second = dict((k, sd[k]) for k in names[:3]), dict((k, sd[k]) for k in names[3:])
    index = {
        "weight_map": {
            **{k: "shards/a.safetensors" for k in first},
            **{k: "shards/b.safetensors" for k in second},
            "model.norm.weight": "shards/../base.safetensors",
        }
    }
    write_folder(
        tmp_path,
        {
            "config.json": {"medusa_num_heads": 2},
            "model.safetensors.index.json": index,
            "shards/a.safetensors": first,
            "shards/b.safetensors": second,
        },
    )
    heads = load_heads(tmp_path)
    assert isinstance(heads, MedusaHeads) and heads.num_heads == 2
    assert torch.equal(heads.lm_heads[1].weight, sd["medusa_head.1.1.weight"])
    save_file(second, str(tmp_path / "shards" / "a.safetensors"))  # the same tensors in both shards
    with pytest.raises(HeadsLoadError, match=r"index\.json: tensors stored in more than one shard"):
        load_heads(tmp_path)


def test_hub_shard_names_are_checked_before_downloading() -> None:
    from entmtp_hf.heads.files import resolve_file

    for name in ("../x.safetensors", "/x.safetensors", "a/../../x"):
        with pytest.raises(HeadsLoadError, match="org/repo/model.safetensors.index.json: file name"):
            resolve_file("org/repo", name, named_by="org/repo/model.safetensors.index.json")


def test_heads_config_limits() -> None:
    ok = dict(family="medusa", num_heads=2, hidden_size=H, vocab_size=V)
    for change, field in [
        ({"num_heads": 65}, "num_heads"),
        ({"num_layers": 65}, "num_layers"),
        ({"hidden_size": 65537}, "hidden_size"),
        ({"vocab_size": 2**21 + 1}, "vocab_size"),
        ({"draft_vocab_size": V + 1}, "draft_vocab_size"),
        ({"family": []}, "family"),
    ]:
        with pytest.raises(ConfigError) as err:
            HeadsConfig(**{**ok, **change})
        assert err.value.field == f"HeadsConfig.{field}"


# ----------------------------------------------------------------------------- check_fits
def test_check_fits(tiny_cache) -> None:
    model, heads = tiny_cache("llama", "hydra", "mlp")  # vocabulary 24, hidden size 32
    heads.check_fits(model)
    wide = MedusaHeads(HeadsConfig(family="medusa", num_heads=2, hidden_size=32, vocab_size=64))
    with pytest.raises(
        HeadsMismatchError, match=r"vocab_size 64 > the 24 embedding rows.*vocab_size 64 != the 24 rows"
    ):
        wide.check_fits(model)
    broad = MedusaHeads(HeadsConfig(family="medusa", num_heads=2, hidden_size=48, vocab_size=24))
    with pytest.raises(HeadsMismatchError, match="hidden_size 48 != the embedding width 32") as err:
        broad.check_fits(model)
    assert "in_features 32" in str(err.value) and "config's hidden_size 32" in str(err.value)
    assert isinstance(err.value, EntMTPError)
    restricted = MedusaHeads(
        HeadsConfig(family="medusa", num_heads=2, hidden_size=32, vocab_size=24, draft_vocab_size=3)
    )
    restricted.draft_vocab.copy_(torch.tensor([0, 5, 30]))
    with pytest.raises(HeadsMismatchError, match=r"draft_vocab ids must lie in \[0, 24\)"):
        restricted.check_fits(model)
