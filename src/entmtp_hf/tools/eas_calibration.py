"""Calibrating EAS for a drafter, offline: which thresholds make the head chain fastest here?

The report's thresholds (3.0 / 2.0 / 1.5 nats) were set for a different drafter and a GPU,
where verifying a long chain costs about as much as one token. The entropy scale depends on
the drafter and the cost of a chain on the machine, so the settings have to be chosen per
drafter, task and machine. Doing it by benchmarking every setting would take hours on a
CPU; instead:

1. **Replay** (:func:`replay_chains`): along a greedy output of the base model, draft the
   heads' full greedy chain from *every* position (the heads are fed the hidden states one
   position at a time, as decoding would after each accepted token) and record each depth's
   head entropy and how many leading chain tokens equal the true continuation. Greedy
   decoding's output does not depend on the drafts, so every step a chain policy could
   take starts at one of these positions and sees exactly these entropies.
2. **Simulate** (:func:`simulate`): walk each output as the decode loop would, an
   :class:`~entmtp_hf.scheduling.eas.EASController` choosing each chain's length from the recorded
   entropies; a chain of ``k`` accepts ``min(k, matches)`` drafted tokens, costs one forward
   over ``k + 1`` tokens plus the heads' drafting up to the depth the rule read.
3. **Rank** (:func:`calibrate`): model every setting of a grid (fixed chains, the report's
   bands, single thresholds with and without warm-up and forks, scaled bands) with the
   forward costs and the drafting costs measured on this machine, and keep the fastest.

The modelled speed-up leaves out the bookkeeping outside forwards and drafting (a few % of a
step), so it overstates every setting alike; the benchmark (``bench --methods eas-calibrated
--eas-config ...``) measures the chosen one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from ..scheduling.eas import ChainRule, EASConfig, EASController, entropy_nats, fixed_length
from ..scheduling.features import entropy_from_logp
from ..trees.tree import Tree
from .checkpoint import heads_fingerprint, read_json, write_json


# ============================================================================ replay
@dataclass
class ChainReplay:
    """One greedy output with the heads' chain drafted from every position.

    ``entropies[j]`` and ``matches[j]`` belong to the step whose root is ``tokens[prompt_len + j]``.
    """

    prompt_len: int
    tokens: list[int]
    entropies: list[list[float]]  # head entropy (nats) of chain depth 1..D
    matches: list[int]  # leading chain tokens equal to the true continuation

    @property
    def new_tokens(self) -> int:
        """Tokens a decode emits after the prefill's first one."""
        return len(self.tokens) - self.prompt_len - 1


@torch.no_grad()
def replay_chains(model, heads, tokens: Sequence[int], prompt_len: int) -> ChainReplay:
    """Draft the greedy head chain from every position of ``tokens`` (prompt + greedy output)."""
    if not 0 < prompt_len < len(tokens):
        raise ValueError(f"prompt_len {prompt_len} must be within the {len(tokens)} tokens")
    device = model.get_output_embeddings().weight.device
    ids = torch.tensor([list(tokens)], device=device)
    hidden = heads.features(model(input_ids=ids, output_hidden_states=heads.hidden_states_request).hidden_states)[0]
    depth = heads.num_heads
    buffers = Tree.chain(depth).buffers(next(heads.parameters()).device, hidden.dtype)
    state = heads.new_state(model)
    heads.observe(state, hidden[:prompt_len], tokens=ids[0, :prompt_len])
    entropies, matches = [], []
    for r in range(prompt_len, len(tokens)):
        prop = heads.propose(state, torch.tensor(tokens[r], device=device), buffers)
        chain = prop.tokens[1:].tolist()
        truth = tokens[r + 1 : r + 1 + depth]
        m = 0
        while m < len(truth) and chain[m] == truth[m]:
            m += 1
        entropies.append([round(float(h), 5) for h in prop.entropy[1:].tolist()])
        matches.append(m)
        heads.observe(state, hidden[r : r + 1], tokens=ids[0, r : r + 1])
    return ChainReplay(prompt_len, list(map(int, tokens)), entropies, matches)


# ============================================================================ simulation
@dataclass(frozen=True)
class Costs:
    """Seconds of one base forward over ``n`` tokens (``forward[n]``) and of drafting the
    chain's first ``d`` depths (``draft[d]``, ``draft[0] = 0``), measured on this machine."""

    forward: dict[int, float]
    draft: list[float]

    def __post_init__(self) -> None:
        if 1 not in self.forward or not self.draft or self.draft[0] != 0:
            raise ValueError("Costs needs forward[1] and draft[0] == 0")

    def step(self, chain: int, drafted: int) -> float:
        return self.forward[chain + 1] + self.draft[drafted]


@dataclass(frozen=True)
class Step:
    """One modelled decode step: chain length, depths drafted, drafted tokens accepted, tokens added."""

    chain: int
    drafted: int
    accepted: int
    new: int


def replay_steps(rep: ChainReplay, config: EASConfig, depth: int) -> list[Step]:
    """The steps a greedy EntMTP decode with ``config`` takes along ``rep``, as the decode loop
    takes them: the controller reads the chain's entropies until it stops (the heads drafting
    lazily up to there), and a chain of ``k`` keeps ``min(k, matches)`` drafted tokens."""
    ctrl = EASController(config, k_max=depth)
    steps: list[Step] = []
    j, left = 0, rep.new_tokens
    while left > 0:
        walk, drafted = ctrl.walk(), 0
        for h in rep.entropies[j][:depth]:
            drafted += 1
            if walk.done or walk.feed(h):
                break
        k = walk.close()
        a = min(k, rep.matches[j])
        new = min(a + 1, left)
        ctrl.observe_verified(k, a, new)
        steps.append(Step(k, drafted, a, new))
        j, left = j + new, left - new
    return steps


def simulate(replays: Sequence[ChainReplay], config: EASConfig, costs: Costs) -> dict[str, float]:
    """Modelled run of ``config`` over ``replays``: speed-up over one-token decoding and the statistics."""
    depth = len(costs.draft) - 1
    steps = [s for rep in replays for s in replay_steps(rep, config, depth)]
    time_eas = sum(costs.step(s.chain, s.drafted) for s in steps)
    tokens = sum(s.new for s in steps)
    verified, accepted = sum(s.chain for s in steps), sum(s.accepted for s in steps)
    n = max(len(steps), 1)
    return {
        "speedup": tokens * costs.forward[1] / time_eas if time_eas else 0.0,
        "tokens_per_step": tokens / n,
        "mean_chain": verified / n,
        "rejected_fraction": 1 - accepted / verified if verified else 0.0,
        "drafted_depths_per_step": sum(s.drafted for s in steps) / n,
        "steps": len(steps),
    }


def grid(depth: int) -> dict[str, EASConfig]:
    """The settings :func:`calibrate` compares for heads ``depth`` deep: the fixed chains
    (``chain-k``, baselines), the report's bands, and single thresholds with forks off and on
    and with the first 0-2 tokens exempt from halting (``min_length``)."""
    out: dict[str, EASConfig] = {f"chain-{k}": fixed_length(k) for k in range(1, depth + 1)}
    out["report"] = EASConfig(k_max=depth)
    out["report-w16"] = EASConfig(k_max=depth, warmup_tokens=16)
    for scale in (0.5, 0.75):
        out[f"report-x{scale:g}"] = EASConfig(
            k_max=depth,
            thresholds=tuple(t * scale for t in (3.0, 2.0, 1.5)),
            band_edges=tuple(e * scale for e in (1.0, 2.0)),
            warmup_tokens=0,
        )
    for tau in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0):
        for min_length in range(min(depth, 3)):
            for forks in (False, True) if tau >= 2.0 else (False,):  # forks need H >= m + 1.5: above low taus
                label = f"tau-{tau:g}" + (f"-min{min_length}" if min_length else "") + ("-forks" if forks else "")
                out[label] = EASConfig(
                    k_max=depth,
                    thresholds=(tau,),
                    band_edges=(),
                    warmup_tokens=0,
                    detect_forks=forks,
                    min_length=min_length,
                )
    return out


def is_fixed(label: str) -> bool:
    return label.startswith("chain-")


def calibrate(replays: Sequence[ChainReplay], costs: Costs, settings: dict[str, EASConfig] | None = None) -> dict:
    """Model every setting: rows fastest first; ``best``/``config``: the fastest adaptive
    setting (what ``eas-calibrated`` runs); ``best_fixed``: the fastest fixed chain."""
    settings = settings if settings is not None else grid(len(costs.draft) - 1)
    rows = [{"label": label, **simulate(replays, cfg, costs)} for label, cfg in settings.items()]
    rows.sort(key=lambda r: -r["speedup"])
    best = next((r["label"] for r in rows if not is_fixed(r["label"])), rows[0]["label"])
    fixed = next((r["label"] for r in rows if is_fixed(r["label"])), None)
    return {"rows": rows, "best": best, "best_fixed": fixed, "config": asdict(settings[best])}


# ============================================================================ measuring costs
def drafting_costs(model, heads, repeats: int = 30, prefix_len: int = 128, progress: bool = False) -> list[float]:
    """Median seconds of drafting the chain's first ``d`` depths, ``d = 0..D`` (interleaved rounds;
    ``progress``: a bar over the rounds)."""
    device = model.get_output_embeddings().weight.device
    depth = heads.num_heads
    buffers = Tree.chain(depth).buffers(next(heads.parameters()).device, model.get_output_embeddings().weight.dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, prefix_len), generator=g).to(device)
    with torch.no_grad():
        hidden = heads.features(model(input_ids=ids, output_hidden_states=heads.hidden_states_request).hidden_states)[0]
        state = heads.new_state(model)
        heads.observe(state, hidden, tokens=ids[0])
        root = ids[0, -1]
        times: dict[int, list[float]] = {d: [] for d in range(1, depth + 1)}
        for r in tqdm(range(repeats + 1), desc="drafting costs", unit="round", disable=not progress):
            for d in range(1, depth + 1):
                t0 = time.perf_counter()
                heads.propose(state, root, buffers, until=lambda i, _h, d=d: i >= d)
                if r:
                    times[d].append(time.perf_counter() - t0)
    return [0.0] + [statistics.median(times[d]) for d in range(1, depth + 1)]


# ============================================================================ persistence
def save_replays(path: str | os.PathLike, replays: dict[str, ChainReplay]) -> None:
    write_json(Path(path), {pid: asdict(r) for pid, r in replays.items()})


def load_replays(path: str | os.PathLike) -> dict[str, ChainReplay]:
    """Replays saved by :func:`save_replays`; a malformed file is named in the error."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return {pid: ChainReplay(**r) for pid, r in data.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a chain-replay file ({e})") from e


TABLE_HEADER = (
    "| setting | modelled speed-up | tokens/step | mean chain | rejected | depths drafted/step |",
    "|---|---|---|---|---|---|",
)


def check_settings(path: Path, settings: dict) -> None:
    """Replays are resumed per prompt: refuse a folder whose replays came from other settings."""
    saved = read_json(path)
    if saved is not None and saved != settings:
        diff = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
        raise ValueError(
            f"{path}: this folder's replays were made with other settings {diff} "
            "(saved, now); use another --out or delete the folder"
        )
    write_json(path, settings)


def markdown(result: dict, task: str, costs: Costs, top: int = 12) -> str:
    base = costs.forward[1]
    lines = [
        f"# EAS calibration: {task}",
        "",
        f"Modelled from {result['replays']} greedy outputs ({result['new_tokens']} tokens); forward c(N) "
        + ", ".join(f"c({n})={costs.forward[n] / base:.2f}" for n in sorted(costs.forward))
        + "; drafting d depths "
        + ", ".join(f"{costs.draft[d] / base:.3f}" for d in range(1, len(costs.draft)))
        + " of a one-token forward.",
        "",
        f"Fastest adaptive setting (written to eas_config.json): **{result['best']}** "
        f"`{json.dumps(result['config'])}`; fastest fixed chain: {result['best_fixed']}.",
        "",
        *TABLE_HEADER,
    ]
    lines += _rows(result["rows"][:top])
    flat = result.get("flat_cost")
    if flat:
        keep = [r for r in flat["rows"] if r["label"] in (flat["best"], "report") or is_fixed(r["label"])]
        lines += [
            "",
            "With a flat forward cost (c(N) = 1 for every N, the regime of a GPU; modelled only, same "
            f"drafting costs): fastest adaptive **{flat['best']}**, fastest fixed {flat['best_fixed']}.",
            "",
            *TABLE_HEADER,
            *_rows(keep),
        ]
    return "\n".join(lines) + "\n"


def _rows(rows: Sequence[dict]) -> list[str]:
    return [
        f"| {r['label']} | {r['speedup']:.3f} | {r['tokens_per_step']:.2f} | {r['mean_chain']:.2f} "
        f"| {r['rejected_fraction']:.0%} | {r['drafted_depths_per_step']:.2f} |"
        for r in rows
    ]


# ============================================================================ CLI
def run_cli(args: argparse.Namespace) -> int:
    from ..demo import DEMO_HEADS
    from ..heads import load_heads
    from .data.tasks import calibration_prompts
    from .machine import set_threads
    from .models import load_base_model
    from .profile import forward_costs

    set_threads(args.threads)
    model, tokenizer = load_base_model(args.model)
    heads = load_heads(args.heads or str(DEMO_HEADS), model=model, base_config=model.config).eval()
    out = Path(args.out.replace("{task}", Path(args.task).stem))
    out.mkdir(parents=True, exist_ok=True)
    check_settings(
        out / "settings.json",
        {
            "model": args.model,
            "heads": heads_fingerprint(heads),
            "task": args.task,
            "max_new_tokens": args.max_new_tokens,
        },
    )
    replays = load_replays(out / "replays.json") if (out / "replays.json").is_file() else {}
    prompts = calibration_prompts(args.task, args.n)
    for p in tqdm(prompts, desc="replay", unit="prompt"):
        if p.prompt_id in replays:
            continue
        ids = p.render(tokenizer)
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        replays[p.prompt_id] = replay_chains(model, heads, gen[0].tolist(), len(ids))
        save_replays(out / "replays.json", replays)  # checkpoint per prompt
    chosen = [replays[p.prompt_id] for p in prompts]  # a larger earlier --n left more in the file
    prefix = int(statistics.median(len(r.tokens) for r in chosen))
    depth = heads.num_heads
    forward = forward_costs(
        model, list(range(1, depth + 2)), prefix_len=prefix, repeats=args.repeats, progress=True, heads=heads
    )
    costs = Costs(forward, drafting_costs(model, heads, repeats=args.repeats, prefix_len=prefix, progress=True))
    result = calibrate(chosen, costs)
    # the regime EAS was designed for, modelled only: verifying N tokens costs what one does (a GPU)
    result["flat_cost"] = calibrate(chosen, Costs({n: forward[1] for n in forward}, costs.draft))
    result.update(
        task=args.task,
        replays=len(chosen),
        new_tokens=sum(r.new_tokens for r in chosen),
        forward_costs={str(n): s for n, s in forward.items()},
        drafting_costs=costs.draft,
    )
    (out / "calibration.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "eas_config.json").write_text(json.dumps(result["config"], indent=1), encoding="utf-8")
    report = markdown(result, args.task, costs)
    (out / "report.md").write_text(report, encoding="utf-8")
    print(report)
    print(f"EAS settings for --eas-config: {out / 'eas_config.json'}")
    return 0


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eas-calibrate",
        help="choose EAS thresholds for a drafter and task by replaying its chain along greedy outputs",
        description="Replay the heads' chain from every position of greedy outputs on the task's calibration "
        "prompts, model each EAS setting's speed with forward and drafting costs timed here, write the "
        "fastest as eas_config.json (for bench --eas-config) and a report.",
    )
    p.add_argument("--task", required=True, help="humaneval, gsm8k, chat or a JSONL file")
    p.add_argument("--heads", help="heads folder or Hub id (default: the demo heads)")
    p.add_argument("--model", help="base model (default: the demo model)")
    p.add_argument("--n", type=int, default=16, help="calibration prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds of the cost timing")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="runs/eas-calibration-{task}", help="output folder ({task} is replaced)")
    p.set_defaults(func=run_cli)


def measure_overhead(model=None, heads=None, repeats: int = 200, tree=None) -> dict:
    """Median per-step cost (ms) of EAS on the demo model (or ``model`` + ``heads``).

    * ``decision_ms``: heads form, what the ``entropy`` policy adds per step (reading the
      chain's entropies to the host, the rule, the bookkeeping);
    * ``head_entropy_ms``: computing the entropies of one step's head distributions (the
      heads already compute them for every proposal; timed alone here);
    * ``draft_token_ms``: draft-model form, the entropy of one draft distribution over the
      full vocabulary plus the rule;
    * ``propose_ms`` / ``base_step_ms``: the chain proposal and one base decode step, for scale.
    """
    from ..heads import HydraHeads

    if model is None:
        from .models import load_base_model

        model, _ = load_base_model()
    if heads is None:
        torch.manual_seed(0)
        heads = HydraHeads.for_model(model).eval()
    depth = heads.num_heads
    tree = Tree.from_choices(tree) if tree is not None else Tree.chain(depth)
    union = tree.union(Tree.chain(tree.depth))
    index = union.node_index()
    chain_nodes = torch.tensor([index[(0,) * d] for d in range(1, tree.depth + 1)])
    buffers = union.buffers("cpu", torch.float32)
    state = heads.new_state(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 300))
    with torch.no_grad():
        out = model(ids, output_hidden_states=heads.hidden_states_request, use_cache=True)
        heads.observe(state, heads.features(out.hidden_states)[0], tokens=ids[0])
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        root = out.logits[0, -1].argmax()

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e3

    proposal = heads.propose(state, root.view(1), buffers)
    ctrl = EASController(EASConfig(warmup_tokens=0), k_max=tree.depth)
    ctrl.recent.extend([1.0] * ctrl.config.window)

    def decision() -> None:
        ctrl.chain_length(proposal.entropy[chain_nodes].tolist())
        ctrl.observe_verified(tree.num_nodes - 1, 1, 2)

    rows = [len(step.parents) for step in buffers.depth_plan]
    logps = [torch.log_softmax(torch.randn(r, heads.config.draft_vocab_rows), -1) for r in rows]
    logits = torch.randn(model.config.vocab_size)
    rule = ChainRule(max_length=99, end_cause="k_max", threshold=2.0, fork_level=None)
    with torch.no_grad():
        result = {
            "decision_ms": median_ms(decision),
            "head_entropy_ms": median_ms(lambda: [entropy_from_logp(lp) for lp in logps]),
            "draft_token_ms": median_ms(lambda: rule.cause_at(0, float(entropy_nats(logits)))),
            "propose_ms": median_ms(lambda: heads.propose(state, root.view(1), buffers)),
        }
        step = torch.tensor([[int(root)]])

        def base_step() -> None:
            model(step, cache=cache, use_cache=True)
            cache.crop(-1)

        result["base_step_ms"] = median_ms(base_step) if repeats else None
    result.update(
        tree_nodes=tree.num_nodes,
        chain_depth=tree.depth,
        head_rows_per_depth=rows,
        draft_vocab=heads.config.draft_vocab_rows,
        vocab=model.config.vocab_size,
        torch_threads=torch.get_num_threads(),
        repeats=repeats,
    )
    return result
