"""The progress line on a terminal: rich's live display for `run`, and `status --watch`; log lines otherwise."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from supervisor.report.progress import DONE, Progress, ProgressLog, progress_line, reader_for

log = logging.getLogger("rollback_supervisor.progress")


class LiveProgress:
    """Shows the progress line while a run goes on: rich's live display on a terminal, else a log line
    every `every` seconds (`ProgressLog`). Reading errors never reach the run."""

    def __init__(
        self,
        read: Callable[[], Progress],
        console: Console | None = None,
        *,
        every: float = 30.0,
        refresh_per_second: float = 2.0,
    ):
        self._read, self.console = read, console or Console()
        self.every, self.refresh_per_second = every, refresh_per_second
        self._live: Any = None
        self._log: ProgressLog | None = None
        self.last = ""

    def line(self) -> str:
        try:
            self.last = progress_line(self._read(), self.console.width)
        except Exception as exc:  # the display must never stop the supervision
            log.debug("progress unavailable: %s", exc)
        return self.last

    def _render(self) -> Text:
        return Text(self.line(), no_wrap=True, overflow="ellipsis", style="bold")

    def __enter__(self) -> LiveProgress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LiveProgress:
        """Start showing the line."""
        if self.console.is_terminal:
            from rich.live import Live

            # Redirected, our log lines print above the live line instead of through it (logs.CurrentStderr).
            self._live = Live(
                get_renderable=self._render,
                console=self.console,
                refresh_per_second=self.refresh_per_second,
                redirect_stdout=True,
                redirect_stderr=True,
            )
            self._live.start()
        else:
            self._log = ProgressLog(self._read, self.every, log).start()
        return self

    def stop(self) -> None:
        """Stop showing it; the live display leaves its last line on the terminal."""
        if self._live is not None:
            self._live.stop()
        if self._log is not None:
            self._log.stop()


def for_run(argv: Sequence[str], policy: Path, lineage: str, workdir: Path, **kwargs: Any) -> LiveProgress:
    """The live progress of `rollback-supervisor run` for this lineage (its local directory and store)."""
    from policies import load_policy
    from supervisor.layout import LineageLayout

    ck = load_policy(policy).checkpoint
    layout = LineageLayout.resolve(workdir, ck.storage, lineage, ck.remote)
    return LiveProgress(reader_for(layout.local, layout.checkpoints, argv).read, **kwargs)


def watch(
    readers: Sequence[Callable[[], Progress]],
    console: Console,
    interval: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Progress]:
    """`status --watch`: each lineage's line every `interval` seconds until every one is done; the last read.

    On a terminal the lines are redrawn in place (rich's live display); otherwise a block of lines is printed
    each time. Either way a line wider than the console takes its short words. Ctrl-C ends the watch, not the
    lineages.
    """
    live = None
    if console.is_terminal:
        from rich.live import Live

        live = Live(console=console, auto_refresh=False)
        live.start()
    try:
        while True:
            now = [read() for read in readers]
            lines = [progress_line(p, console.width, name=True) for p in now]
            if live is not None:
                live.update(Text("\n".join(lines), no_wrap=True, overflow="ellipsis"), refresh=True)
            else:
                for line in lines:
                    console.print(line, soft_wrap=True, highlight=False, markup=False)
            if all(p.status in DONE for p in now):
                return now
            sleep(interval)
    except KeyboardInterrupt:
        return now
    finally:
        if live is not None:
            live.stop()
