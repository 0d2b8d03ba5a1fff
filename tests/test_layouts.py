"""Verification products by either kernel or layout: the same numbers, checked against the
model's own logits, modules restored, and greedy decoding unchanged whichever runs."""

import pytest
import torch

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import disable_entmtp, enable_entmtp
from entmtp_hf.cpu_kernels import (
    DECODER_LAYOUTS,
    HEAD_LAYOUTS,
    LAYOUTS_ATTR,
    RowLayouts,
    _onednn_available,
    onednn_linears,
    packed_linears,
    project,
    tree_forward,
)
from entmtp_hf.integration import HEADS_ATTR
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree
from tiny import VOCAB

MC_SIM_7B_63_TREE = Tree.from_choices(MC_SIM_7B_63)
BOTH = [(d, h) for d in DECODER_LAYOUTS for h in HEAD_LAYOUTS]
ONEDNN = pytest.mark.skipif(not _onednn_available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def tiny(tiny_cache):
    """The shared tiny model with heads, re-enabled afterwards (tests here replace its RowLayouts)."""
    model, heads = tiny_cache("llama", "hydra", "mlp")
    yield enable_entmtp(model, heads)
    enable_entmtp(model, heads)


@pytest.fixture(scope="module")
def tiny32():
    """A float32 tiny model with random heads: oneDNN takes float32 (the float64 models keep MKL)."""
    from entmtp_hf.heads import HydraHeads
    from tiny import tiny_model

    model = tiny_model(seed=5).float()
    torch.manual_seed(5)
    return enable_entmtp(model, HydraHeads.for_model(model, num_heads=4, arch="mlp"))


def _ids(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def test_this_torch_build_has_onednn():
    """The CI machine's CPU build has it; without it RowLayouts keeps MKL for the decoder."""
    assert _onednn_available()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layouts_compute_the_same_product(n, bias, dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 40, bias=bias).to(dtype)
    x = torch.randn(n, 8, dtype=dtype)
    want = lin(x).detach()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for layout in ("linear", "transposed", "onednn") if dtype == torch.float32 else ("linear", "transposed"):
        got = project(x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach(), layout)
        assert got.shape == (n, 40) and torch.allclose(got, want, rtol=tol, atol=tol), layout
    with pytest.raises(ValueError, match="unknown layout"):
        project(x, lin.weight, None, "blocked")


def test_each_row_count_is_timed_once_and_one_row_keeps_the_models_own(tiny, tiny32):
    assert RowLayouts(tiny).linears == [] and RowLayouts(tiny).decoder_layouts == ("linear",)  # float64
    layouts = RowLayouts(tiny32, repeats=2)
    assert layouts.layouts == {1: ("linear", "linear")}
    assert len(layouts.linears) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    chosen = layouts.layout(3)
    assert set(layouts.layouts) == {1, 3} and chosen[0] in DECODER_LAYOUTS and chosen[1] in HEAD_LAYOUTS
    layouts.layouts[3] = ("onednn", "transposed")  # stored: later calls do not time again
    assert layouts.layout(3) == ("onednn", "transposed")


def test_bad_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="repeats"):
        RowLayouts(tiny, repeats=0)
    with pytest.raises(ValueError, match="not available here"):  # float64: oneDNN takes float32 and bfloat16
        RowLayouts(tiny, layouts={2: ("linear", "onednn")})
    with pytest.raises(ValueError, match="draft_kernel"):
        RowLayouts(tiny, draft_kernel="transposed")
    with pytest.raises(ValueError, match="layouts must map"):
        RowLayouts(tiny, layouts={2: ("transposed", "linear")})
    biased = torch.nn.Linear(4, 6, bias=True)
    model = type("M", (), {"get_output_embeddings": lambda self: biased})()
    with pytest.raises(ValueError, match="no bias"):
        RowLayouts(model)


def test_matches_only_the_plain_product(tiny):
    layouts = RowLayouts(tiny)
    h = torch.randn(tiny.config.hidden_size, dtype=torch.float64)
    plain = h @ tiny.get_output_embeddings().weight.T
    assert layouts.matches(h, plain)
    assert not layouts.matches(h, plain * 0.5)  # a logit scale
    assert not layouts.matches(h, 3.0 * torch.tanh(plain / 3.0))  # soft-capping
    assert not layouts.matches(h, plain[:-1])  # another vocabulary


@ONEDNN
@pytest.mark.parametrize("chosen", BOTH)
def test_tree_forward_equals_the_models_forward_and_restores_the_modules(tiny32, chosen):
    tiny, ids = tiny32, _ids(6)
    ref = tiny(input_ids=ids, output_hidden_states=-1)
    layouts = RowLayouts(tiny, layouts={6: chosen})
    logits, hidden = tree_forward(tiny, layouts, input_ids=ids)
    assert torch.allclose(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    assert torch.allclose(hidden, ref.hidden_states[-1][0], rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in layouts.linears)  # the swap is undone
    calls = []
    handle = layouts.linears[0].register_forward_hook(lambda *a: calls.append(1))  # hooks still run inside
    with layouts.decoder(6):
        tiny(input_ids=ids)
    handle.remove()
    assert calls == [1] and "forward" not in layouts.linears[0].__dict__


@ONEDNN
def test_the_swap_is_undone_when_the_forward_fails(tiny32):
    layouts = RowLayouts(tiny32, layouts={4: ("onednn", "linear")})
    with pytest.raises(RuntimeError, match="boom"):
        with layouts.decoder(4):
            assert all("forward" in m.__dict__ for m in layouts.linears)
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in layouts.linears)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS[:2])  # float64: oneDNN's is refused (the float32 tests run it)
def test_greedy_decoding_identical_in_either_head_layout(tiny, layout):
    setattr(tiny, LAYOUTS_ATTR, RowLayouts(tiny, layouts={n: ("linear", layout) for n in range(2, 65)}))
    for seed in range(3):
        ids = _ids(4 + seed, seed)
        ref = tiny.generate(ids, max_new_tokens=30, do_sample=False)
        out = tiny.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(out, ref)


@ONEDNN
@pytest.mark.parametrize("chosen", BOTH)
def test_float32_greedy_decoding_matches_vanilla_with_every_choice(tiny32, chosen):
    """oneDNN takes float32 (the tiny float64 models keep MKL: their decoder has no eligible
    layer), so this runs the float32 tiny model: outputs equal, and the swap really ran."""
    model = tiny32
    layouts = RowLayouts(model, layouts={n: chosen for n in range(2, 65)})
    setattr(model, LAYOUTS_ATTR, layouts)
    ran = _greedy_like_vanilla(model, layouts.linears, seeds=range(4))
    assert any(ran) == (chosen[0] == "onednn") and all("forward" not in m.__dict__ for m in layouts.linears)


def test_a_model_whose_logits_are_not_the_plain_product_decodes_with_its_own(tiny):
    """The prefill check fails (here: a wrapped LM head adds a per-token offset that moves the
    argmax), so the loop keeps the model's logits and the output stays vanilla's."""
    head = tiny.get_output_embeddings()
    original = head.forward
    offsets = 3.0 * torch.randn(VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    head.forward = lambda x: original(x) + offsets
    try:
        ids = _ids(5, 7)
        ref = tiny.generate(ids, max_new_tokens=30, do_sample=False)
        out = tiny.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert torch.equal(out, ref)
        h = tiny(input_ids=ids, output_hidden_states=-1)  # the prefill check is what catches it
        assert not getattr(tiny, LAYOUTS_ATTR).matches(h.hidden_states[-1][0, -1], h.logits[0, -1])
    finally:
        del head.forward


def test_enabling_again_keeps_the_timed_layouts(tiny, tiny_cache):
    """Swapping heads (as the benchmark does between methods) must not time the layouts again."""
    kept = getattr(tiny, LAYOUTS_ATTR)
    kept.layouts[3] = ("onednn", "transposed")
    enable_entmtp(tiny, tiny_cache("llama", "medusa", "mlp")[1])
    assert getattr(tiny, LAYOUTS_ATTR) is kept and kept.layouts[3] == ("onednn", "transposed")


def test_disable_removes_the_layouts(tiny):
    disable_entmtp(tiny)
    assert not hasattr(tiny, LAYOUTS_ATTR)


def _greedy_like_vanilla(model, watched, seeds=range(3), tree=MC_SIM_7B_63) -> list[bool]:
    """Greedy EntMTP (``tree``) equals vanilla on a few prompts; per call of a ``watched``
    module, whether its forward was swapped."""
    ran, handle = _swapped_calls(watched)
    try:
        for seed in seeds:
            ids = _ids(4 + seed, seed)
            ref = model.generate(ids, max_new_tokens=30, do_sample=False)
            out = model.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=EntMTPConfig(tree=tree))
            assert torch.equal(out, ref)
    finally:
        handle.remove()
    return ran


def _swapped_calls(modules):
    """A global forward hook recording, for each call of one of ``modules``, whether its forward was swapped."""
    ran = []
    ids = {id(m) for m in modules}
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: ran.append("forward" in m.__dict__) if id(m) in ids else None)
    return ran, handle


@ONEDNN
@pytest.mark.parametrize("base_rows", [False, True])
def test_drafting_kernels_draft_the_same_tree_and_restore_the_heads(tiny32, base_rows):
    """The heads' layers and LM rows (their own LM heads, or the base LM head's rows of a draft
    vocabulary read through ``state.kernel``) by oneDNN: the same probabilities (to float32
    rounding), so the same tokens here; every swap undone after the block and after an error."""
    from entmtp_hf.heads import HydraHeads

    model = tiny32
    heads = getattr(model, HEADS_ATTR)
    if base_rows:
        torch.manual_seed(6)
        heads = HydraHeads.for_model(model, num_heads=4, arch="mlp", use_base_lm_head=True,
                                     draft_vocab=torch.arange(0, VOCAB, 2))  # fmt: skip
    buffers = MC_SIM_7B_63_TREE.buffers(dtype=torch.float32)
    hidden = model(input_ids=_ids(7), output_hidden_states=-1).hidden_states[-1][0]
    proposals = {}
    for kernel in ("linear", "onednn"):
        layouts = RowLayouts(model, draft_kernel=kernel)
        state = heads.new_state(model)
        heads.observe(state, hidden)
        with layouts.drafting(heads, state):
            assert state.kernel == (kernel if base_rows else "linear")  # own LM heads are swapped modules
            proposals[kernel] = heads.propose(state, torch.tensor(3), buffers)
        assert state.kernel == "linear" and all("forward" not in m.__dict__ for m in heads.modules())
    a, b = proposals["linear"], proposals["onednn"]
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.probs, b.probs, rtol=1e-4, atol=1e-6)
    layouts = RowLayouts(model, draft_kernel="onednn")
    with pytest.raises(RuntimeError, match="boom"):
        with layouts.drafting(heads, heads.new_state(model)):
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in heads.modules())


@ONEDNN
@pytest.mark.parametrize("kernel", ["linear", "onednn", None])
def test_float32_greedy_decoding_matches_vanilla_with_either_draft_kernel(tiny32, kernel):
    """None: timed once for the heads on first use and kept."""
    model = tiny32
    heads = getattr(model, HEADS_ATTR)
    layouts = RowLayouts(model, repeats=1, draft_kernel=kernel)
    setattr(model, LAYOUTS_ATTR, layouts)
    ran = _greedy_like_vanilla(model, [m for m in heads.modules() if type(m) is torch.nn.Linear])
    chosen = layouts._drafting[heads][0]
    assert chosen == (kernel or chosen) and list(layouts._drafting) == [heads]
    assert ran and all(ran) == (chosen == "onednn") and any(ran) == (chosen == "onednn")


@ONEDNN
def test_onednn_linears_runs_every_linear_and_keeps_the_output(tiny32):
    model = tiny32
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert model.get_output_embeddings() in linears  # the LM head too
    ids = _ids(6, 3)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    ran, handle = _swapped_calls(linears)
    try:
        with onednn_linears(model):
            out = model.generate(ids, max_new_tokens=20, do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(out, ref) and ran and all(ran)
    assert all("forward" not in m.__dict__ for m in linears)


def test_float64_heads_keep_their_own_kernel_even_when_onednn_is_asked_for(tiny):
    """oneDNN takes float32 and bfloat16: float64 heads have nothing it could run."""
    layouts = RowLayouts(tiny, draft_kernel="onednn")
    setattr(tiny, LAYOUTS_ATTR, layouts)
    ids = _ids(5, 4)
    ref = tiny.generate(ids, max_new_tokens=20, do_sample=False)
    out = tiny.generate(ids, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(out, ref) and layouts._drafting[getattr(tiny, HEADS_ATTR)][0] == "linear"


@ONEDNN
def test_entmtp_inside_onednn_linears_nests_and_restores(tiny32):
    """Swaps nest: the tree forward's and drafting's swaps inside the plain-decoding one give
    every module back what it had, and the output is still vanilla's."""
    model = tiny32
    setattr(model, LAYOUTS_ATTR, RowLayouts(model, layouts={n: ("onednn", "onednn") for n in range(2, 65)},
                                            draft_kernel="onednn"))  # fmt: skip
    ids = _ids(6, 5)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    with onednn_linears(model):
        out = model.generate(ids, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
        assert all("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
    assert torch.equal(out, ref) and all("forward" not in m.__dict__ for m in model.modules())
    heads = getattr(model, HEADS_ATTR)  # timed inside the block, the heads' layers still count as swappable
    assert len(getattr(model, LAYOUTS_ATTR)._drafting[heads][2]) == sum(type(m) is torch.nn.Linear for m in heads.modules())


def test_only_plain_or_own_forwards_are_swapped():
    from entmtp_hf.cpu_kernels import _onednn_forward, _swappable

    plain, hooked, ours = (torch.nn.Linear(4, 4) for _ in range(3))
    hooked.forward = lambda x: x  # someone else's instance forward (an offloading hook, say)
    ours.forward = _onednn_forward.__get__(ours)
    assert _swappable([plain, hooked, ours]) == [plain, ours]
    assert _swappable([plain.double()]) == []  # oneDNN takes float32 and bfloat16


@ONEDNN
def test_the_prefill_runs_on_the_kernel_timed_at_prefill_rows(tiny32):
    """Every prompt length takes the choice for PREFILL_ROWS rows (one timing), here oneDNN while
    every tree size keeps MKL: the swapped calls are the prefill's, and the output is vanilla's."""
    from entmtp_hf.cpu_kernels import PREFILL_ROWS

    model = tiny32
    presets = {n: ("linear", "linear") for n in range(2, 65)} | {PREFILL_ROWS: ("onednn", "linear")}
    layouts = RowLayouts(model, layouts=presets, draft_kernel="linear")
    setattr(model, LAYOUTS_ATTR, layouts)
    ran = _greedy_like_vanilla(model, layouts.linears, tree=[[0], [1], [0, 0]])  # 4 nodes, not 64
    assert any(ran) and not all(ran) and set(layouts.layouts) == set(presets) | {1}
    calls_per_forward = len(layouts.linears)
    assert sum(ran) == 3 * calls_per_forward  # one prefill per generate call, three prompts


def _dense(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@ONEDNN
def test_packed_linears_decode_like_vanilla_and_give_the_exact_weights_back(tiny32):
    """Packed in place, the decoder's layers compute the same products (the float32 model's greedy
    output, plain and EntMTP, is vanilla's); saving is refused while packed; the weights come back
    bit for bit; the LM head (tied or not) is never packed."""
    model = tiny32
    before, ids = _dense(model), _ids(6, 7)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    decoder_linears = [m for m in model.get_decoder().modules() if type(m) is torch.nn.Linear]
    with packed_linears(model) as n:
        assert n == len(decoder_linears) > 0
        assert all(m.weight.numel() == 0 for m in decoder_linears)
        assert model.get_output_embeddings().weight.numel() > 0
        with pytest.raises(RuntimeError, match="packed"):
            model.state_dict()
        plain = model.generate(ids, max_new_tokens=20, do_sample=False)
        tree = model.generate(ids, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(plain, ref) and torch.equal(tree, ref)
    after = _dense(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all("forward" not in vars(m) for m in model.modules())


@ONEDNN
def test_packed_linears_unpack_on_errors_and_nest_in_onednn_linears(tiny32):
    model = tiny32
    before = _dense(model)
    with pytest.raises(KeyError):
        with packed_linears(model):
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
            with packed_linears(model):
                pass
    assert all(torch.equal(before[k], v) for k, v in _dense(model).items())
    assert all("forward" not in vars(m) and "_entmtp_packed_weight" not in vars(m) for m in model.modules())
    with onednn_linears(model):
        outer = {m: vars(m)["forward"] for m in model.modules() if type(m) is torch.nn.Linear}
        with packed_linears(model) as n:
            assert n > 0
        assert all(vars(m)["forward"] is f for m, f in outer.items())  # the outer swap is back
    assert all("forward" not in vars(m) for m in model.modules())


@ONEDNN
def test_row_layouts_leave_packed_layers_alone(tiny32):
    """A RowLayouts built before packing neither swaps nor times the packed layers (they have no
    dense weight), so its decoder kernel and its timing still work inside the block."""
    model = tiny32
    layouts = RowLayouts(model)
    ids = _ids(6, 8)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    with packed_linears(model):
        assert layouts._tune(3)[0] == "linear"  # nothing left to time: the model's own
        setattr(model, LAYOUTS_ATTR, RowLayouts(model, layouts={n: ("onednn", "onednn") for n in range(2, 65)}))
        with getattr(model, LAYOUTS_ATTR).decoder(4):
            assert not any(vars(m).get("forward").__func__.__name__ == "_onednn_forward"
                           for m in model.get_decoder().modules() if type(m) is torch.nn.Linear)  # fmt: skip
        out = model.generate(ids, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
    assert torch.equal(out, ref)


@ONEDNN
def test_a_weight_shared_with_another_module_is_not_packed():
    from tiny import tiny_model

    model = tiny_model(seed=3).float()
    layer = next(m for m in model.get_decoder().modules() if type(m) is torch.nn.Linear)
    other = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
    other.weight = layer.weight  # tied to a module outside the decoder
    model.add_module("tied_probe", other)
    with packed_linears(model) as n:
        assert layer.weight.numel() > 0 and n == sum(type(m) is torch.nn.Linear for m in model.get_decoder().modules()) - 1
