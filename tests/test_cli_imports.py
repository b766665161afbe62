"""The offline console script imports only what it uses.

``inspect``, ``consolidate`` and ``export-lightning`` need neither Lightning nor
megatron-fsdp, so they import neither (and print no megatron warning such as "Transformer
Engine and Apex are not installed"); importing the package anywhere else still imports the
strategy, which registers ``strategy="megatron_fsdp"`` with Lightning. ``inspect`` (with
``--verify`` too) reads ``.metadata`` into plain records, so it does not import
``torch.distributed.checkpoint`` or DTensor either (``consolidate`` and ``export-lightning``
read through ``dcp.load``, so they do). Start-up times are a benchmark
(benchmarks/bench_cli_startup.py), not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_untrusted_checkpoints import checkpoints  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[1]
TORCH215 = ROOT / "tests" / "fixtures" / "torch215" / "checkpoint"
HEAVY = ("lightning", "megatron_fsdp", "torchmetrics")
DCP = ("torch.distributed.checkpoint", "torch.distributed.tensor")
_PROBE = f"""
import json, sys
sys.argv = ["lightning-megatron-fsdp", *sys.argv[1:]]
from lightning_megatron_fsdp.tools.cli import main
status = main()
watched = {HEAVY + DCP!r}
print(json.dumps({{"status": status, "loaded": [m for m in watched if m in sys.modules]}}))
"""


def _probe(argv: list[str]) -> tuple[dict[str, Any], str]:
    """Run the console script's ``main`` on ``argv`` in a fresh interpreter: its exit
    status and which watched modules it imported, and its stderr."""
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    return json.loads(probe.stdout.strip().splitlines()[-1]), probe.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["inspect", "--verify"],
        ["consolidate", "{out}/w.pt"],
        ["export-lightning", "{out}/m.ckpt"],
    ],
    ids=lambda c: c[0] + (" --verify" if "--verify" in c else ""),
)
def test_offline_commands_import_neither_lightning_nor_megatron(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    command: list[str],
) -> None:
    name, *rest = command
    argv = [name, str(checkpoints["intact"]), *[a.format(out=tmp_path) for a in rest]]
    result, stderr = _probe(argv)
    assert result["status"] == 0, result
    assert [m for m in result["loaded"] if m in HEAVY] == [], result
    assert "Warning" not in stderr and "warn" not in stderr.lower(), stderr
    script = Path(sys.executable).parent / "lightning-megatron-fsdp"
    if name == "inspect" and script.exists():  # the installed script itself: no stderr
        ran = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0 and ran.stderr == "", ran.stderr[-2000:]


@pytest.mark.parametrize(
    ("which", "options"),
    [
        ("intact", []),
        ("intact", ["--verify"]),
        ("intact", ["--verify", "--trust-checkpoint", "--json"]),
        ("torch 2.15", ["--verify"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_inspect_imports_neither_dcp_nor_dtensor(
    checkpoints: dict[str, Path],  # noqa: F811
    which: str,
    options: list[str],
) -> None:
    """``inspect`` reads the index as records: no ``torch.distributed.checkpoint`` (whose
    package import brings DTensor and sympy) for a checkpoint of this torch or of 2.15
    (six ``TensorProperties`` fields), checked or not, trusted or not."""
    path = TORCH215 if which == "torch 2.15" else checkpoints[which]
    result, stderr = _probe(["inspect", *options, str(path)])
    assert result == {"status": 0, "loaded": []}, (result, stderr[-2000:])


def test_consolidate_still_reads_through_dcp(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """Not vacuous: the probe sees DCP where a command does import it."""
    result, _ = _probe(["consolidate", str(checkpoints["intact"]), str(tmp_path / "w.pt")])
    assert result == {"status": 0, "loaded": list(DCP)}, result


def test_importing_the_package_elsewhere_registers_the_strategy() -> None:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import lightning_megatron_fsdp, sys\n"
            "from lightning.pytorch.strategies import StrategyRegistry\n"
            "print('megatron_fsdp' in StrategyRegistry,\n"
            "      'lightning_megatron_fsdp.strategies.strategy' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.stdout.split() == ["True", "True"], probe.stderr[-2000:]


def test_version_names_the_package_and_its_frameworks_without_importing_them() -> None:
    """``--version`` (what a bug report asks for) exits 0 with the installed versions of
    this package, torch, Lightning and megatron-fsdp, read from their metadata alone."""
    import importlib.metadata

    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys\n"
            "sys.argv = ['lightning-megatron-fsdp', '--version']\n"
            "from lightning_megatron_fsdp.tools.cli import main\n"
            "try:\n"
            "    main()\n"
            "except SystemExit as exit:\n"
            f"    watched = {HEAVY + DCP + ('torch',)!r}\n"
            "    loaded = [m for m in watched if m in sys.modules]\n"
            "    print(json.dumps({'status': exit.code, 'loaded': loaded}))\n",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    *printed, result = probe.stdout.strip().splitlines()
    assert json.loads(result) == {"status": 0, "loaded": []}, probe.stderr[-2000:]
    line = " ".join(printed)
    for package in ("lightning-megatron-fsdp", "torch", "lightning", "megatron-fsdp"):
        assert f"{package} {importlib.metadata.version(package)}" in line, line
