"""The cost probe: this machine's step costs for a model and its heads, measured in seconds.

It times the real pieces of a decode step on the loaded model (short, interleaved, medians),
through decoding's own session (:mod:`entmtp_hf.decoding.loop`), so what it times is what a
``generate`` call runs:

1. the verification forward of ``N`` nodes after a cached prefix, for a grid of sizes
   (:func:`~entmtp_hf.decoding.loop.trial_forward` on a prefilled session);
2. the heads drafting a few tree shapes (chains and fans) on their own: what each further node
   of a depth costs;
3. plain ``generate``'s time per step (the median interval between its steps) and three short
   EntMTP decodes (chains one and three deep, and a ten-node tree) at the table's batch size:
   drafting's fixed and per-depth parts and the rest of a step (acceptance, cache, the heads'
   conditioning) as a real step pays them. Timed on their own, the heads' calls run on warm
   caches and skip the conditioning on the accepted tokens: the EAGLE-style drafter's
   depth-one draft took 0.8 ms there against 4.6 ms inside decoding on the demo model.

A grid of forward medians is checked against itself (:func:`doubtful`): a size that costs less
than the size below it, or lies far off the line through its neighbours, is timed again with
more rounds, with its neighbours (:func:`settle`). The check only chooses where more rounds go;
the medians stay what was measured, so a real kink of the kernels holds.

The one-node forward and the plain step are timed again after everything else; where the two
timings of either disagree (:func:`steady`) something else was using the cores, so that part
(and only it) is measured again, in what is left of the time budget (:func:`retry_seconds`),
and a table whose timings never agreed says so in its notes.

The result is a :class:`~entmtp_hf.costs.table.CostTable` (see there for the model).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from transformers import GenerationConfig, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria

from ..config import EntMTPConfig
from ..costs.fingerprint import compiled_route, machine_fingerprint, model_key
from ..costs.table import CostTable
from ..decoding.loop import entmtp_decode, open_session, trial_forward
from ..decoding.session import DecodeSession
from ..decoding.stats import PhaseTimer
from ..trees.tree import Tree

log = logging.getLogger(__name__)

#: forward sizes measured (larger trees interpolate, or extrapolate from the last two)
PROBE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: at ``B`` rows, sizes above ``MAX_BATCH_NODES / B`` (at least the four smallest) are left to the
#: extrapolation: a forward of that many tokens is bound by its products, linear in the tokens
MAX_BATCH_NODES = 64
PREFIX_LEN = 256
#: tokens of the timed plain decode
DECODE_TOKENS = 24
#: tokens of each short EntMTP decode that splits a step's time, and of the plain decode timed
#: again to check the machine stayed steady: a mean over a dozen steps settles these parts well
#: enough, and the three decodes are the probe's longest stage (at 24 tokens a third of its time)
STEP_TOKENS = 12
#: plain decoding's timed prompts: its steps run at contexts centred on the forward's
#: ``PREFIX_LEN``, because a step's attention grows with its context (on the demo model on a
#: 2-core CPU a step at 256 cached tokens costs 6-9% more than at 112, the more rows the more)
PLAIN_PROMPT_LEN = PREFIX_LEN - DECODE_TOKENS // 2
#: prompts of the short EntMTP decodes that time drafting and the rest of a step
DECODE_PROMPT_LEN = 64
REPEATS = 3
#: how far a forward size's median may lie off the line through its two neighbours' medians (of
#: that line) before :func:`doubtful` doubts the three: a median of a few rounds on a busy machine
#: strays by tens of percent, an idle machine's by a few
OFF_LINE = 0.10
#: how much less than the size below it a size may cost before :func:`doubtful` doubts both: more
#: nodes are the same work and more, so a drop is a noisy median or a kink of the kernels
DROP = 0.01
#: rounds added to the doubted sizes per check (:func:`settle`), and the most checks of one grid
CHECK_ROUNDS = 4
CHECKS = 2
#: how far two timings of one thing may differ (of the smaller) for :func:`steady`: an idle
#: machine repeats them within a few percent, a busy one by tens of percent
STEADY = 0.25
#: seconds one batch size's measuring should stay under: a part measured again after the recheck
#: (:func:`retry_seconds`) runs only if it fits what is left
BUDGET_S = 30.0
#: where one pass alone takes longer than the budget (a large model), the retry may still add this
#: share of the pass
RETRY_SHARE = 0.1
#: the first forward grid's checks fit this share of the budget (:func:`retry_seconds`): plain
#: decoding, the short decodes and the recheck after the grid take most of a pass
CHECK_SHARE = 1 / 3
#: the two trees whose short decodes split a step's time (2 and 10 nodes)
OVERHEAD_TREES = (Tree.chain(1), Tree.chain(1).union(Tree.from_choices([[i] for i in range(8)])))

Tick = Callable[[str], None]


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _timings(
    runs: dict,
    repeats: int,
    sync: Callable[[], None],
    on_round: Callable[[], None] | None = None,
    *,
    warm_up: bool = True,
) -> dict[Any, list[float]]:
    """Seconds of each ``runs[key]()`` in ``repeats`` interleaved rounds, after a warm-up round
    unless ``warm_up`` is False (``on_round`` is called after each round: a progress bar's)."""
    times: dict = {k: [] for k in runs}
    for r in range(repeats + warm_up):
        for key, run in runs.items():
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if r or not warm_up:
                times[key].append(time.perf_counter() - t0)
        if on_round is not None:
            on_round()
    return times


def _medians(runs: dict, repeats: int, sync: Callable[[], None], on_round: Callable[[], None] | None = None) -> dict:
    """Median seconds of each ``runs[key]()`` (see :func:`_timings`)."""
    return {k: statistics.median(v) for k, v in _timings(runs, repeats, sync, on_round).items()}


def doubtful(medians: dict[int, float]) -> set[int]:
    """The forward sizes whose medians disagree with their neighbours': a size more than
    :data:`DROP` cheaper than the size below it (both doubted), or more than :data:`OFF_LINE` off
    the line through its two neighbours (the three doubted: any of them may be the stray one)."""
    sizes, out = sorted(medians), set()
    for lo, n in zip(sizes, sizes[1:]):
        if medians[n] < (1 - DROP) * medians[lo]:
            out |= {lo, n}
    for lo, n, hi in zip(sizes, sizes[1:], sizes[2:]):
        line = medians[lo] + (medians[hi] - medians[lo]) * (n - lo) / (hi - lo)
        if abs(medians[n] - line) > OFF_LINE * line:
            out |= {lo, n, hi}
    return out


def settle(
    samples: dict[int, list[float]],
    time_again: Callable[[set[int], int], dict[int, list[float]]],
    seconds_left: Callable[[], float] = lambda: float("inf"),
) -> set[int]:
    """Time the sizes :func:`doubtful` doubts again, :data:`CHECK_ROUNDS` more rounds each (their
    samples pooled), up to :data:`CHECKS` times, while a check's rounds fit ``seconds_left()``
    (``time_again(sizes, rounds)`` returns the new samples). ``samples`` grow in place; the sizes
    timed again are returned. Medians are never replaced by a fit: a kink that holds stays."""
    again: set[int] = set()
    for _ in range(CHECKS):
        medians = {n: statistics.median(v) for n, v in samples.items()}
        sizes = doubtful(medians)
        if not sizes or CHECK_ROUNDS * sum(medians[n] for n in sizes) > seconds_left():
            break
        for n, more in time_again(sizes, CHECK_ROUNDS).items():
            samples[n].extend(more)
        again |= sizes
    return again


def _random_prompts(model, batch_size: int, seed: int, length: int) -> torch.Tensor:
    lm = model.get_output_embeddings().weight
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (batch_size, length), generator=torch.Generator().manual_seed(seed)).to(lm.device)


def _greedy(model, tokens: int, prompt_len: int | None = None) -> GenerationConfig:
    """Greedy decoding of exactly ``tokens`` tokens (no EOS: every timed decode has one length), as
    ``generate`` takes it, or with ``prompt_len``: with the ``max_length`` generate would derive
    (what a session opened without ``generate`` reads)."""
    fields = {
        **model.generation_config.to_dict(),
        "eos_token_id": None,
        "do_sample": False,
        "return_dict_in_generate": True,
    }
    if prompt_len is None:
        return GenerationConfig(**{**fields, "max_new_tokens": tokens})
    return GenerationConfig(**{**fields, "max_new_tokens": None, "max_length": prompt_len + tokens})


def _session(model, heads, ids: torch.Tensor, tree: Tree, tokens: int) -> tuple[DecodeSession, dict]:
    """A session decoding ``ids`` [B, L] greedily with ``tree``, as ``generate`` would open it (on
    the static cache ``generate`` would build where the model decodes compiled by default, so the
    compiled forward is what is timed), and the arguments that open it again."""
    config = EntMTPConfig(tree=tree.choices)
    generation = _greedy(model, tokens, ids.shape[1])
    args = dict(
        logits_processor=LogitsProcessorList(),
        stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(generation.max_length)]),
        generation_config=generation,
        heads=heads,
        plan=config.resolve(heads.num_heads, heads.config.draft_vocab_rows),
        attention_mask=torch.ones_like(ids),
    )
    if compiled_route(model):  # generate's own static cache: one per session, as one per call
        length = max(generation.max_length, getattr(generation, "max_cache_len", None) or 0)
        args["past_key_values"] = StaticCache(config=model.config, max_cache_len=length)
    return open_session(model, ids, **args), args


def prefilled(model, heads, *, prefix_len: int = PREFIX_LEN, batch_size: int = 1) -> DecodeSession:
    """A session of ``batch_size`` random prompts of ``prefix_len`` tokens, prefilled: what
    :func:`forward_ms` times forwards on (it drafts nothing: its tree is the root alone)."""
    session, _ = _session(model, heads, _random_prompts(model, batch_size, 0, prefix_len), Tree.root_only(), 1)
    session.prefill()
    return session


@torch.no_grad()  # as generate runs it: no autograd record, no graph compiled for one
def forward_ms(
    model,
    heads,
    sizes: Sequence[int] = PROBE_SIZES,
    *,
    prefix_len: int = PREFIX_LEN,
    repeats: int = REPEATS,
    batch_size: int = 1,
    on_round: Callable[[], None] | None = None,
    session: DecodeSession | None = None,
) -> dict[int, float]:
    """Median ms of the verification forward of ``N`` chained nodes (in each of ``batch_size`` rows)
    after ``prefix_len`` cached tokens (:func:`forward_grid`). ``heads``: the model's draft heads;
    ``session``: one from :func:`prefilled` to time on again (a prefill of a batch costs as much
    as a dozen forwards; each timed forward leaves its cache as it found it)."""
    session = session if session is not None else prefilled(model, heads, prefix_len=prefix_len, batch_size=batch_size)
    return forward_grid(session, sizes, repeats, on_round=on_round)[0]


@torch.no_grad()
def forward_grid(
    session: DecodeSession,
    sizes: Sequence[int],
    repeats: int = REPEATS,
    *,
    on_round: Callable[[], None] | None = None,
    warm_up: bool = True,
    seconds_left: Callable[[], float] = lambda: float("inf"),
) -> tuple[dict[int, float], set[int]]:
    """Median ms of the verification forward of each of ``sizes`` on ``session``, timed
    round-robin so drift hits every size alike, the doubtful ones timed again (:func:`settle`)
    while their rounds fit ``seconds_left()`` and take no longer than the grid took; and the
    sizes timed again. ``on_round``, ``warm_up``: see :func:`_timings`."""
    runs, sync = {n: (lambda n=n: trial_forward(session, n)) for n in sizes}, _sync(session.device)
    t0 = time.perf_counter()
    samples = _timings(runs, repeats, sync, on_round, warm_up=warm_up)
    end = 2 * time.perf_counter() - t0

    def left() -> float:
        return min(seconds_left(), end - time.perf_counter())

    def time_again(doubted: set[int], rounds: int) -> dict[int, list[float]]:
        return _timings({n: runs[n] for n in sorted(doubted)}, rounds, sync, warm_up=False)

    again = settle(samples, time_again, left)
    return {n: 1e3 * statistics.median(v) for n, v in samples.items()}, again


def sizes_at(batch_size: int, sizes: Sequence[int] = PROBE_SIZES) -> tuple[int, ...]:
    """The forward sizes measured at ``batch_size`` rows (see :data:`MAX_BATCH_NODES`)."""
    return tuple(n for i, n in enumerate(sorted(sizes)) if i < 4 or n * batch_size <= MAX_BATCH_NODES)


def probe_trees(heads) -> list[Tree]:
    """Shapes whose drafting times fit the draft model: chains of every depth, fans, a bushy tree."""
    depth, rows = heads.num_heads, heads.config.draft_vocab_rows
    trees = [Tree.chain(d) for d in range(1, depth + 1)]
    trees += [Tree.from_choices([[i] for i in range(w)]) for w in (2, 4, 8) if w <= rows]
    bushy = [[i] for i in range(min(4, rows))] + [[i, j] for i in range(min(4, rows)) for j in range(min(2, rows))]
    trees.append(Tree.from_choices(bushy).union(Tree.chain(depth)))
    return trees


def draft_fit(model, heads, *, repeats: int = REPEATS) -> tuple[tuple[float, float, float], float]:
    """Least-squares ``(a, b, c)`` of drafting ms = a + b·depth + c·(nodes - 1) with the heads
    timed on their own, and the fit's largest relative error over the probed shapes. The probe
    keeps ``c`` only: ``a`` and ``b`` are measured inside decoding (:func:`step_costs`)."""
    heads_device = next(heads.parameters()).device
    dtype = model.get_output_embeddings().weight.dtype
    ids = _random_prompts(model, 1, 1, 64)
    out = model(input_ids=ids, output_hidden_states=heads.hidden_states_request)
    state = heads.new_state(model)
    heads.observe(state, heads.features(out.hidden_states)[0], tokens=ids[0])
    root = ids[0, -1:].to(heads_device)
    trees = probe_trees(heads)
    runs = {i: (lambda b=t.buffers(heads_device, dtype): heads.propose(state, root, b)) for i, t in enumerate(trees)}
    seconds = _medians(runs, repeats, _sync(heads_device))
    x = torch.tensor([[1.0, t.depth, t.num_nodes - 1] for t in trees], dtype=torch.float64)
    y = torch.tensor([1e3 * seconds[i] for i in range(len(trees))], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    error = float(((x @ coef - y).abs() / y).max())
    return (float(coef[0]), float(coef[1]), float(coef[2])), error


def _decode_phases(model, heads, ids: torch.Tensor, tree: Tree, tokens: int) -> tuple[float, float]:
    """A short EntMTP decode of ``ids`` [B, L] verifying ``tree`` every step: ms per row-step of
    drafting, and of everything outside the forward and drafting (prefill excluded)."""
    timer = PhaseTimer()
    _, args = _session(model, heads, ids, tree, tokens)
    st = entmtp_decode(model, ids, observers=[timer], **args).entmtp_stats
    row_steps = sum(st["live_batch_sizes"])  # rows may stop at different steps
    rest = st["total_time"] - st["prefill_time"] - timer.seconds["verify"] - timer.seconds["draft"]
    return 1e3 * timer.seconds["draft"] / row_steps, 1e3 * rest / row_steps


def _overhead_fit(rest: dict[int, float]) -> tuple[float, float]:
    """``(o, p)`` of o + p·nodes through the overhead trees' two measurements."""
    (n1, o1), (n2, o2) = sorted(rest.items())
    p = (o2 - o1) / (n2 - n1)
    return o1 - p * n1, p


def step_costs(
    model, heads, per_node: float, batch_size: int = 1, *, tokens: int = STEP_TOKENS
) -> tuple[tuple[float, float, float], tuple[float, float]]:
    """Per-row drafting ``(a, b, c)`` and overhead ``(o, p)`` at ``batch_size`` rows, from short
    EntMTP decodes: drafting's fixed and per-depth parts from chains one and three deep (a batch
    drafts its rows together, one head call per depth, so a row costs less than alone, the more so
    the deeper the tree), its per-node part ``per_node`` (from :func:`draft_fit`), the overhead
    from the overhead trees. Heads one deep have no per-depth part to tell apart: it is left at 0."""
    ids = _random_prompts(model, batch_size, 2, DECODE_PROMPT_LEN)
    short, deep = OVERHEAD_TREES[0], Tree.chain(min(3, heads.num_heads))
    phases = {tree: _decode_phases(model, heads, ids, tree, tokens) for tree in {*OVERHEAD_TREES, deep}}
    extra, per_depth = deep.num_nodes - short.num_nodes, 0.0
    if extra:
        per_depth = (phases[deep][0] - phases[short][0] - per_node * extra) / (deep.depth - short.depth)
    fixed = phases[short][0] - per_depth * short.depth - per_node * (short.num_nodes - 1)
    overhead = _overhead_fit({tree.num_nodes: phases[tree][1] for tree in OVERHEAD_TREES})
    return (fixed, per_depth, per_node), overhead


class _StepClock(StoppingCriteria):
    """Stops nothing: notes when each step of plain ``generate`` ends."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _plain_ms(model, ids: torch.Tensor, tokens: int) -> float:
    """Plain greedy ``generate``'s ms per step on ``ids`` [B, L]: the median interval between its
    steps after the prefill (callers pass :data:`PLAIN_PROMPT_LEN` tokens)."""
    clock, sync = _StepClock(), _sync(ids.device)
    criteria = StoppingCriteriaList([clock])
    config = _greedy(model, tokens + 1)
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, stopping_criteria=criteria)
    sync()
    return 1e3 * statistics.median(b - a for a, b in zip(clock.times, clock.times[1:]))


def steady(first: float, *others: float) -> bool:
    """Whether a timing agrees within :data:`STEADY` with one of ``others``, the same thing timed
    apart: then at least one pair of timings saw the machine alike."""
    return any(abs(first - other) <= STEADY * min(first, other) for other in others)


def retry_seconds(elapsed: float, budget_s: float = BUDGET_S) -> float:
    """Seconds a part measured again may take after ``elapsed`` seconds of measuring: what is left
    of ``budget_s``, or :data:`RETRY_SHARE` of ``elapsed`` where measuring took about as long
    already (a large model: it still gets a bounded second look)."""
    return max(budget_s - elapsed, RETRY_SHARE * elapsed)


def _measure(
    model,
    heads,
    batch_size: int,
    sizes: Sequence[int],
    repeats: int,
    per_node: float,
    tick: Tick,
    started: float,
    budget_s: float,
) -> tuple[dict[int, float], float, tuple, tuple, dict]:
    """The forward grid, plain ms, per-row drafting and overhead at ``batch_size`` rows; then the
    one-node forward and the plain step timed again, and the one of them that disagrees
    (:func:`steady`) measured again if it fits :func:`retry_seconds` of the time since
    ``started``; and the table's notes on it."""
    session = prefilled(model, heads, batch_size=batch_size)  # the forwards' and the recheck's
    forward, timed_again = forward_grid(
        session,
        sizes_at(batch_size, sizes),
        repeats,
        seconds_left=lambda: retry_seconds(time.perf_counter() - started, CHECK_SHARE * budget_s),
    )
    tick("forward")
    t0 = time.perf_counter()
    plain = _plain_ms(model, _random_prompts(model, batch_size, 3, PLAIN_PROMPT_LEN), DECODE_TOKENS)
    plain_s = time.perf_counter() - t0
    tick("plain decoding")
    draft, overhead = step_costs(model, heads, per_node, batch_size)
    tick("drafting")
    recheck_ids = _random_prompts(
        model, batch_size, 3, PREFIX_LEN - STEP_TOKENS // 2
    )  # a shorter decode, centred alike
    one, plain_then = forward_grid(session, (1,), repeats)[0][1], _plain_ms(model, recheck_ids, STEP_TOKENS)
    deadline = time.perf_counter() + retry_seconds(time.perf_counter() - started, budget_s)

    def retry_left() -> float:
        return deadline - time.perf_counter()

    forward_ok, plain_ok, again = steady(forward[1], one), steady(plain, plain_then), []
    if not forward_ok and repeats * sum(forward.values()) / 1e3 <= retry_left():
        first, again = forward[1], again + ["forward"]
        forward, more = forward_grid(
            session, sizes_at(batch_size, sizes), repeats, warm_up=False, seconds_left=retry_left
        )
        forward_ok, timed_again = steady(forward[1], first, one), timed_again | more
    if not plain_ok and plain_s <= retry_left():
        first, again = plain, again + ["plain decoding"]
        plain = _plain_ms(model, _random_prompts(model, batch_size, 3, PLAIN_PROMPT_LEN), DECODE_TOKENS)
        plain_ok = steady(plain, first, plain_then)
    # a doubted size that was never timed again (no time left for it) is a guess, not a kink that held
    unchecked = sorted(doubtful(forward) - timed_again)
    unsettled = [part for part, ok in (("forward", forward_ok), ("plain step", plain_ok)) if not ok]
    if unchecked:
        log.warning(
            "entmtp-hf: at batch size %d the forward of %s nodes disagrees with its neighbours and there was "
            "no time to time it again: the table is kept as unsteady (calibrate measures it again)",
            batch_size,
            ", ".join(map(str, unchecked)),
        )
    if unsettled:
        log.warning(
            "entmtp-hf: at batch size %d the %s changed while measuring (one-node forward %.1f then %.1f ms, "
            "plain step %.1f then %.1f ms; measured again: %s): the machine looks busy; keeping the last",
            batch_size,
            " and ".join(unsettled),
            forward[1],
            one,
            plain,
            plain_then,
            ", ".join(again) or "nothing, no time left",
        )
    notes = {
        "timings_steady": forward_ok and plain_ok and not unchecked,
        "measured_again": again,
        "timed_again": sorted(timed_again),
        "unchecked_sizes": unchecked,
    }
    return forward, plain, draft, overhead, notes


def _noop(stage: str) -> None:
    pass


@torch.no_grad()
def probe_batch(
    model,
    heads,
    base: CostTable,
    batch_size: int,
    *,
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = REPEATS,
    tick: Tick = _noop,
    budget_s: float = BUDGET_S,
) -> CostTable:
    """``base`` (this machine's batch-size-1 table) at ``batch_size`` rows: the verification forward,
    plain batched decoding and the per-row drafting and overhead measured anew. ``tick(stage)`` is
    called as each stage ends (a progress bar's); ``budget_s``: see :data:`BUDGET_S`."""
    t0 = time.perf_counter()
    forward, plain, draft, overhead, notes = _measure(
        model, heads, batch_size, sizes, repeats, base.draft_ms[2], tick, t0, budget_s
    )
    seconds = time.perf_counter() - t0
    return CostTable(
        base.fingerprint,
        base.model,
        forward,
        draft,
        overhead,
        plain,
        seconds,
        notes={**base.notes, **notes},
        batch_size=batch_size,
    )


@torch.no_grad()
def probe(
    model,
    heads,
    *,
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = REPEATS,
    tick: Tick = _noop,
    budget_s: float = BUDGET_S,
) -> CostTable:
    """Measure this machine's batch-size-1 :class:`CostTable` for ``model`` (enabled with ``heads``)."""
    t0 = time.perf_counter()
    lm = model.get_output_embeddings().weight
    fingerprint = machine_fingerprint(lm.device, lm.dtype)
    shape, fit_error = draft_fit(model, heads, repeats=repeats)
    tick("heads")
    forward, plain, draft, overhead, notes = _measure(model, heads, 1, sizes, repeats, shape[2], tick, t0, budget_s)
    seconds = time.perf_counter() - t0
    notes = {"draft_fit_max_error": fit_error, "prefix_len": PREFIX_LEN, **notes}
    return CostTable(
        {**fingerprint.to_dict(), "key": fingerprint.key()},
        model_key(model, heads),
        forward,
        draft,
        overhead,
        plain,
        seconds,
        notes=notes,
    )


#: the stages :func:`probe` reports to ``tick`` (:func:`probe_batch`: all but the first), in order
STAGES = ("heads", "forward", "plain decoding", "drafting")
