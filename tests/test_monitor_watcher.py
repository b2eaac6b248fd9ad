"""The MLflow watcher and Monitor against a real sqlite store and a real `mlflow server`."""

from __future__ import annotations

import math
import threading
import time
import uuid

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from supervisor.monitor import (
    DetectorSet,
    HeartbeatWriter,
    MetricsSourceError,
    MetricsUnavailable,
    MetricWatcher,
    Monitor,
    build_detectors,
)
from supervisor.monitor.sources import StoreHistory

NAN, INF = float("nan"), float("inf")
SPECS = [
    {"type": "non_finite", "metrics": ["loss", "grad_norm"]},
    {"type": "spike", "metric": "loss", "window": 32, "sigmas": 6.0, "warmup_steps": 10, "min_history": 16},
]


class Trainer:
    """Logs points the way the training side does: `log_batch` with `step=` and a wall-clock timestamp."""

    def __init__(self, uri: str):
        self.client = MlflowClient(uri)
        self.run_id = self.client.create_run(
            self.client.create_experiment(f"t-{uuid.uuid4().hex}")
        ).info.run_id
        self._ms = int(time.time() * 1000)

    def log(self, step: int, **values: float) -> None:
        self._ms += 1  # strictly increasing timestamps, as a real step takes > 1 ms
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, self._ms, step) for k, v in values.items()])

    def steps(self, steps, **fns) -> None:
        for step in steps:
            self.log(step, **{k: fn(step) for k, fn in fns.items()})


def healthy(step: int) -> float:
    return 2.0 + 0.01 * math.sin(step)


@pytest.fixture(params=["sqlite", pytest.param("server", marks=pytest.mark.e2e)])
def uri(request, mlflow_sqlite_uri):
    if request.param == "sqlite":
        return mlflow_sqlite_uri
    return request.getfixturevalue("mlflow_server").url


def test_poll_returns_only_new_points_in_step_order(uri):
    trainer = Trainer(uri)
    trainer.steps(range(10), loss=healthy, grad_norm=lambda s: 1.0)
    watcher = MetricWatcher(uri, trainer.run_id, ["loss", "grad_norm"], page_size=7, overlap=3)
    first = watcher.poll()
    assert [(p.step, p.metric) for p in first] == [(s, m) for s in range(10) for m in ("grad_norm", "loss")]
    assert watcher.poll() == []
    trainer.log(10, loss=NAN, grad_norm=INF)
    trainer.log(11, loss=healthy(11), grad_norm=-INF)
    new = watcher.poll()
    assert [(p.step, p.metric) for p in new] == [
        (10, "grad_norm"),
        (10, "loss"),
        (11, "grad_norm"),
        (11, "loss"),
    ]
    assert math.isnan(new[1].value) and new[0].value == INF and new[2].value == -INF
    assert all(p.segment == 0 for p in first + new)
    assert new[0].wall_time == pytest.approx(time.time(), abs=60)
    watcher.close()


def test_steps_going_backwards_start_a_new_segment(uri):
    trainer = Trainer(uri)
    trainer.steps(range(100), loss=healthy)
    watcher = MetricWatcher(uri, trainer.run_id, ["loss"], page_size=30)
    assert len(watcher.poll()) == 100
    trainer.steps(range(60, 80), loss=lambda s: 1000.0 + s)
    new = watcher.poll()
    assert [(p.step, p.segment) for p in new] == [(s, 1) for s in range(60, 80)]
    assert [p.step for p in watcher.prefix(1)] == list(range(60))
    assert watcher.segment == 1


def test_monitor_reports_a_nan_once_and_only_in_the_live_branch(uri):
    trainer = Trainer(uri)
    trainer.steps(range(50), loss=healthy)
    monitor = Monitor.from_specs(uri, trainer.run_id, SPECS)
    assert monitor.poll(0.0) == []
    trainer.steps(range(50, 95), loss=lambda s: NAN if s == 90 else healthy(s))
    # The old branch hits NaN at 90; before the monitor polls, the run is rolled back to 60 and goes on.
    trainer.steps(range(61, 80), loss=lambda s: NAN if s == 75 else healthy(s))
    events = monitor.poll(1.0)
    assert [(e.type, e.metric, e.onset_step) for e in events] == [("non_finite", "loss", 75)]
    assert monitor.poll(2.0) == []
    trainer.log(80, loss=healthy(80) * 50)
    assert [(e.type, e.onset_step) for e in monitor.poll(3.0)] == [("spike", 80)]
    assert monitor.points_seen == 50 + 45 + 19 + 1
    monitor.close()


def test_monitor_can_attach_without_reporting_history(mlflow_sqlite_uri):
    trainer = Trainer(mlflow_sqlite_uri)
    trainer.steps(range(30), loss=lambda s: NAN if s == 20 else healthy(s))
    monitor = Monitor.from_specs(mlflow_sqlite_uri, trainer.run_id, SPECS, report_history=False)
    assert monitor.poll(0.0) == []
    trainer.steps(range(30, 40), loss=lambda s: NAN if s == 35 else healthy(s))
    assert [(e.type, e.onset_step) for e in monitor.poll(1.0)] == [("non_finite", 35)]


class Flaky:
    """A real store reader that fails the next `failures` page reads, as a tracking outage does."""

    def __init__(self, inner):
        self.inner, self.failures, self.reads = inner, 0, 0

    def page(self, metric, offset, limit):
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise MetricsUnavailable("connection refused")
        return self.inner.page(metric, offset, limit)

    def close(self):
        self.inner.close()


def test_an_outage_is_retried_never_an_event_and_loses_no_points(mlflow_sqlite_uri):
    trainer = Trainer(mlflow_sqlite_uri)
    trainer.steps(range(20), loss=healthy, grad_norm=lambda s: 1.0)
    source = Flaky(StoreHistory(mlflow_sqlite_uri, trainer.run_id))
    waits: list[float] = []
    watcher = MetricWatcher(
        mlflow_sqlite_uri, trainer.run_id, ["grad_norm", "loss"], source=source, sleep=waits.append
    )
    monitor = Monitor(watcher, DetectorSet(build_detectors([*SPECS, {"type": "hang", "seconds": 600}])))
    assert monitor.poll(0.0) == [] and monitor.points_seen == 40
    source.failures = 2  # two failed reads, the third attempt succeeds
    trainer.log(20, loss=healthy(20), grad_norm=1.0)
    assert monitor.poll(10.0) == [] and monitor.available and monitor.points_seen == 42
    assert waits == [0.1, 0.2]
    source.failures = 10**9  # down for good: each poll gives up after 3 attempts
    trainer.steps(range(21, 30), loss=lambda s: NAN if s == 25 else healthy(s), grad_norm=lambda s: 1.0)
    for now in (20.0, 300.0, 600.0):
        assert monitor.poll(now) == []
    assert not monitor.available and "connection refused" in monitor.last_error
    source.failures = 0
    events = monitor.poll(609.0)
    assert [(e.type, e.onset_step) for e in events] == [("non_finite", 25)]  # picked up after the outage
    assert monitor.available and monitor.points_seen == 60


def test_an_outage_longer_than_hang_seconds_is_a_hang_only(mlflow_sqlite_uri):
    trainer = Trainer(mlflow_sqlite_uri)
    trainer.steps(range(5), loss=healthy)
    source = Flaky(StoreHistory(mlflow_sqlite_uri, trainer.run_id))
    watcher = MetricWatcher(mlflow_sqlite_uri, trainer.run_id, ["loss"], source=source, sleep=lambda s: None)
    monitor = Monitor(watcher, DetectorSet(build_detectors([{"type": "hang", "seconds": 600}])))
    assert monitor.poll(0.0) == []
    source.failures = 10**9
    assert monitor.poll(600.0) == []
    assert [(e.type, e.onset_step) for e in monitor.poll(601.0)] == [("hang", 4)]


def test_heartbeats_tell_slow_from_stuck(mlflow_sqlite_uri, tmp_path):
    trainer = Trainer(mlflow_sqlite_uri)
    trainer.steps(range(3), loss=healthy)
    beat_file = tmp_path / "hb" / "heartbeat.json"
    monitor = Monitor.from_specs(
        mlflow_sqlite_uri, trainer.run_id, [{"type": "hang", "seconds": 60}], heartbeat_path=beat_file
    )
    writer = HeartbeatWriter(beat_file)
    assert monitor.watcher.metrics == ["loss"]
    assert monitor.poll(0.0) == []
    writer.beat(3, "checkpoint")  # a long save starts; no points for a while
    assert monitor.poll(30.0) == []
    assert monitor.poll(200.0) == []  # 170 s into a save is slow, not stuck (grace 3 x 60 s)
    (event,) = monitor.poll(211.0)
    assert (event.type, event.onset_step, event.evidence["phase"]) == ("hang", 3, "checkpoint")
    writer.beat(4, "train")
    assert monitor.poll(220.0) == [] and monitor.poll(280.0) == []
    assert [e.type for e in monitor.poll(280.5)] == ["hang"]
    assert list(beat_file.parent.iterdir()) == [beat_file]  # atomic writes leave no temp files


def test_run_loop_hands_events_to_the_callback_and_stops(mlflow_sqlite_uri):
    trainer = Trainer(mlflow_sqlite_uri)
    monitor = Monitor.from_specs(mlflow_sqlite_uri, trainer.run_id, SPECS)
    stop, got = threading.Event(), []

    def on_event(event):
        got.append(event)
        stop.set()

    thread = threading.Thread(target=monitor.run, args=(stop, on_event), kwargs={"poll_seconds": 0.05})
    thread.start()
    trainer.steps(range(5), loss=lambda s: NAN if s == 4 else healthy(s))
    thread.join(30)
    assert not thread.is_alive() and [(e.type, e.onset_step) for e in got] == [("non_finite", 4)]


def test_unsupported_tracking_uri_is_a_user_error():
    with pytest.raises(MetricsSourceError, match="expected http"):
        MetricWatcher("file:///tmp/mlruns", "abc", ["loss"])


@pytest.mark.e2e
def test_http_errors_that_retrying_cannot_fix_are_raised(mlflow_server):
    watcher = MetricWatcher(mlflow_server.url + "/no-such-prefix", "abc", ["loss"])
    with pytest.raises(MetricsSourceError, match="expected HTTP 200, got 404"):
        watcher.poll()


def wait_for(condition, timeout: float, step: float = 0.1) -> bool:
    """Wait on a condition the code under test exposes no event for (a server's availability)."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        pause.wait(step)
    return True


OUTAGE_SECONDS = 6.0  # 3x the trainer's request timeout below


@pytest.mark.slow
@pytest.mark.e2e
def test_server_killed_for_6_s_mid_run_raises_nothing_and_loses_nothing(mlflow_server, monkeypatch):
    # The outage only has to outlast what the clients give a request: the trainer's 2 s timeout with no
    # retries (so its points queue up), and enough of the monitor's 0.5 s polls to see it unavailable.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    trainer = Trainer(mlflow_server.url)
    specs = [
        *SPECS,
        {"type": "hang", "seconds": 600},
        {"type": "threshold", "metric": "loss", "above": 100.0},
    ]
    monitor = Monitor.from_specs(mlflow_server.url, trainer.run_id, specs)
    events, outage_seen = [], threading.Event()
    stop_monitor, stop_training, final_logged = threading.Event(), threading.Event(), threading.Event()
    sent = [0]

    def on_event(event):
        events.append(event)

    def watch():
        while not stop_monitor.is_set():
            for event in monitor.poll(time.monotonic()):
                on_event(event)
            if not monitor.available:
                outage_seen.set()
            stop_monitor.wait(0.5)

    def train():
        # Like a retrying logger: points that cannot be sent stay queued until the server is back.
        backlog, step = [], 0
        while not stop_training.is_set() or backlog:
            if not stop_training.is_set():
                value = 1000.0 if final_logged.is_set() else healthy(step)
                backlog.append(Metric("loss", value, int(time.time() * 1000), step))
                step += 1
                if final_logged.is_set():
                    stop_training.set()
            try:
                trainer.client.log_batch(trainer.run_id, metrics=backlog[:500])
                sent[0] += len(backlog[:500])
                del backlog[:500]
            except Exception:
                pass
            stop_training.wait(0.05)

    threads = [threading.Thread(target=watch), threading.Thread(target=train)]
    for thread in threads:
        thread.start()
    try:
        assert wait_for(lambda: monitor.points_seen >= 40, 60)
        mlflow_server.stop()
        down_at = time.monotonic()
        assert outage_seen.wait(30)
        threading.Event().wait(max(0.0, OUTAGE_SECONDS - (time.monotonic() - down_at)))
        mlflow_server.start()
        assert wait_for(lambda: monitor.available and monitor.points_seen >= sent[0] > 40, 120)
        assert events == []
        final_logged.set()
        assert wait_for(lambda: events, 60)
    finally:
        stop_training.set()
        final_logged.set()
        threads[1].join(60)
        stop_monitor.set()
        threads[0].join(60)
        if mlflow_server.proc is None:
            mlflow_server.start()
    # The one bad point logged at the end is the only anomaly: a spike and a threshold breach.
    assert sorted((e.type, e.metric, e.onset_step) for e in events) == [
        ("spike", "loss", sent[0] - 1),
        ("threshold", "loss", sent[0] - 1),
    ]
    assert monitor.points_seen == sent[0]
