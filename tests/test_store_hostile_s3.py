"""On an object store, a manifest's names are confined too (issue 14, section 5): a real S3 server (moto)."""

from __future__ import annotations

import json
import logging

import pytest

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.manifest import marker_bytes
from supervisor.errors import CheckpointCorrupt
from tests.ckpt_scripts.tiny import Tiny
from tests.s3_server import POLICY_BUCKET, S3Server, s3_server  # noqa: F401  (module fixture)

LOGGER = "rollback_supervisor.checkpoint"


@pytest.mark.parametrize("name", ["../escape/blob.safetensors", "/etc/passwd"])
def test_a_remote_manifest_name_that_leaves_the_store_is_refused(
    s3_server: S3Server,  # noqa: F811
    tmp_path,
    caplog,
    name,
):
    url = f"s3://{POLICY_BUCKET}/hostile/{tmp_path.name}/store"
    t = Tiny()
    options = CheckpointOptions(tmp_path / "a", remote=url, async_save=False, memory_slots=0)
    with CheckpointManager(options, t.state) as mgr:
        t.step()
        good = mgr.save(1)
        saved = t.snapshot()
        t.step()
        bad = mgr.save(2)
    catalog = open_store(url)
    ckpt = f"ckpt-{bad.id}"
    m = json.loads(catalog.fs.cat_file(catalog.path(f"{ckpt}/manifest.json")))
    own = f"blobs/{bad.id}.safetensors"
    blob = catalog.fs.cat_file(catalog.path(own))
    catalog.fs.pipe_file(f"{POLICY_BUCKET}/hostile/{tmp_path.name}/escape/blob.safetensors", blob)
    for f in m["files"]:
        f["path"] = name if f["path"] == own else f["path"]
    for ref in m["tensors"].values():
        ref["blob"] = name if ref["blob"] == own else ref["blob"]
    raw = json.dumps(m, indent=1, sort_keys=True).encode()
    catalog.fs.pipe_file(catalog.path(f"{ckpt}/manifest.json"), raw)
    catalog.fs.pipe_file(catalog.path(f"{ckpt}/COMMITTED"), marker_bytes(raw, bad.id))
    reason = f"entry '{name}' leaves the store"
    for mode in ("full", "fast", "none"):
        assert reason in open_store(url).verify(bad.id, mode)
    seen = len(s3_server.requests())

    fresh = Tiny(seed=7)
    options = CheckpointOptions(tmp_path / "b", remote=url, memory_slots=0)
    with caplog.at_level(logging.WARNING, logger=LOGGER), CheckpointManager(options, fresh.state) as mgr:
        with pytest.raises(CheckpointCorrupt, match=reason):
            mgr.restore(bad.id)
        assert mgr.restore("latest").id == good.id
        assert fresh.equals(saved)
    assert f"Not restoring checkpoint {bad.id}" in caplog.text
    assert not [r for r in s3_server.requests()[seen:] if "escape" in r or "passwd" in r]
