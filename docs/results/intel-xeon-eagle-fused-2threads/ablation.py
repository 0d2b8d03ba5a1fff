"""A/B/C: does the round-5 drafter gain from (B) fused low/mid base features, or (C) a second layer?
Same data subset, same steps, same schedule; teacher-forced validation top-1 per depth."""
import json, sys, time, copy, math, os
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
from entmtp_hf.heads import DraftHeads
from entmtp_hf.heads.eagle import RMSNorm
from entmtp_hf.tools.training.teacher import TeacherCache, pack, epoch_batches
from entmtp_hf.tools.training.objective import teacher_logprobs, distill_loss, head_targets
from entmtp_hf.demo.model import load_base_model
torch.set_num_threads(2); torch.manual_seed(0)
OUT, STEPS, NTRAIN, ARMS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
os.makedirs(OUT, exist_ok=True)
log = open(f"{OUT}/log.txt", "a")
def say(*a):
    s = time.strftime("%H:%M:%S ") + " ".join(map(str, a)); print(s, flush=True); log.write(s + "\n"); log.flush()
cache = TeacherCache("runs/eagle5/data")
rng = np.random.default_rng(0)
tr, va = cache.split(0), cache.split(1)
tr = np.sort(rng.choice(tr, NTRAIN, replace=False))
ks = np.concatenate([tr, va]); lengths = cache.seqs[:, 1]
say("train seqs", len(tr), "tokens", int(lengths[tr].sum()), "val", len(va), int(lengths[va].sum()))
model, tok = load_base_model()
H, LOW, MID = 576, 2, 15
# --- extra features: hidden_states[2], [15] of every sequence in ks (bf16 autocast like the cache)
feat_path = f"{OUT}/extra.npz"
row = {}
if os.path.exists(feat_path):
    z = np.load(feat_path); extra = z["extra"]; order = z["order"]
else:
    order = ks; tot = int(lengths[ks].sum()); extra = np.zeros((tot, 2, H), np.float16); o2 = 0
    t0 = time.time()
    with torch.no_grad():
        for bi, b in enumerate(pack(list(ks), lengths, 4096)):
            L = int(lengths[b].max()); ids = np.zeros((len(b), L), np.int64)
            for r, k in enumerate(b): ids[r, :lengths[k]] = cache.ids(k)
            m = (torch.arange(L)[None] < torch.from_numpy(lengths[b])[:, None]).long()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model.model(input_ids=torch.from_numpy(ids), attention_mask=m, output_hidden_states=True, use_cache=False)
            hs = torch.stack([out.hidden_states[LOW], out.hidden_states[MID]], 2).float().numpy()
            for r, k in enumerate(b):
                row[int(k)] = o2; n = lengths[k]; extra[o2:o2 + n] = hs[r, :n]; o2 += n
            if bi % 10 == 0: say("extract", bi, o2, f"{o2/(time.time()-t0):.0f} tok/s")
    order = np.array(sorted(row, key=row.get))
    np.savez(feat_path, extra=extra, order=order)
offs = np.concatenate([[0], np.cumsum(lengths[order])[:-1]]); row = {int(k): int(o) for k, o in zip(order, offs)}
say("extra features ready", extra.shape)

def batch(b):
    d = cache.batch(b); t = d["ids"].shape[1]
    ex = np.zeros((len(b), t, 2, H), np.float32)
    for r, k in enumerate(b): ex[r, :lengths[k]] = extra[row[int(k)]: row[int(k)] + lengths[k]]
    d["extra"] = torch.from_numpy(ex); return d

embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
base = DraftHeads.from_pretrained("src/entmtp_hf/demo/assets/smollm2-135m-eagle").float()

class Fuse(nn.Module):
    def __init__(self):
        super().__init__(); self.nl, self.nm = RMSNorm(H, 1e-5), RMSNorm(H, 1e-5)
        self.w = nn.Linear(2 * H, H, bias=False); nn.init.zeros_(self.w.weight)
    def forward(self, f, ex):
        return f + self.w(torch.cat([self.nl(ex[..., 0, :]), self.nm(ex[..., 1, :])], -1))

def make(arm):
    heads = copy.deepcopy(base); fuse = None
    if arm == "fuse":
        fuse = Fuse()
    if arm == "2layer":
        from entmtp_hf.heads.eagle import DraftLayer
        from entmtp_hf.heads.hydra import build_prefix_config
        lc = build_prefix_config(heads.config.prefix_layer_config)
        new = DraftLayer(lc, False, input_norm=True)
        with torch.no_grad():
            new.load_state_dict(heads.layers[0].state_dict(), strict=False)
            new.self_attn.o_proj.weight.zero_(); new.mlp.down_proj.weight.zero_()
        heads.layers.append(new); heads.config.num_layers = 2
    return heads, fuse

def student(heads, fuse, d):
    hid = d["hidden"]
    if fuse is not None:
        orig = heads.committed_feature
        heads.committed_feature = lambda h: fuse(h, d["extra"])
        try: return heads.forward_train(hid, d["ids"], embed, lm_head)
        finally: del heads.committed_feature
    return heads.forward_train(hid, d["ids"], embed, lm_head)

@torch.no_grad()
def evaluate(heads, fuse):
    heads.eval(); n = heads.num_heads; hit = np.zeros(n); rows_n = np.zeros(n); kl = np.zeros(n)
    vocab = heads.draft_vocab
    for b in pack(list(va), lengths, 4096):
        d = batch(b); st = student(heads, fuse, d)
        w, bias = heads._base_lm_rows(lm_head); teacher = teacher_logprobs(d["hidden"], w, bias)
        for i, lg in enumerate(st):
            target, rows = head_targets(teacher, d["sup"], d["valid"], i)
            top = vocab[lg[rows].argmax(-1)]; truth = d["greedy"][:, i + 1:][rows]
            hit[i] += (top == truth).sum().item(); rows_n[i] += rows.sum().item()
            t, q = target[rows], torch.log_softmax(lg[rows].float(), -1); kl[i] += (t.exp() * (t - q)).sum().item()
    heads.train(); return {"top1": (hit / rows_n).round(4).tolist(), "kl": (kl / rows_n).round(4).tolist()}

results = json.load(open(f"{OUT}/results.json")) if os.path.exists(f"{OUT}/results.json") else {}
if "start" not in results:
    results["start"] = evaluate(base, None); say("start", results["start"])
for arm in ARMS:
    if arm in results: continue
    heads, fuse = make(arm)
    old = [p for p in heads.parameters() if p.requires_grad]
    new = list(fuse.parameters()) if fuse is not None else []
    if arm == "2layer":
        newids = {id(p) for p in heads.layers[1].parameters()}
        new = [p for p in old if id(p) in newids]; old = [p for p in old if id(p) not in newids]
    groups = [{"params": old, "lr": 1e-4}] + ([{"params": new, "lr": 1e-3}] if new else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 10) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / STEPS))))
    batches = epoch_batches(tr, lengths, 1024, 0, 0); t0 = time.time(); step = 0
    while step < STEPS:
        for b in batches:
            d = batch(b)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                st = student(heads, fuse, d)
            with torch.no_grad():
                w, bias = heads._base_lm_rows(lm_head); teacher = teacher_logprobs(d["hidden"], w, bias)
            loss, per = distill_loss(st, teacher, d["sup"], d["valid"], 0.0, 0.8)
            loss.backward(); torch.nn.utils.clip_grad_norm_(old + new, 1.0); opt.step(); sched.step(); opt.zero_grad()
            step += 1
            if step % 25 == 0: say(arm, step, round(loss.item(), 4), f"{time.time()-t0:.0f}s")
            if step >= STEPS: break
    results[arm] = evaluate(heads, fuse); results[arm]["seconds"] = round(time.time() - t0)
    say(arm, results[arm]); json.dump(results, open(f"{OUT}/results.json", "w"), indent=1)
say("done", json.dumps(results))
