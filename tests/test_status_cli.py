"""`rollback-supervisor status` over a hand-built lineage record and a checkpoint store where the default
storage puts it (`<workdir>/checkpoints/<lineage>`); test_status_real_run.py reads what a real run wrote."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from policies.schema import CheckpointConfig
from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.checkpoint.options import CheckpointInfo
from supervisor.cli import main
from supervisor.commands.progress import watch
from supervisor.commands.status import (
    DEFAULT_STORAGE,
    PIPED_WIDTH,
    in_process_reason,
    output_width,
    segment_steps,
)
from supervisor.report import report_tags
from supervisor.report.progress import Progress, progress_line
from supervisor.state import TrainingState
from tests.test_report_timeline import CKPT, FINAL, lineage_record

EXE = Path(sys.executable).with_name("rollback-supervisor")


def _store(directory: Path) -> list[str]:
    """Save along the sample lineage's story (every 100 steps, rollbacks abandoning later commits)."""
    torch.manual_seed(0)
    state = TrainingState()
    model = state.register("model", torch.nn.Linear(4, 2))
    options = CheckpointOptions(directory=directory, async_save=False, memory_slots=0)
    with CheckpointManager(options, state) as manager:

        def save(step):
            with torch.no_grad():
                model.weight.add_(0.01)
            return manager.save(step, metrics={"loss": 3.0 - step / 300, "val_loss": 3.1 - step / 300}).id

        ids = [save(100)]
        manager.abandon_after(ids[0])  # the in-process NaN rollback to 100
        ids += [save(200), save(300), save(400)]
        manager.abandon_after(ids[1])  # the spike: roll back to 200
        ids += [save(300), save(400), save(500), save(600)]
    return ids


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch):
    """In-process status reads COLUMNS; these tests expect the piped default (the width tests set their own)."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "wd"
    demo = wd / "lineages" / "charlm-demo"
    demo.mkdir(parents=True)
    ids = _store(wd / "checkpoints" / "charlm-demo")  # the default storage's place; the record has no storage
    assert [ids[i] for i in (0, 1, 5, 6, 7)] == [CKPT[100], CKPT[200], CKPT[400], CKPT[500], FINAL]
    (demo / "lineage.json").write_text(json.dumps(lineage_record(), indent=2))
    fresh = wd / "lineages" / "fresh"
    fresh.mkdir(parents=True)
    record = {
        "version": 1,
        "lineage": "fresh",
        "status": "running",
        "segments": [{"index": 0, "pid": 7, "started": 1.0}],
    }
    (fresh / "lineage.json").write_text(json.dumps(record))
    return wd


def _json(capsys, *args: str) -> dict:
    assert main(["status", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))


def test_json_lists_every_lineage_with_segments_timeline_and_checkpoints(workdir, capsys):
    doc = _json(capsys, "--workdir", str(workdir))
    demo, fresh = doc["lineages"]
    assert (demo["lineage"], fresh["lineage"]) == ("charlm-demo", "fresh")
    assert demo["status"] == "finished" and demo["final_checkpoint"] == FINAL
    assert demo["final_reason"] == "training finished at step 600"
    assert (demo["rollbacks"], demo["restarts"]) == (2, 4)
    assert [s["outcome"] for s in demo["segments"]] == ["rollback", "resume", "resume", "finished"]
    assert [(r["event"], r["action"], r["target_step"]) for r in demo["timeline"]] == [
        ("non_finite", "rollback", 100),
        ("spike", "rollback", 200),
        ("unknown_exit", "resume", 400),
        ("hardware_fault", "resume", 500),
    ]
    assert demo["timeline"][0]["value"] == "NaN"
    ckpts = demo["checkpoints"]
    assert [(c["step"], c["abandoned"]) for c in ckpts] == [
        (100, False),
        (200, False),
        (300, True),
        (400, True),
        (300, False),
        (400, False),
        (500, False),
        (600, False),
    ]
    assert ckpts[-1]["id"] == FINAL and ckpts[-1]["parent_id"] == CKPT[500]
    assert ckpts[0]["metrics"] == pytest.approx({"loss": 3.0 - 1 / 3, "val_loss": 3.1 - 1 / 3})
    assert fresh["status"] == "running" and fresh["checkpoints"] == [] and fresh["timeline"] == []


def test_json_agrees_with_the_mlflow_tags(workdir, capsys):
    demo = _json(capsys, "--workdir", str(workdir), "--lineage", "charlm-demo")["lineages"][0]
    tags = report_tags(lineage_record())
    assert tags["rollback.status"] == demo["status"]
    assert tags["rollback.final_checkpoint"] == demo["final_checkpoint"]
    assert tags["rollback.final_reason"] == demo["final_reason"]
    assert (tags["rollback.rollbacks"], tags["rollback.restarts"]) == (
        str(demo["rollbacks"]),
        str(demo["restarts"]),
    )
    assert sum(k.startswith("rollback.decision.") for k in tags) == len(demo["timeline"])


def test_human_output_shows_tables_for_each_lineage(workdir, capsys):
    assert main(["status", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "charlm-demo: finished, 4 segment(s), 2 rollback(s) (1 in process), 4 restart(s)" in out
    assert "fresh: running, 1 segment(s)" in out
    for text in ("segments", "events and decisions", "checkpoints", "hardware_fault", "Xid 79", "no events"):
        assert text in out, text
    assert out.count("abandoned") == 2
    assert "no checkpoints" in out
    rows = {line.lstrip("│ ")[:17]: line for line in out.splitlines() if line.lstrip("│ ")[:10].isdigit()}
    assert "live" in rows[FINAL] and "final" in rows[FINAL]
    assert "rollback target (#1)" in rows[CKPT[200]]


def test_lineage_filter_and_its_errors(workdir, capsys):
    assert [
        x["lineage"] for x in _json(capsys, "--workdir", str(workdir), "--lineage", "fresh")["lineages"]
    ] == ["fresh"]
    assert main(["status", "--workdir", str(workdir), "--lineage", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--lineage nope" in err and "expected one of: charlm-demo, fresh" in err


@pytest.mark.parametrize(
    ("make", "args", "code", "message"),
    [
        (lambda tmp: None, ["--workdir", "{tmp}/missing"], 2, "--workdir {tmp}/missing: no such directory"),
        (lambda tmp: tmp.mkdir(exist_ok=True), ["--workdir", "{tmp}"], 0, "no lineages under {tmp}/lineages"),
        (
            lambda tmp: (
                (tmp / "lineages" / "bad").mkdir(parents=True)
                or (tmp / "lineages" / "bad" / "lineage.json").write_text("{not json")
            ),
            ["--workdir", "{tmp}"],
            2,
            "lineage record {tmp}/lineages/bad/lineage.json is not valid JSON",
        ),
        (
            lambda tmp: tmp.mkdir(exist_ok=True),
            ["--workdir", "{tmp}", "stray"],
            2,
            "unexpected argument(s) stray",
        ),
    ],
    ids=["missing-workdir", "empty-workdir", "corrupt-record", "stray-argument"],
)
def test_workdir_problems(tmp_path, capsys, make, args, code, message):
    make(tmp_path)
    assert main(["status", *(a.format(tmp=tmp_path) for a in args)]) == code
    captured = capsys.readouterr()
    assert message.format(tmp=tmp_path) in (captured.err if code else captured.out)


@pytest.mark.e2e
@pytest.mark.slow
def test_console_script_prints_json(workdir):
    out = subprocess.run(
        [str(EXE), "status", "--workdir", str(workdir), "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert [x["lineage"] for x in json.loads(out.stdout)["lineages"]] == ["charlm-demo", "fresh"]
    missing = subprocess.run(
        [str(EXE), "status", "--workdir", str(workdir / "nope")], capture_output=True, text=True
    )
    assert (
        missing.returncode == 2 and "error: --workdir" in missing.stderr and "Traceback" not in missing.stderr
    )


def test_in_process_rows_say_in_process_and_relaunches_keep_their_delay(workdir, capsys):
    rows = _json(capsys, "--workdir", str(workdir), "--lineage", "charlm-demo")["lineages"][0]["timeline"]
    for row in rows:
        assert ("in process" in row["reason"]) == row["in_process"], row["reason"]


@pytest.mark.parametrize(
    ("reason", "shown"),
    [
        (
            "rules[0]: roll back; skip 300 batches, lr x0.5, relaunch in 0.7 s; budgets left: 4 of 5",
            "rules[0]: roll back; skip 300 batches, lr x0.5, continued in process, no relaunch; budgets left: 4 of 5",
        ),
        ("fake in-process rollback", "fake in-process rollback; handled in process"),
    ],
)
def test_in_process_reason(reason, shown):
    assert in_process_reason(reason) == shown


def _info(step: int, seq: int, wall_time: float, abandoned: bool = False) -> CheckpointInfo:
    return CheckpointInfo(
        id=f"{step:010d}-{seq:06d}", step=step, wall_time=wall_time, seq=seq, abandoned=abandoned
    )


#: A store along one lineage: 100 and 120 before the segment (started at t=10), 140 during it (t=12).
INFOS = [_info(100, 1, 5.0), _info(120, 2, 6.0), _info(140, 3, 12.0)]


def _seg(**kw) -> dict:
    # start_step / last_step are the heartbeat's steps at launch and at exit, as the orchestrator records them
    return {"index": 1, "started": 10.0, "ended": 20.0, "start_step": 90, "last_step": 137, **kw}


@pytest.mark.parametrize(
    ("seg", "spool", "steps"),
    [
        # killed at 150: the heartbeat said 137, the spool logged 150
        (_seg(restore={"checkpoint_id": "0000000100-000001"}), (19.0, 150), (100, 150)),
        # no spool: the checkpoint it saved (140) beats the lagging heartbeat
        (_seg(restore={"checkpoint_id": "0000000100-000001"}), None, (100, 140)),
        # a checkpoint retention deleted: its id still names its step
        (_seg(restore={"checkpoint_id": "0000000080-000009"}, last_step=85), None, (80, 140)),
        # the heartbeat file is the lineage's: unchanged since launch means this segment never beat
        (_seg(restore={"checkpoint_id": "0000000100-000001"}, start_step=137, ended=11.0), None, (100, 100)),
        (_seg(restore={"from_scratch": True}, ended=11.0, last_step=5), None, (0, 5)),
        # "the newest valid" at launch: the newest checkpoint saved before the segment started
        (_seg(restore={}, ended=11.0, last_step=None), None, (120, 120)),
        (_seg(restore={}, index=0, started=1.0, ended=2.0, last_step=None), None, (0, 0)),
        # the anomaly that ended it was seen at step 152
        (
            _seg(restore={"checkpoint_id": "0000000100-000001"}, event={"step": 152, "wall_time": 19.5}),
            (19.0, 150),
            (100, 152),
        ),
        # an in-process rollback at step 160 went back to 140 at t=14; after it the spool logged 150, and the
        # heartbeat (158) may predate the rollback
        (
            _seg(
                restore={"checkpoint_id": "0000000100-000001"},
                last_step=158,
                in_process=[
                    {
                        "time": 14.0,
                        "event": {"step": 160},
                        "decision": {"action": "rollback", "target_step": 140},
                    }
                ],
            ),
            (19.0, 150),
            (100, 150),
        ),
        # ... but a beat past the anomaly's step is on the new branch
        (
            _seg(
                restore={"checkpoint_id": "0000000100-000001"},
                last_step=171,
                in_process=[
                    {
                        "time": 14.0,
                        "event": {"step": 160},
                        "decision": {"action": "rollback", "target_step": 140},
                    }
                ],
            ),
            (19.0, 150),
            (100, 171),
        ),
    ],
)
def test_segment_steps_come_from_the_record_checkpoints_and_spool(seg, spool, steps):
    assert segment_steps(seg, INFOS, spool) == steps


def test_the_default_storage_is_the_schemas():
    assert CheckpointConfig().storage == DEFAULT_STORAGE


def _record(lineage: str, **extra) -> dict:
    return {"version": 1, "lineage": lineage, "status": "finished", "segments": [], **extra}


def _small_store(directory: Path) -> str:
    state = TrainingState()
    state.register("model", torch.nn.Linear(2, 2))
    with CheckpointManager(
        CheckpointOptions(directory=directory, async_save=False, memory_slots=0), state
    ) as m:
        return m.save(10).id


@pytest.mark.parametrize("where", ["recorded-outside-the-workdir", "workdir-moved", "no-storage-key"])
def test_status_finds_the_store_wherever_the_policy_put_it(tmp_path, capsys, where):
    wd = tmp_path / "wd"
    (wd / "lineages" / "x").mkdir(parents=True)
    if where == "recorded-outside-the-workdir":  # storage: /abs/elsewhere
        store = tmp_path / "elsewhere" / "x"
        storage = {"checkpoints": str(store), "remote": None, "durable": str(wd / "lineages" / "x")}
    elif where == "workdir-moved":  # storage: ./ckpts, recorded when the workdir was /old/wd
        store = wd / "ckpts" / "x"
        storage = {"checkpoints": "/old/wd/ckpts/x", "remote": None, "durable": "/old/wd/lineages/x"}
    else:
        store, storage = wd / "checkpoints" / "x", None
    ckpt = _small_store(store)
    record = _record("x", **({"storage": storage} if storage else {}))
    (wd / "lineages" / "x" / "lineage.json").write_text(json.dumps(record))
    view = _json(capsys, "--workdir", str(wd))["lineages"][0]
    assert [c["id"] for c in view["checkpoints"]] == [ckpt]
    assert view["checkpoint_store"] == str(store.resolve())


BINARY = bytes(range(256)) * 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (BINARY, "is not valid JSON (UnicodeDecodeError"),
        (b"\x89PNG\r\n\x1a\n" + BINARY, "is not valid JSON"),
        (b'{"lineage": "x", "segments": [', "is not valid JSON (JSONDecodeError"),
        (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON (RecursionError"),
        (b"[1, 2]", "is not a lineage record: expected a JSON object, found a list"),
        (b'{"segments": 5}', "is not a lineage record: key 'segments': found a number"),
        (b'{"segments": [{"in_process": [1]}]}', "segments[0].in_process[0]: expected an object"),
        (b'{"segments": [{"restore": "latest"}]}', "segments[0].restore: found a string"),
        (b'{"segments": [{"started": true}]}', "segments[0].started: found a boolean"),
    ],
    ids=[
        "binary",
        "png",
        "truncated",
        "deep",
        "list",
        "segments-number",
        "in-process-item",
        "restore",
        "bool",
    ],
)
def test_an_invalid_lineage_record_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "lineages" / "bad" / "lineage.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert main(["status", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: lineage record {path} ") and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_a_lineage_record_that_is_no_file_does_not_hang(tmp_path, capsys, make):
    path = tmp_path / "lineages" / "bad" / "lineage.json"
    path.parent.mkdir(parents=True)
    make(path)  # a FIFO with no writer: reading it would wait forever
    assert main(["status", "--workdir", str(tmp_path)]) == 2
    assert f"lineage record {path} is not a regular file" in capsys.readouterr().err


@pytest.mark.e2e
def test_console_script_on_a_binary_record_prints_one_line(tmp_path):
    path = tmp_path / "lineages" / "bad" / "lineage.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(BINARY)
    out = subprocess.run(
        [str(EXE), "status", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"error: lineage record {path} is not valid JSON")


@pytest.mark.parametrize(
    ("option", "columns", "terminal", "width"),
    [
        (None, None, None, PIPED_WIDTH),  # piped, nothing said: today's default
        (None, None, 93, 93),  # a terminal: its width
        (None, "80", None, 80),  # COLUMNS, piped or not
        (None, "80", 200, 80),
        (None, " 100 ", None, 100),
        (None, "0", None, PIPED_WIDTH),  # COLUMNS that is no positive integer is ignored
        (None, "-80", 93, 93),
        (None, "wide", None, PIPED_WIDTH),
        (None, "", 93, 93),
        (70, "80", 200, 70),  # --width wins over both
        (300, None, None, 300),
    ],
)
def test_output_width_prefers_the_option_then_columns_then_the_terminal(option, columns, terminal, width):
    environ = {} if columns is None else {"COLUMNS": columns}
    assert output_width(option, environ, terminal) == width


@pytest.mark.parametrize("bad", ["0", "-5", "abc", "8.5", ""])
def test_a_bad_width_is_one_line_and_exit_2(workdir, capsys, bad):
    assert main(["status", "--workdir", str(workdir), f"--width={bad}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: --width: expected a whole number of columns > 0, got {bad!r}\n"


def _piped_status(workdir: Path, args: list[str], columns: str | None) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")
    }
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run(
        [str(EXE), "status", "--workdir", str(workdir), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "columns", "width"),
    [
        ([], "80", 80),
        ([], "160", 160),
        (["--width", "80"], None, 80),
        (["--width", "80"], "160", 80),  # the option wins over COLUMNS
        (["--width", "132"], "80", 132),
        ([], None, PIPED_WIDTH),  # piped, nothing said
    ],
)
def test_piped_status_fits_the_width_asked_for(workdir, args, columns, width):
    out = _piped_status(workdir, args, columns)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, f"lines wider than {width}: {too_wide}"
    header = next(line for line in lines if line.startswith("┃ id "))  # the checkpoint table's header
    summary = (
        "charlm-demo: finished, 4 segment(s), 2 rollback(s) (1 in process), 4 restart(s), final checkpoint"
    )
    assert summary in " ".join(lines[:2])  # whole, never cut by the edge
    if width < 120:  # the narrow layout: short timeline with numbered reasons, fewer checkpoint columns
        assert "saved" not in header and "parent" not in header
        assert any(line.lstrip().startswith("1. ") for line in lines)
    else:  # the wide layout: one event table and every checkpoint column
        assert "saved" in header and "parent" in header
        assert not any(line.lstrip().startswith("1. ") for line in lines)
    assert lines[0].endswith("───") == (width == PIPED_WIDTH)  # a rule only where the summary fits on it
    assert max(len(line) for line in lines) > width - 25  # the layout used the room it had


@pytest.mark.e2e
def test_piped_status_with_a_bad_width_prints_no_traceback(workdir):
    out = _piped_status(workdir, ["--width", "-3"], "80")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: --width: expected a whole number of columns > 0, got '-3'\n"


@pytest.mark.parametrize("width", [80, 200])
def test_piped_watch_lines_take_short_words_in_a_narrow_console(width):
    done = Progress("charlm-demo", "finished", 1, 900, 900, "train", 2.31412, 3.2, 12.0, 900, 2, 2)
    out = io.StringIO()
    watch(
        [lambda: done], Console(file=out, width=width), 1.0, sleep=lambda s: pytest.fail("no wait when done")
    )
    assert out.getvalue().splitlines() == [progress_line(done, width, name=True)]
    assert ("steps/s" in out.getvalue()) == (width == 200)  # never cut: a log line keeps every fact


def _on_a_terminal(workdir: Path, columns: int, env_columns: str | None, *args: str) -> list[str]:
    """status's lines on a pseudo-terminal `columns` wide, with or without COLUMNS."""
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE")}
    if env_columns is not None:
        env["COLUMNS"] = env_columns
    proc = subprocess.Popen(
        [str(EXE), "status", "--workdir", str(workdir), *args], stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    raw = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        raw += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, raw.decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode()).splitlines()


@pytest.mark.e2e
@pytest.mark.parametrize(("columns", "env_columns", "width"), [(100, None, 100), (100, "150", 150)])
def test_on_a_terminal_status_takes_its_width_unless_columns_says(workdir, columns, env_columns, width):
    lines = _on_a_terminal(workdir, columns, env_columns)
    assert max(len(line) for line in lines) == width


@pytest.mark.e2e
def test_watch_on_a_terminal_is_never_wider_than_it(workdir):
    lines = _on_a_terminal(workdir, 70, None, "--watch", "--width", "300", "--lineage", "charlm-demo")
    assert [line for line in lines if line.strip()] and all(len(line) <= 70 for line in lines)
    assert any(line.startswith("charlm-demo: seg 3") for line in lines)
