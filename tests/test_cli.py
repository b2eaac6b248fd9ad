"""The console script installs and answers --help and --version."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from supervisor import __version__
from supervisor.cli import main

EXE = Path(sys.executable).with_name("rollback-supervisor")


def test_console_script_help_and_version():
    exe = str(EXE) if EXE.exists() else shutil.which("rollback-supervisor")
    assert exe, "console script rollback-supervisor is not installed in this environment"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Usage: rollback-supervisor" in out.stdout
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"rollback-supervisor {__version__}"


def test_unknown_command_is_a_usage_error(capsys):
    assert main(["no-such-command"]) == 2
    assert "No such command" in capsys.readouterr().err
