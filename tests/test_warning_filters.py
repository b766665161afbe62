"""The suite silences only named third-party warnings, so ours are seen.

``pyproject.toml``'s ``filterwarnings`` (the pytest process) and
``tests.harness.THIRD_PARTY_WARNINGS`` (``PYTHONWARNINGS`` of the processes tests start)
each name a message and a module. A blanket filter (``ignore::UserWarning``,
``PYTHONWARNINGS=ignore``) would hide this package's own warnings, which tests assert
where they matter, and which a failing test's output should show. Pure inspection: fast.
"""

from __future__ import annotations

import os
import re
import subprocess
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


def _fresh_interpreter(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a new interpreter with Python's default warning filters (no
    ``PYTHONWARNINGS``), this checkout first on its path, from outside it."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("WARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_importing_the_package_prints_no_warning_and_leaves_no_filter() -> None:
    """megatron-fsdp's "Transformer Engine and Apex are not installed" (every CPU install)
    is ignored for the package's import only: no warning line, no filter left behind, and
    the user's own warnings, that one included, still show afterwards."""
    control = _fresh_interpreter("import megatron_fsdp")
    assert "Transformer Engine and Apex are not installed" in control.stderr, control.stderr
    ran = _fresh_interpreter(
        "import warnings\n"
        "import lightning_megatron_fsdp\n"
        "assert not [f for f in warnings.filters if f[1] is not None and 'Apex' in f[1].pattern]\n"
        "warnings.warn('a warning of the user')\n"
        "warnings.warn_explicit('Transformer Engine and Apex are not installed, again',\n"
        "                       UserWarning, 'x.py', 1, module='megatron_fsdp.user')\n"
    )
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if "Warning:" in line]
    assert len(lines) == 2, ran.stderr
    assert "a warning of the user" in lines[0] and "again" in lines[1], ran.stderr


def test_known_dependency_warnings_are_ignored_only_while_a_run_lasts() -> None:
    """Each of ``KNOWN_WARNINGS`` is ignored between ``ignore_known_warnings`` and
    ``stop_ignoring`` where its module raises it, and only there: the same message from
    the user's module, and the user's own warnings, still show; afterwards the filters are
    as before, a filter added meanwhile kept."""
    from lightning_megatron_fsdp.known_warnings import (
        KNOWN_WARNINGS,
        ignore_known_warnings,
        stop_ignoring,
    )

    hook = (
        "Full backward hook is firing when gradients are computed with respect to module "
        "outputs since no inputs require gradients. See ..."
    )
    raised = [
        (
            "torch.distributed.c10d_logger",
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...",
            FutureWarning,
        ),
        (
            "torchdata.stateful_dataloader.stateful_dataloader",
            "'set_vital' is deprecated, please do not call",
            UserWarning,
        ),
        (
            "lightning.pytorch.utilities._pytree",
            "`isinstance(treespec, LeafSpec)` is deprecated, use ...",
            FutureWarning,
        ),
        ("lightning_megatron_fsdp.fabric.precision", hook, UserWarning),
        ("lightning.pytorch.core.module", hook, UserWarning),
    ]
    for pattern, _category, _module in KNOWN_WARNINGS:  # each entry is exercised
        assert any(re.match(pattern, message) for _, message, _ in raised), pattern

    def shown(message: str, category: type[Warning], module: str) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)
        return bool(caught)

    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the base the run's filters go in front of
        before = list(warnings.filters)
        added = ignore_known_warnings()
        assert len(added) == len(KNOWN_WARNINGS)
        for module, message, category in raised:
            assert not shown(message, category, module), module
            assert shown(message, category, "users_training_script"), module
        assert shown(hook, UserWarning, "lightning.pytorch.core.module_of_the_user")
        assert shown("a warning of the user", UserWarning, "users_training_script")
        warnings.filterwarnings("ignore", message="added during the run")
        meanwhile = warnings.filters[0]
        stop_ignoring(added)
        assert warnings.filters == [meanwhile, *before]
        for module, message, category in raised:
            assert shown(message, category, module), module
