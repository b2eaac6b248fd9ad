"""A tiny GPT-2 (built from a config, no download) trained by the Hugging Face Trainer, supervised.

The one line the supervisor needs is `callbacks=[RollbackSupervisorCallback()]`. Characters of the
Shakespeare sample are the tokens; dropout is on, the Trainer shuffles the windows and warms the LR up.
Runs stand-alone (a local MLflow sqlite store and checkpoints under .rollback/) or under
`rollback-supervisor run`, which hands it a launch plan through the environment.

    python examples/hf_tiny_gpt.py --steps 200
    rollback-supervisor run --policy tests/data/policies/hf-fast.yaml -- python examples/hf_tiny_gpt.py

The Trainer names its metrics `loss`, `grad_norm`, `learning_rate` and `eval_loss` (with `--eval-every`): a
policy's detectors and selectors must use those names (the presets' `val_loss` is `eval_loss` here).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched: the model is built from its config

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from supervisor.integrations.transformers import RollbackSupervisorCallback

DATA = Path(__file__).resolve().parent / "data" / "shakespeare.txt"


class CharWindows(Dataset):
    """Non-overlapping windows of `seq_len` characters; the model shifts the labels itself."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return len(self.ids) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": window, "labels": window}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1, help="batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument(
        "--samples", type=int, default=0, help="train on the first N windows (0: all): short epochs"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps of the linear schedule")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even where an accelerator exists")
    p.add_argument(
        "--workdir", type=Path, default=None, help="stand-alone run directory (default .rollback/)"
    )
    p.add_argument("--policy", type=Path, default=None, help="policy YAML for stand-alone runs")
    return p.parse_args(argv)


def deterministic() -> None:
    """Deterministic kernels, without the seconds `torch.use_deterministic_algorithms` spends importing
    inductor (the model is never compiled); cuBLAS needs its fixed workspace set before CUDA starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(True)
    else:
        setter(True)


def build(args: argparse.Namespace) -> Trainer:
    """The model, the data and the Trainer, all seeded from `args.seed`."""
    text = args.data.read_text(encoding="utf-8")
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(len(ids) * 0.9)
    train = CharWindows(ids[:split], args.seq_len)
    if args.samples:
        train = torch.utils.data.Subset(train, range(min(args.samples, len(train))))
    evaluation = torch.utils.data.Subset(CharWindows(ids[split:], args.seq_len), range(64))
    config = GPT2Config(
        vocab_size=len(chars),
        n_positions=args.seq_len,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(Path(tempfile.gettempdir()) / "hf_tiny_gpt"),  # the Trainer's own saves are off
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=0.1,
        warmup_steps=args.warmup,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        seed=args.seed,
        logging_steps=1,
        logging_nan_inf_filter=False,  # a NaN loss is logged as NaN, for the detectors to see
        eval_strategy="steps" if args.eval_every else "no",
        eval_steps=args.eval_every or None,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=args.cpu,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    return Trainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=evaluation if args.eval_every else None,
        callbacks=[
            RollbackSupervisorCallback(
                workdir=args.workdir, policy=args.policy, run_name="hf-tiny-gpt", config=vars(args)
            )
        ],
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    deterministic()
    trainer = build(args)
    trainer.train()  # a stop ends the process here with its exit code (75, 76, 3); a set-up mistake with 2
    if torch.distributed.is_initialized():
        # Under torchrun: release gloo's threads before the interpreter exits, or a finished rank can die of
        # SIGABRT ("terminate called without an active exception") during finalization.
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
