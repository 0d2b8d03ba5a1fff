"""The CPU kernel opt-in: the same products, the choices it measures, nothing left behind.

Every kernel computes the same products, so greedy output on a float32 tiny model stays
vanilla's whichever is chosen; the layers get their own forward and their exact weights
back when the kernels are removed; nothing changes per call, so threads are safe.
"""

import threading

import pytest
import torch

import entmtp_hf.cpu_kernels as K
from entmtp_hf import CPUKernels, EntMTPConfig, disable_entmtp, enable_entmtp
from entmtp_hf.heads import HydraHeads
from entmtp_hf.trees.tree import MC_SIM_7B_63
from tiny import VOCAB, tiny_model

ONEDNN = pytest.mark.skipif(not K.onednn_available(), reason="this torch build has no oneDNN linear")
TREE = [[0], [1], [0, 0], [0, 0, 0]]


@pytest.fixture
def tiny32():
    """A float32 tiny model with random heads (oneDNN takes float32; the float64 models keep MKL)."""
    model = tiny_model(seed=5).float()
    torch.manual_seed(5)
    return enable_entmtp(model, HydraHeads.for_model(model, num_heads=4, arch="mlp"))


def _ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _dense(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model) -> bool:
    return all("forward" not in vars(m) and K.PACKED_ATTR not in vars(m) for m in model.modules())


def _greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=20, do_sample=False, **kwargs)


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


def test_by_rows_fills_the_gaps_with_the_next_measured_count():
    table = K._by_rows({1: "linear", 4: "onednn", 8: "linear"})
    assert table == ["linear", "linear", "onednn", "onednn", "onednn", "linear", "linear", "linear", "linear"]
    layer = torch.nn.Linear(3, 2)
    dispatch = K._Dispatch(layer, table)
    for rows in (0, 1, 5, 40):  # 40 rows: above the largest measured, its choice
        x = torch.randn(rows, 3)
        torch.testing.assert_close(dispatch(x), layer(x))


@ONEDNN
def test_the_choices_follow_the_measured_times(tiny32, monkeypatch):
    """Synthetic timings: oneDNN faster from two rows on, packing slower, so ``auto`` does not pack."""
    def fake(run, choices, repeats):
        rows = fake.rows
        if choices == ("packed",):
            return {"packed": 10.0}
        if "transposed" in choices:
            return {c: (1.0 if c == "transposed" else 2.0) for c in choices}
        return {"linear": 1.0, "onednn": 0.5 if rows > 1 else 2.0}

    real_pass = CPUKernels._decoder_pass

    def decoder_pass(self, layers, rows, packed=False):
        fake.rows = rows
        return real_pass(self, layers, rows, packed)

    monkeypatch.setattr(K, "_timed_median", fake)
    monkeypatch.setattr(CPUKernels, "_decoder_pass", decoder_pass)
    kernels = CPUKernels(tiny32, rows=(1, 2, 4), pack="auto")
    assert kernels.active and not kernels.packed
    assert kernels.decoder == {1: "linear", 2: "onednn", 4: "onednn"}
    assert set(kernels.lm_head.values()) == {"transposed"}
    assert "onednn at 2-4 rows" in kernels.describe()
    kernels.remove()
    assert _untouched(tiny32)


@ONEDNN
@pytest.mark.parametrize("pack", [False, True])
def test_greedy_output_is_vanillas_and_everything_comes_back(tiny32, pack):
    model = tiny32
    before, ids = _dense(model), _ids(6)
    ref = _greedy(model, ids)
    tree = _greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    with CPUKernels(model, model.entmtp_heads, rows=(1, 2, 4, 8), pack=pack, repeats=1) as kernels:
        assert kernels.active and kernels.packed == pack
        if pack:
            assert all(m.weight.numel() == 0 for m in model.get_decoder().modules() if type(m) is torch.nn.Linear)
            with pytest.raises(RuntimeError, match="packed"):
                model.state_dict()
        assert torch.equal(_greedy(model, ids), ref)
        assert torch.equal(_greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)), tree)
    assert torch.equal(tree, ref) and _untouched(model)
    assert all(torch.equal(before[k], v) for k, v in _dense(model).items())


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
    enable_entmtp(model, heads, cpu_kernels=True, rows=(1, 2), repeats=1)
    assert vars(model)["_entmtp_cpu_kernels"].active
    enable_entmtp(model, heads)  # enabling again without kernels removes them
    assert "_entmtp_cpu_kernels" not in vars(model) and _untouched(model)
    enable_entmtp(model, heads, cpu_kernels=True, rows=(1, 2), repeats=1, pack=True)
    disable_entmtp(model)
    assert _untouched(model) and model.config._attn_implementation == "sdpa"


@ONEDNN
@pytest.mark.parametrize("kernels_on", [False, True])
def test_threads_decode_at_once_and_leave_nothing_behind(tiny32, kernels_on):
    """Two threads in EntMTP generate on one model: each gets vanilla's output, and no module
    is left with a forward it did not have before (nothing is swapped per call)."""
    model, heads = tiny32, tiny32.entmtp_heads
    enable_entmtp(model, heads, cpu_kernels=kernels_on, rows=(1, 2, 4, 5), repeats=1)
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
def test_packed_linears_decode_like_vanilla_and_give_the_exact_weights_back(tiny32):
    """The benchmark's packed reference: same products, saving refused while packed, the weights
    back bit for bit, the LM head (tied or not) never packed."""
    model = tiny32
    before, ids = _dense(model), _ids(6, 7)
    ref = _greedy(model, ids)
    decoder_linears = [m for m in model.get_decoder().modules() if type(m) is torch.nn.Linear]
    with K.packed_linears(model) as n:
        assert n == len(decoder_linears) > 0
        assert model.get_output_embeddings().weight.numel() > 0
        with pytest.raises(RuntimeError, match="packed"):
            model.state_dict()
        plain = _greedy(model, ids)
        tree = _greedy(model, ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(plain, ref) and torch.equal(tree, ref)
    assert all(torch.equal(before[k], v) for k, v in _dense(model).items()) and _untouched(model)


@ONEDNN
def test_packing_gives_every_weight_back_on_errors(tiny32):
    model = tiny32
    before = _dense(model)
    with pytest.raises(KeyError):
        with K.packed_linears(model):
            raise KeyError("boom")
    assert all(torch.equal(before[k], v) for k, v in _dense(model).items())
    calls, real = [], torch.nn.Module.register_state_dict_pre_hook

    def fail_on_the_third(self, hook):  # a failure halfway through packing
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("hook refused")
        return real(self, hook)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.Module, "register_state_dict_pre_hook", fail_on_the_third)
        with pytest.raises(RuntimeError, match="hook refused"):
            with K.packed_linears(model):
                pass
    assert all(torch.equal(before[k], v) for k, v in _dense(model).items()) and _untouched(model)


@ONEDNN
def test_a_weight_shared_with_another_module_is_not_packed():
    model = tiny_model(seed=3).float()
    layer = next(m for m in model.get_decoder().modules() if type(m) is torch.nn.Linear)
    other = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
    other.weight = layer.weight  # tied to a module outside the decoder
    model.add_module("tied_probe", other)
    with K.packed_linears(model) as n:
        assert layer.weight.numel() > 0 and n == sum(type(m) is torch.nn.Linear for m in model.get_decoder().modules()) - 1


def test_only_plain_layers_without_a_forward_of_someone_elses_are_taken():
    plain, hooked = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    hooked.forward = lambda x: x  # someone else's instance forward (an offloading hook, say)
    assert K._plain_linears([plain, hooked]) == [plain]
    assert K._plain_linears([plain.double()]) == []  # oneDNN takes float32 and bfloat16


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
    assert K.kernel_routing(model, heads) == []
    default = model_key(model, heads)
    keys = {default}
    with K.onednn_linears(model):
        assert K.kernel_routing(model, heads) == ["entmtp_hf.cpu_kernels._onednn_forward"]
        keys.add(model_key(model, heads))
    with CPUKernels(model, heads, rows=(1, 2), pack=True, repeats=1):
        keys.add(model_key(model, heads))
    with monkeypatch.context() as m:  # oneDNN measured faster from two rows on: dispatchers, not packing
        m.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "onednn") for c in choices})
        with CPUKernels(model, heads, rows=(1, 2), pack=False, repeats=1) as kernels:
            assert K.kernel_routing(model, heads) == ["by row count"] and kernels.active
            dispatched = model_key(model, heads)
        m.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "transposed") for c in choices})
        with CPUKernels(model, heads, rows=(1, 2), pack=False, repeats=1):  # other choices (the LM head only), same kinds
            assert K.kernel_routing(model, heads) == ["by row count"]
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
    with K.onednn_linears(model):
        calibrate(model, heads, folder=tmp_path, progress=False)
    calibrate(model, heads, folder=tmp_path, progress=False)
    assert calls == [1, 1] and len(list(tmp_path.glob("*.json"))) == 2
