"""The SLURM launcher's batch script and segment file (pure, run through real bash), and its policy section."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from policies import parse_policy
from supervisor.cli import main
from supervisor.errors import PolicyError, UserError
from supervisor.launcher.base import LaunchSpec
from supervisor.launcher.slurm import SlurmLauncher, launcher_from_policy, slurm_options
from supervisor.launcher.slurm_script import SlurmOptions, batch_script, segment_file

BASE = "version: 1\nname: t\nrules: [{when: [preemption], action: resume}]\n"


def test_the_sbatch_lines_carry_the_options(tmp_path):
    options = SlurmOptions(
        partition="gpu", account="proj", nodes=2, gpus_per_node=4, cpus_per_task=8, time_limit="2:00:00",
        warning_seconds=120, extra_sbatch=("--qos=high",), job_dir=tmp_path,
    )  # fmt: skip
    assert options.sbatch_lines("lin-3") == [
        "--job-name=lin-3",
        f"--output={tmp_path}/%j.out",
        f"--error={tmp_path}/%j.err",
        "--open-mode=append",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--partition=gpu",
        "--account=proj",
        "--time=2:00:00",
        "--gpus-per-node=4",
        "--cpus-per-task=8",
        "--signal=TERM@120",  # to the steps, not "B:" (srun aborts its step on a SIGTERM of its own)
        "--no-requeue",
        "--qos=high",
    ]


def test_defaults_ask_for_nothing_the_cluster_decides(tmp_path):
    lines = SlurmOptions(job_dir=tmp_path, warning_seconds=None, relaunch="requeue").sbatch_lines("x")
    assert not any(
        line.startswith(("--partition", "--account", "--time", "--gpus", "--signal")) for line in lines
    )
    assert "--requeue" in lines


def test_the_segment_file_gives_bash_the_exact_environment_and_command(tmp_path):
    """Quoting survives spaces, quotes, `$` and newlines: bash sources the file and prints what it got."""
    odd = "a b 'c' \"d\" $HOME `x` \\ \n e"
    spec = LaunchSpec(
        ("python", "-u", "train.py", odd), env_overrides={"PLAN": odd, "X": ""}, cwd=str(tmp_path)
    )
    seg = tmp_path / "s.sh"
    seg.write_text(segment_file(spec, spec.command))
    out = subprocess.run(
        ["bash", "-c", f'. {seg}; printf "%s\\0" "$PWD" "$PLAN" "$X" "${{cmd[@]}}"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split("\0")[:-1] == [str(tmp_path), odd, "", "python", "-u", "train.py", odd]


def test_the_batch_script_sources_the_segment_file_and_runs_srun(tmp_path):
    script = batch_script(SlurmOptions(job_dir=tmp_path), "lin-0", tmp_path / "tok.segment.sh")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "#SBATCH --job-name=lin-0" in lines
    assert f". {tmp_path}/tok.segment.sh" in lines
    assert any(
        line.startswith('srun --export=ALL --kill-on-bad-exit=1 --ntasks-per-node=1 -- "${cmd[@]}" &')
        for line in lines
    )
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # it parses


def test_several_processes_per_node_run_under_torchrun(tmp_path):
    launcher = SlurmLauncher(SlurmOptions(nproc_per_node=2, job_dir=tmp_path))
    cmd = launcher.command(("python", "-u", "train.py", "--x"))
    assert cmd[:4] == ("python", "-u", "-m", "torch.distributed.run") and cmd[-2:] == ("train.py", "--x")
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--max-restarts") + 1] == "0"
    assert SlurmLauncher(SlurmOptions(job_dir=tmp_path)).command(("python", "t.py")) == ("python", "t.py")
    with pytest.raises(UserError, match="one node"):
        SlurmOptions(nodes=2, nproc_per_node=2)


def test_the_policy_section_builds_the_launcher(tmp_path):
    policy = parse_policy(
        BASE + "launcher:\n  type: slurm\n  slurm: {partition: gpu, time_limit: 90, relaunch: requeue,"
        " extra_sbatch: [--qos=high], time_limit_event: stop}\n"
    )
    launcher = launcher_from_policy(policy.launcher, tmp_path)
    assert isinstance(launcher, SlurmLauncher)
    o = launcher.options
    assert (o.partition, o.time_limit, o.relaunch, o.extra_sbatch, o.time_limit_event, o.warning_seconds) == (
        "gpu",
        "90",
        "requeue",
        ("--qos=high",),
        "stop",
        60,
    )
    assert o.job_dir == tmp_path / "slurm"
    assert launcher_from_policy(parse_policy(BASE).launcher, tmp_path) is None  # local by default
    own = parse_policy(BASE + "launcher: {type: slurm, slurm: {job_dir: /shared/jobs}}\n").launcher.slurm
    assert slurm_options(own, tmp_path).job_dir == Path("/shared/jobs")


BAD = [
    (
        "launcher: {type: pbs}\n",
        '4:18: launcher.type: expected one of local, torchrun, slurm, kubernetes, got "pbs"',
    ),
    (
        "launcher: {slurm: {nodes: 2}}\n",
        "4:11: launcher.type: expected slurm (a `slurm:` section is given), got",
    ),
    ("launcher: {type: slurm, slurm: {nodes: 0}}\n", "4:40: launcher.slurm.nodes: expected"),
    (
        "launcher: {type: slurm, slurm: {time_limit: 1h}}\n",
        "4:45: launcher.slurm.time_limit: expected minutes",
    ),
    (
        "launcher: {type: slurm, slurm: {time_limit: 0}}\n",
        "4:45: launcher.slurm.time_limit: expected a number",
    ),
    ("launcher: {type: slurm, slurm: {relaunch: again}}\n", "4:43: launcher.slurm.relaunch: expected one of"),
    (
        "launcher: {type: slurm, slurm: {extra_sbatch: [qos]}}\n",
        "4:48: launcher.slurm.extra_sbatch[0]: expected",
    ),
    (
        "launcher: {type: slurm, slurm: {nodes: 2, nproc_per_node: 2}}\n",
        "launcher.slurm.nodes: expected 1 with",
    ),
    ("launcher: {type: slurm, slurm: {partiton: gpu}}\n", "launcher.slurm.partiton"),
]


@pytest.mark.parametrize(("section", "message"), BAD)
def test_a_bad_launcher_section_names_file_line_key_expected_and_found(section, message):
    with pytest.raises(PolicyError) as err:
        parse_policy(BASE + section, "p.yaml")
    assert message in str(err.value) and str(err.value).startswith("p.yaml:"), str(err.value)


def test_run_refuses_a_bad_launcher_section_in_one_line_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text(BASE + BAD[3][0])
    assert main(["run", "--policy", str(bad), "--workdir", str(tmp_path / "w"), "--", "python", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}:4:45: launcher.slurm.time_limit: expected") and err.count("\n") == 1
    assert "Traceback" not in err and not (tmp_path / "w").exists()
