"""Draft heads: published-format loading, proposal semantics, drafting vocabulary, persistence.

Reference outputs come from straightforward re-implementations of the head formulas that
read the published key layouts directly (and, for the prefix layer, a one-layer
``LlamaModel`` run on ``inputs_embeds``, which is what the published layer is), so the
project's heads are checked against the formula, not against themselves. Everything runs
in float64 so that top-k ranks compare exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from entmtp_hf.heads import (
    HEADS_REGISTRY,
    DraftHeads,
    HeadsConfig,
    HydraHeads,
    MedusaHeads,
    Proposal,
    convert_heads,
    load_heads,
)
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

H, V = 16, 64
DTYPE = torch.float64


# ----------------------------------------------------------------------------- fixtures
def tiny_llama_config(**kw) -> LlamaConfig:
    args = dict(
        hidden_size=H,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=V,
        max_position_embeddings=256,
    )
    args.update(kw)
    return LlamaConfig(**args)


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval().to(DTYPE)


def rand(*shape: int, gen: torch.Generator, scale: float = 0.5) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def hydra_published_state(arch: str, n: int, layers: int, seed: int = 0, tie_extra: bool = False) -> dict:
    """A Hydra checkpoint's state dict in the published key layout."""
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    prefix = arch == "prefix-mlp"
    for i in range(n):
        first = f"hydra_mlp.{i}.{1 if prefix else 0}"
        for mod in ("linear", "res_connection"):
            sd[f"{first}.{mod}.weight"] = rand(H, (i + 2) * H, gen=gen)
            sd[f"{first}.{mod}.bias"] = rand(H, gen=gen)
        shared = (rand(H, H, gen=gen), rand(H, gen=gen))
        for j in range(1, layers):
            w, b = shared if tie_extra else (rand(H, H, gen=gen), rand(H, gen=gen))
            idx = 2 * j + 1 if prefix else j
            sd[f"hydra_mlp.{i}.{idx}.linear.weight"], sd[f"hydra_mlp.{i}.{idx}.linear.bias"] = w, b
        lm = f"hydra_lm_head.{i}.1" if prefix else f"hydra_lm_head.{i}"
        sd[f"{lm}.weight"], sd[f"{lm}.bias"] = rand(V, H, gen=gen, scale=1.0), rand(V, gen=gen)
    sd["input_embed_fn.weight"] = rand(V, H, gen=gen)
    if prefix:
        torch.manual_seed(seed + 1)
        layer = LlamaModel(tiny_llama_config())
        for k, v in layer.state_dict().items():  # norms get non-trivial weights too
            noise = rand(*v.shape, gen=gen, scale=0.3) if k.endswith("norm.weight") else 0
            sd[f"prefix_embeding_layer.{k}"] = v + noise
    return sd


def medusa_published_state(n: int, layers: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(n):
        for j in range(layers):
            sd[f"{i}.{j}.linear.weight"], sd[f"{i}.{j}.linear.bias"] = rand(H, H, gen=gen), rand(H, gen=gen)
        sd[f"{i}.{layers}.weight"] = rand(V, H, gen=gen, scale=1.0)
    return sd


def write_hydra(folder, arch: str, n: int = 4, layers: int = 2, tie_extra: bool = False, **cfg_overrides) -> dict:
    os.makedirs(folder, exist_ok=True)
    sd = hydra_published_state(arch, n, layers, tie_extra=tie_extra)
    cfg = dict(
        hydra_num_heads=n,
        hydra_num_layers=layers,
        hydra_head_arch=arch,
        grounded_heads=True,
        hidden_state_offset=0,
        base_model_name_or_path="nobody/unreachable-base",
    )
    cfg.update(cfg_overrides)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(sd, folder / "hydra_lm_head.pt")
    return sd


def write_medusa(folder, n: int = 5, layers: int = 1, cfg_heads: int = 2) -> dict:
    os.makedirs(folder, exist_ok=True)
    sd = medusa_published_state(n, layers)
    cfg = dict(medusa_num_heads=cfg_heads, medusa_num_layers=layers, base_model_name_or_path="nobody/base")
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(sd, folder / "medusa_lm_head.pt")
    return sd


# ------------------------------------------------------------------ reference formulas
def ref_block(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    res = x
    if f"{name}.res_connection.weight" in sd:
        res = x @ sd[f"{name}.res_connection.weight"].T + sd[f"{name}.res_connection.bias"]
    return res + F.silu(x @ sd[f"{name}.linear.weight"].T + sd[f"{name}.linear.bias"])


def ref_hydra_logits(sd: dict, arch: str, layers: int, i: int, c: torch.Tensor, embs: list) -> torch.Tensor:
    """Head i on concat[c, E(x_{t+1}), ..., E(x_{t+i+1})] in the published layout."""
    assert len(embs) == i + 1
    x = torch.cat([c, *embs], dim=-1)
    for j in range(layers):
        x = ref_block(sd, f"hydra_mlp.{i}.{2 * j + 1 if arch == 'prefix-mlp' else j}", x)
    lm = f"hydra_lm_head.{i}.1" if arch == "prefix-mlp" else f"hydra_lm_head.{i}"
    return x @ sd[f"{lm}.weight"].T + sd[f"{lm}.bias"]


def ref_medusa_logits(sd: dict, layers: int, i: int, h: torch.Tensor) -> torch.Tensor:
    x = h
    for j in range(layers):
        x = x + F.silu(x @ sd[f"{i}.{j}.linear.weight"].T + sd[f"{i}.{j}.linear.bias"])
    return x @ sd[f"{i}.{layers}.weight"].T


def ref_prefix(sd: dict, hidden: torch.Tensor) -> torch.Tensor:
    """The published prefix layer: a one-layer LlamaModel on inputs_embeds ([T, H] -> [T, H])."""
    model = LlamaModel(tiny_llama_config())
    own = {k.removeprefix("prefix_embeding_layer."): v for k, v in sd.items() if k.startswith("prefix_embeding_layer.")}
    model.load_state_dict(own, strict=True)
    model = model.to(DTYPE).eval()
    with torch.no_grad():
        return model(inputs_embeds=hidden[None].to(DTYPE)).last_hidden_state[0]


def dsd(sd: dict) -> dict:
    return {k: v.to(DTYPE) for k, v in sd.items()}


# ----------------------------------------------------------------------- helpers
def random_tree(rng: random.Random, depth: int = 4, size: int = 20, width: int = 4) -> Tree:
    paths: set[tuple[int, ...]] = {(0,)}
    while len(paths) < size:
        parent = rng.choice([()] + [p for p in paths if len(p) < depth])
        paths.add(parent + (rng.randrange(width),))
    closed = {p[:k] for p in paths for k in range(1, len(p) + 1)}
    return Tree.from_choices(sorted(closed))


def make_heads(base, family: str, arch: str, draft_vocab=None, layers: int = 2, seed: int = 0) -> DraftHeads:
    torch.manual_seed(seed)
    cls = HEADS_REGISTRY[family]
    return cls.for_model(base, num_heads=4, num_layers=layers, arch=arch, draft_vocab=draft_vocab).to(DTYPE).eval()


def observe_prompt(heads: DraftHeads, base, hidden: torch.Tensor, chunks: tuple[int, ...] = (5,)):
    """New state, prompt observed in chunks (exercises the prefix layer's KV cache)."""
    state = heads.new_state(base)
    start = 0
    for end in (*chunks, hidden.shape[0]):
        heads.observe(state, hidden[start:end])
        start = end
    return state


FAMILIES = [("hydra", "mlp"), ("hydra", "prefix-mlp"), ("medusa", "mlp")]


# ------------------------------------------------------------- published checkpoints
@pytest.mark.parametrize("arch", ["mlp", "prefix-mlp"])
def test_published_hydra_matches_reference(tmp_path, base, arch):
    sd = write_hydra(tmp_path, arch, n=3, layers=3, tie_extra=True)
    heads = load_heads(str(tmp_path), base_config=base.config).to(DTYPE)
    assert isinstance(heads, HydraHeads) and heads.config.head_arch == arch
    # tied extra blocks in the file are loaded as independent copies
    b1, b2 = heads.mlps[0][1].linear.weight, heads.mlps[0][2].linear.weight
    assert torch.equal(b1, b2) and b1.data_ptr() != b2.data_ptr()

    sd, gen = dsd(sd), torch.Generator().manual_seed(1)
    hidden, ids = rand(2, 9, H, gen=gen, scale=1.0).to(DTYPE), torch.randint(0, V, (2, 9), generator=gen)
    embed = base.get_input_embeddings()
    out = heads.forward_train(hidden, ids, embed)
    for b in range(2):
        cond = ref_prefix(sd, hidden[b]) if arch == "prefix-mlp" else hidden[b]
        emb = embed(ids[b]).detach()
        for i, logits in enumerate(out):
            assert logits.shape == (2, 9 - i - 1, V)
            for t in range(9 - i - 1):
                want = ref_hydra_logits(sd, arch, 3, i, cond[t], [emb[t + k] for k in range(1, i + 2)])
                torch.testing.assert_close(logits[b, t], want, rtol=1e-9, atol=1e-9)


def test_published_hydra_propose_matches_reference(tmp_path, base):
    """Each node is the rank-r token of its head's distribution given its own path (mc_sim_7b_63)."""
    arch = "prefix-mlp"
    sd = dsd(write_hydra(tmp_path, arch))
    heads = load_heads(tmp_path, base_config=base.config).to(DTYPE)
    hidden = rand(7, H, gen=torch.Generator().manual_seed(3), scale=1.0).to(DTYPE)
    state = observe_prompt(heads, base, hidden, chunks=(3, 4))
    tree = Tree.from_choices(MC_SIM_7B_63)
    prop = heads.propose(state, torch.tensor(11), tree.buffers(dtype=DTYPE))
    cond = ref_prefix(sd, hidden)[-1]
    embed = base.get_input_embeddings()
    index = tree.node_index()
    for n, path in enumerate(tree.paths, start=1):
        ancestors = [0] + [index[path[:k]] for k in range(1, len(path))]
        embs = [embed(prop.tokens[a]).detach() for a in ancestors]
        logits = ref_hydra_logits(sd, arch, 2, len(path) - 1, cond, embs)
        order = logits.argsort(descending=True)
        assert prop.tokens[n] == order[path[-1]], f"node {n} path {path}"
        p = logits.softmax(-1)
        torch.testing.assert_close(prop.probs[n].double(), p[order[path[-1]]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(prop.entropy[n].double(), -torch.special.xlogy(p, p).sum(), rtol=1e-5, atol=1e-6)
    assert prop.tokens[0] == 11 and prop.probs[0] == 1 and prop.entropy[0] == 0


def test_published_medusa_matches_reference(tmp_path, base):
    sd = write_medusa(tmp_path, n=5, layers=2, cfg_heads=2)
    with pytest.warns(UserWarning, match="declares 2 heads"):
        heads = load_heads(tmp_path).to(DTYPE)
    assert isinstance(heads, MedusaHeads) and heads.num_heads == 5 and heads.config.num_layers == 2
    sd = dsd(sd)
    hidden = rand(1, 8, H, gen=torch.Generator().manual_seed(2), scale=1.0).to(DTYPE)
    for i, logits in enumerate(heads.forward_train(hidden, None, None)):
        want = torch.stack([ref_medusa_logits(sd, 2, i, hidden[0, t]) for t in range(8 - i - 1)])
        torch.testing.assert_close(logits[0], want, rtol=1e-9, atol=1e-9)
    state = observe_prompt(heads, base, hidden[0])
    tree = Tree.from_choices(MC_SIM_7B_63)
    prop = heads.propose(state, torch.tensor(3), tree.buffers())
    for n, path in enumerate(tree.paths, start=1):  # Cartesian: node = rank-r token of head d-1
        order = ref_medusa_logits(sd, 2, len(path) - 1, hidden[0, -1]).argsort(descending=True)
        assert prop.tokens[n] == order[path[-1]]


def test_medusa2_full_model_layout(tmp_path, base):
    sd = medusa_published_state(3, 1)
    full = {f"medusa_head.{k}": v for k, v in sd.items()}
    full["model.embed_tokens.weight"] = torch.zeros(V, H)  # base weights in the same file are skipped
    save_file(full, tmp_path / "model.safetensors")
    config = {"model_type": "llama", "medusa_num_heads": 3, "medusa_num_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    heads = load_heads(tmp_path).to(DTYPE)
    h = rand(1, 4, H, gen=torch.Generator().manual_seed(5)).to(DTYPE)
    torch.testing.assert_close(heads.forward_train(h)[2][0, 0], ref_medusa_logits(dsd(sd), 1, 2, h[0, 0]))


def test_convert_heads_and_cli(tmp_path, base):
    write_hydra(tmp_path / "src", "mlp", n=2, layers=1)
    from entmtp_hf.tools.cli import main

    assert main(["convert-heads", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert cfg["entmtp_heads_format"] == 1 and cfg["family"] == "hydra" and cfg["num_heads"] == 2
    a, b = load_heads(tmp_path / "src"), DraftHeads.from_pretrained(str(tmp_path / "dst"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    converted = convert_heads(tmp_path / "src", tmp_path / "dst2")
    assert isinstance(converted, HydraHeads) and (tmp_path / "dst2" / "README.md").exists()


# ------------------------------------------------------------------- proposal semantics
@pytest.mark.parametrize("family,arch", FAMILIES)
@pytest.mark.parametrize("restricted", [False, True])
def test_propose_agrees_with_forward_train(base, family, arch, restricted):
    """Every node's token/prob/entropy equal a teacher-forced pass along that node's path; at a
    temperature the tokens and entropies stay and the probs are those of the tempered head."""
    dv = torch.randperm(V, generator=torch.Generator().manual_seed(7))[:24] if restricted else None
    heads = make_heads(base, family, arch, draft_vocab=dv)
    gen = torch.Generator().manual_seed(11)
    prompt_h, prompt_ids = rand(8, H, gen=gen, scale=1.0).to(DTYPE), torch.randint(0, V, (8,), generator=gen)
    state = observe_prompt(heads, base, prompt_h, chunks=(5,))
    embed = base.get_input_embeddings()
    rng = random.Random(5)
    for tree in [Tree.from_choices(MC_SIM_7B_63)] + [random_tree(rng) for _ in range(2)]:
        prop = heads.propose(state, torch.tensor(9), tree.buffers(dtype=DTYPE))
        cold = heads.propose(state, torch.tensor(9), tree.buffers(dtype=DTYPE), temperature=0.6)
        assert isinstance(prop, Proposal) and prop.tokens.shape == prop.probs.shape == (tree.num_nodes,)
        assert torch.equal(cold.tokens, prop.tokens) and torch.equal(cold.entropy, prop.entropy)
        assert cold.probs[0] == 1
        index = tree.node_index()
        for n, path in enumerate(tree.paths, start=1):
            drafted = [prop.tokens[index[path[:k]]] for k in range(1, len(path))]
            ids = torch.cat([prompt_ids, torch.tensor([9] + [int(x) for x in drafted])])
            hidden = torch.cat([prompt_h, torch.zeros(len(ids) - 8, H, dtype=DTYPE)])  # later states unused
            logits = heads.forward_train(hidden[None], ids[None], embed)[len(path) - 1][0, 7]
            order = logits.argsort(descending=True)
            want = dv[order[path[-1]]] if restricted else order[path[-1]]
            assert prop.tokens[n] == want, f"node {n} path {path}"
            p = logits.softmax(-1)
            torch.testing.assert_close(prop.probs[n].double(), p[order[path[-1]]], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(prop.entropy[n].double(), -torch.special.xlogy(p, p).sum(), rtol=1e-5, atol=1e-6)
            p_cold = (logits / 0.6).softmax(-1)
            torch.testing.assert_close(cold.probs[n].double(), p_cold[order[path[-1]]], rtol=1e-5, atol=1e-7)
        if restricted:
            assert torch.isin(prop.tokens[1:], dv).all()


@pytest.mark.parametrize("family,arch", FAMILIES)
def test_propose_until_stops_after_the_depth_it_asks(base, family, arch):
    """``until`` sees every drafted depth in order; stopping leaves the shallower nodes as in a full draft."""
    heads = make_heads(base, family, arch)
    state = observe_prompt(heads, base, rand(6, H, gen=torch.Generator().manual_seed(8), scale=1.0).to(DTYPE))
    tree = Tree.from_choices(MC_SIM_7B_63)
    buffers = tree.buffers(dtype=DTYPE)
    full = heads.propose(state, torch.tensor(4), buffers)
    depth_of = [0] + [len(p) for p in tree.paths]
    for stop in (1, 2, 4):
        seen = []

        def until(d, entropy):
            seen.append(d)
            return d == stop

        part = heads.propose(state, torch.tensor(4), buffers, until=until)
        assert seen == list(range(1, stop + 1)) and part.depth == stop
        kept = torch.tensor([d <= stop for d in depth_of])
        assert torch.equal(part.tokens[kept], full.tokens[kept])
        torch.testing.assert_close(part.entropy[kept], full.entropy[kept])
    assert full.depth is None


def test_prefix_layer_incremental_equals_full(base):
    heads = make_heads(base, "hydra", "prefix-mlp")
    h = rand(10, H, gen=torch.Generator().manual_seed(4), scale=1.0).to(DTYPE)
    whole = heads.prefix_embeding_layer(h[None])[0]
    state = heads.new_state(base)
    for a, b in [(0, 4), (4, 5), (5, 10)]:
        heads.observe(state, h[a:b])
        torch.testing.assert_close(state.cond, whole[b - 1], rtol=1e-9, atol=1e-9)
    assert state.num_observed == 10


def test_draft_vocab_maps_to_base_ids(base):
    """Restricted heads = full-vocabulary heads with the logits of draft_vocab rows only."""
    dv = torch.tensor([60, 3, 17, 42, 5, 33, 8, 21, 50, 12])
    full = HydraHeads.for_model(base, num_heads=2, use_base_lm_head=True).to(DTYPE)
    part = HydraHeads.for_model(base, num_heads=2, use_base_lm_head=True, draft_vocab=dv).to(DTYPE)
    part.mlps.load_state_dict(full.mlps.state_dict())
    assert part.lm_heads is None and "draft_vocab" in part.state_dict()
    gen = torch.Generator().manual_seed(8)
    hidden, ids = rand(1, 6, H, gen=gen).to(DTYPE), torch.randint(0, V, (1, 6), generator=gen)
    embed, lm = base.get_input_embeddings(), base.get_output_embeddings()
    for a, b in zip(full.forward_train(hidden, ids, embed, lm), part.forward_train(hidden, ids, embed, lm)):
        torch.testing.assert_close(b, a[..., dv])
    s_full, s_part = full.new_state(base), part.new_state(base)
    full.observe(s_full, hidden[0]), part.observe(s_part, hidden[0])
    buffers = Tree.chain(2).buffers()
    p = part.propose(s_part, torch.tensor(1), buffers)
    assert torch.isin(p.tokens[1:], dv).all()
    # per-head LM heads initialised from the base LM head rows give the same logits
    own = HydraHeads.for_model(base, num_heads=2, draft_vocab=dv).to(DTYPE)
    own.mlps.load_state_dict(full.mlps.state_dict())
    own.init_lm_heads_from(base)
    for a, b in zip(own.forward_train(hidden, ids, embed), part.forward_train(hidden, ids, embed, lm)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="draft_vocab"):
        HydraHeads.for_model(base, draft_vocab=[1, 1, 2])
    with pytest.raises(ValueError, match="draft_vocab"):
        HydraHeads.for_model(base, draft_vocab=[0, V])


def test_state_lives_outside_the_heads(base):
    heads = make_heads(base, "hydra", "mlp", layers=3)
    keys = set(heads.state_dict())
    state = heads.new_state(base)
    assert set(heads.state_dict()) == keys and state.embed is base.get_input_embeddings()
    assert not any(k.startswith(("embed", "base")) for k in keys)
    params = [p.data_ptr() for p in heads.parameters()]
    assert len(params) == len(set(params))  # every block owns its weights
    with pytest.raises(ValueError, match="observe"):
        heads.propose(state, torch.tensor(0), Tree.chain(2).buffers())
    heads.observe(state, torch.zeros(3, H, dtype=DTYPE))
    with pytest.raises(ValueError, match="exceeds"):
        heads.propose(state, torch.tensor(0), Tree.chain(5).buffers())
    with pytest.raises(ValueError, match="observe expects"):
        heads.observe(state, torch.zeros(3, H + 1, dtype=DTYPE))


# ----------------------------------------------------------------------- persistence
@pytest.mark.parametrize("family,arch", FAMILIES)
def test_save_load_round_trip(tmp_path, base, family, arch):
    heads = make_heads(base, family, arch, draft_vocab=torch.arange(40, 0, -2), seed=3)
    heads.save_pretrained(tmp_path)
    assert {"config.json", "model.safetensors", "README.md"} <= set(os.listdir(tmp_path))
    loaded = DraftHeads.from_pretrained(tmp_path).to(DTYPE)
    assert type(loaded) is type(heads) and loaded.config == heads.config
    gen = torch.Generator().manual_seed(1)
    hidden, ids = rand(1, 7, H, gen=gen).to(DTYPE), torch.randint(0, V, (1, 7), generator=gen)
    embed = base.get_input_embeddings()
    for a, b in zip(heads.forward_train(hidden, ids, embed), loaded.forward_train(hidden, ids, embed)):
        assert torch.equal(a, b)
    buffers = Tree.from_choices(MC_SIM_7B_63).buffers(dtype=DTYPE)
    pa, pb = (h.propose(observe_prompt(h, base, hidden[0]), torch.tensor(2), buffers) for h in (heads, loaded))
    assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.probs, pb.probs)
    other = MedusaHeads if family == "hydra" else HydraHeads
    with pytest.raises(ValueError, match="not"):
        other.from_pretrained(tmp_path)


def test_load_from_offline_hub_cache(tmp_path, base, monkeypatch):
    """A cache laid out as models--org--name/{refs/main, snapshots/<hash>/} loads with HF_HUB_OFFLINE=1."""
    import huggingface_hub.constants as hub_constants

    heads = make_heads(base, "medusa", "mlp")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someorg--tiny-heads"
    heads.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # The library reads these variables at import time; set them the way the env would have.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for revision in (None, commit):
        loaded = load_heads("someorg/tiny-heads", revision=revision)
        pairs = zip(loaded.state_dict().values(), heads.state_dict().values())
        assert all(torch.equal(a, b) for a, b in pairs)
    with pytest.raises(ValueError, match="someorg/absent"):
        load_heads("someorg/absent")
    with pytest.raises(
        ValueError, match=f"revision 'v2' of Hub repo 'someorg/tiny-heads' is not in the local cache.*{commit}"
    ):
        load_heads("someorg/tiny-heads", revision="v2")  # a missing revision, not a missing config.json


# ------------------------------------------------------------------- refusing bad input
class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("family", ["hydra", "medusa"])
def test_malicious_pickle_is_refused(tmp_path, family):
    marker = tmp_path / "pwned"
    if family == "hydra":
        write_hydra(tmp_path, "mlp", n=1, layers=1)
        name = "hydra_lm_head.pt"
    else:
        write_medusa(tmp_path, n=1, cfg_heads=1)
        name = "medusa_lm_head.pt"
    torch.save({"0.0.linear.weight": _Evil(str(marker))}, tmp_path / name)
    with pytest.raises(ValueError, match=name):
        load_heads(tmp_path)
    assert not marker.exists()


def test_corrupt_or_mismatched_weights(tmp_path, base):
    heads = make_heads(base, "hydra", "mlp", layers=1)
    heads.save_pretrained(tmp_path / "ok")
    weights = tmp_path / "ok" / "model.safetensors"
    for name, mutate in {
        "truncated": lambda d: d.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2]),
        "garbage": lambda d: d.write_bytes(b"\x00" * 64),
    }.items():
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        mutate(tmp_path / name / "model.safetensors")
        with pytest.raises(ValueError, match=r"model\.safetensors.*safetensors"):
            load_heads(tmp_path / name)
    state = {k: v.contiguous() for k, v in heads.state_dict().items()}
    cases = {
        "shape": {**state, "lm_heads.0.bias": torch.zeros(V + 1)},
        "missing": {k: v for k, v in state.items() if k != "mlps.1.0.linear.weight"},
        "extra": {**state, "mlps.9.0.linear.weight": torch.zeros(1)},
    }
    expect = {
        "shape": "wrong shapes: lm_heads.0.bias",
        "missing": "missing keys: mlps.1.0.linear.weight",
        "extra": "unexpected keys: mlps.9",
    }
    for name, sd in cases.items():
        shutil.copytree(tmp_path / "ok", tmp_path / name)
        save_file(sd, tmp_path / name / "model.safetensors")
        with pytest.raises(ValueError, match=rf"model\.safetensors.*{expect[name]}"):
            load_heads(tmp_path / name)


def test_published_strictness(tmp_path):
    sd = write_hydra(tmp_path / "a", "mlp", n=2, layers=1)
    torch.save({**sd, "hydra_mlp.0.7.linear.weight": torch.zeros(H, H)}, tmp_path / "a" / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match=r"hydra_lm_head\.pt.*unexpected keys: hydra_mlp\.0\.7"):
        load_heads(tmp_path / "a")
    sd = write_hydra(tmp_path / "b", "prefix-mlp", n=2, layers=1)
    del sd["prefix_embeding_layer.norm.weight"]
    torch.save(sd, tmp_path / "b" / "hydra_lm_head.pt")
    with pytest.raises(ValueError, match=r"missing keys: prefix_embeding_layer\.norm\.weight"):
        load_heads(tmp_path / "b", base_config=tiny_llama_config())
    sd = write_medusa(tmp_path / "c", n=2, layers=2, cfg_heads=2)
    del sd["1.1.linear.weight"]
    torch.save(sd, tmp_path / "c" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt.*different or non-contiguous"):
        load_heads(tmp_path / "c")


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"grounded_heads": False}, "non-grounded"),
        ({"hidden_state_offset": 1}, "hidden_state_offset"),
        ({"hydra_head_arch": "cross-attn"}, "unsupported hydra_head_arch"),
        ({"hydra_num_heads": "4"}, "hydra_num_heads"),
        ({"grounded_heads": None}, "grounded_heads"),
    ],
)
def test_unsupported_hydra_configs(tmp_path, overrides, message):
    write_hydra(tmp_path, "mlp", n=2, layers=1, **overrides)
    with pytest.raises(ValueError, match=rf"config\.json.*{message}"):
        load_heads(tmp_path)


@pytest.mark.parametrize("family", ["medusa", "hydra"])
@pytest.mark.parametrize(
    "declared, message",
    [
        ({"vocab_size": 10**9}, r"vocab_size must be an integer in \[1, 2097152\], got 1000000000"),
        ({"hidden_size": 2**40}, r"hidden_size must be an integer in \[1, 65536\]"),
        ({"vocab_size": "64"}, "vocab_size must be an integer"),
        ({"vocab_size": V + 1}, rf"vocab_size is {V + 1}, but the weights in .* have {V}"),
        ({"hidden_size": 2 * H}, rf"hidden_size is {2 * H}, but the weights in .* have {H}"),
    ],
)
def test_published_config_sizes_are_bounded_and_match_the_weights(tmp_path, family, declared, message):
    folder = tmp_path / family
    write_medusa(folder, n=2) if family == "medusa" else write_hydra(folder, "mlp", n=2, layers=1)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": H, "vocab_size": V}))
    assert load_heads(folder).config.vocab_size == V  # declared sizes that agree load
    (folder / "config.json").write_text(json.dumps({**cfg, **declared}))
    with pytest.raises(ValueError, match=rf"{family}.config\.json: {message}"):
        load_heads(folder)


def test_bad_configs(tmp_path, base):
    write_hydra(tmp_path / "nobase", "prefix-mlp", n=1, layers=1, base_model_name_or_path=None)
    with pytest.raises(ValueError, match="base_config"):
        load_heads(tmp_path / "nobase")
    heads = make_heads(base, "medusa", "mlp")
    heads.save_pretrained(tmp_path / "own")
    cfg_path = tmp_path / "own" / "config.json"
    good = json.loads(cfg_path.read_text())
    for bad, message in [
        ("{not json", "JSON"),
        (json.dumps([1, 2]), "JSON object"),
        (json.dumps({**good, "num_heads": "4"}), "num_heads: must be an int"),
        (json.dumps({**good, "family": "lookahead"}), "family"),
        (json.dumps({**good, "family": "eagle"}), "head_arch: for .eagle. must be one of"),
        (json.dumps({**good, "entmtp_heads_format": 99}), "unsupported entmtp_heads_format"),
        (json.dumps({k: v for k, v in good.items() if k != "hidden_size"}), "hidden_size"),
        (json.dumps({"foo": 1}), "not a draft-heads config"),
    ]:
        cfg_path.write_text(bad)
        with pytest.raises(ValueError, match=rf"config\.json.*{message}"):
            load_heads(tmp_path / "own")
    cfg_path.write_text(json.dumps({**good, "added_later": True}))
    with pytest.warns(UserWarning, match="added_later"):
        load_heads(tmp_path / "own")
    with pytest.raises(ValueError, match="not a local folder"):
        load_heads(tmp_path / "no-such-folder")


def test_heads_config_validation():
    ok = HeadsConfig(family="hydra", num_heads=2, hidden_size=H, vocab_size=V)
    assert HeadsConfig.from_dict(ok.to_dict()) == ok and ok.draft_vocab_rows == V
    for bad in [
        dict(family="medusa", head_arch="prefix-mlp"),
        dict(num_heads=0),
        dict(draft_vocab_size=V + 1),
        dict(use_base_lm_head=1),
        dict(head_arch="prefix-mlp"),  # needs prefix_layer_config
        dict(format_version=2),
    ]:
        with pytest.raises(ValueError):
            HeadsConfig(**{**ok.to_dict(), **bad})
