"""What a policy does, in plain words, for every event type: the text `policy explain` prints."""

from __future__ import annotations

from policies.monitor_schema import (
    DivergenceSpec,
    HangSpec,
    NonFiniteSpec,
    PlateauSpec,
    SpikeSpec,
    StragglerSpec,
    ThresholdSpec,
)
from policies.schema import Policy, Rule, ScriptCheckpoints
from policies.targets import BeforeTarget, BestBeforeTarget, BestTarget, CustomTarget, LatestTarget
from supervisor.events import EVENT_TYPES

_BETTER = {"min": "lowest", "max": "highest"}
_LOWER = {"min": "lower", "max": "higher"}


def summarize(policy: Policy) -> str:
    """The whole policy in plain words: checkpoints, detectors, one line per event type, budgets."""
    lines = [f"Policy: {policy.name}", "", "Checkpoints", *_checkpoints(policy), ""]
    if policy.script is not None:
        lines += ["Script mode (the command does not use the training-side API)", *_script(policy), ""]
    lines += [f"Watching (every {policy.monitor.poll_seconds:g} s)", *_detectors(policy), ""]
    if policy.monitor.replay is not None and policy.monitor.replay.enabled:
        lines += ["Replay (data or hardware?)", *_replay(policy), ""]
    lines.append("On each event")
    width = max(len(t) for t in EVENT_TYPES)
    for event_type in EVENT_TYPES:
        lines.append(f"  {event_type:<{width}}  {_on_event(policy, event_type)}")
    lines += ["", "Limits", *_limits(policy)]
    return "\n".join(lines) + "\n"


def _checkpoints(policy: Policy) -> list[str]:
    c = policy.checkpoint
    if policy.script is not None:
        return _script_checkpoints(policy)
    when = []
    if c.every_steps is not None:
        when.append(
            f"adaptively (Young/Daly), at most every {c.every_steps} steps"
            if c.adaptive
            else f"every {c.every_steps} steps"
        )
    if c.every_seconds is not None:
        when.append(f"every {c.every_seconds:g} s")
    if len(when) > 1:  # save_policy.build_save_policy: both then count from the last save
        when[-1] += " after the last save, whichever comes first"
    how = f"in the background ({c.memory_slots} memory slots)" if c.async_ else "synchronously"
    verify = {
        "full": "hashed in full",
        "fast": "checked quickly (sizes and manifest)",
        "none": "not verified",
    }
    kept = [f"the newest {c.keep_last}"]
    if c.keep_best:
        kept.append(f"the {c.keep_best.count} best by {c.keep_best.metric} ({_BETTER[c.keep_best.mode]})")
    if c.keep_every_steps:
        by = "adaptive" if c.adaptive else "every_seconds" if c.every_seconds is not None else None
        drift = (
            f" (with {by}, saves count from the last one, so each such step is saved as well)" if by else ""
        )
        kept.append(f"every multiple of {c.keep_every_steps} steps{drift}")
    lines = [
        f"  Saved {' or '.join(when)}, {how}, to {c.storage}; {verify[c.verify]} before a restore.",
        f"  Kept: {_join(kept)}.",
    ]
    if c.remote:
        lines.append(f"  Each checkpoint is also copied to {c.remote}.")
    return lines


def _detectors(policy: Policy) -> list[str]:
    m = policy.monitor
    lines = [f"  {spec.type}: {_detector(spec)}" for spec in m.detectors] or ["  no metric detectors."]
    lines += [f"  log pattern /{p.pattern}/ means {p.type}." for p in m.classifier_patterns]
    if m.preemption_notice.provider != "none" and policy.script is None:  # script mode: see _script
        n = m.preemption_notice
        where = n.endpoint or f"the {n.provider} metadata service"
        lines.append(f"  preemption notices: polled from {where} every {n.poll_seconds:g} s.")
    return lines


def _replay(policy: Policy) -> list[str]:
    r = policy.monitor.replay
    assert r is not None
    lines = [
        f"  Before a rule applies to {_join(list(r.when), 'or')} (onset at the step just seen), the steps up to "
        f"the onset run again from the newest memory snapshot 2 to {r.max_steps} steps back (skipped when they "
        f"would take over {r.budget_seconds:g} s), with the same batches and RNG streams, compared bit for bit.",
        "  A different value: hardware_fault (replay_mismatch); training goes on from the replayed state, nothing "
        "skipped.",
    ]
    if r.other_device:
        lines.append(
            "  The same value, under torchrun (the Session loop): the steps run once more with that rank's batches "
            "on the next rank's device; a different value there is hardware_fault (persistent_mismatch) and every "
            "rank stops for the rule below; the same value leaves the anomaly's rule to decide."
        )
    else:
        lines.append("  The same value: the anomaly's rule decides (other_device is off: no second stage).")
    if policy.rule_for("hardware_fault") is None:
        lines.append(
            "  No rule handles hardware_fault: a device found wrong every time (persistent_mismatch) fails the run; "
            "add one (e.g. resume) to relaunch away from its host."
        )
    return lines


def _detector(spec: object) -> str:
    if isinstance(spec, NonFiniteSpec):
        return f"fires when {_join(spec.metrics, 'or')} is NaN or infinite."
    if isinstance(spec, SpikeSpec):
        return (
            f"fires when {spec.metric} jumps more than {spec.sigmas:g} sigmas above its last {spec.window} "
            f"points (from step {spec.warmup_steps}, once {spec.min_history} points are in)."
        )
    if isinstance(spec, DivergenceSpec):
        return (
            f"fires when the {spec.window}-point mean of {spec.metric} stays above {spec.factor:g} x its best "
            f"for {spec.patience} points in a row."
        )
    if isinstance(spec, ThresholdSpec):
        bounds = [
            f"{word} {value:g}"
            for word, value in (("above", spec.above), ("below", spec.below))
            if value is not None
        ]
        return f"fires when {spec.metric} goes {' or '.join(bounds)}."
    if isinstance(spec, PlateauSpec):
        return (
            f"fires when {spec.metric} has not improved ({_LOWER[spec.mode]} is better) by {spec.min_delta:g} "
            f"for {spec.patience} evaluations."
        )
    if isinstance(spec, HangSpec):
        return f"fires after {spec.seconds:g} s without a heartbeat or metric."
    if isinstance(spec, StragglerSpec):
        return (
            f"fires when one rank's step takes {spec.factor:g} x the other ranks' median, and at least "
            f"{spec.min_gap_seconds:g} s more, for {spec.patience} steps in a row (torchrun only)."
        )
    raise TypeError(f"unknown detector spec {type(spec).__name__}")


def _on_event(policy: Policy, event_type: str) -> str:
    match = policy.rule_for(event_type)
    if match is None:
        return "no rule: the run fails."
    index, rule = match
    where = f"rules[{index}]:"
    if rule.action == "fail":
        return f"{where} the run fails."
    if rule.action == "warn":
        return (
            f"{where} warn: the event and the decision are logged and recorded, and training goes on "
            "(no restore, no stop, no relaunch, no budget spent)."
        )
    if rule.action == "stop":
        keep = policy.checkpoint.keep_best
        best = f"the best checkpoint by {keep.metric}" if keep else "the newest checkpoint"
        return f"{where} stop the run successfully, keeping {best}."
    verb = "roll back to" if rule.action == "rollback" else "resume from"
    text = f"{where} {verb} {_target(rule)}"
    if rule.action == "rollback" and not isinstance(rule.target, BeforeTarget | BestBeforeTarget):
        text += " saved before the anomaly's onset"
    extras = []
    if rule.skip_batches:
        extras.append(f"skip {rule.skip_batches} batches" + _unsupported(policy, "skip_batches"))
    if rule.lr_scale != 1.0:
        extras.append(f"scale the learning rate by {rule.lr_scale:g}" + _unsupported(policy, "lr_scale"))
    if extras:
        text += "; " + "; ".join(extras)
    return f"{text}. {_fallback(policy, rule)}"


def _fallback(policy: Policy, rule: Rule) -> str:
    """What a relaunch rule does when its target matches no checkpoint, in words."""
    last = "restart from scratch" if rule.allow_scratch else "the run fails"
    t = rule.target
    if t is None or isinstance(t, LatestTarget):  # nothing older to fall back to
        return f"If there is none, {last}."
    if t.strict:
        return f"If none matches, {last} (target.strict: true, no fallback)."
    newest = "the newest checkpoint" if policy.checkpoint.allow_nonfinite else "the newest healthy checkpoint"
    where = " saved before the anomaly's onset" if rule.action == "rollback" else ""
    return (
        f"If none matches, fall back to {newest}{where} instead (the decision says fallback: true); "
        f"if there is none at all, {last}."
    )


def _unsupported(policy: Policy, field: str) -> str:
    """In script mode, why a rule key cannot reach the script (empty when it can, or without a script)."""
    if policy.script is None or field in policy.script.relaunch.template().fields:
        return ""
    return f" (unsupported: script.relaunch.args has no {{{field}}}, so the script never gets it)"


def _script_checkpoints(policy: Policy) -> list[str]:
    c, files = policy.checkpoint, policy.script.checkpoints  # type: ignore[union-attr]
    kept = [f"the newest {c.keep_last}"]
    if c.keep_best:
        kept.append(f"the {c.keep_best.count} best by {c.keep_best.metric} ({_BETTER[c.keep_best.mode]})")
    if c.keep_every_steps:
        kept.append(f"every multiple of {c.keep_every_steps} steps")
    verify = {
        "full": "hashed in full",
        "fast": "checked quickly (sizes and manifest)",
        "none": "not verified",
    }
    lines = [
        f"  Saved by the script itself; each new or changed file matching {files.glob} is versioned to "
        f"{c.storage} as an opaque blob; {verify[c.verify]} before it is put back.",
        f"  Kept: {_join(kept)}.",
        "  Not used in script mode (the script decides when it saves): checkpoint.every_steps, every_seconds, "
        "adaptive, async, memory_slots.",
    ]
    if c.remote:
        lines.append(
            f"  Unsupported in script mode: checkpoint.remote ({c.remote}); versions stay in {c.storage}."
        )
    return lines


def _script(policy: Policy) -> list[str]:
    s = policy.script
    assert s is not None
    if s.output.patterns:
        shown = ", ".join(f"/{p}/" for p in s.output.patterns)
        metrics = "read from output lines matching " + shown
    else:
        metrics = "only from the script's own MLflow logging"
    files = s.checkpoints
    step = {
        "output": "the step printed last before the file changed",
        "name": f"the step in the file's path (/{files.step_pattern}/), each step its own version",
        "sidecar": f"the step in {files.sidecar}"
        + (f" (key {files.sidecar_key})" if files.sidecar_key else ""),
    }[files.step_from]
    whole = "read as whole zip archives, " if files.file_format() == "zip" else ""
    if s.mlflow_mode() == "join":
        mlflow = (
            "MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_ID and MLFLOW_RUN_ID are exported (script.mlflow: join), so "
            "the script's own mlflow.start_run() logs into the lineage's run (it must not call set_experiment, "
            "nor log a parameter that changes on a relaunch)"
        )
    else:
        mlflow = "MLflow's variables are not exported (script.mlflow: off)"
    args = s.relaunch.args if isinstance(s.relaunch.args, str) else " ".join(s.relaunch.args)
    values = ", ".join(f"{k} = {v:g}" for k, v in s.relaunch.values.items())
    rendered = s.relaunch.template().preview(dict(s.relaunch.values))
    return [
        f"  Metrics: {metrics}; {mlflow}.",
        f"  Checkpoint files: {files.glob} under the command's working directory, checked every "
        f"{files.scan_seconds:g} s and versioned once {whole}unchanged for {files.settle_seconds:g} s; a "
        f"version's step is {step}.",
        _first_save(files),
        f"  Relaunch: the command plus {args or 'nothing'}" + (f" ({values})" if values else "") + "; a "
        "relaunch from scratch runs the command as first given.",
        f"  Relaunch arguments at lr_scale 1 with no skip: {' '.join(rendered) or 'none'} (a --key=value of "
        "the command must match its --key= here, or the run is refused).",
        "  Fault drill: kill, term and hang are injected from outside; nan, spike, hw, oom and exc cannot be.",
    ] + (
        [
            f"  Unsupported in script mode: monitor.preemption_notice ({policy.monitor.preemption_notice.provider}); "
            "notices are polled by the training-side API, which the script does not load."
        ]
        if policy.monitor.preemption_notice.provider != "none"
        else []
    )


def _first_save(files: ScriptCheckpoints) -> str:
    """When a glob that has matched no file is warned about (supervisor.script.first_save), in words."""
    when = []
    if files.expect_within_steps is not None:
        when.append(
            f"once the script prints a step more than {files.expect_within_steps} steps past the one a segment "
            "started at (expect_within_steps)"
        )
    if files.warn_after_seconds is not None:
        when.append(f"{files.warn_after_seconds:g} s after a segment starts (warn_after_seconds)")
    if not when:
        return "  A glob that matches no file is never warned about (expect_within_steps and warn_after_seconds are null)."
    first = ", whichever comes first" if len(when) > 1 else ""
    return f"  A glob that has matched no file yet is warned about {_join(when, 'or')}{first}."


def _target(rule: Rule) -> str:
    t = rule.target
    if t is None or isinstance(t, LatestTarget):
        return "the newest valid checkpoint"
    if isinstance(t, BestTarget):
        return f"the valid checkpoint with the {_BETTER[t.mode]} {t.metric}"
    if isinstance(t, BeforeTarget):
        return (
            f"the newest valid checkpoint saved at least {t.lookback_steps} steps before the anomaly's onset"
        )
    if isinstance(t, BestBeforeTarget):
        return (
            f"the valid checkpoint with the {_BETTER[t.mode]} {t.metric} among those saved at least "
            f"{t.lookback_steps} steps before the anomaly's onset"
        )
    assert isinstance(t, CustomTarget)
    return f"the checkpoint chosen by {t.build()}"


def _limits(policy: Policy) -> list[str]:
    lim, b = policy.limits, policy.limits.backoff
    lines = [
        f"  At most {lim.max_rollbacks} rollbacks and {lim.max_restarts} restarts (resume or rollback) per run; "
        "one more fails the run."
    ]
    wait = f"  Before each relaunch wait {b.initial_seconds:g} s"
    if b.multiplier > 1:
        wait += f", {b.multiplier:g}x longer each time up to {b.max_seconds:g} s"
    wait += ", jittered to 50-100%" if b.jitter else ""
    lines.append(f"{wait}; relaunches older than {b.reset_after_seconds:g} s no longer lengthen it.")
    lines.append(_loops(policy))
    return lines


def _loops(policy: Policy) -> str:
    """Rollback-loop handling, saying only what holds for the rollback rules' selectors."""
    e = policy.limits.escalation
    if e is None:
        return "  Rollback loops are not detected."
    rollbacks = [(i, r) for i, r in enumerate(policy.rules) if r.action == "rollback"]
    if not rollbacks:
        return "  Rollback loops: no rule rolls back, so there is no loop to detect."
    head = f"  Rollback loops: when the same anomaly recurs within {e.same_step_window} steps of an earlier rollback's onset"
    if e.max_escalations == 0:
        return f"{head}, the run fails."
    # Only a target with a lookback can be widened (engine._escalate); the others roll back the same way again.
    widened = [i for i, r in rollbacks if isinstance(r.target, BeforeTarget | BestBeforeTarget)]
    same = [(i, r) for i, r in rollbacks if i not in widened]
    tail = f"for up to {_times(e.max_escalations)}; the next recurrence fails the run."
    if not same:
        return f"{head}, the lookback grows {e.lookback_multiplier:g}x per recurrence {tail}"
    fixed = _join([f"rules[{i}] ({_select(r)}, which has no lookback to widen)" for i, r in same])
    again = f"{fixed} {'rolls' if len(same) == 1 else 'roll'} back the same way again"
    if not widened:
        return f"{head}, {again}, {tail}"
    grows = f"the lookback of {_join([f'rules[{i}]' for i in widened])} grows {e.lookback_multiplier:g}x per recurrence"
    return f"{head}, {grows} and {again}, {tail}"


def _select(rule: Rule) -> str:
    t = rule.target
    return f"select: {t.select}" if t is not None else "select: latest"


def _times(n: int) -> str:
    return "1 recurrence" if n == 1 else f"{n} recurrences"


def _join(items: list[str], word: str = "and") -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {word} " + items[-1]
