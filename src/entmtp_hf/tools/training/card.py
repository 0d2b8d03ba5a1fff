"""What a training run records in its heads' card: data, recipe, command, validation, τ, hardware.

The card (:class:`~entmtp_hf.heads.card.HeadsCard`) is saved with the heads and their README
is generated from it (:mod:`entmtp_hf.heads.card`), so a card written here survives every
later load and save of the heads.
"""

from __future__ import annotations

from typing import Any

from ...heads import DraftHeads
from ...heads.card import DataSource, HeadsCard, TokensPerStep
from ..machine import hardware_string
from .config import SOURCES

DESCRIBED = {
    "distill": "the base model's own greedy answers (`entmtp_hf.tools.data.distill`) to GSM8K-train, Python "
    "standard-library docstring and chat prompts",
    "gsm8k": "GSM8K *train* questions with their reference answers as chats",
    "stdlib": "Python standard-library source",
}
TAU_PROMPTS = "greedy; held-out distilled prompts, then held-out GSM8K-train questions"


def _start(s: dict[str, Any], heads: DraftHeads) -> str:
    c, n = s["config"], heads.num_heads
    if not c.get("init_from"):
        if heads.family == "eagle":
            return "Training started from the warm start (the drafter passing the feature through to the base LM head)."
        return "Training started from the warm start (every head = base LM head on c_t)."
    vocab = (
        "its drafting vocabulary chosen anew from this run's data"
        if c.get("init_vocab") == "data"
        else "same drafting vocabulary"
    )
    given = s.get("init_num_heads", n)
    extended = (
        f" Those were {given} heads; heads {given}..{n - 1} started as copies of the last (its hidden-state "
        "weights kept, its embedding weights on the most recent tokens)."
        if given < n
        else ""
    )
    return f"Training started from the heads in `{c['init_from']}` ({vocab}) instead of the warm start.{extended}"


def recipe(s: dict[str, Any], heads: DraftHeads) -> str:
    """How the heads were trained, in Markdown, from a run summary."""
    c, hc = s["config"], heads.config
    teacher = (
        " The teacher cache (hidden states and greedy tokens) was filled under bfloat16 autocast "
        "(`--teacher-dtype bfloat16`; weights float32)."
        if s["extract"].get("dtype") == "bfloat16"
        else ""
    )
    unit = (
        "the drafter, unrolled on its own features, at depth i+1 after row t"
        if heads.family == "eagle"
        else "head i at row t"
    )
    return (
        f"Distillation from the frozen base model with `entmtp-hf train-heads`: {unit} learns the base "
        "model's next-token distribution at position t+i+1, restricted to the drafting vocabulary and renormalised, "
        f"with KL(teacher || head) (CE weight {c['ce_weight']}, head weights {c['head_decay']}^i).{teacher} "
        f"{_start(s, heads)} AdamW lr {c['lr']}, {c['schedule']} schedule with {c['warmup_steps']} warm-up steps, "
        f"clip {c['grad_clip']}, batches of ≤ {c['batch_tokens']} tokens, {s['steps']} of {s['total_steps']} steps "
        f"({s['train_tokens_seen']} tokens seen, ≈ {s['epochs_done']} epochs, {s['train_seconds']} s, "
        f"{s['train_tokens_per_s']} tokens/s). Documents were split train/validation by a hash of their id; no "
        "evaluation text was used (no HumanEval, GSM8K test or MT-Bench; stdlib chunks and distillation prompts "
        "sharing a word 13-gram with any of them were dropped). Drafting vocabulary: the "
        f"{hc.draft_vocab_size} most frequent greedy tokens of the training split, covering "
        f"{s['draft_vocab_val_coverage']:.4f} of the held-out greedy tokens."
    )


def heads_card(s: dict[str, Any], heads: DraftHeads) -> HeadsCard:
    """The card of heads trained by the run summarised in ``s`` (see ``finalize``)."""
    data = tuple(
        DataSource(name, d.get("train", {}).get("tokens"), d.get("val", {}).get("tokens"), DESCRIBED.get(name, ""))
        for name, d in (s["data"] or {}).items()
        if name in SOURCES
    )
    tau = s.get("tau_mc_sim_7b_63")
    taus = (
        (TokensPerStep("mc_sim_7b_63", tau["mean_accept_length"], tau["prompts"], tau["max_new_tokens"], TAU_PROMPTS),)
        if tau and tau["steps"]
        else ()
    )
    return HeadsCard(
        training_data=data,
        recipe=recipe(s, heads),
        command=s.get("command") or "",
        validation_top1=tuple(round(x, 4) for x in s["validation"]["top1"]),
        tokens_per_step=taus,
        hardware=hardware_string(),
    )


def _mtp_start(c: dict[str, Any]) -> str:
    if not c.get("init_from"):
        return "Each layer started as the base LM head on its input state (its block's output projections at zero)."
    vocab = (
        "its drafting vocabulary chosen anew from this run's data"
        if c.get("init_vocab") == "data"
        else "same drafting vocabulary"
    )
    return f"Training continued the layers in `{c['init_from']}` ({vocab})."


def mtp_recipe(s: dict[str, Any]) -> str:
    """How MTP layers were trained, in Markdown, from a run summary."""
    c = s["config"]
    return (
        "Distillation from the frozen base model with `entmtp-hf build-drafter --arch mtp` (the `train-heads` "
        "loop): at a step start t (the base state h_t, the next token x_{t+1}), drafted depth d predicts "
        "x_{t+d+1}: MTP layer d (the last layer again beyond their count) reads x_{t+d} and the previous depth's "
        "output (h_t for depth 1), teacher-forced on the base model's text as transformers' MTP decoding and "
        "EntMTP's trees read it, and learns the base model's next-token distribution at position t+d over the "
        f"whole vocabulary, with KL(teacher || layer) (CE weight {c['ce_weight']}, depth weights "
        f"{c['head_decay']}^(d-1)). Embeddings and LM head are the base model's, frozen. {_mtp_start(c)} AdamW lr "
        f"{c['lr']}, {c['schedule']} schedule with {c['warmup_steps']} warm-up steps, clip {c['grad_clip']}, "
        f"batches of ≤ {c['batch_tokens']} tokens, {s['steps']} of {s['total_steps']} steps "
        f"({s['train_tokens_seen']} tokens seen, ≈ {s['epochs_done']} epochs, {s['train_seconds']} s). Documents "
        "were split train/validation by a hash of their id; no evaluation text was used (no HumanEval, GSM8K test "
        "or MT-Bench)."
    )


def mtp_readme(s: dict[str, Any], heads: DraftHeads) -> str:
    """The README.md of a folder of MTP layers in transformers' native layout (:mod:`.mtp_layout`)."""
    from huggingface_hub import ModelCardData

    from ...hub import hub_repo_id

    hc, base = heads.config, heads.config.base_model_name_or_path
    n, data = hc.num_layers, heads_card(s, heads).training_data
    front = ModelCardData(
        library_name="transformers",
        base_model=hub_repo_id(base),
        tags=["entmtp-hf", "speculative-decoding", "multi-token-prediction"],
    ).to_yaml()
    vocab = s["draft_vocab_size"]
    lines = [
        "---",
        front,
        "---",
        "",
        f"# {base} with {n} MTP layer{'s' if n > 1 else ''}",
        "",
        f"{n} multi-token-prediction (MTP) layer{'s' if n > 1 else ''} trained for `{base}`, saved in "
        "transformers' native layout: the base model's weights unchanged, the MTP layers in "
        f"`model-mtp.safetensors` ({s['weights_bytes']} bytes). transformers' own `generate(..., use_mtp=True)` "
        "drafts with them (a chain, one token per layer, batch size 1), and EntMTP drafts trees, per-task banks "
        "and batches with the very same layers.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM",
        "from entmtp_hf import enable_entmtp",
        "",
        'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER", trust_remote_code=True)',
        "out = model.generate(**inputs, use_mtp=True)  # transformers' MTP decoding",
        'enable_entmtp(model, "mtp")  # EntMTP: trees over the same layers',
        "```",
        "",
        "`trust_remote_code=True` loads `modeling_mtp.py`: the base model's own class, declaring only where the "
        "MTP tensors sit (`mtp.layers.K.*`), which is how transformers' `MtpModel` finds a model's MTP layers. "
        "Without it the model loads as the plain base model.",
        "",
        f"EntMTP's drafting settings (`entmtp_drafting.json`: trees up to {hc.num_heads} deep, the last layer "
        "drafting every depth beyond the layer count; "
        + (
            f"a drafting vocabulary of the {vocab} most frequent tokens of the training data, covering "
            f"{s['draft_vocab_val_coverage']:.4f} of the held-out greedy tokens"
            if vocab
            else "the whole vocabulary"
        )
        + ") are what the banks beside the layers were searched with.",
        "",
        "## Training",
        "",
    ]
    if data:
        lines += ["| source | train tokens | validation tokens | what |", "|---|---|---|---|"]
        lines += [f"| {d.name} | {d.train_tokens} | {d.val_tokens} | {d.description} |" for d in data]
        lines += [""]
    lines += [mtp_recipe(s), ""]
    if s.get("command"):
        lines += ["Command:", "", "```", s["command"], "```", ""]
    val = s["validation"]
    lines += [
        "## Validation",
        "",
        "Per drafted depth on held-out text, teacher-forced: how often the layer's first choice (top 5) is the "
        f"base model's own greedy token; depths beyond {n} are drafted by the last layer again.",
        "",
        "| depth | MTP layer | drafts | top-1 | top-5 |",
        "|---|---|---|---|---|",
        *(
            f"| {k + 1} | {min(k, n - 1) + 1} | t+{k + 2} | {a:.3f} | {b:.3f} |"
            for k, (a, b) in enumerate(zip(val["top1"], val["top5"]))
        ),
        "",
    ]
    tau = s.get("tau_mc_sim_7b_63")
    if tau and tau["steps"]:
        lines += [
            f"Tokens per step of greedy EntMTP with the tree mc_sim_7b_63: {tau['mean_accept_length']:.3f} "
            f"({tau['prompts']} prompts, {tau['max_new_tokens']} new tokens; {TAU_PROMPTS}).",
            "",
        ]
    lines += [f"Trained on {hardware_string()}.", ""]
    return "\n".join(lines)
