"""The model card of draft heads: what they are, how they were trained, how well they draft.

What a card says beyond the heads' shape (the training data and recipe, validation top-1
per head, tokens per step with named trees, the hardware) is a :class:`HeadsCard`, saved as
``card.json`` beside ``config.json``. It is kept out of the config on purpose: the config
rebuilds the heads and keys their cost tables, the card only describes them. Both survive
load -> save, and ``README.md`` (YAML front matter + text) is generated from them on every
save, so the figures and the text never disagree. Every field is checked by type, range and
length when a card is built or read.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Callable, Sequence

from huggingface_hub import ModelCardData

from ..errors import ConfigError
from ..hub import hub_repo_id
from ..validation import MAX_COUNT, brief_repr, integer, number, numbers_in, sequence
from .config import HeadsConfig
from .files import HeadsLoadError, read_json
from .registry import FAMILIES

CARD_NAME = "card.json"
CARD_VERSION = 1
MAX_CARD_BYTES = 2**18
#: characters of one text field (a recipe paragraph, a command line) and of a name
MAX_TEXT = 8192
MAX_NAME = 200
#: data sources and measurements one card lists
MAX_ENTRIES = 64
#: tokens per step: at least the verifier's own token, at most a whole tree's depth + 1
MAX_TOKENS_PER_STEP = 65.0
TAGS = ("entmtp-hf", "speculative-decoding", "draft-heads")


def _text(where: str, value: Any, limit: int = MAX_TEXT, required: bool = False) -> str:
    if not isinstance(value, str) or len(value) > limit or (required and not value.strip()):
        need = "a non-empty string" if required else "a string"
        raise ConfigError(where, f"must be {need} of at most {limit} characters, got {brief_repr(value)}")
    return value


def _count(where: str, value: Any) -> int | None:
    return None if value is None else integer(value, where, low=0, high=MAX_COUNT)


def _entries(where: str, value: Any, kind: type, build: Callable[[dict], Any]) -> tuple:
    """A tuple of ``kind`` from a sequence of ``kind`` objects or of dicts (as read from JSON)."""
    out = []
    for i, item in enumerate(sequence(value, where, of="entries", max_len=MAX_ENTRIES)):
        if isinstance(item, dict):
            item = _from_fields(f"{where}[{i}]", kind, item, build)
        if not isinstance(item, kind):
            raise ConfigError(
                f"{where}[{i}]", f"must be a {kind.__name__} or a dict of its fields, got {brief_repr(item)}"
            )
        out.append(item)
    return tuple(out)


def _from_fields(where: str, kind: type, data: dict, build: Callable[[dict], Any]) -> Any:
    unknown = sorted(map(str, set(data) - {f.name for f in fields(kind)}))
    if unknown:
        raise ConfigError(where, f"unknown fields {unknown}")
    missing = [f.name for f in fields(kind) if f.default is MISSING and f.name not in data]
    if missing:
        raise ConfigError(where, f"lacks the fields {missing}")
    return build(data)


@dataclass(frozen=True)
class DataSource:
    """One source of training text, and the tokens of it trained and validated on."""

    name: str
    train_tokens: int | None = None
    val_tokens: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        _text("HeadsCard.training_data.name", self.name, MAX_NAME, required=True)
        object.__setattr__(self, "train_tokens", _count("HeadsCard.training_data.train_tokens", self.train_tokens))
        object.__setattr__(self, "val_tokens", _count("HeadsCard.training_data.val_tokens", self.val_tokens))
        _text("HeadsCard.training_data.description", self.description)


@dataclass(frozen=True)
class TokensPerStep:
    """Mean tokens per decode step with one tree (accepted drafted tokens + the verifier's own)."""

    tree: str  # e.g. "mc_sim_7b_63", or a bank's tree: "smollm2-135m-cpu/chat static tree (4 nodes)"
    value: float
    prompts: int | None = None
    new_tokens: int | None = None  # per prompt
    note: str = ""  # how it was measured: acceptance rule, which prompts

    def __post_init__(self) -> None:
        _text("HeadsCard.tokens_per_step.tree", self.tree, MAX_NAME, required=True)
        object.__setattr__(
            self, "value", number(self.value, "HeadsCard.tokens_per_step.value", low=1.0, high=MAX_TOKENS_PER_STEP)
        )
        object.__setattr__(self, "prompts", _count("HeadsCard.tokens_per_step.prompts", self.prompts))
        object.__setattr__(self, "new_tokens", _count("HeadsCard.tokens_per_step.new_tokens", self.new_tokens))
        _text("HeadsCard.tokens_per_step.note", self.note, MAX_NAME)


@dataclass(frozen=True)
class HeadsCard:
    """What the model card of a set of heads reports; every field optional, empty when unknown.

    ``validation_top1[i]``: head i's held-out top-1 accuracy (its first drafting choice is the
    base model's own next-but-i token), one value per head; ``recipe``: how the heads were
    trained (Markdown); ``command``: the command that trained them; ``hardware``: the machine
    they were trained and measured on.
    """

    training_data: tuple[DataSource, ...] = ()
    recipe: str = ""
    command: str = ""
    validation_top1: tuple[float, ...] = ()
    tokens_per_step: tuple[TokensPerStep, ...] = ()
    hardware: str = ""

    def __post_init__(self) -> None:
        data = _entries("HeadsCard.training_data", self.training_data, DataSource, lambda d: DataSource(**d))
        taus = _entries("HeadsCard.tokens_per_step", self.tokens_per_step, TokensPerStep, lambda d: TokensPerStep(**d))
        top1 = numbers_in(self.validation_top1, "HeadsCard.validation_top1", low=0.0, high=1.0, max_len=MAX_ENTRIES)
        for name in ("recipe", "command", "hardware"):
            _text(f"HeadsCard.{name}", getattr(self, name))
        for name, value in (("training_data", data), ("tokens_per_step", taus), ("validation_top1", top1)):
            object.__setattr__(self, name, value)

    @property
    def empty(self) -> bool:
        return self == HeadsCard()

    def check_heads(self, num_heads: int) -> None:
        """Per-head figures must cover every head (or be absent)."""
        if self.validation_top1 and len(self.validation_top1) != num_heads:
            raise ConfigError(
                "HeadsCard.validation_top1", f"has {len(self.validation_top1)} values for {num_heads} heads"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: the version and the fields that are set (entries without empty values)."""
        out: dict[str, Any] = {"card_version": CARD_VERSION}
        for f in fields(self):
            value = getattr(self, f.name)
            if value in ((), ""):
                continue
            if f.name in ("training_data", "tokens_per_step"):
                value = [{k: v for k, v in asdict(e).items() if v not in (None, "")} for e in value]
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "HeadsCard":
        """Inverse of :meth:`to_dict`; unknown fields and other versions are refused."""
        if not isinstance(data, dict):
            raise ConfigError("HeadsCard", f"must be a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.pop("card_version", None)
        if version != CARD_VERSION:
            raise ConfigError("HeadsCard.card_version", f"must be {CARD_VERSION}, got {brief_repr(version)}")
        return _from_fields("HeadsCard", cls, data, lambda d: cls(**d))


def read_card(path: str, num_heads: int) -> HeadsCard:
    """The card in ``path`` (bounded JSON), checked against the heads; a problem names the file."""
    data = read_json(path, MAX_CARD_BYTES)
    try:
        card = HeadsCard.from_dict(data)
        card.check_heads(num_heads)
    except (ValueError, TypeError) as e:
        raise HeadsLoadError(path, str(e)) from e
    return card


# ------------------------------------------------------------------ the README
def _cell(value: object) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(_cell, row)) + " |" for row in rows] + [""]


def _about(config: HeadsConfig, dtype: str, nbytes: int) -> list[str]:
    base = config.base_model_name_or_path
    vocab = (
        f"a {config.draft_vocab_size}-token drafting vocabulary" if config.draft_vocab_size else "the full vocabulary"
    )
    lm = "the base model's own LM head rows" if config.use_base_lm_head else "an LM head of their own each"
    stored = f"{dtype} ({nbytes / 1e6:.1f} MB)"
    title, what = FAMILIES[config.family].heads_class.card_summary(config, vocab, lm, stored)
    return [
        f"# {title}" + (f" for `{base}`" if base else ""),
        "",
        f"{what} They draft token trees for tree speculative decoding with "
        "[entmtp-hf](https://pypi.org/project/entmtp-hf/); the base model verifies every drafted token, so greedy "
        "output is the base model's own.",
        "",
        "## Usage",
        "",
        "```python",
        "from entmtp_hf import MC_SIM_7B_63, EntMTPConfig, enable_entmtp",
        'enable_entmtp(model, "<this repo id or folder>")   # model: the base model, loaded with transformers',
        "out = model.generate(**inputs, max_new_tokens=128, entmtp_config=EntMTPConfig(tree=MC_SIM_7B_63))",
        "```",
        "",
    ]


def _training(card: HeadsCard) -> list[str]:
    lines = ["## Training", ""] if card.training_data or card.recipe or card.command else []
    if card.training_data:
        rows = [(d.name, d.train_tokens, d.val_tokens, d.description) for d in card.training_data]
        lines += ["Data (tokens):", "", *_table(["source", "train", "validation", "what"], rows)]
    if card.recipe:
        lines += [card.recipe, ""]
    if card.command:
        lines += ["Command:", "", "```", card.command, "```", ""]
    return lines


def _figures(card: HeadsCard) -> list[str]:
    lines = []
    if card.validation_top1:
        rows = [(i, f"t+{i + 2}", round(x, 3)) for i, x in enumerate(card.validation_top1)]
        lines += [
            "## Validation",
            "",
            "Top-1 accuracy per head on held-out text (teacher-forced: the head's first "
            "choice is the base model's own token).",
            "",
            *_table(["head", "drafts", "top-1"], rows),
        ]
    if card.tokens_per_step:
        rows = [(t.tree, round(t.value, 3), t.prompts, t.new_tokens, t.note) for t in card.tokens_per_step]
        lines += [
            "## Tokens per step",
            "",
            "Mean tokens per decode step (accepted drafted tokens plus the verifier's own; plain decoding: 1).",
            "",
            *_table(["tree", "tokens per step", "prompts", "new tokens each", "measured"], rows),
        ]
    if card.hardware:
        lines += ["## Hardware", "", f"Trained and measured on: {card.hardware}.", ""]
    return lines


def model_card(config: HeadsConfig, card: HeadsCard, dtype: str, nbytes: int) -> str:
    """The README.md of a heads folder: YAML front matter, what the heads are, how to use them,
    and what ``card`` records (sections for unknown figures are left out)."""
    family_tags = [*TAGS, config.family]
    front = ModelCardData(
        library_name="entmtp-hf", base_model=hub_repo_id(config.base_model_name_or_path), tags=family_tags
    ).to_yaml()
    body = _about(config, dtype, nbytes) + _training(card) + _figures(card)
    if card.empty:
        body += ["No training record or measured figures were saved with these heads.", ""]
    return "\n".join(["---", front, "---", "", *body])
