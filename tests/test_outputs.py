"""What ``generate`` returns besides the text: scores and logits per new token, several sampled
sequences per prompt, and the ``output_*`` options it cannot return refused up front."""

import pytest
import torch
from test_batch import batch_of, eos_ending_rows_apart
from test_generation import CHAIN, SAMPLING_TREE, chi_square_p, prompts, target_joint

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63

PAD = 0


def enabled(tiny_cache, arch="llama"):
    model, heads = tiny_cache(arch, "hydra", "mlp")
    return enable_entmtp(model, heads)


def both(model, ids, **kwargs):
    """Plain and EntMTP ``generate`` with the same arguments, dicts with scores and logits."""
    common = dict(max_new_tokens=25, return_dict_in_generate=True, output_scores=True, output_logits=True, **kwargs)
    return model.generate(ids, **common), model.generate(ids, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63), **common)


def assert_same_per_token(plain, mine, prompt_len: int):
    for name in ("scores", "logits"):
        a, b = getattr(plain, name), getattr(mine, name)
        assert a is not None and b is not None and len(a) == len(b) == mine.sequences.shape[1] - prompt_len
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype
            finite = torch.isfinite(x)
            assert torch.equal(finite, torch.isfinite(y))
            assert torch.allclose(x[finite], y[finite], atol=1e-9, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_scores_and_logits_equal_plain_generate(tiny_cache, arch):
    model = enabled(tiny_cache, arch)
    for ids in prompts():
        plain, mine = both(model, ids, do_sample=False, repetition_penalty=1.3)  # processed scores differ from logits
        assert torch.equal(plain.sequences, mine.sequences)
        assert max(mine.entmtp_stats["accept_lengths"]) >= 3
        assert_same_per_token(plain, mine, ids.shape[1])
        assert not torch.allclose(mine.scores[3], mine.logits[3])
        a = model.compute_transition_scores(plain.sequences, plain.scores, normalize_logits=True)
        b = model.compute_transition_scores(mine.sequences, mine.scores, normalize_logits=True)
        assert torch.allclose(a, b, atol=1e-9, rtol=0)


def test_scores_of_a_batch_whose_rows_stop_apart(tiny_cache):
    """Rows ending on EOS at different steps: each row's scores are plain generate's up to its end;
    past it, those of a forced pad token."""
    model = enabled(tiny_cache)
    singles, ids, mask = batch_of()
    eos = eos_ending_rows_apart(model, singles, 30)
    plain, mine = both(model, ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(plain.sequences, mine.sequences)
    width = ids.shape[1]
    for b in range(ids.shape[0]):
        new = mine.sequences[b, width:]
        ended = next((i + 1 for i, t in enumerate(new.tolist()) if t in eos), len(new))
        for t, (x, y, lx, ly) in enumerate(zip(plain.scores, mine.scores, plain.logits, mine.logits)):
            if t < ended:
                assert torch.allclose(x[b], y[b], atol=1e-9, rtol=0) and torch.allclose(lx[b], ly[b], atol=1e-9, rtol=0)
            else:
                assert y[b, PAD] == 0 and bool((y[b, 1:] == torch.finfo(y.dtype).min).all())
    assert len({next((i for i, t in enumerate(r.tolist()) if t in eos), 99) for r in mine.sequences[:, width:]}) >= 3


def test_sampled_runs_return_the_emitted_tokens_scores(tiny_cache):
    """Under exact sampling every emitted token's scores are the warped distribution it was drawn
    from: the same forward's scores plain generate would compute for that text."""
    model = enabled(tiny_cache)
    ids = prompts(1, seed=3)[0]
    torch.manual_seed(0)
    out = model.generate(
        ids,
        max_new_tokens=20,
        do_sample=True,
        temperature=0.7,
        top_k=4,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        entmtp_config=EntMTPConfig(tree=SAMPLING_TREE),
    )
    new = out.sequences.shape[1] - ids.shape[1]
    assert len(out.scores) == len(out.logits) == new and max(out.entmtp_stats["accept_lengths"]) >= 2
    with torch.no_grad():
        full = model(out.sequences).logits[0, ids.shape[1] - 1 : -1].float()
    for t in range(new):
        token = out.sequences[0, ids.shape[1] + t]
        assert torch.allclose(out.logits[t][0], full[t], atol=1e-9, rtol=0)
        assert torch.isfinite(out.scores[t][0, token])  # drawn from the top 4
        warped = full[t] / 0.7
        kth = warped.topk(4).values[-1]
        expected = warped.masked_fill(warped < kth, -float("inf"))
        assert torch.allclose(out.scores[t][0], expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["output_attentions", "output_hidden_states"])
def test_outputs_it_cannot_return_are_refused_before_any_forward(tiny_cache, name):
    model = enabled(tiny_cache)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=name):
            model.generate(
                prompts(1)[0],
                max_new_tokens=5,
                return_dict_in_generate=True,
                entmtp_config=EntMTPConfig(tree=CHAIN),
                **{name: True},
            )
    finally:
        handle.remove()
    assert calls == []


def test_num_return_sequences_greedy_is_refused_as_plain_generate_refuses_it(tiny_cache):
    model = enabled(tiny_cache)
    with pytest.raises(ValueError, match="num_return_sequences") as plain:
        model.generate(prompts(1)[0], max_new_tokens=5, num_return_sequences=4)
    with pytest.raises(ValueError, match="num_return_sequences") as mine:
        model.generate(prompts(1)[0], max_new_tokens=5, num_return_sequences=4, entmtp_config=EntMTPConfig(tree=CHAIN))
    assert str(plain.value) == str(mine.value)


def test_num_return_sequences_samples_each_row_from_the_target(tiny_cache):
    """Four sequences per prompt under exact acceptance: every row's continuations follow the
    model's distribution, and the rows are independent draws (not copies)."""
    model = enabled(tiny_cache)
    ids = prompts(1, seed=3)[0]
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    k, runs = 4, 250
    per_row, differing = [{} for _ in range(k)], 0
    torch.manual_seed(5)
    for _ in range(runs):
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=True,
            temperature=0.7,
            top_k=4,
            num_return_sequences=k,
            entmtp_config=EntMTPConfig(tree=SAMPLING_TREE),
        )
        assert out.shape == (k, ids.shape[1] + 3) and bool((out[:, : ids.shape[1]] == ids).all())
        rows = [tuple(r[ids.shape[1] :].tolist()) for r in out]
        differing += len(set(rows)) > 1
        for i, key in enumerate(rows):
            per_row[i][key] = per_row[i].get(key, 0) + 1
    assert differing > runs // 2
    for counts in per_row:
        assert chi_square_p(counts, probs, runs) > 1e-3
    pooled = {}
    for counts in per_row:
        for key, c in counts.items():
            pooled[key] = pooled.get(key, 0) + c
    assert chi_square_p(pooled, probs, runs * k) > 1e-3
