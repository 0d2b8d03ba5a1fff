"""A/B under sampling (T = 0.7) on chat, session 9: the value policy over session 8's set (3-node chain and fan, 4-node tree and fan), session 9's (2-node tree, 3-node chain and fan) and their union, against the static tree and vanilla; c(N) from the chat search's 60-round costs; 15 prompts per process (two processes, one per core), order rotating. usage: ab_sets.py FIRST N SEED"""
import sys, time, json, torch
from entmtp_hf.demo import load_demo
from entmtp_hf.bank import TopologyBank
from entmtp_hf.config import EntMTPConfig
from entmtp_hf.tasks import split_prompts
from entmtp_hf.search import fan
from entmtp_hf.tree import Tree
torch.set_num_threads(1)
first, n, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model, tok, banks = load_demo(None)
bank = TopologyBank.from_pretrained(str(banks), task="chat")
byname = {}
for i, t in enumerate(bank.trees):
    byname.setdefault(t.num_nodes, t)
f2, f3, f4 = byname[2], byname[3], byname[4]
assert f3 == Tree.chain(2), f3
c = {2: 1.0231, 3: 1.0938, 4: 1.5413}
def cfg(trees):
    return EntMTPConfig(trees=[t.choices for t in trees], policy="value", costs=[c[t.num_nodes] for t in trees])
methods = {
    "vanilla": None,
    "static": EntMTPConfig(bank=str(banks), task="chat", policy="static"),
    "s8set": cfg([f3, fan(3), f4, fan(4)]),
    "s9set": cfg([f2, f3, fan(3)]),
    "union": cfg([f2, f3, fan(3), f4, fan(4)]),
}
print("f4", f4.choices, flush=True)
pool, _ = split_prompts("chat")
import random
idx = list(range(len(pool))); random.Random(seed).shuffle(idx)
prompts = [pool[i] for i in idx[first:first + n]]
kw = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
rec = {m: [] for m in methods}; names = list(methods)
for i, p in enumerate(prompts):
    ids = torch.tensor([p.render(tok)])
    order = names[i % len(names):] + names[:i % len(names)]
    for m in order:
        torch.manual_seed(1000 + i)
        t0 = time.perf_counter()
        if methods[m] is None:
            out = model.generate(ids, max_new_tokens=128, return_dict_in_generate=True, **kw); steps = None
        else:
            out = model.generate(ids, max_new_tokens=128, return_dict_in_generate=True, entmtp_config=methods[m], **kw)
            steps = len(out.entmtp_stats["accept_lengths"])
        dt = time.perf_counter() - t0
        rec[m].append({"tps": (out.sequences.shape[1] - ids.shape[1]) / dt, "new": out.sequences.shape[1] - ids.shape[1], "steps": steps})
    print(i, {m: round(rec[m][-1]["tps"] / rec["static"][-1]["tps"], 3) for m in names}, flush=True)
json.dump(rec, open(f"runs/s9/ab_sets_{seed}_{first}.json", "w"))
