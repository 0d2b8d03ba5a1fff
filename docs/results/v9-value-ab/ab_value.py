"""A/B on chat (session 9): the value policy with the 2-node tree (T-) added in front of the bank's value set
("value+2", c(2) = 1.01 from profile-v8) against the bank's value set ("value") and the static tree, with vanilla
as the reference; interleaved per prompt (order rotating), one thread. It ran against the session-8 banks
(commit 6bf9faf: chat's value set = 3-node chain, 3-node fan, 4-node tree, 4-node fan); greedy.txt and
sampled.txt are its output (`taskset -c 0 ... greedy 0 20`, `taskset -c 1 ... sample 20 20`).
usage, from the repository root: ab_value.py MODE(greedy|sample) FIRST N [TOKENS] [TASK] [C2]"""
import statistics, sys, time, json, torch
from entmtp_hf.demo import load_demo
from entmtp_hf.bank import TopologyBank
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.tasks import split_prompts
torch.set_num_threads(1)
mode, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
task = sys.argv[5] if len(sys.argv) > 5 else "chat"
model, tok, banks = load_demo(None)
bank = TopologyBank.from_pretrained(str(banks), task=task)
sd = bank.scheduler
print(sd, flush=True)
T = [t.choices for t in bank.trees]
vt = list(sd.value); vc = list(sd.value_costs)
c2 = float(sys.argv[6]) if len(sys.argv) > 6 else 1.01
small = [i for i in range(len(bank.trees)) if bank.trees[i].num_nodes == 2][0]
methods = {
    "vanilla": None,
    "static": EntMTPConfig(bank=str(banks), task=task, policy="static"),
    "value": EntMTPConfig(bank=str(banks), task=task, policy="value"),
    "value+2": EntMTPConfig(trees=[T[small]] + [T[i] for i in vt], policy="value", costs=[c2] + vc),
}
pool, _ = split_prompts(task)
prompts = pool[first:first + n]
kw = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0) if mode == "sample" else dict(do_sample=False)
rec = {m: [] for m in methods}
names = list(methods)
for i, p in enumerate(prompts):
    ids = torch.tensor([p.render(tok)])
    order = names[i % len(names):] + names[:i % len(names)]
    for m in order:
        cfg = methods[m]
        torch.manual_seed(1000 + i)
        t0 = time.perf_counter()
        if cfg is None:
            out = model.generate(ids, max_new_tokens=tokens, return_dict_in_generate=True, **kw)
            steps = None
        else:
            out = model.generate(ids, max_new_tokens=tokens, return_dict_in_generate=True, entmtp_config=cfg, **kw)
            steps = len(out.entmtp_stats["accept_lengths"])
        dt = time.perf_counter() - t0
        new = out.sequences.shape[1] - ids.shape[1]
        rec[m].append({"tps": new / dt, "new": new, "steps": steps, "ids": out.sequences[0, ids.shape[1]:].tolist() if mode == "greedy" else None})
    line = {m: round(rec[m][-1]["tps"] / rec["vanilla"][-1]["tps"], 3) for m in names[1:]}
    print(i, line, flush=True)
def gm(xs): return float(torch.tensor(xs).log().mean().exp())
for m in names[1:]:
    r = [a["tps"] / b["tps"] for a, b in zip(rec[m], rec["vanilla"])]
    tau = sum(a["new"] for a in rec[m]) / sum(a["steps"] for a in rec[m])
    same = sum(a["ids"] == b["ids"] for a, b in zip(rec[m], rec["vanilla"])) if mode == "greedy" else None
    vs = [a["tps"] / b["tps"] for a, b in zip(rec[m], rec["static"])]
    print(f"{m}: vs vanilla {gm(r):.3f}  vs static {gm(vs):.3f}  tau {tau:.3f}  identical {same}")
json.dump(rec, open(f"runs/s9/ab_value_{task}_{mode}_{first}.json", "w"))
