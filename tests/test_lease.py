"""Lease test (issue 7): two supervisors never drive one lineage at once.

Unit tests drive `Lease` with an injected clock and sleep on a local path and on a real S3-compatible
server (moto on 127.0.0.1); the end-to-end test starts two real `rollback-supervisor run` for one lineage.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from supervisor.errors import LeaseHeldError
from supervisor.lineage import Lease
from tests.s3_server import s3_server  # noqa: F401  (module fixture)
from tests.test_spot import cli_argv, cli_env, cli_log, process_tree, reap, running, start_cli, wait_until

A, B = "host-a:101:aaaa", "host-b:202:bbbb"


class FakeClock:
    """Wall clock for the lease; `sleep` advances it and remembers each wait."""

    def __init__(self, now: float = 1000.0):
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture(params=["local", "s3"])
def lease_root(request, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "lineage")
    request.getfixturevalue("s3_server")
    return f"s3://rollback-tests/leases/{uuid.uuid4().hex[:8]}"


def test_lease_expiry_renew_release_and_takeover(lease_root: str):
    clock = FakeClock()
    a = Lease(lease_root, ttl_seconds=30, owner=A, clock=clock)
    b = Lease(lease_root, ttl_seconds=30, owner=B, clock=clock)

    a.acquire()
    assert a.holder() == {"owner": A, "acquired_at": 1000.0, "expires_at": 1030.0, "token": 1}
    with pytest.raises(LeaseHeldError, match=r"driven by host-a:101:aaaa \(lease expires in 30s\)"):
        b.acquire(0, sleep=clock.sleep)
    assert clock.sleeps == []

    clock.now = 1020.0
    a.renew()
    assert a.holder()["expires_at"] == 1050.0
    clock.now = 1045.0  # past the first expiry, inside the renewed one
    with pytest.raises(LeaseHeldError, match="expires in 5s"):
        b.acquire(0, sleep=clock.sleep)

    # Waiting: b polls (at most 1 s apart) until a's renewed lease has expired, then takes it over.
    b.acquire(10, sleep=clock.sleep)
    assert clock.sleeps == [1.0] * 6 and clock.now == 1051.0
    assert b.holder() == {"owner": B, "acquired_at": 1051.0, "expires_at": 1081.0, "token": 2}

    # The old holder finds out at its next renewal, and its release does not drop b's lease.
    with pytest.raises(LeaseHeldError, match="lost the lease .* to host-b:202:bbbb"):
        a.renew()
    a.release()
    assert b.holder()["owner"] == B

    b.release()
    assert b.holder() is None
    a.acquire(0, sleep=clock.sleep)
    assert a.holder()["owner"] == A and clock.sleeps == [1.0] * 6


def test_lease_wait_gives_up_at_its_deadline(lease_root: str):
    clock = FakeClock()
    Lease(lease_root, ttl_seconds=60, owner=A, clock=clock).acquire()
    b = Lease(lease_root, ttl_seconds=60, owner=B, clock=clock)
    with pytest.raises(LeaseHeldError, match=r"driven by host-a:101:aaaa \(lease expires in 58s\)"):
        b.acquire(2.5, sleep=clock.sleep)
    assert clock.sleeps == [1.0, 1.0, 0.5]
    assert b.holder()["owner"] == A


def test_a_stale_read_of_no_holder_cannot_steal_a_held_lease(lease_root: str):
    """b checked for a holder just before a took the lease (the check-then-write race): b must not win."""
    clock = FakeClock()
    a = Lease(lease_root, ttl_seconds=30, owner=A, clock=clock)
    b = Lease(lease_root, ttl_seconds=30, owner=B, clock=clock)
    a.acquire()
    real_holder, reads = b.holder, []

    def stale_then_real():
        reads.append(1)
        return None if len(reads) == 1 else real_holder()

    b.holder = stale_then_real  # type: ignore[method-assign]
    try:
        b.acquire(0, sleep=clock.sleep)
    except LeaseHeldError:
        pass
    assert real_holder()["owner"] == A
    a.renew()  # a still holds the lease it took


def test_two_supervisors_taking_over_one_expired_lease_cannot_both_win(lease_root: str):
    """b and c both judged a's lease expired from the same read: exactly one take-over write succeeds."""
    clock = FakeClock()
    a = Lease(lease_root, ttl_seconds=30, owner=A, clock=clock)
    a.acquire()
    clock.now += 31
    b = Lease(lease_root, ttl_seconds=30, owner=B, clock=clock)
    c = Lease(lease_root, ttl_seconds=30, owner="host-c:303:cccc", clock=clock)
    seen = b.holder()
    assert seen == c.holder() and seen["owner"] == A
    won = [b._take(seen), c._take(seen)]
    assert won == [True, False]
    assert a.holder()["owner"] == B
    with pytest.raises(LeaseHeldError, match="lost the lease"):
        a.renew()
    with pytest.raises(LeaseHeldError, match="lost the lease"):
        c.renew()
    b.renew()


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    clock = FakeClock()
    Lease(str(tmp_path), owner=f"{socket.gethostname()}:{dead.pid}:dead0000", clock=clock).acquire()
    mine = Lease(str(tmp_path), clock=clock)
    mine.acquire(0, sleep=clock.sleep)
    assert mine.holder()["owner"] == mine.owner


# -- two real supervisors ---------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_second_supervisor_for_a_lineage_refuses_and_never_trains(prefect_harness, tmp_path: Path):
    from prefect.settings import PREFECT_API_URL

    # Both talk to the session's Prefect test server (two flow runs, one API); no ephemeral servers.
    api = {"PREFECT_API_URL": PREFECT_API_URL.value()}
    lineage, work = "leased", tmp_path / "work"
    lineage_dir = work / "lineages" / lineage
    first = start_cli(tmp_path, work, lineage, steps=5000, env=api)
    tree = []
    try:
        wait_until(
            "the first supervisor's training to report a step",
            (lineage_dir / "heartbeat.json").exists,
            first,
            lambda: cli_log(tmp_path, lineage),
        )
        tree = process_tree(first)
        holder = json.loads((lineage_dir / "lease.json").read_text())
        assert holder["owner"].startswith(f"{socket.gethostname()}:{first.pid}:")
        training_pid = json.loads((lineage_dir / "heartbeat.json").read_text())["pid"]

        second = subprocess.run(
            cli_argv(work, lineage, steps=60, lease_wait=0),
            cwd=tmp_path,
            env=cli_env(api),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == LeaseHeldError.exit_code == 2
        assert f"error: lineage at {lineage_dir} is driven by {holder['owner']}" in second.stderr
        assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1
        assert "--lease-wait" in second.stderr

        # The second never launched a segment; the first still trains and still holds the lease.
        record = json.loads((lineage_dir / "lineage.json").read_text())
        assert [s["pid"] for s in record["segments"]] == [training_pid]
        assert sorted(p.name for p in lineage_dir.glob("plan-*.json")) == ["plan-0.json"]
        assert first.poll() is None
        assert json.loads((lineage_dir / "lease.json").read_text())["owner"] == holder["owner"]

        first.send_signal(signal.SIGTERM)
        assert first.wait(120) == 143
        assert running(tree, timeout=15) == []
        assert Lease(str(lineage_dir)).holder() is None  # released (the file keeps the token for the next)
    finally:
        reap(first, tree)
