"""Whether this run is CI, and what a test whose prerequisite is missing does there.

CI services set ``CI`` to ``true`` or ``1``; ``.ci/run`` sets ``CI=true``. Under CI a test
must never pass by skipping: a missing prerequisite (the other megatron-fsdp's interpreter,
the ``weed`` binary, litgpt) fails it; elsewhere it skips, saying why.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["in_ci", "skip_or_fail"]

TRUTHY = frozenset({"1", "true", "yes", "on", "y"})


def in_ci() -> bool:
    """Whether ``CI`` is set to a truthy value (``1``, ``true``, ``yes``, ``on``, ``y``, any
    case), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() in TRUTHY


def skip_or_fail(reason: str) -> None:
    """Fail under CI (naming ``CI``'s value and the reason), skip elsewhere."""
    if in_ci():
        pytest.fail(f"CI={os.environ['CI']} but {reason} (a test may not skip in CI)")
    pytest.skip(reason)
