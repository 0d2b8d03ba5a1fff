"""Compiled graphs saved for a later process (:mod:`entmtp_hf.decoding.precompiled`): what may be saved,
what a saved graph is keyed by, that a loaded graph decodes with its own model's weights, and that a
file which cannot serve is removed and compiled again."""

from __future__ import annotations

import copy
import hashlib
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny import VOCAB, left_padded, tiny_model
from transformers import CompileConfig

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf import cpu_kernels as K
from entmtp_hf import gemv as G
from entmtp_hf.decoding import compiled, precompiled
from entmtp_hf.decoding.compiled import compile_kwargs, compiled_call, compiled_generation
from entmtp_hf.heads import HEADS_ATTR
from entmtp_hf.trees.tree import Tree

CPU = torch.device("cpu")


def test_only_graphs_whose_weights_stay_inputs_are_saved():
    assert precompiled.saves_graphs(compile_kwargs(None, CPU))  # float32 on a CPU: unfrozen
    assert not precompiled.saves_graphs(compile_kwargs(None, CPU, torch.bfloat16))  # frozen: weights in the graph
    assert not precompiled.saves_graphs(compile_kwargs(CompileConfig(mode="max-autotune"), CPU))
    assert not precompiled.saves_graphs(compile_kwargs(CompileConfig(dynamic=True), CPU))
    assert not precompiled.saves_graphs(compile_kwargs(CompileConfig(backend="eager"), CPU))
    assert precompiled.plain_weights(tiny_model("llama"))


def test_the_key_separates_what_the_saved_guards_do_not_check():
    model = tiny_model("llama")
    kwargs = compile_kwargs(None, CPU)
    key = precompiled.artifact_key(model, ("shape",), kwargs)
    assert key.endswith(precompiled.SUFFIX) and key == precompiled.artifact_key(model, ("shape",), kwargs)
    assert precompiled.artifact_key(model, ("other shape",), kwargs) != key
    assert precompiled.artifact_key(model, ("shape",), {**kwargs, "options": {"cpp_wrapper": True}}) != key
    trained = copy.deepcopy(model).train()
    assert precompiled.artifact_key(trained, ("shape",), kwargs) != key
    other = copy.deepcopy(model)
    other.config._attn_implementation = "eager" if model.config._attn_implementation != "eager" else "sdpa"
    assert precompiled.artifact_key(other, ("shape",), kwargs) != key
    # the module tree: a layer swapped for another class with the same weights, or an adapter added
    swapped, adapted = copy.deepcopy(model), copy.deepcopy(model)
    mlp = swapped.model.layers[0].mlp
    mlp.down_proj = type("Rewired", (torch.nn.Linear,), {})(
        mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False
    )
    adapted.model.layers[0].mlp.down_proj.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(2, 2)))
    keys = {precompiled.artifact_key(m, ("shape",), kwargs) for m in (swapped, adapted)}
    assert key not in keys and len(keys) == 2
    assert precompiled.artifact_key(copy.deepcopy(model), ("shape",), kwargs) == key  # a copy: the same graph
    enabled = copy.deepcopy(model)
    setattr(enabled, HEADS_ATTR, torch.nn.Linear(2, 2))  # a drafter: the forward never runs it
    assert precompiled.artifact_key(enabled, ("shape",), kwargs) == key
    # CPU kernels: what a routed layer traces as at the graph's row count (batch x tokens), not its
    # choice at other counts (which may flip between runs, and which the graph never runs)
    routed = copy.deepcopy(model)
    layer = routed.model.layers[0].mlp.down_proj
    one_row = (compiled._shape_key({"input_ids": torch.zeros(1, 1, dtype=torch.long)}), False)
    keys = []
    kernels = (["linear", "onednn", "onednn"], ["linear", "onednn", "linear"], ["linear", "linear", "onednn"])
    for table in kernels + ((["linear", "gemv"],) if G.graph_operator() else ()):
        routes = K._Routes({layer: (table, None)})
        routes.install()
        keys.append(precompiled.artifact_key(routed, one_row, kwargs))
        routes.remove()
    assert keys[0] == keys[1] != keys[2] and precompiled.artifact_key(model, one_row, kwargs) not in keys
    assert len(keys) == 3 or keys[3] not in keys[:3]  # the extension's operator: a graph of its own
    assert precompiled._rows(one_row) == 1


def _saved_sources(code: list[tuple[str, int, int, str]]):
    """An object shaped like a loaded graph, whose traced sources are ``code``."""
    sources = [SimpleNamespace(module=m, firstlineno=a, lastlineno=b, checksum=c) for m, a, b, c in code]
    return SimpleNamespace(source_info=lambda: SimpleNamespace(inlined_sources=sources))


def test_a_saved_graph_serves_only_while_the_code_it_traced_is_unchanged():
    lines, first = inspect.getsourcelines(precompiled._forward)
    last = first + len(lines)
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()
    assert precompiled._sources_unchanged(_saved_sources([(precompiled.__name__, first, last, digest)]))
    assert not precompiled._sources_unchanged(_saved_sources([(precompiled.__name__, first, last, "0" * 64)]))
    assert not precompiled._sources_unchanged(_saved_sources([("no_such_module_here", 1, 2, digest)]))


def test_a_file_that_cannot_be_loaded_is_removed(tmp_path: Path):
    bad = tmp_path / ("x" + precompiled.SUFFIX)
    bad.write_bytes(b"not a compiled graph")
    with pytest.warns(UserWarning, match="could not load the compiled forward"):
        assert precompiled.load(bad, tiny_model("llama")) is None
    assert not bad.exists()
    assert precompiled.load(tmp_path / "absent.aot", tiny_model("llama")) is None


@pytest.mark.slow
def test_a_later_process_loads_the_saved_graphs_and_decodes_with_its_own_weights(
    tiny_cache, tmp_path, monkeypatch, capsys
):
    """The first model compiles and saves each shape's graph (plain decoding's, each tree size's); a second
    model of the same architecture and other weights, after dynamo forgot everything (as in a new
    process), loads every graph instead of compiling it, and its greedy output equals its own eager one."""
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    _, heads = tiny_cache("llama", "hydra", "mlp")
    trees = [Tree.chain(1).choices, Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices]
    config = EntMTPConfig(trees=trees, tau_on=0.1, tau_off=0.09, feature="base_top1")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    greedy = dict(max_new_tokens=16, do_sample=False)
    fast = compiled_generation(max_cache_len=64)
    outputs = []
    for seed in (0, 1):
        model = tiny_model("llama", seed=seed).float()
        enable_entmtp(model, copy.deepcopy(heads).float(), cpu_kernels=False)
        eager = model.generate(ids, **greedy)
        assert torch.equal(model.generate(ids, **greedy, **fast), eager)
        assert torch.equal(model.generate(ids, **greedy, **fast, entmtp_config=config), eager)
        call = compiled_call(model, fast["compile_config"])
        outputs.append((eager, call))
        torch._dynamo.reset()
    (first, compiled), (second, loaded) = outputs
    assert not torch.equal(first, second)  # the weights differ, and so do the outputs
    saved = sorted((compiled.folder / "precompiled").glob("*" + precompiled.SUFFIX))
    assert len(saved) == len(compiled.compile_seconds) >= 3  # plain decoding's graph and one per tree size
    assert all(not what.endswith("loaded") for what, _ in compiled.compile_seconds)
    assert [what for what, _ in loaded.compile_seconds] == [f"{what}, loaded" for what, _ in compiled.compile_seconds]
    assert "entmtp-hf: loaded the compiled forward for 1 row(s) x 1 token(s)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_graph_whose_traced_code_changed_is_compiled_again(tiny_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    fast = compiled_generation(max_cache_len=32)
    shapes = []
    for stale in (False, True):
        model = tiny_model("llama").float()
        enable_entmtp(model, copy.deepcopy(tiny_cache("llama", "hydra", "mlp")[1]).float(), cpu_kernels=False)
        if stale:
            monkeypatch.setattr(precompiled, "_sources_unchanged", lambda fn: False)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, **fast)
        assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False))
        shapes.append([what for what, _ in compiled_call(model, fast["compile_config"]).compile_seconds])
        torch._dynamo.reset()
    assert shapes[0] == shapes[1] and not any(what.endswith("loaded") for what in shapes[1])


def test_a_call_the_saved_guards_refuse_runs_through_dynamo(tmp_path, monkeypatch):
    """Refused before the graph runs (nothing computed, nothing written): that call goes to the usual
    compiled route, which compiles what it needs; any other error is the caller's to see."""

    def refusing(model, **kwargs):
        raise RuntimeError("GuardManager check failed, reason: requires_grad mismatch")

    def failing(model, **kwargs):
        raise RuntimeError("index out of range")

    with pytest.raises(precompiled.Refused):
        precompiled._as_forward(refusing, None)(input_ids=None)
    with pytest.raises(RuntimeError, match="index out of range"):
        precompiled._as_forward(failing, None)(input_ids=None)

    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    model = tiny_model("llama").float()
    call = compiled_call(model, None)
    ids = torch.zeros(1, 1, dtype=torch.long)
    key = (compiled._shape_key({"input_ids": ids}), model.training)
    call._graphs[key] = precompiled._as_forward(refusing, model)
    monkeypatch.setattr(call, "_compiled", lambda **kwargs: "dynamo's route")
    assert call(input_ids=ids) == "dynamo's route"


@pytest.mark.slow
def test_a_left_padded_batch_on_saved_graphs_equals_plain_batched_generate(tiny_cache, tmp_path, monkeypatch):
    """Saved graphs of a 3-row batch, made in one model and loaded by a second: each model's EntMTP output
    equals its plain batched ``generate``, rows ending at different steps."""
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    _, heads = tiny_cache("llama", "hydra", "mlp")
    lengths = (3, 7, 5)
    ids, mask = left_padded(lengths)
    trees = [Tree.chain(1).choices, Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices]
    config = EntMTPConfig(trees=trees, tau_on=0.1, tau_off=0.09, feature="base_top1")
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    fast = compiled_generation(max_cache_len=64)
    free = tiny_model("llama").float().generate(ids, **kwargs)
    kwargs["eos_token_id"] = [int(free[0, max(lengths) + 5])]  # the first row stops early
    loaded = []
    for _ in range(2):
        model = tiny_model("llama").float()
        enable_entmtp(model, copy.deepcopy(heads).float(), cpu_kernels=False)
        plain = model.generate(ids, **kwargs)
        assert torch.equal(model.generate(ids, **kwargs, **fast, entmtp_config=config), plain)
        loaded.append([w.endswith("loaded") for w, _ in compiled_call(model, fast["compile_config"]).compile_seconds])
        torch._dynamo.reset()
    assert not any(loaded[0]) and loaded[1] and all(loaded[1])


def test_a_saved_graph_refusing_its_first_call_is_kept_and_the_call_compiled_here(tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = tiny_model("llama").float()
    call = compiled_call(model, None)
    ids = torch.zeros(1, 1, dtype=torch.long)
    key = (compiled._shape_key({"input_ids": ids}), model.training)
    saved = call.folder / "precompiled" / precompiled.artifact_key(model, key, call.kwargs)
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"a graph saved for other calls")

    def refusing(**kwargs):
        raise precompiled.Refused("GuardManager check failed")

    def never(*args, **kwargs):
        raise AssertionError("a graph this call's tensors refuse is not compiled over the saved one")

    monkeypatch.setattr(precompiled, "load", lambda path, model: refusing)
    monkeypatch.setattr(precompiled, "compile_and_save", never)
    monkeypatch.setattr(call, "_compiled", lambda **kwargs: "dynamo's route")
    assert call(input_ids=ids) == "dynamo's route"
    assert [what for what, _ in call.compile_seconds] == ["1 row(s) x 1 token(s)"]
    assert saved.read_bytes() == b"a graph saved for other calls"
