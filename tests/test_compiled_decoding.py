"""Compiled decoding (:mod:`entmtp_hf.decoding.compiled`): the forward compiled with static shapes and, on a
CPU, inductor's weight freezing, shared by plain ``generate`` and EntMTP on an enabled model."""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from op_calls import extension_calls
from tiny import VOCAB, tiny_model
from transformers import CompileConfig, StaticCache

from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf import cpu_kernels as K
from entmtp_hf.calibration.probe import forward_ms
from entmtp_hf.decoding import compiled
from entmtp_hf.decoding.compiled import (
    CompiledForward,
    compile_kwargs,
    compiled_call,
    compiled_generation,
    use_compiled_decoding,
)
from entmtp_hf.decoding.product_groups import ProductGroups
from entmtp_hf.errors import EntMTPError
from entmtp_hf.gemv import unavailable as gemv_unavailable
from entmtp_hf.trees.tree import Tree

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_transformers_defaults_become_static_shapes_and_the_cpu_options():
    """On a CPU: no CUDA-graph mode; float32 graphs unfrozen (a second process reuses inductor's caches),
    other dtypes frozen (their weights prepacked) unless the CPU kernels route their products (whose
    graph operator needs the weights as inputs)."""
    assert compile_kwargs(None, CPU) == {
        "backend": "inductor",
        "fullgraph": False,
        "dynamic": False,
        "mode": None,
        "options": {"size_asserts": False},
    }
    assert compile_kwargs(CompileConfig(), CPU) == compile_kwargs(None, CPU)
    assert compile_kwargs(None, CPU, torch.bfloat16)["options"] == {"freezing": True, "size_asserts": False}
    routed = {"size_asserts": False, "post_grad_custom_post_pass": ProductGroups()}  # int8 products grouped
    assert compile_kwargs(None, CPU, torch.bfloat16, routed=True)["options"] == routed
    assert compile_kwargs(None, CUDA, torch.bfloat16) == compile_kwargs(None, CUDA)
    # CUDA keeps transformers' CUDA-graph mode, with static shapes
    assert compile_kwargs(None, CUDA) == {
        "backend": "inductor",
        "fullgraph": False,
        "dynamic": False,
        "mode": "reduce-overhead",
    }


def test_what_the_user_sets_is_kept():
    options = compile_kwargs(CompileConfig(options={"freezing": False}, fullgraph=True, dynamic=True), CPU)
    assert options == {
        "backend": "inductor",
        "fullgraph": True,
        "dynamic": True,
        "mode": None,
        "options": {"freezing": False},
    }
    assert compile_kwargs(CompileConfig(mode="max-autotune"), CPU)["mode"] == "max-autotune"
    assert "options" not in compile_kwargs(CompileConfig(mode="max-autotune"), CPU)
    # another backend gets no inductor options
    assert compile_kwargs(CompileConfig(backend="eager"), CPU) == {
        "backend": "eager",
        "fullgraph": False,
        "dynamic": False,
        "mode": "reduce-overhead",
    }


def test_generate_keywords_mark_a_cpu_compile_and_leave_the_users_config_alone():
    mine = CompileConfig(fullgraph=True)
    kwargs = compiled_generation(mine, max_cache_len=512)
    assert kwargs["cache_implementation"] == "static" and kwargs["max_cache_len"] == 512
    assert kwargs["compile_config"]._compile_all_devices and kwargs["compile_config"].fullgraph
    assert not getattr(mine, "_compile_all_devices", None)


def test_shapes_that_need_their_own_graph_are_told_apart(tiny_cache):
    model, _ = tiny_cache("llama", "hydra", "mlp")
    one, two = StaticCache(config=model.config, max_cache_len=32), StaticCache(config=model.config, max_cache_len=64)
    ids = torch.zeros(1, 1, dtype=torch.long)
    key = compiled._shape_key
    assert key({"input_ids": ids, "cache": one}) == key({"input_ids": ids.clone(), "cache": one})
    assert key({"input_ids": ids, "cache": one}) != key({"input_ids": ids, "cache": two})
    assert key({"input_ids": ids, "cache": one}) != key({"input_ids": ids.repeat(1, 3), "cache": one})
    assert key({"input_ids": ids, "use_cache": True}) != key({"input_ids": ids, "use_cache": False})
    with torch.no_grad():
        quiet = key({"input_ids": ids})
        with torch.inference_mode():  # inference tensors: a graph traced outside the mode refuses them
            assert key({"input_ids": ids}) != quiet


def test_one_compiled_forward_per_model_and_config_and_a_copy_compiles_its_own(tiny_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    model, heads = tiny_cache("llama", "hydra", "mlp")
    model = copy.deepcopy(model)
    call = compiled_call(model, CompileConfig())
    assert isinstance(call, CompiledForward) and compiled_call(model, None) is call
    assert compiled_call(model, CompileConfig(mode="default")) is not call
    assert call.folder.parent == tmp_path / "compiled"  # per machine, model and precision
    float32 = copy.deepcopy(model).float()
    assert compiled_call(float32, None).folder != call.folder
    twin = copy.deepcopy(model)  # compiled graphs hold their model's weights: a copy compiles anew
    assert compiled_call(twin, None) is not call
    assert pickle.loads(pickle.dumps(call)) is None


@pytest.mark.slow
def test_plain_and_entmtp_generate_compiled_equal_eager_plain_generate(tiny_cache, tmp_path, monkeypatch, capsys):
    """A float32 tiny Llama, compiled as a user of ``CompileConfig()`` gets it (each graph saved for a later process):
    plain ``generate`` and EntMTP run the same compiled forward, each greedy output equal to eager plain
    ``generate``; each graph is announced."""
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model, heads = tiny_cache("llama", "hydra", "mlp")
    model, heads = copy.deepcopy(model).float(), copy.deepcopy(heads).float()
    enable_entmtp(model, heads, cpu_kernels=False)
    trees = [Tree.chain(1).choices, Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices]
    config = EntMTPConfig(trees=trees, tau_on=0.1, tau_off=0.09, feature="base_top1")
    prompts = [torch.randint(0, VOCAB, (1, 5 + i), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    greedy = dict(max_new_tokens=20, do_sample=False)
    fast = compiled_generation(max_cache_len=64)
    for ids in prompts:
        eager = model.generate(ids, **greedy)
        assert torch.equal(model.generate(ids, **greedy, **fast), eager)
        assert torch.equal(model.generate(ids, **greedy, **fast, entmtp_config=config), eager)
    call = compiled_call(model, fast["compile_config"])
    shapes = [what for what, _ in call.compile_seconds]
    # plain decoding's graph first; its cache's slots: at least max_cache_len (generate reuses a larger
    # static cache an earlier call of the same model object left, and so do the trees' graphs)
    first = shapes[0]
    assert first.startswith("1 row(s) x 1 token(s), ") and int(first.split(", ")[1].split()[0]) >= 64
    slots = first.split(", ")[1]
    assert {f"1 row(s) x 2 token(s), {slots}", f"1 row(s) x 6 token(s), {slots}"} <= set(shapes)
    assert len(shapes) == len(set(shapes))  # each shape compiled once, whichever call needed it
    err = capsys.readouterr().err
    assert f"entmtp-hf: compiling the forward for {first}" in err
    assert f"entmtp-hf: compiled the forward for {first} in" in err

    # the cost probe on a model that decodes compiled by default times that compiled forward, as generate runs it
    use_compiled_decoding(model, fast["compile_config"], max_cache_len=64)
    ran, compiled_forward = [], CompiledForward.__call__

    def counted(self, **kw):
        ran.append(kw["input_ids"].shape)
        return compiled_forward(self, **kw)

    monkeypatch.setattr(CompiledForward, "__call__", counted)
    forward_ms(model, model.entmtp_heads, sizes=(1, 2), repeats=1, prefix_len=32)
    assert ran.count((1, 1)) >= 2 and ran.count((1, 2)) >= 2  # a warm-up and a timed round of each size


@pytest.mark.skipif(not K.onednn_available(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("kernel", ["onednn", "gemv"])
def test_compiled_entmtp_multiplies_on_the_cpu_kernels_and_stays_lossless(kernel, tiny_cache, tmp_path, monkeypatch):
    """With the CPU kernels routed (packed oneDNN copies for the decoder and oneDNN for the LM head,
    or the package's gemv kernel for both), compiled EntMTP's graphs multiply on them and its greedy
    output equals eager plain ``generate``. Packed copies run through the ``entmtp_hf::linear``
    operator, inside EntMTP's calls only (compiled plain ``generate`` outside them: ``F.linear``);
    gemv is the extension's operator, which a graph calls in every call."""
    if kernel == "gemv" and gemv_unavailable() is not None:
        pytest.skip(f"the gemv kernel is off here: {gemv_unavailable()}")
    monkeypatch.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != kernel) for c in choices})
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model, heads = tiny_cache("llama", "hydra", "mlp")
    model, heads = copy.deepcopy(model).float(), copy.deepcopy(heads).float()
    enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1, pack=kernel == "onednn")
    assert K.kernels_of(model).kinds() == ["by row count", "packed" if kernel == "onednn" else "gemv"]
    on_kernels = []  # per product through the Python operator in a compiled graph: whether the kernels served it

    class Counted(weakref.WeakValueDictionary):
        def get(self, key, default=None):
            dispatch = super().get(key, default)
            on_kernels.append(dispatch is not None and dispatch.owner.active())
            return dispatch

    monkeypatch.setattr(K, "_DISPATCH_BY_WEIGHT", Counted())
    config = EntMTPConfig(tree=Tree.chain(3).union(Tree.from_choices([[1], [2]])).choices)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    greedy, fast = dict(max_new_tokens=20, do_sample=False), compiled_generation(max_cache_len=64)
    eager = model.generate(ids, **greedy)
    plain, plain_calls = extension_calls(lambda: model.generate(ids, **greedy, **fast))
    plain_on_kernels, on_kernels[:] = list(on_kernels), []
    out, entmtp_calls = extension_calls(lambda: model.generate(ids, **greedy, **fast, entmtp_config=config))
    assert torch.equal(plain, eager) and torch.equal(out, eager)
    products = 7 * model.config.num_hidden_layers + 1  # a forward's: per layer q, k, v, o, gate, up, down; the LM head
    if kernel == "onednn":
        assert len(plain_on_kernels) >= products and not any(plain_on_kernels)  # plain generate: F.linear
        assert len(on_kernels) >= products and all(on_kernels)  # EntMTP: every compiled product on the copies
        assert "gemv" not in plain_calls | entmtp_calls
    else:
        assert plain_on_kernels == on_kernels == []  # no product through the Python operator
        assert len(plain_calls["gemv"]) >= products and {x[-2] for x in plain_calls["gemv"]} == {1}
        assert max(x[-2] for x in entmtp_calls["gemv"]) > 1  # the trees' verification on the kernel too


def test_compiled_decoding_as_the_models_default_needs_entmtp_enabled(tiny_cache):
    _, heads = tiny_cache("llama", "hydra", "mlp")
    model = tiny_model("llama")  # the shared one may have EntMTP enabled by another test
    with pytest.raises(EntMTPError, match="enable_entmtp"):
        use_compiled_decoding(model)
    enable_entmtp(model, copy.deepcopy(heads), cpu_kernels=False)
    use_compiled_decoding(model, max_cache_len=256)
    config = model.generation_config
    assert config.cache_implementation == "static" and config.max_cache_len == 256
    assert config.compile_config._compile_all_devices
    assert isinstance(model.get_compiled_call(config.compile_config), CompiledForward)


def test_inductor_writes_its_caches_in_the_models_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor sets once it ran
    with compiled.inductor_cache(tmp_path / "model") as folder:
        assert folder == tmp_path / "model" and cache_dir() == str(folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    with compiled.inductor_cache(tmp_path / "model") as folder:
        assert folder == tmp_path / "mine" and cache_dir() == str(folder)
