"""`ShardWriter`: DCP's `StorageWriter` writing our format, each rank its own blob, rank 0 committing last.

One instance per save per rank. The steps, in DCP's order:

- `prepare_local_plan` (every rank): refuses a non-tensor item, which DCP would pickle.
- `prepare_global_plan` (rank 0): asks the job's `gate`, runs its `prepare` (retention; it returns the
  checkpoints dedup may reuse), stages the directory, and sends every rank its blob name, the staging
  directory and the reuse list.
- `write_data` (every rank): health, dedup against the reusable checkpoints, `blobs/<id>.r<rank>.safetensors`
  and `ranks.<rank>.json` written and fsynced in the staging directory. DCP gathers every rank's results to
  rank 0 before `finish`, so that gather is the barrier "every rank's files are durable".
- `finish` (rank 0): state.json, the v2 manifest, `before_commit`, the `gate` again, then `LocalStore.commit`
  (marker last).

Only rank 0 decides to skip a save, and only inside DCP's steps: a refusal raised there reaches every rank as
`SaveRefused`, in lockstep. A rank that skipped the collectives alone would hang the others until the timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from supervisor.checkpoint.blobs import write_blob
from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.dcp_format import chunk_key, chunk_refs, from_metadata
from supervisor.checkpoint.dedup import DedupIndex, plan
from supervisor.checkpoint.local import LocalStore, write_file
from supervisor.checkpoint.manifest import (
    BLOBS,
    CKPT_PREFIX,
    SHARDED_FORMAT_VERSION,
    STATE,
    FileEntry,
    Manifest,
    TensorRef,
    files_digest,
    marker_bytes,
)
from supervisor.checkpoint.writer import CheckpointMeta
from supervisor.errors import CheckpointError

log = logging.getLogger("rollback_supervisor.checkpoint")

#: The index of the one extra WriteResult per rank that carries the rank's files (never a tensor name).
RANK_INFO = "__rank_files__"
#: Phases a `phase_hook` is called at (crash tests kill a rank there with a real signal).
PHASES = ("plan", "write_start", "after_blob", "finish", "before_marker", "committed")


def rank_file(checkpoint_id: str, rank: int) -> str:
    """Where rank `rank`'s own JSON state lies, relative to the store root."""
    return f"{CKPT_PREFIX}{checkpoint_id}/ranks.{rank}.json"


class SaveRefused(CheckpointError):
    """Rank 0's gate refused the save (a rollback went past it); nothing was committed, on any rank."""


@dataclass
class CommitJob:
    """What only the committing rank (0) knows about a save: its store, record, global state and hooks."""

    store: LocalStore
    meta: CheckpointMeta
    state_raw: bytes
    """The global JSON skeleton (state.json)."""
    prepare: Callable[[], list[str]] = list
    """Runs before anything is staged (retention); returns the ids whose blobs this save may reuse."""
    before_commit: Callable[[], Any] | None = None
    checked: Callable[[str], bool] | None = None
    """Which tensors the health mark covers (None: all); module buffers are exempt, as in the v1 path."""
    gate: Callable[[str], str | None] | None = None
    """Asked before anything is staged and again just before the commit: a reason refuses the save."""
    staged: str | None = None
    manifest: Manifest | None = None

    def check_gate(self) -> None:
        """SaveRefused when the gate refuses this save now."""
        if self.gate is not None and (reason := self.gate(self.meta.id)) is not None:
            raise SaveRefused(f"save {self.meta.id} refused: {reason}")


@dataclass
class _RankShare:
    """What one rank wrote, sent to rank 0 in its extra WriteResult."""

    rank: int
    files: list[FileEntry]
    new_blobs: list[str]
    written: int
    nonfinite: list[str] = field(default_factory=list)


class ShardWriter(StorageWriter):
    """Every rank's writer for one sharded save into the store at `root` (rank 0 also holds the `job`)."""

    def __init__(
        self,
        root: str,
        rank_raw: bytes,
        job: CommitJob | Callable[[], CommitJob] | None = None,
        phase_hook: Callable[[str, int], None] | None = None,
        *,
        failure: BaseException | None = None,
        expect_id: str | None = None,
    ):
        """`failure`: this rank could not prepare its share (the capture failed); its local plan raises it, so
        every rank fails this save together instead of the others waiting for a rank that never joins.
        `expect_id`: the id this rank gave the save; a plan for another id (ranks out of step) is refused."""
        super().__init__()
        self.failure, self.expect_id = failure, expect_id
        self.root = root
        self.rank_raw = rank_raw
        # A function is called in prepare_global_plan: DCP sends a raise there to every rank at once.
        self.job = job if isinstance(job, CommitJob) else None
        self._make_job = None if isinstance(job, CommitJob) else job
        self.rank = 0
        self.is_coordinator = False
        self.saved_id: str | None = None
        self._hook = phase_hook

    def _phase(self, name: str) -> None:
        if self._hook is not None:
            self._hook(name, self.rank)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))
        if is_coordinator and self.job is None and self._make_job is None:
            raise CheckpointError(
                "the coordinating rank of a sharded save needs a CommitJob (rank 0 commits)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.failure is not None:
            raise CheckpointError(
                f"this rank's share could not be prepared: {type(self.failure).__name__}: {self.failure}"
            )
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(
                    f"{item.index.fqn}: a non-tensor value reached the sharded writer, which would need pickle; "
                    "keep numbers, strings and lists in the JSON skeleton and pass only tensors to DCP"
                )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._phase("plan")
        if self.job is None and self._make_job is not None:
            self.job = self._make_job()
        job = self.job
        assert job is not None
        job.check_gate()
        reuse = job.prepare()
        job.staged = job.store.stage(job.meta.id)
        cid = job.meta.id
        return [
            dataclasses.replace(
                p,
                storage_data={
                    "id": cid,
                    # relative to the store root: a rank on another node may mount the shared store elsewhere
                    "staged": os.path.relpath(job.staged, job.store.root),
                    "rank": r,
                    "blob": f"{BLOBS}/{cid}.r{r}.safetensors",
                    "reuse": list(reuse),
                },
            )
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._phase("write_start")
        sd = plan.storage_data
        cid, rank = sd["id"], sd["rank"]
        if self.expect_id is not None and cid != self.expect_id:
            raise CheckpointError(
                f"ranks out of step: rank 0 commits {cid}, this rank's save is {self.expect_id}; nothing of it "
                "is written"
            )
        staged = os.path.join(self.root, sd["staged"])
        self.saved_id = cid
        tensors: dict[str, torch.Tensor] = {}
        indexes: dict[str, MetadataIndex] = {}
        nonfinite: set[str] = set()
        for item in plan.items:
            t = planner.resolve_data(item)
            assert isinstance(t, torch.Tensor)
            t = t.detach().to("cpu").contiguous()
            key = chunk_key(item.index.fqn, item.index.offset or ())
            tensors[key], indexes[key] = t, item.index
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                nonfinite.add(item.index.fqn)
        layout = plan_rank(self.root, tensors, sd["blob"], sd["reuse"])
        files = list(layout.reused_files.values())
        written = 0
        for rel, part in layout.writes.items():
            size, digest = write_blob(
                os.path.join(staged, os.path.basename(rel)), part, {"checkpoint": cid, "rank": str(rank)}
            )
            files.append(FileEntry(rel, size, digest))
            written += size
        self._phase("after_blob")
        write_file(os.path.join(staged, os.path.basename(rank_file(cid, rank))), self.rank_raw)
        files.append(
            FileEntry(rank_file(cid, rank), len(self.rank_raw), xxhash.xxh3_64_hexdigest(self.rank_raw))
        )
        results = [
            WriteResult(index=indexes[key], size_in_bytes=ref.nbytes, storage_data=ref)
            for key, ref in layout.refs.items()
        ]
        share = _RankShare(rank, files, list(layout.writes), written, sorted(nonfinite))
        results.append(WriteResult(index=MetadataIndex(RANK_INFO), size_in_bytes=0, storage_data=share))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        job = self.job
        assert job is not None and job.staged is not None
        self._phase("finish")
        meta, cid = job.meta, job.meta.id
        sharded = from_metadata(metadata)
        refs: dict[str, TensorRef] = {}
        shares: list[_RankShare] = []
        for per_rank in results:
            for wr in per_rank:
                if wr.index.fqn == RANK_INFO:
                    shares.append(wr.storage_data)
                else:
                    refs[chunk_key(wr.index.fqn, wr.index.offset or ())] = wr.storage_data
        if reason := chunk_refs(sharded, refs):
            raise CheckpointError(f"sharded save {cid}: {reason}")
        write_file(os.path.join(job.staged, STATE), job.state_raw)
        files = {
            f"{CKPT_PREFIX}{cid}/{STATE}": FileEntry(
                f"{CKPT_PREFIX}{cid}/{STATE}", len(job.state_raw), xxhash.xxh3_64_hexdigest(job.state_raw)
            )
        }
        for share in shares:
            files.update((f.path, f) for f in share.files)
        flagged = {n for s in shares for n in s.nonfinite if job.checked is None or job.checked(n)}
        nonfinite = sorted(flagged | set(meta.nonfinite))
        manifest = Manifest(
            id=cid,
            seq=meta.seq,
            step=meta.step,
            wall_time=meta.wall_time,
            metrics=dict(meta.metrics),
            parent_id=meta.parent_id,
            files=sorted(files.values(), key=lambda f: f.path),
            tensors=dict(sorted(refs.items())),
            nbytes=sum(r.nbytes for r in refs.values()),
            written_bytes=sum(s.written for s in shares),
            versions=dict(meta.versions),
            git_commit=meta.git_commit,
            config_hash=meta.config_hash,
            format_version=SHARDED_FORMAT_VERSION,
            nonfinite=nonfinite,
            world_size=len(results),
            sharded=sharded,
            rank_files={str(s.rank): rank_file(cid, s.rank) for s in sorted(shares, key=lambda s: s.rank)},
        )
        raw = manifest.to_bytes()
        if job.before_commit is not None:
            job.before_commit()
        job.check_gate()
        self._phase("before_marker")
        marker = marker_bytes(raw, cid, len(results), files_digest(manifest.files))
        new_blobs = sorted(b for s in shares for b in s.new_blobs)
        job.store.commit(cid, job.staged, raw, new_blobs, marker=marker)
        job.manifest = manifest
        self._phase("committed")

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True


def plan_rank(root: str, tensors: dict[str, torch.Tensor], blob: str, reuse: list[str]) -> Any:
    """This rank's dedup plan against the blobs of the committed checkpoints `reuse` (named by rank 0)."""
    index = None
    if reuse:
        catalog = _catalog(root)
        index = DedupIndex()
        index.rebuild(m for cid in reuse if (m := _readable(catalog, cid)) is not None)
    return plan(tensors, blob, index)


def _readable(catalog: Catalog, checkpoint_id: str) -> Manifest | None:
    """The manifest, or None when it cannot be read now (retention got there first): nothing to reuse."""
    try:
        return catalog.manifest(checkpoint_id)
    except CheckpointError as exc:
        log.warning("Not reusing blobs of checkpoint %s (%s)", checkpoint_id, exc)
        return None


#: One catalog per store root for the life of the process: it keeps the manifests it parsed (keyed by their
#: checksum), so a rank's dedup planning does not parse every reusable manifest again on every save.
_CATALOGS: dict[str, Catalog] = {}


def _catalog(root: str) -> Catalog:
    catalog = _CATALOGS.get(root)
    if catalog is None:
        import fsspec

        catalog = _CATALOGS[root] = Catalog(fsspec.filesystem("file"), root)
    return catalog


def discard(job: CommitJob) -> None:
    """Remove what a failed save staged (rank 0, after every rank has left the save)."""
    if job.staged is not None and job.manifest is None:
        shutil.rmtree(job.staged, ignore_errors=True)
