"""Unhealthy checkpoints (issue 14): a snapshot whose parameters or optimizer state hold a NaN or an infinity is
marked when it is taken (durably, in its manifest), and is never "latest" nor a rollback or resume target
unless `checkpoint.allow_nonfinite` says so. Real tensors, a real store on tmp_path, real NaN training steps."""

from __future__ import annotations

import json

import pytest
import torch

from policies import History, decide, parse_policy
from policies.records import to_records
from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.fastcopy import _PIECE, nonfinite_in
from supervisor.checkpoint.manifest import MANIFEST, Manifest
from supervisor.cli import main
from supervisor.errors import CheckpointNotFound
from supervisor.events import Event
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.wiring import checkpoint_options
from supervisor.state import TrainingState

FLOATS = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
]
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _with(dtype: torch.dtype, n: int, at: int | None, value: float) -> torch.Tensor:
    t = torch.linspace(-3, 3, n, dtype=torch.float64)
    if at is not None:
        t[at] = value
    return t.to(dtype)


def _really_bad(t: torch.Tensor) -> bool:
    """What torch itself says (float8_e4m3fn has no infinity: converting one saturates to its largest value)."""
    return not bool(torch.isfinite(t.to(torch.complex128 if t.is_complex() else torch.float64)).all())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bad", BAD, ids=str)
def test_a_nan_or_an_infinity_is_found_anywhere_in_every_float_dtype(dtype: torch.dtype, bad: str):
    n = 3 * _PIECE // 2  # more than one piece of every dtype
    clean = _with(dtype, n, None, 0.0)
    for at in (0, n // 2, n - 1):
        t = _with(dtype, n, at, BAD[bad])
        assert nonfinite_in([("t", t), ("clean", clean)], threads=1) == ({"t"} if _really_bad(t) else set())
    if dtype != torch.float8_e4m3fn:  # e4m3fn saturates an infinity to its largest finite value
        assert _really_bad(_with(dtype, 4, 1, BAD[bad]))


def test_the_check_reads_big_and_strided_tensors_and_skips_integers():
    big = torch.zeros(1 << 24)  # 64 MiB: read on several threads
    big[-1] = float("inf")
    strided = torch.zeros(64, 64).t()
    strided[3, 5] = float("nan")
    tensors = {"big": big, "strided": strided, "fine": torch.ones(64, 64).t(), "int": torch.arange(9)}
    assert nonfinite_in(tensors.items(), threads=2) == {"big", "strided"}


class Net:
    """A real model and optimizer; `step(x)` is one training step, and an input with an inf makes a NaN step."""

    def __init__(self, buffer: torch.Tensor | None = None):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))
        if buffer is not None:
            self.model.register_buffer("mask", buffer)  # persistent: part of the state
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.state = TrainingState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)

    def step(self, poison: bool = False) -> float:
        x = torch.randn(4, 6)
        if poison:
            x[0, 0] = float("inf")  # bad data: inf - inf in the forward pass, NaN gradients, NaN weights
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


@pytest.mark.parametrize("async_save,memory_slots", [(True, 2), (True, 1), (False, 1), (False, 0)])
def test_a_snapshot_of_a_nan_step_is_marked_unhealthy_and_never_taken_as_latest(
    tmp_path, async_save, memory_slots
):
    net = Net()
    net.step()
    root = tmp_path / "store"
    with CheckpointManager(
        CheckpointOptions(root, async_save=async_save, memory_slots=memory_slots), net.state
    ) as mgr:
        good = mgr.save(1, metrics={"loss": 2.0})
        kept = net.weights()
        net.step(poison=True)
        assert not all(torch.isfinite(p).all() for p in net.model.parameters())
        bad = mgr.save(2, metrics={"loss": 1.0})
        marks = [(c.id, c.healthy) for c in mgr.candidates()]  # pending or committed: marked either way
        assert marks == [(good.id, True), (bad.id, False)]
        mgr.wait()
        bad = mgr.get(bad.id)
        assert {"model.0.weight", "optimizer.state.0.exp_avg"} <= set(bad.nonfinite)

        on_disk = json.loads((root / f"ckpt-{bad.id}" / MANIFEST).read_bytes())
        assert on_disk["nonfinite"] == list(bad.nonfinite)
        assert [(i.id, i.healthy) for i in open_store(root).list()] == [(good.id, True), (bad.id, False)]
        assert mgr.latest().id == good.id
        assert mgr.best("loss").id == good.id  # its loss was logged before the NaN step: it looks best
        assert mgr.restore().id == good.id  # a plain resume ("latest") skips it
        assert all(torch.equal(v, kept[k]) for k, v in net.model.state_dict().items())
        if memory_slots > 1:
            assert mgr.restore_memory().id == good.id
        elif memory_slots:  # the ring holds the unhealthy snapshot alone
            with pytest.raises(CheckpointNotFound, match=r"\(only 1 abandoned or unhealthy one\(s\)\)"):
                mgr.restore_memory()
        assert mgr.restore(bad.id).id == bad.id  # named explicitly, it is restorable (for a post-mortem)


def test_allow_nonfinite_lets_latest_take_an_unhealthy_checkpoint(tmp_path):
    net = Net()
    with CheckpointManager(CheckpointOptions(tmp_path / "s", allow_nonfinite=True), net.state) as mgr:
        mgr.save(1)
        net.step(poison=True)
        bad = mgr.save(2)
        mgr.wait()
        assert not mgr.get(bad.id).healthy and mgr.latest().id == bad.id and mgr.restore().id == bad.id
    with pytest.raises(ValueError, match="checkpoint.allow_nonfinite: expected true or false, got 'yes'"):
        CheckpointOptions(tmp_path / "s", allow_nonfinite="yes")


def test_a_module_buffer_may_hold_an_infinity_on_purpose(tmp_path):
    """An additive attention mask is -inf by design: buffers are not part of the health check."""
    net = Net(buffer=torch.full((3, 3), float("-inf")).triu(1))
    with CheckpointManager(CheckpointOptions(tmp_path / "s", async_save=False), net.state) as mgr:
        assert mgr.save(1).healthy and mgr.latest() is not None


def test_a_manifest_without_the_mark_is_healthy_and_checkpoints_list_shows_the_mark(tmp_path, capsys):
    net = Net()
    root = tmp_path / "store"
    with CheckpointManager(CheckpointOptions(root), net.state) as mgr:
        good = mgr.save(1)
        net.step(poison=True)
        bad = mgr.save(2)
    raw = json.loads((root / f"ckpt-{good.id}" / MANIFEST).read_bytes())
    del raw["nonfinite"]  # written before the mark existed
    assert Manifest.from_bytes(json.dumps(raw).encode()).nonfinite == []
    assert main(["checkpoints", "list", str(root)]) == 0
    rows = {
        line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines() if "│ 00" in line
    }
    assert (
        "UNHEALTHY (12 non-finite)" in rows[bad.id]
    )  # 2 layers x (weight, bias) x (itself, exp_avg, exp_avg_sq)
    assert "UNHEALTHY" not in rows[good.id] and "ok" in rows[good.id]


POLICY = """
version: 1
name: unhealthy
checkpoint: {every_steps: 1, keep_best: {metric: loss, mode: min}%s}
rules:
  - when: [spike]
    action: rollback
    target: {select: best, metric: loss}
  - when: [preemption]
    action: resume
  - when: [plateau]
    action: stop
"""


def test_the_supervisor_decision_never_targets_an_unhealthy_checkpoint_unless_the_policy_allows(tmp_path):
    """The supervisor's path: the store's info records (open_store(...).list()) through to_records into decide."""
    net = Net()
    root = tmp_path / "store"
    with CheckpointManager(CheckpointOptions(root), net.state) as mgr:
        mgr.save(10, metrics={"loss": 1.0})
        net.step(poison=True)
        bad = mgr.save(20, metrics={"loss": 0.5})  # the loss logged at the step looks best
    records = to_records(open_store(root).list())
    assert [r.healthy for r in records] == [True, False]
    spike = Event(type="spike", reason="t", metric="loss", onset_step=90, step=90)
    kill = Event(type="preemption", reason="t", step=25)
    plateau = Event(type="plateau", reason="t", metric="loss", step=30)

    strict = parse_policy(POLICY % "")
    assert strict.checkpoint.allow_nonfinite is False
    for event, action in ((spike, "rollback"), (kill, "resume"), (plateau, "stop")):
        decision = decide(strict, event, History(), records, now=1.0, rng_seed=0)
        assert (decision.action, decision.target_step) == (action, 10), decision.reason
    reason = decide(strict, spike, History(), records, now=1.0, rng_seed=0).reason
    assert f"skipped 1 unhealthy checkpoint(s) (NaN or infinity in the state: {bad.id}" in reason

    allowing = parse_policy(POLICY % ", allow_nonfinite: true")
    decision = decide(allowing, spike, History(), records, now=1.0, rng_seed=0)
    assert decision.target_step == 20 and "allowed by checkpoint.allow_nonfinite" in decision.reason
    plan = LaunchPlan(lineage="l", workdir=str(tmp_path), checkpoint_dir=str(root), tracking_uri="unused")
    assert checkpoint_options(allowing, plan).allow_nonfinite is True
    assert checkpoint_options(strict, plan).allow_nonfinite is False


def test_no_healthy_checkpoint_fails_the_rollback_with_the_reason(tmp_path):
    net = Net()
    root = tmp_path / "store"
    with CheckpointManager(CheckpointOptions(root, async_save=False), net.state) as mgr:
        net.step(poison=True)
        mgr.save(10, metrics={"loss": 1.0})
        assert mgr.latest() is None
        with pytest.raises(Exception, match="unhealthy"):
            mgr.restore()
    spike = Event(type="spike", reason="t", metric="loss", onset_step=90, step=90)
    decision = decide(
        parse_policy(POLICY % ""), spike, History(), to_records(open_store(root).list()), now=1.0
    )
    assert decision.action == "fail" and "skipped 1 unhealthy" in decision.reason
