"""The offline console script imports only what it uses.

``inspect``, ``consolidate`` and ``export-lightning`` need neither Lightning nor
megatron-fsdp, so they import neither (and print no megatron warning such as "Transformer
Engine and Apex are not installed"); importing the package anywhere else still imports the
strategy, which registers ``strategy="megatron_fsdp"`` with Lightning. Start-up times are a
benchmark (benchmarks/bench_cli_startup.py), not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_untrusted_checkpoints import checkpoints  # noqa: F401 (the fixture)

ROOT = Path(__file__).resolve().parents[1]
_PROBE = """
import json, sys
sys.argv = ["lightning-megatron-fsdp", *sys.argv[1:]]
from lightning_megatron_fsdp.tools.cli import main
status = main()
heavy = ("lightning", "megatron_fsdp", "torchmetrics")
print(json.dumps({"status": status, "loaded": [m for m in heavy if m in sys.modules]}))
"""


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
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result == {"status": 0, "loaded": []}, result
    assert "Warning" not in probe.stderr and "warn" not in probe.stderr.lower(), probe.stderr
    script = Path(sys.executable).parent / "lightning-megatron-fsdp"
    if name == "inspect" and script.exists():  # the installed script itself: no stderr
        ran = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0 and ran.stderr == "", ran.stderr[-2000:]


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
