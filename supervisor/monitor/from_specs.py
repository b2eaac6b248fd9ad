"""Detectors from policy detector specs: the schema's validated settings, passed through unchanged.

A spec is a schema object, a mapping (validated here, against the same schema), or a section of a launch
plan's policy (`policies.plain.SectionView`: validated by the supervisor, every setting present), which
builds its detector by its `type` without importing the schema: a training process's start-up skips pydantic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from policies.plain import SectionView
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

if TYPE_CHECKING:
    from policies.monitor_schema import AnyDetectorSpec

    Spec = AnyDetectorSpec | SectionView

#: The detector each spec `type` builds. Its constructor takes the spec's fields (all but `type`) by name.
DETECTORS: dict[str, type[Detector]] = {
    d.type: d
    for d in (
        NonFiniteDetector,
        SpikeDetector,
        DivergenceDetector,
        ThresholdDetector,
        PlateauDetector,
        HangDetector,
        StragglerDetector,
    )
}


class DetectorSpecError(UserError):
    """A detector spec given as a mapping has an unknown type, an unknown key or a bad value."""


def __getattr__(name: str) -> Any:
    if name == "DETECTOR_FOR":  # by schema class; built on first use, so that importing this needs no schema
        from policies.monitor_schema import DETECTOR_SPECS

        return {spec: DETECTORS[spec.TAG] for spec in DETECTOR_SPECS}  # type: ignore[attr-defined]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def settings(spec: Spec) -> dict[str, Any]:
    """A spec's settings by field name: what its detector's constructor receives."""
    if isinstance(spec, SectionView):
        return {name: getattr(spec, name) for name in spec if name != "type"}
    return {name: getattr(spec, name) for name in type(spec).model_fields if name != "type"}


def detector_for(spec: Spec) -> Detector:
    """The detector a validated spec describes."""
    return DETECTORS[spec.type](**settings(spec))


def detector_specs(specs: Sequence[Spec | Mapping[str, Any]]) -> list[Spec]:
    """Validated specs: spec objects and plan sections pass as they are, mappings are checked against the
    same schema."""
    if all(isinstance(spec, SectionView) for spec in specs):
        return list(specs)  # type: ignore[arg-type]
    from policies.loader import check_section
    from policies.monitor_schema import DETECTOR_SPECS, DetectorSpec

    if all(isinstance(spec, DETECTOR_SPECS) for spec in specs):
        return list(specs)  # type: ignore[arg-type]
    try:
        return check_section(list[DetectorSpec], [_raw(spec) for spec in specs], "detectors")
    except PolicyError as exc:
        raise DetectorSpecError("; ".join(exc.problems)) from None


def _raw(spec: object) -> object:
    """A spec object as it is; a plan section or another pydantic-like object through its dump, read as a
    mapping would be."""
    from policies.monitor_schema import DETECTOR_SPECS

    if isinstance(spec, SectionView):
        return spec.to_dict()
    if isinstance(spec, DETECTOR_SPECS) or not hasattr(spec, "model_dump"):
        return spec
    return spec.model_dump()


def build_detectors(specs: Sequence[Spec | Mapping[str, Any]]) -> list[Detector]:
    """Detectors from policy detector specs (the policy's `monitor.detectors`, or mappings in the same shape)."""
    return [detector_for(spec) for spec in detector_specs(specs)]
