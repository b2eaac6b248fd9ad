"""Every rank's Python stacks at a hang: faulthandler's and py-spy's dumps parsed, and where each rank was.

Pure: text in, records out. `supervisor.monitor.stack_dump` asks the ranks for the dumps and reads them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: faulthandler's thread header: "Thread 0x00007f... (most recent call first):", "Current thread 0x...",
#: or "Stack (most recent call first):" for a dump of the current thread alone; newer Pythons may add a name.
_FAULT_THREAD = re.compile(
    r"^(?:(?P<current>Current thread)|Thread|Stack)(?: (?P<id>0x[0-9a-fA-F]+))?(?: \[(?P<name>[^\]]*)\])?"
    r" \(most recent call first\):\s*$"
)
_FAULT_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*?)\s*$')
#: py-spy dump: 'Thread 4242 (idle): "MainThread"', then frames as "    step (train.py:42)".
_SPY_THREAD = re.compile(
    r'^Thread (?P<id>0x[0-9a-fA-F]+|\d+)(?: \((?P<state>[^)]*)\))?(?:: "(?P<name>.*)")?\s*$'
)
_SPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>.+):(?P<line>\d+)\)\s*$")
#: Where a path's readable tail starts: an installed package's path inside its environment, or the stdlib's.
_PATH_ROOTS = re.compile(r".*/(?:site-packages|dist-packages|lib/python\d+(?:\.\d+)?)/")
#: The most characters of the one-line summary an event carries.
SUMMARY_CHARS = 1000
#: Up to this many ranks the record keeps every thread of every rank (see `compact`).
FULL_RANKS = 16
#: The most frames the record keeps of one thread, innermost first (a deep recursion is cut).
MAX_FRAMES = 100


@dataclass(frozen=True)
class Frame:
    """One Python frame: file, line (None when faulthandler did not know it) and function."""

    file: str
    line: int | None
    function: str

    def where(self) -> str:
        """The frame in one short phrase: "torch/distributed/distributed_c10d.py:2501 all_reduce"."""
        line = "?" if self.line is None else str(self.line)
        return f"{short_path(self.file)}:{line} {self.function}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's frames, innermost first, as the dump listed them."""

    thread_id: int | None
    frames: tuple[Frame, ...]
    current: bool = False  #: the thread that ran the dump (faulthandler's "Current thread")
    name: str | None = None  #: py-spy's thread name ("MainThread")


@dataclass(frozen=True)
class RankStacks:
    """What one rank process was doing: its threads, and which of them is the main thread."""

    rank: int | None
    host: str
    pid: int
    threads: tuple[ThreadStack, ...]
    main_thread: int | None = None  #: the main thread's id, when the process said it
    source: str = "faulthandler"  #: faulthandler | py-spy

    def main(self) -> ThreadStack | None:
        """The main thread: the one the process named, else py-spy's "MainThread", else the last listed.

        CPython lists its threads newest first, so without a name the main thread is the last one.
        """
        for thread in self.threads:
            if self.main_thread is not None and thread.thread_id == self.main_thread:
                return thread
        for thread in self.threads:
            if thread.name == "MainThread":
                return thread
        return self.threads[-1] if self.threads else None

    def where(self) -> str | None:
        """The innermost frame of the main thread, in one phrase; None if it has no Python frame."""
        main = self.main()
        return main.frames[0].where() if main is not None and main.frames else None

    def main_only(self) -> RankStacks:
        """This rank with its main thread alone (what a large job's record keeps of most ranks)."""
        main = self.main()
        return dataclasses.replace(self, threads=(main,) if main is not None else ())

    def in_module(self, fragment: str) -> bool:
        """Whether any frame of the main thread is in a file whose path contains `fragment`."""
        main = self.main()
        return main is not None and any(fragment in f.file for f in main.frames)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "source": self.source,
            "main_thread": self.main_thread,
            "where": self.where(),
            "threads": [
                {
                    "thread_id": t.thread_id,
                    "current": t.current,
                    "name": t.name,
                    "frames": [{"file": f.file, "line": f.line, "function": f.function} for f in t.frames],
                }
                for t in self.threads
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankStacks:
        threads = tuple(
            ThreadStack(
                thread_id=t.get("thread_id"),
                frames=tuple(Frame(f["file"], f.get("line"), f["function"]) for f in t.get("frames") or ()),
                current=bool(t.get("current")),
                name=t.get("name"),
            )
            for t in data.get("threads") or ()
        )
        return cls(
            rank=data.get("rank"),
            host=str(data.get("host") or ""),
            pid=int(data.get("pid") or 0),
            threads=threads,
            main_thread=data.get("main_thread"),
            source=str(data.get("source") or "faulthandler"),
        )


@dataclass(frozen=True)
class HangStacks:
    """Every rank's stacks collected at one hang, and why any rank's are missing."""

    ranks: tuple[RankStacks, ...]
    missing: tuple[str, ...] = ()  #: one sentence per rank (or the whole job) without stacks
    nccl_traces: tuple[str, ...] = ()  #: files torch's NCCL flight recorder dumped
    collected_at: float | None = None
    seconds: float | None = None  #: how long the collection took
    dumps: str | None = (
        None  #: the directory of the ranks' raw dumps (the record may keep less, see `compact`)
    )

    def summary(self) -> str:
        """Where each rank was, in one line: "rank 0: a.py:3 f; rank 1: b.py:9 g"."""
        return summary_line(where_each_rank(self.ranks), self.missing)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "summary": self.summary(),
            "where": where_each_rank(self.ranks),
            "ranks": [r.to_dict() for r in self.ranks],
            "missing": list(self.missing),
        }
        if self.nccl_traces:
            out["nccl_traces"] = list(self.nccl_traces)
        if self.collected_at is not None:
            out["collected_at"] = self.collected_at
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 3)
        if self.dumps is not None:
            out["dumps"] = self.dumps
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HangStacks:
        return cls(
            ranks=tuple(RankStacks.from_dict(r) for r in data.get("ranks") or ()),
            missing=tuple(str(m) for m in data.get("missing") or ()),
            nccl_traces=tuple(str(p) for p in data.get("nccl_traces") or ()),
            collected_at=data.get("collected_at"),
            seconds=data.get("seconds"),
            dumps=data.get("dumps"),
        )


def compact(
    ranks: Iterable[RankStacks], full: int = FULL_RANKS, frames: int = MAX_FRAMES
) -> tuple[RankStacks, ...]:
    """What the lineage record keeps: every thread of up to `full` ranks, and beyond that of the first rank at
    each place only (the others keep their main thread); at most `frames` innermost frames a thread.

    A thousand ranks' every thread would make the record tens of MiB; the raw dumps stay on disk.
    """
    ranks = tuple(ranks)
    keep_all = len(ranks) <= full
    seen: set[str | None] = set()
    kept = []
    for rank in ranks:
        place = rank.where()
        if not keep_all and place in seen:
            rank = rank.main_only()
        seen.add(place)
        threads = tuple(dataclasses.replace(t, frames=t.frames[:frames]) for t in rank.threads)
        kept.append(dataclasses.replace(rank, threads=threads))
    return tuple(kept)


def short_path(path: str) -> str:
    """A frame's file as a reader wants it: from the package root for installed code, else the file name."""
    tail = _PATH_ROOTS.sub("", path, count=1)
    return tail if tail != path else path.rsplit("/", 1)[-1]


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...]:
    """The threads of faulthandler's dump(s) in `text`; only the last dump counts when there are several.

    A dump is a run of thread blocks; a header that follows a thread's frames without a blank line
    between them starts a new dump (faulthandler ends each thread's block with a blank line, but the
    last). Lines that are neither a header nor a frame ("<no Python frame>", "  ...") are skipped.
    """
    dumps: list[list[ThreadStack]] = []
    current: list[ThreadStack] | None = None
    thread: dict[str, Any] | None = None
    previous_blank = True

    def close() -> None:
        if thread is not None and current is not None:
            current.append(
                ThreadStack(thread["id"], tuple(thread["frames"]), thread["current"], thread["name"])
            )

    for line in text.splitlines():
        head = _FAULT_THREAD.match(line)
        if head:
            close()
            if current is None or not previous_blank:
                current = []
                dumps.append(current)
            ident = head.group("id")
            thread = {
                "id": int(ident, 16) if ident else None,
                "current": bool(head.group("current")),
                "name": head.group("name"),
                "frames": [],
            }
        elif (frame := _FAULT_FRAME.match(line)) and thread is not None:
            number = frame.group("line")
            thread["frames"].append(
                Frame(frame.group("file"), None if number == "???" else int(number), frame.group("func"))
            )
        previous_blank = not line.strip()
        if previous_blank and thread is not None:
            close()
            thread = None
    close()
    return tuple(dumps[-1]) if dumps else ()


def parse_py_spy(text: str) -> tuple[ThreadStack, ...]:
    """The threads of one `py-spy dump` output (innermost frame first, as py-spy prints them)."""
    threads: list[ThreadStack] = []
    ident: int | None = None
    name: str | None = None
    frames: list[Frame] | None = None
    for line in text.splitlines():
        head = _SPY_THREAD.match(line)
        if head:
            if frames is not None:
                threads.append(ThreadStack(ident, tuple(frames), name=name))
            raw = head.group("id")
            ident = int(raw, 16) if raw.startswith("0x") else int(raw)
            name, frames = head.group("name"), []
        elif frames is not None and (frame := _SPY_FRAME.match(line)):
            frames.append(Frame(frame.group("file"), int(frame.group("line")), frame.group("func")))
    if frames is not None:
        threads.append(ThreadStack(ident, tuple(frames), name=name))
    return tuple(threads)


def where_each_rank(ranks: Iterable[RankStacks]) -> dict[str, str]:
    """{"0": "torch/distributed/distributed_c10d.py:2501 all_reduce", "1": "train.py:42 step"}, by rank.

    A process without a rank is named by its pid ("pid 4242"); a main thread without Python frames reads
    "no Python frame".
    """
    found: dict[str, str] = {}
    ordered = sorted(ranks, key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.pid))
    for r in ordered:
        key = str(r.rank) if r.rank is not None else f"pid {r.pid}"
        found[key] = r.where() or "no Python frame"
    return found


def by_place(where: Mapping[str, str]) -> list[tuple[str, str]]:
    """Ranks at the same place grouped, in order of first appearance: [("ranks 0, 2-7", "…all_reduce"), ...].

    At scale most ranks wait in the same collective and one or two are elsewhere: those are the ones to read.
    A process without a rank ("pid 4242") stands alone.
    """
    groups: dict[str, list[str]] = {}
    for key, place in where.items():
        groups.setdefault(place, []).append(key)
    rows = []
    for place, keys in groups.items():
        ranks = sorted(int(k) for k in keys if k.isdigit())
        if ranks:
            rows.append((("ranks " if len(ranks) > 1 else "rank ") + rank_ranges(ranks), place))
        rows += [(k, place) for k in keys if not k.isdigit()]
    return rows


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as ranges: [0, 2, 3, 4, 7] -> "0, 2-4, 7"."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def summary_line(
    where: Mapping[str, str], missing: Iterable[str] = (), max_chars: int = SUMMARY_CHARS
) -> str:
    """Where the ranks were, grouped by place, then what is missing, in at most `max_chars`:
    "rank 0: a.py:3 f; rank 1: b.py:9 g" (it goes into the event, which the history and every plan carry)."""
    parts = [f"{who}: {place}" for who, place in by_place(where)]
    parts += list(missing)
    text = "; ".join(parts) if parts else "no stacks"
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"
