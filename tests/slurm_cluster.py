"""A private one-node SLURM cluster for the tests, installed when missing (root with apt), started in a temporary
directory on free ports, stopped by PID. A hidden partition `pair` adds a node that never runs (`spare`).

The daemons read their configuration from `SLURM_CONF` (set for the session, so every `sbatch` the tests and
the supervisor run reaches this cluster and nothing in /etc/slurm is touched). `munged` is shared: one already
answering is used as it is; one we start is stopped by us. Measured facts behind the settings: FACTS.md, SLURM.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SBIN = Path("/usr/sbin")
MUNGE_KEY = Path("/etc/munge/munge.key")
#: The hidden partition of `localhost` and `spare`, a node that is always DOWN (see write_conf).
PAIR, SPARE = "pair", "spare"
INSTALL_HINT = (
    "apt-get install -y slurm-wlm munge (as root), or run the tests as root where apt-get is available"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed() -> bool:
    return all(
        shutil.which(name) or (SBIN / name).exists() for name in ("slurmctld", "slurmd", "sbatch", "munged")
    )


def ensure_installed() -> str | None:
    """Install slurm-wlm and munge when missing and we may (root, apt); else why the tests must be skipped."""
    if installed():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"SLURM is not installed: {INSTALL_HINT}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        ["apt-get", "install", "-y", "slurm-wlm", "munge"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0 or not installed():
        return f"installing SLURM failed ({done.stderr.strip()[-300:]}): {INSTALL_HINT}"
    return None


def munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        return (
            cred.returncode == 0
            and subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=5).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class SlurmCluster:
    """One running private cluster: its configuration, its logs, and the daemons we started."""

    base: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def jobcomp(self) -> Path:
        """One line per finished job (JobState, ExitCode), written by jobcomp/filetxt."""
        return self.base / "log" / "jobcomp.txt"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        mem = max(1024, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2**20 - 2048)
        b = self.base
        self.conf.write_text(
            f"""ClusterName=rstest
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it may start again (default 120; 5 is the least SLURM takes)
AuthInfo=cred_expire=5
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool
SlurmctldPidFile={b}/slurmctld.pid
SlurmdPidFile={b}/slurmd.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a pending job (a requeued one once its wait is over) is looked at every second
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=86400
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
KillWait=5
# A node that never runs (no slurmd answers on its port), in a hidden partition only `--partition=pair` uses: a
# pool of 2 where excluding localhost is admitted, and a job that excludes it stays pending. Declared first: while
# a lone node is named localhost, slurmctld finds it under any name, and the next one counts as a duplicate.
NodeName={SPARE} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 RealMemory=1024 State=DOWN Reason=never_runs
NodeName=localhost NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName={PAIR} Nodes=localhost,{SPARE} MaxTime=INFINITE State=UP Hidden=YES OverSubscribe=FORCE:4
"""
        )

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        self.write_conf()
        env = {**os.environ, **self.env}
        if not munge_works():
            if not MUNGE_KEY.exists():
                subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True)
                shutil.chown(MUNGE_KEY, "munge", "munge")
                MUNGE_KEY.chmod(0o400)
            Path("/run/munge").mkdir(exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            self._spawn("munged", [str(SBIN / "munged"), "-F"], env, user="munge", group="munge")
            try:
                self._until(munge_works, timeout, "munged did not answer")
            except RuntimeError:
                if not munge_works():
                    raise
                # Another xdist worker's cluster started munged first; ours lost the socket and exited.
                self.procs.pop("munged").wait()
        self._spawn("slurmctld", [str(SBIN / "slurmctld"), "-D", "-i"], env)
        self._spawn("slurmd", [str(SBIN / "slurmd"), "-D"], env)
        self._until(lambda: self._node_state(env) == "idle", timeout, "the node did not become idle")
        return self

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], **kw) -> None:
        out = open(self.base / "log" / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, **kw)
        out.close()

    def _node_state(self, env: dict[str, str]) -> str:
        done = subprocess.run(  # localhost's, in the default partition (the pair's spare is always down)
            ["sinfo", "-h", "-p", "debug", "-o", "%T"], env=env, capture_output=True, text=True
        )
        return done.stdout.strip()

    def _until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{what}: {name} exited {proc.returncode} (logs in {self.base / 'log'})"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} in {timeout:.0f}s (logs in {self.base / 'log'})")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the daemons we started, by PID, slurmd first."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A running private cluster for the session; `SLURM_CONF` points every SLURM command at it."""
    why = ensure_installed()
    if why is not None:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    old = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
