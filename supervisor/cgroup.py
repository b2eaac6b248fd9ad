"""The memory cgroup of a process (v2, or v1's memory controller): where its limits and counters are read."""

from __future__ import annotations

from pathlib import Path


def memory_cgroup_dir(pid: int | str = "self") -> Path:
    """The directory of `pid`'s memory cgroup; OSError if it has none (or /proc is unreadable)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            return Path("/sys/fs/cgroup") / path.lstrip("/")
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise OSError(f"/proc/{pid}/cgroup: no memory cgroup found")


def memory_headroom(pid: int | str = "self") -> int | None:
    """Bytes the cgroup still lets `pid` allocate (its limit less its usage); None without a limit, or where
    it cannot be read."""
    try:
        root = memory_cgroup_dir(pid)
        for limit_file, usage_file in (
            ("memory.max", "memory.current"),
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        ):
            if (root / limit_file).exists():
                limit = (root / limit_file).read_text().strip()
                if limit == "max":
                    return None
                return int(limit) - int((root / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    return None
