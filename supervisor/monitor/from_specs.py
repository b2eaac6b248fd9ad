"""Detectors from policy detector specs: the schema's validated settings, passed through unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.loader import check_section
from policies.monitor_schema import (
    DETECTOR_SPECS,
    AnyDetectorSpec,
    DetectorSpec,
    DivergenceSpec,
    HangSpec,
    NonFiniteSpec,
    PlateauSpec,
    SpikeSpec,
    StragglerSpec,
    ThresholdSpec,
)
from supervisor.errors import PolicyError, UserError
from supervisor.monitor.detectors import (
    Detector,
    DivergenceDetector,
    HangDetector,
    NonFiniteDetector,
    PlateauDetector,
    SpikeDetector,
    StragglerDetector,
    ThresholdDetector,
)

#: The detector each spec builds. Its constructor takes the spec's fields (all but `type`) by name.
DETECTOR_FOR: dict[type[AnyDetectorSpec], type[Detector]] = {
    NonFiniteSpec: NonFiniteDetector,
    SpikeSpec: SpikeDetector,
    DivergenceSpec: DivergenceDetector,
    ThresholdSpec: ThresholdDetector,
    PlateauSpec: PlateauDetector,
    HangSpec: HangDetector,
    StragglerSpec: StragglerDetector,
}


class DetectorSpecError(UserError):
    """A detector spec given as a mapping has an unknown type, an unknown key or a bad value."""


def settings(spec: AnyDetectorSpec) -> dict[str, Any]:
    """A spec's settings by field name: what its detector's constructor receives."""
    return {name: getattr(spec, name) for name in type(spec).model_fields if name != "type"}


def detector_for(spec: AnyDetectorSpec) -> Detector:
    """The detector a validated spec describes."""
    return DETECTOR_FOR[type(spec)](**settings(spec))


def detector_specs(specs: Sequence[AnyDetectorSpec | Mapping[str, Any]]) -> list[AnyDetectorSpec]:
    """Validated specs: spec objects pass as they are, mappings are checked against the same schema."""
    if all(isinstance(spec, DETECTOR_SPECS) for spec in specs):
        return list(specs)  # type: ignore[arg-type]
    try:
        return check_section(list[DetectorSpec], [_raw(spec) for spec in specs], "detectors")
    except PolicyError as exc:
        raise DetectorSpecError("; ".join(exc.problems)) from None


def _raw(spec: object) -> object:
    """A spec object as it is; another pydantic-like object through its dump, read as a mapping would be."""
    if isinstance(spec, DETECTOR_SPECS) or not hasattr(spec, "model_dump"):
        return spec
    return spec.model_dump()


def build_detectors(specs: Sequence[AnyDetectorSpec | Mapping[str, Any]]) -> list[Detector]:
    """Detectors from policy detector specs (the policy's `monitor.detectors`, or mappings in the same shape)."""
    return [detector_for(spec) for spec in detector_specs(specs)]
