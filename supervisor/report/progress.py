"""The one-line progress of a supervised run, from the files the supervisor already reads.

Segment and counts come from the lineage record (and events.jsonl past what it has folded in), the step and
its pace from the heartbeat, the last loss from the metric spool, the last checkpoint from the store's commit
markers. Nothing is asked of the training process. `ProgressLog` logs the line every N seconds (the flow, and
`run` off a terminal); `supervisor.commands.progress` draws it live on a terminal.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.report.timeline import timeline_rows

log = logging.getLogger("rollback_supervisor.progress")

#: Flags whose value is the run's total number of steps, as common training scripts spell them.
MAX_STEP_FLAGS = ("--steps", "--max-steps", "--max_steps", "--max-iters", "--max_iters", "--total-steps")
#: Seconds of heartbeats the pace is measured over.
RATE_WINDOW_S = 60.0
#: Bytes read from the end of a metric spool to find the last loss.
SPOOL_TAIL_BYTES = 16 << 10
#: Bytes of events.jsonl read past the record's offset (in-process rollbacks not folded in yet).
EVENTS_TAIL_BYTES = 1 << 20
#: Statuses after which a lineage does not move on its own.
DONE = frozenset({"finished", "stopped", "failed"})


@dataclass(frozen=True)
class Progress:
    """What the progress line shows; None where it is not known (yet)."""

    lineage: str
    status: str | None = None
    segment: int | None = None
    step: int | None = None
    max_steps: int | None = None
    phase: str | None = None
    loss: float | None = None
    steps_per_second: float | None = None
    since_checkpoint_s: float | None = None
    checkpoint_step: int | None = None
    events: int = 0
    decisions: int = 0

    @property
    def seconds_left(self) -> float | None:
        """At the current pace, until max_steps; None without both."""
        if self.max_steps is None or self.step is None or not self.steps_per_second:
            return None
        return max(0, self.max_steps - self.step) / self.steps_per_second


def progress_line(p: Progress, width: int | None = None, *, name: bool = False) -> str:
    """`seg 1 · step 412/900 · loss 2.314 · 3.2 steps/s · 2m32s left · ckpt @400 12s ago · 2 events, 2 decisions`.

    With `name`, the lineage leads. Wider than `width`, the same facts in short words (80 columns hold them).
    """
    for short in (False, True):
        line = _line(p, short, name)
        if width is None or len(line) <= width:
            return line
    return line


def _line(p: Progress, short: bool, name: bool) -> str:
    parts = [f"seg {'-' if p.segment is None else p.segment}"]
    step = ("" if short else "step ") + ("-" if p.step is None else str(p.step))
    parts.append(step + (f"/{p.max_steps}" if p.max_steps is not None else ""))
    if p.phase and p.phase != "train":
        parts[-1] += f" ({'saving' if short and p.phase == 'checkpoint' else p.phase})"
    parts.append(f"loss {_loss(p.loss)}")
    if p.steps_per_second is not None:
        parts.append(f"{p.steps_per_second:.3g}" + ("/s" if short else " steps/s"))
        left = p.seconds_left
        if left is not None:
            parts.append(f"ETA {duration_text(left)}" if short else f"{duration_text(left)} left")
    if p.since_checkpoint_s is not None:
        ago = duration_text(p.since_checkpoint_s)
        parts.append(f"ckpt {ago} ago" if short else f"ckpt @{p.checkpoint_step} {ago} ago")
    else:
        parts.append("no ckpt yet")
    if short:
        parts.append(f"{p.events} ev/{p.decisions} dec")
    else:
        parts.append(
            f"{p.events} event{'s' * (p.events != 1)}, {p.decisions} decision{'s' * (p.decisions != 1)}"
        )
    if p.status and p.status != "running":
        parts.append(p.status)
    return (f"{p.lineage}: " if name else "") + " · ".join(parts)


def duration_text(seconds: float) -> str:
    """`45s`, `2m05s`, `3h07m`: to the second below an hour, to the minute above."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _loss(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def max_steps_of(argv: Sequence[str]) -> int | None:
    """The total steps the command asks for (`--steps 900`, `--max_steps=900`, ...); None if it does not say."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in MAX_STEP_FLAGS:
            continue
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if value.isdigit():
            return int(value)
    return None


class RateMeter:
    """Steps per second over the last `window` seconds of (time, step) samples. Pure: the caller gives times.

    A step lower than the last one (a rollback or a relaunch) starts a new measurement, and a measurement
    starts from the last time its first step was seen (a restore's start-up is not training time).
    """

    def __init__(self, window: float = RATE_WINDOW_S):
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, t: float, step: int) -> None:
        if self._samples and (step < self._samples[-1][1] or t < self._samples[-1][0]):
            self._samples.clear()
        if self._samples and self._samples[-1] == (t, step):
            return
        if len(self._samples) == 1 and self._samples[0][1] == step:
            self._samples[0] = (t, step)
            return
        self._samples.append((t, step))
        while len(self._samples) > 2 and t - self._samples[1][0] >= self.window:
            self._samples.popleft()

    def rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None


class ProgressReader:
    """Reads one lineage's progress from its local directory and checkpoint store; each read is a few small files.

    Not thread-safe: one thread reads (the live display's refresh, or the log loop).
    """

    def __init__(
        self,
        lineage_dir: Path,
        checkpoints: Path | None,
        *,
        max_steps: int | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.lineage_dir, self.checkpoints, self.max_steps = Path(lineage_dir), checkpoints, max_steps
        self._clock = clock
        self._rate = RateMeter()
        self._segment: tuple[Any, Any] = (None, None)  # (segment, heartbeat pid) the pace is measured for

    def read(self) -> Progress:
        record = _json(self.lineage_dir / "lineage.json") or {}
        segments = record.get("segments") if isinstance(record.get("segments"), list) else []
        last = segments[-1] if segments and isinstance(segments[-1], dict) else {}
        segment = last.get("index") if isinstance(last.get("index"), int) else None
        beat = _json(self.lineage_dir / "heartbeat.json") or {}
        when = beat.get("wall_time") if isinstance(beat.get("wall_time"), int | float) else None
        started = last.get("started") if isinstance(last.get("started"), int | float) else None
        if when is None or (started is not None and when < started):
            beat = {}  # the previous segment's last beat: this one has not beaten yet
        step = beat.get("step") if isinstance(beat.get("step"), int) else None
        if (segment, beat.get("pid")) != self._segment:
            self._segment, self._rate = (segment, beat.get("pid")), RateMeter()
        if step is not None and when is not None:
            self._rate.add(float(when), step)
        events, decisions = _counts(record, self.lineage_dir / "events.jsonl")
        ckpt = newest_commit(self.checkpoints)
        status = record.get("status") if isinstance(record.get("status"), str) else None
        return Progress(
            lineage=str(record.get("lineage") or self.lineage_dir.name),
            status=status,
            segment=segment,
            step=step,
            max_steps=self.max_steps,
            phase=beat.get("phase") if isinstance(beat.get("phase"), str) else None,
            loss=last_value(self.lineage_dir / "metrics" / f"{segment}.jsonl", "loss")
            if segment is not None
            else None,
            steps_per_second=self._rate.rate() if status not in DONE else None,
            since_checkpoint_s=self._clock() - ckpt[1] if ckpt else None,
            checkpoint_step=ckpt[0] if ckpt else None,
            events=events,
            decisions=decisions,
        )


def _json(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as fh:
            data = json.loads(fh.read(64 << 20))
    except (OSError, ValueError):
        return None  # not written yet, or mid-replace on a filesystem without atomic rename
    return data if isinstance(data, dict) else None


def _counts(record: dict[str, Any], events_path: Path) -> tuple[int, int]:
    """(events, decisions) in the record, plus in-process reports in events.jsonl it has not folded in."""
    try:
        rows = timeline_rows(record)
    except (TypeError, AttributeError, KeyError, ValueError):  # a record mid-shape: count what is readable
        rows = []
    events, decisions = len(rows), sum(r["action"] is not None for r in rows)
    offset = record.get("events_offset") if isinstance(record.get("events_offset"), int) else 0
    try:
        with events_path.open("rb") as fh:
            fh.seek(offset)
            tail = fh.read(EVENTS_TAIL_BYTES).split(b"\n")[:-1]  # the last part may be a line being written
    except OSError:
        return events, decisions
    for line in tail:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") != "save_failed" and isinstance(rec.get("event"), dict):
            events += 1
            decisions += isinstance(rec.get("decision"), dict)
    return events, decisions


def last_value(spool: Path, key: str) -> float | None:
    """The last value of `key` in a metric spool (`[key, value, timestamp_ms, step]` lines), from its end."""
    try:
        with spool.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - SPOOL_TAIL_BYTES))
            lines = fh.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[:-1]):  # the part after the last newline may be cut
        try:
            name, value, _, _ = json.loads(line)
        except (ValueError, TypeError):
            continue
        if name == key and isinstance(value, int | float):
            return float(value)
    return None


def newest_commit(store: Path | None) -> tuple[int, float] | None:
    """(step, commit time) of the newest committed checkpoint in a local store: its COMMITTED marker."""
    if store is None:
        return None
    from supervisor.checkpoint.options import parse_id

    best: tuple[int, int, float] | None = None  # (seq, step, mtime)
    try:
        names = os.listdir(store)
    except OSError:
        return None
    for name in names:
        if not name.startswith("ckpt-"):
            continue
        try:
            step, seq = parse_id(name[len("ckpt-") :])
            mtime = os.stat(store / name / "COMMITTED").st_mtime
        except (ValueError, OSError):
            continue
        if best is None or seq > best[0]:
            best = (seq, step, mtime)
    return (best[1], best[2]) if best else None


class ProgressLog:
    """Logs the progress line every `every` seconds on a thread, from `start()` to `stop()`; 0 logs nothing.

    A failed read is skipped (the display must never stop the supervision).
    """

    def __init__(self, read: Callable[[], Progress], every: float, logger: Any = None, *, name: bool = False):
        self._read, self.every, self._log, self._name = read, every, logger or log, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ProgressLog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ProgressLog:
        if self.every > 0:
            self._thread = threading.Thread(target=self._loop, name="rbs-progress", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                line = progress_line(self._read(), name=self._name)
            except Exception as exc:  # a file mid-write, a store gone: try again at the next tick
                log.debug("progress unavailable: %s", exc)
                continue
            self._log.info("progress: %s", line)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def reader_for(
    lineage_dir: Path, checkpoints: Path | None, command: Sequence[str], **kwargs: Any
) -> ProgressReader:
    """A reader for a lineage run with `command` (its max steps, when the command says)."""
    return ProgressReader(lineage_dir, checkpoints, max_steps=max_steps_of(command), **kwargs)
