"""LineageRunner.supervise: the segment loop over real short processes, its named steps, and a caller's stop."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from supervisor import exitcodes
from supervisor.lineage import LineageRecord
from supervisor.orchestrator import LineageRunner, Outcome, RunOptions
from tests.flowkit import FAST_POLICY

#: The test policy, with relaunches from scratch allowed (these segments save no checkpoints).
SCRATCH = FAST_POLICY.read_text().replace(
    "target: {select: latest}", "target: {select: latest}\n    allow_scratch: true"
)


def _options(tmp_path: Path, code: int, **kw) -> RunOptions:
    policy = tmp_path / "policy.yaml"
    tmp_path.mkdir(parents=True, exist_ok=True)
    policy.write_text(SCRATCH)
    return RunOptions(
        command=(sys.executable, "-c", f"import sys; print('hello'); sys.exit({code})"),
        policy_path=str(policy),
        lineage="t",
        stop_grace_seconds=5,
        **{"workdir": tmp_path, **kw},
    )


class Steps:
    """A StepRunner that runs each step inline and remembers its name."""

    def __init__(self) -> None:
        self.names: list[tuple[str, str | None]] = []

    def __call__(self, name, fn, run_name=None):
        self.names.append((name, run_name))
        return fn()


def test_a_run_that_finishes_by_itself(tmp_path: Path):
    steps, seen, lines = Steps(), [], []
    with LineageRunner(_options(tmp_path, exitcodes.EXIT_OK), sleep=lambda s: None) as runner:
        record = runner.supervise(
            on_line=lambda stream, line: lines.append(line),
            on_decision=lambda d, r: seen.append((d, len(r.segments))),
            step=steps,
        )
    assert steps.names == [
        ("open_lineage", None),
        ("run_segment", "segment-0"),
        ("decide_next", None),
        ("finish_lineage", None),
    ]
    assert seen == [(None, 1)] and "hello" in lines
    assert (record.status, record.final_reason) == ("finished", "training finished")
    on_disk = json.loads((tmp_path / "lineages" / "t" / "lineage.json").read_text())
    assert LineageRecord.from_dict(on_disk).to_dict() == on_disk == record.to_dict()


def test_relaunches_back_off_until_the_caller_ends_the_lineage(tmp_path: Path):
    sleeps: list[float] = []

    def budget(decision, record) -> Outcome | None:
        assert decision is not None and decision.action == "resume"
        return Outcome("stopped", "caller's budget spent") if len(record.segments) == 3 else None

    with LineageRunner(_options(tmp_path, exitcodes.EXIT_PREEMPTED), sleep=sleeps.append) as runner:
        record = runner.supervise(on_decision=budget)
    assert [s.outcome for s in record.segments] == ["resume", "resume", "resume"]
    assert (record.status, record.final_reason) == ("stopped", "caller's budget spent")
    assert sleeps == [0.1, 0.2]  # the policy's backoff after the first two; the third ended the lineage


def test_the_segment_cap_fails_the_lineage(tmp_path: Path):
    options = _options(tmp_path, exitcodes.EXIT_PREEMPTED, max_segments=2)
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise()
    assert len(record.segments) == 2
    assert (record.status, record.final_reason) == ("failed", "gave up after 2 segments")


def test_a_policy_failure_ends_the_loop(tmp_path: Path):
    options = _options(tmp_path, 0)
    command = (sys.executable, "-c", "raise ValueError('bad shape')")
    options = RunOptions(**{**options.__dict__, "command": command})
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise()
    assert [s.outcome for s in record.segments] == ["fail"]
    assert record.status == "failed" and "software_error" in record.final_reason


def test_the_constructor_touches_neither_the_disk_nor_the_environment(tmp_path: Path, monkeypatch):
    from supervisor.tracking import BOUNDED_HTTP

    for key in BOUNDED_HTTP:
        monkeypatch.delenv(key, raising=False)
    runner = LineageRunner(_options(tmp_path, 0, workdir=tmp_path / "wd"))
    assert not (tmp_path / "wd").exists()
    assert not any(key in os.environ for key in BOUNDED_HTTP)
    assert runner.lease is None and runner.history.entries == ()
    try:
        runner.open()
        assert (tmp_path / "wd" / "lineages" / "t" / "segments").is_dir()
        assert all(os.environ[key] == value for key, value in BOUNDED_HTTP.items())
    finally:
        runner.close()


def test_the_facade_holds_a_dozen_attributes_at_most(tmp_path: Path):
    runner = LineageRunner(_options(tmp_path, 0))
    assert len(vars(runner)) <= 12, sorted(vars(runner))


def _vanished(tmp_path: Path, restarts: int) -> RunOptions:
    """A lineage whose supervisor vanished mid-segment (its segment has no end), under `restarts` restarts."""
    from supervisor.lineage import SegmentRecord

    options = _options(tmp_path, exitcodes.EXIT_OK)
    policy = Path(options.policy_path)
    text = policy.read_text().replace("max_restarts: 6", f"max_restarts: {restarts}")
    policy.write_text(text.replace("max_rollbacks: 3", f"max_rollbacks: {min(restarts, 3)}"))
    with LineageRunner(options, sleep=lambda s: None) as runner:
        runner.open()
        runner.record.segments.append(SegmentRecord(index=0, started=1.0, host="gone"))
        runner.book.save()
    return options


def test_a_pending_backoff_is_honoured_once_then_the_lineage_runs(tmp_path: Path):
    sleeps: list[float] = []
    with LineageRunner(_vanished(tmp_path, restarts=6), sleep=sleeps.append) as runner:
        record = runner.supervise()
        assert [s.outcome for s in record.segments] == ["interrupted", "finished"]
        assert sleeps == [0.1] and record.status == "finished"
        again = runner.supervise()  # on the still open runner: the stale pending decision is not replayed
    assert sleeps == [0.1] and again.status == "finished" and len(again.segments) == 3


def test_a_pending_failure_ends_the_lineage_before_any_segment(tmp_path: Path):
    sleeps: list[float] = []
    with LineageRunner(_vanished(tmp_path, restarts=0), sleep=sleeps.append) as runner:
        record = runner.supervise()
        assert len(record.segments) == 1 and record.status == "failed" and sleeps == []
        assert record.final_reason == record.segments[0].decision["reason"]
        again = runner.supervise()  # not failed again by the old decision: the lineage runs
    assert again.status == "finished" and len(again.segments) == 2
