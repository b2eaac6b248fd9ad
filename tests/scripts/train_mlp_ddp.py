"""tests/scripts/train_mlp.py under DDP, in the shape of nanoGPT's train.py; it imports nothing of rollback-supervisor.

    torchrun --standalone --nproc_per_node=2 train_mlp_ddp.py --backend=gloo --max_iters=300
    torchrun --standalone --nproc_per_node=2 train_mlp_ddp.py --backend=gloo --init_from=resume

Like nanoGPT under torchrun: DDP when `RANK` is set (`init_process_group(backend)`), the master process (rank
0) alone writes `ckpt.pt` (overwritten in place with `torch.save` every `save_interval` iterations) and prints
the `iter N: loss X, lr Y` lines, every rank resumes from that file, and each rank draws its own batches. Every
rank prints its configuration (`rank R: peak learning rate X`), so a test sees what each one was given; with
`--print_all_ranks=True` every rank prints its own `iter` line too (a script that does not guard its prints).
"""

import os
import sys
import time
from ast import literal_eval

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

config = {
    "out_dir": "out",
    "init_from": "scratch",  # or "resume": continue from out_dir/ckpt.pt
    "max_iters": 300,
    "learning_rate": 0.05,
    "warmup_iters": 100,
    "save_interval": 10,
    "batch_size": 32,
    "seed": 0,
    "iter_time": 0.0,  # seconds each iteration lasts at least, as a bigger model's would
    "backend": "nccl",
    "print_all_ranks": False,
}
for arg in sys.argv[
    1:
]:  # nanoGPT's configurator: a Python literal of the default's exact type, else the text
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in config:
        sys.exit(f"unknown option --{key}")
    try:
        attempt = literal_eval(value)
    except (SyntaxError, ValueError):
        attempt = value
    if type(attempt) is not type(config[key]):
        sys.exit(f"--{key}={value}: expected a {type(config[key]).__name__}, got a {type(attempt).__name__}")
    config[key] = attempt

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend=config["backend"])
    rank, world = dist.get_rank(), dist.get_world_size()
else:
    rank, world = 0, 1
master_process = rank == 0

torch.manual_seed(config["seed"])  # the same data and initial weights on every rank
inputs = torch.randn(2048, 32)
targets = torch.sin(inputs @ torch.randn(32, 1)) + 0.1 * torch.randn(2048, 1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=config["learning_rate"], momentum=0.5)
ckpt_path = os.path.join(config["out_dir"], "ckpt.pt")
iter_num = 0
if config["init_from"] == "resume":
    checkpoint = torch.load(ckpt_path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
    print(f"rank {rank}: resuming from {ckpt_path} at iter {iter_num}")
raw_model = model
if ddp:
    model = DistributedDataParallel(model)
if master_process:
    os.makedirs(config["out_dir"], exist_ok=True)
print(f"rank {rank}: peak learning rate {config['learning_rate']}")


def get_lr(it):
    return config["learning_rate"] * min(1.0, (it + 1) / config["warmup_iters"])


while True:
    started = time.monotonic()
    if (
        master_process
        and iter_num > 0
        and (iter_num % config["save_interval"] == 0 or iter_num == config["max_iters"])
    ):
        state = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(state, ckpt_path)  # in place, not atomic: what nanoGPT does
    if iter_num >= config["max_iters"]:
        break
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    draw = torch.Generator().manual_seed(iter_num * world + rank)  # each rank its own batch
    batch = torch.randint(0, len(inputs), (config["batch_size"],), generator=draw)
    loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if master_process or config["print_all_ranks"]:
        print(f"iter {iter_num}: loss {loss.item():.6g}, lr {lr:.6g}")
    iter_num += 1
    time.sleep(max(0.0, config["iter_time"] - (time.monotonic() - started)))
if ddp:
    dist.destroy_process_group()
if master_process:
    print("training done")
