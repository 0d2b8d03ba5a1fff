"""A model's own MTP layers as the drafter: loaded as transformers loads them, lossless, and drafting
exactly what ``generate(use_mtp=True)`` drafts.

The tiny checkpoints are written as the families' real ones are laid out, so that transformers'
``MtpModel.from_pretrained`` finds the MTP tensors: DeepSeek-V3 and GLM-4-MoE after their last
decoder layer (``model.layers.61.*`` / ``model.layers.46.*``, so those tiny models have 61 / 46
layers, dense and cheap, while their MTP layer is a mixture of experts as in the real models),
Mellum under ``mtp.``, ERNIE 4.5 as ``mtp_block.0.*``, ``mtp_emb_norm.0.*``, ... with the model's
final norm as the MTP post-norm. Every model runs in float64 (the experts with transformers'
``eager`` implementation: its grouped kernel takes no float64). The MTP layers are fitted for a
few dozen steps before saving, so drafts are often accepted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from safetensors.torch import load_file, save_file
from test_generation import CONFIGS, SAMPLING_TREE, chi_square_p, sample_counts, target_joint
from tiny import COMMON as TINY_COMMON
from tiny import VOCAB, tiny_model
from torch import Tensor
from transformers import AutoModelForCausalLM
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel

from entmtp_hf.config import EntMTPConfig
from entmtp_hf.heads import HeadsMismatchError, MtpHeads, load_heads
from entmtp_hf.integration import enable_entmtp
from entmtp_hf.scheduling.eas import EASConfig
from entmtp_hf.trees.tree import MC_SIM_7B_63, Tree

COMMON = {**TINY_COMMON, "intermediate_size": 32}  # every family below names its layer count
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)


def _deepseek_key(key: str, layers: int) -> str | None:
    """``layers.K.mtp_block.x`` -> ``model.layers.{layers+K}.x`` (post-norm: ``shared_head.norm``), as DeepSeek-V3
    and GLM-4.5 checkpoints store their MTP layers."""
    _, k, rest = key.split(".", 2)
    rest = "shared_head.norm.weight" if rest == "post_norm.weight" else rest.removeprefix("mtp_block.")
    return f"model.layers.{layers + int(k)}.{rest}"


def _ernie_key(key: str, layers: int) -> str | None:
    """ERNIE 4.5's ``mtp_block.K.x``, ``mtp_emb_norm.K.x``, ...; its post-norm is the model's final norm."""
    _, k, rest = key.split(".", 2)
    part, name = rest.split(".", 1)
    parts = {
        "mtp_block": "mtp_block",
        "enorm": "mtp_emb_norm",
        "hnorm": "mtp_hidden_norm",
        "eh_proj": "mtp_linear_proj",
    }
    return None if part == "post_norm" else f"{parts[part]}.{k}.{name}"


#: family -> (config class, model class, config fields, checkpoint key of an MtpModel key)
FAMILIES = {
    "deepseek_v3": (
        tf.DeepseekV3Config,
        tf.DeepseekV3ForCausalLM,
        dict(
            num_hidden_layers=61,
            first_k_dense_replace=61,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            num_mtp_layers=1,
            **MOE,
        ),
        _deepseek_key,
    ),
    "glm4_moe": (
        tf.Glm4MoeConfig,
        tf.Glm4MoeForCausalLM,
        dict(
            num_hidden_layers=46,
            first_k_dense_replace=46,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            head_dim=8,
            num_mtp_layers=1,
            **MOE,
        ),
        _deepseek_key,
    ),
    # a sliding-window MTP layer (Mellum's default type) with a window shorter than the texts
    "mellum": (
        tf.MellumConfig,
        tf.MellumForCausalLM,
        dict(
            num_hidden_layers=2,
            num_experts=4,
            num_mtp_layers=1,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            **MOE,
        ),
        lambda key, layers: f"mtp.{key}",
    ),
    "ernie4_5_moe": (
        tf.Ernie4_5_MoeConfig,
        tf.Ernie4_5_MoeForCausalLM,
        dict(
            num_hidden_layers=2,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_layer_start_index=2,
            num_mtp_layers=1,
        ),
        _ernie_key,
    ),
}


def _plain(model):
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def _random_mtp(model, layers: int, seed: int = 1) -> MtpModel:
    """transformers' ``MtpModel`` of ``model`` with random weights (its own init leaves the experts unset)."""
    mtp = MtpModel(model, layers).to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return mtp


def fit(model, heads: MtpHeads, steps: int = 40, seed: int = 0) -> None:
    """Fit the MTP layers briefly to the model's greedy next-next tokens on random texts (teacher forcing)."""
    texts = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(texts, output_hidden_states=-1)
        hidden, targets = out.hidden_states[-1], out.logits.argmax(-1)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    opt = torch.optim.Adam([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        logits = heads.forward_train(hidden, texts, embed, lm_head)
        # element i, row j scores token j + i + 2: the model's greedy pick after j + i + 1
        loss = sum(
            F.cross_entropy(lg.flatten(0, 1), targets[:, i + 1 : i + 1 + lg.shape[1]].flatten())
            for i, lg in enumerate(logits)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    heads.eval()


def write_checkpoint(family: str, folder) -> None:
    """A tiny float64 model of ``family`` with one fitted MTP layer, saved with the MTP tensors where the
    family's checkpoints keep them."""
    config_cls, model_cls, extra, key_of = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra})
    config._experts_implementation = "eager"
    model = _plain(model_cls(config).to(torch.float64))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # greedy runs that are not flat
    mtp = _random_mtp(model, config.num_mtp_layers)
    if family == "ernie4_5_moe":  # the MTP post-norm is the model's final norm
        with torch.no_grad():
            mtp.layers[0].post_norm.weight.requires_grad_(False).copy_(model.model.norm.weight)
    fit(model, MtpHeads.from_model(model, mtp_model=mtp))
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    for key, value in mtp.state_dict().items():
        name = None if key.startswith(("embed_tokens", "shared_head")) else key_of(key, config.num_hidden_layers)
        if name is not None:
            tensors[name] = value.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="session")
def mtp_model(tmp_path_factory):
    """``mtp_model(family)``: the tiny checkpoint of ``family``, loaded (float64, eager experts) and enabled
    with its own MTP layers (one fresh model per call; checkpoints written once)."""
    folders = {}

    def get(family: str, enable: bool = True):
        if family not in folders:
            folders[family] = tmp_path_factory.mktemp(family)
            write_checkpoint(family, folders[family])
        model = _plain(
            AutoModelForCausalLM.from_pretrained(folders[family], dtype=torch.float64, experts_implementation="eager")
        )
        return enable_entmtp(model, "mtp", cpu_kernels=False) if enable else model

    return get


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


BRANCHING = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]  # mc_sim-like, smaller
TREES = {"chain": Tree.chain(3).choices, "branching": BRANCHING, "mc_sim": MC_SIM_7B_63}
#: the 61- and 46-layer models are the slow ones: fewer tokens and trees
BUDGET = {
    "deepseek_v3": (12, ["chain", "mc_sim"]),
    "glm4_moe": (16, ["chain", "mc_sim"]),
    "mellum": (30, list(TREES)),
    "ernie4_5_moe": (30, list(TREES)),
}


# ----------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_identical_to_plain_generate(mtp_model, family):
    model = mtp_model(family)
    tokens, trees = BUDGET[family]
    longest = 0
    for ids in (prompt(5, 1), prompt(9, 2))[: 1 if tokens < 20 else 2]:
        ref = model.generate(ids, max_new_tokens=tokens, do_sample=False)
        for name in trees:
            out = model.generate(
                ids,
                max_new_tokens=tokens,
                do_sample=False,
                return_dict_in_generate=True,
                entmtp_config=EntMTPConfig(tree=TREES[name]),
            )
            assert torch.equal(out.sequences, ref), (family, name)
            longest = max(longest, max(out.entmtp_stats["accept_lengths"]))
    assert longest >= 2, "the fitted MTP layer should have drafts accepted"


def test_greedy_identical_under_every_policy(mtp_model):
    """Switching trees, several trees drafted from one root, and EAS's early stop (``propose(until=...)``)."""
    model = mtp_model("ernie4_5_moe")
    configs = {**CONFIGS, "eas": lambda: EntMTPConfig(tree=Tree.chain(5).choices, eas=EASConfig(warmup_tokens=4))}
    ids = prompt(6, 3)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    for name, config in configs.items():
        out = model.generate(ids, max_new_tokens=30, do_sample=False, entmtp_config=config())
        assert torch.equal(out, ref), name


def test_a_drafting_vocabulary_limits_the_drafts_only(mtp_model):
    """``draft_vocab``: the MTP layers score a subset of the LM head's rows; the output stays the model's."""
    model = mtp_model("ernie4_5_moe")
    ids = prompt(6, 3)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    vocab = model.generate(ids, max_new_tokens=24, do_sample=False)[0].unique()[:10]  # tokens the text uses
    heads = MtpHeads.from_model(model, draft_vocab=vocab)
    assert heads.config.draft_vocab_rows == vocab.numel()
    enable_entmtp(model, heads, cpu_kernels=False)
    drafted = []
    propose = heads.propose

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafted.extend(proposal.tokens[1:].tolist())
        return proposal

    heads.propose = recorded
    out = model.generate(
        ids,
        max_new_tokens=24,
        do_sample=False,
        entmtp_config=EntMTPConfig(tree=BRANCHING),
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, ref)
    assert drafted and set(drafted) <= set(vocab.tolist())
    assert max(out.entmtp_stats["accept_lengths"]) >= 2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_left_padded_batch_identical(mtp_model, family):
    model = mtp_model(family)
    tokens = BUDGET[family][0]
    rows = 2 if tokens < 20 else 3
    ids = torch.randint(1, VOCAB, (rows, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    if rows > 2:
        mask[2, :6] = 0  # one real token: the MTP layer has nothing committed before the root
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        do_sample=False,
        pad_token_id=0,
        entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63),
    )
    assert torch.equal(out, ref)


def test_exact_sampling_preserves_distribution(mtp_model):
    model = mtp_model("ernie4_5_moe")
    ids = prompt(4, 3)
    probs = target_joint(model, ids, temperature=0.7, top_k=4)
    n = 400
    counts, long_paths = sample_counts(model, ids, n, entmtp_config=EntMTPConfig(tree=SAMPLING_TREE))
    assert long_paths > n // 6, "drafted tokens should often be accepted (the test's power)"
    assert chi_square_p(counts, probs, n) > 1e-3


# ----------------------------------------------------------------------------- parity with use_mtp=True
class _Accepted:
    """An EntMTP observer recording how many drafted tokens every step accepted."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_start(self, session) -> None: ...
    def on_prefill(self, seconds) -> None: ...
    def on_end(self, seconds) -> None: ...

    def on_step(self, record) -> None:
        self.counts += [len(r.path) - 1 for r in record.rows]


def _use_mtp_steps(model, ids, tokens: int, monkeypatch) -> tuple[torch.Tensor, list[tuple[list[int], Tensor, int]]]:
    """``generate(use_mtp=True)``, recording what transformers' MTP candidate generator drafted each step (the
    tokens and their probabilities) and how many of those tokens the model accepted."""
    steps, get, update = [], MTPCandidateGenerator.get_candidates, MTPCandidateGenerator.update_candidate_strategy

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = get(self, input_ids, *args, **kwargs)
        self.drafted = None
        if logits is not None:  # the prefill's step drafts nothing
            self.drafted = (candidates[0, input_ids.shape[1] :].tolist(), torch.softmax(logits[0], -1).amax(-1))
        return candidates, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self.drafted is not None:
            steps.append((*self.drafted, int(num_matches)))
        return update(self, input_ids, scores, num_matches)

    with monkeypatch.context() as m:
        m.setattr(MTPCandidateGenerator, "get_candidates", get_candidates)
        m.setattr(MTPCandidateGenerator, "update_candidate_strategy", update_candidate_strategy)
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, use_mtp=True)
    return out, steps


def _entmtp_steps(model, ids, tokens: int, layers: int, monkeypatch) -> tuple[torch.Tensor, list]:
    """EntMTP with a chain of ``layers``: each step's drafted tokens, their probabilities and how many were accepted."""
    heads, drafted, accepted = model.entmtp_heads, [], _Accepted()
    propose = heads.propose

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafted.append((proposal.tokens[1:].tolist(), proposal.probs[1:]))
        return proposal

    with monkeypatch.context() as m:
        m.setattr(heads, "propose", recorded)
        out = model.generate(
            ids,
            max_new_tokens=tokens,
            do_sample=False,
            entmtp_observers=[accepted],
            entmtp_config=EntMTPConfig(tree=Tree.chain(layers).choices),
        )
    return out, [(*d, n) for d, n in zip(drafted, accepted.counts)]


def _assert_parity(model, layers: int, monkeypatch, lengths=(1, 4, 8), tokens: int = 24) -> set[int]:
    """EntMTP with a chain of ``layers`` drafts (the same tokens, with the same probabilities) and accepts what
    ``use_mtp=True`` does at every step, on prompts of ``lengths`` tokens; the accepted counts seen, as a set."""
    accepted = set()
    for seed, length in enumerate(lengths):
        ids = prompt(length, seed)
        ref, theirs = _use_mtp_steps(model, ids, tokens, monkeypatch)
        out, ours = _entmtp_steps(model, ids, tokens, layers, monkeypatch)
        assert torch.equal(out, ref)
        assert len(ours) == len(theirs), (length, ours, theirs)
        # the last step's acceptance is cut to the length budget differently: compare it without the count;
        # transformers hands its drafted logits over in float32
        for step, ((a, p, n), (b, q, m)) in enumerate(zip(ours, theirs)):
            assert a == b and (n == m or step == len(ours) - 1), (length, step, ours, theirs)
            assert torch.allclose(p, q.to(p.dtype), rtol=0, atol=1e-6), (length, step, p, q)
        accepted |= {n for _, _, n in theirs[:-1]}
    return accepted


@pytest.mark.parametrize("family", ["mellum", "ernie4_5_moe"])
def test_chain_drafts_what_use_mtp_drafts(mtp_model, family, monkeypatch):
    """One MTP layer loaded from the checkpoint by both: the same drafts and acceptances, step by step."""
    accepted = _assert_parity(mtp_model(family), 1, monkeypatch)
    assert 1 in accepted, "the fitted MTP layer's drafts should be accepted at times"


@pytest.fixture(scope="module")
def three_layers():
    """A tiny GLM-4-MoE with three fitted MTP layers, and its ``MtpModel`` (no stock checkpoint layout holds more
    than one for these families: the test hands transformers the same object its loader would build)."""
    config_cls, model_cls, extra, _ = FAMILIES["glm4_moe"]
    torch.manual_seed(0)
    config = config_cls(**{**COMMON, **extra, "num_hidden_layers": 2, "first_k_dense_replace": 2, "num_mtp_layers": 3})
    config._experts_implementation = "eager"
    model = _plain(model_cls(config).to(torch.float64))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    mtp = _random_mtp(model, 3)
    heads = MtpHeads.from_model(model, mtp_model=mtp)
    fit(model, heads, steps=60)
    return model, mtp, heads


def test_three_layer_chain_drafts_what_use_mtp_drafts(three_layers, monkeypatch):
    """Layer d drafts depth d from layer d-1's outputs, over its own cache of the text and, for depth 3,
    the entry of the drafted depth-1 token (the tree's triangle of entries): as transformers' chain."""
    model, mtp, heads = three_layers
    enable_entmtp(model, heads, cpu_kernels=False)
    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(lambda cls, main, **kwargs: mtp))
    # (transformers' chain fails on a prompt shorter than its layers once a draft is rejected early: its
    # window of states to re-run reaches before the text's start)
    accepted = _assert_parity(model, 3, monkeypatch, lengths=(4, 6, 9))
    assert {0, 3} < accepted, f"whole, partial and no chains should be accepted, got {accepted}"


def test_three_layer_greedy_identical(three_layers):
    model, _, heads = three_layers
    enable_entmtp(model, heads, cpu_kernels=False)
    ids = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2], mask[2, :5] = 0, 0
    for tree in (BRANCHING, MC_SIM_7B_63, Tree.chain(5).choices):  # depths 4 and 5: the last layer again
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
            entmtp_config=EntMTPConfig(tree=tree),
        )
        assert torch.equal(out, ref)


def test_a_wide_tree_drafts_each_branch_as_if_alone(three_layers):
    """The tree masks: a node's distribution does not depend on its siblings' branches, in any layer."""
    model, _, heads = three_layers
    ids = prompt(6, 7)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=-1).hidden_states[-1][0]
    root = torch.tensor(3)

    def drafted(tree: Tree):
        state = heads.new_state(model)
        heads.observe(state, hidden, tokens=ids[0])
        return heads.propose(state, root, tree.buffers("cpu", torch.float64))

    tree = Tree.from_choices(MC_SIM_7B_63)
    full = drafted(tree)
    buffers = tree.buffers("cpu", torch.float64)
    for leaf in buffers.retrieve_indices[::4]:
        path = [int(n) for n in leaf if n >= 0]
        alone = drafted(Tree.from_choices([list(tree.paths[n - 1][: k + 1]) for k, n in enumerate(path[1:])]))
        assert torch.equal(alone.tokens, full.tokens[path])
        assert torch.allclose(alone.probs, full.probs[path], atol=1e-12)


# ----------------------------------------------------------------------------- refusals
def test_a_model_without_mtp_layers_is_refused():
    with pytest.raises(HeadsMismatchError, match="no MTP layers.*num_mtp_layers"):
        enable_entmtp(tiny_model(), "mtp")


def test_a_checkpoint_without_mtp_tensors_is_refused(tmp_path):
    config_cls, model_cls, extra, _ = FAMILIES["mellum"]
    model_cls(config_cls(**{**COMMON, **extra})).save_pretrained(tmp_path)  # the config says 1 MTP layer, no tensors
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(HeadsMismatchError, match="holds no MTP layers.*missing"):
        enable_entmtp(model, "mtp")
    model.config.name_or_path = ""
    with pytest.raises(HeadsMismatchError, match="not loaded from a checkpoint"):
        enable_entmtp(model, "mtp")


def test_mtp_heads_come_from_a_model(three_layers, tmp_path):
    _, _, heads = three_layers
    with pytest.raises(ValueError, match="pass the model"):
        load_heads("mtp")
    with pytest.raises(ValueError, match="saved with it"):
        heads.save_pretrained(tmp_path / "heads")
    with pytest.raises(ValueError, match="from_model"):
        MtpHeads.for_model(three_layers[0])
