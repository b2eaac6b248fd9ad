"""Script mode end to end (issue 16, part 3): an unmodified nanoGPT-style script (tests/scripts/train_mlp.py, which
imports nothing of ours) supervised through its output and its own `ckpt.pt`: a real divergence rolled back with
the learning rate scaled through the template, the drill's external faults resumed from the script's own file
bit for bit, SIGTERM passed through, its own MLflow logging joining the lineage's run, and a glob that never
matches reported as a policy mistake."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from policies import load_policy
from supervisor.checkpoint import open_store
from supervisor.checkpoint.manifest import CKPT_PREFIX, STATE
from supervisor.checkpoint.options import parse_id
from supervisor.drill import judge
from supervisor.errors import PolicyError
from supervisor.orchestrator import LineageRunner, RunOptions
from supervisor.report import timeline_rows
from supervisor.runtime.faults import FAULTS_ENV, parse_faults
from supervisor.script import opaque
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = str(REPO / "tests" / "scripts" / "train_mlp.py")
POLICY = REPO / "tests" / "data" / "policies" / "script.yaml"
#: The script's learning rate blows up once the warm-up passes ~0.65 (around iteration 100).
DIVERGING = ["--learning_rate=2.0", "--max_iters=240", "--warmup_iters=300", "--iter_time=0.01"]
STABLE = ["--learning_rate=0.3", "--max_iters=200", "--warmup_iters=100", "--iter_time=0.01"]
#: One thread: this tiny model's steps take 0.3 ms on one and 2-50 ms on two contended cores.
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One work directory (and so one MLflow store, created once) for every lineage of this module."""
    return tmp_path_factory.mktemp("script-mode")


def _options(workdir: Path, lineage: str, args: list[str], policy: Path = POLICY, **kw) -> RunOptions:
    cwd = workdir / lineage
    cwd.mkdir(exist_ok=True)
    return RunOptions(
        command=(sys.executable, SCRIPT, *args),
        policy_path=str(policy),
        lineage=lineage,
        workdir=workdir,
        cwd=str(cwd),
        stop_grace_seconds=5,
        **{"env": THREADS, **kw},
    )


def _stable_policy(tmp_path: Path, keep_last: int = 12) -> Path:
    """The test policy for the stable learning rate: the template's lr is the command's."""
    policy = tmp_path / "script.yaml"
    text = POLICY.read_text().replace("lr: 2.0", "lr: 0.3")
    policy.write_text(text.replace("keep_last: 12", f"keep_last: {keep_last}"))
    return policy


def _supervise(options: RunOptions):
    lines: list[str] = []
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_line=lambda stream, line: lines.append(line))
    return record, lines


def _segment_log(workdir: Path, lineage: str, index: int) -> str:
    return (workdir / "lineages" / lineage / "segments" / f"{index}.log").read_text()


def _resumed_at(log: str) -> int:
    (found,) = re.findall(r"resuming from out/ckpt.pt at iter (\d+)", log)
    return int(found)


def _version_state(workdir: Path, lineage: str, checkpoint_id: str, tmp_path: Path) -> dict:
    """What the script saved in the version `checkpoint_id` (read with weights_only, never unpickled)."""
    manifest = json.loads(
        (workdir / "checkpoints" / lineage / f"ckpt-{checkpoint_id}" / "manifest.json").read_text()
    )
    ref = manifest["tensors"]["out/ckpt.pt"]
    out = tmp_path / f"{checkpoint_id}.pt"
    with open(out, "wb") as f:
        opaque.read_blob(workdir / "checkpoints" / lineage / ref["blob"], ref["key"], f.fileno())
    return torch.load(out, weights_only=True)


def test_a_real_divergence_is_rolled_back_and_relaunched_with_the_lr_scaled(workdir, caplog):
    caplog.set_level("WARNING", logger="rollback_supervisor")
    caplog.set_level("INFO", logger="rollback_supervisor.script")
    record, lines = _supervise(_options(workdir, "diverge", DIVERGING))
    first, second = record.segments
    # Detected from the printed loss, stopped, and decided by the policy engine over the versioned ckpt.pt.
    assert first.event["type"] in ("divergence", "non_finite") and first.outcome == "rollback"
    onset = first.event["onset_step"]
    decision = first.decision
    # The target is the newest healthy version of the first segment labelled at or before onset - lookback (55):
    # not too late, and not any older one either.
    messages = [r.getMessage() for r in caplog.records]
    put_back = next(i for i, m in enumerate(messages) if m.startswith("Put out/ckpt.pt back from checkpoint"))
    versions = [
        (int(m.group(2)), m.group(1))
        for text in messages[:put_back]
        if (m := re.match(r"Versioned out/ckpt.pt as checkpoint (\S+) \(step (\d+),", text))
        and "unhealthy" not in text
    ]
    expected_step, expected_id = max(v for v in versions if v[0] <= onset - 55)
    assert decision["action"] == "rollback"
    assert (decision["target_step"], decision["target_id"]) == (expected_step, expected_id), versions
    # The script resumed from that version, put back in place: the save a label names was written after the
    # line of the step before (a label errs late, never early), so before the next save's (save_interval 10).
    resumed = _resumed_at(_segment_log(workdir, "diverge", 1))
    assert resumed % 10 == 0 and resumed <= expected_step + 1 < resumed + 10
    assert resumed <= onset - 50
    # Relaunched with the template: --learning_rate={lr * lr_scale} = 2.0 x 0.25; the script printed it.
    assert second.extra["command"][2:] == [*DIVERGING, "--init_from=resume", "--learning_rate=0.5"]
    assert "peak learning rate 0.5" in lines
    lrs = [float(m) for m in re.findall(r"iter \d+: loss \S+, lr (\S+)", _segment_log(workdir, "diverge", 1))]
    assert lrs and max(lrs) <= 0.5 * 240 / 300 + 1e-9
    # The rule's skip_batches has no field in the template: said at decision time, not silently dropped.
    assert (
        "unsupported by this script: skip_batches 7: script.relaunch.args has no {skip_batches}"
        in caplog.text
    )
    # ... and the run then finished, recorded as such.
    assert second.outcome == "finished" and second.returncode == 0
    assert (record.status, record.final_reason) == ("finished", "training finished")
    on_disk = json.loads((workdir / "lineages" / "diverge" / "lineage.json").read_text())
    assert on_disk["status"] == "finished"
    assert torch.load(workdir / "diverge" / "out" / "ckpt.pt", weights_only=True)["iter_num"] == 240
    # The printed metrics reached the lineage's MLflow run.
    client = MlflowClient(tracking_uri=record.mlflow.tracking_uri)
    steps = {m.step for m in client.get_metric_history(record.mlflow.run_id, "loss")}
    assert {0, onset, 239} <= steps


def test_the_drills_external_faults_resume_from_the_scripts_own_file_bit_for_bit(workdir, tmp_path):
    spec, policy = "kill@45,term@95,hang@145", _stable_policy(tmp_path, keep_last=40)
    options = _options(workdir, "drill", STABLE, policy, env={**THREADS, FAULTS_ENV: spec})
    # The reference, a run never interrupted, runs alongside the drill (one thread each; both mostly wait).
    alone = tmp_path / "alone"
    alone.mkdir()
    env = {**os.environ, **THREADS}
    reference_run = subprocess.Popen(
        [sys.executable, SCRIPT, *STABLE],
        cwd=alone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        record, _ = _supervise(options)
        reference_out, _ = reference_run.communicate(timeout=300)
    finally:
        if reference_run.poll() is None:
            reference_run.kill()
            reference_run.wait()
    assert reference_run.returncode == 0, reference_out[-3000:]
    # The drill's judge passes each fault: seen as the right event, decided per the policy, recovered from.
    verdicts = judge(parse_faults(spec), timeline_rows(record), load_policy(policy), record.status)
    assert [v.passed for v in verdicts] == [True, True, True], verdicts
    assert [s.outcome for s in record.segments] == ["resume", "resume", "resume", "finished"]
    assert [s.event["type"] for s in record.segments[:3]] == ["unknown_exit", "preemption", "hang"]
    assert [s.returncode for s in record.segments[:2]] == [-signal.SIGKILL, -signal.SIGTERM]
    catalog = open_store(workdir / "checkpoints" / "drill")
    segment_of = {
        info.id: json.loads(catalog.read(f"{CKPT_PREFIX}{info.id}/{STATE}"))["segment"]
        for info in catalog.list()
    }
    for index, seg in enumerate(record.segments[:3]):
        # Each relaunch resumed from the newest version taken up to the fault (the last one of its segment):
        # the script's own latest whole file, not an older one.
        newest = max((cid for cid, s in segment_of.items() if s <= index), key=lambda cid: parse_id(cid)[1])
        assert seg.decision["target_id"] == newest
        resumed = _resumed_at(_segment_log(workdir, "drill", index + 1))
        saved = _version_state(workdir, "drill", newest, tmp_path)
        assert resumed == saved["iter_num"] and resumed % 10 == 0
        assert (
            resumed <= parse_id(newest)[0] + 1 < resumed + 10
        )  # its label: the step printed before the save
        # ... and the script had not got past its next save (save_interval 10) when the fault hit it.
        printed = [
            int(n) for n in re.findall(r"^stdout: iter (\d+):", _segment_log(workdir, "drill", index), re.M)
        ]
        assert resumed <= max(printed) + 1 < resumed + 2 * 10
        assert record.segments[index + 1].extra["command"][-2:] == [
            "--init_from=resume",
            "--learning_rate=0.3",
        ]
    assert record.status == "finished"
    # The script saves all its state, so its resumes are exact: the same weights as a run never interrupted.
    ours = torch.load(workdir / "drill" / "out" / "ckpt.pt", weights_only=True)
    reference = torch.load(alone / "out" / "ckpt.pt", weights_only=True)
    assert ours["iter_num"] == reference["iter_num"] == 200
    for part in ("model", "optimizer"):
        flat_ours, flat_ref = _tensors(ours[part]), _tensors(reference[part])
        assert flat_ours.keys() == flat_ref.keys() and flat_ours
        assert all(torch.equal(flat_ours[k], flat_ref[k]) for k in flat_ref)


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {k: v for key, sub in items for k, v in _tensors(sub, f"{prefix}/{key}").items()}


# The supervisor in its own process, stopped as a spot machine's SIGTERM stops it (what `run` does on SIGTERM).
DRIVER = """
import json, signal, sys
from pathlib import Path
from supervisor.orchestrator import LineageRunner, RunOptions
class Interrupted(Exception):
    pass
def on_term(signum, frame):
    raise Interrupted()
signal.signal(signal.SIGTERM, on_term)
fields = json.loads(sys.argv[1])
options = RunOptions(**{**fields, "command": tuple(fields["command"]), "workdir": Path(sys.argv[2])})
with LineageRunner(options) as runner:
    try:
        runner.supervise(on_line=lambda stream, line: print(line, flush=True))
    except Interrupted:
        sys.exit(143)
"""


def test_sigterm_reaches_the_script_and_the_next_run_resumes_it(workdir, tmp_path):
    options = _options(workdir, "term", STABLE, _stable_policy(tmp_path))
    names = ("command", "policy_path", "lineage", "cwd", "stop_grace_seconds", "env")
    fields = {k: getattr(options, k) for k in names}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(fields), str(workdir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in driver.stdout:
        if line.startswith("iter 60:"):
            break
    driver.send_signal(signal.SIGTERM)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 143, err
    (seg,) = json.loads((workdir / "lineages" / "term" / "lineage.json").read_text())["segments"]
    assert (seg["outcome"], seg["signal_sent"], seg["returncode"]) == (
        "interrupted",
        signal.SIGTERM,
        -signal.SIGTERM,
    )
    record, _ = _supervise(options)  # the next run of the lineage resumes from the script's own file
    assert [s.outcome for s in record.segments] == ["interrupted", "finished"]
    assert _resumed_at(_segment_log(workdir, "term", 1)) >= 50 and record.status == "finished"


MLFLOW_POLICY = """\
version: 1
name: mlflow-script
monitor: {poll_seconds: 0.2, detectors: [{type: non_finite, metrics: [script_loss]}]}
rules:
  - when: [unknown_exit, software_error]
    action: fail
script:
  checkpoints: {glob: 'ckpts/step_*.pt', step_from: name, step_pattern: 'step_(?P<step>\\d+)\\.pt$'}
"""
MLFLOW_SCRIPT = """
import os, mlflow
with mlflow.start_run() as run:  # no arguments: MLFLOW_RUN_ID and MLFLOW_EXPERIMENT_ID say which run
    mlflow.log_metric("script_loss", 1.5, step=3)
    print("run", run.info.run_id, "experiment", run.info.experiment_id, flush=True)
"""


def test_the_scripts_own_mlflow_run_is_the_lineages(workdir, tmp_path):
    policy = tmp_path / "mlflow.yaml"
    policy.write_text(MLFLOW_POLICY)
    (workdir / "own-mlflow").mkdir(exist_ok=True)
    options = RunOptions(
        command=(sys.executable, "-c", MLFLOW_SCRIPT),
        policy_path=str(policy),
        lineage="own-mlflow",
        workdir=workdir,
        cwd=str(workdir / "own-mlflow"),
    )
    record, lines = _supervise(options)
    assert record.status == "finished", lines
    client = MlflowClient(tracking_uri=record.mlflow.tracking_uri)
    run = client.get_run(record.mlflow.run_id)
    assert f"run {run.info.run_id} experiment {run.info.experiment_id}" in lines
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "script_loss")] == [
        (3, 1.5)
    ]


def test_a_glob_that_never_matched_is_a_policy_error_at_decision_time(workdir, tmp_path):
    policy = tmp_path / "script.yaml"
    policy.write_text(POLICY.read_text())
    options = _options(workdir, "no-files", [])
    crash = "import os, signal; print('iter 3: loss 1.0', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    options = RunOptions(
        **{**options.__dict__, "command": (sys.executable, "-c", crash), "policy_path": str(policy)}
    )
    with LineageRunner(options, sleep=lambda s: None) as runner, pytest.raises(PolicyError) as err:
        runner.supervise()
    line = str(err.value)
    at = next(
        i for i, text in enumerate(policy.read_text().splitlines(), 1) if text.strip().startswith("glob:")
    )
    assert line.startswith(
        f"{policy}:{at}:11: script.checkpoints.glob: expected files matching 'out/ckpt.pt' in "
    ), line
    assert "got no file ever matching it" in line and err.value.exit_code == 2
    on_disk = json.loads((workdir / "lineages" / "no-files" / "lineage.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["segments"][0]["event"]["type"] == "unknown_exit"


DRIFT = str(REPO / "tests" / "scripts" / "drift.py")
DRIFT_POLICY = """\
version: 1
name: drift
checkpoint: {keep_last: 20}
monitor:
  poll_seconds: 0.1
  detectors: [{type: divergence, metric: loss, window: 3, factor: 1.5, patience: 2}]
rules:
  - when: [unknown_exit, preemption]
    action: resume
    target: {select: latest}
  - when: [divergence, software_error]
    action: fail
limits: {max_restarts: 3, max_rollbacks: 1, backoff: {initial_seconds: 0.1, jitter: false}}
script:
  output: {patterns: ['iter (?P<step>\\d+): loss (?P<loss>\\S+)']}
  checkpoints: {glob: out/state.json, step_from: output, scan_seconds: 0.03, settle_seconds: 0.01}
  relaunch: {args: --init_from=resume}
"""


def test_detectors_warmed_on_the_branch_so_far_still_fire_after_a_kill(workdir, tmp_path, caplog):
    """The loss bottoms out at 1.0 by iteration 30, then drifts up 1% an iteration; a kill at 60 relaunches the
    script. Warmed on segment 0's points, the divergence detector keeps its best of ~1.0 and fires at ~85 in
    segment 1; started cold it would take its best at the resume (1.2-1.3) and never fire before the end (110)."""
    caplog.set_level("INFO", logger="rollback_supervisor.script")
    policy = tmp_path / "drift.yaml"
    policy.write_text(DRIFT_POLICY)
    (workdir / "drift").mkdir(exist_ok=True)
    options = RunOptions(
        command=(sys.executable, DRIFT),
        policy_path=str(policy),
        lineage="drift",
        workdir=workdir,
        cwd=str(workdir / "drift"),
        env={FAULTS_ENV: "kill@60"},
    )
    record, _ = _supervise(options)
    first, second = record.segments
    assert (first.event["type"], first.outcome) == ("unknown_exit", "resume")
    resumed = int(
        re.findall(r"resuming from out/state.json at iter (\d+)", _segment_log(workdir, "drift", 1))[0]
    )
    assert resumed in (50, 60)
    assert second.event["type"] == "divergence" and (record.status, second.outcome) == ("failed", "fail")
    evidence = second.event["evidence"]
    # The baseline is segment 0's, and the anomaly is segment 1's.
    assert evidence["best_step"] < 40 and evidence["best_mean"] < 1.02
    assert resumed < second.event["onset_step"] < 110
    warmed = [r.getMessage() for r in caplog.records if "detectors warmed on" in r.getMessage()]
    assert warmed == [
        f"detectors warmed on {resumed} points of the surviving branch (steps 0-{resumed - 1}) "
        f"before step {resumed}"
    ]
