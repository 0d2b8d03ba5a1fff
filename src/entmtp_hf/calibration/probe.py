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

The one-node forward and the plain step are timed again after everything else; where the two
timings of either disagree (:func:`steady`) something else was using the cores, so all is
measured again, and a table whose timings never agreed says so in its notes.

The result is a :class:`~entmtp_hf.costs.table.CostTable` (see there for the model).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Sequence

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria

from ..config import EntMTPConfig
from ..costs.fingerprint import machine_fingerprint, model_key
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
#: how far two timings of one thing may differ (of the smaller) for :func:`steady`: an idle
#: machine repeats them within a few percent, a busy one by tens of percent
STEADY = 0.25
#: measurements repeated when they disagree, before the table is kept with a note
RETRIES = 1
#: the two trees whose short decodes split a step's time (2 and 10 nodes)
OVERHEAD_TREES = (Tree.chain(1), Tree.chain(1).union(Tree.from_choices([[i] for i in range(8)])))

Tick = Callable[[str], None]


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _medians(runs: dict, repeats: int, sync: Callable[[], None], on_round: Callable[[], None] | None = None) -> dict:
    """Median seconds of each ``runs[key]()`` over ``repeats`` interleaved rounds after a warm-up
    round (``on_round`` is called after each round: a progress bar's)."""
    times: dict = {k: [] for k in runs}
    for r in range(repeats + 1):
        for key, run in runs.items():
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if r:
                times[key].append(time.perf_counter() - t0)
        if on_round is not None:
            on_round()
    return {k: statistics.median(v) for k, v in times.items()}


def _random_prompts(model, batch_size: int, seed: int, length: int) -> torch.Tensor:
    lm = model.get_output_embeddings().weight
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (batch_size, length), generator=torch.Generator().manual_seed(seed)).to(lm.device)


def _greedy(model, tokens: int, prompt_len: int | None = None) -> GenerationConfig:
    """Greedy decoding of exactly ``tokens`` tokens (no EOS: every timed decode has one length), as
    ``generate`` takes it, or with ``prompt_len``: with the ``max_length`` generate would derive
    (what a session opened without ``generate`` reads)."""
    fields = {**model.generation_config.to_dict(), "eos_token_id": None, "do_sample": False,
              "return_dict_in_generate": True}  # fmt: skip
    if prompt_len is None:
        return GenerationConfig(**{**fields, "max_new_tokens": tokens})
    return GenerationConfig(**{**fields, "max_new_tokens": None, "max_length": prompt_len + tokens})


def _session(model, heads, ids: torch.Tensor, tree: Tree, tokens: int) -> tuple[DecodeSession, dict]:
    """A session decoding ``ids`` [B, L] greedily with ``tree``, as ``generate`` would open it, and
    the arguments that open it again."""
    config = EntMTPConfig(tree=tree.choices)
    generation = _greedy(model, tokens, ids.shape[1])
    args = dict(logits_processor=LogitsProcessorList(),
                stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(generation.max_length)]),
                generation_config=generation, entmtp_config=config, heads=heads,
                plan=config.resolve(heads.num_heads, heads.config.draft_vocab_rows),
                attention_mask=torch.ones_like(ids))  # fmt: skip
    return open_session(model, ids, **args), args


def prefilled(model, heads, *, prefix_len: int = PREFIX_LEN, batch_size: int = 1) -> DecodeSession:
    """A session of ``batch_size`` random prompts of ``prefix_len`` tokens, prefilled: what
    :func:`forward_ms` times forwards on (it drafts nothing: its tree is the root alone)."""
    session, _ = _session(model, heads, _random_prompts(model, batch_size, 0, prefix_len), Tree.root_only(), 1)
    session.prefill()
    return session


def forward_ms(model, heads, sizes: Sequence[int] = PROBE_SIZES, *, prefix_len: int = PREFIX_LEN,
               repeats: int = REPEATS, batch_size: int = 1, on_round: Callable[[], None] | None = None,
               session: DecodeSession | None = None) -> dict[int, float]:  # fmt: skip
    """Median ms of the verification forward of ``N`` chained nodes (in each of ``batch_size`` rows)
    after ``prefix_len`` cached tokens, the sizes timed round-robin so drift hits every size alike.
    ``heads``: the model's draft heads; ``on_round``: see :func:`_medians`; ``session``: one from
    :func:`prefilled` to time on again (a prefill of a batch costs as much as a dozen forwards;
    each timed forward leaves its cache as it found it)."""
    session = session if session is not None else prefilled(model, heads, prefix_len=prefix_len, batch_size=batch_size)
    runs = {n: (lambda n=n: trial_forward(session, n)) for n in sizes}
    seconds = _medians(runs, repeats, _sync(session.device), on_round)
    return {n: 1e3 * s for n, s in seconds.items()}


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


def step_costs(model, heads, per_node: float, batch_size: int = 1, *, tokens: int = STEP_TOKENS
               ) -> tuple[tuple[float, float, float], tuple[float, float]]:  # fmt: skip
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


def plain_batch_ms(model, batch_size: int, *, tokens: int = DECODE_TOKENS) -> float:
    """Plain batched ``generate``'s ms per step (``batch_size`` tokens) after the prefill."""
    return _plain_ms(model, _random_prompts(model, batch_size, 3, PLAIN_PROMPT_LEN), tokens)


def steady(first: float, second: float) -> bool:
    """Whether two timings of the same thing, taken apart, agree within :data:`STEADY`."""
    return abs(first - second) <= STEADY * min(first, second)


def _agreeing(measure: Callable[[], tuple], recheck: Callable[[], tuple[float, float]],
              batch_size: int) -> tuple[tuple, bool]:  # fmt: skip
    """``measure()`` (its first two results: forward ms by size and plain ms), checked against
    ``recheck()`` (the one-node forward and plain ms timed again right after) and measured again up
    to :data:`RETRIES` times while they disagree; the last result, and whether it agreed."""
    for attempt in range(RETRIES + 1):
        result = measure()
        forward, plain = recheck()
        if steady(result[0][1], forward) and steady(result[1], plain):
            return result, True
        log.warning("entmtp-hf: step costs at batch size %d changed while measuring (one-node forward %.1f then "
                    "%.1f ms, plain step %.1f then %.1f ms): the machine looks busy; %s", batch_size, result[0][1],
                    forward, result[1], plain, "measuring again" if attempt < RETRIES else "keeping the last")  # fmt: skip
    return result, False


def _forward_and_plain(model, heads, batch_size: int, sizes: Sequence[int], repeats: int, tick: Tick
                       ) -> tuple[dict[int, float], float, bool]:  # fmt: skip
    plain_ids = _random_prompts(model, batch_size, 3, PLAIN_PROMPT_LEN)
    recheck_ids = _random_prompts(model, batch_size, 3, PREFIX_LEN - STEP_TOKENS // 2)  # a shorter decode, centred alike
    session = prefilled(model, heads, batch_size=batch_size)  # the forwards' and the recheck's
    ticked: set[str] = set()

    def once(stage: str) -> None:  # a measurement taken again does not move the bar again
        if stage not in ticked:
            ticked.add(stage)
            tick(stage)

    def measure() -> tuple:
        forward = forward_ms(model, heads, sizes_at(batch_size, sizes), repeats=repeats, session=session)
        once("forward")
        plain = _plain_ms(model, plain_ids, DECODE_TOKENS)
        once("plain decoding")
        return forward, plain

    def recheck() -> tuple[float, float]:
        one = forward_ms(model, heads, (1,), repeats=repeats, session=session)[1]
        return one, _plain_ms(model, recheck_ids, STEP_TOKENS)

    (forward, plain), agree = _agreeing(measure, recheck, batch_size)
    return forward, plain, agree


def _noop(stage: str) -> None:
    pass


@torch.no_grad()
def probe_batch(model, heads, base: CostTable, batch_size: int, *, sizes: Sequence[int] = PROBE_SIZES,
                repeats: int = REPEATS, tick: Tick = _noop) -> CostTable:
    """``base`` (this machine's batch-size-1 table) at ``batch_size`` rows: the verification forward,
    plain batched decoding and the per-row drafting and overhead measured anew. ``tick(stage)`` is
    called as each stage ends (a progress bar's)."""
    t0 = time.perf_counter()
    forward, plain, agree = _forward_and_plain(model, heads, batch_size, sizes, repeats, tick)
    draft, overhead = step_costs(model, heads, base.draft_ms[2], batch_size)
    tick("drafting")
    seconds = time.perf_counter() - t0
    return CostTable(base.fingerprint, base.model, forward, draft, overhead, plain, seconds,
                     notes={**base.notes, "timings_steady": agree}, batch_size=batch_size)  # fmt: skip


@torch.no_grad()
def probe(model, heads, *, sizes: Sequence[int] = PROBE_SIZES, repeats: int = REPEATS, tick: Tick = _noop
          ) -> CostTable:  # fmt: skip
    """Measure this machine's batch-size-1 :class:`CostTable` for ``model`` (enabled with ``heads``)."""
    t0 = time.perf_counter()
    lm = model.get_output_embeddings().weight
    fingerprint = machine_fingerprint(lm.device, lm.dtype)
    shape, fit_error = draft_fit(model, heads, repeats=repeats)
    tick("heads")
    forward, plain, agree = _forward_and_plain(model, heads, 1, sizes, repeats, tick)
    draft, overhead = step_costs(model, heads, shape[2])
    tick("drafting")
    seconds = time.perf_counter() - t0
    notes = {"draft_fit_max_error": fit_error, "prefix_len": PREFIX_LEN, "timings_steady": agree}
    return CostTable({**fingerprint.to_dict(), "key": fingerprint.key()}, model_key(model, heads), forward, draft,
                     overhead, plain, seconds, notes=notes)  # fmt: skip


#: the stages :func:`probe` reports to ``tick`` (:func:`probe_batch`: all but the first), in order
STAGES = ("heads", "forward", "plain decoding", "drafting")
