"""The shared draft-head interface: proposal, per-call state, save/load/push.

Conventions (shared with the generation loop):

* Node 0 of a tree is the root, the base model's own next token x_{t+1}; nodes at depth
  d = 1..D are drafted by head d-1, and head i predicts token t+i+2.
* h_t is the base model's last hidden state after the final norm at the position whose
  prediction is the root. :meth:`DraftHeads.observe` receives those states for every
  newly accepted position; :meth:`DraftHeads.propose` drafts a whole tree from them.
* All per-``generate`` state lives in a :class:`DraftState`; the heads object holds only
  weights (and what describes them: the card, where they were loaded from), so one set of
  heads can serve concurrent or successive calls.

Heads are Hub artefacts through huggingface_hub's :class:`~huggingface_hub.ModelHubMixin`:
``save_pretrained`` writes ``config.json``, ``model.safetensors`` (safetensors only),
``card.json`` and a generated ``README.md``; ``push_to_hub`` uploads that folder;
``from_pretrained`` reads this project's format and the published ones, validated.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.nn.functional as F
from huggingface_hub import ModelCard, ModelHubMixin
from torch import Tensor, nn

from ..cpu_kernels import fitted_layout, project
from ..errors import EntMTPError
from ..scheduling.features import entropy_from_logp
from ..trees.tree import DepthStep, TreeBuffers
from .card import CARD_NAME, HeadsCard, model_card
from .config import FORMAT_VERSION, HeadsConfig
from .registry import CONFIG_NAME, FAMILIES, load_from_source

FORMAT_KEY = "entmtp_heads_format"
WEIGHTS_NAME = "model.safetensors"

StopFn = Callable[[int, Tensor], bool]


#: the attribute an enabled model keeps its draft heads under (``enable_entmtp``)
HEADS_ATTR = "entmtp_heads"


class HeadsMismatchError(EntMTPError):
    """Heads that do not fit what they are used with: a base model (vocabulary, hidden size,
    drafting ids, prefix layer; see :meth:`DraftHeads.check_fits`) or the family asked for."""


@dataclass(frozen=True)
class Proposal:
    """A drafted tree: one entry per node, in the tree's canonical node order.

    ``tokens`` are base-vocabulary ids (node 0 = the root token); ``probs`` is each node
    token's softmax probability under the head that drafted it (1 for the root);
    ``entropy`` the entropy in nats of that head distribution (0 for the root).
    ``depth`` is how many depths were drafted: when ``propose(..., until=...)`` stopped early
    the nodes deeper than it are unset and must not be read.
    """

    tokens: Tensor  # [N] long
    probs: Tensor  # [N] float32 (float64 for float64 heads)
    entropy: Tensor | None = None  # [N] same dtype as probs
    depth: int | None = None  # depths drafted (None: all of the tree's)


@dataclass
class DraftState:
    """Per-``generate``-call drafting state; create with :meth:`DraftHeads.new_state`.

    The base model's embedding and LM head are referenced here rather than registered on
    the heads, so they are neither saved with the heads nor moved twice.
    """

    embed: nn.Module
    lm_weight: Tensor | None = None  # base LM head rows (restricted to draft_vocab) if used
    lm_bias: Tensor | None = None
    prefix_cache: Any = None  # the family's own per-call cache (a prefix layer's, an EAGLE drafter's)
    num_observed: int = 0  # accepted positions seen so far (prefix-layer positions)
    cond: Tensor | None = None  # [H] conditioning vector at the last accepted position
    #: how ``lm_weight`` multiplies (a :func:`~entmtp_hf.cpu_kernels.project` layout; see ``DraftHeads.lm_kernel``)
    kernel: str = "linear"


class ResBlock(nn.Module):
    """``res(x) + SiLU(linear(x))``; ``res`` is a learned projection only when widths differ."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.res_connection = nn.Linear(in_features, out_features) if in_features != out_features else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.res_connection(x) + F.silu(self.linear(x))


def text_config(config: Any) -> Any:
    """The decoder's config of a (possibly multimodal) transformers config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def replicated(t: Tensor | None) -> Tensor | None:
    """A tensor-parallel (DTensor) weight gathered whole, anything else as it is: the heads run
    replicated on every rank and multiply by the base LM head as a plain tensor (a collective:
    every rank gathers at the same point of its generate call)."""
    gather = getattr(t, "full_tensor", None)
    return gather() if callable(gather) else t


def check_draft_vocab(draft_vocab: Tensor | list[int] | None, vocab_size: int) -> Tensor | None:
    """Validate a drafting vocabulary: 1-D, unique ids in ``[0, vocab_size)``."""
    if draft_vocab is None:
        return None
    dv = torch.as_tensor(draft_vocab)
    if dv.dim() != 1 or dv.numel() == 0 or dv.is_floating_point() or dv.is_complex() or dv.dtype == torch.bool:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids, got shape {tuple(dv.shape)}")
    dv = dv.long().cpu()
    if int(dv.min()) < 0 or int(dv.max()) >= vocab_size:
        raise ValueError(f"draft_vocab ids must lie in [0, {vocab_size}), got [{int(dv.min())}, {int(dv.max())}]")
    if dv.unique().numel() != dv.numel():
        raise ValueError("draft_vocab contains repeated token ids")
    return dv


class DraftHeads(nn.Module, ModelHubMixin):
    """Base class of draft heads; subclasses implement ``_build_mlps``, ``propose``, ``forward_train``.

    ``card`` (a :class:`~entmtp_hf.heads.card.HeadsCard`) is what the model card reports beyond
    the config; ``name_or_path`` the folder or repo id the heads were loaded from (None if built).
    """

    family: ClassVar[str] = ""  # set by ``register_family``
    lm_head_bias: ClassVar[bool] = True  # whether per-head LM heads carry a bias
    #: how the base LM rows multiply while drafting; :class:`~entmtp_hf.cpu_kernels.CPUKernels`
    #: sets ``"onednn"`` on an instance where it measured that faster, and removes it again
    lm_kernel: str = "linear"
    #: what a head drafts from, as the model card words it
    card_inputs: ClassVar[str] = "the base model's last hidden state at t"

    @classmethod
    def card_summary(cls, config: HeadsConfig, vocab: str, lm: str, stored: str) -> tuple[str, str]:
        """The model card's title and first paragraph: what these heads are and what each drafts from
        (``vocab``: the drafting vocabulary, ``lm``: the LM head rows, ``stored``: dtype and size, as worded)."""
        what = (
            f"{config.num_heads} {config.family} heads (`{config.head_arch}`, {config.num_layers} block(s) each, "
            f"hidden size {config.hidden_size}) drafting over {vocab} with {lm}; stored in {stored}. Head i "
            f"drafts token t+i+2 from {cls.card_inputs}."
        )
        return f"{config.family.capitalize()} draft heads", what

    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if config.family != self.family:
            raise ValueError(f"{type(self).__name__} needs a config of family {self.family!r}, got {config.family!r}")
        self.config = config
        self.card = HeadsCard()
        self.name_or_path: str | None = None
        rows = config.draft_vocab_rows
        self.register_buffer("draft_vocab", torch.arange(rows) if config.draft_vocab_size else None)
        self.mlps = self._build_mlps()
        self.lm_heads = self._build_lm_heads()

    # ------------------------------------------------------------------ building
    def _build_lm_heads(self) -> nn.ModuleList | None:
        """One LM head per head over the drafting vocabulary, unless the base one is used."""
        if self.config.use_base_lm_head:
            return None
        h, rows = self.config.hidden_size, self.config.draft_vocab_rows
        return nn.ModuleList(nn.Linear(h, rows, bias=self.lm_head_bias) for _ in range(self.config.num_heads))

    def _build_mlps(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The base hidden-state indices the heads read (``output_hidden_states`` of the verifier's
        forwards), concatenated in this order: the last, after the final norm, unless a family says."""
        return (-1,)

    @property
    def feature_size(self) -> int:
        """Width of the features :meth:`observe` takes: ``hidden_size`` per read hidden state."""
        return self.config.hidden_size * len(self.feature_layers)

    @property
    def hidden_states_request(self) -> int | list[int]:
        """What a forward's ``output_hidden_states`` must be for :meth:`features` (only those states are kept)."""
        layers = self.feature_layers
        return layers[0] if len(layers) == 1 else list(layers)

    def features(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        """The features [..., feature_size] of a forward run with ``output_hidden_states=hidden_states_request``
        (transformers keeps the tuple's full length, the states not asked for being None)."""
        states = [hidden_states[i] for i in self.feature_layers]
        return states[0] if len(states) == 1 else torch.cat(states, dim=-1)

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        num_heads: int = 4,
        num_layers: int = 1,
        arch: str = "mlp",
        draft_vocab: Tensor | list[int] | None = None,
        use_base_lm_head: bool = False,
        feature_layers: list[int] | None = None,
    ) -> "DraftHeads":
        """Randomly initialised heads sized for ``model`` (hidden size, vocabulary), on its device;
        ``feature_layers``: the base hidden states they read, if not the family's default."""
        if not cls.family:
            raise TypeError("call for_model on a concrete class, e.g. HydraHeads.for_model(model)")
        base = text_config(model.config)
        dv = check_draft_vocab(draft_vocab, base.vocab_size)
        family = FAMILIES[cls.family]
        config = family.config_class(
            family=cls.family,
            head_arch=arch,
            num_heads=num_heads,
            num_layers=num_layers,
            hidden_size=base.hidden_size,
            vocab_size=base.vocab_size,
            use_base_lm_head=use_base_lm_head,
            draft_vocab_size=0 if dv is None else int(dv.numel()),
            base_model_name_or_path=getattr(model, "name_or_path", None) or None,
            prefix_layer_config=cls._prefix_layer_config(base) if arch in family.layer_archs else None,
            feature_layers=feature_layers or cls._default_feature_layers(base, arch),
        )
        heads = cls(config)
        if dv is not None:
            heads.draft_vocab.copy_(dv)
        param = next(model.parameters(), None)
        return heads.to(param.device) if param is not None else heads

    @staticmethod
    def _prefix_layer_config(base_config: Any) -> dict[str, Any]:
        raise ValueError("this heads family has no prefix layer")

    @staticmethod
    def _default_feature_layers(base_config: Any, arch: str) -> list[int] | None:
        return None

    @torch.no_grad()
    def init_lm_heads_from(self, model: nn.Module) -> "DraftHeads":
        """Copy the base LM head's rows (restricted to ``draft_vocab``) into every head's LM head.

        A common warm start: before training each head then predicts like the base model.
        """
        if self.lm_heads is None:
            raise ValueError("these heads use the base LM head (use_base_lm_head=True); there is nothing to initialise")
        weight, bias = self._base_lm_rows(model)
        for lm in self.lm_heads:
            lm.weight.copy_(weight)
            if lm.bias is not None:
                lm.bias.copy_(bias if bias is not None else torch.zeros_like(lm.bias))
        return self

    def _base_lm_rows(self, model_or_head: nn.Module) -> tuple[Tensor, Tensor | None]:
        head = model_or_head
        if hasattr(model_or_head, "get_output_embeddings"):
            head = model_or_head.get_output_embeddings()
        if head is None or not isinstance(getattr(head, "weight", None), Tensor):
            raise ValueError("the base model exposes no output embeddings (LM head) with a weight")
        weight, bias = replicated(head.weight), replicated(getattr(head, "bias", None))
        if weight.shape[-1] != self.config.hidden_size or weight.shape[0] < self.config.vocab_size:
            raise ValueError(
                f"base LM head of shape {tuple(weight.shape)} does not fit hidden_size={self.config.hidden_size}, "
                f"vocab_size={self.config.vocab_size}"
            )
        weight = weight[: self.config.vocab_size]
        bias = bias[: self.config.vocab_size] if isinstance(bias, Tensor) else None
        if self.draft_vocab is not None:
            idx = self.draft_vocab.to(weight.device)
            weight, bias = weight[idx], (bias[idx] if bias is not None else None)
        dtype = self._dtype
        return weight.to(dtype), (bias.to(dtype) if bias is not None else None)

    def check_fits(self, model: nn.Module) -> None:
        """Raise :class:`HeadsMismatchError` listing every way these heads do not fit ``model``.

        Drafted ids index the model's input embeddings and are verified against its LM head,
        so the heads' vocabulary must be the LM head's rows and within the embedding rows;
        the heads read the model's hidden states and embeddings, so their widths must agree;
        drafting ids must lie in the vocabulary; a prefix layer runs on the same hidden states.
        Checked once before generating, so a wrong pairing fails with names, not deep inside
        a forward pass or, worse, as silently wrong drafts.
        """
        problems = [*self._fit_problems(model)]
        if problems:
            raise HeadsMismatchError(f"{self.family} heads do not fit {type(model).__name__}: " + "; ".join(problems))

    def _fit_problems(self, model: nn.Module) -> Iterator[str]:
        h, v = self.config.hidden_size, self.config.vocab_size
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        lm = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        embed_w, lm_w = getattr(embed, "weight", None), getattr(lm, "weight", None)
        if not isinstance(embed_w, Tensor) or embed_w.dim() != 2:
            yield "the model exposes no input embeddings with a 2-D weight"
        else:
            if embed_w.shape[1] != h:
                yield f"heads hidden_size {h} != the embedding width {embed_w.shape[1]}"
            if embed_w.shape[0] < v:
                yield f"heads vocab_size {v} > the {embed_w.shape[0]} embedding rows (drafted ids must be embeddable)"
        if not isinstance(lm_w, Tensor) or lm_w.dim() != 2:
            yield "the model exposes no LM head (output embeddings) with a 2-D weight"
        else:
            if lm_w.shape[0] != v:
                yield f"heads vocab_size {v} != the {lm_w.shape[0]} rows of the model's LM head (its vocabulary)"
            if lm_w.shape[1] != h:
                yield f"heads hidden_size {h} != the LM head's in_features {lm_w.shape[1]}"
        model_h = getattr(text_config(getattr(model, "config", None)), "hidden_size", None)
        if isinstance(model_h, int) and model_h != h:
            yield f"heads hidden_size {h} != the model config's hidden_size {model_h}"
        depth = getattr(text_config(getattr(model, "config", None)), "num_hidden_layers", None)
        deepest = max(self.feature_layers)
        if isinstance(depth, int) and deepest > depth:
            yield f"the heads read hidden state {deepest}, but the model has {depth} layers (states 0..{depth})"
        prefix = self.config.prefix_layer_config
        if prefix is not None and isinstance(model_h, int) and prefix.get("hidden_size") != model_h:
            yield f"the prefix layer's hidden_size {prefix.get('hidden_size')} != the model's {model_h}"
        if self.draft_vocab is not None:
            try:
                check_draft_vocab(self.draft_vocab, v)
            except ValueError as e:
                yield str(e)

    @property
    def _dtype(self) -> torch.dtype:
        return next(p for p in self.parameters()).dtype

    # ------------------------------------------------------------------ drafting
    @torch.no_grad()
    def new_state(self, model: nn.Module) -> DraftState:
        """Fresh drafting state for one ``generate`` call on ``model``."""
        embed = model.get_input_embeddings()
        weight = getattr(embed, "weight", None)
        if isinstance(weight, Tensor) and weight.shape[-1] != self.config.hidden_size:
            raise ValueError(f"base embeddings have width {weight.shape[-1]}, heads expect {self.config.hidden_size}")
        lm_weight = lm_bias = None
        if self.config.use_base_lm_head:
            lm_weight, lm_bias = self._base_lm_rows(model)
        return DraftState(
            embed=embed,
            lm_weight=lm_weight,
            lm_bias=lm_bias,
            prefix_cache=self._new_prefix_cache(),
            kernel=fitted_layout(self.lm_kernel, lm_weight),
        )

    def _new_prefix_cache(self) -> Any:
        return None

    def _condition(self, state: DraftState, hidden: Tensor) -> Tensor:
        """Conditioning vectors [T, H] for newly accepted states (identity unless prefix-mlp)."""
        return hidden

    def _observed(self, hidden: Tensor) -> Tensor:
        """``observe``'s features as [T, feature_size], checked (a leading batch of one is dropped)."""
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.dim() != 2 or hidden.shape[-1] != self.feature_size or hidden.shape[0] == 0:
            raise ValueError(
                f"observe expects hidden states [T>0, {self.feature_size}] (batch size 1), got {tuple(hidden.shape)}"
            )
        return hidden

    @torch.no_grad()
    def observe(self, state: DraftState, hidden: Tensor, tokens: Tensor | None = None) -> None:
        """Feed the last hidden states [T, H] of newly accepted positions, in order; ``tokens`` [T],
        the ids at those positions, are read by families that pair features with tokens (EAGLE)."""
        hidden = self._observed(hidden)
        cond = self._condition(state, hidden.to(self._dtype))
        state.num_observed += hidden.shape[0]
        state.cond = cond[-1]

    def observe_rows(self, states: list[DraftState], hiddens: list[Tensor], tokens: list[Tensor | None]) -> None:
        """:meth:`observe` for several rows' states (a batch's commit); families whose conditioning
        runs a layer override this loop to run it once for every row."""
        for state, hidden, toks in zip(states, hiddens, tokens):
            self.observe(state, hidden, toks)

    def propose(
        self,
        state: DraftState,
        root_token: Tensor,
        buffers: TreeBuffers,
        until: StopFn | None = None,
        temperature: float = 1.0,
    ) -> Proposal:
        """Draft the tree of ``buffers`` from the root token.

        ``until(depth, entropy)``, if given, is called after each drafted depth (1-based) with
        the entropy tensor filled so far; returning True stops drafting there, so a caller that
        decides from the heads' entropies (EAS) pays only for the depths it reads.
        ``temperature``: the proposal's ``probs`` are those of the heads' distributions at it
        (the tokens, ranked, and the entropies, at 1, do not change): sampling at T < 1 accepts
        a drafted token with its probability at T, so that is what a value estimate should read.
        """
        raise NotImplementedError

    def propose_rows(
        self, states: list[DraftState], roots: list[Tensor], buffers: TreeBuffers, temperature: float = 1.0
    ) -> list[Proposal]:
        """:meth:`propose` of one tree for several rows' states (a batch's drafting); families that
        can draft the rows in one head call per depth override this loop."""
        return [self.propose(s, r, buffers, temperature=temperature) for s, r in zip(states, roots)]

    def forward_train(
        self, hidden: Tensor, input_ids: Tensor, embed: nn.Module | None, lm_head: nn.Module | None = None
    ) -> list[Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared maths
    def _head(
        self, i: int, x: Tensor, lm_weight: Tensor | None, lm_bias: Tensor | None, kernel: str = "linear"
    ) -> Tensor:
        """Logits of head ``i`` (over the drafting vocabulary) for head inputs ``x``; ``kernel``:
        how the base LM rows multiply (:func:`~entmtp_hf.cpu_kernels.project`)."""
        for block in self.mlps[i]:
            x = block(x)
        if self.lm_heads is not None:
            return self.lm_heads[i](x)
        if lm_weight is None:
            raise ValueError("these heads use the base LM head: pass it (new_state(model) / lm_head=...)")
        if kernel == "linear":
            return F.linear(x, lm_weight, lm_bias)
        return project(x.reshape(-1, x.shape[-1]), lm_weight, lm_bias, kernel).reshape(*x.shape[:-1], -1)

    def _train_lm(self, lm_head: nn.Module | None) -> tuple[Tensor | None, Tensor | None]:
        if not self.config.use_base_lm_head:
            return None, None
        if lm_head is None:
            raise ValueError("these heads use the base LM head: pass lm_head=model.get_output_embeddings()")
        return self._base_lm_rows(lm_head)

    def _start(self, state: DraftState, root_token: Tensor, buffers: TreeBuffers) -> tuple[Tensor, Tensor, Tensor]:
        """Checked conditioning vector and empty proposal tensors with the root filled in."""
        if state.cond is None:
            raise ValueError("observe() the prompt's hidden states before propose()")
        depth = len(buffers.depth_plan)
        if depth > self.num_heads:
            raise ValueError(f"tree depth {depth} exceeds the {self.num_heads} draft heads")
        widest = max((s.topk for s in buffers.depth_plan), default=0)
        if widest > self.config.draft_vocab_rows:
            raise ValueError(f"tree asks for top-{widest} but heads draft from {self.config.draft_vocab_rows} tokens")
        n, device = buffers.num_nodes, state.cond.device
        tokens = torch.empty(n, dtype=torch.long, device=device)
        tokens[:1] = root_token.reshape(1)
        stat = torch.promote_types(self._dtype, torch.float32)  # float32 unless the heads run in float64
        return tokens, torch.ones(n, dtype=stat, device=device), torch.zeros(n, dtype=stat, device=device)

    def _children(
        self, logits: Tensor, rows: Tensor, step: DepthStep, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Token, probability (at ``temperature``) and head entropy (at 1) of each child of ``step``.

        ``logits`` [R, V'] are the head outputs of the parent rows; child c takes the
        rank ``step.child_rank[c]`` token of row ``rows[c]``.
        """
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logp = torch.log_softmax(logits, dim=-1)
        entropy = entropy_from_logp(logp)
        top_logp, top_idx = logp.topk(step.topk, dim=-1)
        if temperature != 1.0:  # same ranking; the probabilities of those tokens at the temperature
            top_logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, top_idx)
        idx = top_idx[..., rows, step.child_rank]  # leading dims: the rows of a batch (propose_rows)
        tokens = self.draft_vocab[idx] if self.draft_vocab is not None else idx
        return tokens, top_logp[..., rows, step.child_rank].exp(), entropy[..., rows]

    # ------------------------------------------------------------------ persistence
    def _save_pretrained(self, save_directory: Path) -> None:
        """``config.json``, ``model.safetensors``, ``card.json`` and the generated ``README.md``
        (what :meth:`save_pretrained` and :meth:`push_to_hub` of the mixin call)."""
        from safetensors.torch import save_file

        if self.draft_vocab is not None:
            check_draft_vocab(self.draft_vocab, self.config.vocab_size)
        self.card.check_heads(self.num_heads)
        config = {FORMAT_KEY: FORMAT_VERSION, **self.config.to_dict()}
        (save_directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(save_directory / WEIGHTS_NAME), metadata={"format": "pt"})
        card = json.dumps(self.card.to_dict(), indent=2, sort_keys=True)
        (save_directory / CARD_NAME).write_text(card, encoding="utf-8")
        self.generate_model_card().save(save_directory / "README.md")

    def generate_model_card(self, *args: Any, **kwargs: Any) -> ModelCard:
        """The README of these heads (:func:`~entmtp_hf.heads.card.model_card`), as a ``ModelCard``."""
        nbytes = sum(t.numel() * t.element_size() for t in self.state_dict().values())
        return ModelCard(model_card(self.config, self.card, str(self._dtype).removeprefix("torch."), nbytes))

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        revision: str | None = None,
        *,
        base_config: Any = None,
        cache_dir: str | os.PathLike | None = None,
        token: str | bool | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
    ) -> "DraftHeads":
        """Load heads from a folder or Hub repo, in this project's or a published format.

        ``revision`` pins a Hub branch, tag or commit. The format and class are chosen from the
        checkpoint through the registries (:mod:`.registry`); calling it on a subclass
        additionally checks the family. ``base_config`` (the base model's config) is only needed
        for published prefix-mlp Hydra heads whose base model config cannot be fetched.
        """
        heads = load_from_source(
            pretrained_model_name_or_path,
            revision=revision,
            base_config=base_config,
            cache_dir=cache_dir,
            token=token,
            force_download=force_download,
            local_files_only=local_files_only,
        )
        if cls.family and not isinstance(heads, cls):
            raise HeadsMismatchError(
                f"{pretrained_model_name_or_path} holds {heads.family!r} heads, not {cls.family!r}"
            )
        return heads
