"""The validated policy as plain data: what the supervisor hands a training process in its launch plan, and
the light view that process reads it through.

The supervisor validated the policy already; a training process reading it again would build the pydantic
schema (~0.1 s of its start-up) to learn nothing new. So the plan carries two plain forms of the same policy:
`values`, every setting with its defaults filled in (what the view reads), and `given`, the settings the file
set (what `PolicyView.model()` validates again, only when an anomaly must be decided: a section's validators
may tell a key the file set from one left at its default).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.schema import Policy


def policy_data(policy: Policy) -> dict[str, Any]:
    """A validated policy as the JSON data a launch plan carries (`PolicyView.of` reads it back)."""
    return {
        "values": policy.model_dump(mode="json", by_alias=True),
        "given": policy.model_dump(mode="json", by_alias=True, exclude_unset=True),
    }


class SectionView:
    """Read-only attribute access to one section of a validated policy's values (`async_` reads `async`)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        key = name if name in values or not name.endswith("_") else name[:-1]  # a keyword's alias: async_
        try:
            return _view(values[key])
        except KeyError:
            raise AttributeError(f"policy section has no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the policy is read-only: cannot set {name!r}")

    # Item access too, for a setting that is a mapping of the user's names (`script.relaunch.values`); no
    # `keys()`/`items()`: a method name would hide the setting of that name.
    def __getitem__(self, key: str) -> Any:
        return _view(self._values[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SectionView):
            return self._values == other._values
        return isinstance(other, Mapping) and dict(self._values) == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._values!r})"

    def to_dict(self) -> dict[str, Any]:
        """The section's values as plain data (keys as the file writes them: `async`), a copy."""
        import copy

        return copy.deepcopy(dict(self._values))


class PolicyView(SectionView):
    """A validated policy, read from a launch plan without pydantic: what a training process uses of it."""

    __slots__ = ("_given", "_model")

    def __init__(self, values: Mapping[str, Any], given: Mapping[str, Any]):
        super().__init__(values)
        object.__setattr__(self, "_given", given)
        object.__setattr__(self, "_model", None)

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> PolicyView:
        """The view of `policy_data(policy)`'s output."""
        return cls(data["values"], data["given"])

    def rule_for(self, event_type: str) -> tuple[int, SectionView] | None:
        """The first rule handling `event_type`, with its index (as `Policy.rule_for`)."""
        for index, rule in enumerate(self.rules):
            if event_type in rule.when:
                return index, rule
        return None

    def model(self) -> Policy:
        """The policy as the schema's model, for the decision engine: validated again on first use (imports
        pydantic and builds the schema, ~0.15 s), then kept."""
        if self._model is None:
            from policies.loader import check_section
            from policies.schema import Policy

            object.__setattr__(self, "_model", check_section(Policy, self._given, "the launch plan's policy"))
        return self._model


def as_model(policy: Policy | PolicyView) -> Policy:
    """The schema's model of `policy`, a model already or a plan's view."""
    return policy.model() if isinstance(policy, PolicyView) else policy


def _view(value: Any) -> Any:
    if isinstance(value, Mapping):
        return SectionView(value)
    if isinstance(value, list):
        return [_view(v) for v in value]
    return value
