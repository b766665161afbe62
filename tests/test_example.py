"""The README's main command works: the example trains on 2 CPU processes, checkpoints,
resumes from ``last`` in a new process group mid-epoch, exactly as an uninterrupted run
trains, and plots both runs as one loss curve with the resume point marked. A fresh run
replaces an earlier run's checkpoints (no ``-v1`` files)."""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType

from lightning_megatron_fsdp import inspect_checkpoint
from tests.harness import free_port, spawned

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _runs(*runs: tuple[Path, tuple[str, ...]]) -> list[str]:
    """Run the example once per ``(out, args)``, as the README does, all at the same time.

    Lightning's own launcher starts rank 1 only once rank 0 has imported everything, so a
    run leaves a core idle for a while; two runs side by side fill it. Each run gets its
    own rendezvous port. Lightning's rank 1 is killed too, whatever happens. Returns each
    run's standard output (where Lightning's progress bar writes).
    """
    with contextlib.ExitStack() as stack:
        started = []
        for out, args in runs:
            command = [
                sys.executable, str(EXAMPLE), "--out", str(out),
                "--checkpoint-every", "3", "--log-every", "1", *args,
            ]  # fmt: skip
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            started.append((command, stack.enter_context(spawned(command, env=env))))
        outputs = []
        for command, process in started:
            stdout, stderr = process.communicate(timeout=240)
            outputs.append(stdout)
            assert process.returncode == 0, (
                f"{command} exited {process.returncode}:\n{stderr[-4000:]}"
            )
            assert "terminate called" not in stderr
    return outputs


def test_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    # The first half, and beside it the uninterrupted run the resume is compared with.
    # An earlier run's files: the fresh run (no --ckpt-path) deletes them, rather than saving
    # beside them as Lightning's last-v1.ckpt and step=3-v1.ckpt.
    for stale in ("last.ckpt", "step=3.ckpt", "step=12.ckpt"):
        (tmp_path / "checkpoints" / stale).mkdir(parents=True)
        (tmp_path / "checkpoints" / stale / "stale.txt").write_text("an earlier run")
    straight = tmp_path / "uninterrupted"
    first, _ = _runs((tmp_path, ("--max-steps", "6")), (straight, ("--max-steps", "9")))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert inspect_checkpoint(last).global_step == 6
    (second,) = _runs((tmp_path, ("--max-steps", "9", "--ckpt-path", "last")))

    assert inspect_checkpoint(last).global_step == 9
    assert inspect_checkpoint(last).world_size == 2
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["last.ckpt", "step=3.ckpt", "step=6.ckpt", "step=9.ckpt"], saved
    runs = sorted((tmp_path / "logs").glob("version_*"))
    assert [(run / "start_step.txt").read_text() for run in runs] == ["0", "6"]
    for run in runs:
        losses = _losses(run)
        assert losses and all(loss == loss for loss in losses.values())  # logged, not NaN
    assert (tmp_path / "loss.png").stat().st_size > 10_000

    # Both runs' progress bars name the epoch and count to where the run stops in it: the
    # resumed one continues the epoch's count (7-9 of 9), not "Training: 9/?".
    assert _bars(first) == {("Epoch 0", "6")}, first[-2000:]
    assert _bars(second) == {("Epoch 0", "9")}, second[-2000:]
    assert re.search(r"Epoch 0: 100%\|[^|]*\| 9/9", second), second[-2000:]

    # The resume is exact: mid-epoch (step 6 of a 625-step epoch), with a resumable loader
    # and the checkpointed RNG states, steps 7-9 equal an uninterrupted run's, to the bit.
    (uninterrupted,) = sorted((straight / "logs").glob("version_*"))
    resumed, reference = _losses(runs[1]), _losses(uninterrupted)
    assert sorted(resumed) == [6, 7, 8], resumed  # Lightning's step index: steps 7-9
    assert resumed == {step: reference[step] for step in resumed}, (resumed, reference)

    # loss.png plots the two runs as one curve, the resume marked: the curve is the
    # uninterrupted run's, every step once (no gap, no replayed step).
    steps, losses, resumes = _example().loss_curve(tmp_path / "logs")
    assert steps == list(range(9)) and resumes == [6], (steps, resumes)
    assert dict(zip(steps, losses, strict=True)) == reference


def _example() -> ModuleType:
    """The example script, imported as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bars(stdout: str) -> set[tuple[str, str]]:
    """(label, total) of every state of the training bar that had counted a batch."""
    states = re.findall(r"(Epoch \d+|Training): *(?:\d+%)?\|[^|]*\| (\d+)/(\d+|\?)", stdout)
    return {(label, total) for label, count, total in states if count != "0"}


def _losses(run: Path) -> dict[int, float]:
    """Logged train loss by step index (``log_every_n_steps=1``)."""
    with (run / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("train_loss")]
    return {int(r["step"]): float(r["train_loss"]) for r in rows}
