"""Fuzzing the checkpoint readers (issue 14, section 6.3): mutated manifests, markers and safetensors headers.

The valid inputs come from one real checkpoint of a real model. Each mutation (random bytes, truncation,
overwritten or cut bytes, a JSON value swapped for another type, a deep nest) is fed to a reader, which
must either accept it or refuse it with a one-line message: ValueError from the parsers, a reason string
from `Catalog.verify`, CheckpointCorrupt from a restore. Anything else is a bug. Derandomized, no database,
and a fixed number of examples, so CI runs the same cases every time (about 10 s here).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.checkpoint import (
    CheckpointManager,
    CheckpointOptions,
    blobs,
    boundedjson,
    open_store,
    safetensors_header,
)
from supervisor.checkpoint.catalog import info_from_manifest
from supervisor.checkpoint.manifest import Manifest, check_marker, marker_bytes, marker_pin
from supervisor.checkpoint.paths import name_leaves
from supervisor.checkpoint.restore import restore_local
from supervisor.errors import CheckpointCorrupt
from tests.ckpt_scripts.tiny import Tiny


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- one real checkpoint, built once ------------------------------------------------------------------------


class Original:
    """A real two-checkpoint store and the bytes of the second checkpoint's files."""

    def __init__(self, root: Path):
        self.root = root
        t = Tiny()
        with CheckpointManager(CheckpointOptions(root, memory_slots=0, dedup=False), t.state) as mgr:
            t.step()
            mgr.save(1)
            t.step()
            self.cid = mgr.save(2).id
        ckpt = root / f"ckpt-{self.cid}"
        self.manifest = (ckpt / "manifest.json").read_bytes()
        self.marker = (ckpt / "COMMITTED").read_bytes()
        self.blob_rel = f"blobs/{self.cid}.safetensors"
        self.blob = (root / self.blob_rel).read_bytes()
        (n,) = struct.unpack("<Q", self.blob[:8])
        self.header = json.loads(self.blob[8 : 8 + n])
        self.body = self.blob[8 + n :]
        self.state = Tiny(seed=3).state

    def put(self, manifest: bytes | None = None, blob: bytes | None = None) -> None:
        """Make the checkpoint hold `manifest` and `blob` (originals where None), re-pinned as an attacker would."""
        if blob is not None:
            data = json.loads(manifest or self.manifest)
            for f in data["files"]:
                if f["path"] == self.blob_rel:
                    f["size"], f["xxh3"] = len(blob), xxhash.xxh3_64_hexdigest(blob)
            manifest = json.dumps(data, indent=1, sort_keys=True).encode()
        raw = self.manifest if manifest is None else manifest
        ckpt = self.root / f"ckpt-{self.cid}"
        (ckpt / "manifest.json").write_bytes(raw)
        (ckpt / "COMMITTED").write_bytes(marker_bytes(raw, self.cid))
        (self.root / self.blob_rel).write_bytes(self.blob if blob is None else blob)


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Original:
    return Original(tmp_path_factory.mktemp("fuzz") / "store")


# -- mutations ---------------------------------------------------------------------------------------------

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "../x", "/etc/passwd", "F32", "blobs/../../x", "a\x00b", "ckpt-1/state.json"]),
    st.sampled_from([10**400, -(10**400), [10**4000] * 3, [2**40] * 4, "x" * 5000]),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=2**40), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)


def _paths(doc: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*path, i))
    return out


@st.composite
def json_swaps(draw, doc: Any) -> bytes:
    """`doc` with one node swapped for another type, deleted, joined by an unknown key, or nested very deep."""
    doc = copy.deepcopy(doc)
    path = draw(st.sampled_from(_paths(doc)))
    action = draw(st.sampled_from(["swap", "swap", "delete", "add", "deep"]))
    deep = draw(st.integers(min_value=1, max_value=100_000)) if action == "deep" else 0
    new = "__DEEP__" if deep else draw(ODD_VALUES)
    if not path:
        doc = new if action in ("swap", "deep") else doc
    else:
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = new
        else:
            parent[key] = new
    text = json.dumps(doc, sort_keys=isinstance(doc, dict) and all(isinstance(k, str) for k in doc))
    return text.replace('"__DEEP__"', "[" * deep + "]" * deep).encode()


@st.composite
def byte_mutations(draw, raw: bytes) -> bytes:
    """`raw` replaced by random bytes, truncated, overwritten in a few places, or with a slice cut out."""
    action = draw(st.sampled_from(["random", "truncate", "overwrite", "cut", "insert"]))
    if action == "random":
        return draw(st.binary(max_size=512))
    if action == "truncate":
        return raw[: draw(st.integers(min_value=0, max_value=max(len(raw) - 1, 0)))]
    at = draw(st.integers(min_value=0, max_value=max(len(raw) - 1, 0)))
    chunk = draw(st.binary(min_size=1, max_size=16))
    if action == "overwrite":
        return raw[:at] + chunk + raw[at + len(chunk) :]
    if action == "insert":
        return raw[:at] + chunk + raw[at:]
    return raw[:at] + raw[at + draw(st.integers(min_value=1, max_value=64)) :]


def mutations(raw: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(byte_mutations(raw), json_swaps(json.loads(raw)))


@st.composite
def blob_mutations(draw, original: Original) -> bytes:
    """A blob whose header JSON was mutated (length prefix kept right), or whose bytes were."""
    if draw(st.booleans()):
        return draw(byte_mutations(original.blob))
    header = draw(json_swaps(original.header))
    if draw(st.booleans()):
        header += b" " * draw(st.integers(min_value=0, max_value=7))
    return struct.pack("<Q", len(header)) + header + original.body


def one_line(message: str) -> None:
    assert message and "\n" not in message, message


# -- the pure readers ----------------------------------------------------------------------------------------


@fuzz(300)
@given(data=st.data())
def test_the_manifest_reader_accepts_or_refuses_with_a_message(original, data):
    raw = data.draw(mutations(original.manifest))
    try:
        m = Manifest.from_bytes(raw)
    except ValueError as exc:
        one_line(str(exc))
        return
    # Accepted: every field has its type, every name stays in the store, every tensor's size adds up.
    assert not [n for n in [f.path for f in m.files] + sorted(m.blobs()) if name_leaves(n)]
    assert all(type(f.size) is int and f.size >= 0 for f in m.files)
    for ref in m.tensors.values():
        assert math.prod(ref.shape) * safetensors_header.ITEMSIZE[ref.dtype] == ref.nbytes
    info_from_manifest(m, "here", ("local",), False)
    assert Manifest.from_bytes(m.to_bytes()) == m


@fuzz(200)
@given(data=st.data())
def test_the_marker_reader_accepts_or_refuses_with_a_message(original, data):
    raw = data.draw(mutations(original.marker))
    pinned = marker_pin(raw)
    assert pinned is None or isinstance(pinned, str)
    reason = check_marker(raw, original.manifest)
    if reason is not None:
        one_line(reason)
    else:
        assert pinned == xxhash.xxh3_64_hexdigest(original.manifest)


@fuzz(300)
@given(data=st.data())
def test_the_header_reader_accepts_or_refuses_with_a_message(original, data):
    blob = data.draw(blob_mutations(original))
    head = blob[: 8 + min(struct.unpack("<Q", blob[:8])[0], len(blob))] if len(blob) >= 8 else blob
    try:
        base, entries = safetensors_header.parse_header(head, len(blob))
    except ValueError as exc:
        one_line(str(exc))
        with pytest.raises(ValueError):
            blobs.parse_header(head, len(blob))
        return
    # Accepted: the entries tile the data region exactly, each as long as its shape and dtype say.
    spans = sorted((e.start, e.end) for e in entries.values())
    ends = [0] + [end for _, end in spans]
    assert [start for start, _ in spans] == ends[:-1] and ends[-1] == len(blob) - base
    for e in entries.values():
        assert math.prod(e.shape) * safetensors_header.ITEMSIZE[e.dtype] == e.end - e.start
    assert blobs.parse_header(head, len(blob))[1].keys() == entries.keys()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\a', max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@fuzz(300)
@given(value=JSON, limit=st.integers(min_value=0, max_value=6), ascii_only=st.booleans())
def test_the_nesting_check_agrees_with_the_parsed_depth(value, limit, ascii_only):
    """Brackets, quotes and backslashes inside strings never fool the pre-parse nesting check."""
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert boundedjson.nesting_within(raw, limit) == (_depth(value) <= limit)


# -- the store: verify, list and restore on a mutated, re-pinned checkpoint ----------------------------------


def _store_reads(original: Original) -> list[str | None]:
    """Every store reader on the (mutated) checkpoint: None where it accepted, else its one-line reason."""
    catalog = open_store(original.root)
    assert original.cid in [i.id for i in catalog.list()] + catalog.ids()
    outcomes = [catalog.verify(original.cid, mode) for mode in ("none", "fast", "full")]
    try:
        manifest = catalog.manifest(original.cid)
        restore_local(catalog, manifest, original.state, None, "full")
        outcomes.append(None)
    except CheckpointCorrupt as exc:
        outcomes.append(exc.reason)
    for reason in outcomes:
        if reason is not None:
            one_line(reason)
    return outcomes


@fuzz(60)
@given(data=st.data())
def test_the_store_accepts_or_refuses_a_mutated_manifest(original, data):
    original.put(manifest=data.draw(mutations(original.manifest)))
    try:
        outcomes = _store_reads(original)
    finally:
        original.put()
    assert len(outcomes) == 4  # three verify modes and a full restore, each accepted or refused in one line


@fuzz(60)
@given(data=st.data())
def test_the_store_accepts_or_refuses_a_mutated_blob(original, data):
    original.put(blob=data.draw(blob_mutations(original)))
    try:
        outcomes = _store_reads(original)
    finally:
        original.put()
    assert len(outcomes) == 4  # three verify modes and a full restore, each accepted or refused in one line


def test_the_original_is_valid(original, tmp_path):
    """The fuzz starts from a checkpoint every reader accepts (so a refusal is the mutation's doing)."""
    shutil.copytree(original.root, tmp_path / "copy")
    catalog = open_store(tmp_path / "copy")
    assert catalog.verify(original.cid, "full") is None
    restore_local(catalog, catalog.manifest(original.cid), Tiny(seed=3).state, None, "full")
    assert safetensors_header.parse_header(original.blob, len(original.blob))[1]
