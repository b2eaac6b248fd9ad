"""manifest.json (what a checkpoint holds, with checksums) and the COMMITTED marker that makes it count."""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from functools import cache

import xxhash

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
MARKER = "COMMITTED"
ABANDONED = "ABANDONED"
CKPT_PREFIX = "ckpt-"
BLOBS = "blobs"


@dataclass(frozen=True)
class FileEntry:
    """A file a checkpoint needs, relative to the store root, with its size and xxh3-64."""

    path: str
    size: int
    xxh3: str


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor of the state lives: a blob file (relative to the store root) and its key in it."""

    blob: str
    key: str
    digest: str
    nbytes: int
    dtype: str = ""
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """Everything needed to find, verify and describe one checkpoint."""

    id: str
    seq: int
    step: int
    wall_time: float
    metrics: dict[str, float]
    parent_id: str | None
    files: list[FileEntry]
    tensors: dict[str, TensorRef]
    nbytes: int
    written_bytes: int
    versions: dict[str, str] = field(default_factory=dict)
    git_commit: str | None = None
    config_hash: str | None = None
    format_version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse manifest.json; ValueError says what is wrong."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{MANIFEST} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{MANIFEST}: expected an object, found {type(data).__name__}")
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"{MANIFEST}: format_version {version!r} is not supported (<= {FORMAT_VERSION})")
        try:
            data["files"] = [FileEntry(**f) for f in data["files"]]
            data["tensors"] = {
                k: TensorRef(**{**v, "shape": tuple(v["shape"])}) for k, v in data["tensors"].items()
            }
            data["metrics"] = {str(k): float(v) for k, v in data["metrics"].items()}
            return cls(**data)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{MANIFEST}: missing or malformed field ({exc})") from None

    def blobs(self) -> set[str]:
        return {ref.blob for ref in self.tensors.values()}


def marker_bytes(manifest_raw: bytes, checkpoint_id: str) -> bytes:
    """COMMITTED marker content: it pins the manifest's checksum, so a later edit is detected."""
    return json.dumps({"id": checkpoint_id, "manifest_xxh3": xxhash.xxh3_64_hexdigest(manifest_raw)}).encode()


def marker_pin(marker_raw: bytes | None) -> str | None:
    """The manifest checksum a whole marker pins; None for a missing or torn marker."""
    try:
        pinned = json.loads(marker_raw)["manifest_xxh3"]  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError):
        return None
    return pinned if isinstance(pinned, str) else None


def check_marker(marker_raw: bytes, manifest_raw: bytes | None) -> str | None:
    """None when the marker is whole and matches the manifest, else the reason."""
    pinned = marker_pin(marker_raw)
    if pinned is None:
        return f"{MARKER} marker is incomplete (commit did not finish)"
    if manifest_raw is None:
        return f"{MANIFEST} is missing"
    found = xxhash.xxh3_64_hexdigest(manifest_raw)
    if found != pinned:
        return f"{MANIFEST} was modified after commit: xxh3 {found}, the commit marker pins {pinned}"
    return None


def config_hash(config: object) -> str | None:
    """xxh3-128 of a training config (canonical JSON, or the raw str/bytes); None when there is none."""
    if config is None:
        return None
    if isinstance(config, str):
        raw = config.encode()
    elif isinstance(config, bytes):
        raw = config
    else:
        raw = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()
    return xxhash.xxh3_128_hexdigest(raw)


@cache
def library_versions() -> dict[str, str]:
    """Versions of the libraries that wrote the checkpoint."""
    import numpy
    import safetensors
    import torch

    from supervisor import __version__

    return {
        "python": platform.python_version(),
        "rollback-supervisor": __version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
        "xxhash": xxhash.VERSION,
    }


def git_commit(cwd: str | None = None) -> str | None:
    """HEAD of the git checkout holding the training code, or None outside one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) >= 40 else None
