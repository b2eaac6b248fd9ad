"""Experiment: a DCP StorageWriter/StorageReader that writes our format (safetensors + JSON, xxh3, no pickle).

Each rank writes one blob `rank<r>.safetensors` (via supervisor.checkpoint.blobs.write_blob) into a staging dir;
rank 0's finish() writes manifest.json (JSON Metadata + every rank's file digests) and then COMMITTED.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from supervisor.checkpoint.blobs import (
    DTYPE_NAMES,
    DTYPES,
    BlobReader,
    digest_start,
    tensor_digest,
    write_blob,
)
from supervisor.checkpoint.local import fsync_dir, write_file

LOG = os.environ.get("EXP_LOG")


def _log(rec: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(rec) + "\n")


def chunk_key(fqn: str, offsets) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


class OurWriter(StorageWriter):
    def __init__(self, staged: str, crash_rank: int | None = None, crash_at: str | None = None):
        self.staged = staged
        self.rank = 0
        self.crash_rank, self.crash_at = crash_rank, crash_at

    def _maybe_crash(self, where: str) -> None:
        if self.crash_at == where and self.rank == self.crash_rank:
            _log({"rank": self.rank, "crash": where})
            if os.environ.get("CRASH_KIND") == "hang":
                time.sleep(60)
            os._exit(137)

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.rank = kwargs.get("rank", 0)
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(f"{item.index.fqn}: non-tensor leaf reached DCP (it would be pickled)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data={"file": f"rank{i}.safetensors"}) for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._maybe_crash("write_start")
        fname = plan.storage_data["file"]
        tensors, keys = {}, []
        for item in plan.items:
            t = planner.resolve_data(item).detach()
            t = t.to("cpu").contiguous()
            key = chunk_key(item.index.fqn, item.tensor_data.chunk.offsets)
            tensors[key] = t
            keys.append((item, key))
        os.makedirs(self.staged, exist_ok=True)
        path = os.path.join(self.staged, fname)
        self._maybe_crash("before_blob")
        size, fdigest = write_blob(path, tensors, {"rank": str(self.rank)})
        self._maybe_crash("after_blob")
        results = []
        for item, key in keys:
            t = tensors[key]
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=t.numel() * t.element_size(),
                    storage_data={
                        "file": fname,
                        "key": key,
                        "digest": tensor_digest(t),
                        "file_size": size,
                        "file_xxh3": fdigest,
                    },
                )
            )
        _log(
            {
                "rank": self.rank,
                "file": fname,
                "n": len(keys),
                "bytes": size,
                "keys": sorted(k for _, k in keys),
                "shapes": {k: list(tensors[k].shape) for _, k in keys},
            }
        )
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._maybe_crash("finish")
        files = {}
        storage = []
        for per_rank in results:
            for wr in per_rank:
                sd = wr.storage_data
                files[sd["file"]] = {"size": sd["file_size"], "xxh3": sd["file_xxh3"]}
                storage.append(
                    {
                        "fqn": wr.index.fqn,
                        "offset": list(wr.index.offset),
                        "file": sd["file"],
                        "key": sd["key"],
                        "digest": sd["digest"],
                    }
                )
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn}: not a tensor")
            tensors[fqn] = {
                "dtype": DTYPE_NAMES[md.properties.dtype],
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        manifest = {"tensors": tensors, "storage": storage, "files": files, "world_size": len(results)}
        raw = json.dumps(manifest, sort_keys=True).encode()
        write_file(os.path.join(self.staged, "manifest.json"), raw)
        fsync_dir(self.staged)
        self._maybe_crash("before_marker")
        marker = json.dumps({"manifest_xxh3": xxhash.xxh3_64_hexdigest(raw), "files": files}).encode()
        write_file(os.path.join(self.staged, "COMMITTED"), marker, exclusive=True)
        fsync_dir(self.staged)
        _log({"rank": self.rank, "finish": True, "files": files, "t": time.time()})

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class OurReader(StorageReader):
    def __init__(self, directory: str):
        self.dir = directory
        self.where: dict[MetadataIndex, dict] = {}

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if not os.path.exists(os.path.join(self.dir, "COMMITTED")):
            raise FileNotFoundError(f"{self.dir}: not committed")
        raw = open(os.path.join(self.dir, "manifest.json"), "rb").read()
        m = json.loads(raw)
        sdm = {}
        for fqn, t in m["tensors"].items():
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=DTYPES[t["dtype"]]),
                size=torch.Size(t["size"]),
                chunks=[
                    ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"]))
                    for c in t["chunks"]
                ],
            )
        storage = {MetadataIndex(s["fqn"], s["offset"]): s for s in m["storage"]}
        return Metadata(state_dict_metadata=sdm, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.where = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        readers: dict[str, BlobReader] = {}
        cache: dict[str, torch.Tensor] = {}  # a stored chunk read once (verified), then narrowed per request
        nread = 0
        try:
            for req in plan.items:
                s = self.where[req.storage_index]
                key = s["key"]
                if key not in cache:
                    r = readers.get(s["file"]) or readers.setdefault(
                        s["file"], BlobReader(os.path.join(self.dir, s["file"]))
                    )
                    e = r.entries[key]
                    buf = torch.empty(tuple(e.shape), dtype=DTYPES[e.dtype])
                    h = digest_start(buf.dtype, tuple(buf.shape))
                    r.read_into(e, buf, h)
                    if h.hexdigest() != s["digest"]:
                        raise ValueError(f"{s['file']}:{key}: checksum mismatch")
                    cache[key] = buf
                    nread += 1
                src = cache[key]
                for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                    src = src.narrow(d, o, n)
                dst = planner.resolve_tensor(req).detach()
                if dst.shape != src.shape:
                    raise ValueError(f"{req.storage_index}: shape {tuple(src.shape)} vs {tuple(dst.shape)}")
                dst.copy_(src)
                planner.commit_tensor(req, dst)
        finally:
            for r in readers.values():
                r.close()
        _log({"read_items": len(plan.items), "chunks_read": nread, "pid": os.getpid()})
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


class ReusedStager:
    """Our staging: each rank's local shards copied into reused host buffers, rewrapped as DTensors."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, v in flat.items():
            local = v.to_local() if isinstance(v, DTensor) else v
            buf = self.buffers.get(name)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = self.buffers[name] = torch.empty(local.shape, dtype=local.dtype)
            buf.copy_(local.detach())
            if isinstance(v, DTensor):
                out[name] = DTensor.from_local(
                    buf, v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
                )
            else:
                out[name] = buf
        return out
