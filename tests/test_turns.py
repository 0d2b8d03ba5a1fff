"""A cache carried across calls: a chat's turns continue from the cache the last one left.

Each turn's prompt is the whole conversation so far; the cache holds all of it but the last
generated token, and a call prefills only the rest, as plain ``generate`` does with
``past_key_values=``. EntMTP and plain turns mix on one cache.
"""

import pytest
import torch
from transformers import DynamicCache

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63
from test_generation import CHAIN
from tiny import VOCAB


def enabled(tiny_cache, arch, family="hydra", head_arch="mlp"):
    model, heads = tiny_cache(arch, family, head_arch)
    return enable_entmtp(model, heads)


def user_turns(seed: int = 2, lengths=(20, 7, 11)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, n), generator=g) for n in lengths]


def chat(model, modes: list[str], tree=MC_SIM_7B_63, new_tokens: int = 15) -> list[torch.Tensor]:
    """Three turns on one cache, each ``"entmtp"`` or ``"plain"``: every turn's returned text."""
    cache, text, texts = DynamicCache(config=model.config), None, []
    for mode, turn in zip(modes, user_turns()):
        prompt = turn if text is None else torch.cat([text, turn], dim=-1)
        extra = {"entmtp_config": EntMTPConfig(tree=tree)} if mode == "entmtp" else {}
        out = model.generate(prompt, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True, **extra)  # fmt: skip
        assert out.cache is cache
        assert cache.get_seq_length() == out.sequences.shape[1] - 1
        text = out.sequences
        texts.append(text)
    return texts


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-window-3"])
@pytest.mark.parametrize(
    "modes", [["entmtp"] * 3, ["entmtp", "plain", "entmtp"], ["plain", "entmtp", "plain"]], ids=["eee", "epe", "pep"]
)
def test_three_turns_on_one_cache_equal_plain_generate_with_the_same_reuse(tiny_cache, arch, modes):
    model = enabled(tiny_cache, arch)
    plain = chat(model, ["plain"] * 3)
    mine = chat(model, modes)
    for a, b in zip(mine, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("head_arch", ["eagle", "prefix-mlp"])
def test_drafters_with_a_context_continue_a_turn(tiny_cache, head_arch):
    """Drafters that read the context (an EAGLE-style drafter, Hydra's prefix layer) start theirs
    at the new turn's tokens: still lossless, and still accepting."""
    family = "eagle" if head_arch == "eagle" else "hydra"
    model = enabled(tiny_cache, "llama", family, head_arch)
    plain = chat(model, ["plain"] * 3)
    for tree in (CHAIN, MC_SIM_7B_63):
        mine = chat(model, ["entmtp"] * 3, tree=tree)
        assert all(torch.equal(a, b) for a, b in zip(mine, plain))


def test_a_turn_stopped_inside_its_accepted_path_hands_back_its_text_only(tiny_cache):
    """max_new_tokens inside an accepted path: the cache drops the nodes past the returned text."""
    model = enabled(tiny_cache, "llama")
    for new_tokens in (1, 2, 3, 5):
        assert all(torch.equal(a, b) for a, b in zip(chat(model, ["entmtp"] * 3, new_tokens=new_tokens),
                                                     chat(model, ["plain"] * 3, new_tokens=new_tokens)))  # fmt: skip


def test_a_filled_cache_without_a_new_token_is_refused(tiny_cache):
    model = enabled(tiny_cache, "llama")
    cache = DynamicCache(config=model.config)
    out = model.generate(user_turns()[0], cache=cache, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="at least one new token"):
        model.generate(out[:, :-1], cache=cache, max_new_tokens=4, do_sample=False,
                       entmtp_config=EntMTPConfig(tree=CHAIN))  # fmt: skip


def test_a_filled_static_cache_is_refused_before_any_forward(tiny_cache):
    from transformers import StaticCache

    model = enabled(tiny_cache, "llama")
    cache = StaticCache(config=model.config, max_cache_len=64)
    out = model.generate(user_turns()[0], cache=cache, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="filled DynamicCache"):
        model.generate(out, cache=cache, max_new_tokens=4, do_sample=False,
                       entmtp_config=EntMTPConfig(tree=CHAIN))  # fmt: skip


def test_a_left_padded_batch_continues_from_plain_generates_cache(tiny_cache):
    """A batch's first turn decoded plainly, its second with EntMTP on the same cache: as plain."""
    model = enabled(tiny_cache, "gemma3")
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (2, 18), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    more = torch.randint(1, VOCAB, (2, 6), generator=g)

    def second_turn(**extra):
        cache = DynamicCache(config=model.config)
        first = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False,
                               pad_token_id=0)  # fmt: skip
        prompt = torch.cat([first, more], dim=-1)
        full = torch.cat([mask, torch.ones(2, prompt.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=-1)
        return model.generate(prompt, attention_mask=full, cache=cache, max_new_tokens=12,
                              do_sample=False, pad_token_id=0, **extra)  # fmt: skip

    assert torch.equal(second_turn(entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)), second_turn())
