"""A folder's public face, imported on first use.

Each folder's ``__init__`` names what the layers above may use from it, mapped to the
module that holds it. The names are imported when first asked for, so that reaching one
light helper (``inspect`` reading a manifest) does not import the folder's heavy modules
(torch's DCP and DTensor) along with it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__all__``, ``__getattr__`` and ``__dir__`` of ``package``, whose public names
    are ``exports`` (a submodule, relative to ``package`` -> the names it defines)."""
    namespace = sys.modules[package].__dict__
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's own name
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - the module hook's own name
        return sorted([*namespace, *where])

    return sorted(where), __getattr__, __dir__
