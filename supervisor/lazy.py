"""A package's names, imported on first use (PEP 562): the `__getattr__` a package's `__init__` exports.

A package that re-exports its modules' names would import every module when any one of them is wanted; with
this, `import policies.history` builds no schema and `import supervisor.runtime.plan` imports no torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """`package`'s `__getattr__`: a name of `where` (name -> module) is imported from its module on first use
    and kept in the package; any other name is an AttributeError, as for a plain module."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
