"""The supervisor recognises an anomaly the training process already handled in process, whatever metric
or detector its own monitor saw it on first (a NaN gradient makes the loss and the grad norm NaN at the same
step; a loss spike comes with the grad norm over its threshold): one incident, one decision (issue 14)."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.events import Event
from supervisor.lineage import SegmentRecord
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.flowkit import FAST_POLICY


def test_an_in_process_report_covers_the_same_anomaly_on_another_metric(tmp_path: Path):
    runner = LineageRunner(
        RunOptions(
            command=("python", "-c", "pass"), policy_path=str(FAST_POLICY), lineage="t", workdir=tmp_path
        )
    )
    runner.open()
    try:
        reported = Event(type="non_finite", reason="loss is nan", metric="loss", onset_step=46, step=46)
        line = {"seq": 1, "handled_in_process": True, "event": reported.to_dict(), "decision": None}
        (runner.layout.local / "events.jsonl").write_text(json.dumps(line) + "\n")

        def seen(kind: str, metric: str, onset: int) -> bool:
            event = Event(type=kind, reason="monitor", metric=metric, onset_step=onset, step=onset)
            return runner.events.reported(event, runner.record.events_offset, wait_s=0)

        assert seen("non_finite", "grad_norm", 46)  # the same NaN step, seen on the grad norm first
        assert seen("non_finite", "loss", 47)
        assert not seen("non_finite", "grad_norm", 60)  # a later anomaly is a new one
        assert seen("threshold", "grad_norm", 46)  # another detector at the same onset: the same incident
        assert seen("spike", "loss", 45)
    finally:
        runner.close()


def _runner(tmp_path: Path) -> LineageRunner:
    runner = LineageRunner(
        RunOptions(
            command=("python", "-c", "pass"), policy_path=str(FAST_POLICY), lineage="t", workdir=tmp_path
        )
    )
    runner.open()
    return runner


def _line(event: Event, decision: dict | None, handled: bool) -> bytes:
    rec = {
        "seq": 1,
        "time": 5.0,
        "handled_in_process": handled,
        "event": event.to_dict(),
        "decision": decision,
    }
    return (json.dumps(rec) + "\n").encode()


def test_one_incident_on_two_metrics_gets_one_decision(tmp_path: Path):
    """A spike on the loss handled in process and the grad norm over its threshold reported at the same step:
    one rollback in the history, and nothing left for the supervisor to decide again."""
    from policies import Decision

    runner = _runner(tmp_path)
    try:
        spike = Event(type="spike", reason="loss spiked", metric="loss", onset_step=301, step=301)
        threshold = Event(
            type="threshold", reason="grad_norm > 100", metric="grad_norm", onset_step=301, step=301
        )
        decision = Decision(
            action="rollback", reason="in process", event=spike, target_id="c", target_step=250
        )
        path = runner.layout.local / "events.jsonl"
        path.write_bytes(_line(spike, decision.to_dict(), True) + _line(threshold, None, False))
        seg = SegmentRecord(index=0, started=0.0)
        assert runner.decisions.fold_reports(runner.record, seg) is None
        assert [e.decision.action for e in runner.history.entries] == ["rollback"]
        assert seg.in_process[1]["part_of_incident"] is True
    finally:
        runner.close()


def test_events_file_is_read_by_offset_and_survives_torn_and_bad_lines(tmp_path: Path):
    runner = _runner(tmp_path)
    try:
        path = runner.layout.local / "events.jsonl"
        a = Event(type="non_finite", reason="a", metric="loss", onset_step=10, step=10)
        b = Event(type="preemption", reason="b", source="notice")
        path.write_bytes(
            b"\n\n" + _line(a, None, False) + b"not json\n" + b'{"event": [1]}\n' + _line(b, None, False)[:20]
        )
        records, offset = runner.events.since(0)
        assert [r["event"]["reason"] for r in records] == ["a"]  # blank and malformed lines skipped
        assert offset == path.stat().st_size - 20  # the torn last line is left for later
        with path.open("ab") as f:
            f.write(_line(b, None, False)[20:])
        more, end = runner.events.since(offset)
        assert [r["event"]["reason"] for r in more] == ["b"] and end == path.stat().st_size
        assert runner.events.since(end) == ([], end)
    finally:
        runner.close()


def test_a_stale_segment_is_killed_only_if_its_pid_was_not_reused(tmp_path: Path):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import psutil

    from supervisor.orchestrator import _kill_stale, _process_started
    from supervisor.runtime.plan import PLAN_ENV

    def exec_done(proc: subprocess.Popen) -> subprocess.Popen:
        """Popen returns while execve may still be setting up the new image, whose environment then reads as
        empty in /proc (a reclaim can only meet a segment long after that)."""
        deadline = time.monotonic() + 10
        while not psutil.Process(proc.pid).environ() and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = {**os.environ, PLAN_ENV: str(tmp_path / "plan-0.json")}
    child = exec_done(subprocess.Popen(sleep, start_new_session=True, env=ours))
    stranger = exec_done(subprocess.Popen(sleep, start_new_session=True))  # same start time, not ours
    try:
        seg = {"index": 0, "pid": child.pid, "host": socket.gethostname()}
        _kill_stale(
            {**seg, "pid_started": _process_started(child.pid) - 100.0}, tmp_path
        )  # the PID was reused
        _kill_stale(
            {**seg, "pid_started": _process_started(child.pid)}, tmp_path / "elsewhere"
        )  # another lineage
        _kill_stale({**seg, "pid": stranger.pid, "pid_started": _process_started(stranger.pid)}, tmp_path)
        assert child.poll() is None and stranger.poll() is None
        _kill_stale({**seg, "pid_started": _process_started(child.pid) + 0.5}, tmp_path)  # boot-time jitter
        assert child.wait(10) == -signal.SIGKILL
        again = exec_done(subprocess.Popen(sleep, start_new_session=True, env=ours))
        _kill_stale(
            {**seg, "pid": again.pid, "pid_started": None}, tmp_path
        )  # a record from before start times
        assert again.wait(10) == -signal.SIGKILL
    finally:
        for proc in (child, stranger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_failure_after_launch_never_leaks_the_training_process(tmp_path: Path):
    """Building the segment's monitor used to sit outside the `try`: when it failed, the child kept running."""
    import sys

    import psutil
    import pytest

    from supervisor.monitor.sources import MetricsSourceError

    runner = LineageRunner(
        RunOptions(
            command=(sys.executable, "-c", "import time; time.sleep(120)"),
            policy_path=str(FAST_POLICY),
            lineage="t",
            workdir=tmp_path,
            stop_grace_seconds=2,
        )
    )
    runner.open()
    try:
        runner.tracking_uri = "bogus-scheme://nowhere"  # the monitor cannot be built for this store
        with pytest.raises(MetricsSourceError):
            runner.run_segment()
        pid = runner.record.segments[-1].pid
        assert pid is not None and not psutil.pid_exists(pid)
    finally:
        runner.close()
