"""Session 9. Pooled speed-ups over several benchmark runs of one task. Each run gives per-prompt ratios
(to vanilla, or to entmtp-static) from its own interleaved rounds; a prompt that ran in several runs (the
runs draw the same evaluation pool: --seed only changes the sampling draws) counts once, with the geometric
mean of its ratios, so the bootstrap 95% interval resamples distinct prompts. usage: pool.py TASK results.json ..."""
import json, math, statistics, sys
from collections import defaultdict
from entmtp_hf.bench_report import bootstrap_interval
task, files = sys.argv[1], sys.argv[2:]
runs = [json.load(open(f)) for f in files]
def gm(xs): return math.exp(statistics.fmean(math.log(x) for x in xs))
for ref, method in [("vanilla", "entmtp-static"), ("vanilla", "entmtp-value"), ("entmtp-static", "entmtp-value")]:
    by_prompt, per, total = defaultdict(list), [], 0
    for r in runs:
        rec = {m: {x["prompt_index"]: x for x in r["records"] if x["task"] == task and x["method"] == m}
               for m in (ref, method)}
        pairs = [(rec[method][i]["prompt_id"], rec[method][i]["tokens_per_s"] / rec[ref][i]["tokens_per_s"])
                 for i in sorted(set(rec[ref]) & set(rec[method]))
                 if rec[ref][i].get("tokens_per_s") and rec[method][i].get("tokens_per_s")]
        for pid, speed in pairs:
            by_prompt[pid].append(speed)
        if pairs:
            per.append(f"{gm([p[1] for p in pairs]):.3f} ({len(pairs)})")
            total += len(pairs)
    speeds = [gm(v) for v in by_prompt.values()]
    if speeds:
        lo, hi = bootstrap_interval(speeds)
        print(f"{method} over {ref}: {gm(speeds):.3f} ({lo:.2f}-{hi:.2f}) over {len(speeds)} distinct prompts "
              f"({total} prompt runs); per run {', '.join(per)}")
