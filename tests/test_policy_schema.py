"""The policy schema: presets, JSON Schema, generated docs, detector-spec field names and custom selectors."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, ValidationError

import policies
from policies import PRESETS_DIR, SCHEMA_FILE, Policy, PolicyError, load_preset, parse_policy
from policies.reference_doc import _sections
from policies.type_words import model_keys

REPO = Path(__file__).resolve().parents[1]

# The v1 example from issue 4, with issue 30's time trigger (every_seconds): palm-spike.yaml must be exactly this.
ISSUE_EXAMPLE = """\
version: 1
name: palm-spike
checkpoint:
  every_steps: 200
  every_seconds: 600           # also save at least every 10 minutes, so no run goes long without a checkpoint
  adaptive: false              # pick the interval from measured save cost and observed failure rate (Young/Daly), capped by every_steps
  keep_last: 3
  keep_best: {metric: val_loss, mode: min, count: 2}
  keep_every_steps: 5000
  async: true
  memory_slots: 2
  storage: ./checkpoints       # a path or an fsspec URL
  verify: full                 # full | fast | none
monitor:
  poll_seconds: 2
  detectors:
    - {type: non_finite, metrics: [loss, grad_norm]}
    - {type: spike, metric: loss, window: 128, sigmas: 6, warmup_steps: 200}
    - {type: divergence, metric: loss, window: 200, factor: 1.5}
    - {type: threshold, metric: grad_norm, above: 100.0}
    - {type: plateau, metric: val_loss, mode: min, patience: 10, min_delta: 0.001}
    - {type: hang, seconds: 600}
rules:                         # first match wins
  - when: [non_finite, spike, divergence, threshold]
    action: rollback
    target: {select: best_before, metric: val_loss, mode: min, lookback_steps: 100}
    skip_batches: 300
    lr_scale: 0.5
  - when: [preemption, hardware_fault, unknown_exit]
    action: resume
    target: {select: latest}
  - when: [plateau]
    action: stop
  - when: [software_error]
    action: fail
limits:
  max_rollbacks: 5
  max_restarts: 20
  backoff: {initial_seconds: 1, max_seconds: 300, multiplier: 2, jitter: true}
"""

PRESETS = ["conservative", "early-stop", "palm-spike", "spot-resume"]


def test_the_four_presets_ship():
    assert policies.preset_names() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_validates_and_names_the_schema(name):
    policy = load_preset(name)
    assert policy.name == name
    text = (PRESETS_DIR / f"{name}.yaml").read_text()
    assert text.splitlines()[0] == "# yaml-language-server: $schema=../policy.schema.json"
    assert (PRESETS_DIR / "../policy.schema.json").resolve() == SCHEMA_FILE


@pytest.mark.parametrize("name", PRESETS)
def test_json_schema_accepts_every_preset(name):
    jsonschema.Draft202012Validator.check_schema(policies.json_schema())
    validator = jsonschema.Draft202012Validator(policies.json_schema())
    data = yaml.safe_load((PRESETS_DIR / f"{name}.yaml").read_text())
    assert list(validator.iter_errors(data)) == []


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda d: d.update(rule=[]), []),
        (lambda d: d["checkpoint"].update(keep_last="3"), ["checkpoint", "keep_last"]),
        (lambda d: d["rules"][0].update(lr_scale=0), ["rules", 0, "lr_scale"]),
        (lambda d: d["monitor"]["detectors"].append({"type": "spikes"}), ["monitor", "detectors", 6]),
        (lambda d: d["rules"][1]["target"].update(select="newest"), ["rules", 1, "target"]),
    ],
)
def test_json_schema_rejects_what_the_loader_rejects(change, path):
    data = yaml.safe_load(ISSUE_EXAMPLE)
    change(data)
    errors = list(jsonschema.Draft202012Validator(policies.json_schema()).iter_errors(data))
    assert errors and any(list(e.absolute_path) == path for e in errors)
    with pytest.raises(PolicyError):
        parse_policy(yaml.safe_dump(data))


def test_palm_spike_is_the_issue_example_verbatim():
    text = (PRESETS_DIR / "palm-spike.yaml").read_text()
    body = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
    assert body == ISSUE_EXAMPLE


def test_schema_file_and_reference_are_generated_from_the_models():
    assert SCHEMA_FILE.read_text() == policies.json_schema_text(), (
        "regenerate: rollback-supervisor policy schema"
    )
    reference = REPO / "policies" / "REFERENCE.md"
    assert reference.read_text() == policies.reference_markdown(), (
        "regenerate: rollback-supervisor policy reference"
    )


def _all_models() -> list[type[BaseModel]]:
    return [model for _, model in _sections(Policy, "", None)]


def test_every_field_of_every_section_has_a_description():
    models = _all_models()
    assert len(models) >= 20
    missing = [
        f"{m.__name__}.{k}" for m in models for k, info in model_keys(m).items() if not info.description
    ]
    assert missing == []
    schema = json.dumps(policies.json_schema())
    assert schema.count('"description"') >= sum(len(model_keys(m)) for m in models)


@pytest.mark.parametrize(
    ("written", "dumped"),
    [
        ({"type": "non_finite"}, {"type": "non_finite", "metrics": ["loss"]}),
        (
            {"type": "spike"},
            {
                "type": "spike",
                "metric": "loss",
                "window": 128,
                "sigmas": 6.0,
                "warmup_steps": 200,
                "min_history": 32,
            },
        ),
        (
            {"type": "divergence"},
            {"type": "divergence", "metric": "loss", "window": 200, "factor": 1.5, "patience": 50},
        ),
        (
            {"type": "threshold", "metric": "grad_norm", "above": 100},
            {"type": "threshold", "metric": "grad_norm", "above": 100.0, "below": None},
        ),
        (
            {"type": "plateau"},
            {"type": "plateau", "metric": "val_loss", "mode": "min", "patience": 10, "min_delta": 0.001},
        ),
        ({"type": "hang"}, {"type": "hang", "seconds": 600.0}),
    ],
)
def test_detector_specs_dump_the_agreed_field_names_and_defaults(written, dumped):
    policy = Policy.model_validate(
        {
            "version": 1,
            "name": "d",
            "monitor": {"detectors": [written]},
            "rules": [{"when": ["oom"], "action": "fail"}],
        }
    )
    assert policy.monitor.detectors[0].model_dump() == dumped


def test_monitor_and_checkpoint_extras_and_defaults():
    policy = parse_policy(
        "version: 1\nname: x\n"
        "checkpoint: {async: false, remote: 's3://bucket/run'}\n"
        "monitor:\n  classifier_patterns: [{type: oom, pattern: 'CUDA out of memory'}]\n"
        "  preemption_notice: {provider: gcp}\n"
        "rules: [{when: [oom], action: fail}]\n"
    )
    assert policy.checkpoint.async_ is False
    assert policy.checkpoint.model_dump(by_alias=True)["async"] is False
    assert policy.checkpoint.remote == "s3://bucket/run"
    assert policy.monitor.classifier_patterns[0].model_dump() == {
        "type": "oom",
        "pattern": "CUDA out of memory",
        "priority": 100,
    }
    assert policy.monitor.preemption_notice.model_dump() == {
        "provider": "gcp",
        "endpoint": None,
        "poll_seconds": 5.0,
    }
    assert policy.limits.escalation.model_dump() == {
        "same_step_window": 50,
        "lookback_multiplier": 2.0,
        "max_escalations": 1,
    }
    assert (policy.rules[0].allow_scratch, policy.rules[0].target) == (False, None)


def test_custom_selector_is_imported_at_load_time_with_its_options():
    policy = parse_policy(
        "version: 1\nname: x\nrules:\n"
        "  - when: [spike]\n    action: rollback\n"
        "    target: {select: 'tests.test_policy_engine:lowest_loss_scale', metric: scale, minimum: 8, strict: true}\n"
    )
    target = policy.rules[0].target
    from tests.test_policy_engine import lowest_loss_scale

    assert target.options == {"metric": "scale", "minimum": 8}  # `strict` is the engine's, not the selector's
    assert target.build().function is lowest_loss_scale
    assert target.model_dump() == {
        "select": "tests.test_policy_engine:lowest_loss_scale",
        "strict": True,
        "metric": "scale",
        "minimum": 8,
    }


def test_custom_selector_options_must_fit_its_signature():
    with pytest.raises(PolicyError) as info:
        parse_policy(
            "version: 1\nname: x\nrules:\n  - when: [spike]\n    action: rollback\n"
            "    target: {select: 'tests.test_policy_engine:lowest_loss_scale', maximum: 8}\n"
        )
    assert info.value.problems == [
        "<string>:6:22: rules[0].target.select: expected a function accepting (catalogue, event, **options), "
        "got \"tests.test_policy_engine:lowest_loss_scale\" (got an unexpected keyword argument 'maximum')"
    ]


def test_policy_is_immutable_and_validates_in_python_too():
    policy = load_preset("palm-spike")
    with pytest.raises(ValidationError):
        policy.name = "other"
    with pytest.raises(ValidationError) as info:
        Policy.model_validate(
            {"version": 1, "name": "x", "rules": [{"when": ["spike"], "action": "rollback"}]}
        )
    assert "expected a target for action rollback" in str(info.value)


def test_unknown_preset_lists_the_shipped_ones():
    with pytest.raises(PolicyError) as info:
        load_preset("palm-spikes")
    assert str(info.value) == (
        "preset 'palm-spikes': expected one of conservative, early-stop, palm-spike, spot-resume, got no such preset"
    )


def test_missing_file_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError) as info:
        policies.load_policy(tmp_path / "nope.yaml")
    assert (
        str(info.value)
        == f"{tmp_path / 'nope.yaml'}: expected a readable policy file, got No such file or directory"
    )


# `policy explain` on rollback loops: only a target with a lookback can have it widened (engine._escalate).
_LOOP_HEAD = "  Rollback loops: when the same anomaly recurs within 50 steps of an earlier rollback's onset, "
_LOOP_TAIL = "for up to 1 recurrence; the next recurrence fails the run."


@pytest.mark.parametrize(
    ("targets", "limits", "line"),
    [
        (
            ["{select: latest}"],
            "",
            _LOOP_HEAD + "rules[0] (select: latest, which has no lookback to widen) "
            "rolls back the same way again, " + _LOOP_TAIL,
        ),
        (
            ["{select: best, metric: val_loss}"],
            "",
            _LOOP_HEAD + "rules[0] (select: best, which has no lookback "
            "to widen) rolls back the same way again, " + _LOOP_TAIL,
        ),
        (
            ["{select: before, lookback_steps: 10}"],
            "",
            _LOOP_HEAD + "the lookback grows 2x per recurrence " + _LOOP_TAIL,
        ),
        (
            ["{select: best_before, metric: val_loss, lookback_steps: 10}"],
            "",
            _LOOP_HEAD + "the lookback grows 2x per recurrence " + _LOOP_TAIL,
        ),
        (
            ["{select: before, lookback_steps: 10}", "{select: latest}"],
            "",
            _LOOP_HEAD + "the lookback of "
            "rules[0] grows 2x per recurrence and rules[1] (select: latest, which has no lookback to widen) rolls "
            "back the same way again, " + _LOOP_TAIL,
        ),
        ([], "", "  Rollback loops: no rule rolls back, so there is no loop to detect."),
        (["{select: latest}"], "limits: {escalation: {max_escalations: 0}}", _LOOP_HEAD + "the run fails."),
        (["{select: latest}"], "limits: {escalation: null}", "  Rollback loops are not detected."),
    ],
    ids=["latest", "best", "before", "best_before", "mixed", "no-rollback", "no-escalation", "off"],
)
def test_explain_promises_a_growing_lookback_only_for_targets_with_one(targets, limits, line):
    from policies.summary import summarize as explain

    events = ["spike", "divergence", "threshold"]
    rules = [
        f"  - when: [{events[i]}]\n    action: rollback\n    target: {t}\n" for i, t in enumerate(targets)
    ] or ["  - when: [spike]\n    action: fail\n"]
    text = explain(parse_policy("version: 1\nname: x\nrules:\n" + "".join(rules) + limits + "\n"))
    assert [x for x in text.splitlines() if "Rollback loops" in x] == [line]
