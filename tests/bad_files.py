"""Valid bank files and heads folders to mutate, and the reproducers of the hardening issue.

Shared by ``test_hardening.py`` (each reproducer refused cleanly) and ``test_fuzz_files.py``
(mutations of the valid files, seeded with the reproducers). Everything is tiny (hidden
size 8, vocabulary 16) so thousands of loads stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from entmtp_hf.banks.bank import TopologyBank, published_defaults_bank
from entmtp_hf.heads import HeadsConfig, HydraHeads, MedusaHeads
from entmtp_hf.heads.hydra import prefix_layer_config
from entmtp_hf.trees.tree import Tree

H, V = 8, 16
I32 = torch.int32


# ----------------------------------------------------------------------------- banks
def small_banks() -> dict[str, TopologyBank]:
    """Valid banks to start mutations from: a searched-style one and the published defaults."""
    meta = {
        "base_model": "tiny",
        "heads": "hydra-mlp",
        "hardware": "cpu",
        "trees": [{"num_nodes": 1, "mean_accept_length": 1.0}, {"num_nodes": 4, "tokens_per_s": 20.0}],
        "scheduler": {"static": 1, "tau_on": 0.02, "tau_off": 0.01, "retrieval": {"mode": "append", "num_tokens": 3}},
        "calibration": {"prompts": 4},
    }
    return {"t": TopologyBank("t", [Tree.root_only(), [[0], [1], [0, 0]]], meta), "default": published_defaults_bank()}


def bank_parts(bank: TopologyBank) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the header JSON object a saved bank holds."""
    from entmtp_hf.banks.bank import encode_tree

    tensors = {f"tree.{k}": encode_tree(t) for k, t in enumerate(bank.trees)}
    meta = {"format_version": 1, "task": bank.task, "num_trees": len(bank.trees), **bank.metadata}
    return tensors, meta


def write_bank(path: Path, tensors: dict[str, torch.Tensor], meta: dict | str) -> Path:
    text = meta if isinstance(meta, str) else json.dumps(meta)
    save_file(tensors, str(path), metadata={"entmtp_bank": text})
    return path


def bank_reproducers(folder: Path) -> dict[str, tuple[Path, str]]:
    """B1-B4 of the issue: file and the message its refusal must match."""
    folder.mkdir(parents=True, exist_ok=True)
    empty = {"tree.0": torch.zeros(0, 0, dtype=I32)}
    deep = '{"format_version": 1, "task": "b1", "num_trees": 1, "calibration": {"x": ' + "[" * 5000 + "]" * 5000 + "}}"
    return {
        "B1": (write_bank(folder / "b1.safetensors", empty, deep), "nests deeper than the limit of 32 levels"),
        "B2": (
            write_bank(folder / "b2.safetensors", empty, {"format_version": 1, "task": "b2", "num_trees": 10**9}),
            r"num_trees must be an integer in \[1, 1024\], got 1000000000",
        ),
        "B3": (
            write_bank(
                folder / "b3.safetensors",
                {"tree.0": torch.arange(3_999_900, dtype=I32)[:, None]},
                {"format_version": 1, "task": "b3", "num_trees": 1},
            ),
            "tree 0 has 3999901 nodes, above the limit of 4096",
        ),
        "B4": (
            write_bank(
                folder / "b4.safetensors",
                empty,
                {"format_version": 1, "task": "b4", "num_trees": 1, "scheduler": {"retrieval": {"num_tokens": 10**12}}},
            ),
            r"RetrievalConfig\.num_tokens: must be an integer in \[1, 32\], got 1000000000000",
        ),
    }


# ----------------------------------------------------------------------------- heads
def tiny_base_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=H,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
        max_position_embeddings=64,
    )


def own_heads(family: str, arch: str = "mlp", draft_vocab: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    prefix = prefix_layer_config(tiny_base_config()) if arch == "prefix-mlp" else None
    config = HeadsConfig(
        family=family,
        head_arch=arch,
        num_heads=2,
        num_layers=2,
        hidden_size=H,
        vocab_size=V,
        draft_vocab_size=6 if draft_vocab else 0,
        prefix_layer_config=prefix,
    )
    heads = (HydraHeads if family == "hydra" else MedusaHeads)(config)
    if draft_vocab:
        heads.draft_vocab.copy_(torch.tensor([3, 1, 4, 15, 9, 2]))
    return heads


def hydra_published_state(arch: str) -> dict[str, torch.Tensor]:
    """A published Hydra state dict built from our own heads' parameters under published names."""
    from entmtp_hf.heads.published import hydra_published_name

    heads = own_heads("hydra", arch)
    sd = {hydra_published_name(k, arch): v.clone() for k, v in heads.state_dict().items()}
    sd["input_embed_fn.weight"] = torch.zeros(V, H)  # a copy of the embeddings the loader ignores
    return sd


def medusa_published_state(n: int = 2, layers: int = 2) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(n):
        for j in range(layers):
            sd[f"{i}.{j}.linear.weight"], sd[f"{i}.{j}.linear.bias"] = torch.randn(H, H, generator=gen), torch.zeros(H)
        sd[f"{i}.{layers}.weight"] = torch.randn(V, H, generator=gen)
    return sd


def hydra_config(arch: str, **changes: Any) -> dict[str, Any]:
    return {
        "hydra_num_heads": 2,
        "hydra_num_layers": 2,
        "hydra_head_arch": arch,
        "grounded_heads": True,
        "hidden_state_offset": 0,
        "base_model_name_or_path": None,
        **changes,
    }


def write_folder(folder: Path, files: dict[str, Any]) -> Path:
    """Write ``name -> content``: dicts of tensors as safetensors or ``torch.save`` by suffix,
    other dicts as JSON, str/bytes as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        elif name.endswith(".safetensors"):
            save_file({k: v.contiguous() for k, v in content.items()}, str(path))
        elif name.endswith((".pt", ".bin")):
            torch.save(content, path)
        else:
            path.write_text(json.dumps(content))
    return folder


def heads_reproducers(folder: Path) -> dict[str, tuple[Path, str, str]]:
    """H1-H6 of the issue: folder, the file its refusal must name and the message it must match."""
    own = folder / "own"
    own_heads("hydra", "prefix-mlp").save_pretrained(own)
    good = json.loads((own / "config.json").read_text())
    out: dict[str, tuple[Path, str, str]] = {}

    def own_variant(name: str, text: str, message: str) -> None:
        files = {"config.json": text, "model.safetensors": (own / "model.safetensors").read_bytes()}
        out[name] = (write_folder(folder / name, files), "config.json", message)

    def prefix(**changes: Any) -> str:
        return json.dumps({**good, "prefix_layer_config": {**good["prefix_layer_config"], **changes}})

    own_variant("H1 hidden_act", prefix(hidden_act="1"), r"prefix_layer_config\.hidden_act: must be one of")
    own_variant("H1 rope_theta", prefix(rope_theta={}), r"prefix_layer_config\.rope_theta: must be a finite number > 0")
    own_variant(
        "H1 head_dim", prefix(head_dim=0), r"prefix_layer_config\.head_dim: must be an integer in \[1, 4096\], got 0"
    )
    own_variant(
        "H2 hidden_size",
        json.dumps({**good, "hidden_size": 100000}),
        r"HeadsConfig\.hidden_size: must be an integer in \[1, 65536\], got 100000",
    )
    for key, value in (("num_heads", 10**5), ("num_layers", 10**6)):
        own_variant(
            f"H2 {key}", json.dumps({**good, key: value}), rf"HeadsConfig\.{key}: must be an integer in \[1, 64\]"
        )
    own_variant("H3 deep", '{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nests deeper than the limit of 32 levels")
    text = json.dumps({**good, "num_heads": 1234567}).replace("1234567", "9" * 5000)
    own_variant("H3 digits", text, "a number of 5000 digits, above the limit of 100")
    zeros = {"hydra_mlp.0.0.linear.weight": torch.zeros(100000, 0), "hydra_lm_head.0.weight": torch.zeros(100000, 0)}
    out["H2 zero-size pickle"] = (
        write_folder(
            folder / "h2pt", {"config.json": hydra_config("mlp", hydra_num_heads=1), "hydra_lm_head.pt": zeros}
        ),
        "hydra_lm_head.pt",
        r"\(100000, 0\), with a zero-size dimension",
    )
    zero_medusa = {**medusa_published_state(1, 1), "0.1.weight": torch.zeros(0, H)}
    out["H4 zero-width medusa"] = (
        write_folder(folder / "h4", {"config.json": {"medusa_num_heads": 1}, "medusa_lm_head.pt": zero_medusa}),
        "medusa_lm_head.pt",
        "zero-size dimension",
    )
    shard = {f"medusa_head.{k}": v for k, v in medusa_published_state(1, 1).items()}
    write_folder(folder / "outside_dir", {"x.safetensors": shard})
    for name, target in (
        ("H6 relative", "../outside_dir/x.safetensors"),
        ("H6 absolute", str((folder / "outside_dir" / "x.safetensors").resolve())),
        ("H6 through a subfolder", "sub/../../outside_dir/x.safetensors"),
    ):
        index = {"weight_map": {k: target for k in shard}}
        files = {"config.json": {"medusa_num_heads": 1}, "model.safetensors.index.json": index}
        out[name] = (
            write_folder(folder / name.replace(" ", "_"), files),
            "model.safetensors.index.json",
            "leaves the folder|is absolute",
        )
    return out
