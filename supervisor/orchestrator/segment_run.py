"""One segment's life: launch it, watch it until it exits or an anomaly makes us stop it, and stop it for sure.

Whatever fails once it is launched (the monitor, the record, a lost lease, Ctrl-C), the segment is stopped
and reaped, and its metrics reach MLflow; when the supervisor itself is going away the segment is recorded as
interrupted, so that the next supervisor resumes it. Not thread-safe; the runner's thread only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from supervisor.checkpoint.options import parse_id
from supervisor.errors import LeaseHeldError
from supervisor.events import METRIC_EVENTS, Event
from supervisor.launcher import Launcher, LaunchSpec, OnLine, SegmentHandle
from supervisor.lineage.record import LineageRecord, SegmentRecord
from supervisor.monitor import HeartbeatReader
from supervisor.monitor.stacks import HangStacks
from supervisor.orchestrator.events_log import EventsLog
from supervisor.orchestrator.options import SegmentResult
from supervisor.runtime.plan import RestoreSpec

log = logging.getLogger("rollback_supervisor.orchestrator")

#: How long cleanup waits for a segment after its stop's grace (and kill) before giving up on it.
WAIT_AFTER_KILL_SECONDS = 60.0


class Watcher(Protocol):
    """The supervisor's monitor of one segment: anomalies seen in its metrics and heartbeat."""

    def begin(self, now: float) -> None:
        """The segment was just launched (start-up and restore get a long grace)."""
        ...

    def poll(self, now: float) -> list[Event]: ...

    def close(self) -> None: ...


class Drain(Protocol):
    """Something running beside the segment that must finish its work once the segment is gone."""

    def drain(self) -> None: ...


class LeaseGuard(Protocol):
    """The lease held while the segment runs."""

    def check(self) -> None:
        """Raise LeaseHeldError if the lease was lost."""
        ...


@dataclass(frozen=True)
class SegmentSettings:
    """How segments are run: stop grace, how often the watch polls, and how long it waits for a report."""

    stop_grace_seconds: float = 30.0
    poll_seconds: float = 5.0
    #: How long an anomaly the monitor saw waits for the training process's own report of it (which means it
    #: was handled in process); 0 for a command that never reports (script mode).
    report_wait_seconds: float = 2.0


#: Every rank's stacks of a hung segment, asked for before it is stopped (`supervisor.monitor.stack_dump`).
CollectStacks = Callable[[SegmentHandle], HangStacks]


class SegmentRun:
    """Launches one planned segment and watches it to its end; `run()` once."""

    def __init__(
        self,
        launcher: Launcher,
        settings: SegmentSettings,
        *,
        record: LineageRecord,
        events: EventsLog,
        lease: LeaseGuard,
        save: Callable[[], None],
        clock: Callable[[], float],
        collect_stacks: CollectStacks | None = None,
        warn: Callable[[SegmentRecord, Event], bool] | None = None,
    ):
        self.launcher = launcher
        self.settings = settings
        self.record = record
        self.events = events
        self.lease = lease
        self.save = save
        self.clock = clock
        self.collect_stacks = collect_stacks
        #: Asked about each event the monitor sees that the training process did not report: True when the
        #: policy only warns about it (recorded there), and the segment runs on.
        self.warn = warn

    def run(
        self,
        seg: SegmentRecord,
        spec: LaunchSpec,
        *,
        heartbeat_path: Path,
        log_path: Path,
        open_watcher: Callable[[], Watcher],
        open_shipper: Callable[[], Drain],
        on_line: OnLine | None = None,
    ) -> SegmentResult:
        """Launch `spec` as segment `seg` (already in the record) and watch it until it exits or is stopped."""
        grace = self.settings.stop_grace_seconds
        with contextlib.ExitStack() as cleanup:
            logfile = cleanup.enter_context(open(log_path, "a"))  # noqa: SIM115

            def sink(stream: str, line: str) -> None:
                logfile.write(f"{stream}: {line}\n")
                logfile.flush()
                if on_line:
                    on_line(stream, line)

            # The training process appends its metrics to the spool; this ships them to the run (spool.py: why).
            shipper = open_shipper()
            cleanup.callback(shipper.drain)  # runs after the child is gone: all it logged reaches MLflow
            started = self.clock()
            handle = self.launcher.start(spec, sink)
            # Whatever fails below (the monitor, the record, a lost lease), the child is stopped and reaped.
            cleanup.callback(handle.wait, grace + WAIT_AFTER_KILL_SECONDS)  # a lost cancel must not hang us
            cleanup.callback(stop_if_running, handle, grace)
            seg.note_launch(handle.details())
            self.save()
            log.info(
                "segment %d %s; launched as %s",
                seg.index,
                describe_restore(RestoreSpec(**seg.restore)),
                handle.handle_id,
            )
            watcher = open_watcher()
            cleanup.callback(watcher.close)
            begun = handle.started()
            if begun:  # the watch's grace clock starts when the segment runs, not while a job is queued
                watcher.begin(self.clock())
            stopped_for = None
            try:
                stopped_for = self._watch(seg, handle, watcher, begun)
            except BaseException as exc:
                self._interrupted(seg, handle, heartbeat_path, save=not isinstance(exc, LeaseHeldError))
                raise
        exit_info = handle.wait()
        return SegmentResult(
            seg.index, exit_info, stopped_for, started, self.clock(), heartbeat_step(heartbeat_path)
        )

    def _watch(
        self, seg: SegmentRecord, handle: SegmentHandle, watcher: Watcher, begun: bool
    ) -> Event | None:
        """Poll until the segment exits (None) or an anomaly stops it (the event); watch only once it started."""
        while handle.poll() is None:
            if not begun:
                begun = handle.started()
                if begun:
                    log.info("segment %d: started", seg.index)
                    watcher.begin(self.clock())
            if not begun:
                self.lease.check()
                handle.wait_exit(self.settings.poll_seconds)
                continue
            event = self._anomaly(watcher, seg)
            if event is not None:
                if event.type == "hang":
                    event = self._with_stacks(seg, handle, event)
                log.warning("segment %d: %s; stopping it", seg.index, event.reason)
                handle.stop(self.settings.stop_grace_seconds, sig=signal.SIGUSR2)
                return event
            self.lease.check()
            handle.wait_exit(self.settings.poll_seconds)
        return None

    def _with_stacks(self, seg: SegmentRecord, handle: SegmentHandle, event: Event) -> Event:
        """Keep every rank's stacks in the segment's record, and where each rank was in the event's evidence.

        Before the stop, which ends the processes; a failure here is logged and never delays the stop more.
        """
        if self.collect_stacks is None:
            return event
        try:
            stacks = self.collect_stacks(handle)
        except Exception:
            log.exception("segment %d: collecting the ranks' stacks failed", seg.index)
            return event
        seg.put(stacks=stacks.to_dict())
        log.warning("segment %d hung; ranks were at: %s", seg.index, stacks.summary())
        evidence = {**event.evidence, "stacks": stacks.summary()}
        return dataclasses.replace(event, evidence=evidence)

    def _anomaly(self, watcher: Watcher, seg: SegmentRecord) -> Event | None:
        """The first event the monitor saw that the training process did not already handle itself, and that
        the policy does more about than warn."""
        for event in watcher.poll(self.clock()):
            wait = self.settings.report_wait_seconds
            if event.type in METRIC_EVENTS and self.events.reported(event, self.record.events_offset, wait):
                log.info("monitor saw %s; the training process already handled it", event.reason)
                continue
            if self.warn is not None and self.warn(seg, event):
                continue
            return event
        return None

    def _interrupted(
        self, seg: SegmentRecord, handle: SegmentHandle, heartbeat_path: Path, *, save: bool
    ) -> None:
        """The supervisor itself is going away (SIGTERM on a spot machine, Ctrl-C, a lost lease): let the
        training save its emergency checkpoint, record that, and let the next run resume."""
        handle.stop(self.settings.stop_grace_seconds, sig=signal.SIGTERM)
        exit_info = handle.wait()
        seg.ended = self.clock()
        seg.returncode = exit_info.returncode
        seg.outcome = "interrupted"
        seg.signal_sent = exit_info.signal_sent
        seg.last_step = heartbeat_step(heartbeat_path)
        seg.event = Event(
            type="preemption",
            reason="the supervisor was interrupted; training stopped with an emergency checkpoint",
            source="supervisor",
            evidence={"returncode": exit_info.returncode},
        ).to_dict()
        self.record.next_restore = RestoreSpec().__dict__
        if save:  # a stale holder (lost lease) must not write the record
            self.save()


def stop_if_running(handle: SegmentHandle, grace: float) -> None:
    if handle.poll() is None:
        handle.stop(grace, sig=signal.SIGTERM)


def heartbeat_step(path: Path) -> int | None:
    """The step of the training's last heartbeat, or None if it has not beaten."""
    beat = HeartbeatReader(path).read()
    return beat.step if beat else None


def start_step(spec: RestoreSpec, heartbeat_path: Path) -> int | None:
    """The step a segment starts at: its checkpoint's, 0 from scratch, else the last heartbeat's.

    The heartbeat file is the previous segment's until the new one beats, and it may be a few steps past
    the checkpoint the new segment restores; only "the newest valid checkpoint" (no id) is unknown here.
    """
    if spec.from_scratch:
        return 0
    if spec.checkpoint_id:
        with contextlib.suppress(ValueError):  # a script-mode version id carries no step
            return parse_id(spec.checkpoint_id)[0]
    return heartbeat_step(heartbeat_path)


def describe_restore(spec: RestoreSpec) -> str:
    """A restore spec in words, for the log."""
    if spec.from_scratch:
        return "starts from scratch"
    where = f"checkpoint {spec.checkpoint_id}" if spec.checkpoint_id else "the newest valid checkpoint"
    kind = "rolls back to" if spec.rollback else "starts from"
    scale = f"{spec.lr_scale:g}"
    scale += ".0" if scale.lstrip("-").isdigit() else ""  # lr ×1.0, lr ×0.5: always reads as a factor
    return f"{kind} {where} (skip {spec.skip_batches}, lr ×{scale})"
