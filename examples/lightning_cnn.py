"""A small CNN trained with PyTorch Lightning; supervised by one added line, `RollbackSupervisor()`.

Runs stand-alone (checkpoints and a local MLflow store under .rollback/) or under `rollback-supervisor run`.
The data are seeded synthetic 16x16 images of four shapes, shuffled by a seeded torchdata StatefulDataLoader
(or, with --plain-loader, a plain torch DataLoader(shuffle=True), which the callback makes resumable);
the model has dropout and a linear LR warm-up. Each step logs its loss, gradient norm, LR and the dataset index
of its batch's first sample, so a resume or a rollback shows in the curves.

    python examples/lightning_cnn.py --steps 300
    rollback-supervisor run --policy policies/presets/palm-spike.yaml -- python examples/lightning_cnn.py --steps 300
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.integrations.lightning import RollbackSupervisor, lineage_mlflow_logger

SIZE = 16
CLASSES = 4


class Shapes(Dataset):
    """`n` noisy 16x16 images of four shapes (bar, column, square, diagonal), seeded; yields (x, y, index)."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        shifts = torch.randint(-3, 4, (n, 2), generator=g)
        self.x = 0.5 * torch.randn(n, 1, SIZE, SIZE, generator=g)
        for i in range(n):
            r, c = 8 + int(shifts[i, 0]), 8 + int(shifts[i, 1])
            label = int(self.y[i])
            if label == 0:
                self.x[i, 0, r - 1 : r + 1, 2:-2] += 1.0
            elif label == 1:
                self.x[i, 0, 2:-2, c - 1 : c + 1] += 1.0
            elif label == 2:
                self.x[i, 0, r - 3 : r + 3, c - 3 : c + 3] += 1.0
            else:
                self.x[i, 0].add_(torch.eye(SIZE).roll(int(shifts[i, 0]), dims=1))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class ShapesCNN(L.LightningModule):
    """Two conv blocks, dropout, a linear head; AdamW with a linear warm-up, stepped every batch."""

    def __init__(
        self,
        lr: float = 3e-3,
        warmup: int = 20,
        dropout: float = 0.2,
        batch_size: int = 16,
        train_size: int = 256,
        seed: int = 0,
        plain_loader: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(16 * (SIZE // 4) ** 2, CLASSES)

    def configure_model(self) -> None:
        """Under ModelParallelStrategy (--strategy fsdp2): FSDP2 over the data-parallel mesh, each block sharded."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        for block in (self.features, self.head):
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x).flatten(1)))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        self.log("sample", float(index[0]))  # which batch this step trained on (the shuffle's first index)
        if self.trainer.world_size > 1:  # and every rank's, so a skip shows on each of them
            for rank, first in enumerate(self.all_gather(index[:1]).flatten().tolist()):
                self.log(f"sample.rank{rank}", float(first))
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        norms = [p.grad.detach().norm() for p in self.parameters() if p.grad is not None]
        self.log("grad_norm", torch.linalg.vector_norm(torch.stack(norms)))

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y, _ = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup = self.hparams.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        data = Shapes(self.hparams.train_size, self.hparams.seed)
        if self.hparams.plain_loader:  # shuffled from torch's global RNG, seeded by seed_everything()
            return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return StatefulDataLoader(
            data, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True, generator=generator
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Shapes(128, self.hparams.seed + 1), batch_size=64)


class BatchCounter(L.Callback):
    """A callback with state (the batches it has seen), logged every step as `batches`: a resume that lost
    callbacks' state would show it restarting from 0. For the tests (`--batch-counter`)."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.batches += 1
        pl_module.log("batches", float(self.batches))

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--train-size", type=int, default=256, help="training images (an epoch is this / batch)")
    p.add_argument("--val-every", type=int, default=50, help="validate every N steps")
    p.add_argument(
        "--mlflow-logger",
        action="store_true",
        help="also log through Lightning's MLFlowLogger (into the lineage's run under the supervisor)",
    )
    p.add_argument("--batch-counter", action="store_true", help="add BatchCounter, a callback with state")
    p.add_argument(
        "--plain-loader",
        action="store_true",
        help="a plain torch DataLoader instead of the StatefulDataLoader",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--devices", type=int, default=1, help="processes per node (CPU, gloo)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes (launched by torchrun or SLURM)")
    p.add_argument(
        "--strategy",
        choices=("auto", "ddp", "fsdp2"),
        default="auto",
        help="ddp: DDPStrategy; fsdp2: ModelParallelStrategy with fully_shard() in configure_model()",
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="stand-alone run directory (default .rollback/)"
    )
    p.add_argument("--policy", type=Path, default=None, help="policy YAML for stand-alone runs")
    return p.parse_args(argv)


def strategy(args: argparse.Namespace) -> str | L.strategies.Strategy:
    """The Trainer's strategy: gloo on CPU for both multi-process ones; FSDP2 shards over every process (its
    default would be tensor parallelism within a node)."""
    if args.strategy == "ddp":
        return L.strategies.DDPStrategy(process_group_backend="gloo")
    if args.strategy == "fsdp2":
        return L.strategies.ModelParallelStrategy(
            data_parallel_size=args.devices * args.num_nodes,
            tensor_parallel_size=1,
            process_group_backend="gloo",
        )
    return args.strategy


def build(args: argparse.Namespace) -> tuple[L.Trainer, ShapesCNN]:
    """The Trainer and the module, seeded from `args.seed`."""
    L.seed_everything(args.seed, verbose=False)
    model = ShapesCNN(
        args.lr, args.warmup, 0.2, args.batch_size, args.train_size, args.seed, args.plain_loader
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy(args),
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=lineage_mlflow_logger() if args.mlflow_logger else False,
        enable_checkpointing=False,  # checkpoints go to the supervisor's store
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,  # for a Lightning logger (--mlflow-logger); the supervisor logs every step
        callbacks=[
            *([BatchCounter()] if args.batch_counter else []),
            RollbackSupervisor(workdir=args.workdir, policy=args.policy),  # the one added line
        ],
    )
    return trainer, model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*set_vital.*")  # torchdata's own deprecation noise
    warnings.filterwarnings("ignore", ".*treespec.*")  # Lightning 2.6 on torch 2.13: its own deprecation
    trainer, model = build(args)
    trainer.fit(model)  # a preemption or a stop for the supervisor ends the process here, with its exit code
    return 0


if __name__ == "__main__":
    sys.exit(main())
