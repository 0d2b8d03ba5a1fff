"""A model with EntMTP enabled is still an ordinary model to copy, pickle and save.

``copy.deepcopy``, ``torch.save(model)`` (whole-module pickling, loaded back with
``weights_only=False``) and ``save_pretrained`` work after ``enable_entmtp`` and after EntMTP
calls, with and without the CPU kernels; every copy decodes plain ``generate``'s tokens and owns
its kernels (packed copies are never shared or pickled: a copy packs its own weights).
"""

import copy
import io

import pytest
import torch
from tiny import VOCAB, tiny_model
from transformers import LlamaForCausalLM

import entmtp_hf.cpu_kernels as K
from entmtp_hf import EntMTPConfig, enable_entmtp
from entmtp_hf.heads import HydraHeads
from entmtp_hf.integration import EntMTPGenerationMixin

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
SETTINGS = ["float64, no kernels", "float32, packed kernels"]


def _ids(n: int = 6, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, **kwargs) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=16, do_sample=False, **kwargs)


def _entmtp(model, ids) -> torch.Tensor:
    return _greedy(model, ids, entmtp_config=EntMTPConfig(tree=TREE))


def _enabled(setting: str, monkeypatch: pytest.MonkeyPatch):
    """A tiny model with random heads, after one EntMTP call (which leaves transformers' hidden-state
    capturing hooks on it)."""
    model = tiny_model(seed=5)
    kernels = setting.endswith("packed kernels")
    if kernels:
        if not K.onednn_available():
            pytest.skip("this torch build has no oneDNN linear")

        def fastest(run, choices, repeats):  # every kernel routed, whatever this CPU measures
            return {c: float(c != "onednn") for c in choices}

        monkeypatch.setattr(K, "_timed_median", fastest)
        model = model.float()
    torch.manual_seed(5)
    heads = HydraHeads.for_model(model, num_heads=3, arch="mlp", use_base_lm_head=True)
    if kernels:
        enable_entmtp(model, heads, rows=(1, 2, 4, 8), repeats=1, pack=True)
        assert K.kernels_of(model).kinds() == ["by row count", "packed"]
    else:
        enable_entmtp(model, heads, cpu_kernels=False)
    ids = _ids()
    assert torch.equal(_entmtp(model, ids), _greedy(model, ids))
    return model


def _same_model(copied, model) -> None:
    """``copied`` is an EntMTP model of the same class with the same weights, its own heads and
    kernels, and decodes losslessly."""
    assert type(copied) is type(model) and isinstance(copied, EntMTPGenerationMixin)
    assert copied.entmtp_heads is not model.entmtp_heads
    assert all(torch.equal(a, b) for a, b in zip(copied.state_dict().values(), model.state_dict().values()))
    ids = _ids(7, 3)
    ref = _greedy(model, ids)
    assert torch.equal(_greedy(copied, ids), ref) and torch.equal(_entmtp(copied, ids), ref)
    kernels = K.kernels_of(copied)
    assert (kernels is None) == (K.kernels_of(model) is None)
    if kernels is not None:
        assert kernels is not K.kernels_of(model) and kernels.model is copied
        own = set(map(id, copied.modules()))
        assert all(id(d.module) in own and vars(d.module)["forward"] is d for d in kernels._routes.dispatches)


@pytest.mark.parametrize("setting", SETTINGS)
def test_deepcopy_gives_an_independent_lossless_model(setting, monkeypatch):
    model = _enabled(setting, monkeypatch)
    twin = copy.deepcopy(model)
    _same_model(twin, model)
    ids = _ids(7, 4)
    ref = _greedy(model, ids)
    with torch.no_grad():  # a merge into the copy only: the original's packed copies are its own
        for m in twin.get_decoder().modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.data += 0.3 * torch.randn_like(m.weight)
    assert torch.equal(_entmtp(twin, ids), _greedy(twin, ids)) and not torch.equal(_greedy(twin, ids), ref)
    assert torch.equal(_entmtp(model, ids), ref)


@pytest.mark.parametrize("protocol", [1, 2, 5])
@pytest.mark.parametrize("setting", SETTINGS)
def test_torch_save_of_the_whole_model_loads_back_lossless(setting, protocol, monkeypatch):
    """The EntMTP class is pickled as the model's own class and made again on load; transformers'
    capturing hooks (closures) are left out and installed again at the next call that needs them."""
    model = _enabled(setting, monkeypatch)
    buffer = io.BytesIO()
    torch.save(model, buffer, pickle_protocol=protocol)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    _same_model(loaded, model)
    ids = _ids(5, 6)  # the original decodes as before, its hooks installed again
    assert torch.equal(_entmtp(model, ids), _greedy(model, ids))
    assert torch.equal(_entmtp(model, ids), _entmtp(loaded, ids))


@pytest.mark.parametrize("setting", SETTINGS)
def test_save_pretrained_writes_the_weights_as_they_are(setting, monkeypatch, tmp_path):
    model = _enabled(setting, monkeypatch)
    with torch.no_grad():  # an in-place merge after enabling is what gets saved
        model.get_decoder().layers[0].mlp.down_proj.weight.data *= 1.5
    model.save_pretrained(tmp_path)
    plain = LlamaForCausalLM.from_pretrained(tmp_path, dtype=model.dtype)
    assert not isinstance(plain, EntMTPGenerationMixin)
    ids = _ids(6, 8)
    assert torch.equal(_greedy(plain, ids), _entmtp(model, ids))
