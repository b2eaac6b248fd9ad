"""A Session resumes the data exactly whatever loader it was given, or refuses the loader at register().

The kill test trains under a real Session in a subprocess: random augmentation inside the Dataset (torch,
NumPy and Python `random`), dropout, AdamW, a schedule, checkpoints every 4 steps. It is SIGKILLed (the whole
process group, workers included) mid-run and relaunched on the same workdir; the final state (model,
optimizer, loader, RNG streams, counters) must equal an uninterrupted run's bit for bit, for a ResumableLoader
with 2 worker processes and for a plain, shuffled, seeded torchdata StatefulDataLoader.

Run as a script it is that training process:
python tests/test_loader_exact.py WORKDIR OUT --steps N --kind resumable|stateful --workers W --segment S
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.data import LoaderError, ResumableLoader, StatefulLoaderState
from supervisor.flatten import flatten
from supervisor.runtime import Session
from supervisor.runtime.plan import LaunchPlan, RestoreSpec

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 40, 4  # 12 batches an epoch: the resumed run crosses epoch ends at 24 and 36

POLICY = f"""\
version: 1
name: loader-exact
checkpoint: {{every_steps: {EVERY}, keep_last: 3, async: true}}
monitor: {{detectors: []}}
rules:
  - when: [preemption, unknown_exit]
    action: resume
    target: {{select: latest}}
"""


class Noisy(Dataset):
    """Fixed inputs plus augmentation drawn where the sample is read (a worker process, or the main one)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(99)
        self.xs = torch.randn(90, 16, generator=gen)
        self.ys = (self.xs @ torch.randn(16, 1, generator=gen)).squeeze(1)

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.05 * torch.randn(16) + 0.05 * torch.from_numpy(np.random.standard_normal(16)).float()
        return self.xs[i] + noise, self.ys[i] * (1.0 + 0.01 * random.random())


def _plan(workdir: Path, segment: int, restore: RestoreSpec = RestoreSpec()) -> LaunchPlan:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.yaml").write_text(POLICY)
    return LaunchPlan(
        lineage="loader-exact",
        workdir=str(workdir),
        checkpoint_dir=str(workdir / "checkpoints"),
        tracking_uri="sqlite:///unused.db",  # the spool is the sink: no MLflow in the training process
        run_id="run",
        segment=segment,
        policy_path=str(workdir / "policy.yaml"),
        metrics_spool=str(workdir / "metrics" / f"{segment}.jsonl"),
        restore=restore,
    )


def train(argv: list[str]) -> int:
    """The training process: resume the latest checkpoint in WORKDIR, train, write OUT/final.*."""
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--kind", choices=["resumable", "stateful"], required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--segment", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    if args.kind == "resumable":
        loader = ResumableLoader(Noisy(), batch_size=8, shuffle=True, seed=5, num_workers=args.workers)
    else:
        gen = torch.Generator().manual_seed(5)
        loader = StatefulDataLoader(
            Noisy(), batch_size=8, shuffle=True, generator=gen, num_workers=args.workers
        )
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    sess = Session(_plan(args.workdir, args.segment))
    sess.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    with sess:
        info = sess.restore()
        print(f"resumed {info.step if info else 0}", flush=True)
        for step, (x, y) in sess.loop(loader, max_steps=args.steps):
            loss = (1.0 + 0.1 * random.random()) * torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            sess.log(loss=loss.item())
            print(f"step {step}", flush=True)
    skeleton, tensors = flatten(sess.state.state_dict())
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().clone() for k, v in tensors.items()}, args.out / "final.safetensors"
    )
    (args.out / "final.json").write_text(json.dumps(skeleton, sort_keys=True))
    return sess.exit_code


def _cmd(workdir: Path, out: Path, kind: str, workers: int, segment: int) -> list[str]:
    return [
        sys.executable, str(Path(__file__)), str(workdir), str(out),
        "--steps", str(STEPS), "--kind", kind, "--workers", str(workers), "--segment", str(segment),
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _final(out: Path) -> tuple[dict, str]:
    return load_file(out / "final.safetensors"), (out / "final.json").read_text()


def _run_killed(workdir: Path, out: Path, kind: str, workers: int, kill_after: int) -> None:
    proc = subprocess.Popen(
        _cmd(workdir, out, kind, workers, 0),
        stdout=subprocess.PIPE, text=True, env=_env(), cwd=REPO, start_new_session=True,
    )  # fmt: skip
    for line in proc.stdout:
        if line.strip() == f"step {kill_after}":
            os.killpg(
                proc.pid, signal.SIGKILL
            )  # the training process and its data workers, as a supervisor does
            break
    proc.wait(timeout=120)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("kind", "workers", "kill_after"),
    [("resumable", 2, 22), ("stateful", 0, 15)],
    ids=["ResumableLoader-2-workers", "plain-StatefulDataLoader"],
)
def test_sigkill_and_resume_is_bit_identical(tmp_path: Path, kind: str, workers: int, kill_after: int):
    reference = tmp_path / "reference"
    subprocess.run(
        _cmd(reference / "work", reference, kind, workers, 0),
        check=True,
        env=_env(),
        cwd=REPO,
        capture_output=True,
    )
    work, out = tmp_path / "work", tmp_path / "out"
    _run_killed(work, out, kind, workers, kill_after)
    done = subprocess.run(
        _cmd(work, out, kind, workers, 1), check=True, env=_env(), cwd=REPO, capture_output=True, text=True
    )
    resumed_from = int(done.stdout.split("resumed ", 1)[1].split()[0])
    assert EVERY <= resumed_from <= kill_after and resumed_from % EVERY == 0

    (want, want_json), (have, have_json) = _final(reference), _final(out)
    assert any(k.startswith("optimizer.state.") for k in want) and any(k.startswith("model.") for k in want)
    assert want.keys() == have.keys()
    assert [k for k in want if not torch.equal(want[k], have[k])] == []
    assert json.loads(want_json) == json.loads(have_json)  # counters, RNG streams, the loader's position


def _session(tmp_path: Path, restore: RestoreSpec = RestoreSpec()) -> Session:
    return Session(_plan(tmp_path, 0, restore))


def test_session_refuses_a_plain_shuffled_dataloader_naming_resumable_loader(tmp_path: Path):
    sess = _session(tmp_path)
    try:
        with pytest.raises(LoaderError, match=r"register\('data'\).*shuffle=True.*ResumableLoader"):
            sess.register(data=DataLoader(Noisy(), batch_size=8, shuffle=True))
    finally:
        sess.close()


def test_session_knows_a_loader_by_its_type_not_its_class_name(tmp_path: Path):
    """A renamed StatefulDataLoader subclass is the data loader: the plan's skip_batches reaches it."""

    class MyLoader(StatefulDataLoader):
        pass

    def make() -> MyLoader:
        return MyLoader(
            torch.arange(24), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    reference = [b.tolist() for b in make()]
    loader = make()
    sess = _session(tmp_path, RestoreSpec(skip_batches=2))
    sess.register(data=loader)
    assert isinstance(sess.state["data"], StatefulLoaderState)
    try:
        got = [b.tolist() for _, b in sess.loop(loader, max_steps=3)]
    finally:
        sess.close()
    assert got == reference[2:5]


if __name__ == "__main__":
    sys.exit(train(sys.argv[1:]))
