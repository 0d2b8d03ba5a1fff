"""Tiny random models and quickly fitted heads shared by the decoding tests.

Models run in float64 so a tree forward and a one-token forward agree far beyond any
argmax gap; the vocabulary is small and the heads are fitted for a few dozen steps to the
model's own greedy continuations, so long accepted paths are exercised.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from entmtp_hf.heads import HEADS_REGISTRY

VOCAB = 24
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 8}),
}
#: sliding-window and hybrid attention (window 8 unless named): every layer sliding, mixed layer
#: types, soft-capping, and a window shorter than the trees' depth
SLIDING_ARCHS = {
    "mistral-sliding": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    "qwen2-sliding": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "head_dim": 8,
            "sliding_window": 8,
            "num_hidden_layers": 3,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 8,
            "sliding_window": 8,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
    "phi3-sliding": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 8}),
    "mistral-window-3": (MistralConfig, MistralForCausalLM, {"sliding_window": 3}),
}
ARCHS_ALL = {**ARCHS, **SLIDING_ARCHS}


def tiny_model(arch: str = "llama", seed: int = 0, sharpen: float = 4.0):
    """A float64 tiny model; ``sharpen`` scales the LM head so greedy runs are not flat."""
    config_cls, model_cls, extra = ARCHS_ALL[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra})).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def fitted_heads(
    model,
    family: str = "hydra",
    arch: str = "mlp",
    num_heads: int = 4,
    steps: int = 60,
    seed: int = 0,
    use_base_lm_head: bool = False,
):
    """Heads fitted briefly to the model's greedy continuations of random prompts. ``arch``
    "eagle+fuse": an EAGLE-1 drafter fusing the embeddings' and the first layer's states too."""
    torch.manual_seed(seed)
    layers = [0, 1, -1] if arch == "eagle+fuse" else None
    arch = "eagle" if layers else arch
    heads = (
        HEADS_REGISTRY[family]
        .for_model(model, num_heads=num_heads, arch=arch, feature_layers=layers, use_base_lm_head=use_base_lm_head)
        .double()
    )
    if layers:  # a zero projection would hide a wrong fusion: start it random
        torch.nn.init.normal_(heads.fuse.weight, std=0.1)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (8, 4), generator=g)
    with torch.no_grad():
        seqs = model.generate(prompts, max_new_tokens=40, do_sample=False)
        out = model(seqs, output_hidden_states=heads.hidden_states_request)
        hidden, targets = heads.features(out.hidden_states), out.logits.argmax(-1)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    for _ in range(steps):
        logits = heads.forward_train(hidden, seqs, embed, lm_head)
        loss = sum(
            torch.nn.functional.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), targets[:, i + 1 : i + 1 + lg.shape[1]].reshape(-1)
            )
            for i, lg in enumerate(logits)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


def left_padded(lengths: tuple[int, ...], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a batch of random prompts of ``lengths``, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:], mask[i, -n:] = torch.randint(1, VOCAB, (n,), generator=g), 1
    return ids, mask
