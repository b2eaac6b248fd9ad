import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MODE", "x")
from exp import build, sharded, train
from torch.distributed.tensor import DTensor

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
model, opt = build(0, w)
train(model, opt, r, 1)
skel, flat = sharded(model, opt)
live = {}
for n, p in model.named_parameters():
    live[f"model.{n}"] = p.to_local().data_ptr()
    for k, v in opt.state[p].items():
        live[f"optim.state.{n}.{k}"] = (v.to_local() if isinstance(v, DTensor) else v).data_ptr()
al = {k: ((v.to_local() if isinstance(v, DTensor) else v).data_ptr() == live.get(k)) for k, v in flat.items()}
print(
    json.dumps(
        {"rank": r, "aliased": sum(al.values()), "of": len(al), "not": [k for k, a in al.items() if not a]}
    )
)
dist.destroy_process_group()
