"""A cache carried across calls: a chat's turns continue from the cache the last one left.

Each turn's prompt is the whole conversation so far; the cache holds all of it but the last
generated token, and a call prefills only the rest, as plain ``generate`` does with
``past_key_values=``. EntMTP and plain turns mix on one cache, dynamic or static (the caller's
cache object ends each call as plain ``generate`` leaves it); a batch call hands its cache back
empty, so the next turn prefills the whole conversation. A cache of another model or batch is
refused before any compute.
"""

import pytest
import torch
from test_generation import CHAIN
from tiny import COMMON, VOCAB, tiny_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63


def enabled(tiny_cache, arch, family="hydra", head_arch="mlp"):
    model, heads = tiny_cache(arch, family, head_arch)
    return enable_entmtp(model, heads)


def user_turns(seed: int = 2, lengths=(20, 7, 11)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, n), generator=g) for n in lengths]


def chat(model, modes: list[str], tree=MC_SIM_7B_63, new_tokens: int = 15, cache=None) -> list[torch.Tensor]:
    """Three turns on one cache (a new DynamicCache unless given), each ``"entmtp"`` or ``"plain"``:
    every turn's returned text."""
    cache, text, texts = cache if cache is not None else DynamicCache(config=model.config), None, []
    for mode, turn in zip(modes, user_turns()):
        prompt = turn if text is None else torch.cat([text, turn], dim=-1)
        extra = {"entmtp_config": EntMTPConfig(tree=tree)} if mode == "entmtp" else {}
        out = model.generate(
            prompt, cache=cache, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, **extra
        )
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
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                chat(model, ["entmtp"] * 3, new_tokens=new_tokens), chat(model, ["plain"] * 3, new_tokens=new_tokens)
            )
        )


def test_a_filled_cache_without_a_new_token_is_refused(tiny_cache):
    model = enabled(tiny_cache, "llama")
    cache = DynamicCache(config=model.config)
    out = model.generate(user_turns()[0], cache=cache, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="at least one new token"):
        model.generate(
            out[:, :-1], cache=cache, max_new_tokens=4, do_sample=False, entmtp_config=EntMTPConfig(tree=CHAIN)
        )


def held(cache) -> list[tuple]:
    """What plain generate's next call reads of each static layer: its type, room, text length and
    the keys and values of the tokens it holds (a ring: the last ones)."""
    out = []
    for layer in cache.layers:
        n = int(layer.get_seq_length())
        kept = min(n, layer.max_cache_len)
        out.append((type(layer).__name__, layer.max_cache_len, n, layer.keys[:, :, :kept], layer.values[:, :, :kept]))
    return out


@pytest.mark.parametrize(("arch", "room"), [("llama", 300), ("gemma2", 82), ("gemma3", 300), ("mistral-sliding", 82)])
def test_turns_on_one_static_cache_equal_plain_generate_with_the_same_reuse(tiny_cache, arch, room):
    """EntMTP fills the caller's StaticCache object (sliding layers; 82 slots, what the text needs but
    not a tree's room too) and leaves it as plain generate would: plain generate continues on it, and
    so does EntMTP."""
    model = enabled(tiny_cache, arch)
    plain_cache = StaticCache(config=model.config, max_cache_len=room)
    plain = chat(model, ["plain"] * 3, cache=plain_cache)  # the third turn's text is 83 tokens: its cache 82
    for modes in (["entmtp"] * 3, ["entmtp", "plain", "entmtp"], ["plain", "entmtp", "plain"]):
        cache = StaticCache(config=model.config, max_cache_len=room)
        assert all(torch.equal(a, b) for a, b in zip(chat(model, modes, cache=cache), plain)), modes
        for mine, theirs in zip(held(cache), held(plain_cache)):
            assert mine[:3] == theirs[:3], modes
            torch.testing.assert_close(mine[3:], theirs[3:], rtol=0, atol=1e-6)


def test_plain_generate_continues_entmtps_static_cache_with_sliding_layers(tiny_cache):
    """The issue's case: EntMTP fills an empty StaticCache, plain generate continues on the same object;
    the text is a full forward's (no cache)."""
    model = enabled(tiny_cache, "gemma2")
    for seed in range(4):
        first, more = user_turns(seed, (10, 5))
        cache = StaticCache(config=model.config, max_cache_len=160)
        out = model.generate(
            first, cache=cache, max_new_tokens=20, do_sample=False, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)
        )
        prompt = torch.cat([out, more], dim=-1)
        after = model.generate(prompt, cache=cache, max_new_tokens=15, do_sample=False)
        assert torch.equal(after, model.generate(prompt, max_new_tokens=15, do_sample=False, use_cache=False))


def batch_turns(model, modes: str, cache, eos) -> list[torch.Tensor]:
    """Three turns of a left-padded batch of 3 on one cache (``"e"``: EntMTP, ``"p"``: plain); each
    turn appends 4 user tokens per row to the returned sequences, with a mask of ones past the prompt."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 6)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    texts = []
    for mode in modes:
        extra = {"entmtp_config": EntMTPConfig(tree=MC_SIM_7B_63)} if mode == "e" else {}
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=eos,
            **extra,
        )
        if mode == "e":
            assert cache.get_seq_length() == 0  # handed back empty: the next turn prefills it all
        texts.append(out)
        more = torch.randint(1, VOCAB, (3, 4), generator=g)
        ids = torch.cat([out, more], dim=-1)
        mask = torch.cat([mask, torch.ones(3, ids.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=-1)
    return texts


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral-window-3"])
@pytest.mark.parametrize(("kind", "eos"), [("dynamic", [5, 9]), ("static", None)])
def test_the_turn_after_a_batch_call_equals_plain_generate(tiny_cache, arch, kind, eos):
    """A batch's rows do not sit in the cache as plain generate's left-padded layout (rejected nodes
    leave holes, stopped rows leave early), so a batch call hands its cache back empty: the next turn,
    plain or EntMTP, prefills the whole conversation and gives plain generate's text."""
    model = enabled(tiny_cache, arch)

    def new_cache():
        return (
            DynamicCache(config=model.config)
            if kind == "dynamic"
            else StaticCache(config=model.config, max_cache_len=200)
        )

    plain = batch_turns(model, "ppp", new_cache(), eos)
    for modes in ("eee", "epe", "pep"):
        assert all(torch.equal(a, b) for a, b in zip(batch_turns(model, modes, new_cache(), eos), plain)), modes


class Forwards:
    """Counts the model's forward calls (a refusal before any compute leaves it at 0)."""

    def __init__(self, model) -> None:
        self.count = 0
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, *args) -> None:
        self.count += 1


def filled_by(config, rows: int = 1, dtype=torch.float64) -> DynamicCache:
    """A cache a Llama of ``config`` filled with a prompt of ``rows`` rows."""
    other = LlamaForCausalLM(config).to(dtype).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        other(torch.arange(1, 7).repeat(rows, 1), cache=cache, use_cache=True)
    return cache


def test_a_cache_of_another_model_or_batch_is_refused_before_any_forward(tiny_cache):
    model = enabled(tiny_cache, "llama")
    three = LlamaConfig(**{**COMMON, "num_hidden_layers": 3})
    cases = {
        "3 layers": (DynamicCache(config=three), "3 layers and the model 2"),
        "3 static layers": (StaticCache(config=three, max_cache_len=64), "3 layers and the model 2"),
        "sliding layers": (
            StaticCache(config=tiny_model("mistral-sliding").config, max_cache_len=64),
            "sliding-window layer where the model's layer has full attention",
        ),
        "wider heads": (
            filled_by(LlamaConfig(**{**COMMON, "num_key_value_heads": 4})),
            "4 key/value heads of size 8; the model's have 2 of size 8",
        ),
        "float32": (
            filled_by(LlamaConfig(**COMMON), dtype=torch.float32),
            "torch.float32 keys and the model computes in torch.float64",
        ),
        "2 rows": (filled_by(LlamaConfig(**COMMON), rows=2), "holds 2 rows and the call decodes 1"),
        "too small": (StaticCache(config=model.config, max_cache_len=20), "max_cache_len=26"),
    }
    forwards = Forwards(model)
    for name, (cache, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            model.generate(
                torch.arange(3, 10)[None],
                cache=cache,
                max_new_tokens=20,
                do_sample=False,
                entmtp_config=EntMTPConfig(tree=CHAIN),
            )
        assert forwards.count == 0, name
    forwards.handle.remove()


def test_an_empty_prompt_is_refused_as_such(tiny_cache):
    """Plain generate fails on a prompt of no token; EntMTP says what is wrong, before any forward."""
    model = enabled(tiny_cache, "llama")
    forwards = Forwards(model)
    with pytest.raises(ValueError, match="input_ids is empty"):
        model.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4, entmtp_config=EntMTPConfig(tree=CHAIN))
    assert forwards.count == 0
    forwards.handle.remove()


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
        first = model.generate(
            ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0
        )
        prompt = torch.cat([first, more], dim=-1)
        full = torch.cat([mask, torch.ones(2, prompt.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=-1)
        return model.generate(
            prompt, attention_mask=full, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0, **extra
        )

    assert torch.equal(second_turn(entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63)), second_turn())
