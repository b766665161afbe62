"""The README's main command works: the example trains on 2 CPU processes, checkpoints,
resumes from ``last`` in a new process group, and plots the loss with the resume point."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from lightning_megatron_fsdp import inspect_checkpoint
from tests.harness import run_command

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _run(out: Path, *args: str) -> None:
    command = [
        sys.executable,
        str(EXAMPLE),
        "--out",
        str(out),
        "--checkpoint-every",
        "3",
        "--log-every",
        "1",
        *args,
    ]
    result = run_command(command, timeout=240)  # Lightning's rank 1 too, whatever happens
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stderr[-4000:]}"
    assert "terminate called" not in result.stderr


def test_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    _run(tmp_path, "--max-steps", "6")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert inspect_checkpoint(last).global_step == 6
    _run(tmp_path, "--max-steps", "9", "--ckpt-path", "last")

    assert inspect_checkpoint(last).global_step == 9
    assert inspect_checkpoint(last).world_size == 2
    periodic = sorted(p.name for p in (tmp_path / "checkpoints").glob("step=*.ckpt"))
    assert periodic == ["step=3.ckpt", "step=6.ckpt", "step=9.ckpt"]
    runs = sorted((tmp_path / "logs").glob("version_*"))
    assert [(run / "start_step.txt").read_text() for run in runs] == ["0", "6"]
    for run in runs:
        with (run / "metrics.csv").open() as handle:
            losses = [float(r["train_loss"]) for r in csv.DictReader(handle) if r["train_loss"]]
        assert losses and all(loss == loss for loss in losses)  # logged, and not NaN
    assert (tmp_path / "loss.png").stat().st_size > 10_000
