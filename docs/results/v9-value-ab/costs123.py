import sys, torch, json
from entmtp_hf.demo_model import load_base_model
from entmtp_hf.profile import forward_costs
torch.set_num_threads(1)
m, _ = load_base_model()
prefix = int(sys.argv[1])
c = forward_costs(m, (1, 2, 3, 4), prefix_len=prefix, repeats=int(sys.argv[2]))
print(prefix, {n: round(v / c[1], 4) for n, v in c.items()}, {n: round(v * 1e3, 2) for n, v in c.items()})
