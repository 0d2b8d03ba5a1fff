"""Perplexity of texts under a causal language model, as an ``evaluate`` metric.

Shipped with entmtp-hf so it loads offline: ``evaluate.load(<this folder>)``. It is
self-contained (torch + transformers only) because ``evaluate`` copies the script into its
module cache before importing it.

Differences from the Hub's ``perplexity`` metric, which this one can replace:

* ``model_id`` (a Hub id or local folder) *or* ``model=`` (an already-loaded model object)
  with ``tokenizer=`` (object, id or folder; defaults to the model's ``name_or_path``);
* works with tokenizers that have no pad token (sequences are padded by hand and masked);
* ``contexts=``: optional conditioning texts, one per prediction; only the prediction's
  tokens are scored (e.g. a response given its chat-templated prompt).

Perplexity of one text is ``exp(mean negative log-likelihood)`` over its scored tokens, in
nats; a model whose next-token distribution is uniform over V tokens scores exactly V.
"""

from __future__ import annotations

import datasets
import evaluate
import torch
import torch.nn.functional as F

_DESCRIPTION = """Perplexity (PPL) of each prediction under a causal LM: exp of the mean token
negative log-likelihood. With `contexts`, the prediction is scored given its context."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): texts to score.
    model_id (str, optional): Hub id or local folder of a causal LM (loaded with AutoModelForCausalLM).
    model (PreTrainedModel, optional): an already-loaded causal LM; takes precedence over model_id.
    tokenizer (tokenizer object or str, optional): defaults to model_id or model.name_or_path.
    contexts (list of str, optional): conditioning text for each prediction (not scored).
    batch_size (int): sequences per forward pass (default 8).
    add_start_token (bool): prepend the BOS token when the tokenizer has one and the sequence does
        not already start with it, so the first prediction token is scored too (default True).
    device (str, optional): device for a model loaded from model_id (default: cuda if available).
    max_length (int, optional): keep only the last max_length tokens of each sequence.
Returns:
    perplexities (list of float): one per prediction; mean_perplexity (float): their mean.
Example:
    >>> ppl = evaluate.load("path/to/entmtp_hf/metrics/perplexity")
    >>> ppl.compute(predictions=["Hello there"], model=model, tokenizer=tokenizer)
"""


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _sequences(tokenizer, predictions, contexts, add_start_token, max_length):
    """Token ids and the index of each sequence's first scored token."""
    bos = getattr(tokenizer, "bos_token_id", None) if add_start_token else None
    out = []
    for i, text in enumerate(predictions):
        prefix = _encode(tokenizer, contexts[i], special=False) if contexts is not None else []
        if bos is not None and (not prefix or prefix[0] != bos):
            prefix = [bos] + prefix
        target = _encode(tokenizer, text, special=False)
        ids, start = prefix + target, max(len(prefix), 1)  # token 0 has nothing to condition on
        if max_length is not None and len(ids) > max_length:
            cut = len(ids) - max_length
            ids, start = ids[cut:], max(start - cut, 1)
        if len(ids) - start < 1:
            raise ValueError(f"prediction {i} has no token to score ({len(target)} tokens, {len(prefix)} of context)")
        out.append((ids, start))
    return out


@torch.no_grad()
def _batch_nll(model, batch, device) -> list[tuple[float, int]]:
    """(sum of NLL, number of scored tokens) per sequence of a batch, padded by hand."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    scored = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, (ids, start) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        scored[row, start : len(ids)] = True
    input_ids, mask, scored = input_ids.to(device), mask.to(device), scored.to(device)
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # position t predicts token t+1
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none")
    nll = nll * scored[:, 1:]
    return [(float(n), int(c)) for n, c in zip(nll.sum(-1), scored[:, 1:].sum(-1))]


def _load(model, model_id, tokenizer, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        if model_id is None:
            raise ValueError("give model_id (a Hub id or folder) or model= (a loaded causal LM)")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_id).to(device)
    if tokenizer is None or isinstance(tokenizer, str):
        source = tokenizer or model_id or getattr(model, "name_or_path", None)
        if not source:
            raise ValueError("this model has no name_or_path: pass tokenizer= explicitly")
        tokenizer = AutoTokenizer.from_pretrained(source)
    return model, tokenizer


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(
        self,
        predictions,
        model_id=None,
        model=None,
        tokenizer=None,
        contexts=None,
        batch_size: int = 8,
        add_start_token: bool = True,
        device=None,
        max_length=None,
    ):
        if contexts is not None and len(contexts) != len(predictions):
            raise ValueError(f"{len(contexts)} contexts for {len(predictions)} predictions")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        model, tokenizer = _load(model, model_id, tokenizer, device)
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        seqs = _sequences(tokenizer, list(predictions), contexts, add_start_token, max_length)
        ppls = []
        try:
            for i in range(0, len(seqs), batch_size):
                for nll, count in _batch_nll(model, seqs[i : i + batch_size], device):
                    ppls.append(float(torch.exp(torch.tensor(nll / count, dtype=torch.float64))))
        finally:
            model.train(was_training)
        return {"perplexities": ppls, "mean_perplexity": sum(ppls) / len(ppls) if ppls else float("nan")}
