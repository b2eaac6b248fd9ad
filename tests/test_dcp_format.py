"""Sharded manifests (format v2), chunk coverage and DCP Metadata <-> JSON: pure, table-driven and Hypothesis."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.checkpoint.dcp_format import (
    chunk_key,
    chunk_refs,
    coverage,
    from_metadata,
    sharded_problem,
    sharded_view,
    to_metadata,
)
from supervisor.checkpoint.manifest import (
    FORMAT_VERSION,
    MAX_MARKER,
    SHARDED_FORMAT_VERSION,
    Chunk,
    FileEntry,
    Manifest,
    ShardedTensor,
    TensorRef,
    check_marker,
    files_digest,
    marker_bytes,
    marker_pin,
)

CID = "0000000005-000002"


def _ref(key: str, blob: str, shape: tuple[int, ...], dtype: str = "F32") -> TensorRef:
    n = 4 if dtype == "F32" else 8
    size = n
    for s in shape:
        size *= s
    return TensorRef(blob, key, "d" * 32, size, dtype, shape)


def _v2(
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]], size: dict[str, tuple[int, ...]]
) -> Manifest:
    """A sharded manifest: chunks alternate between two rank blobs."""
    sharded, tensors = {}, {}
    for name, boxes in chunks.items():
        cs = []
        for i, (offsets, sizes) in enumerate(boxes):
            key = chunk_key(name, offsets)
            tensors[key] = _ref(key, f"blobs/{CID}.r{i % 2}.safetensors", sizes)
            cs.append(Chunk(offsets, sizes, key))
        sharded[name] = ShardedTensor("F32", size[name], cs)
    files = [FileEntry(f"blobs/{CID}.r{r}.safetensors", 10, "0" * 16) for r in range(2)]
    files += [FileEntry(f"ckpt-{CID}/ranks.{r}.json", 3, "1" * 16) for r in range(2)]
    return Manifest(
        id=CID,
        seq=2,
        step=5,
        wall_time=1.0,
        metrics={},
        parent_id=None,
        files=files,
        tensors=tensors,
        nbytes=sum(r.nbytes for r in tensors.values()),
        written_bytes=20,
        format_version=SHARDED_FORMAT_VERSION,
        world_size=2,
        sharded=sharded,
        rank_files={str(r): f"ckpt-{CID}/ranks.{r}.json" for r in range(2)},
    )


GOOD = _v2(
    {
        "model.w": [((0, 0), (6, 4)), ((6, 0), (5, 4))],
        "model.b": [((0,), (3,)), ((3,), (0,))],
        "opt.step": [((), ())],
    },
    {"model.w": (11, 4), "model.b": (3,), "opt.step": ()},
)


def test_chunk_key_names_tensor_and_offsets():
    assert chunk_key("model.w", torch.Size([6, 0])) == "model.w@6,0"
    assert chunk_key("optimizer.state.w.step", ()) == "optimizer.state.w.step@"


@pytest.mark.parametrize(
    "size,boxes,problem",
    [
        ((11, 4), [((0, 0), (6, 4)), ((6, 0), (5, 4))], None),
        ((11, 4), [((0, 0), (11, 2)), ((0, 2), (11, 2))], None),
        ((2,), [((0,), (2,)), ((2,), (0,))], None),  # an empty shard (dim 0 < world size)
        ((2,), [((0,), (0,)), ((0,), (2,))], "two chunks start at [0]"),
        ((), [((), ())], None),  # a scalar (Adam's step)
        ((11, 4), [((0, 0), (6, 4))], "cover 24 of the tensor's 44 elements"),
        ((11, 4), [((0, 0), (6, 4)), ((5, 0), (6, 4))], "overlap"),
        ((11, 4), [((0, 0), (6, 4)), ((6, 0), (6, 4))], "outside"),
        ((11, 4), [((0,), (11,))], "1 dimensions, the tensor has 2"),
        ((4,), [((0,), (2,)), ((1,), (1,)), ((3,), (1,))], "overlap"),  # the right count, yet overlapping
        # Overlaps found by the sweep: with a chunk still open from an earlier row, and inside one row.
        ((8, 8), [((0, 0), (8, 4)), ((0, 4), (4, 4)), ((2, 6), (2, 1)), ((4, 4), (4, 4))], "overlap"),
        ((8, 8), [((0, 0), (4, 8)), ((4, 0), (4, 5)), ((4, 4), (4, 4))], "overlap"),
    ],
)
def test_coverage_accepts_exact_tilings_only(size, boxes, problem):
    found = coverage(size, boxes)
    assert found is None if problem is None else problem in found


@settings(max_examples=60, deadline=None)
@given(
    dims=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    splits=st.lists(st.integers(1, 4), min_size=3, max_size=3),
)
def test_coverage_of_any_grid_split_and_of_it_less_one_chunk(dims, splits):
    """Splitting every dimension into pieces tiles the tensor; dropping a non-empty piece leaves a hole."""
    axes = []
    for d, k in zip(dims, splits, strict=False):
        cuts = sorted({0, d, *(d * i // k for i in range(1, k))})
        axes.append([(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)] or [(0, 0)])
    boxes = [((), ())]
    for axis in axes:
        boxes = [(o + (a,), n + (b,)) for o, n in boxes for a, b in axis]
    assert coverage(tuple(dims), boxes) is None
    nonempty = [i for i, (_, n) in enumerate(boxes) if all(n)]
    if nonempty:
        assert "a hole" in coverage(tuple(dims), boxes[: nonempty[0]] + boxes[nonempty[0] + 1 :])


def test_coverage_of_a_4096_chunk_grid_and_of_it_with_one_chunk_moved():
    """A large 2-D grid (tensor parallel x FSDP) is checked by the sweep, not pair by pair (16 million pairs)."""
    boxes = [((r * 4, c * 2), (4, 2)) for r in range(64) for c in range(64)]
    assert coverage((256, 128), boxes) is None
    moved = boxes[:-1] + [((252, 125), (4, 2))]  # the last chunk slid one column left onto its neighbour
    assert "overlap" in coverage((256, 128), moved)


def test_sharded_manifest_round_trips_through_json_and_is_consistent():
    parsed = Manifest.from_bytes(GOOD.to_bytes())
    assert parsed == GOOD and sharded_problem(parsed) is None
    assert parsed.sharded["model.w"].chunks[1] == Chunk((6, 0), (5, 4), "model.w@6,0")


def test_v1_manifest_still_parses_and_unsharded_saves_keep_writing_version_1():
    v1 = dataclasses.replace(GOOD, format_version=1, world_size=1, sharded={}, rank_files={})
    raw = json.loads(v1.to_bytes())
    # Written without the new fields, as an old manifest is: a reader older than format 2 still reads it.
    assert not {"world_size", "sharded", "rank_files"} & raw.keys() and raw["format_version"] == 1
    parsed = Manifest.from_bytes(json.dumps(raw).encode())
    assert parsed.world_size == 1 and parsed.sharded == {} and sharded_problem(parsed) is None
    assert FORMAT_VERSION == 1 and Manifest.__dataclass_fields__["format_version"].default == 1


@pytest.mark.parametrize(
    "edit,problem",
    [
        (lambda d: d["sharded"]["model.w"]["chunks"][0].update(key="nope@0"), "which tensors does not list"),
        (lambda d: d["sharded"]["model.w"]["chunks"].pop(), "a hole"),
        (lambda d: d["sharded"]["model.w"].update(dtype="F64"), "is F32[6, 4], sharded['model.w'] says F64"),
        (lambda d: d.update(format_version=1), "need format_version 2, found 1"),
        (lambda d: d["rank_files"].update({"1": "ckpt-x/ranks.1.json"}), "is not a listed file"),
    ],
)
def test_inconsistent_sharded_manifests_are_refused_with_the_reason(edit, problem):
    data = json.loads(GOOD.to_bytes())
    edit(data)
    found = sharded_problem(Manifest.from_bytes(json.dumps(data).encode()))
    assert found is not None and problem in found


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: d.update(format_version=3), "format_version 3 is not supported (<= 2)"),
        (lambda d: d["sharded"]["model.w"]["chunks"][0].update(offsets=[-1, 0]), "expected an integer >= 0"),
        (lambda d: d["sharded"]["model.w"].update(size="11x4"), "sharded['model.w'].size: expected tuple"),
        (lambda d: d.update(world_size=-2), "world_size: expected an integer >= 0"),
    ],
)
def test_malformed_v2_fields_are_one_line_errors(edit, message):
    data = json.loads(GOOD.to_bytes())
    edit(data)
    with pytest.raises(ValueError, match="manifest.json") as exc:
        Manifest.from_bytes(json.dumps(data).encode())
    assert message in str(exc.value)


def test_metadata_round_trips_through_json():
    metadata, keys = to_metadata(GOOD.sharded)
    assert from_metadata(metadata) == GOOD.sharded
    assert metadata.state_dict_metadata["model.w"].properties.dtype == torch.float32
    assert {k.fqn for k in keys} == set(GOOD.sharded) and set(keys.values()) == set(GOOD.tensors)


def test_a_non_tensor_in_metadata_is_refused():
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    with pytest.raises(ValueError, match="extras.note: only tensors can be stored without pickle"):
        from_metadata(Metadata(state_dict_metadata={"extras.note": BytesStorageMetadata()}))


def test_a_v1_manifest_is_whole_chunks_at_offset_zero():
    v1 = Manifest(
        CID, 2, 5, 1.0, {}, None, [], {"model.w": _ref("model.w", "blobs/a.safetensors", (3, 2))}, 24, 24
    )
    assert sharded_view(v1) == {"model.w": ShardedTensor("F32", (3, 2), [Chunk((0, 0), (3, 2), "model.w")])}
    metadata, keys = to_metadata(sharded_view(v1))
    assert list(keys.values()) == ["model.w"]


def test_written_chunks_must_match_the_plan():
    refs = dict(GOOD.tensors)
    assert chunk_refs(GOOD.sharded, refs) is None
    del refs["model.w@6,0"]
    assert "no rank wrote chunk 'model.w@6,0'" in chunk_refs(GOOD.sharded, refs)
    refs["model.w@6,0"] = refs["model.w@0,0"]
    refs["stray@0"] = refs["model.w@0,0"]
    assert "'stray@0' was written but is not in the global plan" in chunk_refs(GOOD.sharded, refs)


def test_marker_of_a_sharded_commit_pins_world_and_files_and_stays_small_at_world_4096():
    files = [FileEntry(f"blobs/{CID}.r{r}.safetensors", 10**9, f"{r:016x}") for r in range(4096)]
    raw = GOOD.to_bytes()
    marker = marker_bytes(raw, CID, 4096, files_digest(files))
    assert len(marker) < MAX_MARKER and marker_pin(marker) is not None and check_marker(marker, raw) is None
    assert json.loads(marker)["world_size"] == 4096
    changed = [*files[:-1], FileEntry(files[-1].path, 10**9, "f" * 16)]
    assert files_digest(changed) != files_digest(files) == files_digest(list(reversed(files)))
    assert json.loads(marker_bytes(raw, CID)) == {
        "id": CID,
        "manifest_xxh3": json.loads(marker)["manifest_xxh3"],
    }
