"""The `target:` block of a rule: which checkpoint to relaunch from, built into a selector."""

from __future__ import annotations

import importlib
import inspect
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator

from policies import selectors
from policies.base import Spec, problem

Mode = Literal["min", "max"]
BUILTIN_SELECTORS: tuple[str, ...] = ("latest", "best", "before", "best_before")
#: The error type raised when `select` names neither a built-in nor a "module:function".
TARGET_SELECT_ERROR = "target_select"
CUSTOM_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


def _strict() -> Any:
    """The `strict` key every target kind has."""
    return Field(
        False,
        description="When no checkpoint matches this target: `false` falls back to the newest checkpoint the rule "
        "may relaunch from (valid, healthy unless `checkpoint.allow_nonfinite`, and for a rollback saved before "
        "the anomaly's onset), and the decision records `fallback: true` and why; `true` keeps to the target, so "
        "`allow_scratch` decides (restart from scratch, or fail). With no such checkpoint at all, `allow_scratch` "
        "decides either way.",
    )


class LatestTarget(Spec):
    """Relaunch from the newest valid checkpoint."""

    TAG: ClassVar[str] = "latest"
    select: Literal["latest"] = Field(description="`latest`: the newest valid checkpoint.")
    strict: bool = _strict()

    def build(self) -> selectors.Selector:
        return selectors.latest()


class BestTarget(Spec):
    """Relaunch from the valid checkpoint with the best metric."""

    TAG: ClassVar[str] = "best"
    select: Literal["best"] = Field(description="`best`: the valid checkpoint with the best `metric`.")
    metric: str = Field(min_length=1, description="Metric recorded with each checkpoint, e.g. val_loss.")
    mode: Mode = Field("min", description="`min` if lower is better, `max` if higher is better.")
    strict: bool = _strict()

    def build(self) -> selectors.Selector:
        return selectors.best(self.metric, self.mode)


class BeforeTarget(Spec):
    """Relaunch from the newest valid checkpoint at least `lookback_steps` before the anomaly's onset."""

    TAG: ClassVar[str] = "before"
    select: Literal["before"] = Field(
        description="`before`: the newest valid checkpoint at least `lookback_steps` before the onset."
    )
    lookback_steps: int = Field(
        ge=0, description="How many steps before the anomaly's onset the checkpoint must be."
    )
    strict: bool = _strict()

    def build(self) -> selectors.Selector:
        return selectors.before(self.lookback_steps)


class BestBeforeTarget(Spec):
    """Relaunch from the best valid checkpoint at least `lookback_steps` before the anomaly's onset."""

    TAG: ClassVar[str] = "best_before"
    select: Literal["best_before"] = Field(
        description="`best_before`: the best checkpoint by `metric` at least `lookback_steps` before the onset."
    )
    metric: str = Field(min_length=1, description="Metric recorded with each checkpoint, e.g. val_loss.")
    mode: Mode = Field("min", description="`min` if lower is better, `max` if higher is better.")
    lookback_steps: int = Field(
        ge=0, description="How many steps before the anomaly's onset the checkpoint must be."
    )
    strict: bool = _strict()

    def build(self) -> selectors.Selector:
        return selectors.best_before(self.metric, self.mode, self.lookback_steps)


class CustomTarget(Spec):
    """A user selector "module:function", imported when the policy loads; other keys are its options."""

    model_config = ConfigDict(extra="allow")
    TAG: ClassVar[str] = "custom"
    SHOWN_TAG: ClassVar[str] = '"module:function"'
    select: str = Field(
        pattern=CUSTOM_PATTERN,
        examples=["mypkg.selectors:healthy_loss_scale"],
        description='"module:function" of a custom selector, imported at load time and called as '
        "`function(catalogue, event, **options)` where options are this block's other keys but `strict`; the "
        "module must be "
        "importable (installed or on PYTHONPATH).",
    )
    strict: bool = _strict()
    _function: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _import(self) -> CustomTarget:
        module_name, _, attr = self.select.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:  # any failure of user code at import is a policy problem, not a crash
            raise problem(
                "select",
                'an importable "module:function"',
                raw=f'"{self.select}" ({type(exc).__name__}: {exc})',
            ) from None
        if not callable(function):
            raise problem("select", "a callable", raw=f'"{self.select}" ({type(function).__name__})')
        try:
            inspect.signature(function).bind(None, None, **self.options)
        except TypeError as exc:
            raise problem(
                "select", "a function accepting (catalogue, event, **options)", raw=f'"{self.select}" ({exc})'
            ) from None
        except ValueError:  # builtins without a signature: trust them
            pass
        self._function = function
        return self

    @property
    def options(self) -> dict[str, Any]:
        """The block's keys other than `select` and `strict`, passed to the function."""
        return dict(self.model_extra or {})

    def build(self) -> selectors.Selector:
        return selectors.custom(self.select, self._function, self.options)


def _target_tag(value: Any) -> str | None:
    select = value.get("select") if isinstance(value, dict) else getattr(value, "select", None)
    if select in BUILTIN_SELECTORS:
        return select
    if isinstance(select, str) and ":" in select:
        return CustomTarget.TAG
    return None


Target = Annotated[
    Annotated[LatestTarget, Tag("latest")]
    | Annotated[BestTarget, Tag("best")]
    | Annotated[BeforeTarget, Tag("before")]
    | Annotated[BestBeforeTarget, Tag("best_before")]
    | Annotated[CustomTarget, Tag("custom")],
    Discriminator(
        _target_tag,
        custom_error_type=TARGET_SELECT_ERROR,
        custom_error_message='select must be latest, best, before, best_before or "module:function"',
    ),
]
TARGET_MODELS: tuple[type[Spec], ...] = (
    LatestTarget,
    BestTarget,
    BeforeTarget,
    BestBeforeTarget,
    CustomTarget,
)
