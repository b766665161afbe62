"""Every process of a finished run exits 0: no abort at interpreter exit.

A scheduler marks a job whose process exits 134 ("terminate called without an active
exception") as failed although its results were written. Each rank here is its own OS
process, launched as torchrun would (so each rank's exit code and stderr are seen; under
Lightning's own launcher rank 1's exit code never reaches anyone), running a 2-rank fit
with periodic async checkpoints, a forward after ``fit`` and a save after ``fit``.

The 20 runs fork each rank from a zygote that imported the libraries once
(:mod:`tests.prefork`): every rank is still a fresh process that runs the script as
``__main__`` and leaves through the interpreter's normal finalisation, where the abort
happens, but 40 launches no longer pay 40 imports (about 9 CPU-seconds each). One more
run starts the script the plain way, ``python script.py`` under Lightning's own launcher
(``devices=2``, rank 1 its child), as a cross-check. ``python -m tests.test_exit N``
launches N runs without the zygote, each rank ``python script.py``, as a diagnostic.

The same harness reproduces the cause without the strategy's exit hook, in every run, so
it can see an abort: gloo's worker thread needing the GIL (to free a finished collective's
tensors, or here to run a collective's Python callback) once the interpreter finalises
(pytorch/pytorch#190489; :mod:`lightning_megatron_fsdp.common.interpreter_exit`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import _rank_env, communicate_all, free_port
from tests.prefork import Zygote

SCRIPT = Path(__file__).parent / "scripts" / "exit_clean.py"
PENDING = Path(__file__).parent / "scripts" / "pending_gloo_work.py"
OPENMP_POOL = Path(__file__).parent / "scripts" / "openmp_pool_at_exit.py"
ROOT = Path(__file__).resolve().parents[1]
RUNS = 20
WORLD_SIZE = 2
# Runs of the distilled cause, with and without the exit hook each.
DISTILLED_RUNS = 4


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _rank_envs(world_size: int) -> list[dict[str, str]]:
    """torchrun's variables for each rank of one run, on a fresh port."""
    port = free_port()
    return [
        {**_env(), **_rank_env(rank, world_size, port), "TORCHELASTIC_RUN_ID": "exit-test"}
        for rank in range(world_size)
    ]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    with Zygote(_env()) as process:
        yield process


def fork_ranks(
    zygote: Zygote, script: Path, arguments: list[str], out: Path, timeout: float
) -> list[tuple[int, str]]:
    """Run ``script *arguments`` as 2 torchrun-style ranks forked from ``zygote``."""
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    return zygote.run(script, [arguments] * WORLD_SIZE, _rank_envs(WORLD_SIZE), logs, timeout)


def _launch(
    script: Path,
    arguments: list[str],
    envs: list[dict[str, str]],
    timeout: float,
    grace: float = 30.0,
) -> list[tuple[int, str]]:
    """Run ``python script *arguments`` once per environment, all at once; (rc, output) each
    (the others may take ``grace`` seconds more once one has failed)."""
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), *arguments],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # communicate_all kills its children too
        )
        for env in envs
    ]
    return communicate_all(processes, timeout, grace)


def launch_ranks(
    script: Path, argument: str, world_size: int, timeout: float
) -> list[tuple[int, str]]:
    """Run ``python script argument`` as ``world_size`` torchrun-style ranks; (rc, output)."""
    return _launch(script, [argument], _rank_envs(world_size), timeout)


def launch_under_lightning(script: Path, argument: str, timeout: float) -> tuple[int, str]:
    """Run ``python script argument`` alone: Lightning's own launcher starts rank 1.

    Rank 1 is Lightning's child and writes to the same pipe, so its output (an abort
    message included) is seen; its exit code reaches no one, which is why the runs above
    launch each rank themselves.
    """
    launched = {"TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"}
    env = {k: v for k, v in _env().items() if k not in launched}
    return _launch(script, [argument], [env], timeout)[0]


def _failures(run: str, results: list[tuple[int, str]]) -> list[str]:
    """Every rank that exited non-zero, printed the abort, or did not finish its work."""
    failures = []
    for rank, (code, output) in enumerate(results):
        if code != 0 or "terminate called" in output or f"finished rank {rank}" not in output:
            tail = "\n".join(output.splitlines()[-8:])
            failures.append(f"{run} rank {rank}: exit code {code}\n{tail}")
    return failures


@pytest.mark.timeout(600)
def test_fit_with_async_checkpoints_exits_cleanly_every_time(
    zygote: Zygote, tmp_path: Path
) -> None:
    """20 runs x 2 ranks, and one launch under Lightning's own launcher (no zygote, no
    per-rank environment): every process exits 0, finishes its work, and never aborts."""
    failures = []
    for run in range(RUNS):
        out = tmp_path / f"run{run}"
        failures += _failures(f"run {run}", fork_ranks(zygote, SCRIPT, [str(out)], out, 120))
        assert (out / "after_fit.ckpt" / "manifest.json").is_file()
    lightning = tmp_path / "lightning"
    code, output = launch_under_lightning(SCRIPT, str(lightning), 180)
    # Both ranks write to the one output: each must have finished in it, without an abort.
    failures += _failures("Lightning's launcher", [(code, output), (code, output)])
    assert (lightning / "after_fit.ckpt" / "manifest.json").is_file()
    assert not failures, f"{len(failures)} of {(RUNS + 1) * WORLD_SIZE} processes failed:\n" + (
        "\n".join(failures)
    )


def _aborted(code: int, output: str) -> bool:
    """Whether a process ended in the abort (SIGABRT after "terminate called"), not otherwise."""
    return code in (-6, 134) and "terminate called" in output


@pytest.mark.timeout(600)
def test_the_exit_hook_fixes_the_abort_of_gloo_workers_at_finalisation(
    zygote: Zygote, tmp_path: Path
) -> None:
    """The cause, isolated: a gloo worker thread that needs the GIL once the interpreter
    finalises aborts the process, unless the strategy's exit hook waited for it.

    Rank 0 leaves a collective in flight whose Python callback runs on gloo's worker; its
    peer joins the collective only when rank 0 lets it (``tests/scripts/pending_gloo_work.py``):
    without the hook, once rank 0 finalises, so rank 0 aborts in every run, the control
    that this harness sees the abort (only the abort counts: exit -6 or 134 with "terminate
    called"); with the hook, as rank 0 begins to leave, so the hook must wait for the
    collective, and every process of as many runs exits 0. The first run of each starts
    its ranks the plain way (``python script``, as torchrun does), the others fork them from
    the pre-imported zygote.
    """
    outcomes: dict[str, list[str]] = {}
    for variant in ("no_hook", "exit_hook"):
        outcomes[variant] = []
        for run in range(DISTILLED_RUNS):
            arguments = [variant]
            if run == 0:
                # Rank 0's abort can leave rank 1 in its waits (PEER_WAIT, gloo's timeout):
                # it ends on its own within them, and only rank 0's outcome counts here.
                launched = _launch(PENDING, arguments, _rank_envs(WORLD_SIZE), 150, grace=90)
            else:
                launched = fork_ranks(zygote, PENDING, arguments, tmp_path / f"{variant}{run}", 120)
            if variant == "exit_hook":
                outcomes[variant] += _failures(f"run {run}", launched)
            elif not _aborted(*launched[0]):  # rank 1, without the hook, may abort too
                tail = "\n".join(launched[0][1].splitlines()[-6:])
                outcomes[variant].append(f"run {run}: rank 0 exit code {launched[0][0]}\n{tail}")
    assert not outcomes["no_hook"], (
        "without the hook rank 0 did not abort in every run, so this harness cannot show "
        "the hook's effect:\n" + "\n".join(outcomes["no_hook"])
    )
    assert not outcomes["exit_hook"], "with the hook:\n" + "\n".join(outcomes["exit_hook"])


def test_an_openmp_pool_started_by_a_gloo_worker_does_not_hold_the_exit_hook(
    zygote: Zygote, tmp_path: Path
) -> None:
    """A collective on a large tensor starts an OpenMP pool from gloo's worker thread, its
    threads named like the worker; idle in the OpenMP runtime, they are not a collective in
    flight, so the hook's wait ends at once (it waited its full 10 s in the README's
    example, rank 1 outliving the parent and printing the in-flight line)."""
    for rank, (code, output) in enumerate(fork_ranks(zygote, OPENMP_POOL, [], tmp_path, 120)):
        assert code == 0 and f"finished rank {rank}" in output, output
        pool = re.search(r"openmp threads named like gloo's workers: (\d+)", output)
        assert pool is not None and int(pool.group(1)) > 0, f"no pool, nothing tested:\n{output}"
        assert "idle: True" in output, output


if __name__ == "__main__":  # pragma: no cover - a diagnostic loop: python -m tests.test_exit N
    count = int(sys.argv[1]) if len(sys.argv) > 1 else RUNS
    import tempfile

    bad = 0
    for run in range(count):
        with tempfile.TemporaryDirectory() as directory:
            for rank, (code, output) in enumerate(launch_ranks(SCRIPT, directory, WORLD_SIZE, 120)):
                if code != 0 or "terminate called" in output:
                    bad += 1
                    print(f"run {run} rank {rank}: rc={code}", output.splitlines()[-3:])
    print(f"bad={bad} of {count * WORLD_SIZE}")
