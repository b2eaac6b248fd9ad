"""The classifier on torchrun's elastic errors across nodes, from real output captured on this machine
(tests/data/torchrun_elastic/, torch 2.13, two agents `--nnodes=2 --rdzv-backend=c10d` on 127.0.0.1):

- peer-node-killed: node 0's agent after node 1 (agent and rank) was SIGKILLed; its rank's gloo all_reduce
  failed with "Connection reset by peer" and the agent's root cause is that rank's exit 1;
- store-host-killed: node 1's agent after node 0, which hosted the c10d store, was SIGKILLed;
- rendezvous-timeout: one agent of two, `join_timeout=5`: the other node never came;
- rendezvous-closed: an agent joining a rendezvous another agent had closed after its rank failed.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

from supervisor.checkpoint.sharded import RankLost
from supervisor.monitor.classifier import classify_exit

DATA = Path(__file__).resolve().parent / "data" / "torchrun_elastic"


@pytest.mark.parametrize(
    ("name", "expected", "rule"),
    [
        # A peer vanished: not this rank's bug (before these rules its traceback made it a software_error).
        ("peer-node-killed", "unknown_exit", "peer_rank_lost"),
        ("store-host-killed", "hardware_fault", "torchrun_store_lost"),
        ("rendezvous-timeout", "hardware_fault", "torchrun_rendezvous_timeout"),
        ("rendezvous-closed", "unknown_exit", "torchrun_rendezvous_closed"),
    ],
)
def test_real_torchrun_elastic_output(name: str, expected: str, rule: str):
    event = classify_exit(1, (DATA / f"{name}.stderr").read_text())
    assert event is not None
    assert (event.type, event.evidence["rule"]) == (expected, rule), event.evidence
    assert "python_traceback" in event.evidence["matched_rules"]  # outranked, not missed


def test_peer_lost_without_the_elastic_rules_would_read_as_a_software_error():
    """The row that makes the difference: without it the same output is the user's bug (a failing rule)."""
    text = (DATA / "peer-node-killed.stderr").read_text().replace("Connection reset by peer", "boom")
    event = classify_exit(1, text)
    assert event is not None and event.type == "software_error"


def _rank_lost_output() -> str:
    """A rank's RankLost as torchrun prints it: the rank's traceback, each line prefixed with `[rank0]:`."""
    try:
        raise RankLost(
            "commit: a rank of the checkpoint group was lost or timed out ([pair.cc:537] Read error "
            "[127.0.0.1]:424: Connection reset by peer); relaunch"
        )
    except RankLost as exc:
        lines = "".join(traceback.format_exception(exc)).splitlines()
    return "\n".join(f"[rank0]: {line}" for line in lines)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        (_rank_lost_output(), "peer_rank_lost"),
        # gloo's pair.cc when the peer closed its socket cleanly (its process died) instead of a reset
        ("[rank0]: RuntimeError: [pair.cc:598] Connection closed by peer [127.0.0.1]:37291", "peer_rank_lost"),
        # gloo's timeout when a peer hangs instead of dying
        ("RuntimeError: [unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete",
         "peer_rank_lost"),
    ],
)  # fmt: skip
def test_lost_rank_lines(text: str, rule: str):
    event = classify_exit(1, f"Traceback (most recent call last):\n{text}")
    assert event is not None and (event.type, event.evidence["rule"]) == ("unknown_exit", rule)


def test_a_killed_rank_on_one_node_still_names_the_sigkill():
    """Single-node DDP: rank 1 SIGKILLed, rank 0's collective reset; the root cause block (-9) wins."""
    peer = (DATA / "peer-node-killed.stderr").read_text()
    head = peer[: peer.index("Root Cause")]
    text = head + (
        "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -9 (pid: 24945)\n  traceback : Signal 9 (SIGKILL) received by PID 24945\n"
    )
    event = classify_exit(1, text)
    assert event is not None and (event.type, event.evidence["rule"]) == (
        "unknown_exit",
        "torchrun_child_sigkill",
    )
    assert "peer_rank_lost" in event.evidence["matched_rules"]


def test_a_policy_pattern_still_beats_the_elastic_rows():
    event = classify_exit(
        1,
        (DATA / "rendezvous-timeout.stderr").read_text(),
        extra_patterns=[{"type": "preemption", "pattern": r"RendezvousTimeoutError"}],
    )
    assert event is not None and event.type == "preemption"
