"""The measured seconds of each slow test file, so xdist hands out the longest files first.

`--dist loadfile` pins a whole file to one worker, in the order the workers collected the files. In name order
the longest files could come last while the other worker has run dry; longest first, the last files handed
out are short ones and both workers end within seconds of each other. Refresh the table from a run's
`--durations=0` output (setup, call and teardown summed per file):

    pytest -q -n 2 --dist loadfile --durations=0 > /tmp/durations.txt
    python -m tests.file_costs /tmp/durations.txt
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("file_costs.json")
#: Files under this many seconds are left out of the table; they keep their collection order at the end.
MIN_SECONDS = 3.0
_LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+?\.py)::")


def load() -> dict[str, float]:
    """file path (relative to the repository, as in a node id) -> seconds; empty if the table is missing."""
    try:
        return json.loads(TABLE.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def from_durations(text: str) -> dict[str, float]:
    """Per-file seconds summed from pytest's `--durations=0` lines, longest first, small files left out."""
    seconds: Counter[str] = Counter()
    for line in text.splitlines():
        if match := _LINE.match(line.strip()):
            seconds[match.group(2)] += float(match.group(1))
    return {path: round(s) for path, s in seconds.most_common() if s >= MIN_SECONDS}


def main(argv: list[str]) -> int:
    (path,) = argv
    table = from_durations(Path(path).read_text())
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{TABLE}: {len(table)} files, {sum(table.values())} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
