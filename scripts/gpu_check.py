"""A short, self-contained check of EntMTP on one accelerator (or this CPU), written to JSON and Markdown.

    python scripts/gpu_check.py --out runs/gpu-check                 # the demo model on CUDA, bf16 and fp16
    python scripts/gpu_check.py --device cpu --tiny --out runs/check # the same code on a tiny random model

In order, each step bounded so the whole run fits in about 8 minutes on one GPU:

1. greedy identity: EntMTP (the shipped banks, re-ranked for this device by the cost probe)
   against plain ``generate`` on a few prompts, in bfloat16 and float16 (a divergence is
   reported with the base model's logit gap there: near-ties are floating-point, not bugs);
2. the verification forward's cost c(N) for N = 1 to 128 tree nodes (the probe's timing);
3. tokens/s at batch size 1, interleaved, medians: plain ``generate``, prompt lookup decoding,
   Hydra's default tree (``mc_sim_7b_63``) and EntMTP* (the tree the probe chose from each
   bank's frontier), eager and compiled. Compiled is the package's route
   (:func:`~entmtp_hf.decoding.compiled.compiled_generation`): a static cache of a few hundred
   slots and ``CompileConfig()``'s mode, which on CUDA is CUDA graphs (``reduce-overhead``), on a
   CPU inductor's weight freezing. Compiled EntMTP's output is checked against compiled plain
   ``generate`` token for token; a method that fails is reported with its error, the others run on.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from entmtp_hf import MC_SIM_7B_63, EntMTPConfig, TopologyBank, Tree, enable_entmtp
from entmtp_hf.calibration import calibrate
from entmtp_hf.calibration.probe import forward_ms
from entmtp_hf.decoding.compiled import compiled_generation
from entmtp_hf.demo.compare import find_mismatch

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TASKS = ("humaneval", "gsm8k", "chat")


# ============================================================================ models
def tiny_setup(device: str, dtype: torch.dtype):
    """A tiny random Llama, random Hydra heads and a chain bank with a synthetic frontier."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from entmtp_hf.heads import HydraHeads

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    heads = HydraHeads.for_model(model, num_heads=4)
    enable_entmtp(model, heads)
    chains = [Tree.chain(d) for d in range(5)]
    banks = {}
    for task in TASKS:
        per_tree = [{"num_nodes": t.num_nodes, "mean_accept_length": 1.0 + 0.3 * t.depth} for t in chains]
        banks[task] = TopologyBank(
            task,
            chains,
            {"trees": per_tree, "frontier": {"trees": list(range(5))}, "scheduler": {"static": 2, "policy": "static"}},
        )
    prompts = {
        task: [torch.randint(0, 64, (1, 12 + i), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        for task in TASKS
    }
    return model, banks, prompts


def demo_setup(device: str, dtype: torch.dtype, n: int):
    """The demo model with its shipped heads and banks, and ``n`` evaluation prompts per task."""
    from entmtp_hf.demo import load_demo
    from entmtp_hf.tools.data.tasks import evaluation_basket

    model, tokenizer, bank_dir = load_demo()
    model = model.to(device=device, dtype=dtype)
    enable_entmtp(model, model.entmtp_heads)  # the heads follow the model's device and dtype
    banks = {task: TopologyBank.from_pretrained(bank_dir, task=task) for task in TASKS}
    prompts = {
        task: [torch.tensor([p.render(tokenizer)], device=device) for p in evaluation_basket(task, n)] for task in TASKS
    }
    return model, banks, prompts


# ============================================================================ steps
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def identity(model, banks, prompts, tokens: int) -> dict:
    """Greedy EntMTP (each bank, re-ranked here) against plain generate, token for token."""
    out = {}
    for task, bank in banks.items():
        for i, ids in enumerate(prompts[task]):
            ids = ids.to(model.device)
            ref = model.generate(ids, max_new_tokens=tokens, do_sample=False)
            got = model.generate(
                ids, max_new_tokens=tokens, do_sample=False, entmtp_config=EntMTPConfig(bank=bank, task=task)
            )
            diff = find_mismatch(
                ref[0, ids.shape[1] :].tolist(), got[0, ids.shape[1] :].tolist(), model, ids[0].tolist()
            )
            out[f"{task}-{i}"] = {"identical": diff is None, "mismatch": diff}
    return out


def methods(model, bank, task: str, costs, compiled: dict) -> dict[str, dict]:
    """name -> generate kwargs at batch size 1."""
    chosen = bank.trees[bank.scheduler_for(costs).static]
    heads_fit = model.entmtp_heads.config.draft_vocab_rows >= 10 and model.entmtp_heads.num_heads >= 4
    out = {"vanilla": {}, "vanilla-compiled": dict(compiled), "pld": {"prompt_lookup_num_tokens": 10}}
    if heads_fit:
        out["hydra-default"] = {"entmtp_config": EntMTPConfig(tree=MC_SIM_7B_63)}
    out["entmtp-static"] = {"entmtp_config": EntMTPConfig(bank=bank, task=task)}
    out["entmtp-static-compiled"] = {"entmtp_config": EntMTPConfig(bank=bank, task=task), **compiled}
    out["_tree"] = {"num_nodes": chosen.num_nodes, "depth": chosen.depth}
    return out


def timing(model, banks, prompts, costs, tokens: int, device: str) -> dict:
    """Tokens/s per task and method, interleaved over the prompts (one warm-up each, compiles included);
    compiled EntMTP's tokens against compiled plain generate's, prompt by prompt."""
    longest = max(ids.shape[1] for p in prompts.values() for ids in p)
    compiled = compiled_generation(max_cache_len=longest + tokens + 256)  # room for the widest tree
    result = {}
    for task, bank in banks.items():
        plan = methods(model, bank, task, costs, compiled)
        tree = plan.pop("_tree")
        warm, errors = {}, {}
        for name, kwargs in plan.items():
            t0 = time.perf_counter()
            try:
                model.generate(prompts[task][0], max_new_tokens=8, do_sample=False, **kwargs)
            except Exception as e:  # reported, so that one route's failure does not hide the others' figures
                errors[name] = f"{type(e).__name__}: {e}"[:500]
            warm[name] = time.perf_counter() - t0
        runs = {name: kw for name, kw in plan.items() if name not in errors}
        tps: dict[str, list[float]] = {name: [] for name in runs}
        compiled_identical = []
        for ids in prompts[task]:
            new = {}
            for name, kwargs in runs.items():
                _sync(device)
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=tokens, do_sample=False, **kwargs)
                _sync(device)
                seqs = getattr(out, "sequences", out)
                tps[name].append((seqs.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
                new[name] = seqs[0, ids.shape[1] :].tolist()
            if "vanilla-compiled" in new and "entmtp-static-compiled" in new:
                diff = find_mismatch(new["vanilla-compiled"], new["entmtp-static-compiled"], model, ids[0].tolist())
                compiled_identical.append({"identical": diff is None, "mismatch": diff})
        base = statistics.median(tps["vanilla"])
        result[task] = {
            "entmtp_tree": tree,
            "warm_up_seconds": warm,
            "errors": errors,
            "compiled_identity": compiled_identical,
            "tokens_per_s": {n: statistics.median(v) for n, v in tps.items()},
            "speedup": {n: statistics.median(v) / base for n, v in tps.items()},
        }
    return result


# ============================================================================ report
def markdown(report: dict) -> str:
    lines = [
        "# EntMTP device check",
        "",
        f"Device: {report['device_name']} ({report['device']}); torch "
        f"{report['torch']}; model: {report['model']}; {report['seconds']:.0f} s in all.",
        "",
    ]
    for dtype, part in report["dtypes"].items():
        same = sum(r["identical"] for r in part["identity"].values())
        lines += [
            f"## {dtype}",
            "",
            f"Greedy identity: {same} of {len(part['identity'])} outputs token-identical to plain generate.",
        ]
        for key, r in part["identity"].items():
            if not r["identical"]:
                lines.append(
                    f"- {key}: from token {r['mismatch']['position']} on, logit gap {r['mismatch']['logit_gap']}"
                )
        c = part["forward_ms"]
        lines += [
            "",
            "| N | " + " | ".join(map(str, c)) + " |",
            "|---|" + "---|" * len(c),
            "| c(N) | " + " | ".join(f"{c[n] / c[1]:.2f}" for n in c) + " |",
            "",
        ]
        if "timing" in part:
            names = list(dict.fromkeys(n for t in part["timing"].values() for n in t["warm_up_seconds"]))
            lines += ["| task | EntMTP* tree | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
            for task, t in part["timing"].items():
                cells = [
                    f"{t['tokens_per_s'][n]:.1f} ({t['speedup'][n]:.2f}x)" if n in t["speedup"] else "failed"
                    for n in names
                ]
                lines.append(f"| {task} | {t['entmtp_tree']['num_nodes']} nodes | " + " | ".join(cells) + " |")
            lines.append("")
            for task, t in part["timing"].items():
                same = sum(r["identical"] for r in t["compiled_identity"])
                lines.append(
                    f"- {task}: compiled EntMTP token-identical to compiled plain generate on {same} of "
                    f"{len(t['compiled_identity'])} prompts; warm-up (compiles) "
                    + ", ".join(f"{n} {s:.0f} s" for n, s in t["warm_up_seconds"].items())
                )
                lines += [
                    f"  - from token {r['mismatch']['position']} on, logit gap {r['mismatch']['logit_gap']}"
                    for r in t["compiled_identity"]
                    if not r["identical"]
                ]
                lines += [f"- {task}: {n} failed: {e}" for n, e in t["errors"].items()]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (the CPU test of this script)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per task")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per timed generation")
    parser.add_argument("--no-timing", action="store_true", help="identity and c(N) only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: pass --device cpu", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    report = {
        "device": args.device,
        "device_name": name,
        "torch": torch.__version__,
        "model": "tiny random Llama" if args.tiny else "SmolLM2-135M-Instruct",
        "dtypes": {},
    }
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        setup = tiny_setup(args.device, dtype) if args.tiny else demo_setup(args.device, dtype, args.prompts)
        model, banks, prompts = setup
        costs = calibrate(model, model.entmtp_heads)[1]  # this device's probe (cached), which re-ranks the banks
        part = {
            "identity": identity(model, banks, prompts, tokens=64 if not args.tiny else 16),
            "forward_ms": forward_ms(model, model.entmtp_heads, SIZES, repeats=3),
            "probe_seconds": costs.seconds,
        }
        if not args.no_timing:
            part["timing"] = timing(model, banks, prompts, costs, args.tokens, args.device)
        if args.device.startswith("cuda"):
            part["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        report["dtypes"][dtype_name] = part
        del model
    report["seconds"] = time.perf_counter() - t0
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    (out / "gpu_check.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
