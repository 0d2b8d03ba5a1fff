"""The EAGLE-style drafter: published layouts against a transcription, drafting, and losslessness."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from test_generation import CONFIGS, SAMPLING_TREE, chi_square_p, prompts, sample_counts, target_joint
from tiny import COMMON, VOCAB, tiny_model

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.heads import HeadsLoadError, load_heads
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

H, INTER, HEADS = COMMON["hidden_size"], COMMON["intermediate_size"], COMMON["num_attention_heads"]


# ----------------------------------------------------------------------------- a transcription
# The published draft forward (SafeAILab/EAGLE: eagle/model/cnets1.py for EAGLE-1/2, cnets.py
# for EAGLE-3), written out from its equations for one causal sequence of pairs, on raw tensors.
def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """Rotate-half RoPE; the angles in float32, as the published code (and transformers) compute them."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(sd, prefix, x, cfg):
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd, t = cfg["hidden_size"] // nh, x.shape[0]
    pos = torch.arange(t)
    theta = cfg.get("rope_theta", 10000.0)
    q = rope((x @ sd[prefix + "q_proj.weight"].T).view(t, nh, hd).transpose(0, 1), pos, theta)
    k = rope((x @ sd[prefix + "k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1), pos, theta)
    v = (x @ sd[prefix + "v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(0, 1).reshape(t, -1) @ sd[prefix + "o_proj.weight"].T


def mlp(sd, prefix, x):
    silu = torch.nn.functional.silu
    return (silu(x @ sd[prefix + "gate_proj.weight"].T) * (x @ sd[prefix + "up_proj.weight"].T)) @ sd[
        prefix + "down_proj.weight"
    ].T


def eagle1_reference(sd, cfg, feats, tokens, lm_weight):
    """Logits [T, V] of pairs (f_j, x_{j+1}): z = fc(cat(E(x), f)); one Llama layer without input norm; base LM head."""
    z = torch.cat([sd["embed_tokens.weight"][tokens], feats], -1) @ sd["fc.weight"].T + sd.get("fc.bias", 0)
    a = z + attention(sd, "layers.0.self_attn.", z, cfg)
    g = a + mlp(sd, "layers.0.mlp.", rms(a, sd["layers.0.post_attention_layernorm.weight"], cfg["rms_norm_eps"]))
    return g @ lm_weight.T


def eagle3_reference(sd, cfg, fused, tokens, embed_weight):
    """Logits [T, V'] and target ids: h = fc(low, mid, high); u = cat(norm(E(x)), norm(h)); residual h; own norm
    + LM head."""
    eps = cfg["rms_norm_eps"]
    h = fused @ sd["fc.weight"].T
    u = torch.cat(
        [
            rms(embed_weight[tokens], sd["midlayer.input_layernorm.weight"], eps),
            rms(h, sd["midlayer.hidden_norm.weight"], eps),
        ],
        -1,
    )
    a = h + attention(sd, "midlayer.self_attn.", u, cfg)
    g = a + mlp(sd, "midlayer.mlp.", rms(a, sd["midlayer.post_attention_layernorm.weight"], eps))
    return rms(g, sd["norm.weight"], eps) @ sd["lm_head.weight"].T


# ----------------------------------------------------------------------------- synthetic checkpoints
def llama_config(**extra):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "pad_token_id": 0,
    }
    cfg.update(extra)
    return cfg


def layer_weights(prefix, in_features, kv_heads, g, eagle3=False):
    hd = H // HEADS
    sd = {
        f"{prefix}self_attn.q_proj.weight": torch.randn(HEADS * hd, in_features, generator=g) * 0.2,
        f"{prefix}self_attn.k_proj.weight": torch.randn(kv_heads * hd, in_features, generator=g) * 0.2,
        f"{prefix}self_attn.v_proj.weight": torch.randn(kv_heads * hd, in_features, generator=g) * 0.2,
        f"{prefix}self_attn.o_proj.weight": torch.randn(H, HEADS * hd, generator=g) * 0.2,
        f"{prefix}mlp.gate_proj.weight": torch.randn(INTER, H, generator=g) * 0.2,
        f"{prefix}mlp.up_proj.weight": torch.randn(INTER, H, generator=g) * 0.2,
        f"{prefix}mlp.down_proj.weight": torch.randn(H, INTER, generator=g) * 0.2,
        f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
    }
    if eagle3:
        sd[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        sd[f"{prefix}hidden_norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return sd


def write_eagle1(folder, model, *, llama3=False, safetensors=False):
    """An EAGLE-1/2 checkpoint: vicuna-style (fc bias, no kv-head key) or LLaMA-3-style ("bias": false, GQA, theta)."""
    g = torch.Generator().manual_seed(5)
    kv = 2 if llama3 else HEADS
    extra = {"num_key_value_heads": 2, "rope_theta": 500000.0, "bias": False} if llama3 else {}
    cfg = llama_config(**extra)
    sd = {
        "embed_tokens.weight": model.get_input_embeddings().weight.detach().float().clone(),
        "fc.weight": torch.randn(H, 2 * H, generator=g) * 0.2,
        **layer_weights("layers.0.", H, kv, g),
    }
    if not llama3:
        sd["fc.bias"] = torch.randn(H, generator=g) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if safetensors:
        save_file(sd, str(folder / "model.safetensors"))
    else:
        torch.save(sd, folder / "pytorch_model.bin")
    return cfg, sd


DRAFT_IDS = torch.tensor([0, 1, 2, 3, 5, 6, 8, 9, 10, 11, 13, 14, 16, 17, 19, 20, 21, 23])


def write_eagle3(folder):
    g = torch.Generator().manual_seed(6)
    cfg = llama_config(num_key_value_heads=2, rms_norm_eps=1e-5, draft_vocab_size=len(DRAFT_IDS))
    sd = {
        "fc.weight": torch.randn(H, 3 * H, generator=g) * 0.2,
        **layer_weights("midlayer.", 2 * H, 2, g, eagle3=True),
        "norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
        "lm_head.weight": torch.randn(len(DRAFT_IDS), H, generator=g) * 0.5,
        "d2t": DRAFT_IDS - torch.arange(len(DRAFT_IDS)),
        "t2d": torch.isin(torch.arange(VOCAB), DRAFT_IDS),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(sd, folder / "pytorch_model.bin")
    return cfg, sd


def base_run(model, heads, length=9, seed=2):
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids, output_hidden_states=heads.hidden_states_request)
    return ids, heads.features(out.hidden_states)


# ----------------------------------------------------------------------------- the loaders
@pytest.mark.parametrize("llama3,safetensors", [(False, False), (True, True)])
def test_published_eagle1_matches_the_transcription(tmp_path, llama3, safetensors):
    model = tiny_model()
    cfg, sd = write_eagle1(tmp_path / "eagle", model, llama3=llama3, safetensors=safetensors)
    heads = load_heads(tmp_path / "eagle", base_config=model.config).double()
    assert (heads.config.head_arch, heads.config.use_base_lm_head) == ("eagle", True)
    ids, feats = base_run(model, heads)
    sd = {k: v.double() for k, v in sd.items()}
    lm = model.get_output_embeddings()
    want = eagle1_reference(sd, cfg, feats[0, :-1], ids[0, 1:], lm.weight.detach())
    got = heads.forward_train(feats, ids, model.get_input_embeddings(), lm)[0][0]
    assert torch.allclose(got, want, atol=1e-10, rtol=0)
    # drafting: depth 1 after the whole sequence is the last pair's distribution
    state = heads.new_state(model)
    heads.observe(state, feats[0, :-1], tokens=ids[0, :-1])
    chain = Tree.chain(1).buffers("cpu", torch.float64)
    proposal = heads.propose(state, ids[0, -1], chain)
    top = torch.softmax(want[-1], -1).max(-1)
    assert int(proposal.tokens[1]) == int(top.indices) and abs(float(proposal.probs[1]) - float(top.values)) < 1e-10


def test_published_eagle3_matches_the_transcription(tmp_path):
    model = tiny_model()
    cfg, sd = write_eagle3(tmp_path / "eagle3")
    with pytest.raises(HeadsLoadError, match="base_config"):
        load_heads(tmp_path / "eagle3")
    heads = load_heads(tmp_path / "eagle3", base_config=model.config).double()
    layers = model.config.num_hidden_layers
    assert heads.config.head_arch == "eagle3" and heads.feature_layers == (
        min(2, layers),
        layers // 2,
        max(layers - 3, 0),
    )
    assert torch.equal(heads.draft_vocab, DRAFT_IDS)
    ids, fused = base_run(model, heads)
    sd = {k: v.double() if v.is_floating_point() else v for k, v in sd.items()}
    embed = model.get_input_embeddings()
    want = eagle3_reference(sd, cfg, fused[0, :-1], ids[0, 1:], embed.weight.detach())
    got = heads.forward_train(fused, ids, embed, None)[0][0]
    assert torch.allclose(got, want, atol=1e-10, rtol=0)
    state = heads.new_state(model)
    heads.observe(state, fused[0, :-1], tokens=ids[0, :-1])
    proposal = heads.propose(state, ids[0, -1], Tree.chain(1).buffers("cpu", torch.float64))
    draft_id = int(want[-1].argmax())
    assert int(proposal.tokens[1]) == draft_id + int(sd["d2t"][draft_id])  # the published id mapping


def test_published_eagle_refusals_name_the_file(tmp_path):
    model = tiny_model()
    cfg, sd = write_eagle3(tmp_path / "bad")
    sd["d2t"] = sd["d2t"] + 7  # maps draft ids past the vocabulary
    torch.save(sd, tmp_path / "bad" / "pytorch_model.bin")
    with pytest.raises(HeadsLoadError, match=r"pytorch_model\.bin.*d2t"):
        load_heads(tmp_path / "bad", base_config=model.config)
    cfg, sd = write_eagle1(tmp_path / "e1", model)
    del sd["layers.0.mlp.up_proj.weight"]
    torch.save(sd, tmp_path / "e1" / "pytorch_model.bin")
    with pytest.raises(HeadsLoadError, match=r"pytorch_model\.bin.*missing keys: layers\.0\.mlp\.up_proj\.weight"):
        load_heads(tmp_path / "e1")
    torch.save({"something.weight": torch.zeros(2)}, tmp_path / "e1" / "pytorch_model.bin")
    with pytest.raises(HeadsLoadError, match="not an EAGLE drafter"):
        load_heads(tmp_path / "e1")


@pytest.mark.parametrize("arch", ["eagle", "eagle3", "eagle+fuse"])
def test_own_format_round_trip(tmp_path, tiny_cache, arch):
    model, heads = tiny_cache("llama", "eagle", arch)
    heads.save_pretrained(tmp_path / arch)
    again = load_heads(tmp_path / arch).double()
    assert again.config == heads.config
    ids, feats = base_run(model, heads)
    embed, lm = model.get_input_embeddings(), model.get_output_embeddings()
    for a, b in zip(heads.forward_train(feats, ids, embed, lm), again.forward_train(feats, ids, embed, lm)):
        assert torch.allclose(a, b, atol=1e-5)  # saved float32


# ----------------------------------------------------------------------------- drafting
@pytest.mark.parametrize("arch", ["eagle", "eagle3", "eagle+fuse"])
def test_tree_drafting_equals_the_unrolled_training_forward(tiny_cache, arch):
    """Depth d of a drafted chain scores exactly what training's unroll step d-1 scores when the
    sequence continues with the drafted tokens: one forward, two code paths (tree mask vs unroll)."""
    model, heads = tiny_cache("llama", "eagle", arch)
    ids, feats = base_run(model, heads, length=7)
    state = heads.new_state(model)
    heads.observe(state, feats[0, :-1], tokens=ids[0, :-1])
    depth = 4
    proposal = heads.propose(state, ids[0, -1], Tree.chain(depth).buffers("cpu", torch.float64))
    seq = torch.cat([ids[0], proposal.tokens[1:]])[None]
    pad = torch.cat([feats, feats.new_zeros(1, depth, feats.shape[-1])], 1)  # features after the root are unread
    logits = heads.forward_train(pad, seq, model.get_input_embeddings(), model.get_output_embeddings())
    root_row = ids.shape[1] - 2  # pair (f_t, root) sits at row t, the position before the root
    for d in range(1, depth + 1):
        q = torch.softmax(logits[d - 1][0, root_row].detach(), -1)
        assert abs(float(q.max()) - float(proposal.probs[d])) < 1e-10


def test_a_wide_tree_drafts_each_branch_as_if_alone(tiny_cache):
    """The tree mask: a node's distribution does not depend on its siblings' branches."""
    model, heads = tiny_cache("llama", "eagle", "eagle")
    ids, feats = base_run(model, heads)
    tree = Tree.from_choices(MC_SIM_7B_63)
    state = heads.new_state(model)
    heads.observe(state, feats[0, :-1], tokens=ids[0, :-1])
    full = heads.propose(state, ids[0, -1], tree.buffers("cpu", torch.float64))
    buffers = tree.buffers("cpu", torch.float64)
    for leaf in buffers.retrieve_indices[:6]:
        path = [int(n) for n in leaf if n >= 0]
        alone = Tree.from_choices([list(tree.paths[n - 1][: k + 1]) for k, n in enumerate(path[1:])])
        state = heads.new_state(model)
        heads.observe(state, feats[0, :-1], tokens=ids[0, :-1])
        chain = heads.propose(state, ids[0, -1], alone.buffers("cpu", torch.float64))
        assert torch.equal(chain.tokens, full.tokens[path])
        assert torch.allclose(chain.probs, full.probs[path], atol=1e-12)


def test_observe_needs_the_tokens(tiny_cache):
    model, heads = tiny_cache("llama", "eagle", "eagle")
    ids, feats = base_run(model, heads)
    with pytest.raises(ValueError, match="tokens"):
        heads.observe(heads.new_state(model), feats[0])


# ----------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("arch", ["eagle", "eagle3", "eagle+fuse"])
@pytest.mark.parametrize("name", ["mc_sim", "random", "hysteresis", "value"])
def test_greedy_identical_to_vanilla(tiny_cache, arch, name):
    model, heads = tiny_cache("llama", "eagle", arch)
    enable_entmtp(model, heads)
    longest = 0
    for ids in prompts():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        out = model.generate(
            ids, max_new_tokens=40, do_sample=False, entmtp_config=CONFIGS[name](), return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, ref)
        longest = max(longest, max(out.entmtp_stats["accept_lengths"]))
    assert longest >= (3 if name == "mc_sim" else 2), "the fitted drafter should produce long accepted paths"


@pytest.mark.parametrize("mode", ["replace", "append"])
def test_greedy_identical_with_retrieval(tiny_cache, mode):
    """Replacing steps skip the drafter: the pairs they commit wait and run at its next call."""
    from entmtp_hf.trees.retrieval import RetrievalConfig

    model, heads = tiny_cache("llama", "eagle", "eagle")
    enable_entmtp(model, heads)
    cfg = EntMTPConfig(tree=[[0], [1]], retrieval=RetrievalConfig(min_ngram=1, max_ngram=3, num_tokens=2, mode=mode))
    looping = model.generate(prompts(1, seed=5)[0], max_new_tokens=24, do_sample=False)  # greedy text repeats
    used = 0
    for ids in [looping, *prompts(2)]:
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        out = model.generate(ids, max_new_tokens=40, do_sample=False, entmtp_config=cfg, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        used += out.entmtp_stats["retrieval_steps"]
    assert used > 0
    batch = torch.cat([looping[:, -12:], looping[:, -15:-3]])  # rows whose text recurs
    ref = model.generate(
        batch, attention_mask=torch.ones_like(batch), max_new_tokens=30, do_sample=False, pad_token_id=0
    )
    out = model.generate(
        batch,
        attention_mask=torch.ones_like(batch),
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=0,
        entmtp_config=cfg,
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["eagle", "eagle+fuse"])
def test_greedy_batch_identical_to_vanilla(tiny_cache, arch):
    model, heads = tiny_cache("llama", "eagle", arch)
    enable_entmtp(model, heads)
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=0,
        entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["eagle", "eagle+fuse"])
def test_exact_sampling_preserves_distribution(tiny_cache, arch):
    model, heads = tiny_cache("llama", "eagle", arch)
    enable_entmtp(model, heads)
    ids = prompts(1, seed=3)[0]
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    n = 1000
    counts, long_paths = sample_counts(model, ids, n, entmtp_config=EntMTPConfig(tree=SAMPLING_TREE))
    assert long_paths > n // 6, "drafted tokens should often be accepted (the test's power)"
    assert chi_square_p(counts, probs, n) > 1e-3


def test_fused_feature_layers_are_checked():
    """An 'eagle' drafter's extra states end with the last one, repeat none; other archs take none."""
    from entmtp_hf.errors import ConfigError
    from entmtp_hf.heads.eagle import EagleHeads
    from entmtp_hf.heads.hydra import HydraHeads

    model = tiny_model()
    for bad, message in [
        ([0, 1], "ending with -1"),
        ([-1], "ending with -1"),
        ([1, 1, -1], "repeats"),
        ([-2, -1], "feature_layers"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EagleHeads.for_model(model, arch="eagle", feature_layers=bad)
    with pytest.raises(ConfigError, match="is only used by head_arch"):
        HydraHeads.for_model(model, arch="mlp", feature_layers=[0, -1])
    heads = EagleHeads.for_model(model, arch="eagle", feature_layers=[0, -1])
    assert heads.feature_size == 2 * H and not heads.fuse.weight.any()
