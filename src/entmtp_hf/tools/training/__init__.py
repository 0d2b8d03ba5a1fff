"""Training draft heads by distillation from the frozen base model (``entmtp-hf train-heads``).

Recipe (docs/training.md has the commands and the measured numbers):

1. **Data.** Token sequences from the self-distilled records of
   :mod:`entmtp_hf.tools.data.distill` (chat-templated prompt + the base model's greedy
   response; rows are supervised from the last prompt position on, where drafting starts) and
   real text from :mod:`entmtp_hf.tools.data.datasets` (GSM8K *train* question/answer chats,
   Python standard-library source). No evaluation text: no HumanEval, GSM8K test or
   MT-Bench; stdlib chunks sharing a 13-gram with an evaluation prompt are dropped.
   Documents go to a held-out split by a hash of their id.
2. **Teacher cache.** One pass of the base model writes every position's last hidden state
   h_t (after the final norm, so ``lm_head(h_t)`` are the logits) as float16 and its greedy
   token argmax(logits_t) into memmaps under ``WORK/data`` (resumable, by batch).
3. **Drafting vocabulary.** The K most frequent greedy tokens of the training split.
4. **Loss.** Head i at row t drafts token t+i+2, so its teacher is the base distribution at
   position t+i+1: p_i,t = softmax(W' h_{t+i+1}) with W' the base LM head rows of the
   drafting vocabulary (the full distribution renormalised over it). Loss per head is
   KL(p || q) averaged over supervised rows (+ ``ce_weight`` x CE on argmax p); heads are
   weighted ``head_decay**i``.
5. **Training** with :class:`accelerate.Accelerator` (the same code runs under
   ``accelerate launch``): AdamW, warm-up + cosine/linear decay, gradient clipping,
   checkpoints (heads, optimiser, scheduler, data cursor, RNG) every ``save_every`` steps.
   ``--resume`` continues from the newest checkpoint; an epoch's batch order is a pure
   function of (seed, epoch), so a resumed run is identical to an uninterrupted one.

The data set is a snapshot taken when ``WORK/data`` is first built (the distilled files and
their line counts are listed in ``WORK/data/manifest.json``); to train on newer distilled
records, point ``--work-dir`` at a fresh folder.

Modules: :mod:`.config` (:class:`TrainConfig`, shared constants), :mod:`.teacher` (data, teacher
cache, drafting vocabulary), :mod:`.objective` (loss, validation, tau), :mod:`.loop` (training,
checkpoints, finalising), :mod:`.card` (the heads' card), :mod:`.cli` (``train-heads`` command),
:mod:`.mtp_layout` (MTP layers: new ones for a model, and the native transformers layout they are saved in).
Every public name is re-exported here.
"""

from __future__ import annotations

from .card import heads_card
from .cli import add_subcommand
from .config import DEMO_HUB_ID, SOURCES, SPLIT_TRAIN, SPLIT_VAL, TrainConfig
from .loop import (
    Cursor,
    RunLog,
    checkpoints,
    finalize,
    half_copy,
    init_heads_from,
    load_checkpoint,
    lr_factor,
    save_checkpoint,
    total_steps,
    train_heads,
    used_data,
    warm_start,
)
from .mtp_layout import load_mtp_checkpoint, mtp_drafter, new_mtp_heads, write_mtp_checkpoint
from .objective import (
    HeadsObjective,
    distill_loss,
    evaluate_heads,
    head_targets,
    measure_tau,
    tau_prompts,
    teacher_logprobs,
)
from .teacher import (
    TeacherCache,
    TokenSeq,
    build_sequences,
    copy_rows,
    coverage,
    cut,
    draft_vocabulary,
    epoch_batches,
    extract_hidden,
    extraction_order,
    held_out,
    open_cache,
    pack,
    prepare_teacher_cache,
    read_distill,
    supervised_tokens,
    system_prefix_len,
)

__all__ = [
    "Cursor",
    "DEMO_HUB_ID",
    "HeadsObjective",
    "RunLog",
    "SOURCES",
    "SPLIT_TRAIN",
    "SPLIT_VAL",
    "TeacherCache",
    "TokenSeq",
    "TrainConfig",
    "add_subcommand",
    "build_sequences",
    "checkpoints",
    "copy_rows",
    "coverage",
    "cut",
    "distill_loss",
    "draft_vocabulary",
    "epoch_batches",
    "evaluate_heads",
    "extract_hidden",
    "extraction_order",
    "finalize",
    "half_copy",
    "head_targets",
    "heads_card",
    "held_out",
    "open_cache",
    "init_heads_from",
    "load_checkpoint",
    "lr_factor",
    "load_mtp_checkpoint",
    "measure_tau",
    "mtp_drafter",
    "new_mtp_heads",
    "pack",
    "prepare_teacher_cache",
    "read_distill",
    "save_checkpoint",
    "supervised_tokens",
    "system_prefix_len",
    "tau_prompts",
    "teacher_logprobs",
    "total_steps",
    "train_heads",
    "used_data",
    "warm_start",
    "write_mtp_checkpoint",
]
