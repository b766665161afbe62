"""The strategy launches by itself (``devices=2``) and under ``torchrun``, with equal results.

Each launch runs ``tests/scripts/strategy_fit.py`` in fresh interpreters, exactly as a
user would: Lightning's subprocess launcher re-runs the script for rank 1, while torchrun
starts both ranks and Lightning picks up its environment. Both must train to the same
bits, and every process must exit cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Launching is version-independent: CI runs it on megatron-fsdp 0.6.1 only (README).
pytestmark = pytest.mark.single_version

SCRIPT = Path(__file__).parent / "scripts" / "strategy_fit.py"
REPO = Path(__file__).parent.parent


def _launch(command: list[str], out_dir: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    completed = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    # A process that exits with live process-group threads aborts with this message.
    assert "terminate called" not in output, output[-4000:]
    reports = sorted(out_dir.glob("rank*.json"))
    assert [p.name for p in reports] == ["rank0.json", "rank1.json"], output[-4000:]
    return [json.loads(p.read_text()) for p in reports]


@pytest.fixture(scope="module")
def self_launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("self_launched")
    return _launch([sys.executable, str(SCRIPT), str(out_dir)], out_dir)


def test_devices_2_self_launch_trains_on_two_ranks(self_launched: list[dict[str, Any]]) -> None:
    """``Trainer(devices=2)`` from a script: Lightning spawns rank 1 and both train."""
    for rank, report in enumerate(self_launched):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["environment"] == "LightningEnvironment"
        assert len(report["losses"]) == 3
    assert self_launched[0]["losses"] == self_launched[1]["losses"]  # globally reduced


def test_torchrun_matches_self_launch(self_launched: list[dict[str, Any]], tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2``: external launch, bit-identical training."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        str(tmp_path),
    ]
    for report, reference in zip(_launch(command, tmp_path), self_launched, strict=True):
        assert report["environment"] == "TorchElasticEnvironment"
        assert report["losses"] == reference["losses"]
        assert report["shards"] == reference["shards"]
