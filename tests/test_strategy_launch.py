"""The strategy launches by itself (``devices=2``) and under ``torchrun``, with equal results.

Each launch runs ``tests/scripts/strategy_fit.py`` in fresh interpreters, exactly as a
user would: Lightning's subprocess launcher re-runs the script for rank 1, while torchrun
starts both ranks and Lightning picks up its environment. Each launch must train like one
plain process on the same global batches (losses and every parameter, assembled from both
ranks' shards), both must train to the same bits, and every process must exit cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from tests.harness import THIRD_PARTY_WARNINGS, spawned
from tests.scripts.strategy_fit import BATCH, LR, STEPS, Model, dataset
from tests.test_strategy import ATOL, _global_batches

SCRIPT = Path(__file__).parent / "scripts" / "strategy_fit.py"
REPO = Path(__file__).parent.parent


def _launch_together(
    launches: dict[str, tuple[list[str], Path]],
) -> dict[str, list[dict[str, Any]]]:
    """Run each launch ``name: (command, out_dir)`` at the same time; each one's reports.

    Side by side because Lightning's own launcher starts rank 1 only after rank 0 has
    imported everything, leaving a core idle that the other launch uses.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": THIRD_PARTY_WARNINGS}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(key, None)
    results = {}
    # Every process of a launch (Lightning's rank 1, torchrun's workers) dies with the test.
    with contextlib.ExitStack() as stack:
        processes = {
            name: stack.enter_context(spawned(command, cwd=str(REPO), env=env))
            for name, (command, _) in launches.items()
        }
        for name, process in processes.items():
            stdout, stderr = process.communicate(timeout=240)
            output = stdout + stderr
            assert process.returncode == 0, (name, output[-4000:])
            # A process that exits with live process-group threads aborts with this message.
            assert "terminate called" not in output, (name, output[-4000:])
            reports = sorted(launches[name][1].glob("rank*.json"))
            assert [p.name for p in reports] == ["rank0.json", "rank1.json"], output[-4000:]
            results[name] = [json.loads(p.read_text()) for p in reports]
    return results


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
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Both launches of the script: ``devices=2`` from the script, and torchrun."""
    self_dir, torchrun_dir = (tmp_path_factory.mktemp(n) for n in ("self", "torchrun"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return _launch_together(
        {
            "self": ([sys.executable, str(SCRIPT), str(self_dir)], self_dir),
            "torchrun": ([*torchrun, "--nproc-per-node", "2", str(SCRIPT), str(torchrun_dir)],
                         torchrun_dir),
        }
    )  # fmt: skip


def test_devices_2_self_launch_trains_on_two_ranks(
    launched: dict[str, list[dict[str, Any]]], reference: dict[str, Any]
) -> None:
    """``Trainer(devices=2)`` from a script: Lightning spawns rank 1 and both train like
    one process would."""
    for rank, report in enumerate(launched["self"]):
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["environment"] == "LightningEnvironment"
        assert len(report["losses"]) == STEPS
    _assert_matches_reference(launched["self"], reference)


def test_torchrun_matches_self_launch(
    launched: dict[str, list[dict[str, Any]]], reference: dict[str, Any]
) -> None:
    """``torchrun --nproc-per-node 2``: external launch, trains like one process, and
    bit-identically to the self-launch."""
    reports = launched["torchrun"]
    _assert_matches_reference(reports, reference)
    for report, self_launched in zip(reports, launched["self"], strict=True):
        assert report["environment"] == "TorchElasticEnvironment"
        assert report["losses"] == self_launched["losses"]
        assert report["shards"] == self_launched["shards"]
