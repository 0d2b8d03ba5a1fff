"""Session 9. Pooled speed-ups over several benchmark runs of one task: per-prompt ratios to vanilla (and to
entmtp-static) from each run's own interleaved rounds, geometric mean and bootstrap 95% interval over all
prompts. usage: pool.py TASK results.json [results.json ...]"""
import json, math, statistics, sys
from entmtp_hf.bench_report import bootstrap_interval, paired_ratios
task, files = sys.argv[1], sys.argv[2:]
runs = [json.load(open(f)) for f in files]
def gm(xs): return math.exp(statistics.fmean(math.log(x) for x in xs))
for ref, method in [("vanilla", "entmtp-static"), ("vanilla", "entmtp-value"), ("entmtp-static", "entmtp-value")]:
    speed, tau, per = [], [], []
    for f, r in zip(files, runs):
        pairs = paired_ratios(r, task, ref, method)
        if pairs:
            per.append(f"{gm([p[0] for p in pairs]):.3f} ({len(pairs)})")
        speed += [p[0] for p in pairs]; tau += [p[1] for p in pairs]
    if speed:
        lo, hi = bootstrap_interval(speed)
        print(f"{method} over {ref}: {gm(speed):.3f} ({lo:.2f}-{hi:.2f}), {len(speed)} prompts; per run {', '.join(per)}")
