"""`rollback-supervisor status`: each lineage's segments, events, decisions and checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from supervisor.errors import UserError
from supervisor.layout import LineageLayout, is_url
from supervisor.lineage import MAX_RECORD_BYTES, LineageRecordError, decode_record
from supervisor.report.exclusions import exclusion_lines, exclusion_rows
from supervisor.report.hangs import hang_lines, hang_rows
from supervisor.report.timeline import (
    SEGMENT_COLUMNS,
    WIDE_TABLE_COLUMNS,
    clock_text,
    counts,
    jsonable,
    rich_table,
    segment_cells,
    short_timeline,
    summary_line,
    timeline_rows,
)
from supervisor.smallfile import FileTooLarge, NotRegularFile, read_small_file

STATUS_STYLES = {"finished": "green", "stopped": "green", "running": "cyan", "failed": "bold red"}
#: The policy's checkpoint.storage when the record does not say (the schema's default).
DEFAULT_STORAGE = "./checkpoints"
#: The width of piped or captured output when neither --width nor COLUMNS gives one: tables stay readable.
PIPED_WIDTH = 160
#: How much of a metric spool's end is read to find the last step it logged.
SPOOL_TAIL_BYTES = 64 << 10
_RELAUNCH_IN = re.compile(r"relaunch in \d+(?:\.\d+)? s")


class StatusError(UserError):
    """The workdir or lineage asked for does not exist or cannot be read."""


def command(
    ctx: typer.Context,
    workdir: Path = typer.Option(Path(".rollback"), "--workdir", help="The supervisor's work directory."),
    lineage: str | None = typer.Option(None, "--lineage", help="Show only this lineage."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document for scripts."),
    watch: bool = typer.Option(
        False, "--watch", help="Follow each lineage's progress line until every one is done (Ctrl-C stops)."
    ),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between --watch refreshes."),
    width: str | None = typer.Option(
        None,
        "--width",
        metavar="N",
        help=f"Lay the output out in N columns. Default: $COLUMNS, else the terminal's width, "
        f"else {PIPED_WIDTH} when piped. Below 120 the tables take their narrow form.",
    ),
) -> None:
    """Show each lineage's segments, events, decisions and checkpoints."""
    if ctx.args:
        raise StatusError(f"status: unexpected argument(s) {' '.join(ctx.args)}; see `status --help`")
    if watch and json_out:
        raise StatusError("status: --watch and --json do not go together; pick one")
    columns = parse_width(width)
    found_records = load_lineages(workdir, lineage)
    if watch:
        watch_lineages(workdir, found_records, interval, _console(columns, live=True))
        return
    found = [_status(d, r, workdir) for d, r in found_records]
    if json_out:
        doc = {"lineages": [view for _, view in found]}
        typer.echo(json.dumps(jsonable(doc), indent=2, allow_nan=False))
        return
    console = _console(columns)
    if not found:
        console.print(f"no lineages under {workdir / 'lineages'}")
    for shown, view in found:
        print_lineage(console, shown, view)


def parse_width(text: str | None) -> int | None:
    """The --width option's columns, or None when it is not given; StatusError for anything but N > 0."""
    if text is None:
        return None
    try:
        columns = int(text.strip())
    except ValueError:
        columns = 0
    if columns < 1:
        raise StatusError(f"--width: expected a whole number of columns > 0, got {text!r}")
    return columns


def output_width(option: int | None, environ: Mapping[str, str], terminal: int | None) -> int:
    """The columns status lays its output out in: --width, else COLUMNS > 0, else the terminal's, else 160.

    `terminal` is the terminal's width when stdout is one, else None (piped or captured).
    """
    if option is not None:
        return option
    columns = environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    return terminal if terminal is not None else PIPED_WIDTH


def _console(option: int | None, live: bool = False) -> Console:
    """A console for stdout at `output_width`; `live`, never wider than the terminal (redraws need that)."""
    terminal = _terminal_width(Console())
    width = output_width(option, os.environ, terminal)
    return Console(width=min(width, terminal) if live and terminal is not None else width)


def _terminal_width(console: Console) -> int | None:
    """The width of the terminal on stdout; None when stdout is none. Rich's own width would read COLUMNS."""
    if not console.is_terminal:
        return None
    try:
        return os.get_terminal_size(console.file.fileno()).columns or console.width
    except (AttributeError, OSError, ValueError):  # forced terminal (FORCE_COLOR, TTY_COMPATIBLE) on a pipe
        return console.width


def watch_lineages(
    workdir: Path,
    found: list[tuple[Path, dict[str, Any]]],
    interval: float,
    console: Console | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """The live progress line of each lineage, from its directory and checkpoint store, until all are done."""
    from supervisor.commands.progress import watch
    from supervisor.report.progress import reader_for

    console = console or Console()
    if not found:
        console.print(f"no lineages under {workdir / 'lineages'}")
        return
    readers = []
    for directory, record in found:
        command = record.get("command") if isinstance(record.get("command"), list) else []
        store = checkpoint_store(workdir, directory, record)
        readers.append(reader_for(directory, store, [str(a) for a in command]).read)
    watch(readers, console, interval, sleep=sleep)


def load_lineages(workdir: Path, only: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """(lineage directory, record) for each `<workdir>/lineages/*/lineage.json`, sorted by name."""
    if not workdir.is_dir():
        raise StatusError(
            f"--workdir {workdir}: no such directory; expected the directory `rollback-supervisor run` "
            "used (default .rollback)"
        )
    paths = sorted((workdir / "lineages").glob("*/lineage.json"))
    if only is not None:
        paths = [p for p in paths if p.parent.name == only]
        if not paths:
            known = ", ".join(p.parent.name for p in sorted((workdir / "lineages").glob("*/lineage.json")))
            raise StatusError(
                f"--lineage {only}: no {workdir / 'lineages' / only / 'lineage.json'}; "
                f"expected one of: {known or 'none (no lineage has run in this workdir)'}"
            )
    return [(p.parent, _read(p)) for p in paths]


def _read(path: Path) -> dict[str, Any]:
    """A lineage record; StatusError (exit 2, one line) for anything that is not one."""
    try:
        raw = _read_bounded(path)
    except OSError as exc:
        raise StatusError(f"lineage record {path} cannot be read: {exc.strerror or exc}") from None
    try:
        record = decode_record(raw, str(path))
    except LineageRecordError as exc:
        raise StatusError(str(exc)) from None
    problem = _shape_problem(record)
    if problem:
        raise StatusError(f"lineage record {path} is not a lineage record: {problem}")
    return record


def _read_bounded(path: Path) -> bytes:
    try:
        return read_small_file(path, MAX_RECORD_BYTES)  # a FIFO planted as lineage.json must not hang status
    except NotRegularFile:
        raise StatusError(f"lineage record {path} is not a regular file") from None
    except FileTooLarge:
        raise StatusError(
            f"lineage record {path} is over {MAX_RECORD_BYTES >> 20} MiB; it is damaged"
        ) from None


_OBJECT_OR_NULL = (dict, type(None))
_NUMBER_OR_NULL = (int, float, type(None))
#: The keys status reads from each segment, and the JSON types it can show.
_SEGMENT_KEYS: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "pid": (int, type(None)),
    "started": _NUMBER_OR_NULL,
    "ended": _NUMBER_OR_NULL,
    "returncode": (int, type(None)),
    "signal_sent": (str, int, type(None)),
    "start_step": (int, type(None)),
    "last_step": (int, type(None)),
    "outcome": (str, type(None)),
    "restore": _OBJECT_OR_NULL,
    "event": _OBJECT_OR_NULL,
    "decision": _OBJECT_OR_NULL,
    "in_process": (list, type(None)),
}


def _shape_problem(record: Any) -> str | None:
    """What makes `record` unusable by status, or None: the types of the keys it reads."""
    if not isinstance(record, dict):
        return f"expected a JSON object, found {_json_type(record)}"
    for key, kinds in (
        ("lineage", (str, type(None))),
        ("status", (str, type(None))),
        ("final_reason", (str, type(None))),
        ("final_checkpoint", (str, type(None))),
        ("segments", (list, type(None))),
        ("storage", _OBJECT_OR_NULL),
        ("excluded_hosts", (list, type(None))),
        ("not_excluded", (list, type(None))),
    ):
        if key in record and not isinstance(record[key], kinds):
            return f"key {key!r}: found {_json_type(record[key])}"
    for i, seg in enumerate(record.get("segments") or []):
        if not isinstance(seg, dict):
            return f"segments[{i}]: expected an object, found {_json_type(seg)}"
        for key, kinds in _SEGMENT_KEYS.items():
            if key in seg and (not isinstance(seg[key], kinds) or isinstance(seg[key], bool)):
                return f"segments[{i}].{key}: found {_json_type(seg[key])}"
        for j, entry in enumerate(seg.get("in_process") or []):
            if not isinstance(entry, dict) or not all(
                isinstance(entry.get(k), _OBJECT_OR_NULL) for k in ("event", "decision")
            ):
                return f"segments[{i}].in_process[{j}]: expected an object with event and decision objects"
    return None


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def lineage_status(directory: Path, record: dict[str, Any], workdir: Path | None = None) -> dict[str, Any]:
    """The JSON view of one lineage: record summary, counts, segments, timeline and checkpoints.

    Segment steps come from the record and the checkpoints (`segment_steps`); `heartbeat_step` keeps the
    heartbeat's last step, which lags the training by up to a beat interval.
    """
    return _status(directory, record, workdir if workdir is not None else directory.parent.parent)[1]


def _status(directory: Path, record: dict[str, Any], workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the record as shown, the JSON view), or StatusError naming the record."""
    try:
        return _view(directory, record, workdir)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a shape _shape_problem did not foresee
        where = directory / "lineage.json"
        raise StatusError(
            f"lineage record {where} is not a lineage record: {type(exc).__name__}: {exc}"
        ) from None


def _view(directory: Path, record: dict[str, Any], workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    store = checkpoint_store(workdir, directory, record)
    infos, store_problem = _list(store)
    display = _for_display(record, infos, directory)
    c = counts(record)
    return display, {
        "lineage": record.get("lineage") or directory.name,
        "status": record.get("status"),
        "final_reason": record.get("final_reason"),
        "final_checkpoint": record.get("final_checkpoint"),
        "rollbacks": c["rollbacks"],
        "restarts": c["restarts"],
        "segments": display.get("segments") or [],
        "timeline": timeline_rows(display),
        "hangs": hang_rows(record),
        **exclusion_rows(record),
        "checkpoint_store": str(store) if store else None,
        "checkpoint_store_problem": store_problem,
        "checkpoints": [dataclasses.asdict(i) for i in infos],
    }


def checkpoint_store(workdir: Path, directory: Path, record: dict[str, Any]) -> Path | None:
    """The lineage's local checkpoint store, wherever its policy put it; None when it has none yet.

    The record's `storage` holds what LineageLayout resolved for the run. For a workdir that moved since, the
    same storage is resolved again against this workdir; a record without `storage` gets the default storage.
    """
    storage = record.get("storage") or {}
    recorded, durable = storage.get("checkpoints"), storage.get("durable")
    candidates, policy_storage = [], DEFAULT_STORAGE
    if isinstance(recorded, str) and recorded:
        candidates.append(Path(recorded))
        policy_storage = str(Path(recorded).parent)
        if isinstance(durable, str) and not is_url(durable):  # local: durable is <old workdir>/lineages/<L>
            try:
                policy_storage = str(Path(recorded).parent.relative_to(Path(durable).parent.parent))
            except ValueError:  # storage outside the workdir: an absolute path, the same after a move
                pass
    try:
        candidates.append(LineageLayout.resolve(workdir, policy_storage, directory.name).checkpoints)
    except UserError:  # a directory name that is no lineage name: only the record can say
        pass
    candidates.append(directory / "checkpoints")  # a URL storage's local tier
    return next((c for c in candidates if c.is_dir()), None)


def checkpoints(directory: Path | None) -> list[Any]:
    """CheckpointInfo of every committed checkpoint in a store; none when there is no store yet."""
    return _list(directory)[0]


def _list(directory: Path | None) -> tuple[list[Any], str | None]:
    if directory is None or not directory.is_dir():
        return [], None
    from supervisor.checkpoint import open_store

    try:
        return open_store(directory).list(), None
    except Exception as exc:  # any failure of the store's reader: a damaged store must not hide the record
        return [], f"checkpoint store {directory} cannot be listed: {exc}"


def _for_display(record: dict[str, Any], infos: list[Any], directory: Path) -> dict[str, Any]:
    """A copy of the record with each segment's steps from the record and checkpoints, and in-process reasons."""
    shown = copy.deepcopy(record)
    for seg in shown.get("segments") or []:
        start, end = segment_steps(seg, infos, _spool_tail(directory / "metrics", seg.get("index")))
        seg["heartbeat_step"] = seg.get("last_step")
        seg["start_step"], seg["last_step"] = start, end
        for entry in seg.get("in_process") or []:
            decision = entry.get("decision")
            if isinstance(decision, dict) and isinstance(decision.get("reason"), str):
                decision["reason"] = in_process_reason(decision["reason"])
    return shown


def in_process_reason(reason: str) -> str:
    """An in-process decision's reason: the engine writes "relaunch in X s", but nothing is relaunched."""
    said = _RELAUNCH_IN.sub("continued in process, no relaunch", reason)
    return said if said != reason else f"{reason}; handled in process"


def segment_steps(
    seg: dict[str, Any], infos: list[Any], spool_last: tuple[float, int] | None = None
) -> tuple[int | None, int | None]:
    """(the step a segment started from, the last step it reached), from the record, checkpoints and spool.

    Start: the step of the checkpoint it restored (0 from scratch). End: the furthest step known after its last
    in-process rollback: checkpoints it saved, the event that ended it, the last metric point it logged, and
    the heartbeat (a lower bound: it lags by up to a beat). `seg` is the record's, whose `start_step` and
    `last_step` are the heartbeat's steps at launch and exit.
    """
    started, ended = seg.get("started") or 0.0, seg.get("ended")
    restore = seg.get("restore") or {}
    start: int | None = None
    if restore.get("from_scratch"):
        start = 0
    elif restore.get("checkpoint_id"):
        start = _step_of(restore["checkpoint_id"], infos)
    else:  # "the newest valid": the newest checkpoint committed before the segment started
        before = [i for i in infos if i.wall_time <= started]
        live = [i for i in before if not i.abandoned] or before
        start = max(live, key=lambda i: i.seq).step if live else (0 if seg.get("index", 0) == 0 else None)
    evidence: list[tuple[float, int]] = []  # (time, step)
    floor, since, went_back_from = start, started, None
    for entry in sorted(seg.get("in_process") or [], key=lambda e: _num(e.get("time"))):
        decision, event = entry.get("decision") or {}, entry.get("event") or {}
        if decision.get("action") == "rollback" and isinstance(decision.get("target_step"), int):
            floor, since = decision["target_step"], _num(entry.get("time"))  # training went back here
            went_back_from = event.get("step") if isinstance(event.get("step"), int) else None
            evidence = []
        elif isinstance(event.get("step"), int):
            evidence.append((_num(entry.get("time")), event["step"]))
    upto = ended if isinstance(ended, int | float) else float("inf")
    evidence += [(i.wall_time, i.step) for i in infos if since <= i.wall_time <= upto]
    event = seg.get("event") or {}
    if isinstance(event.get("step"), int):
        evidence.append((_num(event.get("wall_time")) or since, event["step"]))
    if spool_last is not None and spool_last[0] >= since:
        evidence.append(spool_last)
    steps = [step for t, step in evidence if t >= since] + ([floor] if floor is not None else [])
    # The heartbeat lags by up to a beat, and its file is the lineage's: a step equal to the one read at launch
    # may be the previous segment's. After an in-process rollback only a beat past the anomaly's step is surely
    # from the branch training went on with.
    beat = seg.get("last_step")
    fresh = isinstance(beat, int) and beat != seg.get("start_step")
    after = since == started or (went_back_from is not None and fresh and beat > went_back_from)
    if fresh and (after or not steps):
        steps.append(beat)
    return start, max(steps, default=None)


def _step_of(checkpoint_id: str, infos: list[Any]) -> int | None:
    found = next((i.step for i in infos if i.id == checkpoint_id), None)
    if found is not None:
        return found
    from supervisor.checkpoint.options import parse_id

    try:
        return parse_id(checkpoint_id)[0]  # the id names its step, even after retention deleted it
    except ValueError:
        return None


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _spool_tail(spool_dir: Path, index: Any) -> tuple[float, int] | None:
    """(time, step) of the last metric point a segment logged to its spool; None if unknown."""
    if not isinstance(index, int):
        return None
    path = spool_dir / f"{index}.jsonl"
    try:
        with path.open("rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - SPOOL_TAIL_BYTES))
            lines = fh.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[:-1]):  # the part after the last newline may be a line cut by a kill
        try:
            _, _, timestamp_ms, step = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(step, int) and isinstance(timestamp_ms, int | float):
            return timestamp_ms / 1000.0, step
    return None


def print_lineage(console: Console, record: dict[str, Any], entry: dict[str, Any]) -> None:
    """One lineage's summary, segments, events and checkpoints, sized to the console's width."""
    narrow = console.width < WIDE_TABLE_COLUMNS
    summary = Text(summary_line(record), style=STATUS_STYLES.get(entry["status"] or "", ""))
    if narrow or summary.cell_len + 4 > console.width:  # a rule would cut the summary at the edge
        console.print(summary)
    else:
        console.rule(summary, align="left")
    console.print(_segment_table(entry, narrow))
    if entry["timeline"] and narrow:
        console.print(short_timeline(entry["timeline"], "events and decisions"))
    elif entry["timeline"]:
        table = rich_table(record)
        table.title = "events and decisions"
        console.print(table)
    else:
        console.print("no events")
    for line in hang_lines(entry.get("hangs") or []):
        console.print(Text(line))
    for line in exclusion_lines(entry):
        console.print(Text(line))
    console.print(_checkpoint_table(entry, narrow))


def _segment_table(entry: dict[str, Any], narrow: bool) -> Table:
    """One row per segment; narrow: no pid, the time of day, restore options on a line of their own."""
    shown = [i for i, name in enumerate(SEGMENT_COLUMNS) if not (narrow and name == "pid")]
    table = Table(title="segments", title_justify="left")
    for i in shown:
        name = SEGMENT_COLUMNS[i]
        table.add_column(name, overflow="fold", no_wrap=narrow and name != "exit")
    for seg in entry["segments"]:
        cells = segment_cells(seg)
        if narrow:
            cells[2] = cells[2].rpartition(" ")[2]  # the summary's record has the date
            cells[4] = cells[4].replace(" ", "\n", 1)  # "<id>\nskip 300 lr x0.5"
        table.add_row(*(Text(cells[i]) for i in shown))
    return table


#: The checkpoint table's columns; a narrow terminal leaves out those marked False.
CHECKPOINT_COLUMNS = (
    ("id", True),
    ("step", True),
    ("saved", False),
    ("metrics", True),
    ("parent", False),
    ("size", True),
    ("state", True),
    ("role", True),
)


def _checkpoint_table(entry: dict[str, Any], narrow: bool = False) -> Table | str:
    if entry["checkpoint_store_problem"]:
        return entry["checkpoint_store_problem"]
    if not entry["checkpoints"]:
        return "no checkpoints"
    roles: dict[str, list[str]] = {}
    for row in entry["timeline"]:
        if row.get("target_id"):
            roles.setdefault(row["target_id"], []).append(f"{row['action']} target (#{row['index']})")
    if entry["final_checkpoint"]:
        roles.setdefault(entry["final_checkpoint"], []).insert(0, "final")
    shown = [(i, name) for i, (name, wide_only) in enumerate(CHECKPOINT_COLUMNS) if wide_only or not narrow]
    table = Table(title="checkpoints", title_justify="left")
    for _, name in shown:
        # Narrow, ids, steps, sizes and metrics (one a line) never break, a folded id or number is hard to read;
        # the roles wrap.
        table.add_column(name, overflow="fold", no_wrap=narrow and name != "role")
    for info in entry["checkpoints"]:
        metrics = (",\n" if narrow else ", ").join(f"{k}={v:.4g}" for k, v in sorted(info["metrics"].items()))
        cells = (
            info["id"],
            str(info["step"]),
            clock_text(info["wall_time"]),
            metrics or "-",
            info["parent_id"] or "-",
            f"{info['nbytes'] / 2**20:.1f} MiB"
            if info["nbytes"] >= 2**20
            else f"{info['nbytes'] / 1024:.1f} KiB",
            Text("abandoned", style="dim") if info["abandoned"] else "live",
            ", ".join(roles.get(info["id"], [])) or "-",
        )
        table.add_row(*(cells[i] for i, _ in shown))
    return table
