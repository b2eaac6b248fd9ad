"""The supervisor recognises an anomaly the training process already handled in process, whatever metric
its own monitor saw it on first (a NaN gradient makes the loss and the grad norm NaN at the same step)."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.events import Event
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.flowkit import FAST_POLICY


def test_an_in_process_report_covers_the_same_anomaly_on_another_metric(tmp_path: Path):
    runner = LineageRunner(
        RunOptions(
            command=("python", "-c", "pass"), policy_path=str(FAST_POLICY), lineage="t", workdir=tmp_path
        )
    )
    runner.open()
    try:
        reported = Event(type="non_finite", reason="loss is nan", metric="loss", onset_step=46, step=46)
        line = {"seq": 1, "handled_in_process": True, "event": reported.to_dict(), "decision": None}
        (runner.layout.local / "events.jsonl").write_text(json.dumps(line) + "\n")

        def seen(kind: str, metric: str, onset: int) -> bool:
            event = Event(type=kind, reason="monitor", metric=metric, onset_step=onset, step=onset)
            return runner._handled_in_process(event, wait_s=0)

        assert seen("non_finite", "grad_norm", 46)  # the same NaN step, seen on the grad norm first
        assert seen("non_finite", "loss", 47)
        assert not seen("non_finite", "grad_norm", 60)  # a later anomaly is a new one
        assert not seen("spike", "loss", 46)
    finally:
        runner.close()
