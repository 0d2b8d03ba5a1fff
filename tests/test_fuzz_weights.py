"""Fuzz: weights a user edits, and models copied, pickled, saved and moved, after ``enable_entmtp``.

Each case (a fixed seed) takes a float32 tiny model (the CPU kernels act on float32 and
bfloat16) with every kernel routed whatever this CPU measures (the decoder on packed copies, the
LM head and the heads' drafting on oneDNN), then runs a random sequence of what users and
libraries do to a loaded model: LoRA-like merges through ``.data``, rows reordered in place,
weights replaced, parametrized and unparametrized, a state dict loaded, writes inside
``torch.inference_mode()``, ``copy.deepcopy``, ``torch.save(model)`` and back, ``save_pretrained``
and back, ``model.to(float64)`` and back, ``enable_entmtp`` again. After each, greedy EntMTP on
the model in hand equals plain ``generate`` token for token. No case has met a near tie in
float32 at these seeds.
"""

from __future__ import annotations

import copy
import io
import random

import pytest
import torch
from tiny import ARCHS, VOCAB, fitted_heads, tiny_model
from torch.nn.utils import parametrize

import entmtp_hf.cpu_kernels as K
from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63

pytestmark = pytest.mark.skipif(not K.onednn_available(), reason="this torch build has no oneDNN linear")
#: case i runs OPS[2i] and OPS[2i + 1] (so the cases cover every operation) and one drawn at random, in a random order
CASES = range(6)
TREES = [MC_SIM_7B_63, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]]
OPS = (
    "lora",
    "rows",
    "assign",
    "parametrize",
    "unparametrize",
    "load_state_dict",
    "inference_write",
    "deepcopy",
    "torch_save",
    "save_pretrained",
    "to_float64_and_back",
    "enable_again",
)


class _Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return self.scale * w


def _enable(model, heads) -> None:
    enable_entmtp(model, heads, rows=(1, 2, 4, 8), repeats=1, pack=True, gemv=False)
    assert K.kernels_of(model).kinds() == ["by row count", "packed"]


def _some_linears(model, rng: random.Random) -> list[torch.nn.Linear]:
    layers = [m for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    return rng.sample(layers, rng.randint(1, len(layers)))


def _apply(op: str, model, rng: random.Random, tmp_path, check, model_cls: type) -> object:
    """Run ``op`` on ``model``; returns the model to go on with (a copy for the copying ops)."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if op == "lora":  # weight.data += B @ A, as a merged adapter does (no version counter moves)
        for m in _some_linears(model, rng):
            rank = rng.randint(1, 4)
            m.weight.data += (
                0.2
                * torch.randn(m.weight.shape[0], rank, generator=g)
                @ torch.randn(rank, m.weight.shape[1], generator=g)
            )
    elif op == "rows":
        for m in _some_linears(model, rng):
            m.weight.data.copy_(m.weight.data[torch.randperm(m.weight.shape[0], generator=g)])
    elif op == "assign":
        for m in _some_linears(model, rng):
            m.weight.data = m.weight.data * rng.uniform(0.5, 1.5)
    elif op == "parametrize":
        for m in _some_linears(model, rng):
            parametrize.register_parametrization(m, "weight", _Scaled(rng.uniform(0.5, 1.5)))
    elif op == "unparametrize":  # the parametrized value written back into the original tensor
        for m in model.modules():
            if parametrize.is_parametrized(m, "weight"):
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
    elif op == "load_state_dict":
        state = {
            k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in model.state_dict().items()
            if "entmtp_heads" not in k
        }
        model.load_state_dict(state, strict=False)
    elif op == "inference_write":
        with torch.inference_mode():
            for m in _some_linears(model, rng):
                m.weight.data.mul_(rng.uniform(0.5, 1.5))
    elif op == "deepcopy":
        twin = copy.deepcopy(model)
        check(model)  # the original is left as it was
        return twin
    elif op == "torch_save":
        buffer = io.BytesIO()
        if any(parametrize.is_parametrized(m) for m in model.modules()):  # torch's own rule, for any model
            with pytest.raises(RuntimeError, match="parametrized modules"):
                torch.save(model, buffer)
            return model
        torch.save(model, buffer)
        buffer.seek(0)
        check(model)
        return torch.load(buffer, weights_only=False)
    elif op == "save_pretrained":
        folder = tmp_path / f"saved-{rng.randrange(10**9)}"
        model.save_pretrained(folder)  # the weights as they are now, parametrizations resolved or not
        loaded = model_cls.from_pretrained(folder, dtype=torch.float32)
        _enable(loaded, copy.deepcopy(model.entmtp_heads))
        return loaded
    elif op == "to_float64_and_back":
        model.to(torch.float64)
        check(model)
        model.to(torch.float32)
    elif op == "enable_again":
        _enable(model, model.entmtp_heads)
    else:
        raise ValueError(op)
    return model


@pytest.mark.parametrize("case", CASES)
def test_weights_edited_and_models_copied_after_enabling_stay_lossless(case, monkeypatch, tmp_path):
    rng = random.Random(case)
    monkeypatch.setattr(K, "_timed_median", lambda run, choices, repeats: {c: float(c != "onednn") for c in choices})
    arch = rng.choice(sorted(ARCHS))
    model = tiny_model(arch, seed=case).float()
    heads = fitted_heads(model, num_heads=4, steps=20, seed=case, use_base_lm_head=rng.random() < 0.5)
    _enable(model, heads)
    ids = torch.randint(0, VOCAB, (1, rng.randint(3, 10)), generator=torch.Generator().manual_seed(case))
    tree = rng.choice(TREES)
    done: list[str] = []

    def check(m) -> None:
        plain = m.generate(ids, max_new_tokens=16, do_sample=False)
        tokens = m.generate(ids, max_new_tokens=16, do_sample=False, entmtp_config=EntMTPConfig(tree=tree))
        assert torch.equal(tokens, plain), f"case {case} ({arch}): EntMTP differs from plain generate after {done}"

    check(model)
    ops = [OPS[2 * case % len(OPS)], OPS[(2 * case + 1) % len(OPS)], rng.choice(OPS)]
    for op in rng.sample(ops, len(ops)):
        done.append(op)
        model = _apply(op, model, rng, tmp_path, check, ARCHS[arch][1])
        check(model)
