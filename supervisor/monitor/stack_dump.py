"""Stacks on a hang, both sides: each rank arms a faulthandler dump on a signal; the supervisor fires it.

Training side, `install(directory, rank)` at start-up (standard library only): faulthandler writes every
thread's stack to `<directory>/rank<R>-<host>-<pid>.txt` when the process gets `STACK_SIGNAL`. The file's first
line says who wrote it (rank, host, pid, main thread, when), so the supervisor signals only processes that
armed the dump: an unarmed process would die of the signal.

Supervisor side, `collect(directory)` before a hung segment is stopped: signal every armed rank on this host
(a rank on another host is named as missing), trigger torch's NCCL flight recorder where it was armed, wait a
bounded time for the dumps, and parse them (`supervisor.monitor.stacks`). With no armed rank (an unmodified
script in script mode, or a hang before start-up finished), `py-spy dump` reads the segment's Python processes
where py-spy is installed.

The signal is a real-time one: SIGTERM and SIGUSR2 are our stop signals, and SIGUSR1 is Lightning's SLURM
requeue signal (and free for users'). `chain=False`: nothing else handles it, and chaining to the default
action would end the process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from supervisor.monitor.stacks import HangStacks, RankStacks, compact, parse_faulthandler, parse_py_spy

log = logging.getLogger("rollback_supervisor.monitor")

#: The signal that makes an armed rank dump its stacks (see the module docstring for why this one).
STACK_SIGNAL: int = int(getattr(signal, "SIGRTMIN", signal.SIGUSR1)) + (
    5 if hasattr(signal, "SIGRTMIN") else 0
)
#: What an armed rank's file starts with; the rest of the line is JSON.
HEADER = "# rollback-supervisor stacks "
#: The most the supervisor waits for the dumps (and the flight recorder's), all ranks together.
WAIT_SECONDS = 5.0
#: A dump counts as complete once its file stopped growing for this long.
SETTLE_SECONDS = 0.1

_armed: dict[str, Any] = {}  # the open dump file of this process: faulthandler writes to its descriptor


def segment_dir(workdir: str | os.PathLike[str], segment: int) -> Path:
    """Where one segment's ranks write their stack dumps."""
    return Path(workdir) / "stacks" / f"segment-{segment}"


def install(directory: str | os.PathLike[str], rank: int) -> Path | None:
    """Arm this process's stack dump on `STACK_SIGNAL` into a file of its own in `directory`; idempotent.

    Returns the file, or None where faulthandler cannot register a signal (Windows) or the file cannot be
    opened (the reason is logged; training goes on without it).
    """
    if not hasattr(faulthandler, "register"):
        return None
    host, pid = socket.gethostname(), os.getpid()
    path = Path(directory) / f"rank{rank}-{host}-{pid}.txt"
    if _armed.get("path") == path:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file: IO[str] = open(path, "a")  # noqa: SIM115 - kept open for faulthandler until the process ends
        # faulthandler re-registers a signal it holds by changing the file only, without setting its handler
        # again; something may have replaced that handler since (a framework restoring every signal's handler
        # as `signal.getsignal` saw it, which knows nothing of faulthandler's): unregister first.
        faulthandler.unregister(STACK_SIGNAL)
        faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=False)
        header = {
            "rank": rank,
            "host": host,
            "pid": pid,
            "main_thread": threading.main_thread().ident,
            "armed_at": time.time(),
        }
        file.write(HEADER + json.dumps(header) + "\n")
        file.flush()
    except OSError as exc:
        log.warning("stack dumps on a hang are off: cannot arm %s (%s)", path, exc)
        return None
    previous = _armed.get("file")
    _armed.update(path=path, file=file)
    if previous is not None:
        previous.close()
    return path


def uninstall() -> None:
    """Disarm this process's stack dump and close its file (a process that arms again later, or a test)."""
    if _armed.pop("path", None) is not None:
        faulthandler.unregister(STACK_SIGNAL)
        _armed.pop("file").close()


@dataclass(frozen=True)
class Armed:
    """One rank that armed its dump: its file, what its header says, and how long the file was."""

    path: Path
    rank: int | None
    host: str
    pid: int
    main_thread: int | None
    armed_at: float
    size: int


def armed_ranks(directory: Path) -> list[Armed]:
    """Every rank file in `directory` with a readable header, in rank order."""
    found = []
    for path in sorted(directory.glob("rank*.txt")) if directory.is_dir() else []:
        try:
            with open(path, "rb") as f:
                first = f.readline().decode("utf-8", "replace")
                size = f.seek(0, os.SEEK_END)
            head = json.loads(first[len(HEADER) :]) if first.startswith(HEADER) else None
            if head is None:
                continue
            found.append(
                Armed(
                    path,
                    head.get("rank"),
                    str(head["host"]),
                    int(head["pid"]),
                    head.get("main_thread"),
                    float(head["armed_at"]),
                    size,
                )
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("stack dump file %s is unreadable (%s); skipped", path, exc)
    return sorted(found, key=lambda a: (a.rank is None, a.rank or 0, a.pid))


def is_armed_process(pid: int, armed_at: float) -> bool:
    """Whether `pid` is still the process that armed its dump at `armed_at` (not a PID reused since)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= armed_at + 1.0
    except psutil.Error:
        return False


def nccl_stem(lineage_dir: str | os.PathLike[str]) -> Path:
    """The flight recorder's file stem for a lineage: in /tmp, which every rank's host has and where a FIFO can
    be made (torch aborts the process when it cannot make its pipe), one per lineage directory."""
    digest = hashlib.sha1(str(Path(lineage_dir).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"rollback-nccl-{digest}-rank"


def nccl_trace_env(stem: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that arm torch's NCCL flight recorder and its dump pipe (`<stem><rank>.pipe`, dumping to
    `<stem><rank>`), where this machine has an NVIDIA driver and the user set none of them; {} elsewhere."""
    names = (
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    )
    if not Path("/proc/driver/nvidia").exists() or any(n in environ for n in names):
        return {}
    return dict(zip(names, ("2000", str(stem), str(stem)), strict=True))


def collect(
    directory: Path,
    *,
    nccl: Path | None = None,
    root_pid: int | None = None,
    unarmed: str = "no rank armed its dump",
    timeout: float = WAIT_SECONDS,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> HangStacks:
    """Ask every armed rank in `directory` for its stacks, wait up to `timeout` for them, and parse them.

    `root_pid`: the segment's local process, whose Python descendants py-spy reads when no rank armed its
    dump; `unarmed` says why there are none when py-spy is not installed either.
    """
    started, wall = clock(), time.time()
    host = socket.gethostname()
    missing: list[str] = []
    waiting: list[Armed] = []
    for rank in armed_ranks(directory):
        who = f"rank {rank.rank} (pid {rank.pid} on {rank.host})"
        if rank.host != host:
            missing.append(f"{who}: on another host, not signalled from {host}")
        elif not is_armed_process(rank.pid, rank.armed_at):
            missing.append(f"{who}: no longer running")
        else:
            try:
                os.kill(rank.pid, STACK_SIGNAL)
                waiting.append(rank)
            except OSError as exc:
                missing.append(f"{who}: could not be signalled ({exc})")
    fired = _fire_nccl_pipes(nccl) if nccl is not None else []
    dumps = _await_dumps(waiting, started + timeout, clock, sleep)
    ranks: list[RankStacks] = []
    for rank in waiting:
        threads = parse_faulthandler(dumps.get(rank.path, ""))
        if not threads:
            missing.append(f"rank {rank.rank} (pid {rank.pid}): no dump within {timeout:g} s")
            continue
        ranks.append(RankStacks(rank.rank, rank.host, rank.pid, threads, rank.main_thread, "faulthandler"))
    if not waiting and not missing:
        spied, why = _py_spy_tree(root_pid, max(0.5, started + timeout - clock()))
        ranks += spied
        if not spied:
            missing.append(f"no stacks: {unarmed} {why}")
    traces = _await_nccl(fired, directory, wall, started + timeout, clock, sleep) if fired else []
    return HangStacks(
        compact(ranks),
        tuple(missing),
        tuple(traces),
        collected_at=wall,
        seconds=clock() - started,
        dumps=str(directory) if waiting else None,
    )


def _await_dumps(
    waiting: list[Armed], deadline: float, clock: Callable[[], float], sleep: Callable[[float], None]
) -> dict[Path, str]:
    """The text each file gained since its size was read, once each stopped growing (or at the deadline)."""
    sizes = {a.path: a.size for a in waiting}
    grown: dict[Path, tuple[int, float]] = {}  # path -> (size, when it was last seen to change)
    while waiting and clock() < deadline:
        now = clock()
        for a in waiting:
            with contextlib.suppress(OSError):
                size = a.path.stat().st_size
                if size > sizes[a.path] and grown.get(a.path, (None,))[0] != size:
                    grown[a.path] = (size, now)
        if len(grown) == len(waiting) and all(now - seen >= SETTLE_SECONDS for _, seen in grown.values()):
            break
        sleep(0.02)
    texts = {}
    for a in waiting:
        with contextlib.suppress(OSError), open(a.path, "rb") as f:
            f.seek(a.size)
            texts[a.path] = f.read().decode("utf-8", "replace")
    return texts


def _py_spy_tree(root_pid: int | None, timeout: float) -> tuple[list[RankStacks], str]:
    """py-spy's dump of each Python process in the segment's tree; (stacks, why there are none)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return [], "without py-spy"
    if root_pid is None:
        return [], "(py-spy: the segment has no local process to read)"
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return [], f"(py-spy: process {root_pid} is gone)"
    found = []
    host = socket.gethostname()
    for proc in procs:
        try:
            if "python" not in proc.name().lower():
                continue
            rank = proc.environ().get("RANK")
        except psutil.Error:
            continue
        try:
            out = subprocess.run(
                [exe, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("py-spy dump of pid %d failed: %s", proc.pid, exc)
            continue
        threads = parse_py_spy(out.stdout)
        if threads:
            ranks = int(rank) if rank and rank.isdigit() else None
            # py-spy names threads by their OS thread id where it can: the main thread's is the pid.
            found.append(RankStacks(ranks, host, proc.pid, threads, proc.pid, "py-spy"))
    return found, "(py-spy read no Python process)" if not found else ""


def _fire_nccl_pipes(stem: Path) -> list[Path]:
    """Ask each rank's NCCL flight recorder for a dump through its pipe; the pipes written to."""
    fired = []
    for pipe in sorted(stem.parent.glob(f"{stem.name}*.pipe")):
        try:
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # no reader (ENXIO): that rank is gone
        except OSError:
            continue
        try:
            os.write(fd, b"1\n")
            fired.append(pipe)
        except OSError:
            pass
        finally:
            os.close(fd)
    return fired


def _await_nccl(
    fired: list[Path],
    directory: Path,
    since: float,
    deadline: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> list[str]:
    """The flight recorder dumps written since `since` for the pipes fired, copied into `directory`; waits for
    them until the deadline (the dump is torch's own format, kept as it is)."""
    wanted = [p.with_suffix("") for p in fired]
    seen: dict[Path, int] = {}  # each dump's size at the previous look: one that still grows is not done
    while True:
        sizes = {p: p.stat().st_size for p in wanted if p.exists() and p.stat().st_mtime >= since - 1.0}
        ready = [p for p, n in sizes.items() if n > 0 and seen.get(p) == n]
        if len(ready) == len(wanted) or clock() >= deadline:
            ready = ready if len(ready) == len(wanted) else list(sizes)  # at the deadline: what there is
            break
        seen = sizes
        sleep(0.05)
    kept = []
    for path in ready:
        try:
            kept.append(str(shutil.copy2(path, directory / path.name)))
        except OSError as exc:
            log.warning("could not keep the NCCL flight recorder dump %s: %s", path, exc)
            kept.append(str(path))
    return kept
