"""The standard workload: a small character-level transformer LM, supervised by rollback-supervisor.

Runs stand-alone (local MLflow sqlite store and checkpoints under .rollback/) or under
`rollback-supervisor run`, which hands it a launch plan through the environment. Under torchrun it trains
data-parallel (DDP, gloo): each rank reads its own shard and draws its own dropout stream.

    python examples/charlm.py --steps 300
    torchrun --standalone --nproc_per_node=2 examples/charlm.py --steps 300
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from supervisor.data import ResumableLoader
from supervisor.runtime import Session
from supervisor.state import rank_seed

DATA = Path(__file__).resolve().parent / "data" / "shakespeare.txt"

#: name -> (d_model, n_layers, n_heads, seq_len). `tiny` runs 300 steps in well under a minute on 2 cores.
SIZES = {
    "tiny": (128, 2, 4, 64),
    "small": (256, 4, 4, 128),
    "10M": (384, 6, 6, 128),
    "100M": (1024, 8, 16, 128),
}


class CharData(Dataset):
    """Non-overlapping windows of `seq_len + 1` characters from one split of the text."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        self.ids = ids
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharLM(nn.Module):
    """A pre-norm transformer decoder over characters, dropout on."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, seq_len: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """LR multiplier: linear warmup, then cosine decay to `floor`."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size preset")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=50, help="log val_loss every N steps")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N (under torchrun, each rank's cuda:LOCAL_RANK)"
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="stand-alone run directory (default .rollback/)"
    )
    p.add_argument("--policy", type=Path, default=None, help="policy YAML for stand-alone runs")
    return p.parse_args(argv)


def setup_distributed(backend: str = "gloo") -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1), join the process group; returns (rank, world_size)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def build(args: argparse.Namespace, rank: int = 0, world_size: int = 1, device: torch.device | None = None):
    """Model, optimizer, scheduler and loaders, all seeded from `args.seed` (and the rank, under DDP)."""
    torch.manual_seed(args.seed)
    text = args.data.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    d_model, n_layers, n_heads, seq_len = SIZES[args.size]
    split = int(len(ids) * 0.9)
    train = CharData(ids[:split], seq_len)
    val = CharData(ids[split:], seq_len)
    loader = ResumableLoader(
        train,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        seed=args.seed,
        rank=rank,
        world_size=world_size,
    )
    val_batches = [
        torch.utils.data.default_collate(
            [val[i] for i in range(b * args.batch_size, (b + 1) * args.batch_size)]
        )
        for b in range(min(args.eval_batches, len(val) // args.batch_size))
    ]
    model = CharLM(len(chars), d_model, n_layers, n_heads, seq_len, args.dropout).to(device or "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    if world_size > 1:
        # Same initial weights everywhere (seeded above), but each rank its own dropout stream.
        torch.manual_seed(rank_seed(args.seed, rank, world_size))
    return model, opt, sched, loader, val_batches


@torch.no_grad()
def evaluate(model: nn.Module, batches) -> float:
    model.eval()
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def deterministic() -> None:
    """Deterministic kernels, without the ~3 s `torch.use_deterministic_algorithms` adds to every start.

    The public call also sets torch.compile's (inductor's) flag, which imports inductor and dynamo. This
    workload is never compiled, so it sets ATen's flag alone; a compiled script should call the public one.
    cuBLAS is deterministic only with a fixed workspace, which must be set before CUDA starts.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(True)
    else:
        setter(True)
    assert torch.are_deterministic_algorithms_enabled()


def train(args: argparse.Namespace) -> tuple[int, nn.Module, torch.optim.Optimizer]:
    """Train under a supervisor session; returns the exit code, the model and the optimizer."""
    if args.threads:
        torch.set_num_threads(args.threads)
    deterministic()
    rank, world_size = setup_distributed("nccl" if args.device.startswith("cuda") else "gloo")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    model, opt, sched, loader, val_batches = build(args, rank, world_size, device)
    val_batches = [(x.to(device), y.to(device)) for x, y in val_batches]
    forward = model
    if world_size > 1:
        forward = nn.parallel.DistributedDataParallel(model)

    sess = Session.attach(config=vars(args), workdir=args.workdir, policy=args.policy, run_name="charlm")
    sess.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    with sess:
        for step, (x, y) in sess.loop(loader, max_steps=args.steps):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            sess.log(loss=loss.item(), grad_norm=grad_norm.item(), lr=sched.get_last_lr()[0])
            if step % args.eval_every == 0 or step == args.steps:
                sess.log(val_loss=evaluate(model, val_batches))
    return sess.exit_code, model, opt


def main(argv: list[str] | None = None) -> int:
    code = train(parse_args(argv))[0]
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
