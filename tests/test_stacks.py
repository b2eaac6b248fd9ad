"""Stacks on a hang: faulthandler's and py-spy's text parsed, where each rank was, the dump protocol on real
processes and real signals, the record and the status view."""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor.events import Event
from supervisor.lineage.record import LineageRecord, SegmentRecord
from supervisor.monitor import stack_dump
from supervisor.monitor.stacks import (
    MAX_FRAMES,
    SUMMARY_CHARS,
    Frame,
    HangStacks,
    RankStacks,
    ThreadStack,
    by_place,
    compact,
    parse_faulthandler,
    parse_py_spy,
    rank_ranges,
    short_path,
    summary_line,
    where_each_rank,
)
from supervisor.report.hangs import hang_lines, hang_rows

REPO = Path(__file__).resolve().parents[1]
SITE = "/venv/lib/python3.11/site-packages"

# Two dumps appended to one file, as faulthandler writes them (no blank line after a dump's last thread).
TWO_DUMPS = f"""\
Thread 0x00007f1bae4fc6c0 (most recent call first):
  File "/tmp/fh.py", line 5 in worker
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f1baf08eb80 (most recent call first):
  File "/tmp/fh.py", line 9 in step
  File "/tmp/fh.py", line 11 in <module>
Thread 0x00007f1bae4fc6c0 (most recent call first):
  File "/tmp/fh.py", line 5 in worker

Current thread 0x00007f1baf08eb80 (most recent call first):
  File "{SITE}/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "{SITE}/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/work/train.py", line 42 in step
"""

PY_SPY = f"""\
Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 0x7F1BAE4FC6C0 (idle): "Thread-1 (writer)"
    wait (threading.py:320)
Thread 0x7F1BAF08EB80 (active): "MainThread"
    all_reduce ({SITE}/torch/distributed/distributed_c10d.py:2501)
    step (/work/train.py:42)
    <module> (/work/train.py:60)
"""


def test_faulthandler_text_gives_the_last_dumps_threads_innermost_first():
    threads = parse_faulthandler(TWO_DUMPS)
    assert [t.thread_id for t in threads] == [0x7F1BAE4FC6C0, 0x7F1BAF08EB80]
    assert [t.current for t in threads] == [False, True]
    main = threads[1]
    assert [f.function for f in main.frames] == ["all_reduce", "wrapper", "step"]
    assert main.frames[2] == Frame("/work/train.py", 42, "step")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("garbage\nmore garbage\n", []),
        # the current thread alone (all_threads=False)
        ('Stack (most recent call first):\n  File "a.py", line 3 in f\n', [(None, ["a.py:3 f"])]),
        # unknown line, a thread without Python frames, a truncated stack, a thread name
        (
            'Thread 0x10 [MainThread] (most recent call first):\n  File "a.py", line ??? in f\n  ...\n\n'
            "Thread 0x20 (most recent call first):\n  <no Python frame>\n",
            [(0x10, ["a.py:? f"]), (0x20, [])],
        ),
    ],
)
def test_faulthandler_edge_cases(text, expected):
    got = [(t.thread_id, [f.where() for f in t.frames]) for t in parse_faulthandler(text)]
    assert got == expected


# py-spy 0.4.3's own output for a process sleeping in step(): OS thread ids, and no thread name.
PY_SPY_NATIVE = """\
Process 18605: /work/main/.venv/bin/python -c import time
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 18611 (idle)
    wait (threading.py:320)
Thread 18605 (idle)
    step (<string>:3)
    <module> (<string>:4)

"""


def test_py_spy_native_thread_ids_name_the_main_thread_by_the_pid():
    threads = parse_py_spy(PY_SPY_NATIVE)
    assert [t.thread_id for t in threads] == [18611, 18605]
    assert (
        RankStacks(None, "h", 18605, threads, main_thread=18605, source="py-spy").where() == "<string>:3 step"
    )


def test_py_spy_text_gives_named_threads_innermost_first():
    threads = parse_py_spy(PY_SPY)
    assert [(t.thread_id, t.name) for t in threads] == [
        (0x7F1BAE4FC6C0, "Thread-1 (writer)"),
        (0x7F1BAF08EB80, "MainThread"),
    ]
    rank = RankStacks(1, "h", 4242, threads, source="py-spy")
    assert rank.where() == "torch/distributed/distributed_c10d.py:2501 all_reduce"
    assert parse_py_spy("Process 1: python\nError: permission denied\n") == ()


@pytest.mark.parametrize(
    ("path", "short"),
    [
        (f"{SITE}/torch/distributed/distributed_c10d.py", "torch/distributed/distributed_c10d.py"),
        ("/usr/lib/python3/dist-packages/numpy/core.py", "numpy/core.py"),
        ("/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py", "threading.py"),
        ("/work/examples/train.py", "train.py"),
        ("train.py", "train.py"),
        ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap>"),
    ],
)
def test_short_path(path, short):
    assert short_path(path) == short


def _thread(ident: int, *frames: tuple[str, int, str], name: str | None = None) -> ThreadStack:
    return ThreadStack(ident, tuple(Frame(*f) for f in frames), name=name)


WORKER = _thread(1, ("/usr/lib/python3.11/threading.py", 320, "wait"))
MAIN = _thread(2, ("/work/train.py", 42, "step"), ("/work/train.py", 60, "<module>"))


@pytest.mark.parametrize(
    ("rank", "where"),
    [
        (RankStacks(0, "h", 1, (WORKER, MAIN), main_thread=2), "train.py:42 step"),  # named by the process
        (RankStacks(0, "h", 1, (MAIN, WORKER), main_thread=2), "train.py:42 step"),
        (RankStacks(0, "h", 1, (WORKER, MAIN)), "train.py:42 step"),  # CPython lists the main thread last
        (
            RankStacks(0, "h", 1, (_thread(2, ("/a.py", 1, "f"), name="MainThread"), WORKER)),
            "a.py:1 f",
        ),  # py-spy
        (RankStacks(0, "h", 1, (WORKER, _thread(2))), None),  # main thread in C only
        (RankStacks(0, "h", 1, ()), None),
    ],
)
def test_where_is_the_main_threads_innermost_frame(rank, where):
    assert rank.where() == where


def test_where_each_rank_and_the_summary_line():
    collective = _thread(2, (f"{SITE}/torch/distributed/distributed_c10d.py", 2501, "all_reduce"))
    ranks = [
        RankStacks(1, "h", 11, (MAIN,)),
        RankStacks(None, "h", 99, (WORKER,)),
        RankStacks(0, "h", 10, (collective,)),
        RankStacks(2, "h", 12, (_thread(2),)),
    ]
    where = where_each_rank(ranks)
    assert list(where) == ["0", "1", "2", "pid 99"]
    assert where["2"] == "no Python frame"
    assert summary_line(where, ["rank 3 (pid 13 on far): on another host"]) == (
        "rank 0: torch/distributed/distributed_c10d.py:2501 all_reduce; rank 1: train.py:42 step; "
        "rank 2: no Python frame; pid 99: threading.py:320 wait; rank 3 (pid 13 on far): on another host"
    )
    assert summary_line({}) == "no stacks"
    assert ranks[2].in_module("torch/distributed/") and not ranks[0].in_module("torch/distributed/")


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([0], "0"), ([0, 1], "0-1"), ([0, 2, 3, 4, 7], "0, 2-4, 7"), ([5, 6, 7, 9, 10], "5-7, 9-10")],
)
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


def test_at_scale_the_ranks_at_one_place_are_one_group_and_the_odd_one_stands_out():
    collective = "torch/distributed/distributed_c10d.py:2501 all_reduce"
    where = {str(r): collective for r in range(1024)} | {"517": "train.py:42 step", "pid 9": "x.py:1 f"}
    assert by_place(where) == [
        ("ranks 0-516, 518-1023", collective),
        ("rank 517", "train.py:42 step"),
        ("pid 9", "x.py:1 f"),
    ]
    assert (
        summary_line(where)
        == f"ranks 0-516, 518-1023: {collective}; rank 517: train.py:42 step; pid 9: x.py:1 f"
    )
    # Every rank somewhere else: the line the event carries stays bounded.
    scattered = {str(r): f"train.py:{r} step" for r in range(1024)}
    line = summary_line(scattered)
    assert (
        len(line) == SUMMARY_CHARS
        and line.startswith("rank 0: train.py:0 step; rank 1:")
        and line.endswith("…")
    )
    rows = [{"segment": 3, "where": where, "missing": [], "nccl_traces": []}]
    assert hang_lines(rows) == [
        "segment 3 hung; the ranks were at:",
        f"  ranks 0-516, 518-1023: {collective}",
        "  rank 517: train.py:42 step",
        "  pid 9: x.py:1 f",
    ]


def test_the_record_keeps_every_thread_of_a_small_job_and_of_one_rank_per_place_in_a_large_one():
    deep = _thread(2, *[("/work/train.py", n, f"f{n}") for n in range(150)])
    collective = _thread(2, (f"{SITE}/torch/distributed/distributed_c10d.py", 2501, "all_reduce"))
    small = [RankStacks(r, "h", r, (WORKER, MAIN), main_thread=2) for r in range(3)]
    assert compact(small) == tuple(small)
    large = [RankStacks(r, "h", r, (WORKER, collective), main_thread=2) for r in range(40)]
    large[7] = RankStacks(7, "h", 7, (WORKER, deep), main_thread=2)
    kept = compact(large)
    assert [len(r.threads) for r in kept] == [2] + [1] * 6 + [2] + [1] * 32  # rank 0 and rank 7 in full
    assert [r.where() for r in kept] == [r.where() for r in large]  # where each rank was is never lost
    assert len(kept[7].main().frames) == MAX_FRAMES and kept[7].main().frames[0].function == "f0"


def test_hang_stacks_round_trip_through_json_and_the_segment_record():
    stacks = HangStacks(
        (
            RankStacks(0, "h", 10, (WORKER, MAIN), main_thread=2),
            RankStacks(1, "h", 11, (MAIN,), source="py-spy"),
        ),
        missing=("rank 2 (pid 12 on far): on another host",),
        collected_at=1.5,
        seconds=0.25,
        dumps="/work/stacks/segment-1",
    )
    doc = json.loads(json.dumps(stacks.to_dict()))
    assert doc["where"] == {"0": "train.py:42 step", "1": "train.py:42 step"}
    assert HangStacks.from_dict(doc).to_dict() == doc
    seg = SegmentRecord(index=0, started=1.0)
    assert "stacks" not in seg.to_dict()  # written only once a hang filled it
    seg.put(stacks=doc)
    assert SegmentRecord.from_dict(seg.to_dict()).stacks == doc

    record = {"segments": [{"index": 0}, {"index": 1, "stacks": doc}, {"index": 2, "stacks": "junk"}]}
    rows = hang_rows(record)
    assert rows == [
        {
            "segment": 1,
            "summary": doc["summary"],
            "where": {"0": "train.py:42 step", "1": "train.py:42 step"},
            "missing": ["rank 2 (pid 12 on far): on another host"],
            "nccl_traces": [],
        }
    ]
    assert hang_lines(rows) == [
        "segment 1 hung; the ranks were at:",
        "  ranks 0-1: train.py:42 step",
        "  rank 2 (pid 12 on far): on another host",
    ]


# -- the dump protocol, on real processes ---------------------------------------------------------------------

ARMED_CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from supervisor.monitor import stack_dump
stack_dump.install({directory!r}, {rank})
{extra}
def stuck_in_step():
    print("armed", flush=True); time.sleep(60)  # one line: the parent reads "armed" before the sleep starts
stuck_in_step()
"""


def _armed_child(directory: Path, rank: int, extra: str = "") -> subprocess.Popen:
    code = ARMED_CHILD.format(repo=str(REPO), directory=str(directory), rank=rank, extra=extra)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "armed\n"
    return proc


def _end(child: subprocess.Popen) -> None:
    child.kill()
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


def test_collect_signals_every_armed_rank_and_parses_its_stacks(tmp_path: Path):
    directory = stack_dump.segment_dir(tmp_path, 3)
    children = [_armed_child(directory, 0), _armed_child(directory, 1)]
    try:
        started = time.monotonic()
        stacks = stack_dump.collect(directory)
        took = time.monotonic() - started
        assert all(c.poll() is None for c in children), "the signal must not end an armed process"
        # A second hang of the same processes reads only the new dump.
        again = stack_dump.collect(directory)
    finally:
        for child in children:
            _end(child)
    assert took < 2.0 and stacks.missing == () and stacks.dumps == str(directory)
    assert [(r.rank, r.pid, r.host) for r in stacks.ranks] == [
        (0, children[0].pid, socket.gethostname()),
        (1, children[1].pid, socket.gethostname()),
    ]
    line = next(i for i, text in enumerate(ARMED_CHILD.splitlines(), 1) if "time.sleep(60)" in text)
    assert stacks.summary() == f"ranks 0-1: <string>:{line} stuck_in_step"
    assert [len(r.threads) for r in again.ranks] == [1, 1]
    names = sorted(p.name for p in directory.iterdir())
    assert names == [
        f"rank0-{socket.gethostname()}-{children[0].pid}.txt",
        f"rank1-{socket.gethostname()}-{children[1].pid}.txt",
    ]


def test_collect_names_each_rank_it_could_not_read(tmp_path: Path, monkeypatch):
    directory = tmp_path / "stacks"
    # Armed, then deaf to the signal: no dump arrives within the wait.
    deaf = _armed_child(
        directory, 0, extra="import signal; signal.signal(stack_dump.STACK_SIGNAL, signal.SIG_IGN)"
    )
    gone = _armed_child(directory, 1)
    _end(gone)
    header = {"rank": 2, "host": "far-away", "pid": os.getpid(), "main_thread": 1, "armed_at": time.time()}
    (directory / "rank2-far-away-1.txt").write_text(stack_dump.HEADER + json.dumps(header) + "\n")
    (directory / "rank3-unreadable.txt").write_text("not a header\n")
    try:
        stacks = stack_dump.collect(directory, timeout=0.3)
    finally:
        _end(deaf)
    host = socket.gethostname()
    assert stacks.ranks == ()
    assert list(stacks.missing) == [
        f"rank 1 (pid {gone.pid} on {host}): no longer running",
        f"rank 2 (pid {os.getpid()} on far-away): on another host, not signalled from {host}",
        f"rank 0 (pid {deaf.pid}): no dump within 0.3 s",
    ]


def test_collect_without_an_armed_rank_says_why_there_are_no_stacks(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(stack_dump.shutil, "which", lambda name: None)
    stacks = stack_dump.collect(tmp_path / "none", root_pid=os.getpid(), unarmed="an unmodified script")
    assert stacks.ranks == () and stacks.missing == ("no stacks: an unmodified script without py-spy",)
    assert stacks.summary() == "no stacks: an unmodified script without py-spy"


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed")
def test_py_spy_reads_a_segment_whose_ranks_armed_nothing(tmp_path: Path):
    code = "import time\ndef stuck_in_step():\n    print('up', flush=True)\n    time.sleep(60)\nstuck_in_step()\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        stacks = stack_dump.collect(tmp_path / "none", root_pid=child.pid, unarmed="an unmodified script")
    finally:
        _end(child)
    assert stacks.missing == ()
    assert [(r.pid, r.source, r.where()) for r in stacks.ranks] == [
        (child.pid, "py-spy", "<string>:4 stuck_in_step")
    ]


def test_nccl_flight_recorder_is_armed_only_on_a_gpu_machine_the_user_left_alone(tmp_path: Path):
    stem = stack_dump.nccl_stem(tmp_path)
    assert stem == stack_dump.nccl_stem(tmp_path / ".") and stem != stack_dump.nccl_stem(tmp_path / "other")
    env = stack_dump.nccl_trace_env(stem, {})
    if not Path("/proc/driver/nvidia").exists():
        assert env == {}
    else:
        assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(stem)
    assert stack_dump.nccl_trace_env(stem, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == {}


def test_collect_fires_each_flight_recorder_pipe_and_keeps_the_dumps(tmp_path: Path):
    """torch's side is played by a thread here (a CPU build has no NCCL): it reads `<stem><rank>.pipe`, as
    ProcessGroupNCCL's monitor thread does, and writes its dump to `<stem><rank>`."""
    stem = tmp_path / "fr" / "rollback-nccl-x-rank"
    stem.parent.mkdir()
    os.mkfifo(f"{stem}0.pipe")
    os.mkfifo(f"{stem}1.pipe")  # a rank that is gone: no reader, never fired

    # The reader is there before the supervisor writes (torch keeps its pipe open for reading all along).
    fd = os.open(f"{stem}0.pipe", os.O_RDONLY | os.O_NONBLOCK)

    def recorder() -> None:
        try:
            readable, _, _ = select.select([fd], [], [], 5.0)
            assert readable and os.read(fd, 16)
        finally:
            os.close(fd)
        Path(f"{stem}0").write_bytes(b"trace of rank 0")

    reader = threading.Thread(target=recorder, daemon=True)
    reader.start()
    directory = tmp_path / "segment"
    directory.mkdir()
    stacks = stack_dump.collect(directory, nccl=stem, timeout=2.0)
    reader.join(2)
    assert stacks.nccl_traces == (str(directory / "rollback-nccl-x-rank0"),)
    assert (directory / "rollback-nccl-x-rank0").read_bytes() == b"trace of rank 0"
    assert hang_rows({"segments": [{"index": 0, "stacks": stacks.to_dict()}]})[0]["nccl_traces"] == [
        str(directory / "rollback-nccl-x-rank0")
    ]


@pytest.mark.parametrize("supervised", [True, False])
def test_a_segments_start_arms_its_ranks_dump_under_the_supervisor_only(tmp_path: Path, supervised: bool):
    from supervisor.runtime.plan import LaunchPlan
    from supervisor.runtime.resources import SegmentResources
    from supervisor.runtime.seams import NullHeartbeat, NullMetrics, Outputs
    from supervisor.runtime.segment_store import SegmentStore
    from supervisor.runtime.stops import StopSources
    from supervisor.state import TrainingState

    class Rank1:
        rank, is_writer = 1, False

    class Quiet:
        def start(self):
            return self

        def stop(self) -> None: ...

    work = tmp_path / "work"
    plan = LaunchPlan(
        lineage="r",
        workdir=str(work),
        checkpoint_dir=str(work / "ck"),
        tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}",
        segment=2,
        supervised=supervised,
    )
    stops = StopSources(lambda on_notice: Quiet(), None)  # type: ignore[arg-type,return-value]
    outputs = Outputs(NullMetrics(), NullHeartbeat())
    resources = SegmentResources(plan, SegmentStore(None, "full"), outputs, stops, Rank1())  # type: ignore[arg-type]
    try:
        resources.start(TrainingState())
        armed = stack_dump.armed_ranks(stack_dump.segment_dir(work, 2))
        if not supervised:
            assert armed == [] and not (work / "stacks").exists()
            return
        (rank,) = armed
        assert (rank.rank, rank.pid, rank.host) == (1, os.getpid(), socket.gethostname())
        os.kill(os.getpid(), stack_dump.STACK_SIGNAL)  # this very process dumps, and goes on
        threads = parse_faulthandler(rank.path.read_text())
        assert threads and any(
            f.function == "test_a_segments_start_arms_its_ranks_dump_under_the_supervisor_only"
            for f in RankStacks(1, "h", 1, threads, rank.main_thread).main().frames
        )
    finally:
        resources.stops.close()
        stack_dump.uninstall()


# -- the supervisor's side: the hang event carries the stacks ---------------------------------------------


class _Handle:
    def details(self) -> dict:
        return {"pid": 1}


def _segment_run(collect):
    from supervisor.orchestrator.segment_run import SegmentRun, SegmentSettings

    record = LineageRecord.from_dict({"lineage": "l", "status": "running", "mlflow": {}})
    return SegmentRun(
        None,  # type: ignore[arg-type]
        SegmentSettings(),
        record=record,
        events=None,  # type: ignore[arg-type]
        lease=None,  # type: ignore[arg-type]
        save=lambda: None,
        clock=time.monotonic,
        collect_stacks=collect,
    )


def test_a_hang_event_gets_the_summary_and_the_segment_the_stacks():
    stacks = HangStacks((RankStacks(0, "h", 10, (MAIN,)),), missing=("rank 1 (pid 11): no dump within 5 s",))
    seen = []
    run = _segment_run(lambda handle: seen.append(handle) or stacks)
    seg = SegmentRecord(index=2, started=0.0)
    hang = Event(type="hang", reason="no progress for 3 s", evidence={"timeout_seconds": 2.0})
    event = run._with_stacks(seg, _Handle(), hang)
    assert len(seen) == 1
    assert event.evidence == {
        "timeout_seconds": 2.0,
        "stacks": "rank 0: train.py:42 step; rank 1 (pid 11): no dump within 5 s",
    }
    assert seg.to_dict()["stacks"] == stacks.to_dict()


def test_a_failing_collection_leaves_the_event_as_it_was():
    def broken(handle):
        raise OSError("disk gone")

    seg = SegmentRecord(index=0, started=0.0)
    hang = Event(type="hang", reason="no progress")
    assert _segment_run(broken)._with_stacks(seg, _Handle(), hang) is hang
    assert seg.stacks is None


def test_arming_again_sets_the_handler_again_after_something_replaced_it(tmp_path: Path):
    # Lightning's signal connector restores every signal's handler as `signal.getsignal` saw it (SIG_DFL for
    # ours, which faulthandler installed behind Python's back); faulthandler re-registering a signal it holds
    # only swaps the file. A process armed again must still dump, not die of the signal. In a child: it would.
    script = f"""
import os, signal
from pathlib import Path
from supervisor.monitor import stack_dump
stack_dump.install(Path({str(tmp_path)!r}) / "a", 0)
signal.signal(stack_dump.STACK_SIGNAL, signal.SIG_DFL)
path = stack_dump.install(Path({str(tmp_path)!r}) / "b", 0)
os.kill(os.getpid(), stack_dump.STACK_SIGNAL)
print("dumped" if "File" in path.read_text() else "empty")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "dumped"), done.stderr[-2000:]
