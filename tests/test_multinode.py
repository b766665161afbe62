"""Multi-node launches, simulated on one machine: two single-process "nodes", then one node.

Each "node" has its own local rank 0 (``LOCAL_RANK`` differs from ``RANK`` on node 1),
which is what breaks code that confuses the two: the commit of a checkpoint is rank 0's
alone, and the recovery of a ``last`` checkpoint a crash left renamed aside runs on every
rank before the process group exists. Two launchers are simulated:

* torchrun: two real ``torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank r``
  agents on loopback (``TorchElasticEnvironment``);
* SLURM: the variables ``srun --nodes 2 --ntasks-per-node 1`` sets (``SLURMEnvironment``).

Then the run resumes from ``ckpt_path="last"``, after its ``last`` was renamed aside as a
crash between the two renames of an overwrite would leave it, and must continue from the
saved weights bit-exactly and end where an uninterrupted 6-step run of the same script
ends, bit for bit: the torchrun run on one node with two processes (torchrun
``--standalone``), the SLURM run on its two nodes again, so the recovery and the resumed
run's commits also happen where node 1's local rank 0 is global rank 1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import communicate_all, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "multinode_fit.py"
TIMEOUT = 180


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "GROUP_", "LOCAL_", "NODE_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    env.update(extra)
    return env


def _wait(processes: list[subprocess.Popen[str]]) -> None:
    failed = [(c, o) for c, o in communicate_all(processes, TIMEOUT) if c != 0]
    assert not failed, "\n\n".join(f"exit code {c}:\n{o[-3000:]}" for c, o in failed)


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # communicate_all kills the agents' workers too
    )


def _fit_torchrun_two_nodes(out: Path) -> None:
    port = str(free_port())
    _wait(
        [
            _popen(
                [
                    sys.executable, "-m", "torch.distributed.run",
                    "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                    "--master-addr", "127.0.0.1", "--master-port", port,
                    str(SCRIPT), str(out), "2", "1", "4",
                ],
                _env(),
            )
            for node in range(2)
        ]
    )  # fmt: skip


def _fit_slurm_two_nodes(out: Path, *resume: str) -> None:
    port = str(free_port())
    steps = "6" if resume else "4"
    _wait(
        [
            _popen(
                [sys.executable, str(SCRIPT), str(out), "2", "1", steps, *resume],
                _env(
                    SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="2",
                    SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node),
                    SLURM_NODELIST="127.0.0.1", SLURM_JOB_ID="4242", SLURM_JOB_NAME="train",
                    MASTER_PORT=port,
                ),
            )
            for node in range(2)
        ]
    )  # fmt: skip


def _resume_one_node(out: Path) -> None:
    _wait(
        [
            _popen(
                [
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(SCRIPT), str(out), "1", "2", "6", "last",
                ],
                _env(),
            )
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same script trained 6 steps in one go (one node, two processes)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _wait(
        [
            _popen(
                [
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", str(SCRIPT), str(out), "1", "2", "6",
                ],
                _env(),
            )
        ]
    )  # fmt: skip
    return _reports(out, "fit")


def _reports(out: Path, tag: str) -> list[dict]:
    return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize(
    ("launcher", "environment"),
    [("torchrun", "TorchElasticEnvironment"), ("slurm", "SLURMEnvironment")],
)
def test_two_nodes_then_resume(
    launcher: str, environment: str, tmp_path: Path, uninterrupted: list[dict]
) -> None:
    """Rank-0-only commit and removal, and every-rank recovery of a renamed-aside ``last``,
    are right when local rank 0 != rank 0, under both launchers."""
    (_fit_torchrun_two_nodes if launcher == "torchrun" else _fit_slurm_two_nodes)(tmp_path)
    fit = _reports(tmp_path, "fit")
    assert [(r["global_rank"], r["local_rank"], r["node_rank"]) for r in fit] == [
        (0, 0, 0),
        (1, 0, 1),
    ]
    assert {r["environment"] for r in fit} == {environment}
    assert all(r["world_size"] == 2 and r["global_step"] == 4 for r in fit)
    checkpoints = tmp_path / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["epoch=0-step=4.ckpt", "last.ckpt"], names  # one commit each, no leftovers

    # A crash between the two renames of an overwrite leaves ``last`` renamed aside.
    last = checkpoints / "last.ckpt"
    saved_step = json.loads((last / "manifest.json").read_text())["global_step"]
    shutil.move(last, checkpoints / ".last.ckpt.old-0123456789abcdef")
    if launcher == "torchrun":
        _resume_one_node(tmp_path)  # local rank == global rank, one node
    else:
        _fit_slurm_two_nodes(tmp_path, "last")  # recovery where local rank 0 != rank 0
    resumed = _reports(tmp_path, "resume")
    assert last.is_dir()  # restored before Lightning looked for "last"
    for before, after in zip(fit, resumed, strict=True):
        if launcher == "torchrun":
            assert after["environment"] == "TorchElasticEnvironment"
            assert (after["local_rank"], after["node_rank"]) == (after["global_rank"], 0)
        else:
            assert after["environment"] == environment
            assert (after["local_rank"], after["node_rank"]) == (0, after["global_rank"])
        assert after["probes"]["start"] == before["probes"]["end"]  # bit-exact weights
        assert after["global_step"] == 6
    # The resumed run ends where the uninterrupted one does, bit for bit (every rank).
    for after, reference in zip(resumed, uninterrupted, strict=True):
        assert reference["global_step"] == 6
        assert after["probes"]["end"] == reference["probes"]["end"], (after, reference)
    # The resumed run committed its saves over the restored ``last`` and removed the older
    # top-1 checkpoint (both rank 0's filesystem work), leaving nothing hidden behind.
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["epoch=0-step=6.ckpt", "last.ckpt"], names
    assert json.loads((last / "manifest.json").read_text())["global_step"] == 6 != saved_step
