"""The suite silences only named third-party warnings, so ours are seen.

``pyproject.toml``'s ``filterwarnings`` (the pytest process) and
``tests.harness.THIRD_PARTY_WARNINGS`` (``PYTHONWARNINGS`` of the processes tests start)
each name a message and a module. A blanket filter (``ignore::UserWarning``,
``PYTHONWARNINGS=ignore``) would hide this package's own warnings, which tests assert
where they matter, and which a failing test's output should show. Pure inspection: fast.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

from tests.harness import THIRD_PARTY_WARNINGS

ROOT = Path(__file__).resolve().parents[1]
OUR_MODULES = (
    "lightning_megatron_fsdp.strategies.strategy",
    "lightning_megatron_fsdp.checkpoint.io",
)


def _action(message: str, category: type[Warning], module: str) -> str:
    """What ``warnings.filters`` does with a warning (the first filter that matches wins,
    as in ``warnings.warn_explicit``; line numbers are ignored: filters here use 0)."""
    for action, text, kind, where, _line in warnings.filters:
        if (
            (text is None or text.match(message))
            and issubclass(category, kind)
            and (where is None or where.match(module))
        ):
            return action
    return "default"


def _named(entry: str) -> bool:
    """An ``action:message:category:module`` filter that names its message and module."""
    fields = entry.split(":")
    return len(fields) >= 4 and all(field.strip() for field in fields[1:4])


def test_our_warnings_are_seen_in_the_pytest_process() -> None:
    """Under the suite's filters (pytest applies them to each test), any warning this
    package raises is shown, while the named third-party ones are silenced."""
    for module in OUR_MODULES:
        for category in (UserWarning, DeprecationWarning, FutureWarning, RuntimeWarning):
            action = _action("any message of ours", category, module)
            assert action != "ignore", (module, category.__name__)
    # The filters are in force here (not a vacuous pass): the named one still applies.
    third_party = _action(
        "Transformer Engine and Apex are not installed.",
        UserWarning,
        "megatron_fsdp.mixed_precision",
    )
    assert third_party == "ignore"


def test_every_filter_names_its_message_and_module(pytestconfig: pytest.Config) -> None:
    entries = pytestconfig.getini("filterwarnings")  # pyproject.toml's
    assert entries, "no filterwarnings: the test above would be vacuous"
    unnamed = [e for e in entries if e.startswith("ignore") and not _named(e)]
    assert not unnamed, f"blanket filters in pyproject.toml: {unnamed}"
    unnamed = [e for e in THIRD_PARTY_WARNINGS.split(",") if not _named(e)]
    assert not unnamed, f"blanket filters in tests.harness.THIRD_PARTY_WARNINGS: {unnamed}"


def test_processes_tests_start_get_the_named_filters_only() -> None:
    """Every place the tests set ``PYTHONWARNINGS`` sets ``THIRD_PARTY_WARNINGS``."""
    from tests import cross_version

    assert cross_version._env()["PYTHONWARNINGS"] == THIRD_PARTY_WARNINGS
    others = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"""["']PYTHONWARNINGS["']""", code) and "THIRD_PARTY" not in code:
                others.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not others, "PYTHONWARNINGS set to something else:\n" + "\n".join(others)
    assert sys.warnoptions == [] or all(_named(o) for o in sys.warnoptions), sys.warnoptions
