"""The package's few-row kernel: F.linear's products, row by row the same whatever the row count,
built once per machine, and out of the way (with the reason said) where it cannot be built."""

import platform
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

import entmtp_hf.cpu_kernels as K
import entmtp_hf.gemv as G
from entmtp_hf import CPUKernels

BUILDS_HERE = platform.machine().lower() in ("x86_64", "amd64") and shutil.which("c++") is not None
NEEDS_IT = pytest.mark.skipif(G.unavailable() is not None, reason=f"the gemv kernel is off here: {G.unavailable()}")


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """A fresh build attempt into an empty folder (the process's built kernel restored after)."""
    monkeypatch.setattr(G, "build_dir", lambda: tmp_path / "kernel")
    G._built.cache_clear()
    yield
    G._built.cache_clear()


def test_an_x86_machine_with_a_compiler_builds_it():
    """CI's machines are such: there the kernel must build and pass its own check."""
    if BUILDS_HERE and torch.backends.cpu.get_cpu_capability() in G.CAPABLE:
        assert G.unavailable() is None


@NEEDS_IT
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(1, 8), (4, 16), (7, 13), (9, 576), (130, 40), (261, 3)])
def test_it_computes_f_linears_product(n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(G.gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, 2 * k, generator=g)[..., ::2]  # batched and strided, as a view
    torch.testing.assert_close(G.gemv(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert G.gemv(x, w, b).shape == (2, 3, n)


@NEEDS_IT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_comes_out_the_same_whatever_rows_share_the_call(dtype):
    """A tree's verification products equal the one-token products bit for bit."""
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(67, 45, generator=g), torch.randn(67, generator=g), torch.randn(9, 45, generator=g)
    w, b, x = w.to(dtype), b.to(dtype), x.to(dtype)
    alone = torch.cat([G.gemv(x[i : i + 1], w, b) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(G.gemv(x[:rows], w, b), alone[:rows])


def test_it_takes_only_what_it_computes_right():
    w, x = torch.randn(8, 16), torch.randn(2, 16)
    assert G.takes(x, w, None) and G.takes(x, w, torch.randn(8))
    assert G.takes(x.bfloat16(), w.bfloat16(), None)
    assert not G.takes(x.double(), w.double(), None)  # float32 and bfloat16 only
    assert not G.takes(x.half(), w.half(), None)
    assert not G.takes(x, w.bfloat16(), None)  # one dtype throughout
    assert not G.takes(x, w, torch.randn(8).bfloat16())
    assert not G.takes(torch.randn(2, 8), torch.randn(16, 8).t(), None)  # a transposed view: copied per call
    assert not G.takes(x, torch.nn.Parameter(w), None)  # a gradient wanted: F.linear computes it
    with torch.no_grad():
        assert G.takes(x, torch.nn.Parameter(w), None)


@NEEDS_IT
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_bfloat16_weights_are_summed_in_float32_and_rounded_once(rows):
    """bfloat16 in and out, as ``F.linear`` on bfloat16 gives: the float32 product of the same
    values rounded to bfloat16, here within one bfloat16 step of it."""
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(130, 77, generator=g), torch.randn(130, generator=g), torch.randn(rows, 77, generator=g)
    w, b, x = w.bfloat16(), b.bfloat16(), x.bfloat16()
    out = G.gemv(x, w, b)
    exact = F.linear(x.float(), w.float(), b.float())
    assert out.dtype == torch.bfloat16
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


@NEEDS_IT
@pytest.mark.parametrize("k", [13, 40, 576])
def test_int8_weights_with_a_scale_per_row_multiply_in_float32(k):
    """``x @ (qdata * scale).T + bias`` (int8 weight-only quantization's product), float32 sums, for
    float32 and bfloat16 rows; each row the same whatever the row count."""
    g = torch.Generator().manual_seed(k)
    qdata = torch.randint(-127, 128, (37, k), generator=g, dtype=torch.int8)
    scale, bias = torch.rand(37, 1, generator=g) / 64, torch.randn(37, generator=g)
    weight = qdata.double() * scale.double()
    ext = G.extension()
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, k, generator=g)
        exact = F.linear(x.double(), weight, bias.double())
        torch.testing.assert_close(ext.gemv_int8(x, qdata, scale, bias).double(), exact, atol=1e-4, rtol=1e-5)
        out = ext.gemv_int8(x.bfloat16(), qdata, scale, bias.bfloat16())
        exact = F.linear(x.bfloat16().double(), weight, bias.bfloat16().double())
        assert out.dtype == torch.bfloat16 and ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    x = torch.randn(2, 3, k, generator=g).bfloat16()
    whole = ext.gemv_int8(x, qdata, scale, None)
    assert whole.shape == (2, 3, 37)
    rows = [ext.gemv_int8(x[i : i + 1, j : j + 1], qdata, scale, None) for i in range(2) for j in range(3)]
    assert torch.equal(whole.reshape(6, 37), torch.cat(rows).reshape(6, 37))
    # scales read in their own dtype (float32, bfloat16) or converted (float64, a strided view): the same
    # products as with the float32 values of those scales
    strided = torch.stack([scale.reshape(-1), scale.reshape(-1)], 1)[:, 0]
    for scales in (scale.bfloat16(), scale.double(), strided):
        assert torch.equal(ext.gemv_int8(x, qdata, scales, None), ext.gemv_int8(x, qdata, scales.float(), None))
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.gemv_int8(x, qdata.t().contiguous().t(), scale, None)
    with pytest.raises(RuntimeError, match="one float per row"):
        ext.gemv_int8(x, qdata, scale[:5], None)


@NEEDS_IT
@pytest.mark.parametrize("k", [40, 576, 600])
def test_int8_weights_take_bfloat16_rows_in_blocks_of_16_bit_integers(k):
    """bfloat16 rows meet int8 weights in integers: per block of 64 values a power-of-two scale
    2^(E-15) (E: the exponent of the block's largest magnitude), so each value is off by at most
    2^(E-16) and an outlier costs precision in its own block only; a non-finite value makes its
    row's outputs NaN, as a float product would."""
    g = torch.Generator().manual_seed(k)
    qdata = torch.randint(-127, 128, (29, k), generator=g, dtype=torch.int8)
    qdata[:, 0] = 0  # the outlier below multiplies zeros: the exact product does not see it
    scale = torch.rand(29, generator=g) / 64
    weight = qdata.double() * scale.double()[:, None]
    x = torch.randn(3, k, generator=g)
    x[1] = x[0]
    x[1, 0] = 3.0e4  # in the first block of the second row only
    x[2] *= 1e-3
    x = x.bfloat16()
    out = G.extension().gemv_int8(x, qdata, scale, None).double()

    def fixed(rows: torch.Tensor, width: int) -> torch.Tensor:  # the rounding the docstring states
        parts = []
        for b in rows.double().split(width, dim=1):
            unit = torch.exp2(torch.frexp(b.abs().amax(1, keepdim=True))[1].double() - 15)
            parts.append(torch.round(b / unit) * unit)  # ties to even
        return torch.cat(parts, 1)

    expected = F.linear(fixed(x, 64), weight)  # then exact sums: only float32's and bfloat16's rounding left
    assert ((out - expected).abs() <= expected.abs() * 2**-8 + (x.double().abs() @ weight.abs().T) * 2**-20).all()
    exact = F.linear(x.double(), weight)
    assert ((out - exact).abs() <= exact.abs() * 2**-7 + 1e-6)[[0, 2]].all()  # no outlier: as good as float32 sums
    if k > 64:  # one scale for the whole row: the outlier's row would be far off
        assert ((F.linear(fixed(x, k), weight) - out).abs() > out.abs() * 2**-6)[1].any()
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[0, k - 1] = bad
        res = G.extension().gemv_int8(y, qdata, scale, None)
        assert res[0].isnan().all() and torch.equal(res[1:], G.extension().gemv_int8(x[1:], qdata, scale, None))


@NEEDS_IT
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_of_int8_products_of_one_input_equals_each_product_alone(dtype):
    """``entmtp_hf_cpu::gemv_int8_group`` (what compiled graphs call for a layer's products of one
    input): each output bit for bit what ``gemv_int8`` gives for its weight alone, whatever the row
    count, the weights' sizes (not multiples of four), their scales' dtypes and biases."""
    g = torch.Generator().manual_seed(11)
    sizes = (37, 8, 130)
    qdata = [torch.randint(-127, 128, (n, 96), generator=g, dtype=torch.int8) for n in sizes]
    scales = [torch.rand(n, generator=g) / 64 for n in sizes]
    scales[1] = scales[1].bfloat16()
    biases = [None, torch.randn(8, generator=g).to(dtype), None]
    group = torch.ops.entmtp_hf_cpu.gemv_int8_group
    for rows in (1, 3, 5):
        x = torch.randn(1, rows, 96, generator=g).to(dtype)
        outs = group(x, qdata, scales, biases)
        alone = [G.extension().gemv_int8(x, q, s, b) for q, s, b in zip(qdata, scales, biases)]
        assert len(outs) == 3 and all(o.shape == (1, rows, n) for o, n in zip(outs, sizes))
        assert all(torch.equal(o, a) for o, a in zip(outs, alone))
    with pytest.raises(RuntimeError, match="one scale and one bias"):
        group(x, qdata, scales[:2], biases)
    with pytest.raises(RuntimeError, match="weight's K"):
        group(x, [qdata[0], qdata[1][:, :50].contiguous()], scales[:2], biases[:2])


@NEEDS_IT
def test_where_a_gradient_is_wanted_the_layout_runs_f_linear():
    w = torch.nn.Parameter(torch.randn(8, 16))
    K.project(torch.randn(2, 16), w, None, "gemv").sum().backward()
    assert w.grad is not None


def test_where_it_cannot_be_built_it_says_why_and_the_other_kernels_serve(rebuilt, monkeypatch):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'entmtp_hf_cpu'\nc++: fatal error")

    monkeypatch.setattr(G, "_not_here", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", broken)
    why = G.unavailable()
    assert why.startswith("could not build or run it in ") and "c++: fatal error" in why
    with pytest.raises(RuntimeError, match="not available"):
        G.gemv(torch.randn(1, 4), torch.randn(2, 4))
    assert not K._works("gemv", torch.randn(2, 4)) and K.fitted_layout("gemv", torch.randn(2, 4)) == "linear"
    seen = []

    def timed(run, choices, repeats):
        seen.append(choices)
        return dict.fromkeys(choices, 1.0)

    monkeypatch.setattr(K, "_timed_median", timed)
    CPUKernels(tiny_model(seed=1).float(), rows=(1, 2), repeats=1)
    assert seen and not any("gemv" in c for c in seen)


def test_a_cache_folder_that_cannot_be_written_turns_it_off_with_the_folder_named(rebuilt, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(G, "build_dir", lambda: blocker / "kernel")
    monkeypatch.setattr(G, "_not_here", lambda: None)
    why = G.unavailable()
    assert why.startswith(f"could not build or run it in {blocker / 'kernel'}")


def test_a_build_that_computes_wrong_products_is_not_used(rebuilt, monkeypatch):
    from torch.utils import cpp_extension

    wrong = types.SimpleNamespace(gemv=lambda x, w, b: torch.zeros(*x.shape[:-1], w.shape[0]))
    monkeypatch.setattr(G, "_not_here", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: wrong)
    assert "wrong products" in G.unavailable()


def test_a_build_whose_attention_is_wrong_is_not_used(rebuilt, monkeypatch):
    from torch.utils import cpp_extension

    def shifted(q, k, v, mask, scale):
        return torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])

    wrong = types.SimpleNamespace(gemv=torch.nn.functional.linear, decode_attention=shifted)
    monkeypatch.setattr(G, "_not_here", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: wrong)
    assert "wrong attention" in G.unavailable()


def test_a_build_whose_int8_products_are_wrong_is_not_used(rebuilt, monkeypatch):
    from torch.utils import cpp_extension

    def attention(q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)

    def zeros(x, qdata, scale, bias):
        return torch.zeros(*x.shape[:-1], qdata.shape[0])

    wrong = types.SimpleNamespace(gemv=F.linear, decode_attention=attention, gemv_int8=zeros)
    monkeypatch.setattr(G, "_not_here", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: wrong)
    assert "wrong int8 products" in G.unavailable()


def test_off_where_the_cpu_cannot_run_it(rebuilt, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert G.unavailable() == "not an x86-64 CPU (aarch64)"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    G._built.cache_clear()
    assert "no AVX2" in G.unavailable()


@NEEDS_IT
def test_a_second_process_loads_the_built_kernel_without_building(tmp_path):
    """The build is kept in the user cache folder, keyed by source, flags, torch and Python."""
    import subprocess
    import sys

    code = "import entmtp_hf.gemv as G; print(G.unavailable(), G.build_dir())"
    env = {**__import__("os").environ}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[0] == "None", out.stderr[-2000:]
    assert "building" not in out.stderr and out.stdout.split()[1] == str(G.build_dir())
