"""Issue 14, section 1 and 7: the lease is held through every wait, checked before every launch, and fences
the lineage record; damaged lease and lineage files never crash a reader.

The unit tests drive `Lease` with an injected clock on a real directory; the end-to-end test runs real
`rollback-supervisor run` processes with a short lease and a relaunch delay several times longer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.errors import LeaseHeldError, UserError
from supervisor.lineage import Lease, LeaseKeeper, LineageRecordError, LineageStore, parse_record
from tests.test_lease import A, B, FakeClock

CLI = Path(sys.executable).with_name("rollback-supervisor")


def test_keeper_holds_a_short_lease_through_a_long_wait(tmp_path: Path):
    """The wait is 2x the TTL: with the keeper renewing, nobody else can take the lease meanwhile."""
    ttl = 1.5  # the keeper renews every 0.5 s: a renewal would have to be 1 s late to lose it
    a = Lease(str(tmp_path), ttl_seconds=ttl, owner=A)
    a.acquire()
    keeper = LeaseKeeper(a).start()
    try:
        deadline = time.monotonic() + 2 * ttl  # the supervisor "sleeps through its backoff"
        while time.monotonic() < deadline:
            with pytest.raises(LeaseHeldError, match="driven by host-a:101:aaaa"):
                Lease(str(tmp_path), ttl_seconds=ttl, owner=B).acquire(0)
            time.sleep(0.2)
        keeper.check()  # and before the launch, the lease is still ours
        keeper.renew_now()
    finally:
        keeper.stop()
    time.sleep(ttl + 0.2)  # without the keeper, the lease expires
    Lease(str(tmp_path), ttl_seconds=ttl, owner=B).acquire(0)
    with pytest.raises(LeaseHeldError, match="lost the lease .* to host-b:202:bbbb"):
        LeaseKeeper(a).check()


def test_a_renewal_that_did_not_take_is_noticed(tmp_path: Path):
    """`renew()` used to ignore whether its write happened: an expired lease then looked renewed."""
    clock = FakeClock()
    a = Lease(str(tmp_path), ttl_seconds=30, owner=A, clock=clock)
    a.acquire()
    clock.now += 31  # a paused supervisor: its lease expired meanwhile
    lock = Path(a.path + ".lock")
    lock.write_text("")  # another supervisor is in the middle of taking the expired lease over
    with pytest.raises(LeaseHeldError, match="lost the lease"):
        a.renew()
    lock.unlink()
    a.renew()  # nobody took it after all: renewing an expired lease of ours that is still ours is safe
    assert a.holder()["expires_at"] == clock.now + 30


def test_the_record_is_fenced_by_the_lease_token(tmp_path: Path):
    clock = FakeClock()
    store = LineageStore(str(tmp_path))
    a = Lease(str(tmp_path), ttl_seconds=30, owner=A, clock=clock)
    a.acquire()
    record = {"lineage": "x", "status": "running", "segments": [], "mlflow": {}, "history": {}}
    store.save(dict(record), fence=a.token)
    clock.now += 31
    b = Lease(str(tmp_path), ttl_seconds=30, owner=B, clock=clock)
    b.acquire()
    assert b.token == a.token + 1
    store.save({**record, "status": "b-was-here"}, fence=b.token)
    with pytest.raises(LeaseHeldError, match=r"newer lease holder \(token 2 > ours 1\)"):
        store.save({**record, "status": "stale"}, fence=a.token)
    assert store.load()["status"] == "b-was-here"
    # The same owner handing the lease over inside one process (CLI -> flow) keeps the token.
    b2 = Lease(str(tmp_path), ttl_seconds=30, owner=B, clock=clock)
    b2.acquire()
    assert b2.token == b.token == 2


def test_tokens_never_go_back_across_a_takeover_and_a_clean_release(tmp_path: Path):
    """A crashes, B takes over and finishes cleanly, C starts: C's fenced writes must be accepted."""
    clock = FakeClock()
    store = LineageStore(str(tmp_path))
    record = {"lineage": "x", "status": "running", "segments": [], "mlflow": {}, "history": {}}
    a = Lease(str(tmp_path), ttl_seconds=30, owner=A, clock=clock)
    a.acquire()
    store.save(dict(record), fence=a.token)
    clock.now += 31  # A died with its lease
    b = Lease(str(tmp_path), ttl_seconds=30, owner=B, clock=clock)
    b.acquire()
    store.save(dict(record), fence=b.token)
    b.release()
    assert b.holder() is None
    c = Lease(str(tmp_path), ttl_seconds=30, owner="host-c:303:cccc", clock=clock)
    c.acquire()
    assert c.token == 3
    store.save({**record, "status": "c"}, fence=c.token)
    assert store.load()["status"] == "c"
    # A lease file lost altogether restarts low; advancing above the record's token restores the fence.
    c.release()
    Path(c.path).unlink()
    d = Lease(str(tmp_path), ttl_seconds=30, owner="host-d:404:dddd", clock=clock)
    d.acquire()
    assert d.token == 1
    with pytest.raises(LeaseHeldError, match="newer lease holder"):
        store.save(dict(record), fence=d.token)
    d.advance(store.load()["lease_token"])
    store.save({**record, "status": "d"}, fence=d.token)
    assert d.token == 4 and store.load()["status"] == "d"


def test_a_runner_that_fails_to_open_releases_the_lease(tmp_path: Path):
    import threading

    from supervisor.orchestrator import LineageRunner, RunOptions
    from tests.flowkit import FAST_POLICY

    lineage_dir = tmp_path / "lineages" / "t"
    lineage_dir.mkdir(parents=True)
    (lineage_dir / "lineage.json").write_bytes(b"\x00not json")
    runner = LineageRunner(
        RunOptions(command=("true",), policy_path=str(FAST_POLICY), lineage="t", workdir=tmp_path)
    )
    with pytest.raises(LineageRecordError):
        runner.open()
    assert runner.lease.holder() is None
    assert not any(t.name == "lease-keeper" and t.is_alive() for t in threading.enumerate())


def test_status_of_a_damaged_record_is_a_user_error(tmp_path: Path):
    (tmp_path / "lineage.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(LineageRecordError, match="is not valid JSON") as info:
        LineageStore(str(tmp_path)).load()
    assert isinstance(info.value, UserError) and info.value.exit_code == 2


def test_a_fifo_planted_as_the_record_is_refused_without_waiting(tmp_path: Path):
    os.mkfifo(tmp_path / "lineage.json")  # no writer: a plain open would wait forever
    with pytest.raises(LineageRecordError, match="is a FIFO, not a regular file"):
        LineageStore(str(tmp_path)).load()


VALID_RECORD = json.dumps(
    {
        "lineage": "x",
        "status": "running",
        "segments": [{"index": 0, "started": 1.0, "ended": None}],
        "mlflow": {"run_id": "r"},
        "history": {},
        "lease_token": 1,
    }
).encode()
VALID_LEASE = json.dumps({"owner": A, "expires_at": 10.0, "acquired_at": 1.0, "token": 3}).encode()


def _mutations(valid: bytes):
    """Random bytes, truncations, byte flips, and JSON type swaps of a valid document."""
    doc = json.loads(valid)
    swaps = st.sampled_from(list(doc)).flatmap(
        lambda key: st.one_of(st.none(), st.integers(), st.floats(), st.text(), st.lists(st.integers())).map(
            lambda v, key=key: json.dumps({**doc, key: v}).encode()
        )
    )
    return st.one_of(
        st.binary(max_size=300),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda t: valid[: t[0]] + bytes([t[1]]) + valid[t[0] + 1 :]
        ),
        swaps,
        st.just(b"[" * 50_000 + b"]" * 50_000),
        st.just(b"[]"),
    )


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(raw=_mutations(VALID_RECORD))
def test_fuzzed_lineage_records_are_accepted_or_refused_with_a_message(raw: bytes):
    try:
        record = parse_record(raw, "lineage.json")
    except LineageRecordError as exc:
        assert "lineage.json" in str(exc) and "\n" not in str(exc)
    else:
        assert isinstance(record["segments"], list) and isinstance(record["lineage"], str)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(raw=_mutations(VALID_LEASE))
def test_fuzzed_lease_files_never_crash_the_lease(tmp_path_factory, raw: bytes):
    root = tmp_path_factory.mktemp("lease")
    (root / "lease.json").write_bytes(raw)
    clock = FakeClock(now=5.0)
    lease = Lease(str(root), ttl_seconds=30, owner=B, clock=clock)
    holder = lease.holder()
    assert holder is None or isinstance(holder["owner"], str)
    try:
        lease.acquire(0, sleep=clock.sleep)
    except LeaseHeldError as exc:
        assert "driven by" in str(exc)  # only a well-formed, unexpired lease of another owner is respected
    else:
        assert lease.holder()["owner"] == B and lease.token >= 1


# -- real supervisors: a short lease, a long relaunch delay -------------------------------------------

CRASH = [sys.executable, "-c", "import sys; print('crashing', flush=True); sys.exit(1)"]
DELAY_POLICY = """\
version: 1
name: slow-backoff
checkpoint: {{every_steps: 10, keep_last: 2, async: false}}
monitor:
  poll_seconds: 0.2
  detectors: [{{type: hang, seconds: 600}}]
rules:
  - when: [software_error, unknown_exit]
    action: resume
    target: {{select: latest}}
    allow_scratch: true
limits:
  max_restarts: {restarts}
  max_rollbacks: 0
  backoff: {{initial_seconds: {delay}, max_seconds: {delay}, multiplier: 1, jitter: false}}
"""


def _run_argv(workdir: Path, policy: Path, *, lease_wait: float, ttl: float) -> list[str]:
    return [
        str(CLI), "run", "--policy", str(policy), "--lineage", "held", "--workdir", str(workdir),
        "--stop-grace", "5", "--lease-wait", str(lease_wait), "--lease-ttl", str(ttl), "--", *CRASH,
    ]  # fmt: skip


@pytest.mark.e2e
@pytest.mark.slow
def test_no_two_trainings_of_a_lineage_overlap_through_a_long_backoff(prefect_harness, tmp_path: Path):
    """A sleeps 3x its lease's TTL between segments (9 s with a 3 s lease): B with no wait is refused with
    A's name, C waits for A to finish, and the lineage record shows no two segments running at once."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    policy = tmp_path / "policy.yaml"
    ttl = 3  # renewed every second: a renewal would have to be 2 s late to lose it
    policy.write_text(DELAY_POLICY.format(delay=3 * ttl, restarts=1))
    work = tmp_path / "work"
    lineage_dir = work / "lineages" / "held"
    first = subprocess.Popen(
        _run_argv(work, policy, lease_wait=0, ttl=ttl),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    waiter = None
    try:
        deadline = time.monotonic() + 240
        while True:  # A's first segment ended and A is sleeping through its backoff
            rec = _record(lineage_dir)
            segs = (rec or {}).get("segments", [])
            if segs and segs[0].get("decision") and len(segs) == 1:
                break
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "A never finished its first segment"
            time.sleep(0.1)
        time.sleep(2 * ttl)  # 2x the TTL into the delay: the lease must still be A's
        owner = json.loads((lineage_dir / "lease.json").read_text())["owner"]

        started = time.monotonic()
        second = subprocess.run(
            _run_argv(work, policy, lease_wait=0, ttl=ttl),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        refused_in = time.monotonic() - started
        assert second.returncode == 2, second.stderr
        assert f"is driven by {owner}" in second.stderr
        assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1
        assert refused_in < 30  # refused before Prefect's flow machinery starts (no server start-up)

        waiter = subprocess.Popen(
            _run_argv(work, policy, lease_wait=120, ttl=ttl),
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out_a, _ = first.communicate(timeout=240)
        assert first.returncode == 1, out_a  # its restart budget ran out: the run failed, as the policy says
        out_c, _ = waiter.communicate(timeout=240)
        assert waiter.returncode == 1, out_c
    finally:
        for proc in (first, waiter):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    segments = _record(lineage_dir)["segments"]
    assert len(segments) >= 3  # A's two, then C's
    spans = sorted((s["started"], s["ended"], s["pid"]) for s in segments)
    for (_, end, pid), (start, _, next_pid) in zip(spans, spans[1:], strict=False):
        assert end is not None and start >= end, f"segment pid {next_pid} started before pid {pid} ended"
    assert len({pid for _, _, pid in spans}) == len(spans)


def _record(lineage_dir: Path) -> dict | None:
    try:
        return json.loads((lineage_dir / "lineage.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
