"""``entmtp-hf export-generate DIR``: a transformers ``custom_generate`` repo for EntMTP.

The folder holds what transformers loads (``custom_generate/generate.py`` and
``custom_generate/requirements.txt``) and a ``README.md`` with the sections the transformers
documentation asks of such a repo. ``generate.py`` only bakes in the defaults given here and
calls :func:`entmtp_hf.custom_generate.entmtp_generate`; upload the folder as a Hub repo
(``huggingface_hub.upload_folder``) or use it where it is:
``model.generate(custom_generate="DIR", trust_remote_code=True)``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .. import __version__
from ..banks.bank import TopologyBank, check_task_name
from ..heads import DraftHeads
from ..hub import hub_repo_id

GENERATE_PY = '''"""EntMTP tree speculative decoding as a transformers ``custom_generate`` method.

Written by ``entmtp-hf export-generate`` (see README.md):
``model.generate(custom_generate=<this repo or folder>, trust_remote_code=True, ...)`` calls
:func:`generate`.
"""

from entmtp_hf.custom_generate import entmtp_generate

#: the defaults baked in when this folder was exported (None: not set)
HEADS = {heads!r}
BANK = {bank!r}
TASK = {task!r}


def generate(model, *args, entmtp_heads=HEADS, entmtp_bank=BANK, entmtp_task=TASK, entmtp_config=None, **kwargs):
    """Generate with EntMTP: ``entmtp_heads`` attached to ``model`` (it keeps them), decoding with
    ``entmtp_config`` if given, else the bank's task, else the ``mc_sim_7b_63`` tree."""
    return entmtp_generate(model, *args, heads=entmtp_heads, bank=entmtp_bank, task=entmtp_task,
                           config=entmtp_config, **kwargs)
'''

README = """---
library_name: transformers
tags:
- custom_generate
- entmtp-hf
- speculative-decoding
{base_yaml}---

# EntMTP tree speculative decoding

## Description

Tree speculative decoding with Hydra or Medusa draft heads
([entmtp-hf](https://pypi.org/project/entmtp-hf/)): each step the heads draft a token tree, the
base model verifies all of it in one forward pass, and the longest agreeing path is kept.
Greedy output is token for token that of plain `generate`; sampling (`do_sample=True`, exact
acceptance) draws from the same distribution. Defaults of this repo: heads {heads}; {trees}.{local}

## Base model

{base}

## Model compatibility

Decoder-only transformers models whose forward takes a 4D float attention mask and
`position_ids` (tested: Llama, Qwen2, Mistral, Gemma), in float32, bfloat16 or float16, with
draft heads that fit them (vocabulary, hidden size; checked before decoding), sliding-window and
hybrid attention included; one prompt or a left-padded batch. Every `generate` option works as
in plain `generate` or is refused before any compute (beam search, contrastive search, DoLa,
classifier-free guidance, other speculative decoders, `inputs_embeds`, ...): the entmtp-hf
usage docs list each field of `GenerationConfig`.

## Additional arguments

| argument | default | meaning |
|---|---|---|
| `entmtp_heads` | {heads} | draft heads: a folder, a Hub repo id or a `DraftHeads`; `None`: the heads the model carries |
| `entmtp_bank` | {bank} | a topology bank (folder or Hub repo id) to take the trees and their scheduler from |
| `entmtp_task` | {task} | the bank's task, e.g. `gsm8k` |
| `entmtp_config` | `None` | an `entmtp_hf.EntMTPConfig` (trees, policy, acceptance, `typical_rule`, ...), used instead of the bank and task |
| `entmtp_observers` | `()` | objects told about every decode step (`entmtp_hf.PhaseTimer`, ...) |

Every other argument is `generate`'s own.

## Output type changes

None: token ids as from `generate`; with `return_dict_in_generate=True` an
`EntMTPGenerateOutput`, a `GenerateDecoderOnlyOutput` with `entmtp_stats` (tokens per step,
tree sizes, timings). The model keeps the heads after the call (`model.entmtp_heads`);
`entmtp_hf.disable_entmtp(model)` removes them.

## Example usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained({example_model})
tokenizer = AutoTokenizer.from_pretrained({example_model})
inputs = tokenizer.apply_chat_template([{{"role": "user", "content": "What is 17 * 23?"}}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
out = model.generate(**inputs, max_new_tokens=128, custom_generate="<this repo id or folder>", trust_remote_code=True)
```

Requires `pip install entmtp-hf` (`custom_generate/requirements.txt`).
"""


def _local(source: str | None) -> str | None:
    """A local folder as an absolute path (so the method finds it from any working folder)."""
    return os.path.abspath(source) if source is not None and os.path.isdir(source) else source


def _code(value: str | None) -> str:
    return "`None`" if value is None else f"`{value}`"


def _readme(heads: str | None, bank: str | None, task: str | None, base_model: str | None) -> str:
    trees = f"the bank {_code(bank)}, task {_code(task)}" if bank else "the published default tree `mc_sim_7b_63`"
    local = [name for name in (heads, bank) if name is not None and os.path.isabs(name)]
    note = (
        f" The local folders {', '.join(map(_code, local))} work on this machine only: export with Hub repo ids "
        "to share this repo."
        if local
        else ""
    )
    base = (
        f"`{base_model}`, the model the heads were trained for; another model needs its own heads."
        if base_model
        else "The model the draft heads were trained for; another model needs its own heads."
    )
    return README.format(
        base_yaml=f"base_model: {base_model}\n" if base_model else "",
        heads=_code(heads),
        bank=_code(bank),
        task=_code(task),
        trees=trees,
        local=note,
        base=base,
        example_model=repr(base_model or "<base model>"),
    )


def _base_model(heads: str | None) -> str | None:
    """The base model named by local heads (read, and so validated, now); None when not known here."""
    if heads is None or not os.path.isdir(heads):
        return None
    return hub_repo_id(DraftHeads.from_pretrained(heads).config.base_model_name_or_path)


def export_generate(
    folder: str | os.PathLike, *, heads: str | None = None, bank: str | None = None, task: str | None = None
) -> Path:
    """Write the ``custom_generate`` repo into ``folder`` (created if needed); returns the generate.py path.

    ``heads``, ``bank`` (with its ``task``): folders or Hub repo ids baked in as the method's
    defaults; local ones are checked (heads loaded, the bank's task read) and written absolute.
    """
    if (bank is None) != (task is None):
        raise ValueError("--bank and --task go together: a bank holds one file per task")
    if task is not None:
        check_task_name(task)
    heads, bank = _local(heads), _local(bank)
    if bank is not None and os.path.isdir(bank):
        TopologyBank.from_pretrained(bank, task=task)
    base_model = _base_model(heads)
    code = Path(folder) / "custom_generate"
    code.mkdir(parents=True, exist_ok=True)
    (code / "generate.py").write_text(GENERATE_PY.format(heads=heads, bank=bank, task=task), encoding="utf-8")
    (code / "requirements.txt").write_text(f"entmtp-hf>={__version__}\n", encoding="utf-8")
    (Path(folder) / "README.md").write_text(_readme(heads, bank, task, base_model), encoding="utf-8")
    return code / "generate.py"


def _command(args: argparse.Namespace) -> int:
    path = export_generate(args.dir, heads=args.heads, bank=args.bank, task=args.task)
    print(
        f"wrote {path.parent.parent}: use it with model.generate(custom_generate={str(args.dir)!r}, "
        "trust_remote_code=True)"
    )
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export-generate",
        help="write a transformers custom_generate repo that decodes with EntMTP",
        description="Write DIR/custom_generate/generate.py, DIR/custom_generate/requirements.txt and DIR/README.md: "
        "a decoding method transformers loads with model.generate(custom_generate=DIR or its Hub repo id, "
        "trust_remote_code=True). HEADS, BANK and TASK become its defaults.",
    )
    p.add_argument("dir", help="output folder (the repo to upload, or to use locally)")
    p.add_argument("--heads", default=None, help="draft heads: a folder or Hub repo id")
    p.add_argument("--bank", default=None, help="a topology bank: a folder or Hub repo id (with --task)")
    p.add_argument("--task", default=None, help="the bank's task, e.g. gsm8k")
    p.set_defaults(func=_command)
