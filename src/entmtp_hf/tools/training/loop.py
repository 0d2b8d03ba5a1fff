"""The training run itself: warm start, learning-rate schedule, the :mod:`accelerate`
loop with exact resume (checkpoints of heads, optimiser, scheduler, data cursor and RNG),
and finalising (shipped half-precision heads, validation, tau, summary, the heads' card).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ...heads import HEADS_REGISTRY, DraftHeads
from .. import require
from ..models import base_model_id
from .card import heads_card
from .config import SOURCES, SPLIT_TRAIN, SPLIT_VAL, TrainConfig
from .objective import HeadsObjective, evaluate_heads, measure_tau, tau_prompts
from .teacher import (
    TeacherCache,
    _write_json,
    coverage,
    draft_vocabulary,
    epoch_batches,
    prepare_teacher_cache,
    supervised_tokens,
)


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine or linear decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return min_ratio + (1 - min_ratio) * decay


@torch.no_grad()
def warm_start(heads: DraftHeads, hidden_rms: float = 1.0) -> DraftHeads:
    """Start every head as "base LM head on c_t": zero block linears, identity on the c_t slice
    of Hydra's first-block projection; a prefix layer starts as (scaled) identity. An EAGLE
    drafter starts as the identity on the feature (``fc`` passes f_j through, every layer's
    output projections are zero), so it first predicts what the base model's own head would;
    an EAGLE-3 one as the base LM head on the highest of its fused states; MTP layers as the base LM
    head on their input state."""
    h = heads.config.hidden_size
    fc = getattr(heads, "fc", None)
    if isinstance(fc, nn.Linear) and fc.in_features == 2 * h:  # EAGLE-1/2: fc(cat(E(x), f))
        fc.weight[:, h:] = torch.eye(h, dtype=fc.weight.dtype, device=fc.weight.device)
        fc.weight[:, :h].mul_(0.1)
        fc.bias.zero_()
    elif isinstance(fc, nn.Linear) and fc.in_features == 3 * h:  # EAGLE-3: fc(cat(low, mid, high))
        fc.weight.zero_()  # the highest fused state passes through: a logit lens a few layers below the top
        fc.weight[:, 2 * h :] = torch.eye(h, dtype=fc.weight.dtype, device=fc.weight.device)
    for name, p in heads.named_parameters():
        if name.startswith("layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            p.zero_()
    for blocks in heads.mlps:
        for block in blocks:
            nn.init.zeros_(block.linear.weight)
            nn.init.zeros_(block.linear.bias)
            res = block.res_connection
            if isinstance(res, nn.Linear):
                res.weight.zero_()
                res.weight[:, :h] = torch.eye(h, dtype=res.weight.dtype, device=res.weight.device)
                res.bias.zero_()
    if heads.family == "mtp":
        from .mtp_layout import warm_start_mtp

        warm_start_mtp(heads, hidden_rms)
    prefix = getattr(heads, "prefix_embeding_layer", None)
    if prefix is not None:
        layer = prefix.layers[0]
        for name, p in layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        prefix.norm.weight.fill_(hidden_rms)
    return heads


class RunLog:
    """Timestamped lines to stdout and ``path`` (main process only)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}"
        print(line, flush=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@dataclass
class Cursor:
    """Where a run stands: optimiser steps done, epoch, next batch index in that epoch."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0


def checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))


def save_checkpoint(
    run: Path, cursor: Cursor, heads: DraftHeads, optimizer, scheduler, cfg: TrainConfig, metrics: dict | None = None
) -> Path:
    """Atomically write heads (float32) + optimiser + scheduler + RNG + cursor; keep the newest few."""
    from safetensors.torch import save_file

    final = run / "checkpoints" / f"step-{cursor.step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}, str(tmp / "heads.safetensors"))
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()},
        tmp / "trainer.pt",
    )
    _write_json(tmp / "state.json", {"cursor": asdict(cursor), "config": asdict(cfg), "metrics": metrics or {}})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoints(run)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, heads: DraftHeads, optimizer, scheduler, cfg: TrainConfig) -> Cursor:
    """Restore what :func:`save_checkpoint` wrote; refuses a checkpoint of different heads."""
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    old = state["config"]
    for key in ("family", "arch", "num_heads", "num_layers", "draft_vocab_size", "seed", "batch_tokens"):
        if old[key] != getattr(cfg, key):
            raise ValueError(f"{path}: checkpoint has {key}={old[key]!r}, this run {getattr(cfg, key)!r}")
    heads.load_state_dict(load_file(str(path / "heads.safetensors")))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["torch_rng"])
    return Cursor(**state["cursor"])


class _Batches(torch.utils.data.Dataset):
    """Item j is the collated batch ``batches[j]`` of the cache (a DataLoader of batch size 1)."""

    def __init__(self, cache: TeacherCache, batches: list[list[int]], layers: tuple[int, ...]):
        self.cache, self.batches, self.layers = cache, batches, layers

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, j: int) -> dict[str, Tensor]:
        return self.cache.batch(self.batches[j], self.layers)


def _first(items: list) -> Any:
    return items[0]


def total_steps(cfg: TrainConfig, cache: TeacherCache, num_processes: int) -> int:
    ks, lengths = cache.split(SPLIT_TRAIN), cache.seqs[:, 1]
    n = sum(len(epoch_batches(ks, lengths, cfg.batch_tokens, cfg.seed, e)) // num_processes for e in range(cfg.epochs))
    return min(n, cfg.max_steps) if cfg.max_steps else n


def _teacher_cache(
    cfg: TrainConfig,
    acc,
    model,
    tokenizer,
    cache: TeacherCache | None,
    log: RunLog,
    run: Path,
    resume: bool,
    extract: bool,
) -> TeacherCache:
    """The teacher cache this run trains on: built and filled once (main process), then the
    sequences fixed at the run's start (kept on resume)."""
    if cache is None:
        if acc.is_main_process:
            prepare_teacher_cache(model, tokenizer, cfg, log, extract=extract)
        acc.wait_for_everyone()
        cache = TeacherCache(Path(cfg.work_dir) / "data")
    snapshot = run / "sequences.npy"
    if resume and snapshot.exists():
        cache.restrict(np.load(snapshot))
    elif acc.is_main_process:
        np.save(snapshot, np.nonzero(cache.ready)[0])
    return cache


def uses_base_lm_head(arch: str) -> bool:
    """Whether heads of ``arch`` project through the base model's LM head rather than their own. An
    EAGLE-3 drafter carries its own LM head over the drafting vocabulary, as EAGLE-3 trains it and as
    the engines load it (``export-heads --to eagle3``); the other archs share the base one."""
    return arch != "eagle3"


def _initial_heads(cfg: TrainConfig, model, cache: TeacherCache) -> tuple[DraftHeads, Tensor | None]:
    """The heads training starts from (``--init-from`` heads or MTP model folder, or a warm start) and the
    drafting vocabulary: chosen from this data unless kept from the ``--init-from`` heads. MTP layers train over
    the whole vocabulary (as ``generate(use_mtp=True)`` drafts); their drafting vocabulary, if any, is
    saved beside them for EntMTP."""
    vocab_size = model.config.get_text_config().vocab_size
    dv = None
    if not (cfg.init_from and cfg.init_vocab == "heads") and cfg.draft_vocab_size:
        dv = draft_vocabulary(supervised_tokens(cache, SPLIT_TRAIN), cfg.draft_vocab_size, vocab_size)
    if cfg.mtp:
        from .mtp_layout import new_mtp_heads

        torch.manual_seed(cfg.seed)  # transformers' initialisation of the new layers
        heads = new_mtp_heads(model, cfg.num_layers, cfg.num_heads).float()
        if cfg.init_from:  # continue training the layers of an earlier run's model folder
            from .mtp_layout import load_trained_layers

            kept = load_trained_layers(heads, cfg.init_from)
            if cfg.init_vocab == "heads":
                if len(kept or ()) != cfg.draft_vocab_size:
                    raise ValueError(
                        f"--init-from {cfg.init_from}: its drafting vocabulary has {len(kept or ())} rows (0: the "
                        f"whole vocabulary), this run asks for {cfg.draft_vocab_size} (--draft-vocab-size): pass "
                        f"{len(kept or ())}, or --init-vocab data to choose it anew"
                    )
                dv = None if kept is None else torch.tensor(kept, dtype=torch.long)
    elif cfg.init_from:  # continue training given heads on this data
        heads = init_heads_from(cfg, model)
        if dv is not None:  # --init-vocab data: the weights do not depend on the vocabulary
            heads.draft_vocab.copy_(dv)
        dv = heads.draft_vocab.cpu()
    else:
        torch.manual_seed(cfg.seed)  # the random part of the initialisation (prefix layer)
        heads = (
            HEADS_REGISTRY[cfg.family]
            .for_model(
                model,
                cfg.num_heads,
                cfg.num_layers,
                cfg.arch,
                dv,
                use_base_lm_head=uses_base_lm_head(cfg.arch),
                feature_layers=cfg.heads_feature_layers(_base(model)),
            )
            .float()
        )
        if not uses_base_lm_head(cfg.arch):  # its own LM head starts as the base rows of its vocabulary
            with torch.no_grad():
                heads.lm_head.weight.copy_(heads._base_lm_rows(model)[0])
    if not cfg.init_from:
        k = cache.split(SPLIT_TRAIN)[:50]
        sample = np.concatenate([cache.hidden[o : o + n] for o, n in cache.seqs[k, :2]]).astype(np.float32)
        warm_start(heads, float(np.sqrt((sample**2).mean(-1)).mean()))
    heads.config.base_model_name_or_path = base_model_id(cfg.model)
    return heads, dv


@dataclass
class _Trainer:
    """What the optimisation loop of one run works on (all prepared by :mod:`accelerate`)."""

    cfg: TrainConfig
    acc: Any
    model: Any
    cache: TeacherCache
    objective: Any
    optimizer: Any
    scheduler: Any
    heads: DraftHeads  # the unwrapped heads (checkpoints, evaluation)
    run: Path
    log: RunLog
    total: int

    def __post_init__(self) -> None:
        self._params = [p for p in self.objective.parameters() if p.requires_grad]

    def fit(self, cursor: Cursor, deadline: float | None, stop_after: int | None, progress: bool = True) -> list[float]:
        """Optimise from ``cursor`` to ``total`` steps (or the deadline / step budget), epoch by
        epoch; checkpoints every ``save_every`` steps and when stopping. Returns the losses."""
        from tqdm.auto import tqdm

        cfg, acc = self.cfg, self.acc
        ks, lengths = self.cache.split(SPLIT_TRAIN), self.cache.seqs[:, 1]
        bar = tqdm(
            total=self.total, initial=cursor.step, disable=not (progress and acc.is_main_process), desc=cfg.run_name
        )
        first_step, losses, stopped = cursor.step, [], False
        while cursor.step < self.total and not stopped:
            batches = epoch_batches(ks, lengths, cfg.batch_tokens, cfg.seed, cursor.epoch)
            usable = len(batches) // acc.num_processes * acc.num_processes
            loader = acc.prepare_data_loader(
                torch.utils.data.DataLoader(
                    _Batches(self.cache, batches[cursor.batch : usable], self.heads.feature_layers),
                    batch_size=1,
                    collate_fn=_first,
                )
            )
            t0 = time.perf_counter()
            for b in loader:
                loss, per_head = self._step(b)
                now = time.perf_counter()
                cursor.step, cursor.batch = cursor.step + 1, cursor.batch + acc.num_processes
                cursor.train_tokens += int(b["valid"].sum()) * acc.num_processes
                cursor.train_seconds, t0 = cursor.train_seconds + now - t0, now
                losses.append(round(loss, 5))
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                self._report(cursor, loss, per_head)
                out_of_time = (deadline is not None and now > deadline) or cursor.step - first_step == stop_after
                if cursor.step % cfg.save_every == 0 or cursor.step >= self.total or out_of_time:
                    self._checkpoint(cursor)
                if cursor.step >= self.total:
                    break
                if out_of_time:
                    self.log(f"stopping at step {cursor.step} of {self.total} (time/step budget): checkpoint saved")
                    stopped = True
                    break
            else:
                cursor.epoch, cursor.batch = cursor.epoch + 1, 0
        bar.close()
        return losses

    def _step(self, batch: dict[str, Tensor]) -> tuple[float, list[float]]:
        loss, per_head = self.objective(**batch)
        self.acc.backward(loss)
        if self.cfg.grad_clip:
            self.acc.clip_grad_norm_(self._params, self.cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), per_head

    def _report(self, cursor: Cursor, loss: float, per_head: list[float]) -> None:
        if cursor.step % 10 == 0:
            self.log(
                f"step {cursor.step}/{self.total} epoch {cursor.epoch} loss {loss:.4f} heads "
                f"{[round(x, 3) for x in per_head]} lr {self.scheduler.get_last_lr()[0]:.2e} "
                f"{cursor.train_tokens / max(cursor.train_seconds, 1e-9):.0f} tok/s"
            )
        if self.cfg.eval_every and cursor.step % self.cfg.eval_every == 0 and self.acc.is_main_process:
            metrics = evaluate_heads(self.heads, *_base_io(self.model), self.cache)
            self.log(f"eval step {cursor.step}: {json.dumps(metrics)}")

    def _checkpoint(self, cursor: Cursor) -> None:
        if self.acc.is_main_process:
            save_checkpoint(self.run, cursor, self.heads, self.optimizer, self.scheduler, self.cfg)
        self.acc.wait_for_everyone()


def train_heads(
    cfg: TrainConfig,
    model=None,
    tokenizer=None,
    *,
    resume: bool = False,
    cache: TeacherCache | None = None,
    max_minutes: float | None = None,
    stop_after: int | None = None,
    measure: bool = True,
    command: str | None = None,
    accelerator=None,
    extract: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume) one set of heads; writes checkpoints under ``WORK/RUN`` and the final
    heads to ``cfg.output`` (default ``WORK/RUN/final``). Returns the run summary.

    ``max_minutes`` / ``stop_after`` (steps in this call) end the call early with a checkpoint
    (and final heads from the current weights); ``resume=True`` later continues the schedule.
    ``progress=False``: no progress bar (the log file still records every step's figures).
    """
    accelerate = require("accelerate", extra="train")
    acc = accelerator or accelerate.Accelerator(mixed_precision=cfg.mixed_precision)
    run = Path(cfg.work_dir) / cfg.run_name
    run.mkdir(parents=True, exist_ok=True)
    log = RunLog(run / "train.log", acc.is_main_process)
    started = time.perf_counter()
    if model is None:
        from ..models import load_base_model

        model, tokenizer = load_base_model(cfg.model)
    model.to(acc.device).eval().requires_grad_(False)
    cache = _teacher_cache(cfg, acc, model, tokenizer, cache, log, run, resume, extract)
    heads, dv = _initial_heads(cfg, model, cache)
    cov = coverage(dv, supervised_tokens(cache, SPLIT_VAL)) if dv is not None else 1.0
    objective = HeadsObjective(
        heads, model.get_input_embeddings(), model.get_output_embeddings(), cfg.ce_weight, cfg.head_decay
    )
    optimizer = torch.optim.AdamW(param_groups(heads, cfg), weight_decay=cfg.weight_decay)
    total = total_steps(cfg, cache, acc.num_processes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio)
    )
    cursor = Cursor()
    found = checkpoints(run) if resume else []
    if found:
        cursor = load_checkpoint(found[-1], heads, optimizer, scheduler, cfg)
        if heads.draft_vocab is not None and not torch.equal(heads.draft_vocab.cpu(), dv):
            raise ValueError(f"{found[-1]}: drafting vocabulary differs from this data's; wrong --work-dir?")
        log(f"resumed from {found[-1].name}: step {cursor.step}, epoch {cursor.epoch}, batch {cursor.batch}")
    elif resume:
        log("no checkpoint found: starting from scratch")
    objective, optimizer = acc.prepare(objective, optimizer)
    unwrapped = acc.unwrap_model(objective).heads
    log(
        f"{cfg.family}/{cfg.arch}: {sum(p.numel() for p in heads.parameters()) / 1e6:.2f}M parameters, "
        f"draft vocab {len(dv) if dv is not None else 'all'} (held-out greedy coverage {cov:.4f}), {total} steps, "
        f"{len(cache.split(SPLIT_TRAIN))} train / {len(cache.split(SPLIT_VAL))} val sequences"
    )
    trainer = _Trainer(cfg, acc, model, cache, objective, optimizer, scheduler, unwrapped, run, log, total)
    losses = trainer.fit(cursor, started + 60 * max_minutes if max_minutes else None, stop_after, progress)
    saved = checkpoints(run)
    if cursor.step > 0 and (not saved or saved[-1].name != f"step-{cursor.step:07d}") and acc.is_main_process:
        save_checkpoint(run, cursor, unwrapped, optimizer, scheduler, cfg)
    summary: dict[str, Any] = {}
    if acc.is_main_process:
        summary = finalize(
            cfg,
            model,
            tokenizer,
            unwrapped,
            cache,
            cursor,
            total,
            cov,
            run,
            log,
            measure=measure,
            command=command,
            dv=dv,
        )
        summary["loss_curve"] = losses
    acc.wait_for_everyone()
    return summary


def param_groups(heads: DraftHeads, cfg: TrainConfig) -> list[dict[str, Any]]:
    """The optimiser's groups: everything at ``lr``; with ``fuse_lr``, an EAGLE drafter's ``fuse``
    projection and its norms (new when ``--feature-layers`` extends trained heads) at that rate."""
    rest, fuse = [], []
    for name, p in heads.named_parameters():
        (fuse if cfg.fuse_lr and name.startswith("fuse") else rest).append(p)
    return [{"params": rest, "lr": cfg.lr}] + ([{"params": fuse, "lr": cfg.fuse_lr}] if fuse else [])


def init_heads_from(cfg: TrainConfig, model) -> DraftHeads:
    """Heads loaded from ``cfg.init_from`` (float32, on the model's device), checked against ``cfg``;
    fewer heads than ``cfg.num_heads`` are extended by :func:`extend_heads`, and an EAGLE-1 drafter
    reading the last state alone by ``--feature-layers`` (its ``fuse`` starting at zero)."""
    heads = DraftHeads.from_pretrained(cfg.init_from).float()
    c = heads.config
    got = (c.family, c.head_arch, c.num_layers, c.draft_vocab_size, c.use_base_lm_head)
    want = (cfg.family, cfg.arch, cfg.num_layers, cfg.draft_vocab_size, uses_base_lm_head(cfg.arch))
    fused = cfg.heads_feature_layers(_base(model))
    given = c.feature_layers if c.head_arch in ("eagle", "eagle3") else None
    if got != want or c.num_heads > cfg.num_heads or (given is not None and given != fused):
        raise ValueError(
            f"--init-from {cfg.init_from}: heads are {got} with {c.num_heads} heads and feature layers "
            f"{given}, this run wants {want} with {cfg.num_heads} and {fused} (family, arch, layers, "
            "draft vocab size, base LM head; as many heads or fewer; feature layers added, not changed)"
        )
    heads = heads.to(next(model.parameters()).device)
    if cfg.feature_layers and given is None:
        wider = (
            type(heads)
            .for_model(
                model,
                c.num_heads,
                cfg.num_layers,
                cfg.arch,
                heads.draft_vocab.cpu(),
                use_base_lm_head=c.use_base_lm_head,
                feature_layers=fused,
            )
            .float()
        )
        missing, unexpected = wider.load_state_dict(heads.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("fuse") for k in missing), (missing, unexpected)
        heads = wider
    if c.num_heads < cfg.num_heads:
        more = (
            type(heads)
            .for_model(
                model,
                cfg.num_heads,
                cfg.num_layers,
                cfg.arch,
                heads.draft_vocab.cpu(),
                use_base_lm_head=c.use_base_lm_head,
                feature_layers=fused,
            )
            .float()
        )
        heads = extend_heads(heads, more)
    return heads


@torch.no_grad()
def extend_heads(given: DraftHeads, more: DraftHeads) -> DraftHeads:
    """``more`` (same kind, more heads) with ``given``'s weights, and each extra head started as a
    copy of the last given head: deeper heads predict further ahead from the same signals.

    A Hydra head's first block reads the hidden state and the embeddings of the tokens drafted
    so far, one more per head; the copy keeps the hidden-state slice and puts the last head's
    embedding slices on the most recent tokens (the older ones start at zero)."""
    n, h = given.num_heads, given.config.hidden_size
    state = more.state_dict()
    src = given.state_dict()
    for key, value in src.items():  # shared parts and the given heads, unchanged
        state[key] = value.clone()
    last = f"mlps.{n - 1}."
    for j in range(n, more.num_heads):
        for key, value in src.items():
            if not key.startswith(last):
                continue
            target = f"mlps.{j}." + key[len(last) :]
            if value.shape == state[target].shape:
                state[target] = value.clone()
            else:  # block 0: columns [hidden, emb_1..emb_n] -> [hidden, 0.., the most recent n embeddings]
                out = torch.zeros_like(state[target])
                out[:, :h], out[:, out.shape[1] - (value.shape[1] - h) :] = value[:, :h], value[:, h:]
                state[target] = out
    more.load_state_dict(state)
    return more


def _base(model) -> Any:
    return model.config.get_text_config()


def _base_io(model) -> tuple[nn.Module, nn.Module]:
    return model.get_input_embeddings(), model.get_output_embeddings()


def half_copy(heads: DraftHeads, dtype: str) -> DraftHeads:
    """A copy of ``heads`` whose floating tensors are in ``dtype`` (ids stay integer)."""
    return copy.deepcopy(heads).to(getattr(torch, dtype))


def finalize(
    cfg: TrainConfig,
    model,
    tokenizer,
    heads: DraftHeads,
    cache: TeacherCache,
    cursor: Cursor,
    total: int,
    cov: float,
    run: Path,
    log,
    *,
    measure: bool = True,
    command: str | None = None,
    dv: Tensor | None = None,
) -> dict[str, Any]:
    """Validate, measure tau, save the shipped (half-precision) heads with their card. MTP layers ship
    as a model folder in transformers' native layout (:mod:`.mtp_layout`), validated as loaded from it;
    ``dv``: their drafting vocabulary saved beside them."""
    out = Path(cfg.output) if cfg.output else run / "final"
    shipping = half_copy(heads, cfg.save_dtype)
    # validate what ships, loaded back from disk as a user would (then run in float32)
    if cfg.mtp:
        from .mtp_layout import MTP_SHARD, save_trained_mtp

        judge, shipped, drafter = save_trained_mtp(model, shipping, out, run, dv)
        weights = out / MTP_SHARD
    else:
        shipping.save_pretrained(out)
        judge, shipped = model, DraftHeads.from_pretrained(out).float()
        drafter, weights = shipped, out / "model.safetensors"
    metrics = evaluate_heads(shipped, *_base_io(judge), cache)
    extract = json.loads((cache.root / "extract.json").read_text())
    summary = {
        "config": asdict(cfg),
        "command": command,
        "steps": cursor.step,
        "total_steps": total,
        "epochs_done": round(cursor.train_tokens / max(1, int(cache.seqs[cache.split(SPLIT_TRAIN), 1].sum())), 2),
        "train_tokens_seen": cursor.train_tokens,
        "train_seconds": round(cursor.train_seconds),
        "train_tokens_per_s": round(cursor.train_tokens / max(cursor.train_seconds, 1e-9), 1),
        "extract": extract,
        "data": used_data(cache),
        "draft_vocab_size": int(len(drafter.draft_vocab)) if drafter.draft_vocab is not None else 0,
        "draft_vocab_val_coverage": round(cov, 4),
        "validation": metrics,
        "validation_fp32_weights": evaluate_heads(heads, *_base_io(model), cache),
        "weights_bytes": os.path.getsize(weights),
    }
    if cfg.init_from and not cfg.mtp:
        summary["init_num_heads"] = DraftHeads.from_pretrained(cfg.init_from).num_heads
    if measure and cfg.tau_prompts > 0 and tokenizer is not None:
        prompts = tau_prompts(cache, tokenizer, cfg.tau_prompts, cfg.seed, cfg.val_fraction)
        summary["tau_mc_sim_7b_63"] = measure_tau(judge, drafter, prompts, cfg.tau_new_tokens)
    if cfg.mtp:
        from .card import mtp_readme

        (out / "README.md").write_text(mtp_readme(summary, shipping))
    else:
        shipping.card = heads_card(summary, shipping)  # the figures of what ships, measured above
        shipping.save_pretrained(out)
    _write_json(run / "summary.json", summary)
    log(f"final: {json.dumps({k: summary[k] for k in ('steps', 'validation', 'weights_bytes')})}")
    if "tau_mc_sim_7b_63" in summary:
        log(f"tau: {summary['tau_mc_sim_7b_63']}")
    log(f"heads written to {out}")
    return summary


def used_data(cache: TeacherCache) -> dict[str, dict[str, dict[str, int]]]:
    """Sequences and tokens actually trained / validated on, per source."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for split, name in ((SPLIT_TRAIN, "train"), (SPLIT_VAL, "val")):
        ks = cache.split(split)
        for i, src in enumerate(SOURCES):
            sel = ks[cache.seqs[ks, 4] == i]
            if len(sel):
                out.setdefault(src, {})[name] = {"sequences": len(sel), "tokens": int(cache.seqs[sel, 1].sum())}
    return out
