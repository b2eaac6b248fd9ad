"""The decision engine: policy + event + history + checkpoint catalogue -> Decision. Pure: no I/O, no clock."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from policies import selectors
from policies.backoff import relaunch_delay, seed_for
from policies.decision import Decision
from policies.history import History
from policies.records import CheckpointRecord
from policies.schema import Escalation, Limits, Policy, Rule
from supervisor.events import EVENT_TYPES, Event


def decide(
    policy: Policy,
    event: Event,
    history: History,
    catalogue: Sequence[CheckpointRecord],
    *,
    now: float,
    rng_seed: int | None = None,
    in_process: bool = False,
) -> Decision:
    """Decide what to do about `event`; `now` is the caller's clock and `rng_seed` fixes the backoff jitter.

    The history is read, never changed: record the returned decision with `history.record(event, d, now)`.
    A relaunch whose target matches no checkpoint falls back to the newest one the rule may use (`fallback`
    True, the reason says why) unless the target is `strict`; with none at all, `allow_scratch` decides.
    `in_process`: the training process asks and carries out a rollback with a target itself, so that
    decision has no relaunch delay and says so.
    A `warn` rule's decision spends no budget and is never refused for a spent one: training goes on.
    """
    what = describe_event(event)
    if event.type not in EVENT_TYPES:
        return _fail(
            event, None, f"{what}: unknown event type; expected one of {', '.join(EVENT_TYPES)}; failing"
        )
    match = policy.rule_for(event.type)
    if match is None:
        return _fail(
            event, None, f"{what}: no rule handles {event.type} events, so the run fails (add a rule)"
        )
    index, rule = match
    head = f"rules[{index}] ({', '.join(rule.when)} -> {rule.action}): {what}"
    if rule.action == "fail":
        return _fail(event, index, f"{head}; the policy says fail")
    if rule.action == "stop":
        return _stop(policy, event, index, head, catalogue)
    if rule.action == "warn":
        return _warn(policy, event, index, head, history)
    return _relaunch(policy, rule, index, head, event, history, catalogue, now, rng_seed, in_process)


def describe_event(event: Event) -> str:
    """One short phrase for an event: "spike on loss at step 1200 (onset 1180)"."""
    text = event.type + (f" on {event.metric}" if event.metric else "")
    if event.step is not None:
        text += f" at step {event.step}"
    if event.onset_step is not None and event.onset_step != event.step:
        text += f" (onset {event.onset_step})" if event.step is not None else f" from step {event.onset_step}"
    return text


def _fail(event: Event, index: int | None, reason: str) -> Decision:
    return Decision(action="fail", reason=reason, rule_index=index, event=event)


def _stop(
    policy: Policy, event: Event, index: int, head: str, catalogue: Sequence[CheckpointRecord]
) -> Decision:
    keep = policy.checkpoint.keep_best
    catalogue, _ = _usable(policy, catalogue)
    selector = selectors.best(keep.metric, keep.mode) if keep else selectors.latest()
    chosen = selector(catalogue, event) or (selectors.latest()(catalogue, event) if keep else None)
    kept = (
        f"keeping {_describe_record(chosen, keep.metric if keep else None)}"
        if chosen
        else "no valid checkpoint"
    )
    return Decision(
        action="stop",
        target_id=chosen.id if chosen else None,
        target_step=chosen.step if chosen else None,
        reason=f"{head}; stopping the run successfully, {kept}",
        rule_index=index,
        event=event,
    )


def _warn(policy: Policy, event: Event, index: int, head: str, history: History) -> Decision:
    limits = policy.limits
    return Decision(
        action="warn",
        reason=f"{head}; warning only: training goes on (no restore, no stop, no relaunch); budgets untouched: "
        f"{limits.max_rollbacks - history.rollbacks} of {limits.max_rollbacks} rollbacks, "
        f"{limits.max_restarts - history.restarts} of {limits.max_restarts} restarts left",
        rule_index=index,
        event=event,
    )


def _relaunch(
    policy: Policy,
    rule: Rule,
    index: int,
    head: str,
    event: Event,
    history: History,
    catalogue: Sequence[CheckpointRecord],
    now: float,
    rng_seed: int | None,
    in_process: bool,
) -> Decision:
    limits = policy.limits
    rollback = rule.action == "rollback"
    spent = _budget_spent(rollback, history, limits)
    if spent:
        return _fail(event, index, f"{head}; {spent}, so the run fails")
    selector = rule.target.build() if rule.target is not None else selectors.latest()
    notes: list[str] = []
    if rollback and limits.escalation is not None:
        level = recurrences(history, event, limits.escalation)
        if level > limits.escalation.max_escalations:
            return _fail(
                event,
                index,
                f"{head}; rollback loop: {event.type} recurred within "
                f"{limits.escalation.same_step_window} steps of the onset of {level} earlier rollback(s), more than "
                f"limits.escalation.max_escalations ({limits.escalation.max_escalations}), so the run fails",
            )
        if level:
            selector, note = _escalate(selector, level, limits.escalation)
            notes.append(note)
    candidates, unhealthy = _usable(policy, [c for c in catalogue if c.valid])
    skipped = (
        f"skipped {len(unhealthy)} unhealthy checkpoint(s) (NaN or infinity in the state: "
        f"{', '.join(c.id for c in unhealthy)}; checkpoint.allow_nonfinite is false)"
        if unhealthy
        else ""
    )
    onset = selectors.onset_of(event)
    if rollback and onset is not None:  # never roll back to the state that produced the anomaly, or later
        clean = selectors.last_clean_step(onset)
        candidates = [c for c in candidates if c.step <= clean]
    try:
        chosen = selector(candidates, event)
    except Exception as exc:  # a broken custom selector fails the run with its reason instead of a crash
        return _fail(event, index, f"{head}; selector {selector} raised {type(exc).__name__}: {exc}")
    if chosen is not None and not (
        isinstance(chosen, CheckpointRecord) and any(c == chosen for c in candidates)
    ):
        shown = getattr(chosen, "id", chosen)
        return _fail(event, index, f"{head}; selector {selector} returned {shown!r}, not a valid candidate")
    verb = "roll back to" if rollback else "resume from"
    fell_back = False
    if chosen is None:
        scope = f"{len(candidates)} valid checkpoint(s)" + (
            f" at or before step {selectors.last_clean_step(onset)} (onset {onset})"
            if rollback and onset is not None
            else ""
        )
        scope += f" ({skipped})" if skipped else ""
        missed = f"no checkpoint matches {selector} among {scope}"
        # A target too far back for the catalogue (early in a run, after a gap in checkpoints) must not end a run
        # that has a healthy checkpoint before the onset to go back to; `strict` keeps the old all-or-nothing.
        strict = rule.target is not None and rule.target.strict
        chosen = None if strict else selectors.latest()(candidates, event)
        if chosen is not None:
            fell_back = True
            newest = "newest " + ("checkpoint" if policy.checkpoint.allow_nonfinite else "healthy checkpoint")
            where = " before the onset" if rollback and onset is not None else ""
            notes.insert(
                0,
                f"{missed}; falling back to the {newest}{where} (target.strict: false): {verb} "
                f"{_describe_record(chosen, getattr(selector, 'metric', None))}",
            )
            if not chosen.healthy:
                notes.insert(1, _unhealthy(chosen))
        elif not rule.allow_scratch:
            return _fail(event, index, f"{head}; {missed}, and allow_scratch is false, so the run fails")
        else:
            notes.insert(0, f"{missed}; restarting from scratch (allow_scratch)")
    else:
        why = f"chosen by {selector}"
        lookback = getattr(selector, "lookback_steps", None)
        if lookback is not None:
            why += f", i.e. saved at or before step {selectors.cutoff_step(candidates, event, lookback)}"
        notes.insert(0, f"{verb} {_describe_record(chosen, getattr(selector, 'metric', None))} {why}")
        if not chosen.healthy:
            notes.insert(1, _unhealthy(chosen))
        if skipped:
            notes.insert(1, skipped)
    rollbacks_after = history.rollbacks + int(rollback)
    restarts_after = history.restarts + 1
    attempt = 1 + history.relaunches_since(now - limits.backoff.reset_after_seconds)
    seed = (
        rng_seed if rng_seed is not None else seed_for(policy.name, len(history), event.type, event.step, now)
    )
    delay = relaunch_delay(limits.backoff, attempt, seed)
    if in_process and rollback and chosen is not None:
        delay, then = 0.0, "carried out in process, no relaunch"
    else:
        then = f"relaunch in {delay:.1f} s"
    notes.append(f"skip {rule.skip_batches} batches, lr x{rule.lr_scale:g}, {then}")
    notes.append(
        f"budgets left: {limits.max_rollbacks - rollbacks_after} of {limits.max_rollbacks} rollbacks, "
        f"{limits.max_restarts - restarts_after} of {limits.max_restarts} restarts"
    )
    return Decision(
        action=rule.action,
        target_id=chosen.id if chosen else None,
        target_step=chosen.step if chosen else 0,
        skip_batches=rule.skip_batches,
        lr_scale=rule.lr_scale,
        delay_seconds=delay,
        reason=f"{head}; " + "; ".join(notes),
        rule_index=index,
        event=event,
        fallback=fell_back,
    )


def _usable(
    policy: Policy, catalogue: Sequence[CheckpointRecord]
) -> tuple[list[CheckpointRecord], list[CheckpointRecord]]:
    """(the records a decision may pick, the unhealthy ones it skipped): unhealthy only when the policy allows."""
    if policy.checkpoint.allow_nonfinite:
        return list(catalogue), []
    return [c for c in catalogue if c.healthy], [c for c in catalogue if c.valid and not c.healthy]


def _budget_spent(rollback: bool, history: History, limits: Limits) -> str | None:
    if rollback and history.rollbacks >= limits.max_rollbacks:
        return f"rollback budget exhausted: {history.rollbacks} of {limits.max_rollbacks} used (limits.max_rollbacks)"
    if history.restarts >= limits.max_restarts:
        return f"restart budget exhausted: {history.restarts} of {limits.max_restarts} used (limits.max_restarts)"
    return None


def recurrences(history: History, event: Event, escalation: Escalation) -> int:
    """Earlier rollbacks for the same event type whose onset lies within `same_step_window` of this one's."""
    onset = selectors.onset_of(event)
    if onset is None:
        return 0
    count = 0
    for entry in history:
        earlier = selectors.onset_of(entry.event)
        if (
            entry.decision.action == "rollback"
            and entry.event.type == event.type
            and earlier is not None
            and abs(onset - earlier) <= escalation.same_step_window
        ):
            count += 1
    return count


def _escalate(
    selector: selectors.Selector, level: int, escalation: Escalation
) -> tuple[selectors.Selector, str]:
    base = getattr(selector, "lookback_steps", None)
    if base is None:
        return (
            selector,
            f"recurrence {level} of {escalation.max_escalations} allowed (target has no lookback to widen)",
        )
    factor = escalation.lookback_multiplier**level
    widened = dataclasses.replace(selector, lookback_steps=math.ceil(base * factor))  # type: ignore[type-var]
    return widened, (
        f"recurrence {level} of {escalation.max_escalations} allowed: lookback {base} x{factor:g} "
        f"= {widened.lookback_steps} steps"  # type: ignore[attr-defined]
    )


def _unhealthy(record: CheckpointRecord) -> str:
    return f"{record.id} is unhealthy (NaN or infinity), allowed by checkpoint.allow_nonfinite"


def _describe_record(record: CheckpointRecord, metric: str | None) -> str:
    text = f"{record.id} (step {record.step}"
    if metric and metric in record.metrics:
        text += f", {metric}={record.metrics[metric]:g}"
    return text + ")"
