"""How the training side saves: a commit waits for its metrics on the writer thread, never on the training
thread, and an adaptive cadence saves after a write in flight instead of blocking on it. In process, with a
real Session, model, optimizer and store; only the MLflow side is replaced by a gate the test controls."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from supervisor.checkpoint import open_store
from supervisor.runtime import Session
from supervisor.runtime.seams import NullMetrics


class GatedMetrics(NullMetrics):
    """A metric logger that sends nothing. The first barrier (the first save's "metrics sent") opens when the
    test says, or after `safety_s` so that a regression fails instead of hanging; later ones are open at once."""

    def __init__(self, safety_s: float = 20.0) -> None:
        self.gates: list[threading.Event] = []
        self._safety_s = safety_s

    def barrier(self) -> threading.Event:
        gate = threading.Event()
        if self.gates:
            gate.set()
        else:
            timer = threading.Timer(self._safety_s, gate.set)
            timer.daemon = True
            timer.start()
        self.gates.append(gate)
        return gate

    def open_all(self) -> None:
        for gate in self.gates:
            gate.set()


def _policy(tmp_path: Path, *, adaptive: bool, every_steps: int) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nname: saves\n"
        f"checkpoint: {{every_steps: {every_steps}, adaptive: {str(adaptive).lower()}, keep_last: 50}}\n"
        "monitor: {detectors: []}\n"
        "rules: [{when: [preemption], action: resume, target: {select: latest}}]\n"
    )
    return path


def _session(tmp_path: Path, *, adaptive: bool, every_steps: int) -> tuple[Session, GatedMetrics]:
    sess = Session.attach(
        workdir=tmp_path / "work", policy=_policy(tmp_path, adaptive=adaptive, every_steps=every_steps)
    )
    sess._metrics = metrics = GatedMetrics()  # no MLflow: the test decides when metrics count as sent
    return sess, metrics


def _train(sess: Session, metrics: GatedMetrics, steps: int, on_step=None) -> None:
    """Train `steps` steps of a small model, calling `on_step(step)` inside each; then open every gate, close."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sess.register(model=model, optimizer=opt)
    batches = [torch.randn(4, 8) for _ in range(steps)]
    try:
        for step, x in sess.loop(batches, max_steps=steps):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if on_step:
                on_step(step)
    finally:
        metrics.open_all()
        sess.close()


def _committed_steps(sess: Session) -> list[int]:
    return sorted(i.step for i in open_store(sess.plan.checkpoint_dir).list())


def test_a_commit_waits_for_its_metrics_but_training_does_not(tmp_path: Path):
    sess, metrics = _session(tmp_path, adaptive=False, every_steps=5)
    seen: dict[int, list[int]] = {}

    def on_step(step: int) -> None:
        if step in (7, 9):
            seen[step] = _committed_steps(sess)
        if step == 9:
            metrics.gates[0].set()  # step 5's metrics are now "sent"
            sess.manager.wait()
            seen[10] = _committed_steps(sess)

    _train(sess, metrics, 12, on_step)
    # Training went on past step 5 while the step-5 commit waited for its metrics.
    assert seen[7] == [] and seen[9] == []
    assert seen[10] == [5]
    assert _committed_steps(sess)[-1] == 12


def test_an_adaptive_cadence_saves_after_the_write_in_flight_instead_of_blocking_on_it(tmp_path: Path):
    sess, metrics = _session(tmp_path, adaptive=True, every_steps=2)
    in_flight: list[int] = []
    committed: list[int] = []

    def on_step(step: int) -> None:
        if metrics.gates and not metrics.gates[0].is_set():
            in_flight.append(step)
        if step == 29:
            committed.extend(_committed_steps(sess))
        if step == 30:
            metrics.gates[0].set()
            sess.manager.wait()  # the first checkpoint is committed now

    # Were the due save blocking on the write in flight, training would stop at step 3 until the commit's
    # bounded wait for its metrics (10 s) gave up and committed it: by step 29 it would be committed.
    _train(sess, metrics, 40, on_step)
    assert committed == []
    first = min(_committed_steps(sess))
    assert len(metrics.gates) >= 3, "saves resumed once the first was committed"
    assert in_flight[-1] == 30 and len(in_flight) >= 25  # trained on while the first save was in flight
    assert all(step >= 30 for step in _committed_steps(sess) if step != first)


def test_a_fixed_cadence_keeps_its_multiples_even_when_a_write_is_in_flight(tmp_path: Path):
    sess, metrics = _session(tmp_path, adaptive=False, every_steps=3)

    def on_step(step: int) -> None:
        if step == 4:
            threading.Timer(0.5, metrics.gates[0].set).start()  # step 6's save blocks until then

    _train(sess, metrics, 12, on_step)
    assert _committed_steps(sess) == [3, 6, 9, 12]


def test_an_in_process_rollback_restores_the_save_in_flight_without_waiting_for_its_write(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nname: fast-path\n"
        "checkpoint: {every_steps: 5, keep_last: 50}\n"
        "monitor: {detectors: [{type: non_finite, metrics: [loss]}]}\n"
        "rules: [{when: [non_finite], action: rollback, target: {select: latest}}]\n"
    )
    sess = Session.attach(workdir=tmp_path / "work", policy=policy)
    sess._metrics = metrics = GatedMetrics()  # step 5's commit is held until the test opens the gate
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sess.register(model=model, optimizer=opt)
    batches = [torch.randn(4, 8) for _ in range(12)]
    trained: list[tuple[int, bool]] = []
    saved_at_5 = resumed_from = committed_then = None
    try:
        for step, x in sess.loop(batches, max_steps=12):
            if step == 6 and sess.rollbacks_in_process:
                resumed_from = model.weight.detach().clone()
                committed_then = _committed_steps(sess)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            if step == 5:
                saved_at_5 = model.weight.detach().clone()  # what step 5's checkpoint holds
            trained.append((step, bool(metrics.gates) and metrics.gates[0].is_set()))
            sess.log(loss=float("nan") if step == 7 and not sess.rollbacks_in_process else loss.item())
            if step == 9:
                metrics.gates[0].set()  # the save at step 10 would otherwise block on step 5's write
    finally:
        metrics.open_all()
        sess.close()
    # Step 7's NaN rolled back to step 5 while step 5's write was still held (up to a 20 s safety timer, which
    # the old handler waited for): training went on at once, from step 5's state, and step 5 then committed.
    assert sess.rollbacks_in_process == 1
    assert trained[:9] == [(s, False) for s in (1, 2, 3, 4, 5, 6, 7, 6, 7)]
    assert committed_then == []  # the old handler waited for the write (10 s, then committed without metrics)
    assert resumed_from is not None and torch.equal(resumed_from, saved_at_5)
    assert _committed_steps(sess)[0] == 5
