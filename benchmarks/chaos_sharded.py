"""`bench chaos --sharded`: SIGKILL one rank of a 2-rank FSDP2 run during sharded saves; count mixed or partial restores.

Each round starts 2 ranks (benchmarks/chaos_sharded_child.py, forked from one zygote; gloo on 127.0.0.1, a free
port) on one store. They resume from its latest checkpoint, then train a step, record the gathered reference
of that step, and save it through `ShardedCheckpoints`, over and over. One rank dies of a real SIGKILL:

- a *phase* round kills rank 0 or 1 at one phase of `dcp_writer.PHASES` of its 1st or 2nd save, round-robin
  over every phase x rank (a rank-0-only phase with rank 1 as the victim: rank 0's hook kills rank 1 there and
  waits for its death before going on);
- a *timed* round kills a random rank a random time after both ranks are ready, wherever it is (training, the
  gather, any phase of a save).

The survivor must exit by itself within the collective timeout (RankLost or a failed collective), never hang.
Then a new process opens the store, restores `latest` at world 1 and checks: it is the last checkpoint
committed before the kill ("old") or the one being saved ("new"), never anything else ("mixed"); its state
equals that step's gathered reference bit for bit (else "partial"); `.tmp` is empty and no blob is orphaned
after the open; every remaining commit passes `verify` (full). The next round's resume (a restore at world 2)
is also compared with the reference of the checkpoint it resumed from.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import BenchRunError, ForkServer, child_env, free_port, machine
from supervisor.checkpoint.dcp_writer import PHASES

#: Phases only the coordinating rank (0) reaches; the other two are reached by every rank.
RANK0_PHASES = ("plan", "finish", "before_marker", "committed")
#: Every third round kills on a timer; the others at a phase, in turn.
TIMED_EVERY = 3
#: How long the ranks may take to be ready; how long the survivor may take to exit after the kill, beyond the
#: collective timeout (a dead peer resets gloo's connection at once; the timeout is for a hung one).
START_TIMEOUT_S = 120.0
EXIT_MARGIN_S = 5.0


class Zygote(ForkServer[list[str]]):
    """The forking child process (benchmarks/chaos_sharded_child.py) and the pipe its ranks write markers to."""

    def __init__(self, env: dict[str, str], log: Path):
        super().__init__("benchmarks.chaos_sharded_child", env, log, "the sharded chaos child process")

    def parse(self, arrived: float, line: str) -> list[str]:
        """[rank, what, step, time, ...]."""
        return line.split(" ", 5)


def kill_plan(rounds: int, rng: random.Random) -> list[dict[str, Any]]:
    """Each round's kill: phase x victim in turn, every `TIMED_EVERY`-th round on a timer with a random victim.

    The first 6 phase rounds take every phase once, the victims alternating; the next 6 the other victim: a
    short run already covers every phase and both ranks, and 18 rounds cover every pair."""
    pairs = [(p, i % 2) for i, p in enumerate(PHASES)] + [(p, 1 - i % 2) for i, p in enumerate(PHASES)]
    out: list[dict[str, Any]] = []
    turn = 0
    for index in range(rounds):
        if index % TIMED_EVERY == TIMED_EVERY - 1:
            out.append({"mode": "timed", "victim": rng.choice((0, 1)), "fraction": rng.random()})
        else:
            phase, victim = pairs[turn % len(pairs)]
            turn += 1
            out.append({"mode": "phase", "victim": victim, "phase": phase, "save": rng.choice((1, 2))})
    return out


class Round:
    """What one round's ranks announced, and what it means for `latest`."""

    def __init__(self, index: int, plan: dict[str, Any]):
        self.index, self.plan = index, plan
        self.markers: list[list[str]] = []

    def of(self, what: str, rank: int | None = None) -> list[list[str]]:
        return [m for m in self.markers if m[1] == what and (rank is None or int(m[0]) == rank)]

    def saved(self) -> dict[int, str]:
        """step -> id of every save some rank saw return (committed: its result came back from rank 0)."""
        return {int(m[2]): m[4] for m in self.of("saved")}

    def in_flight(self) -> int | None:
        """The step of the save rank 0 had begun and no rank saw return when the victim died. Rank 0 commits,
        and writes the step's reference before it begins: a save only rank 1 had begun cannot commit."""
        begun = [int(m[2]) for m in self.of("save", 0)]
        done = self.saved()
        pending = [s for s in begun if s not in done]
        return max(pending) if pending else None

    def where(self, victim: int) -> str:
        """Where the victim was at its death: its last marker (a phase by name)."""
        own = [m for m in self.markers if int(m[0]) == victim and m[1] not in ("kill", "error")]
        if not own:
            return "start"
        last = own[-1]
        return f"phase:{last[4]}" if last[1] == "phase" else last[1]


def run(
    scratch: Path,
    kills: int,
    *,
    timeout_s: float = 5.0,
    seed: int = 20261125,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Run `kills` rounds against one store in `scratch`; returns the counts as a JSON-able dict."""
    started = time.monotonic()
    rng = random.Random(seed)
    store = scratch / "store"
    plans = kill_plan(kills, rng)
    zygote = Zygote(child_env(OMP_NUM_THREADS="1"), scratch / "children.log")
    committed: dict[str, str] = {}  # checkpoint id -> its reference (path without suffix)
    last: dict[str, Any] | None = None  # the newest commit known: {"id", "step", "ref"}
    cycle_s: list[float] = []  # one train + gather + save, for the timed rounds' delays
    log: list[dict[str, Any]] = []
    tally = _Tally(timeout_s)
    try:
        for index, plan in enumerate(plans):
            t0 = time.monotonic()
            rnd = Round(index, plan)
            refs = scratch / "refs" / f"r{index:03d}"
            refs.mkdir(parents=True)
            entry = _one_round(zygote, rnd, store, refs, timeout_s, cycle_s)
            new_step = rnd.in_flight()
            for step, cid in sorted(rnd.saved().items()):
                committed[cid] = str(refs / f"s{step}")
                last = {"id": cid, "step": step, "ref": committed[cid]}
            check = _check(zygote, scratch, store, refs, last, new_step, rnd, committed)
            entry.update(tally.add(rnd, entry, check, last, new_step))
            if entry["latest"] == "new":
                cid = check["id"]
                committed[cid] = str(refs / f"s{new_step}")
                last = {"id": cid, "step": new_step, "ref": committed[cid]}
            entry["round_s"] = round(time.monotonic() - t0, 3)
            tally.round_s.append(entry["round_s"])
            log.append(entry)
            if (index + 1) % 10 == 0 or index + 1 == kills:
                say(f"chaos --sharded: {index + 1}/{kills} kills, {tally.bad()} bad so far")
    finally:
        zygote.close()
    result = tally.summary()
    result.update(
        benchmark="chaos-sharded",
        kills=kills,
        world_size=2,
        collective_timeout_s=timeout_s,
        seed=seed,
        method=(
            "one store; each round, 2 FSDP2 ranks (gloo) resume from latest, then train, gather a reference and "
            "save through ShardedCheckpoints until one rank is SIGKILLed: at a phase_hook phase of its 1st or "
            "2nd save (every phase x rank in turn), or every third round at a random time; the survivor must "
            "exit by itself; a new process then restores latest at world 1 and checks it against the last "
            "commit before the kill or the save in flight, bit for bit, plus .tmp, orphans and verify"
        ),
        wall_s=round(time.monotonic() - started, 1),
        machine=machine(),
        round_log=log,
    )
    return result


def _one_round(
    zygote: Zygote,
    rnd: Round,
    store: Path,
    refs: Path,
    timeout_s: float,
    cycle_s: list[float],
) -> dict[str, Any]:
    """Start both ranks, let one die (at its phase, or on a timer here), and wait for the survivor to exit."""
    plan = rnd.plan
    timed = plan["mode"] == "timed"
    cmd = {
        "op": "rank",
        "port": free_port(),
        "store": str(store),
        "refs": str(refs),
        "timeout_s": timeout_s,
        "marker_fd": zygote.write_fd,
        "max_saves": 1000 if timed else plan["save"] + 1,
        "kill": None if timed else {k: plan[k] for k in ("victim", "phase", "save")},
    }
    pids = [zygote.ask({**cmd, "rank": r})["pid"] for r in (0, 1)]
    victim = plan["victim"]
    killed_at: float | None = None
    if timed:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(rnd.of("ready")) < 2:
            if time.monotonic() > deadline:
                break  # reaped below, reported as a failure to start
            rnd.markers += zygote.markers(0.5)
        if len(rnd.of("ready")) == 2:
            delay = plan["fraction"] * 3 * (statistics.median(cycle_s) if cycle_s else 0.2)
            ready_at = max(float(m[3]) for m in rnd.of("ready"))
            time.sleep(max(0.0, ready_at + delay - time.monotonic()))
            killed_at = time.monotonic()
            os.kill(pids[victim], signal.SIGKILL)
    exits = zygote.ask({"op": "reap", "pids": pids, "timeout": START_TIMEOUT_S + timeout_s})["exits"]
    hung = [pid for pid in pids if exits[str(pid)] is None]
    for pid in hung:  # counted as a failure: the survivor must leave by itself
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if hung:
        exits.update(zygote.ask({"op": "reap", "pids": hung, "timeout": 30})["exits"])
    rnd.markers += zygote.drain()
    if killed_at is None and rnd.of("kill"):
        killed_at = float(rnd.of("kill")[0][3])
    trains = sorted(float(m[3]) for m in rnd.of("train", 0))
    cycle_s += [b - a for a, b in itertools.pairwise(trains)]
    survivor = 1 - victim
    v_status = exits[str(pids[victim])]
    s_exit = exits[str(pids[survivor])]
    errors = rnd.of("error", survivor)
    return {
        "round": rnd.index,
        **plan,
        "victim_sigkilled": v_status is not None
        and os.WIFSIGNALED(v_status[0])
        and os.WTERMSIG(v_status[0]) == signal.SIGKILL,
        "killed_in": rnd.where(victim),
        "survivor": {
            "hung": pids[survivor] in hung,
            "exit_code": os.waitstatus_to_exitcode(s_exit[0]) if s_exit else None,
            "error": errors[0][4] if errors else None,
            "message": errors[0][5][:300] if errors and len(errors[0]) > 5 else None,
            "exit_after_kill_s": round(s_exit[1] - killed_at, 3)
            if s_exit and killed_at is not None and pids[survivor] not in hung
            else None,
        },
    }


def _check(
    zygote: Zygote,
    scratch: Path,
    store: Path,
    refs: Path,
    last: dict[str, Any] | None,
    new_step: int | None,
    rnd: Round,
    committed: dict[str, str],
) -> dict[str, Any]:
    out = scratch / "check.json"
    out.unlink(missing_ok=True)
    candidates = {}
    if last is not None:
        candidates["old"] = last["ref"]
    if new_step is not None:
        candidates["new"] = str(refs / f"s{new_step}")
    same = {}
    resumed = [m for m in rnd.of("resumed", 0) if m[4] != "none"]
    if resumed:
        cid = resumed[0][4]
        if cid in committed:
            same["resume"] = [str(refs / "resume"), committed[cid]]
    pid = zygote.ask({"op": "check", "store": str(store), "out": str(out), "refs": candidates, "same": same})[
        "pid"
    ]
    status = zygote.ask({"op": "reap", "pids": [pid], "timeout": START_TIMEOUT_S})["exits"][str(pid)]
    if status is None or status[0] != 0 or not out.exists():
        raise BenchRunError(f"round {rnd.index}: the checking process failed ({status}); see children.log")
    found = json.loads(out.read_text())
    found["resumed_from"] = resumed[0][4] if resumed else None
    found["resume_known"] = bool(same) or not resumed
    return found


class _Tally:
    """The counts the JSON reports."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.by_phase: dict[str, Counter[str]] = {}
        self.latest: Counter[str] = Counter()
        self.problems: list[str] = []
        self.kinds: Counter[str] = Counter()
        self.survivor_errors: Counter[str] = Counter()
        self.exit_after_kill_s: list[float] = []
        self.restore_s: list[float] = []
        self.round_s: list[float] = []

    def _bad(self, kind: str, where: str, what: str) -> None:
        self.kinds[kind] += 1
        self.problems.append(f"{where}: {kind}: {what}")

    def add(
        self,
        rnd: Round,
        entry: dict[str, Any],
        check: dict[str, Any],
        last: dict[str, Any] | None,
        new_step: int | None,
    ) -> dict[str, Any]:
        where = f"round {rnd.index} ({entry['mode']} kill of rank {entry['victim']} in {entry['killed_in']})"
        key = f"{entry['phase']}@rank{entry['victim']}" if entry["mode"] == "phase" else "timed"
        self.by_phase.setdefault(key, Counter())["kills"] += 1
        if "failed" in check:  # the checking process itself raised: nothing it checked can be trusted
            self._bad("check_failed", where, f"{check['failed']}\n{check['traceback'][-2000:]}")
            self.latest["error"] += 1
            self.by_phase[key]["error"] += 1
            return {"latest": "error", "latest_id": None, "committed_before_kill": last and last["id"]}
        if not entry["victim_sigkilled"]:
            self._bad("not_killed", where, "the victim was not SIGKILLed (the round never reached its kill)")
        survivor = entry["survivor"]
        if survivor["hung"]:
            self._bad("hung", where, "the survivor did not exit by itself")
        elif survivor["exit_code"] == 0:
            self._bad("survivor_exit_0", where, "the survivor exited 0 as if nothing happened")
        elif (after := survivor["exit_after_kill_s"]) is not None and after > self.timeout_s + EXIT_MARGIN_S:
            self._bad("slow_exit", where, f"the survivor exited {after:.1f} s after the kill")
        self.survivor_errors[survivor["error"] or "none"] += 1
        if survivor["exit_after_kill_s"] is not None:
            self.exit_after_kill_s.append(survivor["exit_after_kill_s"])
        # Which checkpoint came back.
        old_id = last["id"] if last else None
        latest = "none"
        if check["error"] is not None:
            self._bad("partial", where, f"restore failed: {check['error']}")
            latest = "error"
        elif check["id"] is None:
            if old_id is not None:
                self._bad("partial", where, f"no checkpoint restored; {old_id} was committed")
        elif check["id"] == old_id:
            latest = "old"
        elif new_step is not None and check["step"] == new_step:
            latest = "new"
        else:
            latest = "mixed"
            self._bad(
                "mixed", where, f"latest {check['id']}: neither {old_id} nor the save of step {new_step}"
            )
        if latest in ("old", "new"):
            diff = check["differences"].get(latest, ["no reference"])
            if diff:
                self._bad("partial", where, f"{check['id']} ({latest}) differs: {', '.join(diff[:5])}")
        if check["differences"].get("resume"):
            self._bad(
                "resume", where, f"resume from {check['resumed_from']}: {check['differences']['resume'][:5]}"
            )
        if not check["resume_known"]:
            self._bad("mixed", where, f"resumed from {check['resumed_from']}, never known committed")
        if check["tmp_left"]:
            self._bad("tmp_left", where, f".tmp holds {check['tmp_left']} after open")
        if check["orphan_blobs"]:
            self._bad("orphan_blobs", where, f"unreferenced blobs after open: {check['orphan_blobs']}")
        for cid, reason in check["invalid"].items():
            self._bad("verify", where, f"{cid}: {reason}")
        self.latest[latest] += 1
        self.by_phase[key][latest] += 1
        self.restore_s.append(check["restore_s"])
        return {
            "latest": latest,
            "latest_id": check["id"],
            "committed_before_kill": old_id,
            "saving_step": new_step,
            "commits_after": len(check["commits"]),
        }

    def bad(self) -> int:
        return sum(self.kinds.values())

    def summary(self) -> dict[str, Any]:
        phase_pairs = [f"{p}@rank{v}" for p in PHASES for v in (0, 1)]
        bad = self.bad()
        return {
            "by_phase": {k: dict(self.by_phase[k]) for k in phase_pairs + ["timed"] if k in self.by_phase},
            "phases_uncovered": [k for k in phase_pairs if k not in self.by_phase],
            "latest": {k: self.latest.get(k, 0) for k in ("old", "new", "none", "mixed", "error")},
            "mixed_restores": self.kinds.get("mixed", 0),
            "partial_restores": self.kinds.get("partial", 0),
            "survivor_hung": self.kinds.get("hung", 0),
            "survivor_slow_exit": self.kinds.get("slow_exit", 0),
            "tmp_left_after_open": self.kinds.get("tmp_left", 0),
            "orphan_blobs_after_open": self.kinds.get("orphan_blobs", 0),
            "verify_failures": self.kinds.get("verify", 0),
            "check_failures": self.kinds.get("check_failed", 0),
            "resume_mismatches": self.kinds.get("resume", 0),
            "bad": bad,
            "target": {"value": bad, "target": 0, "met": bad == 0},
            "survivor_errors": dict(self.survivor_errors),
            "survivor_exit_after_kill_s": _stats(self.exit_after_kill_s),
            "restore_check_s": _stats(self.restore_s),
            "round_s": _stats(self.round_s),
            "problems": self.problems[:50],
        }


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}
