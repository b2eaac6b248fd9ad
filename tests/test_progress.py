"""Live progress (issue 19): the one-line status of a supervised run from the files the supervisor already
reads (record, heartbeat, spool, checkpoint commits); rich's live line on a terminal, log lines otherwise,
and `status --watch`."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from supervisor.commands.progress import watch
from supervisor.commands.status import load_lineages, watch_lineages
from supervisor.report.progress import (
    Progress,
    ProgressLog,
    ProgressReader,
    RateMeter,
    duration_text,
    max_steps_of,
    progress_line,
)

CLI = Path(sys.executable).with_name("rollback-supervisor")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
T0 = 1_800_000_000.0


@pytest.mark.parametrize(
    ("argv", "steps"),
    [
        (["python", "train.py", "--steps", "900"], 900),
        (["python", "train.py", "--max_steps=120"], 120),
        (["python", "train.py", "--max-iters", "5000", "--lr", "3"], 5000),
        (["python", "train.py", "60"], None),  # a positional count says nothing
        (["python", "train.py", "--steps"], None),
        (["python", "train.py", "--steps", "many"], None),
    ],
)
def test_max_steps_from_the_command(argv, steps):
    assert max_steps_of(argv) == steps


def test_rate_meter_measures_over_its_window_and_restarts_after_going_back():
    meter = RateMeter(window=10.0)
    assert meter.rate() is None
    for t, step in [(0.0, 0), (1.0, 10), (1.0, 10), (2.0, 20)]:
        meter.add(t, step)
    assert meter.rate() == 10.0
    meter.add(30.0, 30)  # the window keeps the newest pair
    assert meter.rate() == 10.0 / 28.0
    meter.add(31.0, 5)  # a rollback: the pace starts again
    assert meter.rate() is None
    meter.add(33.0, 9)
    assert meter.rate() == 2.0


@pytest.mark.parametrize(("s", "text"), [(0, "0s"), (59.4, "59s"), (125, "2m05s"), (3600 * 3 + 420, "3h07m")])
def test_duration_text(s, text):
    assert duration_text(s) == text


def test_the_line_says_everything_and_fits_80_columns_in_short_words():
    p = Progress("charlm-demo", "running", 1, 412, 900, "train", 2.31412, 3.2, 12.0, 400, 2, 2)
    assert progress_line(p) == (
        "seg 1 · step 412/900 · loss 2.314 · 3.2 steps/s · 2m32s left · ckpt @400 12s ago · 2 events, 2 decisions"
    )
    assert (
        progress_line(p, 80) == "seg 1 · 412/900 · loss 2.314 · 3.2/s · ETA 2m32s · ckpt 12s ago · 2 ev/2 dec"
    )
    assert (
        progress_line(Progress("x"), name=True)
        == "x: seg - · step - · loss - · no ckpt yet · 0 events, 0 decisions"
    )
    done = Progress("x", "finished", 0, 60, None, "train", float("nan"), None, 1.0, 60, 1, 1)
    assert (
        progress_line(done) == "seg 0 · step 60 · loss nan · ckpt @60 1s ago · 1 event, 1 decision · finished"
    )


def _lineage(tmp_path: Path, status: str = "running") -> tuple[Path, Path]:
    """A lineage directory as a run leaves it mid-segment 1, and its checkpoint store."""
    directory, store = tmp_path / "lineages" / "demo", tmp_path / "checkpoints" / "demo"
    (directory / "metrics").mkdir(parents=True)
    kill = {"type": "unknown_exit", "reason": "SIGKILL", "step": None, "source": "exit"}
    decision = {"action": "resume", "target_id": "0000000040-000004", "target_step": 40, "reason": "resume"}
    record = {
        "lineage": "demo",
        "status": status,
        "command": ["python", "train.py", "--steps", "100"],
        "events_offset": 0,
        "segments": [
            {"index": 0, "event": kill, "decision": decision, "in_process": []},
            {"index": 1, "event": None, "decision": None, "in_process": []},
        ],
    }
    (directory / "lineage.json").write_text(json.dumps(record))
    # An in-process rollback the record has not folded in yet, a save failure (no event), and a cut line.
    nan = {"type": "non_finite", "reason": "nan", "step": 55, "source": "in_process"}
    lines = [
        {"kind": "anomaly", "event": nan, "decision": {"action": "rollback"}, "handled_in_process": True},
        {"kind": "save_failed", "event": {"type": "save_failed"}},
    ]
    (directory / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "ano')
    spool = [["loss", 0.5, 1, 49], ["val_loss", 0.7, 2, 50], ["loss", 0.25, 3, 50]]
    (directory / "metrics" / "1.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in spool) + '["loss", 9'
    )
    for step, seq, age in [(40, 4, 30.0), (50, 6, 5.0), (60, 5, 1.0)]:  # the newest commit is seq 6
        ckpt = store / f"ckpt-{step:010d}-{seq:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "COMMITTED").write_text("")
        os.utime(ckpt / "COMMITTED", (T0 - age, T0 - age))
    (store / "ckpt-0000000070-000007").mkdir()  # not committed
    return directory, store


def _beat(directory: Path, step: int, t: float, phase: str = "train") -> None:
    (directory / "heartbeat.json").write_text(
        json.dumps({"step": step, "wall_time": t, "phase": phase, "pid": 1})
    )


def test_the_reader_takes_each_fact_from_the_file_the_supervisor_already_reads(tmp_path):
    directory, store = _lineage(tmp_path)
    reader = ProgressReader(directory, store, max_steps=100, clock=lambda: T0)
    _beat(directory, 50, T0 - 2.0)
    first = reader.read()
    assert first.steps_per_second is None  # one beat: no pace yet
    _beat(directory, 54, T0 - 1.0, "checkpoint")
    p = reader.read()
    assert p == Progress(
        lineage="demo",
        status="running",
        segment=1,
        step=54,
        max_steps=100,
        phase="checkpoint",
        loss=0.25,
        steps_per_second=4.0,
        since_checkpoint_s=5.0,
        checkpoint_step=50,
        events=2,  # the kill in the record, the NaN in events.jsonl
        decisions=2,
    )
    assert p.seconds_left == 11.5
    assert progress_line(p) == (
        "seg 1 · step 54/100 (checkpoint) · loss 0.25 · 4 steps/s · 12s left · ckpt @50 5s ago · "
        "2 events, 2 decisions"
    )


def test_a_relaunched_segment_ignores_the_last_beat_of_the_one_before_and_its_start_up(tmp_path):
    directory, store = _lineage(tmp_path)
    record = json.loads((directory / "lineage.json").read_text())
    record["segments"][1]["started"] = T0
    (directory / "lineage.json").write_text(json.dumps(record))
    reader = ProgressReader(directory, store, max_steps=100, clock=lambda: T0 + 10)
    _beat(directory, 62, T0 - 1.0)  # segment 0's last beat, before segment 1 was launched
    assert reader.read().step is None
    paces = []
    for t, step in [
        (T0 + 2.0, 40),
        (T0 + 6.0, 40),
        (T0 + 7.0, 50),
        (T0 + 8.0, 60),
    ]:  # restored at 2 s, trains at 6 s
        (directory / "heartbeat.json").write_text(
            json.dumps({"step": step, "wall_time": t, "phase": "train", "pid": 2})
        )
        paces.append(reader.read().steps_per_second)
    assert paces == [None, None, 10.0, 10.0]


def test_status_watch_follows_until_the_lineage_is_done(tmp_path):
    directory, store = _lineage(tmp_path)
    _beat(directory, 50, T0 - 2.0)
    ticks = []

    def sleep(seconds: float) -> None:  # the lineage moves on while the watch waits
        ticks.append(seconds)
        _beat(directory, 50 + 10 * len(ticks), T0 - 2.0 + len(ticks))
        if len(ticks) == 2:
            record = json.loads((directory / "lineage.json").read_text())
            (directory / "lineage.json").write_text(json.dumps({**record, "status": "finished"}))

    out = io.StringIO()
    watch_lineages(tmp_path, load_lineages(tmp_path), 5.0, Console(file=out, width=200), sleep)
    lines = out.getvalue().splitlines()
    assert ticks == [5.0, 5.0]
    assert [line.split(" · ")[1] for line in lines] == ["step 50/100", "step 60/100", "step 70/100"]
    assert lines[1].startswith("demo: seg 1 · step 60/100 · loss 0.25 · 10 steps/s · 4s left · ckpt @50 ")
    assert lines[-1].endswith("· finished")


def test_watch_redraws_in_place_on_a_terminal(tmp_path):
    out = io.StringIO()
    reads = iter([Progress("a", "running", 0, 1), Progress("a", "finished", 0, 2)])
    last = watch(
        [lambda: next(reads)], Console(file=out, width=80, force_terminal=True), 1.0, sleep=lambda s: None
    )
    assert last[0].step == 2
    raw = out.getvalue()
    assert "\x1b[2K" in raw or "\x1b[1A" in raw  # the live display erased and redrew its line
    assert "a: seg 0 · step 2" in ANSI.sub("", raw)


SLOW_TRAIN = """\
import sys
import time

import torch

from supervisor.data import ResumableLoader
from supervisor.runtime import Session

steps = int(sys.argv[sys.argv.index("--steps") + 1])
torch.manual_seed(0)
torch.set_num_threads(1)
xs = torch.randn(256, 8)
loader = ResumableLoader(torch.utils.data.TensorDataset(xs, xs.sum(1, keepdim=True)), batch_size=8, shuffle=True, seed=0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sess = Session.attach(run_name="slow")
sess.register(model=model, optimizer=opt, data=loader)
with sess:
    for step, (x, y) in sess.loop(loader, max_steps=steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sess.log(loss=loss.item())
        time.sleep(0.03)  # about 4 s of training: time for the progress to show
sys.exit(sess.exit_code)
"""
#: A line the live display drew while training went on: every fact present.
LIVE = re.compile(
    r"seg 0 · step \d+/150 · loss [0-9.e-]+ · [0-9.]+ steps/s · \d+s left · ckpt @\d+ \d+s ago · 0 events, 0 decisions"
)


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    from tests.test_status_real_run import POLICY

    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "slow.py").write_text(SLOW_TRAIN)
    return [
        str(CLI), "run", *extra, "--policy", str(tmp_path / "policy.yaml"), "--lineage", "slow",
        "--workdir", str(tmp_path / "wd"), "--", sys.executable, str(tmp_path / "slow.py"), "--steps", "150",
    ]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
def test_run_draws_the_live_line_in_a_pseudo_terminal(tmp_path):
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "140", "LINES": "40", "TERM": "xterm-256color"}
    proc = subprocess.Popen(_argv(tmp_path), stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    raw = b"".join(chunks).decode("utf-8", "replace")
    assert "\x1b[2K" in raw  # drawn in place: the live display erases its line before each redraw
    text = ANSI.sub("", raw)
    drawn = [seg for seg in re.split(r"[\r\n]+", text) if LIVE.search(seg)]
    assert drawn, text[-3000:]
    steps = [int(re.search(r"step (\d+)/", line).group(1)) for line in drawn]
    assert len(set(steps)) >= 2 and steps == sorted(steps)  # it moved while training went on
    assert "lineage slow: finished" in text


class _Capture(logging.Handler):
    """Keeps the messages it gets; `got` is set once `n` have arrived."""

    def __init__(self, n: int, match: str = "progress: "):
        super().__init__(logging.INFO)
        self.n, self.match, self.lines, self.got = n, match, [], threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.match in message:
            self.lines.append(message)
            if len(self.lines) >= self.n:
                self.got.set()


def test_progress_log_logs_the_line_on_its_thread_and_skips_failed_reads():
    logger = logging.getLogger("tests.progress_log")
    logger.setLevel(logging.INFO)
    capture = _Capture(2)
    logger.addHandler(capture)
    reads = iter([OSError("mid-write"), Progress("a", "running", 0, 5), Progress("a", "running", 0, 9)])

    def read() -> Progress:
        got = next(reads, Progress("a", "finished", 0, 9))
        if isinstance(got, Exception):
            raise got
        return got

    try:
        with ProgressLog(read, 0.01, logger, name=True):
            assert capture.got.wait(60)
    finally:
        logger.removeHandler(capture)
    assert capture.lines[:2] == [
        "progress: a: seg 0 · step 5 · loss - · no ckpt yet · 0 events, 0 decisions",
        "progress: a: seg 0 · step 9 · loss - · no ckpt yet · 0 events, 0 decisions",
    ]
    with ProgressLog(read, 0, logger):  # 0: no thread, nothing logged
        pass


@pytest.mark.e2e
@pytest.mark.slow
def test_the_flow_logs_the_progress_line_to_its_run_log(prefect_harness, tmp_path):
    from flows.supervised import supervised_training
    from tests.test_status_real_run import POLICY

    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "slow.py").write_text(SLOW_TRAIN)
    flow_log = logging.getLogger("prefect.flow_runs")
    capture = _Capture(1, "progress: seg 0 · step ")
    level = flow_log.level
    flow_log.setLevel(logging.INFO)  # the harness's level is WARNING; a deployment's is the user's
    flow_log.addHandler(capture)
    try:
        result = supervised_training(
            command=[sys.executable, str(tmp_path / "slow.py"), "--steps", "90"],
            policy=str(tmp_path / "policy.yaml"),
            lineage="slow",
            workdir=str(tmp_path / "wd"),
            progress_seconds=0.5,
        )
    finally:
        flow_log.removeHandler(capture)
        flow_log.setLevel(level)
    assert result["status"] == "finished"
    assert any(re.search(r"step \d+/90 · loss \S+ · ", line) for line in capture.lines), capture.lines
