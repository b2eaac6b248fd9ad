"""A third-party training script in the style of nanoGPT's train.py; it imports nothing of rollback-supervisor.

    python train_mlp.py --out_dir=out --max_iters=300 --learning_rate=0.05
    python train_mlp.py --out_dir=out --init_from=resume --learning_rate=0.0125

Like nanoGPT: `--key=value` overrides read as its configurator reads them (a Python literal of the default's
exact type, so `--learning_rate=2` is refused), prints never flushed (the supervisor sets PYTHONUNBUFFERED), a
linear learning-rate warm-up, one `ckpt.pt` in `out_dir` overwritten in place with `torch.save` every
`save_interval` iterations (the state after `iter_num` updates), and one `iter N: loss X, lr Y` line per
iteration. Unlike nanoGPT it saves everything a bit-exact resume needs: the batch of iteration N is drawn from
a generator seeded with N, and the optimizer state is in the checkpoint.
"""

import os
import sys
import time
from ast import literal_eval

import torch

config = {
    "out_dir": "out",
    "init_from": "scratch",  # or "resume": continue from out_dir/ckpt.pt
    "max_iters": 300,
    "learning_rate": 0.05,
    "warmup_iters": 100,
    "save_interval": 10,
    "batch_size": 64,
    "seed": 0,
    "iter_time": 0.0,  # seconds each iteration lasts at least, as a bigger model's would
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
    if type(attempt) is not type(config[key]):  # nanoGPT asserts this: --learning_rate=2 fails, 2.0 works
        sys.exit(f"--{key}={value}: expected a {type(config[key]).__name__}, got a {type(attempt).__name__}")
    config[key] = attempt

torch.manual_seed(config["seed"])
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
    print(f"resuming from {ckpt_path} at iter {iter_num}")
os.makedirs(config["out_dir"], exist_ok=True)
print(f"peak learning rate {config['learning_rate']}")


def get_lr(it):
    return config["learning_rate"] * min(1.0, (it + 1) / config["warmup_iters"])


while True:
    started = time.monotonic()
    if iter_num > 0 and (iter_num % config["save_interval"] == 0 or iter_num == config["max_iters"]):
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(state, ckpt_path)  # in place, not atomic: what nanoGPT does
    if iter_num >= config["max_iters"]:
        break
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    draw = torch.Generator().manual_seed(iter_num)
    batch = torch.randint(0, len(inputs), (config["batch_size"],), generator=draw)
    loss = torch.nn.functional.mse_loss(model(inputs[batch]), targets[batch])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    value = loss.item()
    print(f"iter {iter_num}: loss {value:.6g}, lr {lr:.6g}")
    iter_num += 1
    time.sleep(max(0.0, config["iter_time"] - (time.monotonic() - started)))
print("training done")
