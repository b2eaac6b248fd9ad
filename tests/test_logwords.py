"""Log lines in words (issue 19): a real `rollback-supervisor run` logs what happens in sentences, never a
dataclass repr, and other libraries' INFO lines (MLflow's table creation, httpx, Prefect) only with --verbose."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.commands.logs import OursOrWarnings
from tests.test_progress import SLOW_TRAIN
from tests.test_status_real_run import POLICY

CLI = Path(sys.executable).with_name("rollback-supervisor")
#: `Name(field=...`: how a dataclass or pydantic object prints itself.
REPR = re.compile(r"\b[A-Z][A-Za-z]+\([a-z_]+=")
PROGRESS = re.compile(
    r"progress: seg \d+ · step \d+/90 · loss \S+ · [0-9.]+ steps/s · \d+s left · ckpt @\d+ \d+s ago · "
    r"\d+ events?, \d+ decisions?"
)
THIRD_PARTY_INFO = re.compile(
    r"INFO mlflow|\bhttpx:|\balembic\b|prefect\.(flow|task)_runs:|Creating initial MLflow"
)


def _run(
    tmp_path: Path, name: str, *extra: str, faults: str = "", steps: int = 60, env_extra: dict | None = None
) -> str:
    (tmp_path / "policy.yaml").write_text(POLICY)
    (tmp_path / "train.py").write_text(SLOW_TRAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_LOGGING_LEVEL", "MLFLOW_LOGGING_LEVEL")}
    env["ROLLBACK_SUPERVISOR_FAULTS"] = faults
    env.update(env_extra or {})
    argv = [str(CLI), "run", *extra, "--policy", str(tmp_path / "policy.yaml"), "--lineage", name]
    argv += ["--workdir", str(tmp_path / name), "--stop-grace", "10", "--"]
    proc = subprocess.run(
        [*argv, sys.executable, str(tmp_path / "train.py"), "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.e2e
@pytest.mark.slow
def test_a_supervised_run_logs_in_words_and_hides_third_party_info_unless_verbose(tmp_path):
    quiet = _run(tmp_path, "quiet", "--progress-every", "0.5", faults="kill@47", steps=90)
    assert not REPR.search(quiet), REPR.search(quiet)
    assert not THIRD_PARTY_INFO.search(quiet), THIRD_PARTY_INFO.search(quiet)
    assert "segment 0 starts from the newest valid checkpoint (skip 0, lr ×1.0)" in quiet
    assert "segment 1 starts from checkpoint 0000000040-000004 (skip 0, lr ×1.0)" in quiet
    assert "decision: rules[1] (preemption, unknown_exit -> resume): unknown_exit" in quiet
    # Off a terminal, the progress line is a log line every --progress-every seconds, with no escape codes.
    progress = [line for line in quiet.splitlines() if "rollback_supervisor.progress: progress: " in line]
    assert any(PROGRESS.search(line) for line in progress), quiet[-3000:]
    assert "\x1b[" not in quiet

    # MLflow creates this store's tables itself (no seeded copy), so it has an INFO line to show.
    no_seed = {"ROLLBACK_CACHE_DIR": ""}
    verbose = _run(tmp_path, "verbose", "--verbose", "--progress-every", "0", steps=20, env_extra=no_seed)
    assert "INFO mlflow.store.db.utils: Creating initial MLflow database tables" in verbose
    assert re.search(r"httpx: HTTP Request: POST http://127\.0\.0\.1:\d+/api/flow_runs/", verbose)
    assert "segment 0 starts from the newest valid checkpoint" in verbose
    assert not REPR.search(verbose), REPR.search(verbose)


def test_the_filter_passes_our_info_and_only_others_warnings():
    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, "m", None, None)

    keep = OursOrWarnings().filter
    assert keep(record("rollback_supervisor.orchestrator", logging.INFO))
    assert keep(record("rollback_supervisor", logging.DEBUG))
    assert not keep(record("mlflow.store.db.utils", logging.INFO))
    assert not keep(record("rollback_supervisorx", logging.INFO))  # a prefix of a word is not ours
    assert keep(record("httpx", logging.WARNING))
