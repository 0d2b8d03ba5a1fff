"""``entmtp-hf export-generate``: a ``custom_generate`` folder transformers loads and runs, offline,
giving token for token what ``enable_entmtp`` + ``generate(entmtp_config=...)`` gives."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers.dynamic_module_utils as dynamic_modules
from huggingface_hub import constants as hf_constants
from test_generation import CHAIN, prompts
from tiny import tiny_model

from entmtp_hf import MC_SIM_7B_63, EntMTPConfig, PhaseTimer, __version__, enable_entmtp
from entmtp_hf.banks.bank import shipped_bank_path
from entmtp_hf.errors import EntMTPError
from entmtp_hf.tools.cli import main
from entmtp_hf.tools.export_generate import export_generate

DEFAULTS = str(shipped_bank_path("published-defaults"))
README_SECTIONS = (
    "## Description",
    "## Base model",
    "## Model compatibility",
    "## Additional arguments",
    "## Output type changes",
    "## Example usage",
)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network, and transformers' copies of remote code in a temporary modules cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # transformers appends the modules cache to it


@pytest.fixture
def heads_dir(tiny_cache, tmp_path):
    _, heads = tiny_cache("llama", "hydra", "mlp")
    heads.config.base_model_name_or_path = "org/tiny-llama"
    heads.save_pretrained(tmp_path / "heads")
    return str(tmp_path / "heads")


def reference(
    heads_dir: str, ids: torch.Tensor, config: EntMTPConfig, seed: int | None = None, **kwargs
) -> torch.Tensor:
    model = enable_entmtp(tiny_model(), heads_dir)
    if seed is not None:  # after building the model, which seeds torch itself
        torch.manual_seed(seed)
    return model.generate(ids, max_new_tokens=24, entmtp_config=config, **kwargs)


def run(model, repo, ids, **kwargs):
    return model.generate(ids, max_new_tokens=24, custom_generate=str(repo), trust_remote_code=True, **kwargs)


@pytest.mark.parametrize("with_bank", [False, True], ids=["default-tree", "bank"])
def test_the_exported_method_decodes_like_enable_entmtp(tmp_path, offline, heads_dir, with_bank):
    bank = dict(bank=DEFAULTS, task="default") if with_bank else {}
    export_generate(tmp_path / "repo", heads=heads_dir, **bank)
    config = EntMTPConfig(**bank) if with_bank else EntMTPConfig(tree=MC_SIM_7B_63)
    model = tiny_model()  # a plain model: the method attaches the heads
    for ids in prompts(2, seed=4):
        out = run(model, tmp_path / "repo", ids, do_sample=False)
        assert torch.equal(out, reference(heads_dir, ids, config, do_sample=False))
        assert torch.equal(out, tiny_model().generate(ids, max_new_tokens=24, do_sample=False))  # lossless
    torch.manual_seed(3)
    sampled = run(model, tmp_path / "repo", ids, do_sample=True)
    assert torch.equal(sampled, reference(heads_dir, ids, config, seed=3, do_sample=True))


def test_the_method_keeps_its_heads_and_takes_the_entmtp_arguments(tmp_path, offline, heads_dir):
    export_generate(tmp_path / "repo", heads=heads_dir)
    model, ids = tiny_model(), prompts(1, seed=6)[0]
    run(model, tmp_path / "repo", ids)
    heads = model.entmtp_heads
    assert heads.name_or_path == heads_dir
    timer = PhaseTimer()
    out = run(
        model,
        tmp_path / "repo",
        ids,
        entmtp_config=EntMTPConfig(tree=CHAIN),
        entmtp_observers=[timer],
        return_dict_in_generate=True,
    )
    assert model.entmtp_heads is heads  # the same heads, not loaded again
    assert torch.equal(out.sequences, reference(heads_dir, ids, EntMTPConfig(tree=CHAIN)))
    assert max(out.entmtp_stats["tree_sizes"]) == len(CHAIN) + 1 and timer.seconds["verify"] > 0
    bank = run(model, tmp_path / "repo", ids, entmtp_bank=DEFAULTS, entmtp_task="default")
    assert torch.equal(bank, reference(heads_dir, ids, EntMTPConfig(bank=DEFAULTS, task="default")))
    with pytest.raises(EntMTPError, match="no draft heads"):
        run(tiny_model(), tmp_path / "repo", ids, entmtp_heads=None)
    with pytest.raises(EntMTPError, match="pass entmtp_bank= too"):
        run(model, tmp_path / "repo", ids, entmtp_task="default")


def test_the_folder_is_a_custom_generate_repo(tmp_path, heads_dir):
    code = export_generate(tmp_path / "repo", heads=heads_dir, bank=DEFAULTS, task="default")
    assert code == tmp_path / "repo" / "custom_generate" / "generate.py"
    assert (code.parent / "requirements.txt").read_text() == f"entmtp-hf>={__version__}\n"
    namespace: dict = {}
    exec(compile(code.read_text(), str(code), "exec"), namespace)  # the defaults are Python literals
    assert (namespace["HEADS"], namespace["BANK"], namespace["TASK"]) == (heads_dir, DEFAULTS, "default")
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert readme.startswith("---\nlibrary_name: transformers\ntags:\n- custom_generate\n")
    assert "base_model: org/tiny-llama\n" in readme and "work on this machine only" in readme
    positions = [readme.index(section) for section in README_SECTIONS]
    assert positions == sorted(positions)
    bare = export_generate(tmp_path / "bare").read_text()
    assert "HEADS = None" in bare and "BANK = None" in bare


def test_the_command_writes_the_folder_and_refuses_a_task_without_a_bank(tmp_path, heads_dir, capsys):
    assert (
        main(["export-generate", str(tmp_path / "cli"), "--heads", heads_dir, "--bank", DEFAULTS, "--task", "default"])
        == 0
    )
    assert "custom_generate=" in capsys.readouterr().out and (tmp_path / "cli" / "custom_generate").is_dir()
    assert main(["export-generate", str(tmp_path / "x"), "--task", "default"]) == 2
    assert "--bank and --task go together" in capsys.readouterr().err
    assert main(["export-generate", str(tmp_path / "x"), "--bank", DEFAULTS, "--task", "nope"]) == 2
    assert "no task 'nope'" in capsys.readouterr().err
