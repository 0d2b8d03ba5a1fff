"""Fuzzing the bank and heads readers: mutated valid files load or raise entmtp-hf's own errors.

Each case starts from a valid saved bank or heads folder and applies a few mutations (JSON
values of random types, huge numbers, deep nesting, tensors of wrong shapes and dtypes, extra
and missing tensors, non-tensor pickle entries, expanded views, escaping shard names,
truncated and flipped bytes). Loading must either succeed or raise an ``EntMTPError``, within
2 s and without the process's peak memory growing by 500 MB. The issue's reproducers seed
the search. ``ENTMTP_FUZZ_EXAMPLES`` raises the number of cases per test for a longer run.
"""

from __future__ import annotations

import copy
import json
import os
import re
import resource
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from bad_files import (
    H,
    bank_parts,
    hydra_config,
    hydra_published_state,
    medusa_published_state,
    own_heads,
    small_banks,
    tiny_base_config,
    write_folder,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as safetensors_bytes

from entmtp_hf.banks.bank import TopologyBank
from entmtp_hf.errors import EntMTPError
from entmtp_hf.heads import DraftHeads, load_heads

EXAMPLES = int(os.environ.get("ENTMTP_FUZZ_EXAMPLES", "500"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_SECONDS = 2.0
MAX_GROWTH_KB = 500 * 1024

# ----------------------------------------------------------------------------- JSON values
# Placeholders for what json.dumps cannot write (nesting past the recursion limit, numbers
# of thousands of digits); :func:`dumps` splices the raw text in.
_SPLICE = re.compile(r'"\\u0000(deep|digits):(\d+)"')


def deep(n: int) -> str:
    return f"\x00deep:{n}"


def digits(n: int) -> str:
    return f"\x00digits:{n}"


def dumps(value: Any) -> str:
    def raw(m: re.Match) -> str:
        n = int(m[2])
        return "[" * n + "]" * n if m[1] == "deep" else "9" * n

    return _SPLICE.sub(raw, json.dumps(value))


SPECIAL_VALUES = st.sampled_from(
    [deep(5000), deep(40), digits(5000), digits(150), 10**9, 10**12, 2**31, 2**63, 10**99, -1, 0, 1.5e308, "", [], {}]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
    | SPECIAL_VALUES
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
#: keys worth adding where they are absent (the schema's own and a few unknown ones)
NEW_KEYS = (
    "num_trees",
    "scheduler",
    "retrieval",
    "num_tokens",
    "ladder",
    "thresholds",
    "value",
    "value_costs",
    "policy",
    "trees",
    "hidden_act",
    "rope_theta",
    "rope_parameters",
    "head_dim",
    "num_key_value_heads",
    "num_hidden_layers",
    "draft_vocab_size",
    "use_base_lm_head",
    "weight_map",
    "zzz",
)


def json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists, the root excluded."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(json_paths(value, prefix + (key,)))
    return out


def pick_path(obj: Any, path: int | tuple) -> tuple:
    """``path`` as given, or the ``path``-th existing path (an int indexes them, so that the
    strategies need not know the file being mutated)."""
    if isinstance(path, tuple):
        return path
    paths = json_paths(obj) or [("zzz",)]
    return paths[path % len(paths)]


def set_path(obj: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    """``obj`` with the value at ``path`` replaced (or deleted); missing dicts on the way are created."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, list) and isinstance(head, int) and head < len(obj):
        if delete and not rest:
            return obj[:head] + obj[head + 1 :]
        return obj[:head] + [set_path(obj[head], rest, value, delete)] + obj[head + 1 :]
    base = dict(obj) if isinstance(obj, dict) else {}
    if delete and not rest:
        base.pop(head, None)
    else:
        base[head] = set_path(base.get(head, {}), rest, value, delete)
    return base


# ----------------------------------------------------------------------------- tensors
DTYPES = (torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.bool)
TENSORS = st.tuples(
    st.lists(st.integers(0, 6), max_size=3),
    st.sampled_from(DTYPES),
    st.sampled_from(["zeros", "arange", "minus", "rand"]),
)


def make_tensor(spec: tuple) -> torch.Tensor:
    shape, dtype, fill = spec
    n = 1
    for d in shape:
        n *= d
    if fill == "arange":
        t = torch.arange(n)
    elif fill == "minus":
        t = torch.full((n,), -1)
    elif fill == "rand":
        t = torch.randint(-2, 8, (n,), generator=torch.Generator().manual_seed(n))
    else:
        t = torch.zeros(n)
    return t.reshape(shape).to(dtype)


BYTE_OPS = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(
        st.just("flip"), st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=4), st.integers(1, 255)
    ),
)


def mutate_bytes(data: bytes, op: tuple) -> bytes:
    if op[0] == "truncate":
        return data[: int(len(data) * op[1])]
    out = bytearray(data)
    for where in op[1]:
        if out:
            out[int(where * len(out))] ^= op[2]
    return bytes(out)


# ----------------------------------------------------------------------------- checking one case
def check_case(load: Any) -> Any:
    """Run ``load()``: it returns or raises an EntMTPError, fast and without a memory spike."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = load()
        except EntMTPError:
            pass
    elapsed = time.perf_counter() - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert elapsed < MAX_SECONDS, f"took {elapsed:.2f} s"
    assert grown < MAX_GROWTH_KB, f"peak memory grew by {grown // 1024} MB"
    return result


# ----------------------------------------------------------------------------- banks
BANKS = small_banks()
BANK_OPS = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 99) | st.tuples(st.sampled_from(NEW_KEYS)), JSON_VALUES),
    st.tuples(st.just("set"), st.tuples(st.just("scheduler"), st.sampled_from(NEW_KEYS)), JSON_VALUES),
    st.tuples(st.just("delete"), st.integers(0, 99)),
    st.tuples(st.just("tensor"), st.integers(0, 9), TENSORS),
    st.tuples(st.just("drop"), st.integers(0, 9)),
    st.tuples(st.just("add"), st.sampled_from(["tree.9", "x", "tree.-1"]), TENSORS),
    st.tuples(st.just("bytes"), BYTE_OPS),
)


def bank_bytes(base: str, ops: list[tuple]) -> bytes:
    tensors, meta = bank_parts(BANKS[base])
    meta = copy.deepcopy(meta)
    for op in ops:
        names = sorted(tensors)
        if op[0] in ("set", "delete"):
            meta = set_path(meta, pick_path(meta, op[1]), op[2] if op[0] == "set" else None, delete=op[0] == "delete")
        elif op[0] == "tensor":
            name = op[1] if isinstance(op[1], str) else names[op[1] % len(names)] if names else "tree.0"
            tensors[name] = make_tensor(op[2])
        elif op[0] == "drop" and names:
            tensors.pop(names[op[1] % len(names)])
        elif op[0] == "add":
            tensors[op[1]] = make_tensor(op[2])
    data = safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata={"entmtp_bank": dumps(meta)})
    for op in ops:
        if op[0] == "bytes":
            data = mutate_bytes(data, op[1])
    return data


def load_bank_case(folder: Path, base: str, ops: list[tuple]) -> None:
    path = folder / f"{base}.safetensors"
    path.write_bytes(bank_bytes(base, ops))
    bank = check_case(lambda: TopologyBank.from_file(path))
    if bank is not None:  # whatever loads can be saved (model card included) and read back
        assert TopologyBank.from_file(bank.save_pretrained(folder / "again")) == bank


@FUZZ
@given(base=st.sampled_from(sorted(BANKS)), ops=st.lists(BANK_OPS, min_size=1, max_size=4))
@example(base="t", ops=[("set", ("calibration",), deep(5000))])  # B1
@example(base="t", ops=[("set", ("num_trees",), 10**9)])  # B2
@example(
    base="t",
    ops=[
        ("tensor", "tree.0", ([3_999_900, 1], torch.int32, "arange")),
        ("drop", 1),
        ("set", ("num_trees",), 1),
        ("delete", ("trees",)),
        ("delete", ("scheduler",)),
    ],
)  # B3
@example(base="t", ops=[("set", ("scheduler", "retrieval", "num_tokens"), 10**12)])  # B4
@example(base="default", ops=[("set", ("description",), digits(5000))])
def test_fuzz_bank_files(base: str, ops: list[tuple]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        load_bank_case(Path(tmp), base, ops)


# ----------------------------------------------------------------------------- heads
def _own(family: str, arch: str = "mlp", draft_vocab: bool = False) -> dict[str, Any]:
    heads = own_heads(family, arch, draft_vocab)
    with tempfile.TemporaryDirectory() as tmp:
        heads.save_pretrained(tmp)
        config = json.loads(Path(tmp, "config.json").read_text())
    return {"config.json": config, "model.safetensors": {k: v.clone() for k, v in heads.state_dict().items()}}


def _medusa2_sharded() -> dict[str, Any]:
    sd = {f"medusa_head.{k}": v for k, v in medusa_published_state().items()}
    names = sorted(sd)
    half = len(names) // 2
    index = {"weight_map": {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(names)}}
    return {
        "config.json": {"medusa_num_heads": 2, "medusa_num_layers": 2},
        "model.safetensors.index.json": index,
        "a.safetensors": {k: sd[k] for k in names[:half]},
        "b.safetensors": {k: sd[k] for k in names[half:]},
    }


def _medusa2_single() -> dict[str, Any]:
    sd = {f"medusa_head.{k}": v for k, v in medusa_published_state().items()}
    return {"config.json": {"medusa_num_heads": 2}, "model.safetensors": {**sd, "model.norm.weight": torch.ones(H)}}


HEADS = {
    "own-hydra": _own("hydra"),
    "own-hydra-prefix": _own("hydra", "prefix-mlp"),
    "own-medusa-draft-vocab": _own("medusa", draft_vocab=True),
    "hydra": {"config.json": hydra_config("mlp"), "hydra_lm_head.pt": hydra_published_state("mlp")},
    "hydra-prefix": {
        "config.json": hydra_config("prefix-mlp"),
        "hydra_lm_head.pt": hydra_published_state("prefix-mlp"),
    },
    "medusa": {
        "config.json": {"medusa_num_heads": 2, "medusa_num_layers": 2},
        "medusa_lm_head.pt": medusa_published_state(),
    },
    "medusa2": _medusa2_single(),
    "medusa2-sharded": _medusa2_sharded(),
}
SHARD_NAMES = st.sampled_from(
    [
        "../outside/x.safetensors",
        "/etc/hostname",
        "sub/../../x.safetensors",
        "a.safetensors",
        "sub/../b.safetensors",
        "missing.safetensors",
        "a\\b",
        "",
        ".",
    ]
)
OBJECTS = JSON_VALUES | st.sampled_from([[torch.zeros(2)], {"t": torch.zeros(1)}, (1, 2), torch.Size([2])])
HEADS_OPS = st.one_of(
    st.tuples(st.just("config"), st.integers(0, 199) | st.tuples(st.sampled_from(NEW_KEYS)), JSON_VALUES),
    st.tuples(st.just("config"), st.tuples(st.just("prefix_layer_config"), st.sampled_from(NEW_KEYS)), JSON_VALUES),
    st.tuples(st.just("config_delete"), st.integers(0, 199)),
    st.tuples(st.just("index"), st.integers(0, 99), SHARD_NAMES | JSON_VALUES),
    st.tuples(st.just("tensor"), st.integers(0, 99), TENSORS),
    st.tuples(st.just("drop"), st.integers(0, 99)),
    st.tuples(st.just("add"), st.sampled_from(["mlps.9.0.linear.weight", "0.9.weight", "x"]), TENSORS),
    st.tuples(st.just("object"), st.integers(0, 99), OBJECTS),
    st.tuples(st.just("expand"), st.integers(0, 99)),
    st.tuples(st.just("bytes"), st.integers(0, 9), BYTE_OPS),
)


def _weights_name(files: dict[str, Any]) -> list[str]:
    return sorted(n for n, c in files.items() if isinstance(c, dict) and n.endswith((".pt", ".bin", ".safetensors")))


def _mutate_weights(files: dict[str, Any], op: tuple) -> None:
    """Tensor ops on the first weights file holding any tensors (pickle-only ops on pickles)."""
    name = next((n for n in _weights_name(files) if files[n]), None)
    if name is None:
        return
    sd = files[name] = dict(files[name])
    keys = sorted(sd)
    key = keys[op[1] % len(keys)] if isinstance(op[1], int) else op[1]
    if op[0] == "tensor" or op[0] == "add":
        sd[key] = make_tensor(op[2])
    elif op[0] == "drop":
        sd.pop(key, None)
    elif name.endswith((".pt", ".bin")):  # safetensors hold nothing but dense tensors
        if op[0] == "object":
            sd[key] = op[2]
        elif isinstance(sd.get(key), torch.Tensor):  # one stored element repeated to the tensor's shape
            sd[key] = torch.zeros((), dtype=sd[key].dtype).expand(sd[key].shape)


def heads_files(base: str, ops: list[tuple]) -> dict[str, Any]:
    files = {n: copy.deepcopy(c) if n.endswith(".json") else dict(c) for n, c in HEADS[base].items()}
    for op in ops:
        if op[0] in ("config", "config_delete"):
            cfg = files["config.json"]
            path = pick_path(cfg, op[1])
            files["config.json"] = set_path(cfg, path, op[2] if op[0] == "config" else None, op[0] == "config_delete")
        elif op[0] == "index" and "model.safetensors.index.json" in files:
            index = files["model.safetensors.index.json"]
            files["model.safetensors.index.json"] = set_path(index, pick_path(index, op[1]), op[2])
        elif op[0] in ("tensor", "drop", "add", "object", "expand"):
            _mutate_weights(files, op)
    return files


def write_heads_case(folder: Path, base: str, ops: list[tuple]) -> None:
    files = heads_files(base, ops)
    texts = {n: dumps(c) for n, c in files.items() if n.endswith(".json")}
    write_folder(folder, {**files, **texts})
    names = sorted(files)
    for op in ops:
        if op[0] == "bytes":
            path = folder / names[op[1] % len(names)]
            path.write_bytes(mutate_bytes(path.read_bytes(), op[2]))


@FUZZ
@given(base=st.sampled_from(sorted(HEADS)), ops=st.lists(HEADS_OPS, min_size=1, max_size=4))
@example(base="own-hydra-prefix", ops=[("config", ("prefix_layer_config", "hidden_act"), "1")])  # H1
@example(base="own-hydra-prefix", ops=[("config", ("prefix_layer_config", "rope_theta"), {})])  # H1
@example(base="own-hydra-prefix", ops=[("config", ("prefix_layer_config", "head_dim"), 0)])  # H1
@example(base="own-hydra", ops=[("config", ("hidden_size",), 100000)])  # H2
@example(base="own-hydra", ops=[("config", ("hidden_size",), 60000)])  # H2, within the limit
@example(base="hydra", ops=[("tensor", "hydra_mlp.0.0.linear.weight", ([100000, 0], torch.float32, "zeros"))])  # H2
@example(base="own-medusa-draft-vocab", ops=[("config", ("num_heads",), 10**5)])  # H2
@example(base="own-medusa-draft-vocab", ops=[("config", ("num_layers",), 10**6)])  # H2
@example(base="own-hydra", ops=[("config", ("num_heads",), deep(5000))])  # H3
@example(base="own-hydra", ops=[("config", ("num_heads",), digits(5000))])  # H3
@example(base="medusa", ops=[("tensor", "0.2.weight", ([0, H], torch.float32, "zeros"))])  # H4
@example(
    base="medusa2-sharded", ops=[("index", ("weight_map", "medusa_head.0.0.linear.bias"), "../outside/x.safetensors")]
)
@example(base="medusa2-sharded", ops=[("index", ("weight_map", "medusa_head.0.0.linear.bias"), "/etc/hostname")])  # H6
@example(base="medusa", ops=[("expand", "1.2.weight"), ("object", "0.0.linear.bias", {"a": [1]})])
def test_fuzz_heads_folders(base: str, ops: list[tuple]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "heads"
        write_heads_case(folder, base, ops)
        heads = check_case(lambda: load_heads(folder, base_config=tiny_base_config()))
        assert heads is None or isinstance(heads, DraftHeads)
