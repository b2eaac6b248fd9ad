"""The `monitor:` section: detector specs, extra classifier patterns and the preemption notice."""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from policies.base import Spec, problem, show
from policies.replay_schema import ReplayConfig

Mode = Literal["min", "max"]


class NonFiniteSpec(Spec):
    """Fire when a watched metric is NaN or infinite."""

    TAG: ClassVar[str] = "non_finite"
    type: Literal["non_finite"] = Field(description="Detector kind: `non_finite` fires on NaN or ±inf.")
    metrics: list[str] = Field(
        default_factory=lambda: ["loss"],
        min_length=1,
        description="Metric names to watch; any NaN or ±inf value fires the detector.",
    )


class SpikeSpec(Spec):
    """Fire when a value jumps more than `sigmas` deviations above the baseline of its rolling window."""

    TAG: ClassVar[str] = "spike"
    type: Literal["spike"] = Field(description="Detector kind: `spike` fires on a sudden jump of one metric.")
    metric: str = Field("loss", min_length=1, description="Metric to watch.")
    window: int = Field(128, ge=2, description="Number of recent points the baseline is computed over.")
    sigmas: float = Field(
        6.0, gt=0, allow_inf_nan=False, description="How many deviations above the baseline count as a spike."
    )
    warmup_steps: int = Field(
        200, ge=0, description="Steps at the start of training during which spikes are ignored."
    )
    min_history: int = Field(
        32, ge=2, description="Points the window must hold before the detector may fire; at most `window`."
    )

    @model_validator(mode="after")
    def _history_fits_window(self) -> SpikeSpec:
        if self.min_history > self.window:
            raise problem("min_history", f"an integer <= window ({self.window})", self.min_history)
        return self


class DivergenceSpec(Spec):
    """Fire when the rolling mean stays above `factor` x its best value for `patience` consecutive points."""

    TAG: ClassVar[str] = "divergence"
    type: Literal["divergence"] = Field(description="Detector kind: `divergence` fires on a sustained rise.")
    metric: str = Field("loss", min_length=1, description="Metric to watch (lower is better).")
    window: int = Field(200, ge=1, description="Number of points in the rolling mean.")
    factor: float = Field(
        1.5,
        gt=1,
        allow_inf_nan=False,
        description="The rolling mean must exceed this multiple of the best rolling mean seen so far.",
    )
    patience: int = Field(
        50, ge=1, description="Consecutive points the rolling mean must stay above the bound before firing."
    )


class ThresholdSpec(Spec):
    """Fire when a metric leaves a fixed band."""

    TAG: ClassVar[str] = "threshold"
    type: Literal["threshold"] = Field(description="Detector kind: `threshold` fires outside a fixed band.")
    metric: str = Field(min_length=1, description="Metric to watch (required).")
    above: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Fire when the value is greater than this; null for no upper bound.",
    )
    below: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Fire when the value is less than this; null for no lower bound.",
    )

    @model_validator(mode="after")
    def _has_a_bound(self) -> ThresholdSpec:
        if self.above is None and self.below is None:
            raise problem("", "at least one of above or below", raw="neither")
        if self.above is not None and self.below is not None and self.below >= self.above:
            raise problem(
                "below", f"a number < above ({self.above:g}) or the band is always crossed", self.below
            )
        return self


class PlateauSpec(Spec):
    """Fire when a metric has not improved by `min_delta` for `patience` evaluations."""

    TAG: ClassVar[str] = "plateau"
    type: Literal["plateau"] = Field(description="Detector kind: `plateau` fires when progress stalls.")
    metric: str = Field("val_loss", min_length=1, description="Metric to watch, usually a validation metric.")
    mode: Mode = Field("min", description="`min` if lower is better, `max` if higher is better.")
    patience: int = Field(10, ge=1, description="Evaluations without improvement before firing.")
    min_delta: float = Field(
        0.001, ge=0, allow_inf_nan=False, description="Smallest change that counts as an improvement."
    )


class HangSpec(Spec):
    """Fire when no heartbeat or metric arrives for `seconds`."""

    TAG: ClassVar[str] = "hang"
    type: Literal["hang"] = Field(description="Detector kind: `hang` fires when the run goes silent.")
    seconds: float = Field(
        600,
        gt=0,
        allow_inf_nan=False,
        description="Seconds of silence (no heartbeat, no metric) before firing.",
    )


class StragglerSpec(Spec):
    """Fire when one rank's step takes `factor` x the other ranks' median for `patience` consecutive steps."""

    TAG: ClassVar[str] = "straggler"
    type: Literal["straggler"] = Field(
        description="Detector kind: `straggler` fires when one rank is persistently slower than the others "
        "(under torchrun; each rank's time is what it spends outside the step's agreement)."
    )
    factor: float = Field(
        2.0,
        gt=1,
        allow_inf_nan=False,
        description="The slow rank's step time must be at least this multiple of the other ranks' median.",
    )
    patience: int = Field(
        5, ge=1, description="Consecutive steps the same rank must be that slow before firing."
    )
    min_gap_seconds: float = Field(
        0.05,
        ge=0,
        allow_inf_nan=False,
        description="And at least this many seconds slower than the median: tiny steps jitter by large factors.",
    )


#: Any one detector's settings; each field's default and bounds are defined here and nowhere else.
AnyDetectorSpec = (
    NonFiniteSpec | SpikeSpec | DivergenceSpec | ThresholdSpec | PlateauSpec | HangSpec | StragglerSpec
)
DetectorSpec = Annotated[AnyDetectorSpec, Field(discriminator="type")]
DETECTOR_SPECS: tuple[type[Spec], ...] = (
    NonFiniteSpec,
    SpikeSpec,
    DivergenceSpec,
    ThresholdSpec,
    PlateauSpec,
    HangSpec,
    StragglerSpec,
)
DETECTOR_TYPES: tuple[str, ...] = tuple(cls.TAG for cls in DETECTOR_SPECS)  # type: ignore[attr-defined]


ClassifiedExit = Literal["preemption", "hardware_fault", "oom", "software_error", "unknown_exit"]


class ClassifierPattern(Spec):
    """An extra exit-classifier rule: a log line matching `pattern` means the process died of `type`."""

    type: ClassifiedExit = Field(description="Exit type to report when the pattern matches.")
    pattern: str = Field(
        min_length=1,
        description="Python regular expression, matched case-insensitively against each log line.",
    )
    priority: int = Field(
        100,
        description="When several rules match one exit the highest priority wins; built-in rules use 90 and "
        "below, so the default beats them all.",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value, re.IGNORECASE | re.MULTILINE)
        except re.error as exc:
            raise problem("", "a valid regular expression", raw=f"{show(value)} ({exc})") from None
        return value


class PreemptionNotice(Spec):
    """Where to poll for the cloud's advance preemption notice."""

    provider: Literal["none", "aws", "gcp", "azure"] = Field(
        "none", description="Cloud whose metadata service announces preemption; `none` disables polling."
    )
    endpoint: str | None = Field(
        None,
        description="Metadata URL to poll instead of the provider's default; only with a provider other than none.",
    )
    poll_seconds: float = Field(5.0, gt=0, allow_inf_nan=False, description="Seconds between polls.")

    @model_validator(mode="after")
    def _endpoint_needs_provider(self) -> PreemptionNotice:
        if self.provider == "none" and self.endpoint is not None:
            raise problem(
                "endpoint", "null when provider is none (set provider: aws, gcp or azure)", self.endpoint
            )
        return self


class MonitorConfig(Spec):
    """What the monitor watches and how often."""

    poll_seconds: float = Field(2.0, gt=0, allow_inf_nan=False, description="Seconds between metric polls.")
    detectors: list[DetectorSpec] = Field(
        default_factory=list,
        description="Anomaly detectors run on every new metric point; each `type` has its own keys.",
    )
    classifier_patterns: list[ClassifierPattern] = Field(
        default_factory=list,
        description="Extra rules for classifying a dead process from its log, tried before the built-in ones.",
    )
    preemption_notice: PreemptionNotice = Field(
        default_factory=PreemptionNotice, description="Advance preemption notice polled from the cloud."
    )
    replay: ReplayConfig = Field(
        default_factory=ReplayConfig,
        description="Replay a non-finite value or a spike from a memory snapshot before deciding: data or hardware?",
    )

    @model_validator(mode="after")
    def _hang_outlasts_polling(self) -> MonitorConfig:
        for i, spec in enumerate(self.detectors):
            if isinstance(spec, HangSpec) and spec.seconds <= self.poll_seconds:
                raise problem(
                    f"detectors.{i}.seconds",
                    f"a number > monitor.poll_seconds ({self.poll_seconds:g})",
                    spec.seconds,
                )
        return self
