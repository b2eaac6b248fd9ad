"""One definition of each detector's settings: the policy schema. The builder and the detectors add no defaults."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from pydantic_core import PydanticUndefined

from policies import parse_policy
from policies.monitor_schema import DETECTOR_SPECS, PlateauSpec, ThresholdSpec
from supervisor.monitor import DetectorSpecError, build_detectors
from supervisor.monitor import from_specs as builder
from supervisor.monitor.from_specs import DETECTOR_FOR, detector_for, detector_specs, settings

#: The fields a spec must be given; every other field takes the schema's default.
REQUIRED = {ThresholdSpec: {"metric": "grad_norm", "above": 100.0}}


def minimal(spec_type: type) -> dict:
    return {"type": spec_type.TAG, **REQUIRED.get(spec_type, {})}


def _as_set(value):
    return frozenset(value) if isinstance(value, list | frozenset) else value


def test_every_spec_builds_a_detector_and_only_those():
    assert set(DETECTOR_FOR) == set(DETECTOR_SPECS)
    for spec_type, detector_type in DETECTOR_FOR.items():
        assert detector_type.type == spec_type.TAG


@pytest.mark.parametrize("spec_type", DETECTOR_SPECS, ids=lambda t: t.TAG)
def test_a_mapping_with_defaults_builds_the_schemas_defaults(spec_type):
    (detector,) = build_detectors([minimal(spec_type)])
    defaults = spec_type.model_validate(minimal(spec_type))
    fields = settings(defaults)
    assert fields, spec_type
    for name, value in fields.items():
        assert _as_set(getattr(detector, name)) == _as_set(value), f"{spec_type.TAG}.{name}"
        info = spec_type.model_fields[name]
        if name not in REQUIRED.get(spec_type, {}) and info.default is not PydanticUndefined:
            assert value == info.default, f"{spec_type.TAG}.{name}"


@pytest.mark.parametrize("spec_type", DETECTOR_SPECS, ids=lambda t: t.TAG)
def test_detectors_take_every_spec_setting_and_default_none_of_them(spec_type):
    params = inspect.signature(DETECTOR_FOR[spec_type]).parameters
    for name in settings(spec_type.model_validate(minimal(spec_type))):
        assert name in params, f"{DETECTOR_FOR[spec_type].__name__} ignores {spec_type.TAG}.{name}"
        assert params[name].default is inspect.Parameter.empty, (
            f"{DETECTOR_FOR[spec_type].__name__}({name}=...) has a default; the schema owns it"
        )


def test_the_builder_holds_no_setting_literals():
    tree = ast.parse(Path(builder.__file__).read_text())
    numbers = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ]
    assert numbers == []


def test_a_policy_spec_reaches_the_detector_unchanged():
    policy = parse_policy(
        "version: 1\nname: x\nmonitor:\n  detectors:\n    - {type: plateau, metric: val_loss}\n"
        "rules:\n  - when: [plateau]\n    action: stop\n"
    )
    (spec,) = policy.monitor.detectors
    (detector,) = build_detectors(policy.monitor.detectors)
    assert isinstance(spec, PlateauSpec)
    assert detector.min_delta == spec.min_delta == 0.001
    assert detector_specs(policy.monitor.detectors)[0] is spec  # validated once, at load


def test_spec_objects_and_mappings_mix_and_errors_name_the_position():
    spec = PlateauSpec(type="plateau", metric="acc", mode="max")
    kinds = [d.type for d in build_detectors([spec, {"type": "hang", "seconds": 60}])]
    assert kinds == ["plateau", "hang"]
    with pytest.raises(DetectorSpecError, match=r"detectors\[1\]\.patience: expected an integer >= 1, got 0"):
        build_detectors([spec, {"type": "plateau", "metric": "acc", "patience": 0}])


def test_detector_for_passes_each_setting_by_name():
    detector = detector_for(PlateauSpec(type="plateau", metric="acc", mode="max", patience=3, min_delta=0.5))
    assert (detector.metric, detector.mode, detector.patience, detector.min_delta) == ("acc", "max", 3, 0.5)
