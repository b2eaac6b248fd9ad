"""Bit-exact resume: a run SIGKILLed after a checkpoint and resumed ends bit-identical to one never stopped."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "ckpt_scripts" / "train_small.py"
STEPS, SAVE_EVERY = 40, 4  # 12 batches per epoch: checkpoints fall mid-epoch (4, 8) and on its end (12, 24)


def _cmd(store: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        str(store),
        str(out),
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        *extra,
    ]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _losses(out: Path) -> dict[int, str]:
    """Loss per step; a step run twice (before the kill and after the resume) keeps its last value."""
    losses = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    subprocess.run(_cmd(out / "store", out, "--sync"), check=True, env=_env(), cwd=REPO, capture_output=True)
    return out


def _kill_at(store: Path, out: Path, kill_after: int, sync: bool) -> None:
    proc = subprocess.Popen(
        _cmd(store, out, *(["--sync"] if sync else [])),
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=REPO,
    )
    for line in proc.stdout:
        if line.strip() == f"step {kill_after}":
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


KILLS = [(10, True), (14, False), (random.Random(7).randint(SAVE_EVERY + 1, STEPS - 2), False)]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("kill_after,sync", KILLS, ids=[f"kill-after-step-{k}" for k, _ in KILLS])
def test_resume_after_sigkill_is_bit_identical(tmp_path, reference, kill_after, sync):
    store, out = tmp_path / "store", tmp_path / "out"
    _kill_at(store, out, kill_after, sync)
    done = subprocess.run(
        _cmd(store, out, "--resume"), check=True, env=_env(), cwd=REPO, capture_output=True, text=True
    )
    resumed_from = int(done.stdout.split("resumed ", 1)[1].split()[0])
    assert SAVE_EVERY <= resumed_from <= kill_after + SAVE_EVERY and resumed_from % SAVE_EVERY == 0

    expected, got = _losses(reference), _losses(out)
    after = [s for s in range(resumed_from + 1, STEPS + 1)]
    assert [got[s] for s in after] == [expected[s] for s in after]

    want, have = load_file(reference / "final.safetensors"), load_file(out / "final.safetensors")
    assert want.keys() == have.keys() and any(k.startswith("optimizer.state.") for k in want)
    for key in want:
        assert want[key].dtype == have[key].dtype and torch.equal(want[key], have[key]), key
    assert json.loads((reference / "final.json").read_text()) == json.loads((out / "final.json").read_text())
