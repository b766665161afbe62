"""The strategy launches by itself (``devices=2``) and under ``torchrun``, with equal results.

Each launch runs ``tests/scripts/strategy_fit.py`` in fresh interpreters, exactly as a
user would: Lightning's subprocess launcher re-runs the script for rank 1, while torchrun
starts both ranks and Lightning picks up its environment. Each launch must train like one
plain process on the same global batches (losses and every parameter, assembled from both
ranks' shards), both must train to the same bits, and every process must exit cleanly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from tests.harness import THIRD_PARTY_WARNINGS, run_command
from tests.scripts.strategy_fit import BATCH, LR, STEPS, Model, dataset
from tests.test_strategy import ATOL, _global_batches

SCRIPT = Path(__file__).parent / "scripts" / "strategy_fit.py"
REPO = Path(__file__).parent.parent


def _launch(command: list[str], out_dir: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": THIRD_PARTY_WARNINGS}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    # Every process of the launch (Lightning's rank 1, torchrun's workers) dies with the test.
    completed = run_command(command, cwd=str(REPO), env=env, timeout=240)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-4000:]
    # A process that exits with live process-group threads aborts with this message.
    assert "terminate called" not in output, output[-4000:]
    reports = sorted(out_dir.glob("rank*.json"))
    assert [p.name for p in reports] == ["rank0.json", "rank1.json"], output[-4000:]
    return [json.loads(p.read_text()) for p in reports]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The script's model trained in this process on the global batches of both ranks."""
    pl.seed_everything(0, verbose=False)
    model = Model()
    data = dataset()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for rows in _global_batches(len(data), 2, BATCH, STEPS):
        loss = model.loss(data[rows])
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"losses": losses, "params": dict(model.named_parameters())}


def _assert_matches_reference(reports: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Each rank's losses, and the parameters assembled from both ranks' shards, equal the
    single-process run's within fp32 reduction-order noise."""
    for report in reports:
        np.testing.assert_allclose(report["losses"], reference["losses"], rtol=0, atol=ATOL)
    assert sorted(reports[0]["shards"]) == sorted(reference["params"])
    for name, parameter in reference["params"].items():
        full = torch.full(parameter.shape, float("nan"))
        written = torch.zeros(parameter.shape[0], dtype=torch.int64)
        for report in reports:
            first, local = report["first_rows"][name], torch.tensor(report["shards"][name])
            full[first : first + len(local)] = local.reshape(-1, *parameter.shape[1:])
            written[first : first + len(local)] += 1
        assert bool((written == 1).all()), f"{name}: rows written {written.tolist()}"
        torch.testing.assert_close(full, parameter.detach(), rtol=0, atol=ATOL, msg=name)


@pytest.fixture(scope="module")
def self_launched(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("self_launched")
    return _launch([sys.executable, str(SCRIPT), str(out_dir)], out_dir)


def test_devices_2_self_launch_trains_on_two_ranks(
    self_launched: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    """``Trainer(devices=2)`` from a script: Lightning spawns rank 1 and both train like
    one process would."""
    for rank, report in enumerate(self_launched):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["environment"] == "LightningEnvironment"
        assert len(report["losses"]) == STEPS
    _assert_matches_reference(self_launched, reference)


def test_torchrun_matches_self_launch(
    self_launched: list[dict[str, Any]], reference: dict[str, Any], tmp_path: Path
) -> None:
    """``torchrun --nproc-per-node 2``: external launch, trains like one process, and
    bit-identically to the self-launch."""
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
    reports = _launch(command, tmp_path)
    _assert_matches_reference(reports, reference)
    for report, launched in zip(reports, self_launched, strict=True):
        assert report["environment"] == "TorchElasticEnvironment"
        assert report["losses"] == launched["losses"]
        assert report["shards"] == launched["shards"]
