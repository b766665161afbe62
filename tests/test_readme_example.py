"""The README's first command, as written, ends cleanly: every rank leaves with the parent.

The command (read from README.md, so the test follows it) trains the example at its default
sizes and resumes it: ``python examples/train_gpt.py --max-steps 150 && python
examples/train_gpt.py --max-steps 300 --ckpt-path last``, each run under Lightning's own
launcher (rank 1 its child). For each run: the parent exits 0, no process of the run
outlives it by more than ``OUTLIVE`` seconds, and no rank prints the exit hook's in-flight
line or an abort. At these sizes gloo's workers copy tensors large enough for torch to
start an OpenMP pool from the worker thread; the pool's threads carry the worker's name, and
an exit hook that took them for workers inside a collective waited its full 10 s in rank 1
and printed that line (20 steps, as in ``test_example.py``, never showed it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_megatron_fsdp import inspect_checkpoint
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "train_gpt.py"
OUTLIVE = 3.0  # seconds a run's other processes may outlive its parent
# What a rank prints when it leaves badly: the exit hook's line, a C++ abort, a signal.
BAD_LINES = ("still in flight", "terminate called", "Aborted", "core dumped", "Traceback")
# Variables a launcher around pytest may have set; a fresh shell, as in the README, has none.
LAUNCHED = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID"}


def readme_example_commands() -> list[list[str]]:
    """The example runs of the README's first command, each as its argument list."""
    block = re.search(r"```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
    assert block is not None, f"{README}: no bash block"
    runs = [
        part.split()
        for part in block.group(1).split(" && ")
        if part.startswith("python examples/train_gpt.py")
    ]
    assert len(runs) == 2, f"{README}: expected a first run and a resume, got {runs}"
    return runs


def _session_members(session: int) -> list[int]:
    """The processes still running in ``session`` (zombies count as gone)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the name: state, ppid, pgrp, session.
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _run(command: list[str], cwd: Path, log: Path) -> tuple[int, float | None]:
    """Run ``command`` in ``cwd``; (parent's exit code, seconds the last process outlived
    it, ``None`` if one was still running ``OUTLIVE`` s after it)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHED | {"OMP_NUM_THREADS"}}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, *command[1:]],  # `python` of the activated virtual environment
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # rank 1 joins the parent's session
        )
    try:
        code = process.wait(timeout=900)
        ended = time.monotonic()
        while _session_members(process.pid):
            if time.monotonic() - ended > OUTLIVE:
                return code, None
            time.sleep(0.05)
        return code, time.monotonic() - ended
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.timeout(1800)
def test_the_readme_example_command_exits_cleanly_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    shutil.copy(EXAMPLE, tmp_path / "examples" / EXAMPLE.name)  # outputs under tmp_path
    steps = []
    for index, command in enumerate(readme_example_commands()):
        log = tmp_path / f"run{index}.log"
        code, outlived = _run(command, tmp_path, log)
        output = log.read_text()
        tail = "\n".join(output.splitlines()[-6:])
        assert code == 0, f"{' '.join(command)} exited {code}:\n{tail}"
        assert outlived is not None, (
            f"{' '.join(command)}: a process of the run was still running {OUTLIVE} s after "
            f"the parent exited:\n{tail}"
        )
        bad = [line for line in output.splitlines() if any(b in line for b in BAD_LINES)]
        assert not bad, f"{' '.join(command)}: {bad}"
        last = tmp_path / "runs" / "gpt" / "checkpoints" / "last.ckpt"
        steps.append(inspect_checkpoint(last).global_step)
    assert steps == [150, 300]
