"""A hostile or damaged store (issue 14, section 5): planted names, symlinks and headers are refused, never followed.

Every attack here re-pins the commit marker (and the manifest's checksums where it changes a file), as someone
who can write into the store would: the checksums alone cannot catch it, so the readers must.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.manifest import marker_bytes
from supervisor.cli import main
from supervisor.errors import CheckpointCorrupt, CheckpointError
from tests.ckpt_scripts.tiny import Tiny

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "policies" / "presets" / "conservative.yaml"
LOGGER = "rollback_supervisor.checkpoint"

# -- what a process opens, seen through Python's audit hooks (no mock: every open and listing is reported) --

_SEEN: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _SEEN is not None and event in ("open", "os.listdir", "os.scandir") and args:
        if isinstance(args[0], str | bytes):
            _SEEN.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


class Opened:
    """Paths opened or listed by this process inside the `with` block (resolved, so links show their targets)."""

    def __enter__(self) -> Opened:
        global _SEEN
        _SEEN = []
        return self

    def __exit__(self, *exc: object) -> None:
        global _SEEN
        self.paths, _SEEN = [os.path.realpath(p) for p in _SEEN or []], None

    def under(self, directory: Path) -> list[str]:
        root = os.path.realpath(directory)
        return [p for p in self.paths if p == root or p.startswith(root + os.sep)]


# -- a small real store, and the attacker's tools ----------------------------------------------------------


def two_checkpoints(root: Path, **options) -> tuple[str, str, dict]:
    """A store with a good and a bad-to-be checkpoint of a real model; (good id, bad id, good state)."""
    t = Tiny()
    with CheckpointManager(CheckpointOptions(root, memory_slots=0, **options), t.state) as mgr:
        t.step()
        good = mgr.save(1, metrics={"loss": 1.0})
        saved = t.snapshot()
        t.step()
        bad = mgr.save(2, metrics={"loss": 0.5})
    return good.id, bad.id, saved


def manifest_of(root: Path, cid: str) -> dict:
    return json.loads((root / f"ckpt-{cid}" / "manifest.json").read_text())


def repin(root: Path, cid: str, manifest: dict) -> None:
    """Write `manifest` and a commit marker that pins it, exactly as the writer would."""
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (root / f"ckpt-{cid}" / "manifest.json").write_bytes(raw)
    (root / f"ckpt-{cid}" / "COMMITTED").write_bytes(marker_bytes(raw, cid))


def rename_blob(root: Path, cid: str, new_name: str) -> None:
    """Point every entry of `cid`'s manifest that names its own blob at `new_name` instead, re-pinned."""
    m = manifest_of(root, cid)
    old = f"blobs/{cid}.safetensors"
    for f in m["files"]:
        f["path"] = new_name if f["path"] == old else f["path"]
    for ref in m["tensors"].values():
        ref["blob"] = new_name if ref["blob"] == old else ref["blob"]
    repin(root, cid, m)


def replace_blob(root: Path, cid: str, data: bytes) -> None:
    """Write `data` as `cid`'s blob and fix its size and checksum in the manifest, re-pinned."""
    blob = f"blobs/{cid}.safetensors"
    (root / blob).write_bytes(data)
    m = manifest_of(root, cid)
    for f in m["files"]:
        if f["path"] == blob:
            f["size"], f["xxh3"] = len(data), xxhash.xxh3_64_hexdigest(data)
    repin(root, cid, m)


def split_blob(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_blob(header: object, body: bytes, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + body


def assert_refused_and_skipped(root: Path, good: str, bad: str, saved: dict, reason: str, caplog) -> None:
    """`bad` is invalid for `reason` everywhere; restore("latest") falls back to `good`, bit for bit."""
    catalog = open_store(root)
    for mode in ("full", "fast", "none") if "leaves the store" in reason else ("full",):
        found = catalog.verify(bad, mode)
        assert found is not None and reason in found and "\n" not in found, (mode, found)
    assert catalog.verify(good) is None
    assert main(["checkpoints", "list", str(root)]) == 0
    assert main(["checkpoints", "verify", str(root)]) == 1
    fresh = Tiny(seed=7)
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), fresh.state) as mgr:
        assert mgr.latest().id == (bad if catalog.verify(bad, "fast") is None else good)  # fast: sizes only
        with pytest.raises(CheckpointCorrupt) as err:
            mgr.restore(bad)
        # Opening a writer removes blob files no valid checkpoint references: a planted link goes (only it).
        assert reason in err.value.reason or f"blobs/{bad}.safetensors is missing" in err.value.reason
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert mgr.restore("latest").id == good
        assert fresh.equals(saved)
    assert f"Not restoring checkpoint {bad}" in caplog.text


# -- 1. names that leave the store ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["/etc/passwd", "absolute copy", "../outside/copy"])
def test_a_manifest_entry_that_leaves_the_store_is_refused_and_never_opened(tmp_path, caplog, capsys, name):
    root, outside = tmp_path / "store", tmp_path / "outside"
    good, bad, saved = two_checkpoints(root)
    outside.mkdir()
    # A copy of the real blob outside the store: following the name would restore it "successfully".
    shutil.copy(root / "blobs" / f"{bad}.safetensors", outside / "copy")
    target = {"absolute copy": str(outside / "copy")}.get(name, name)
    rename_blob(root, bad, target)
    capsys.readouterr()
    with Opened() as seen:
        assert_refused_and_skipped(root, good, bad, saved, f"entry '{target}' leaves the store", caplog)
    assert seen.under(outside) == [] and "/etc/passwd" not in seen.paths
    assert f"INVALID  {bad}: manifest.json: entry '{target}' leaves the store" in capsys.readouterr().out


# -- 2. symlinks out of the store ------------------------------------------------------------------------------


def link_blob_outside(root: Path, outside: Path, cid: str) -> str:
    blob = root / "blobs" / f"{cid}.safetensors"
    shutil.move(blob, outside / blob.name)
    blob.symlink_to(outside / blob.name)
    return f"entry 'blobs/{cid}.safetensors' leaves the store"


def link_checkpoint_outside(root: Path, outside: Path, cid: str) -> str:
    ckpt = root / f"ckpt-{cid}"
    shutil.move(ckpt, outside / ckpt.name)
    ckpt.symlink_to(outside / ckpt.name, target_is_directory=True)
    return f"entry 'ckpt-{cid}' leaves the store"


@pytest.mark.parametrize("plant", [link_blob_outside, link_checkpoint_outside], ids=["blob", "ckpt dir"])
def test_a_symlink_out_of_the_store_is_refused_and_never_followed(tmp_path, caplog, plant: Callable):
    root, outside = tmp_path / "store", tmp_path / "outside"
    good, bad, saved = two_checkpoints(root)
    outside.mkdir()
    reason = plant(root, outside, bad)
    with Opened() as seen:
        assert_refused_and_skipped(root, good, bad, saved, reason, caplog)
        assert [i.id for i in open_store(root).list()] == [good, bad]  # listed, and reported invalid
    assert seen.under(outside) == []
    # Retention deletes it (and a writer's cleanup its leftovers): the link goes, never what it points to.
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    t = Tiny()
    with CheckpointManager(CheckpointOptions(root, keep_last=1), t.state) as mgr:
        newest = mgr.save(3)
    assert [i.id for i in open_store(root).list()] == [newest.id]
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
    assert not [p for p in root.rglob("*") if p.is_symlink()]


def test_a_symlinked_blobs_directory_is_refused_and_gc_never_deletes_through_it(tmp_path, capsys):
    root, outside = tmp_path / "store", tmp_path / "outside"
    good, bad, _ = two_checkpoints(root)
    shutil.move(root / "blobs", outside)
    (outside / "precious.txt").write_text("not a blob")
    (root / "blobs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="blobs is a symlink to .*outside"):
        CheckpointManager(CheckpointOptions(root), Tiny().state)
    policy = tmp_path / "policy.yaml"
    policy.write_text(PRESET.read_text())
    assert main(["checkpoints", "gc", str(root), "--policy", str(policy)]) == 0
    assert (outside / "precious.txt").read_text() == "not a blob"
    capsys.readouterr()
    assert main(["checkpoints", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID  {good}: entry 'blobs/{good}.safetensors' leaves the store" in out
    assert f"INVALID  {bad}: entry 'blobs/{bad}.safetensors' leaves the store" in out


def test_a_symlink_on_a_file_url_remote_is_refused_and_restore_falls_back(tmp_path, caplog):
    remote, outside = tmp_path / "remote", tmp_path / "outside"
    good, bad, saved = two_checkpoints(tmp_path / "a", remote=f"file://{remote}", async_save=False)
    outside.mkdir()
    reason = link_blob_outside(remote, outside, bad)
    fresh = Tiny(seed=7)
    options = CheckpointOptions(tmp_path / "b", remote=f"file://{remote}", memory_slots=0)
    with Opened() as seen, CheckpointManager(options, fresh.state) as mgr:
        with pytest.raises(CheckpointCorrupt, match=reason):
            mgr.restore(bad)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert mgr.restore("latest").id == good
        assert fresh.equals(saved)
    assert seen.under(outside) == []
    assert reason in caplog.text


# -- 3. safetensors headers that are JSON but not the format -----------------------------------------------


def _as_list(header: dict, body: bytes) -> bytes:
    return join_blob([k for k in header if k != "__metadata__"], body)


def _entries_not_objects(header: dict, body: bytes) -> bytes:
    return join_blob({k: (v if k == "__metadata__" else v["dtype"]) for k, v in header.items()}, body)


def _deep(header: dict, body: bytes) -> bytes:
    return join_blob(None, body, raw=b"[" * 100_000 + b"]" * 100_000)


def _beyond_the_file(header: dict, body: bytes) -> bytes:
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + 4096, end + 4096]
    return join_blob(header, body)


def _overlapping(header: dict, body: bytes) -> bytes:
    by_size: dict[int, list[str]] = {}
    for k, v in header.items():
        if k != "__metadata__":
            by_size.setdefault(v["data_offsets"][1] - v["data_offsets"][0], []).append(k)
    # The later one moves onto the earlier: the overlap comes before the hole it leaves.
    same = next(names for names in by_size.values() if len(names) > 1)
    a, b = sorted(same, key=lambda k: header[k]["data_offsets"])[:2]
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    return join_blob(header, body)


def _shape_disagrees(header: dict, body: bytes) -> bytes:
    name = next(k for k, v in header.items() if k != "__metadata__" and v["shape"] == [16, 16])
    header[name]["shape"] = [16, 15]
    return join_blob(header, body)


HEADERS = [
    ("list", _as_list, "header: expected a JSON object, found an array"),
    ("entries not objects", _entries_not_objects, "expected an object, found a string"),
    ("100k deep", _deep, "header nests deeper than 3 levels"),
    ("offsets beyond the file", _beyond_the_file, "lie outside the"),
    ("overlapping", _overlapping, "overlaps tensor"),
    (
        "shape x dtype vs bytes",
        _shape_disagrees,
        "shape [16, 15] x F32 is 960 bytes, its data_offsets span 1024",
    ),
]


@pytest.mark.parametrize("mutate,reason", [h[1:] for h in HEADERS], ids=[h[0] for h in HEADERS])
def test_a_header_that_is_json_but_not_safetensors_is_refused(tmp_path, caplog, mutate, reason):
    root = tmp_path / "store"
    good, bad, saved = two_checkpoints(root)
    header, body = split_blob((root / "blobs" / f"{bad}.safetensors").read_bytes())
    replace_blob(root, bad, mutate(header, body))
    assert_refused_and_skipped(root, good, bad, saved, reason, caplog)


# -- 4. a manifest that contradicts its blob's header ------------------------------------------------------


def _reshape(ref: dict) -> None:
    ref["shape"] = [256]  # same dtype, same byte count


def _retype(ref: dict) -> None:
    ref["dtype"] = "I32"  # same shape, same byte count


def _shrink(ref: dict) -> None:
    ref["shape"], ref["nbytes"] = [16, 8], 512


@pytest.mark.parametrize("edit", [_reshape, _retype, _shrink], ids=["shape", "dtype", "bytes"])
def test_verify_cross_checks_the_manifest_against_each_blob_header(tmp_path, caplog, edit):
    root = tmp_path / "store"
    good, bad, saved = two_checkpoints(root)
    m = manifest_of(root, bad)
    square = sorted(k for k, ref in m["tensors"].items() if ref["shape"] == [16, 16])
    for name in reversed(square[:2]):  # two edits: the first (in manifest order) is the one reported
        edit(m["tensors"][name])
    repin(root, bad, m)
    first = m["tensors"][square[0]]
    reason = (
        f"blobs/{bad}.safetensors: tensor {first['key']!r} is F32[16, 16] (1024 bytes), "
        f"the manifest records {first['dtype']}{first['shape']} ({first['nbytes']} bytes)"
    )
    assert open_store(root).verify(bad, "full") == reason
    assert_refused_and_skipped(root, good, bad, saved, reason, caplog)


# -- 5. stores that are not there, or cannot be named ----------------------------------------------------


@pytest.mark.parametrize("command", ["list", "verify", "gc"])
def test_a_missing_store_is_a_user_error(tmp_path, capsys, command):
    policy = tmp_path / "policy.yaml"
    policy.write_text(PRESET.read_text())
    extra = ["--policy", str(policy)] if command == "gc" else []
    missing = tmp_path / "no-such-store"
    assert main(["checkpoints", command, str(missing), *extra]) == 2
    assert capsys.readouterr().err == f"error: no checkpoint store at {missing}\n"
    assert not missing.exists()


def test_a_path_component_too_long_is_a_clear_error(tmp_path, capsys):
    long = tmp_path / ("a" * 300)
    assert main(["checkpoints", "list", str(long)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: no checkpoint store at {long}: File name too long\n"


# -- 6. a file:// URL is the local store it names: gc takes its writer lock ------------------------------


def test_gc_on_a_file_url_takes_the_writer_lock(tmp_path, capsys):
    root = tmp_path / "store"
    policy = tmp_path / "policy.yaml"
    policy.write_text(PRESET.read_text().replace("keep_last: 5", "keep_last: 1"))
    t = Tiny()
    with CheckpointManager(CheckpointOptions(root), t.state) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
        mgr.wait()
        assert main(["checkpoints", "gc", f"file://{root}", "--policy", str(policy)]) == 1
        assert "holds the store lock" in capsys.readouterr().err
        assert len(open_store(f"file://{root}").list()) == 3
    assert open_store(f"file://{root}").tier == "local"
    assert main(["checkpoints", "gc", f"file://{root}", "--policy", str(policy)]) == 0
    assert [i.step for i in open_store(root).list()] == [3]
