"""The README (Hub model card) written next to the shipped heads: a long text template
filled from a run summary, kept out of the training loop.
"""

from __future__ import annotations

from typing import Any

from ...heads import DraftHeads
from .config import SOURCES


def model_card(s: dict[str, Any], heads: DraftHeads) -> str:
    """The shipped heads' README: what they are, how they were trained, how well they draft."""
    c, hc, v = s["config"], heads.config, s["validation"]
    rows = "\n".join(f"| {i} | t+{i + 2} | {v['top1'][i]:.3f} | {v['top5'][i]:.3f} | {v['kl'][i]:.3f} | {v['rows'][i]} |"
                     for i in range(hc.num_heads))
    data = "\n".join(f"| {name} | {d.get('train', {}).get('tokens', 0)} | {d.get('val', {}).get('tokens', 0)} |"
                     for name, d in (s["data"] or {}).items())
    tau = s.get("tau_mc_sim_7b_63")
    sources = (s["data"] or {}).keys()
    described = {
        "distill": "`distill`: the base model's own greedy answers (`entmtp_hf.tools.data.distill`) to "
                   "GSM8K-train, Python standard-library docstring and chat prompts",
        "gsm8k": "`gsm8k`: GSM8K *train* questions with their reference answers as chats",
        "stdlib": "`stdlib`: Python standard-library source",
    }
    about = "; ".join(described[k] for k in SOURCES if k in sources)
    vocab = ("its drafting vocabulary chosen anew from this run's data" if c.get("init_vocab") == "data"
             else "same drafting vocabulary")
    extended = (f" Those were {s['init_num_heads']} heads; heads {s['init_num_heads']}..{hc.num_heads - 1} started "
                "as copies of the last (its hidden-state weights kept, its embedding weights on the most recent "
                "tokens)." if s.get("init_num_heads", hc.num_heads) < hc.num_heads else "")
    start = (f"Training started from the heads in `{c['init_from']}` ({vocab}) instead of the "
             f"warm start.{extended}" if c.get("init_from") else "Training started from the warm start (every head = base LM "
             "head on c_t).")
    teacher = ("The teacher cache (hidden states and greedy tokens) was filled under bfloat16 autocast "
               "(`--teacher-dtype bfloat16`; weights float32).\n\n" if s["extract"].get("dtype") == "bfloat16" else "")
    tau_line = (f"Greedy EntMTP decoding with the `mc_sim_7b_63` tree on {tau['prompts']} held-out prompts "
                f"(held-out distilled prompts, then held-out GSM8K-train questions; {tau['max_new_tokens']} new tokens "
                f"each): **mean accepted tokens per step τ = "
                f"{tau['mean_accept_length']:.3f}** ({tau['steps']} steps)." if tau else "τ not measured.")
    return f"""---
library_name: entmtp-hf
tags:
- speculative-decoding
- {hc.family}
base_model: {hc.base_model_name_or_path}
---

# {hc.family.capitalize()} draft heads for {hc.base_model_name_or_path}

{hc.num_heads} {hc.family} heads (`{hc.head_arch}`, {hc.num_layers} block(s) each, hidden size {hc.hidden_size})
drafting over a {hc.draft_vocab_size}-token vocabulary with the base model's own LM head rows
(`use_base_lm_head=True`), stored in {c['save_dtype']} ({s['weights_bytes'] / 1e6:.1f} MB).
Head i drafts token t+i+2 from the base model's last hidden state at t (Hydra: and the
embeddings of the tokens in between). The base model verifies every draft, so outputs are
unchanged.

```python
from entmtp_hf.generation import enable_entmtp
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.tree import MC_SIM_7B_63
enable_entmtp(model, "<this folder>")   # heads are cast to the model's dtype
out = model.generate(ids, max_new_tokens=128, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))
```

## Training

Distillation from the frozen base model: head i at row t learns the base model's
next-token distribution at position t+i+1, restricted to the drafting vocabulary and
renormalised, with KL(teacher || head) (CE weight {c['ce_weight']}, head weights
{c['head_decay']}^i). Trained with `entmtp-hf train-heads`:

```
{s.get('command') or '(API call)'}
```

{teacher}{start}
AdamW lr {c['lr']}, {c['schedule']} schedule with {c['warmup_steps']} warm-up steps, clip {c['grad_clip']},
batches of ≤ {c['batch_tokens']} tokens, {s['steps']} of {s['total_steps']} steps
({s['train_tokens_seen']} tokens seen, ≈ {s['epochs_done']} epochs, {s['train_seconds']} s,
{s['train_tokens_per_s']} tokens/s on the training machine).

Data (tokens; documents split train/val by a hash of their id):

| source | train | val |
|---|---|---|
{data}

{about}. No evaluation text was used: no HumanEval, no GSM8K test, no MT-Bench (stdlib
chunks and distillation prompts sharing a word 13-gram with any of them were dropped).

## Validation (held-out split, teacher-forced)

Drafting vocabulary: the {hc.draft_vocab_size} most frequent greedy tokens of the training
split; it covers {s['draft_vocab_val_coverage']:.4f} of the held-out greedy tokens.
Accuracy = the head's top-k (over the drafting vocabulary) contains the base model's
greedy token.

| head | drafts | top-1 | top-5 | KL (nats) | rows |
|---|---|---|---|---|---|
{rows}

{tau_line}
"""

