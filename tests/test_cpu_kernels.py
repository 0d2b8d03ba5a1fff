"""The CPU kernel opt-in: the same products, the choices it measures, nothing left behind.

Every kernel computes the same products, so greedy output on a float32 tiny model stays
vanilla's whichever is chosen; the layers get their own forward and their exact weights
back when the kernels are removed; nothing changes per call, so threads are safe.
"""

import threading
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from tiny import VOCAB, tiny_model
from torch.nn.utils import parametrize

import entmtp_hf.cpu_kernels as K
from entmtp_hf import CPUKernels, EntMTPConfig, EntMTPError, disable_entmtp, enable_entmtp
from entmtp_hf.heads import HydraHeads
from entmtp_hf.trees.tree import MC_SIM_7B_63

ONEDNN = pytest.mark.skipif(not K.onednn_available(), reason="this torch build has no oneDNN linear")
TREE = [[0], [1], [0, 0], [0, 0, 0]]


@pytest.fixture
def tiny32():
    """A float32 tiny model with random heads (oneDNN takes float32; the float64 models keep MKL)."""
    model = tiny_model(seed=5).float()
    torch.manual_seed(5)
    return enable_entmtp(model, HydraHeads.for_model(model, num_heads=4, arch="mlp"), cpu_kernels=False)


def _ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _dense(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model) -> bool:
    return all("forward" not in vars(m) for m in model.modules()) and K.kernels_of(model) is None


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=20, do_sample=False, **kwargs)


def _lossless(model, ids) -> bool:
    """Greedy EntMTP on a 63-node tree (products of up to 64 rows) gives plain ``generate``'s tokens."""
    return torch.equal(_greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)), _greedy(model, ids))


def _fastest(*kinds: str):
    """Synthetic timings in which ``kinds`` win, so the kernels are routed whatever this CPU measures."""
    return lambda run, choices, repeats: {c: float(c not in kinds) for c in choices}


@pytest.fixture
def packed32(monkeypatch):
    """A float32 tiny model on every kernel at once: the decoder packed, the LM head and the heads'
    drafting over the base LM rows on oneDNN."""
    monkeypatch.setattr(K, "_timed_median", _fastest("onednn"))
    model = tiny_model(seed=5).float()
    torch.manual_seed(5)
    heads = HydraHeads.for_model(model, num_heads=4, arch="mlp", use_base_lm_head=True)
    enable_entmtp(model, heads, rows=(1, 2, 4, 8), repeats=1, pack=True)
    kernels = K.kernels_of(model)
    assert kernels.kinds() == ["by row count", "packed"] and heads.lm_kernel == "onednn"
    assert set(kernels.lm_head.values()) == {"onednn"}
    return model


def _decoder_linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]


def _edit_weights(model, edit: str, seed: int = 0) -> None:
    """Change every decoder weight the way users and libraries do after ``enable_entmtp``."""
    g = torch.Generator().manual_seed(seed)
    for m in _decoder_linears(model):
        w = m.weight
        if edit == "lora":  # a merged low-rank update: weight.data += B @ A (no version counter moves)
            w.data += 0.3 * torch.randn(w.shape[0], 2, generator=g) @ torch.randn(2, w.shape[1], generator=g)
        elif edit == "rows":  # the same values in another order, in place through .data
            w.data.copy_(w.data[torch.randperm(w.shape[0], generator=g)])
        elif edit == "assign":  # a new tensor of the same shape and dtype
            w.data = w.data * 1.5
        elif edit == "parametrize":  # a weight computed on each access
            parametrize.register_parametrization(m, "weight", _Scaled())
        else:
            raise ValueError(edit)


class _Scaled(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 1.5 * w


def test_this_torch_build_has_onednn():
    """The CI machine's CPU build has it; without it the kernels stay off (tested below)."""
    assert K.onednn_available()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layouts_compute_the_same_product(n, bias, dtype):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, 16, generator=g, dtype=dtype), torch.randn(24, 16, generator=g, dtype=dtype)
    b = torch.randn(24, generator=g, dtype=dtype) if bias else None
    want = torch.nn.functional.linear(x, w, b)
    layouts = K.HEAD_LAYOUTS if dtype == torch.float32 else K.HEAD_LAYOUTS[:2]
    for layout in layouts:
        torch.testing.assert_close(K.project(x, w, b, layout), want, rtol=1e-5, atol=1e-5)


def test_widened_products_are_float32_products_of_the_widened_weight():
    """``widened``: a bfloat16 or int8 weight-only weight widened to float32 (into a reused buffer or
    not: the same values), multiplied in float32, rounded once; float32 weights are ``F.linear``'s."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((5, 24), (7, 24), (7,)))
    scratch = K.Scratch()
    out = K.project(x, w, b, "widened", scratch)
    assert out.dtype == torch.bfloat16 and torch.equal(out, K.project(x, w, b, "widened"))
    exact = F.linear(x.double(), w.double(), b.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    q, scale = torch.randint(-127, 128, (7, 24), generator=g, dtype=torch.int8), torch.rand(7, 1, generator=g)
    out = K.widened(x, q, scale, b, scratch(q.numel()).view(q.shape))
    exact = F.linear(x.double(), q.double() * scale.double(), b.double())
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
    assert K._works("widened", w) and not K._works("widened", w.float())
    first = scratch(10)
    assert scratch(5).data_ptr() == first.data_ptr() and scratch(1000).numel() == 1000


def test_by_rows_fills_the_gaps_with_the_next_measured_count():
    table = K._by_rows({1: "linear", 4: "onednn", 8: "linear"})
    assert table == ["linear", "linear", "onednn", "onednn", "onednn", "linear", "linear", "linear", "linear"]


@ONEDNN
def test_a_dispatcher_runs_its_kernels_only_inside_applied_and_only_on_the_weight_as_it_is_now():
    layer = torch.nn.Linear(16, 8)
    routes = K._Routes({layer: (["linear", "onednn", K.PACKED, K.PACKED], K._pack(layer.weight))})
    routes.install()
    (dispatch,) = routes.dispatches
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(*args):
        calls.append(args[1] is dispatch.ready[1])
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
        for rows in (0, 1, 2, 3, 40):  # 40 rows: above the largest measured, its choice
            x = torch.randn(rows, 16)
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            seen = len(calls)
            torch.testing.assert_close(layer(x), want)  # outside: F.linear, nothing else
            assert len(calls) == seen
            with routes.applied():
                torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        assert calls == [False, True, True, True]  # 1 row on the plain weight, 2, 3 and 40 on the packed copy
        first = dispatch.ready[1]
        layer.weight.data.mul_(2.0)  # written after packing, through .data: no version counter moves
        with routes.applied():  # entering fits the layer to its weight: packed again
            x = torch.randn(3, 16)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        second = dispatch.ready[1]
        assert second is not first and calls[-1] is True
        with routes.applied():  # nothing changed since: the same copy, no packing
            assert dispatch.ready[1] is second
    layer.to(torch.float64)  # another dtype: F.linear on the weight as it is now
    with routes.applied():
        x = torch.randn(3, 16, dtype=torch.float64)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert dispatch.ready is None
    routes.remove()
    assert "forward" not in vars(layer)


@ONEDNN
def test_a_weight_parametrized_or_replaced_inside_a_call_runs_f_linear_on_it():
    """The dispatcher reads the layer's tensors directly (no attribute lookup per product); a weight
    parametrized or swapped after the call began is multiplied as the layer now computes it."""
    layer = torch.nn.Linear(16, 8)
    routes = K._Routes({layer: (["linear", "onednn", "onednn"], None)})
    routes.install()
    x = torch.randn(2, 16)
    with torch.no_grad(), routes.applied():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(layer.weight.detach() * 2.0)
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        parametrize.register_parametrization(layer, "weight", _Scaled())
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert torch.equal(torch.ops.entmtp_hf.linear(x, layer.weight, layer.bias), layer(x))
    routes.remove()


@ONEDNN
def test_a_compiled_graph_multiplies_on_the_kernels_where_an_eager_call_would():
    """In a traced graph a routed layer is one ``entmtp_hf::linear`` operator that runs the layer's
    dispatcher when the graph runs: its packed copy inside ``applied``, ``F.linear`` outside, on the
    weight as it is now; a weight the dispatcher's layer no longer holds runs ``F.linear``."""
    layer = torch.nn.Linear(16, 8)
    routes = K._Routes({layer: ([K.PACKED], K._pack(layer.weight))})
    routes.install()
    (dispatch,) = routes.dispatches
    graph = torch.compile(lambda x: layer(x) * 2, backend="aot_eager", fullgraph=True)
    real, calls = torch.ops.mkldnn._linear_pointwise, []

    def counted(*args):
        calls.append(args[1] is dispatch.ready[1])
        return real(*args)

    x = torch.randn(3, 16)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias) * 2
        torch.testing.assert_close(graph(x), want)  # outside applied: F.linear
        assert calls == []
        with routes.applied():
            torch.testing.assert_close(graph(x), want, rtol=1e-5, atol=1e-5)
        assert calls == [True]  # the packed copy
        layer.weight.data.mul_(-1.0)  # edited in place after packing
        with routes.applied():
            torch.testing.assert_close(graph(x), torch.nn.functional.linear(x, layer.weight, layer.bias) * 2)
        assert calls == [True, True] and K._DISPATCH_BY_WEIGHT[layer.weight.data_ptr()] is dispatch
        old = layer.weight
        layer.weight = torch.nn.Parameter(old.detach() + 1.0)  # the layer holds another weight now
        with routes.applied():
            out = torch.ops.entmtp_hf.linear(x, old, layer.bias)  # the old weight's entry no longer serves
        torch.testing.assert_close(out, torch.nn.functional.linear(x, old, layer.bias))
        assert calls == [True, True]
    routes.remove()
    head = torch.nn.Linear(16, 8, bias=False)  # as an LM head: ``transposed`` gives a transposed view
    kernels = ("transposed", "onednn", K.PACKED) + (("gemv",) if K._works("gemv", head.weight) else ())
    for kernel in kernels:  # the operator's declared output is what each kernel gives
        routes = K._Routes({head: ([kernel], K._pack(head.weight) if kernel == K.PACKED else None)})
        routes.install()
        with routes.applied():
            args = (torch.randn(1, 3, 16), head.weight.detach(), None)
            torch.library.opcheck(
                torch.ops.entmtp_hf.linear.default, args, test_utils=("test_schema", "test_faketensor")
            )
            assert torch.ops.entmtp_hf.linear(*args).is_contiguous()  # as declared: inductor checks the strides
        routes.remove()
    with torch.enable_grad():  # a graph traced for gradients keeps F.linear (the operator has none)
        torch.compile(lambda x: layer(x), backend="aot_eager")(x).sum().backward()
    assert layer.weight.grad is not None


@ONEDNN
def test_the_choices_follow_the_measured_times(tiny32, monkeypatch):
    """Synthetic timings: oneDNN faster from two rows on, packing slower, so ``auto`` does not pack."""

    def fake(run, choices, repeats):
        rows = fake.rows
        if "transposed" in choices:
            return {c: (1.0 if c == "transposed" else 2.0) for c in choices}
        return {"linear": 1.0, "onednn": 0.5 if rows > 1 else 2.0, K.PACKED: 10.0}

    real_pass = CPUKernels._decoder_pass

    def decoder_pass(self, layers, packed, rows):
        fake.rows = rows
        return real_pass(self, layers, packed, rows)

    monkeypatch.setattr(K, "_timed_median", fake)
    monkeypatch.setattr(CPUKernels, "_decoder_pass", decoder_pass)
    kernels = CPUKernels(tiny32, rows=(1, 2, 4), pack="auto")
    assert kernels.active and not kernels.packed and kernels.kinds() == ["by row count"]
    assert kernels.decoder == {1: "linear", 2: "onednn", 4: "onednn"}
    assert set(kernels.lm_head.values()) == {"transposed"}
    assert "onednn at 2-4 rows" in kernels.describe()
    monkeypatch.setattr(K, "_available_bytes", lambda: 1000)  # packed copies would not fit the memory
    assert "not packed" in CPUKernels(tiny32, rows=(1, 2), pack="auto").describe()
    assert _untouched(tiny32)


@ONEDNN
@pytest.mark.parametrize("pack", [False, True])
def test_greedy_output_is_vanillas_and_the_model_stays_as_it_was(tiny32, pack, tmp_path):
    """Installed, the kernels change nothing a user reads from the model: its state dict (every
    weight dense and equal), ``save_pretrained``, and plain ``generate`` (F.linear throughout);
    EntMTP calls run on them and decode vanilla's tokens."""
    model = tiny32
    before, ids = _dense(model), _ids(6)
    ref = _greedy(model, ids)
    tree = _greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    with CPUKernels(model, model.entmtp_heads, rows=(1, 2, 4, 8), pack=pack, repeats=1) as kernels:
        assert kernels.active and kernels.packed == pack and K.kernels_of(model) is kernels
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        model.save_pretrained(tmp_path / "saved")
        used = []
        with pytest.MonkeyPatch.context() as mp:
            real = K.project
            mp.setattr(K, "project", lambda *a: used.append(a[-1]) or real(*a))
            assert torch.equal(_greedy(model, ids), ref) and used == []  # plain generate: untouched
            assert torch.equal(_greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)), tree)
    assert torch.equal(tree, ref) and _untouched(model)
    assert all(torch.equal(before[k], v) for k, v in _dense(model).items())
    assert (tmp_path / "saved" / "model.safetensors").is_file()


@ONEDNN
def test_a_model_cast_to_bfloat16_after_measuring_still_generates(tiny32):
    model = tiny32
    enable_entmtp(model, model.entmtp_heads, rows=(1, 2, 4), repeats=1, pack=True)
    assert K.kernels_of(model).packed
    model.to(torch.bfloat16)
    out = _greedy(model, _ids(6))  # plain generate in the new dtype: the stale copies are never read
    with K.kernels_of(model).applied():
        assert torch.equal(_greedy(model, _ids(6)), out)


@ONEDNN
@pytest.mark.parametrize("edit", ["lora", "rows", "assign", "parametrize"])
def test_a_weight_edited_after_enabling_is_multiplied_as_it_is_now(packed32, edit):
    """Never a stale packed copy: a weight edited in place (through ``.data``, which moves no
    version counter), replaced or parametrized after the kernels packed it decodes plain
    ``generate``'s tokens; a copy whose bytes changed is packed again, not dropped."""
    model, ids = packed32, _ids(6)
    assert _lossless(model, ids)
    _edit_weights(model, edit)
    assert _lossless(model, ids)
    for m in _decoder_linears(model):
        ready = vars(m)["forward"].ready
        if edit == "parametrize":
            assert ready is None  # computed on each access: F.linear
        else:  # packed from the weight as it is now
            assert ready[0] == m.weight.data_ptr() and ready[1] is not None and ready[2] == K._checksum(m.weight)


@pytest.mark.skipif(K._gemv.unavailable() is not None, reason="the gemv kernel is off here")
def test_on_the_gemv_kernel_everywhere_greedy_output_stays_plain_generates(monkeypatch):
    """The package's kernel for the decoder, the LM head and the heads' drafting: lossless on a
    63-node tree (products of up to 64 rows), and a weight swapped for a transposed view of the same
    shape (which the kernel does not take) runs ``F.linear``."""
    monkeypatch.setattr(K, "_timed_median", _fastest("gemv"))
    model = tiny_model(seed=7).float()
    torch.manual_seed(7)
    heads = HydraHeads.for_model(model, num_heads=4, arch="mlp", use_base_lm_head=True)
    enable_entmtp(model, heads, rows=(1, 2, 4, 8), repeats=1)
    kernels = K.kernels_of(model)
    assert kernels.kinds() == ["by row count", "gemv"] and heads.lm_kernel == "gemv"
    assert set(kernels.decoder.values()) == set(kernels.lm_head.values()) == {"gemv"}
    ids = _ids(6, 7)
    assert _lossless(model, ids)
    layer = next(m for m in _decoder_linears(model) if m.in_features == m.out_features)
    layer.weight.data = layer.weight.data.t().contiguous().t()  # the same values, column-major
    assert not layer.weight.is_contiguous() and _lossless(model, ids)
    assert vars(layer)["forward"].ready is None


@pytest.mark.skipif(K._gemv.unavailable() is not None, reason="the gemv kernel is off here")
def test_a_bfloat16_model_gets_the_gemv_kernel_even_where_onednn_takes_no_bfloat16(monkeypatch):
    """Some CPUs (an AMD EPYC Zen 2) have no oneDNN bfloat16 primitive; the package's kernel reads
    bfloat16 weights anyway, so a bfloat16 model's EntMTP calls run on it and decode plain
    bfloat16 ``generate``'s tokens."""
    monkeypatch.setattr(K, "_timed_median", _fastest("gemv"))
    real = K._works
    monkeypatch.setattr(K, "_works", lambda layout, w: layout != "onednn" and real(layout, w))
    model = tiny_model(seed=8).to(torch.bfloat16)
    torch.manual_seed(8)
    heads = HydraHeads.for_model(model, num_heads=4, arch="mlp", use_base_lm_head=True)
    enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1, pack=False)
    kernels = K.kernels_of(model)
    assert kernels.active and kernels.kinds() == ["by row count", "gemv"], kernels.reason
    assert _lossless(model, _ids(6, 8))


@ONEDNN
def test_weights_written_in_place_between_calls_are_seen_at_each_call(packed32):
    model, ids = packed32, _ids(6, 4)
    for seed in range(3):
        _edit_weights(model, "lora", seed)
        assert _lossless(model, ids)
    with K.kernels_of(model).applied():  # a block of the user's: checked on entering, and at each EntMTP call
        _edit_weights(model, "lora", 9)
        assert _lossless(model, ids)


@ONEDNN
@pytest.mark.parametrize("made_inside", [True, False])
@pytest.mark.parametrize("run_inside", [True, False])
def test_inference_mode_models_measure_and_decode_losslessly(monkeypatch, made_inside, run_inside):
    """``torch.inference_mode()`` around loading and enabling (a serving pattern), around the
    calls, or both: inference tensors have no version counter, which the kernels never read."""
    monkeypatch.setattr(K, "_timed_median", _fastest("onednn"))
    ids = _ids(6, 3)
    with torch.inference_mode() if made_inside else nullcontext():
        model = tiny_model(seed=5).float()
        torch.manual_seed(5)
        heads = HydraHeads.for_model(model, num_heads=4, arch="mlp", use_base_lm_head=True)
    with torch.inference_mode():
        enable_entmtp(model, heads, rows=(1, 2, 4), repeats=1, pack=True)
    assert model.get_output_embeddings().weight.is_inference() == made_inside
    assert K.kernels_of(model).kinds() == ["by row count", "packed"]
    with torch.inference_mode() if run_inside else nullcontext():
        assert _lossless(model, ids)
    with torch.inference_mode():  # an inference tensor written in place: no counter at all
        for m in _decoder_linears(model):
            (m.weight if made_inside else m.weight.data).mul_(1.25)
    with torch.inference_mode() if run_inside else nullcontext():
        assert _lossless(model, ids)


@ONEDNN
def test_drafting_kernel_follows_the_model_to_another_dtype(packed32):
    """The heads' drafting product measured on oneDNN falls back to ``F.linear`` for weights oneDNN
    does not take (the model moved to float64 after measuring), as the layers' kernels do."""
    model, ids = packed32, _ids(6, 5)
    model.to(torch.float64)
    assert model.entmtp_heads.lm_kernel == "onednn" and _lossless(model, ids)
    assert all(d.ready is None for d in K.kernels_of(model)._routes.dispatches)
    model.to(torch.float32)  # back: fitted again at the next call, the copies packed again
    assert _lossless(model, ids)
    assert all(d.ready is not None for d in K.kernels_of(model)._routes.dispatches)


def test_float64_models_and_other_devices_are_left_alone(tiny_cache):
    model, heads = tiny_cache("llama", "hydra", "mlp")
    kernels = CPUKernels(model, heads)
    assert not kernels.active and "float64" in kernels.reason and "off" in kernels.describe()
    assert _untouched(model)


def test_bfloat16_either_runs_or_says_why():
    model = tiny_model(seed=1).to(torch.bfloat16)
    kernels = CPUKernels(model, rows=(1, 2), repeats=1)
    assert kernels.active or kernels.reason
    kernels.remove()
    assert _untouched(model)


@ONEDNN
def test_enable_and_disable_install_and_remove_them(tiny32):
    model, heads = tiny32, tiny32.entmtp_heads
    enable_entmtp(model, heads, rows=(1, 2), repeats=1)
    assert K.kernels_of(model).active  # enable_entmtp's default on a CPU float model
    enable_entmtp(model, heads, cpu_kernels=False)
    assert K.kernels_of(model) is None and _untouched(model)
    enable_entmtp(model, heads, rows=(1, 2), repeats=1, pack=True)
    measured = K.kernels_of(model)
    enable_entmtp(model, heads, cpu_kernels=measured)  # measured before: installed again, not measured
    assert K.kernels_of(model) is measured
    with pytest.raises(EntMTPError, match="another model"):
        enable_entmtp(tiny_model(seed=9).float(), HydraHeads.for_model(model, num_heads=2), cpu_kernels=measured)
    disable_entmtp(model)
    assert _untouched(model) and model.config._attn_implementation == "sdpa"


@ONEDNN
@pytest.mark.parametrize("kernels_on", [False, True])
def test_threads_decode_at_once_and_leave_nothing_behind(tiny32, kernels_on):
    """Two threads in EntMTP generate on one model: each gets vanilla's output, and no module
    is left with a forward it did not have before (nothing is swapped per call: the kernels are
    applied per thread)."""
    model, heads = tiny32, tiny32.entmtp_heads
    if kernels_on:
        enable_entmtp(model, heads, rows=(1, 2, 4, 5), repeats=1)
    else:
        enable_entmtp(model, heads, cpu_kernels=False)
    installed = {id(m): vars(m).get("forward") for m in model.modules()}
    prompts = [_ids(6, seed) for seed in (11, 12)]
    refs = [_greedy(model, ids) for ids in prompts]
    outs: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        for _ in range(3):
            outs[i] = _greedy(model, prompts[i], entmtp_config=EntMTPConfig(tree=TREE))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(outs[i], refs[i]) for i in range(2))
    assert {id(m): vars(m).get("forward") for m in model.modules()} == installed
    disable_entmtp(model)
    assert _untouched(model)


@ONEDNN
def test_onednn_linears_runs_every_linear_and_keeps_the_output(tiny32):
    model = tiny32
    ids = _ids(6, 3)
    ref = _greedy(model, ids)
    with K.onednn_linears(model):
        swapped = [m for m in model.modules() if "forward" in vars(m)]
        out = _greedy(model, ids)
    assert model.get_output_embeddings() in swapped  # the LM head too
    assert torch.equal(out, ref) and _untouched(model)


@ONEDNN
def test_packed_linears_decode_like_vanilla_and_leave_the_weights_alone(tiny32):
    """The benchmark's packed reference: same products on packed copies, the state dict readable
    and unchanged meanwhile, the LM head (tied or not) never packed; the model's own kernels are
    lifted for the block and put back after, also on errors."""
    model = tiny32
    before, ids = _dense(model), _ids(6, 7)
    ref = _greedy(model, ids)
    decoder_linears = [m for m in model.get_decoder().modules() if type(m) is torch.nn.Linear]
    with K.packed_linears(model) as n:
        assert n == len(decoder_linears) > 0
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        plain = _greedy(model, ids)
        tree = _greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(plain, ref) and torch.equal(tree, ref) and _untouched(model)
    kernels = CPUKernels(model, rows=(1, 2), repeats=1, pack=True).install()

    def routing():
        return {id(m): getattr(vars(m).get("forward"), "owner", None) for m in model.modules()}

    own = routing()
    assert set(own.values()) == {None, kernels._routes}
    with pytest.raises(KeyError):
        with K.packed_linears(model):
            assert all(
                f.owner is not kernels._routes
                for m in model.modules()
                if isinstance(f := vars(m).get("forward"), K._Dispatch)
            )
            raise KeyError("boom")
    assert routing() == own
    kernels.remove()
    assert _untouched(model)


def test_only_plain_layers_without_a_forward_of_someone_elses_are_taken():
    plain, hooked = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    hooked.forward = lambda x: x  # someone else's instance forward (an offloading hook, say)
    assert K._linears([plain, hooked]) == [plain]
    assert K._linears([plain.double()]) == []  # oneDNN takes float32 and bfloat16


@ONEDNN
def test_cost_tables_are_keyed_by_the_kernels_the_layers_run_on(tiny32, tmp_path, monkeypatch):
    """The same machine costs a tree differently on other kernels: a table probed without them
    must not rank trees for a model with them installed (nor the other way round)."""
    import entmtp_hf.calibration.tables as tables_module
    from entmtp_hf.calibration import calibrate
    from entmtp_hf.calibration.store import key_for
    from entmtp_hf.costs.fingerprint import model_key
    from entmtp_hf.costs.table import CostTable

    model, heads = tiny32, tiny32.entmtp_heads
    assert K.kernel_routing(model) == []
    default = model_key(model, heads)
    keys = {default}
    with K.onednn_linears(model):  # a reference for plain decoding: not what EntMTP calls run on
        assert model_key(model, heads) == default
    with CPUKernels(model, heads, rows=(1, 2), pack=True, gemv=False, repeats=1):
        assert K.kernel_routing(model) == ["by row count", "packed"]
        keys.add(model_key(model, heads))
    with monkeypatch.context() as m:  # the package's own kernel measured fastest everywhere
        m.setattr(K, "_timed_median", _fastest("gemv"))
        with CPUKernels(model, heads, rows=(1, 2), pack=False, repeats=1):
            assert K.kernel_routing(model) == ["by row count", "gemv"]
            keys.add(model_key(model, heads))
    with monkeypatch.context() as m:  # oneDNN measured faster from two rows on: dense kernels, no packing
        m.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "onednn") for c in choices})
        with CPUKernels(model, heads, rows=(1, 2), pack=False, repeats=1) as kernels:
            assert K.kernel_routing(model) == ["by row count"] and kernels.active
            dispatched = model_key(model, heads)
        m.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "transposed") for c in choices})
        with CPUKernels(
            model, heads, rows=(1, 2), pack=False, repeats=1
        ):  # other choices (the LM head only), same kinds
            assert K.kernel_routing(model) == ["by row count"]
            assert model_key(model, heads) == dispatched  # a near-tie flipping does not measure again
    assert len(keys | {dispatched}) == 4
    assert model_key(model, heads) == default  # removed: the default path's key again
    calls = []

    def fake(m, h, **k):  # a table filed under the key of the kernels the layers run on now
        calls.append(1)
        machine = key_for(m, h).removesuffix(f"-{model_key(m, h)}")
        return CostTable({"key": machine}, model_key(m, h), {1: 1.0, 2: 1.0}, (0.0, 0.0, 0.0), (0.0, 0.0), 1.0)

    monkeypatch.setattr(tables_module, "probe", fake)
    calibrate(model, heads, folder=tmp_path, progress=False)
    with CPUKernels(model, heads, rows=(1, 2), pack=True, repeats=1):
        calibrate(model, heads, folder=tmp_path, progress=False)
    calibrate(model, heads, folder=tmp_path, progress=False)
    assert calls == [1, 1] and len(list(tmp_path.glob("*.json"))) == 2


@ONEDNN
def test_the_demo_times_plain_and_entmtp_on_and_off_the_kernels(tiny32, monkeypatch):
    """``make demo``'s methods: plain generate, plain on the kernels (applied around the call),
    EntMTP as enabled (on them) and EntMTP with them lifted for the call, put back after."""
    from entmtp_hf.demo import run

    monkeypatch.setattr(K, "_timed_median", lambda run_, choices, repeats: {c: float(c != "onednn") for c in choices})
    model = enable_entmtp(tiny32, tiny32.entmtp_heads, rows=(1, 2), repeats=1)
    kernels = K.kernels_of(model)
    methods = run._methods({"t": EntMTPConfig(tree=TREE)}, kernels, compiled=True)
    assert list(methods) == [run.PLAIN, run.PLAIN_K, run.ENTMTP, run.ENTMTP_F, run.PLAIN_C, run.ENTMTP_C]
    with methods[run.PLAIN_K][0]():
        assert kernels._routes.active()
    with methods[run.ENTMTP_F][0]():
        assert K.kernels_of(model) is None
    assert K.kernels_of(model) is kernels and not kernels._routes.active()
    assert list(run._methods({"t": EntMTPConfig(tree=TREE)}, None, compiled=False)) == [run.PLAIN, run.ENTMTP]
