"""manifest.json (what a checkpoint holds, with checksums) and the COMMITTED marker that makes it count."""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

import xxhash

from supervisor.checkpoint.boundedjson import loads_bounded, preview
from supervisor.checkpoint.paths import LeavesStore, name_leaves
from supervisor.checkpoint.safetensors_header import ITEMSIZE, shape_bytes
from supervisor.checkpoint.typedjson import Schema

#: What an unsharded save writes, so that readers older than sharded checkpoints still read it.
FORMAT_VERSION = 1
#: What a sharded (DCP) save writes: chunks of tensors, one blob per rank (issue 17).
SHARDED_FORMAT_VERSION = 2
_SHARDED_FIELDS = ("world_size", "sharded", "rank_files")
MANIFEST = "manifest.json"
STATE = "state.json"
MARKER = "COMMITTED"
ABANDONED = "ABANDONED"
CKPT_PREFIX = "ckpt-"
BLOBS = "blobs"
#: A marker is one small flat object; anything longer is not one this store wrote.
MAX_MARKER = 4096
#: The manifest nests four deep ({"tensors": {name: {"shape": [...]}}}); the rest is room for new fields.
_MAX_DEPTH = 8


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
class Chunk:
    """One stored piece of a sharded tensor: where it starts, its extent, and its key in `Manifest.tensors`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key: str


@dataclass(frozen=True)
class ShardedTensor:
    """A tensor of a sharded checkpoint: its global dtype and size, and the chunks that tile it."""

    dtype: str
    size: tuple[int, ...]
    chunks: list[Chunk]


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
    nonfinite: list[str] = field(default_factory=list)
    """Tensors that held a NaN or an infinity when the snapshot was taken: the checkpoint is unhealthy."""
    world_size: int = 1
    sharded: dict[str, ShardedTensor] = field(default_factory=dict)
    """Sharded checkpoints only: each tensor's chunks; `tensors` is then keyed by chunk key."""
    rank_files: dict[str, str] = field(default_factory=dict)
    """Sharded checkpoints only: each saving rank's own JSON state (RNG, loader), by rank."""

    def to_bytes(self) -> bytes:
        data = asdict(self)
        if not self.sharded:  # an unsharded manifest keeps format 1's fields, so older readers still read it
            for name in _SHARDED_FIELDS:
                del data[name]
        return json.dumps(data, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse and validate manifest.json (types, names inside the store, sizes); ValueError says what is wrong."""
        data = loads_bounded(raw, max_depth=_MAX_DEPTH, what=MANIFEST)
        if not isinstance(data, dict):
            raise ValueError(f"{MANIFEST}: expected an object, found {_kind(data)}")
        version = data.get("format_version")
        if type(version) is not int or version > SHARDED_FORMAT_VERSION:
            raise ValueError(
                f"{MANIFEST}: format_version {version!r} is not supported (<= {SHARDED_FORMAT_VERSION})"
            )
        manifest = _SCHEMA.build(cls, data)
        manifest.check_entries()
        return manifest

    def check_entries(self) -> None:
        """ValueError when a file or blob name leaves the store or a tensor's byte count contradicts it."""
        for rel in [f.path for f in self.files] + sorted(self.blobs()):
            if why := name_leaves(rel):
                raise ValueError(f"{MANIFEST}: {LeavesStore(rel, why)}")
        for name, ref in self.tensors.items():
            if ref.dtype not in ITEMSIZE:
                raise ValueError(
                    f"{MANIFEST}: tensors[{preview(name)}].dtype {preview(ref.dtype)} is not a safetensors dtype"
                )
            if (nbytes := shape_bytes(ref.dtype, ref.shape)) != ref.nbytes:
                raise ValueError(
                    f"{MANIFEST}: tensors[{preview(name)}]: shape {preview(list(ref.shape))} x {ref.dtype} is "
                    f"{nbytes} bytes, the manifest records {ref.nbytes}"
                )

    def blobs(self) -> set[str]:
        return {ref.blob for ref in self.tensors.values()}


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


_SCHEMA = Schema(
    MANIFEST,
    [FileEntry, TensorRef, Chunk, ShardedTensor],
    counts=["seq", "size", "nbytes", "written_bytes", "shape", "world_size", "offsets", "sizes"],
)


def marker_bytes(
    manifest_raw: bytes, checkpoint_id: str, world_size: int | None = None, files_xxh3: str | None = None
) -> bytes:
    """COMMITTED marker content: it pins the manifest's checksum, so a later edit is detected.

    A sharded commit also records its world size and `files_digest` of every rank's files (one fixed-size
    field, so the marker stays under MAX_MARKER at any world size).
    """
    marker: dict[str, object] = {"id": checkpoint_id, "manifest_xxh3": xxhash.xxh3_64_hexdigest(manifest_raw)}
    if world_size is not None:
        marker["world_size"] = world_size
    if files_xxh3 is not None:
        marker["files_xxh3"] = files_xxh3
    return json.dumps(marker).encode()


def files_digest(files: list[FileEntry]) -> str:
    """xxh3-64 over the sorted `path:xxh3` lines of a checkpoint's files (what a sharded marker pins)."""
    lines = sorted(f"{f.path}:{f.xxh3}" for f in files)
    return xxhash.xxh3_64_hexdigest("\n".join(lines).encode())


def marker_pin(marker_raw: bytes | None) -> str | None:
    """The manifest checksum a whole marker pins; None for a missing or torn marker."""
    if not isinstance(marker_raw, bytes) or len(marker_raw) > MAX_MARKER:
        return None
    try:
        found = loads_bounded(marker_raw, max_depth=1, what=MARKER)
    except ValueError:
        return None
    pinned = found.get("manifest_xxh3") if isinstance(found, dict) else None
    return pinned if isinstance(pinned, str) else None


def marker_disagreement(marker_raw: bytes, manifest: Manifest) -> str | None:
    """None when a sharded marker's `world_size` and `files_xxh3` (if present) match the parsed manifest it
    pins, else the reason. The manifest checksum already pins both; this catches a marker written for
    another commit's files, which a bug in the commit path could produce."""
    try:
        found = loads_bounded(marker_raw, max_depth=1, what=MARKER)
    except ValueError as exc:
        return f"{MARKER}: {exc}"
    if not isinstance(found, dict):
        return f"{MARKER}: expected a JSON object"
    if "world_size" in found and found["world_size"] != manifest.world_size:
        return (
            f"{MARKER} records world_size {found['world_size']!r}, but {MANIFEST} says {manifest.world_size}"
        )
    if "files_xxh3" in found:
        digest = files_digest(manifest.files)
        if found["files_xxh3"] != digest:
            return (
                f"{MARKER} pins files_xxh3 {found['files_xxh3']!r}, but {MANIFEST}'s files digest to {digest}"
            )
    return None


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
