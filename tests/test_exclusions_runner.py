"""LineageRunner with a launcher that places segments on hosts: a hardware fault excludes the host it ran on
from the next launch (its LaunchSpec), and a fault on the last host left keeps it. Real short processes."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from supervisor.launcher import ExitInfo, LaunchSpec, LocalLauncher
from supervisor.lineage.exclusions import HostPool
from supervisor.orchestrator import LineageRunner, Outcome, RunOptions
from tests.test_runner_supervise import SCRATCH

#: A segment whose GPU falls off the bus: the drill's Xid line on stderr, exit 1.
XID = "import sys; print('NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.', file=sys.stderr); sys.exit(1)"  # noqa: E501


class PlacedLauncher(LocalLauncher):
    """Local processes reported as placed on hosts n1, n2, ... of a two-host pool (a scheduler's view of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[LaunchSpec] = []

    def host_pool(self) -> HostPool:
        return HostPool(1, ("n1", "n2"), "two test hosts")

    def start(self, spec: LaunchSpec, on_line: Any = None) -> Any:
        self.specs.append(spec)
        return _Placed(super().start(spec, on_line), f"n{len(self.specs)}")


class _Placed:
    def __init__(self, inner: Any, host: str):
        self.inner, self.host = inner, host

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def wait(self, timeout: float | None = None) -> ExitInfo:
        return dataclasses.replace(self.inner.wait(timeout), hosts=(self.host,))


def test_a_faulty_host_is_left_out_of_the_next_launch_and_the_last_host_is_kept(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(SCRATCH)
    launcher = PlacedLauncher()
    options = RunOptions(
        command=(sys.executable, "-c", XID),
        policy_path=str(policy),
        lineage="t",
        workdir=tmp_path,
        stop_grace_seconds=5,
        launcher=launcher,
    )

    def three(decision, record) -> Outcome | None:
        return Outcome("stopped", "three segments") if len(record.segments) == 3 else None

    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_decision=three)
    assert [s.event["type"] for s in record.segments] == ["hardware_fault"] * 3
    assert [s.hosts for s in record.segments] == [["n1"], ["n2"], ["n3"]]
    assert [spec.exclude_hosts for spec in launcher.specs] == [(), ("n1",), ("n1",)]
    on_disk = json.loads((tmp_path / "lineages" / "t" / "lineage.json").read_text())
    assert [(e["host"], e["segment"], e["event"]) for e in on_disk["excluded_hosts"]] == [
        ("n1", 0, "hardware_fault")
    ]
    kept = [(e["host"], e["segment"], e["reason"]) for e in on_disk["not_excluded"]]
    assert kept == [
        ("n2", 1, "not excluded: excluding n2 would leave 0 of the 2 host(s) this launcher can use, and a segment "
         "needs 1; two test hosts"),
        ("n3", 2, "not excluded: n3 is not a host this launcher places segments on (n1, n2); two test hosts"),
    ]  # fmt: skip
