"""The cost probe: this machine's step costs for a model and its heads, measured in seconds.

It times the real pieces of a decode step on the loaded model (short, interleaved, medians):

1. the verification forward of ``N`` nodes after a cached prefix, for a grid of sizes;
2. the heads drafting a few tree shapes (chains and fans) on their own: what each further node
   of a depth costs;
3. a short plain ``generate`` (plain decoding's time per token) and three short EntMTP decodes
   (chains one and three deep, and a ten-node tree) at the table's batch size: drafting's fixed
   and per-depth parts and the rest of a step (acceptance, cache, the heads' conditioning) as a
   real step pays them. Timed on their own, the heads' calls run on warm caches and skip the
   conditioning on the accepted tokens: the EAGLE-style drafter's depth-one draft took 0.8 ms
   there against 4.6 ms inside decoding on the demo model.

The one-node forward and the plain step are timed again after everything else; where the two
timings of either disagree (:func:`steady`) something else was using the cores, so all is
measured again, and a table whose timings never agreed is used for the call but not cached
(see :func:`~entmtp_hf.costs.cache.cost_table`).

The result is a :class:`~entmtp_hf.costs.table.CostTable` (see there for the model).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Sequence

import torch
from transformers import DynamicCache, GenerationConfig

from ..config import EntMTPConfig
from ..decoding.attention import tree_attention_mask, verifying
from ..decoding.cache import preallocate
from ..decoding.stats import PhaseTimer
from ..trees.tree import Tree
from .fingerprint import machine_fingerprint, model_key
from .table import CostTable

log = logging.getLogger(__name__)

#: forward sizes measured (larger trees interpolate, or extrapolate from the last two)
PROBE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
PREFIX_LEN = 256
DECODE_TOKENS = 32
#: plain decoding's timed prompts: its steps run at contexts centred on the forward's
#: ``PREFIX_LEN``, because a step's attention grows with its context (on the demo model on a
#: 2-core CPU a step at 256 cached tokens costs 6-9% more than at 112, the more rows the more)
PLAIN_PROMPT_LEN = PREFIX_LEN - DECODE_TOKENS // 2
#: prompts of the short EntMTP decodes that time drafting and the rest of a step
DECODE_PROMPT_LEN = 96
#: how far two timings of one thing may differ (of the smaller) for :func:`steady`: an idle
#: machine repeats them within a few percent, a busy one by tens of percent
STEADY = 0.25
#: measurements repeated when they disagree, before the table is used uncached
RETRIES = 2


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


def _prefix(model, length: int, generator: torch.Generator, batch_size: int = 1, heads=None
            ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
    """Random prompt ids [B, L], the cache after them and the first row's features [L, F] (those
    ``heads`` read; else the last hidden states)."""
    lm = model.get_output_embeddings().weight
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch_size, length), generator=generator).to(lm.device)
    cache = preallocate(DynamicCache(config=model.config), length + max(PROBE_SIZES))  # as decoding's
    request = heads.hidden_states_request if heads is not None else -1
    out = model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=request)
    return ids, cache, (heads.features(out.hidden_states) if heads is not None else out.hidden_states[-1])[0]


def forward_ms(model, sizes: Sequence[int] = PROBE_SIZES, *, prefix_len: int = PREFIX_LEN, repeats: int = 5,
               on_round: Callable[[], None] | None = None, batch_size: int = 1) -> dict[int, float]:
    """Median ms of the verification forward of ``N`` chained nodes (in each of ``batch_size`` rows)
    after ``prefix_len`` cached tokens, the sizes timed round-robin so drift hits every size alike."""
    lm = model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(0)
    _, cache, _ = _prefix(model, prefix_len, g, batch_size)
    row = torch.zeros(prefix_len, dtype=lm.dtype, device=lm.device)
    vocab = model.config.get_text_config().vocab_size

    def run(n: int) -> Callable[[], None]:
        b = Tree.chain(n - 1).buffers(lm.device, lm.dtype)
        mask = tree_attention_mask(b, row, prefix_len + n).expand(batch_size, -1, -1, -1)
        inputs = dict(input_ids=torch.randint(0, vocab, (batch_size, n), generator=g).to(lm.device),
                      attention_mask=mask, position_ids=(b.position_ids + prefix_len)[None].expand(batch_size, -1))  # fmt: skip

        def forward() -> None:
            model(**inputs, cache=cache, use_cache=True, output_hidden_states=-1)
            cache.crop(-n)

        return forward

    with verifying():
        seconds = _medians({n: run(n) for n in sizes}, repeats, _sync(lm.device), on_round)
    return {n: 1e3 * s for n, s in seconds.items()}


def probe_trees(heads) -> list[Tree]:
    """Shapes whose drafting times fit the draft model: chains of every depth, fans, a bushy tree."""
    depth, rows = heads.num_heads, heads.config.draft_vocab_rows
    trees = [Tree.chain(d) for d in range(1, depth + 1)]
    trees += [Tree.from_choices([[i] for i in range(w)]) for w in (2, 4, 8) if w <= rows]
    bushy = [[i] for i in range(min(4, rows))] + [[i, j] for i in range(min(4, rows)) for j in range(min(2, rows))]
    trees.append(Tree.from_choices(bushy).union(Tree.chain(depth)))
    return trees


def draft_fit(model, heads, *, repeats: int = 5) -> tuple[tuple[float, float, float], float]:
    """Least-squares ``(a, b, c)`` of drafting ms = a + b·depth + c·(nodes - 1) with the heads
    timed on their own, and the fit's largest relative error over the probed shapes. The probe
    keeps ``c`` only: ``a`` and ``b`` are measured inside decoding (:func:`step_costs`)."""
    heads_device = next(heads.parameters()).device
    dtype = model.get_output_embeddings().weight.dtype
    ids, _, hidden = _prefix(model, 64, torch.Generator().manual_seed(1), heads=heads)
    state = heads.new_state(model)
    heads.observe(state, hidden, tokens=ids[0])
    root = ids[0, -1:].to(heads_device)
    trees = probe_trees(heads)
    runs = {i: (lambda b=t.buffers(heads_device, dtype): heads.propose(state, root, b)) for i, t in enumerate(trees)}
    seconds = _medians(runs, repeats, _sync(heads_device))
    x = torch.tensor([[1.0, t.depth, t.num_nodes - 1] for t in trees], dtype=torch.float64)
    y = torch.tensor([1e3 * seconds[i] for i in range(len(trees))], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    error = float(((x @ coef - y).abs() / y).max())
    return (float(coef[0]), float(coef[1]), float(coef[2])), error


def _greedy(model, tokens: int) -> GenerationConfig:
    """Greedy decoding of exactly ``tokens`` tokens (no EOS: every probe decode has one length)."""
    return GenerationConfig(**{**model.generation_config.to_dict(), "eos_token_id": None, "do_sample": False,
                               "max_new_tokens": tokens, "return_dict_in_generate": True})  # fmt: skip


#: the two trees whose short decodes split a step's time (2 and 10 nodes)
OVERHEAD_TREES = (Tree.chain(1), Tree.chain(1).union(Tree.from_choices([[i] for i in range(8)])))


def _decode_phases(model, ids: torch.Tensor, tree: Tree, tokens: int) -> tuple[float, float]:
    """A short EntMTP decode of ``ids`` [B, L] verifying ``tree`` every step: ms per row-step of
    drafting, and of everything outside the forward and drafting (prefill excluded)."""
    timer = PhaseTimer()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy(model, tokens),
                         entmtp_config=EntMTPConfig(tree=tree.choices), entmtp_observers=[timer])  # fmt: skip
    st = out.entmtp_stats
    prefill, row_steps = st["prefill_time"], sum(st["live_batch_sizes"])  # rows may stop at different steps
    rest = st["total_time"] - prefill - timer.seconds["verify"] - timer.seconds["draft"]
    return 1e3 * timer.seconds["draft"] / row_steps, 1e3 * rest / row_steps


def _overhead_fit(rest: dict[int, float]) -> tuple[float, float]:
    """``(o, p)`` of o + p·nodes through the overhead trees' two measurements."""
    (n1, o1), (n2, o2) = sorted(rest.items())
    p = (o2 - o1) / (n2 - n1)
    return o1 - p * n1, p


def _random_prompts(model, batch_size: int, seed: int, length: int = DECODE_PROMPT_LEN) -> torch.Tensor:
    lm = model.get_output_embeddings().weight
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(0, vocab, (batch_size, length), generator=torch.Generator().manual_seed(seed)).to(lm.device)


def step_costs(model, heads, per_node: float, batch_size: int = 1, *, tokens: int = DECODE_TOKENS
               ) -> tuple[tuple[float, float, float], tuple[float, float]]:  # fmt: skip
    """Per-row drafting ``(a, b, c)`` and overhead ``(o, p)`` at ``batch_size`` rows, from short
    EntMTP decodes: drafting's fixed and per-depth parts from chains one and three deep (a batch
    drafts its rows together, one head call per depth, so a row costs less than alone, the more so
    the deeper the tree), its per-node part ``per_node`` (from :func:`draft_fit`), the overhead
    from the overhead trees. Heads one deep have no per-depth part to tell apart: it is left at 0."""
    ids = _random_prompts(model, batch_size, 2)
    short, deep = OVERHEAD_TREES[0], Tree.chain(min(3, heads.num_heads))
    phases = {tree: _decode_phases(model, ids, tree, tokens) for tree in {*OVERHEAD_TREES, deep}}
    extra, per_depth = deep.num_nodes - short.num_nodes, 0.0
    if extra:
        per_depth = (phases[deep][0] - phases[short][0] - per_node * extra) / (deep.depth - short.depth)
    fixed = phases[short][0] - per_depth * short.depth - per_node * (short.num_nodes - 1)
    overhead = _overhead_fit({tree.num_nodes: phases[tree][1] for tree in OVERHEAD_TREES})
    return (fixed, per_depth, per_node), overhead


def _plain_ms(model, ids: torch.Tensor, tokens: int) -> float:
    """Plain greedy ``generate``'s ms per step on ``ids`` [B, L] after the prefill (a one-token call's
    time subtracted); callers pass :data:`PLAIN_PROMPT_LEN` tokens."""
    mask = torch.ones_like(ids)
    runs = {n: (lambda n=n: model.generate(ids, attention_mask=mask, generation_config=_greedy(model, n)))
            for n in (1, tokens + 1)}  # fmt: skip
    seconds = _medians(runs, 3, _sync(ids.device))
    return 1e3 * (seconds[tokens + 1] - seconds[1]) / tokens


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
                    forward, result[1], plain, "measuring again" if attempt < RETRIES else "giving up")  # fmt: skip
    return result, False


@torch.no_grad()
def probe_batch(model, heads, base: CostTable, batch_size: int, *, sizes: Sequence[int] = PROBE_SIZES,
                repeats: int = 5) -> CostTable:
    """``base`` (this machine's batch-size-1 table) at ``batch_size`` rows: the verification forward,
    plain batched decoding and the per-row drafting and overhead measured anew."""
    t0 = time.perf_counter()
    (forward, plain), agree = _agreeing(
        lambda: (forward_ms(model, sizes, repeats=repeats, batch_size=batch_size), plain_batch_ms(model, batch_size)),
        lambda: (forward_ms(model, (1,), repeats=repeats, batch_size=batch_size)[1], plain_batch_ms(model, batch_size)),
        batch_size,
    )
    draft, overhead = step_costs(model, heads, base.draft_ms[2], batch_size)
    seconds = time.perf_counter() - t0
    log.info("entmtp-hf: measured this machine's step costs at batch size %d in %.1f s", batch_size, seconds)
    return CostTable(base.fingerprint, base.model, forward, draft, overhead, plain, seconds,
                     notes={**base.notes, "timings_steady": agree}, batch_size=batch_size)  # fmt: skip


@torch.no_grad()
def probe(model, heads, *, sizes: Sequence[int] = PROBE_SIZES, repeats: int = 5) -> CostTable:
    """Measure this machine's :class:`CostTable` for ``model`` (enabled with ``heads``)."""
    t0 = time.perf_counter()
    lm = model.get_output_embeddings().weight
    fingerprint = machine_fingerprint(lm.device, lm.dtype)
    shape, fit_error = draft_fit(model, heads, repeats=repeats)
    plain_ids = _random_prompts(model, 1, 2, PLAIN_PROMPT_LEN)

    def measure() -> tuple:
        return forward_ms(model, sizes, repeats=repeats), _plain_ms(model, plain_ids, DECODE_TOKENS)

    def recheck() -> tuple[float, float]:
        return forward_ms(model, (1,), repeats=repeats)[1], _plain_ms(model, plain_ids, DECODE_TOKENS)

    (forward, plain), agree = _agreeing(measure, recheck, 1)
    draft, overhead = step_costs(model, heads, shape[2])
    seconds = time.perf_counter() - t0
    notes = {"draft_fit_max_error": fit_error, "prefix_len": PREFIX_LEN, "timings_steady": agree}
    table = CostTable({**fingerprint.to_dict(), "key": fingerprint.key()}, model_key(model, heads), forward, draft,
                      overhead, plain, seconds, notes=notes)  # fmt: skip
    log.info("entmtp-hf: measured this machine's step costs in %.1f s (%s)", seconds, fingerprint.describe())
    return table
