"""A Session loop under torchrun whose every step draws from the process's RNG streams, in the data as in the
model: each sample gets fresh noise when the loader reads it (`torch.randn` in `__getitem__`, no workers), and
the model has dropout. Each rank seeds its streams differently. A replay, or the replay's second stage (which
moves one rank's batches to another rank's device), sees the same values only if every draw is the same as the
first time.

    torchrun --standalone --nproc_per_node=2 tests/scripts/train_noisy_ddp.py STEPS
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from supervisor.data import ResumableLoader
from supervisor.runtime import Session


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=generator)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.1 * torch.randn(16), self.y[i]  # the process's stream: a fresh draw each read


def main() -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    torch.manual_seed(1000 + rank)  # then every rank's own streams
    loader = ResumableLoader(Noisy(512), batch_size=8, shuffle=True, seed=0, rank=rank, world_size=world)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = DistributedDataParallel(model)
    sess = Session.attach(run_name="noisy")
    sess.register(model=model, optimizer=opt, data=loader)
    with sess:
        for _, (x, y) in sess.loop(loader, max_steps=int(sys.argv[1])):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sess.log(loss=loss.item())
    code = sess.exit_code
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
