"""Session as a thin driver over the core: few attributes of its own, nothing started when built, one step
counter, and the signals routed only inside `with`."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from supervisor import exitcodes
from supervisor.checkpoint import open_store
from supervisor.runtime import Session
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.seams import NullMetrics


def _plan(tmp_path: Path) -> LaunchPlan:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "version: 1\nname: driver\ncheckpoint: {every_steps: 100, async: false}\n"
        "monitor: {detectors: []}\nrules: [{when: [preemption], action: resume, target: {select: latest}}]\n"
    )
    return LaunchPlan(
        lineage="driver",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "work" / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}",
        policy_path=str(policy),
    )


def test_a_session_is_small_and_built_without_side_effects(tmp_path: Path):
    threads = threading.active_count()
    sess = Session(_plan(tmp_path))
    assert len(vars(sess)) <= 12, sorted(vars(sess))
    assert not (tmp_path / "work").exists() and sess._core.store is None
    assert threading.active_count() == threads
    sess._metrics = NullMetrics()
    sess.close()  # closing a session that never started is fine


def test_the_manager_opens_on_first_use_without_with(tmp_path: Path):
    sess = Session(_plan(tmp_path))
    sess._metrics = NullMetrics()
    assert not (tmp_path / "work").exists()
    try:
        assert sess.manager.latest() is None  # type: ignore[union-attr]
        assert sess.manager is sess.manager and (tmp_path / "work" / "checkpoints").is_dir()
        assert not (tmp_path / "work" / "heartbeat.json").exists()  # only the store opened
    finally:
        sess.close()


def test_a_failed_start_in_enter_closes_what_it_opened_and_puts_the_handlers_back(
    tmp_path: Path, monkeypatch
):
    before = signal.getsignal(signal.SIGTERM)
    sess = Session(_plan(tmp_path))
    sess._metrics = NullMetrics()
    closed = []
    real_close = sess.close

    def start(state: object) -> None:
        sess.manager.latest()  # type: ignore[union-attr]  # the store is open, then the start fails
        raise ZeroDivisionError

    def close() -> None:
        closed.append(True)
        real_close()

    monkeypatch.setattr(sess._core.resources, "start", start)
    monkeypatch.setattr(sess, "close", close)
    with pytest.raises(ZeroDivisionError):
        with sess:
            pass
    assert closed == [True] and signal.getsignal(signal.SIGTERM) == before
    assert sess.exit_code == exitcodes.EXIT_FAILED


def test_the_step_is_the_training_states_and_read_only(tmp_path: Path):
    sess = Session(_plan(tmp_path))
    sess._metrics = NullMetrics()
    sess.state.step = 41
    assert sess.step == 41
    with pytest.raises(AttributeError):
        sess.step = 3  # type: ignore[misc]
    sess.close()


@pytest.mark.parametrize(
    ("sig", "exit_code", "checkpoints"),
    [(signal.SIGUSR2, exitcodes.EXIT_STOPPED, []), (signal.SIGTERM, exitcodes.EXIT_PREEMPTED, [3])],
)
def test_signals_inside_with_stop_the_loop_and_the_handlers_are_put_back(
    tmp_path: Path, sig, exit_code, checkpoints
):
    before = signal.getsignal(sig)
    sess = Session(_plan(tmp_path))
    sess._metrics = NullMetrics()
    model = torch.nn.Linear(2, 1)
    sess.register(model=model)
    steps = []
    with sess:
        assert signal.getsignal(sig) != before
        for step, _ in sess.loop([torch.ones(1, 2)] * 10, max_steps=10):
            steps.append(step)
            if step == 3:
                os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) == before
    assert steps == [1, 2, 3] and sess.exit_code == exit_code
    assert [i.step for i in open_store(sess.plan.checkpoint_dir).list()] == checkpoints


def test_request_stop_ends_the_loop_after_the_step(tmp_path: Path):
    sess = Session(_plan(tmp_path))
    sess._metrics = NullMetrics()
    sess.register(model=torch.nn.Linear(2, 1))
    with sess:
        for step, _ in sess.loop([torch.ones(1, 2)] * 10, max_steps=10):
            if step == 2:
                sess.request_stop("enough for the test")
    assert sess.step == 2 and sess.exit_code == exitcodes.EXIT_STOPPED
