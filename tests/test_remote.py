"""Remote test (issue 7): lineage record, lease and checkpoints on a real S3-compatible server (moto).

The spot test again with `checkpoint.storage: s3://...`: after the SIGKILL the first machine's local
lineage directory (record copy, checkpoint cache, heartbeat, logs) is wiped, and the lineage resumes in
another work directory (a fresh machine sharing only S3 and the MLflow store); it must find everything on
S3 and end bit-identical. Then the store's own guarantees on S3: a partial
upload is never visible as committed, and a restore verifies checksums after download.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import xxhash
from safetensors.torch import load_file

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.manifest import CKPT_PREFIX, MANIFEST, MARKER
from supervisor.checkpoint.options import parse_id
from supervisor.errors import CheckpointCorrupt
from supervisor.lineage import Lease
from tests.ckpt_scripts.tiny import Tiny
from tests.conftest import REPO
from tests.s3_server import POLICY_BUCKET, S3Server, s3_server  # noqa: F401  (module fixture)
from tests.test_spot import (
    KILL_AFTER_STEP,
    LEASE_WAIT,
    STEPS,
    assert_resumed_exactly,
    cli_log,
    kill_tree,
    newest,
    process_tree,
    reached,
    reap,
    reference_run,
    role,
    running,
    start_cli,
    wait_until,
)

S3_POLICY = REPO / "tests" / "data" / "policies" / "spot-s3.yaml"
LOGGER = "rollback_supervisor.checkpoint"


def read_json(url: str) -> dict:
    with fsspec.open(url, "r") as fh:
        return json.load(fh)


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_then_resume_on_a_fresh_machine_from_s3(
    s3_server: S3Server,  # noqa: F811
    prefect_harness,
    tmp_path: Path,
    tmp_path_factory,
):
    lineage = "spot-s3"
    durable = f"s3://{POLICY_BUCKET}/runs/{lineage}"
    remote_store = f"{durable}/checkpoints"
    machine_a, machine_b = tmp_path / "machine-a", tmp_path / "machine-b"
    proc = start_cli(tmp_path, machine_a, lineage, policy=S3_POLICY)
    tree = []
    try:
        wait_until(
            f"a checkpoint at step >= {KILL_AFTER_STEP} on S3",
            reached(remote_store, KILL_AFTER_STEP),
            proc,
            lambda: cli_log(tmp_path, lineage),
        )
        tree = process_tree(proc)
        roles = sorted(role(p) for p in tree)
        kill_tree(proc)
        assert roles == ["cli", "prefect-server", "training"]
        assert running(tree) == []
    finally:
        reap(proc, tree)
    resume_from = newest(remote_store)  # what survives the machine: only what reached S3
    assert resume_from is not None and resume_from.step >= KILL_AFTER_STEP
    on_s3 = read_json(f"{durable}/lineage.json")
    assert on_s3["segments"][-1]["ended"] is None and on_s3["storage"]["remote"] == remote_store
    assert read_json(f"{durable}/lease.json")["owner"].split(":")[1] == str(proc.pid)

    # Machine a is gone with everything local to it; only S3 and the MLflow store (a server's stand-in)
    # are shared with machine b.
    local_a = machine_a / "lineages" / lineage
    assert (local_a / "checkpoints").is_dir() and (local_a / "lineage.json").is_file()
    shutil.rmtree(machine_a / "lineages")

    ref = reference_run(tmp_path_factory)  # also lets the dead supervisor's lease expire
    from tests.flowkit import run_flow

    result = run_flow(
        machine_b,
        steps=STEPS,
        policy=S3_POLICY,
        lineage=lineage,
        lease_wait_seconds=LEASE_WAIT,
        tracking_uri=on_s3["mlflow"]["tracking_uri"],
    )
    rec = read_json(f"{durable}/lineage.json")
    assert rec["created"] == on_s3["created"] and rec["mlflow"] == on_s3["mlflow"]  # the same lineage
    assert rec["status"] == "finished"
    local_b = machine_b / "lineages" / lineage
    assert json.loads((local_b / "lineage.json").read_text())["segments"] == rec["segments"]
    assert_resumed_exactly(ref, result, rec, resume_from, checkpoints=local_b / "checkpoints")
    # The resume point came down from S3 into b's empty cache; the final checkpoint went up, whole.
    assert resume_from.id in {i.id for i in open_store(local_b / "checkpoints").list()}
    assert open_store(remote_store).verify(result["final_checkpoint"], "full") is None
    assert Lease(durable).holder() is None  # released on S3 too (the record keeps only the token)
    assert read_json(f"{durable}/lease.json")["token"] == rec["lease_token"]
    assert not (machine_a / "lineages").exists()


# -- the store on S3: commit marker last, partial uploads, checksums after download -----------------

DIE_BEFORE_SECOND_MARKER = """
import os, signal, sys
sys.path.insert(0, sys.argv[4])
from safetensors.torch import save_file
from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.checkpoint.manifest import MARKER
from supervisor.checkpoint.remote import RemoteTier
from tests.ckpt_scripts.tiny import Tiny

local, remote, expected = sys.argv[1:4]
put, markers = RemoteTier._put, []

def put_or_die(self, src, rel):
    if rel.endswith("/" + MARKER):
        markers.append(rel)
        if len(markers) == 2:  # the machine dies after the second checkpoint's data, before its marker
            os.kill(os.getpid(), signal.SIGKILL)
    put(self, src, rel)

RemoteTier._put = put_or_die
t = Tiny()
with CheckpointManager(CheckpointOptions(local, remote=remote, async_save=False), t.state) as mgr:
    t.step()
    first = mgr.save(1)
    mgr.wait()
    save_file(t.snapshot(), expected)
    print(first.id, flush=True)
    t.step()
    print(mgr.save(2).id, flush=True)
    mgr.wait()
"""


def puts(server: S3Server, url: str) -> list[str]:
    """Object keys (relative to `url`) of every PUT the server answered under `url`, in order."""
    prefix = "PUT /" + url.removeprefix("s3://").rstrip("/") + "/"
    return [r.removeprefix(prefix) for r in server.requests() if r.startswith(prefix)]


def test_partial_upload_is_never_committed_and_marker_goes_last(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
):
    url = f"s3://{POLICY_BUCKET}/unit/partial"
    expected = tmp_path / "expected.safetensors"
    child = subprocess.run(
        [sys.executable, "-c", DIE_BEFORE_SECOND_MARKER, str(tmp_path / "a"), url, str(expected), str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr[-3000:]
    first, second = child.stdout.split()

    # Server side: the first checkpoint's marker was its last object, after every file it lists.
    catalog = open_store(url)
    keys = puts(s3_server, url)
    needed = [f.path for f in catalog.manifest(first).files] + [f"{CKPT_PREFIX}{first}/{MANIFEST}"]
    marker = f"{CKPT_PREFIX}{first}/{MARKER}"
    assert set(needed) <= set(keys[: keys.index(marker)])
    # The second checkpoint's data reached S3 but its marker never did: it is not a checkpoint.
    assert f"{CKPT_PREFIX}{second}/{MANIFEST}" in keys and f"{CKPT_PREFIX}{second}/{MARKER}" not in keys
    assert catalog.ids() == [first, second]
    assert [i.id for i in catalog.list()] == [first]
    assert catalog.verify(second) == f"not committed: {MARKER} marker missing"

    # A fresh machine sees only the committed one and restores it bit for bit from S3.
    t = Tiny(seed=5)
    with CheckpointManager(CheckpointOptions(tmp_path / "b", remote=url, async_save=False), t.state) as mgr:
        assert [i.id for i in mgr.list()] == [first]
        assert mgr.restore("latest").id == first
        assert t.equals(load_file(str(expected)))
        t.step()
        third = mgr.save(2)
        mgr.wait()
    # Its sequence continues past the half-upload, whose leftovers the next upload cleaned away.
    assert third.seq > parse_id(second)[1]
    assert catalog.ids() == [first, third.id]


def test_restore_verifies_checksums_after_download(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
    caplog,
):
    url = f"s3://{POLICY_BUCKET}/unit/checksum"
    t = Tiny()
    with CheckpointManager(CheckpointOptions(tmp_path / "a", remote=url, async_save=False), t.state) as mgr:
        t.step()
        first = mgr.save(1)
        expected = t.snapshot()
        t.step()
        second = mgr.save(2)
        mgr.wait()
    catalog = open_store(url)
    bad = sorted(catalog.manifest(second.id).blobs() - catalog.manifest(first.id).blobs())[0]
    data = bytearray(catalog.fs.cat_file(catalog.path(bad)))
    data[-5] ^= 0x01  # one bit in the tensor bytes: same size, so only a checksum can tell
    catalog.fs.pipe_file(catalog.path(bad), bytes(data))
    assert catalog.verify(second.id, "fast") is None
    assert catalog.verify(second.id, "full") == (
        f"{bad} checksum mismatch: expected xxh3 "
        f"{next(f.xxh3 for f in catalog.manifest(second.id).files if f.path == bad)}, "
        f"found {xxhash.xxh3_64_hexdigest(bytes(data))}"
    )

    fresh = Tiny(seed=5)
    options = CheckpointOptions(tmp_path / "b", remote=url, async_save=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER), CheckpointManager(options, fresh.state) as mgr:
        assert mgr.latest().id == second.id  # a size check passes; the download is what gets verified
        assert mgr.restore("latest").id == first.id
        assert fresh.equals(expected)
        with pytest.raises(CheckpointCorrupt, match=f"remote: {bad}: tensor '.+' checksum mismatch"):
            mgr.restore(second.id)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Not restoring")]
    assert len(skipped) == 1 and second.id in skipped[0]
    assert f"remote: {bad}: tensor " in skipped[0] and "checksum mismatch" in skipped[0]


# -- a lineage that moves machines keeps its in-process decisions -----------------------------------

#: A stand-in training segment: it reports one anomaly it handled in process (an in-process rollback),
#: exactly as Session._report writes it, and exits 0.
REPORTS_ONE_IN_PROCESS_ROLLBACK = """
import json, os, time
from policies import Decision
from supervisor.events import Event
from supervisor.runtime.plan import load_plan

plan = load_plan("fake")
event = Event(type="spike", reason="fake spike", metric="loss", onset_step=5, step=5, value=9.0,
              wall_time=time.time(), source="in_process")
decision = Decision(action="rollback", target_id=None, reason="fake in-process rollback", event=event)
record = {"seq": 1, "pid": os.getpid(), "segment": plan.segment, "time": time.time(),
          "handled_in_process": True, "event": event.to_dict(), "decision": decision.to_dict()}
with open(plan.events_path, "a") as fh:
    fh.write(json.dumps(record) + "\\n")
"""


def fake_segment_on(machine: Path, lineage: str, tracking_uri: str | None) -> dict:
    """One supervised segment of the stand-in above on `machine` (a work directory); the finished record."""
    from supervisor.orchestrator import LineageRunner, RunOptions

    options = RunOptions(
        command=(sys.executable, "-c", REPORTS_ONE_IN_PROCESS_ROLLBACK),
        policy_path=str(S3_POLICY),
        lineage=lineage,
        workdir=machine,
        tracking_uri=tracking_uri,
        stop_grace_seconds=5,
        max_segments=1,
    )

    def ended_by_itself(decision, record) -> None:
        assert decision is None

    with LineageRunner(options, sleep=lambda s: None) as runner:
        return runner.supervise(on_decision=ended_by_itself).to_dict()


@pytest.mark.e2e
@pytest.mark.slow
def test_in_process_decisions_survive_a_move_to_another_machine(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
):
    from policies import History

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"  # shared by both machines, like a tracking server

    def one_segment_on(machine: Path) -> dict:
        return fake_segment_on(machine, "moving", tracking)

    first = one_segment_on(tmp_path / "machine-a")
    assert [len(s["in_process"]) for s in first["segments"]] == [1]
    second = one_segment_on(tmp_path / "machine-b")
    assert len(second["segments"]) == 2
    assert [len(s["in_process"]) for s in second["segments"]] == [1, 1]
    assert [e.decision.reason for e in History.from_dict(second["history"])] == [
        "fake in-process rollback"
    ] * 2


@pytest.mark.e2e
def test_a_lineage_on_a_machine_without_its_mlflow_store_logs_to_a_new_run_here(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
):
    """No --tracking-uri: machine a's local sqlite store is gone with machine a, so b opens a run of its own."""
    from mlflow.tracking import MlflowClient

    def one_segment_on(machine: Path) -> dict:
        record = fake_segment_on(machine, "moved-tracking", None)
        assert record["storage"]["checkpoints"].startswith(str(machine))  # this machine's paths, not a's
        return record

    first = one_segment_on(tmp_path / "machine-a")
    a_store = f"sqlite:///{(tmp_path / 'machine-a' / 'mlflow.db').resolve()}"
    assert first["mlflow"]["tracking_uri"] == a_store
    shutil.rmtree(tmp_path / "machine-a")  # the spot machine is gone, and its disk with it

    second = one_segment_on(tmp_path / "machine-b")
    b_store = f"sqlite:///{(tmp_path / 'machine-b' / 'mlflow.db').resolve()}"
    assert second["mlflow"]["tracking_uri"] == b_store
    assert second["mlflow"]["run_id"] != first["mlflow"]["run_id"]
    assert [(p["tracking_uri"], p["run_id"]) for p in second["mlflow_previous"]] == [
        (a_store, first["mlflow"]["run_id"])
    ]
    run = MlflowClient(tracking_uri=b_store).get_run(second["mlflow"]["run_id"])
    assert run.data.tags["rollback.lineage"] == "moved-tracking"
    assert run.info.status == "FINISHED"

    # Same host, another work directory: the recorded store is still reachable, so its run continues.
    third = one_segment_on(tmp_path / "machine-c")
    assert (third["mlflow"]["tracking_uri"], third["mlflow"]["run_id"]) == (
        b_store,
        second["mlflow"]["run_id"],
    )
    assert len(third["mlflow_previous"]) == 1
