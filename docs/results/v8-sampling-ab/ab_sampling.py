"""A/B of the sampled EntMTP* step (session 8): the inverse-CDF sampler and one batched call of row-wise
logits processors ("new") against torch.multinomial and per-depth processor calls ("old"), swapped by
monkeypatching in one process, interleaved (order alternating by round), 3 chat prompts x N rounds, 96 tokens,
T = 0.7. Prints the median ms per decode step of each and the old/new ratio of every pair.
Run from the repository root: `taskset -c 0 .venv/bin/python docs/results/v8-sampling-ab/ab_sampling.py 4`."""
import statistics, sys, torch
import entmtp_hf.generation as G
from transformers.generation.logits_process import LogitsProcessor
from entmtp_hf.demo import load_demo, config_for, _encode
torch.set_num_threads(1)
model, tok, banks = load_demo(None)
cfg = config_for(banks, "chat")
texts = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "What are some tips for staying productive when working from home?",
         "Explain why the sky is blue to a ten year old."]
new_pick = G.sample_picks
def old_pick(scores, generator=None):
    return torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(-1)
class Ident(LogitsProcessor):
    def __call__(self, input_ids, scores): return scores
orig_process = G._process_tree_scores
def old_process(lp, *a):
    from transformers.generation.logits_process import LogitsProcessorList
    return orig_process(LogitsProcessorList([*lp, Ident()]) if lp else lp, *a)
res = {"new": [], "old": []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    for t in texts:
        ids = _encode(tok, t)
        for name in (["new", "old"] if r % 2 == 0 else ["old", "new"]):
            G.sample_picks = new_pick if name == "new" else old_pick
            G._process_tree_scores = orig_process if name == "new" else old_process
            torch.manual_seed(r)
            out = model.generate(ids, max_new_tokens=96, do_sample=True, temperature=0.7, entmtp_config=cfg,
                                 return_dict_in_generate=True)
            st = out.entmtp_stats
            steps = len(st["accept_lengths"])
            res[name].append((st["total_time"] - st["prefill_time"]) / steps * 1e3)
ratio = [o / n for n, o in zip(res["new"], res["old"])]
print("ms/step new", statistics.median(res["new"]), "old", statistics.median(res["old"]),
      "old/new median", statistics.median(ratio), sorted(round(x, 3) for x in ratio))
