"""`ShardReader`: DCP's `StorageReader` over our manifest (v2 chunks, or v1 whole tensors), verifying each read.

Built from a manifest already checked against its marker; `read_metadata` turns it into DCP's `Metadata`
(JSON, never a pickle), and DCP's load planner intersects the stored chunks with the live placements, which
is the resharding. Each stored chunk a rank needs is read once, its xxh3-128 computed while reading.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from supervisor.checkpoint.blobs import DTYPES, BlobReader, digest_start
from supervisor.checkpoint.boundedjson import loads_bounded
from supervisor.checkpoint.catalog import Catalog, header_disagreement
from supervisor.checkpoint.dcp_format import sharded_problem, sharded_view, to_metadata
from supervisor.checkpoint.manifest import CKPT_PREFIX, STATE, Manifest
from supervisor.checkpoint.options import VERIFY_MODES
from supervisor.checkpoint.paths import LeavesStore
from supervisor.errors import CheckpointCorrupt, CheckpointError

log = logging.getLogger("rollback_supervisor.checkpoint")

#: As restore.py: state.json nests as deep as the registered state dicts do.
_MAX_STATE_DEPTH = 200


class ShardReader(StorageReader):
    """Reads one committed checkpoint of `catalog` for DCP; verify is "full" (checksums) or "fast"."""

    def __init__(self, catalog: Catalog, manifest: Manifest, verify: str = "full"):
        super().__init__()
        check_verify(verify)
        if reason := sharded_problem(manifest):
            raise CheckpointCorrupt(manifest.id, reason)
        self.catalog, self.manifest, self.verify = catalog, manifest, verify
        self.metadata, self.keys = to_metadata(sharded_view(manifest))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(
                    f"{item.dest_index.fqn}: a non-tensor value cannot be loaded without pickle"
                )
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_key: dict[str, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            by_key[self._key(req.storage_index)].append(req)
        readers: dict[str, BlobReader] = {}
        try:
            for key, reqs in by_key.items():
                self._read_chunk(key, reqs, planner, readers)
        finally:
            for r in readers.values():
                r.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _key(self, index: MetadataIndex) -> str:
        key = self.keys.get(MetadataIndex(index.fqn, index.offset))
        if key is None:
            raise CheckpointCorrupt(
                self.manifest.id, f"no stored chunk of {index.fqn!r} at {list(index.offset or ())}"
            )
        return key

    def _read_chunk(
        self, key: str, reqs: list[ReadItem], planner: LoadPlanner, readers: dict[str, BlobReader]
    ) -> None:
        """Read stored chunk `key` once (into the live tensor itself when one request wants all of it)."""
        cid, ref = self.manifest.id, self.manifest.tensors[key]
        reader = readers.get(ref.blob)
        if reader is None:
            try:
                reader = readers[ref.blob] = BlobReader(self.catalog.confined(ref.blob))
            except LeavesStore as exc:
                raise CheckpointCorrupt(cid, str(exc)) from None
            except (OSError, ValueError) as exc:
                raise CheckpointCorrupt(cid, f"{ref.blob}: {exc}") from None
        entry = reader.entries.get(ref.key)
        found = None if entry is None else (entry.dtype, entry.shape, entry.end - entry.start)
        if reason := header_disagreement(ref, found):
            raise CheckpointCorrupt(cid, reason)
        assert entry is not None
        dtype = DTYPES[entry.dtype]
        direct = None
        if len(reqs) == 1 and tuple(reqs[0].lengths) == entry.shape and not any(reqs[0].storage_offsets):
            dst = planner.resolve_tensor(reqs[0]).detach()
            if (
                dst.device.type == "cpu"
                and dst.dtype == dtype
                and dst.is_contiguous()
                and tuple(dst.shape) == entry.shape
            ):
                direct = dst
        buf = direct if direct is not None else torch.empty(entry.shape, dtype=dtype)
        digest = digest_start(dtype, entry.shape) if self.verify == "full" and ref.digest else None
        try:
            reader.read_into(entry, buf, digest)
        except (OSError, ValueError) as exc:
            raise CheckpointCorrupt(cid, f"{ref.blob}: reading tensor {ref.key!r} failed ({exc})") from None
        if digest is not None and digest.hexdigest() != ref.digest:
            raise CheckpointCorrupt(
                cid,
                f"{ref.blob}: tensor {ref.key!r} checksum mismatch: expected xxh3-128 {ref.digest}, "
                f"found {digest.hexdigest()}",
            )
        for req in reqs:
            dst = direct if direct is not None else planner.resolve_tensor(req).detach()
            if direct is None:
                src = buf
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    src = src.narrow(d, o, n)
                if tuple(dst.shape) != tuple(src.shape):
                    raise CheckpointCorrupt(
                        cid,
                        f"{key}: stored piece is {list(src.shape)}, the live tensor wants {list(dst.shape)}",
                    )
                dst.copy_(src)
            planner.commit_tensor(req, dst)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def check_verify(verify: object) -> None:
    """CheckpointError unless `verify` is one of the store's modes (a typo would silently skip checksums)."""
    if verify not in VERIFY_MODES:
        raise CheckpointError(f"verify: expected one of {', '.join(VERIFY_MODES)}, got {verify!r}")


def read_skeleton(catalog: Catalog, manifest: Manifest, rel: str | None = None) -> Any:
    """A checkpoint's JSON skeleton (state.json, or a rank file), checked against the manifest's xxh3."""
    cid = manifest.id
    rel = rel or f"{CKPT_PREFIX}{cid}/{STATE}"
    try:
        raw = catalog.read(rel)
    except LeavesStore as exc:
        raise CheckpointCorrupt(cid, str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(cid, f"{rel}: {exc}") from None
    listed = {f.path: f for f in manifest.files}.get(rel)
    if listed is not None and xxhash.xxh3_64_hexdigest(raw) != listed.xxh3:
        raise CheckpointCorrupt(cid, f"{rel} checksum mismatch: expected xxh3 {listed.xxh3}")
    try:
        return loads_bounded(raw, max_depth=_MAX_STATE_DEPTH, what=rel)
    except ValueError as exc:
        raise CheckpointCorrupt(cid, str(exc)) from None


def load_tensors(
    catalog: Catalog,
    manifest: Manifest,
    targets: dict[str, Any],
    verify: str,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """Fill `targets` ({name: Tensor | DTensor}) from the checkpoint through DCP (resharding as needed).

    A failure on any rank reaches every rank as one CheckpointError: CheckpointCorrupt when the checkpoint is
    bad (so the caller can pick another one), else CheckpointError with the first rank's reason. A lost peer
    is not one: the collective's own error (RuntimeError) passes through for the caller to classify.
    """
    reader = ShardReader(catalog, manifest, verify)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist says so
            dcp.load(
                targets,
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_partial_load=False),
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise unwrap(exc, manifest.id) from None


def unwrap(exc: CheckpointException, checkpoint_id: str) -> CheckpointError:
    """The first rank's own error inside DCP's CheckpointException, as ours (corrupt stays corrupt).

    DCP carries each rank's traceback as a stack summary; an error that is not ours (an I/O error, a bug) is
    logged with it here, since the CheckpointError raised in its place has no traceback of its own."""
    for rank, (inner, stack) in sorted(exc.failures.items()):
        if not isinstance(inner, CheckpointError):
            where = "".join(stack.format()) if hasattr(stack, "format") else str(stack)
            log.warning(
                "checkpoint %s: rank %d failed with %s: %s\n%s",
                checkpoint_id,
                rank,
                type(inner).__name__,
                inner,
                where,
            )
    for rank, (inner, _) in sorted(exc.failures.items()):
        if isinstance(inner, CheckpointCorrupt):
            return CheckpointCorrupt(inner.checkpoint_id, f"rank {rank}: {inner.reason}")
    for rank, (inner, _) in sorted(exc.failures.items()):
        if isinstance(inner, CheckpointError):
            return _on_rank(inner, rank)
        # DCP's own checks (a tensor the checkpoint lacks, a size that differs) and I/O errors.
        return CheckpointError(f"checkpoint {checkpoint_id}: rank {rank}: {type(inner).__name__}: {inner}")
    return CheckpointError(f"checkpoint {checkpoint_id}: {exc}")


def _on_rank(exc: CheckpointError, rank: int) -> CheckpointError:
    """`exc` (its own type kept: SaveRefused stays SaveRefused) with the rank that raised it in the message."""
    try:
        return type(exc)(f"rank {rank}: {exc}")
    except TypeError:  # an error type with its own arguments
        return exc


def restore_chunks(
    catalog: Catalog,
    manifest: Manifest,
    selected: Iterable[str],
    live: dict[str, torch.Tensor],
    verify: str,
) -> dict[str, torch.Tensor]:
    """Read the named tensors of a sharded checkpoint in this process alone (world 1); live tensors are
    filled in place where they fit, the others are fresh CPU tensors."""
    view = sharded_view(manifest)
    targets: dict[str, Any] = {}
    for name in selected:
        st = view.get(name)
        if st is None:
            raise CheckpointCorrupt(
                manifest.id, f"{STATE} names tensor {name!r}, which the manifest does not list"
            )
        dtype, size = DTYPES[st.dtype], tuple(st.size)
        dst = live.get(name)
        fits = (
            dst is not None and dst.device.type == "cpu" and dst.dtype == dtype and tuple(dst.shape) == size
        )
        targets[name] = dst.detach() if fits and dst is not None else torch.empty(size, dtype=dtype)
    load_tensors(catalog, manifest, targets, verify, no_dist=True)
    return targets
