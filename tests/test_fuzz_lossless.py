"""Random lossless cases: greedy EntMTP output equals plain ``generate`` token for token.

Each case draws a prompt, a tree (or several, for the switching policies), a policy, logits
processors, an EOS token, left padding, a static or dynamic cache and retrieval branches, on
tiny float64 models (Llama and Qwen2, Hydra and Medusa heads) where no floating-point tie can
flip an argmax. ``ENTMTP_FUZZ_EXAMPLES`` raises the number of cases (default 300).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_generation import random_choices
from tiny import VOCAB

from entmtp_hf import EASConfig, EntMTPConfig, enable_entmtp

EXAMPLES = int(os.environ.get("ENTMTP_FUZZ_EXAMPLES", "300"))
MODELS = [
    ("llama", "hydra", "mlp"),
    ("qwen2", "hydra", "mlp"),
    ("llama", "medusa", "mlp"),
    ("llama", "hydra", "prefix-mlp"),
]


@st.composite
def trees(draw, count: int):
    sizes = sorted(draw(st.lists(st.integers(1, 24), min_size=count, max_size=count)))
    return [random_choices(draw(st.integers(0, 10_000)), size=n, depth=4, rank=4) for n in sizes]


@st.composite
def configs(draw):
    policy = draw(st.sampled_from(["static", "hysteresis", "ladder", "value", "entropy"]))
    retrieval = draw(st.booleans())
    feature = draw(st.sampled_from(["base_top1", "head_confidence", "accept_ema", "best_path_value"]))
    if policy in ("static", "entropy"):
        tree = draw(trees(1))[0]
        eas = (
            EASConfig(warmup_tokens=draw(st.integers(0, 8)), window=4, fork_min_history=2)
            if policy == "entropy"
            else None
        )
        return EntMTPConfig(tree=tree, eas=eas, retrieval=retrieval)
    if policy == "hysteresis":
        tau = draw(st.floats(0.02, 0.3)) if feature != "accept_ema" else draw(st.floats(1.0, 2.0))  # depth >= 1
        return EntMTPConfig(trees=draw(trees(2)), tau_on=tau, feature=feature, retrieval=retrieval)
    if policy == "ladder":
        low = draw(st.floats(0.02, 0.15))
        return EntMTPConfig(
            trees=draw(trees(3)),
            policy="ladder",
            thresholds=[low, low + 0.05],
            feature="base_top1",
            retrieval=retrieval,
        )
    costs = draw(st.lists(st.floats(0.5, 3.0), min_size=3, max_size=3))
    return EntMTPConfig(trees=draw(trees(3)), policy="value", costs=costs, retrieval=retrieval)


@st.composite
def generate_kwargs(draw):
    kwargs: dict = {"max_new_tokens": draw(st.integers(1, 16)), "do_sample": False}
    processor = draw(st.sampled_from(["none", "repetition", "ngram", "bad_words", "suppress", "min_new"]))
    if processor == "repetition":
        kwargs["repetition_penalty"] = draw(st.floats(1.05, 1.6))
    elif processor == "ngram":
        kwargs["no_repeat_ngram_size"] = draw(st.integers(2, 3))
    elif processor == "bad_words":
        kwargs["bad_words_ids"] = [
            [draw(st.integers(0, VOCAB - 1))],
            draw(st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=2)),
        ]
    elif processor == "suppress":
        kwargs["suppress_tokens"] = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))
    elif processor == "min_new":
        kwargs["min_new_tokens"] = draw(st.integers(1, 8))
    eos = draw(st.one_of(st.none(), st.integers(0, VOCAB - 1)))
    if eos is not None or processor == "min_new":
        kwargs["eos_token_id"] = eos if eos is not None else draw(st.integers(0, VOCAB - 1))
        kwargs["pad_token_id"] = kwargs["eos_token_id"]
    if draw(st.booleans()):
        kwargs["cache_implementation"] = "static"
    return kwargs


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    which=st.sampled_from(MODELS),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
    padding=st.integers(0, 3),
    config=configs(),
    kwargs=generate_kwargs(),
)
def test_random_cases_are_lossless(tiny_cache, which, prompt, padding, config, kwargs):
    model, heads = tiny_cache(*which)
    enable_entmtp(model, heads)
    ids = torch.tensor([[0] * padding + prompt])
    mask = torch.tensor([[0] * padding + [1] * len(prompt)])
    if padding == 0 and len(prompt) % 2:
        mask = None  # some cases pass no mask at all
    try:
        config.resolve(heads.num_heads, heads.config.draft_vocab_rows)
    except ValueError:
        assume(False)  # a tree deeper or wider than these heads is refused up front: not a lossless case
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kwargs)
        out = model.generate(ids, attention_mask=mask, entmtp_config=config, **kwargs)
    assert torch.equal(out, ref), f"{which} {config} {kwargs}: {ref.tolist()} != {out.tolist()}"
    CASES.append(1)


CASES: list[int] = []


def test_the_fuzz_compared_at_least_the_required_number_of_cases():
    """Runs after the fuzz in this module: every drawn case that decoded was compared."""
    assert len(CASES) >= min(300, EXAMPLES), len(CASES)


def test_the_comparison_catches_a_broken_cache_update(tiny_cache, monkeypatch):
    """Negative control: keeping the first slots of a verified tree instead of the accepted path
    (a plausible bug) must make some of the same kind of cases differ from plain generate."""
    import entmtp_hf.decoding.session as session

    real = session.keep_accepted
    monkeypatch.setattr(
        session, "keep_accepted", lambda cache, prefix, paths: real(cache, prefix, [list(range(len(p))) for p in paths])
    )
    model, heads = tiny_cache("llama", "hydra", "mlp")
    enable_entmtp(model, heads)
    differ = 0
    for seed in range(20):
        ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))
        config = EntMTPConfig(tree=random_choices(seed, size=16))
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=16, do_sample=False)
            out = model.generate(ids, max_new_tokens=16, do_sample=False, entmtp_config=config)
        differ += not torch.equal(out, ref)
    assert differ > 0
