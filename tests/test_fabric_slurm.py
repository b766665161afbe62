"""``fabric.launch()`` under SLURM with the Fabric ``MegatronFSDPStrategy``.

The tasks are started as ``srun`` starts them: one real process per task, each with the
variables SLURM gives a task (``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``,
``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_ID``, ``SLURM_JOB_NAME``,
``SLURM_NODELIST``) and ``MASTER_PORT`` as a batch script exports it; no torchrun variables
and no ``MASTER_ADDR`` (Lightning's ``SLURMEnvironment`` derives it from the node list).
Each task runs ``tests/scripts/fabric_slurm.py``: Fabric must pick ``SLURMEnvironment``,
start no processes of its own, and the strategy must form the process group from it, train,
save and load a checkpoint. Two layouts: one node with two tasks, two one-task "nodes".
A job named ``interactive`` or ``bash`` (``salloc``'s shell) is not SLURM's launch, as
Lightning decides; Fabric then launches the processes itself.

The Trainer strategy's SLURM run is ``tests/test_multinode.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy
from tests.harness import communicate_all, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fabric_slurm.py"
TIMEOUT = 240
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "GROUP_", "LOCAL_", "NODE_", "PL_")


def _without_launchers() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_VARIABLES
    }


def _task_env(
    procid: int, nodes: int, tasks_per_node: int, port: int, job_name: str = "train"
) -> dict[str, str]:
    """What ``srun --nodes N --ntasks-per-node T`` gives task ``procid`` (block layout)."""
    env = _without_launchers()
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        SLURM_NTASKS=str(nodes * tasks_per_node),
        SLURM_NTASKS_PER_NODE=str(tasks_per_node),
        SLURM_NNODES=str(nodes),
        SLURM_PROCID=str(procid),
        SLURM_LOCALID=str(procid % tasks_per_node),
        SLURM_NODEID=str(procid // tasks_per_node),
        SLURM_NODELIST="127.0.0.[1]" if nodes == 1 else "127.0.0.1,127.0.0.1",
        SLURM_JOB_ID="90210",
        SLURM_JOB_NAME=job_name,
        MASTER_PORT=str(port),
    )
    return env


@pytest.mark.parametrize(("nodes", "tasks_per_node"), [(1, 2), (2, 1)])
def test_fabric_launch_under_slurm_trains_saves_and_loads(
    nodes: int, tasks_per_node: int, tmp_path: Path
) -> None:
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), str(nodes), str(tasks_per_node)],
            env=_task_env(procid, nodes, tasks_per_node, port),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for procid in range(nodes * tasks_per_node)
    ]
    failed = [(c, o) for c, o in communicate_all(processes, TIMEOUT) if c != 0]
    assert not failed, "\n\n".join(f"exit code {c}:\n{o[-3000:]}" for c, o in failed)

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    pids = {p.pid for p in processes}
    for rank, report in enumerate(reports):
        assert report["environment"] == "SLURMEnvironment"
        # global, local, node rank and world size as SLURM numbered the task
        assert report["ranks"] == [rank, rank % tasks_per_node, rank // tasks_per_node, 2]
        assert report["group"] == [rank, 2, "gloo"]
        assert report["mesh"] == [2]
        # MASTER_ADDR was not given: it is the first host of SLURM_NODELIST
        assert report["master_addr"] == [None, "127.0.0.1"]
        # the group's two ranks are the two tasks started here: Fabric started none
        assert set(report["pid_peers"]) == pids
        assert report["rest"] == [] and report["step"] == 1
        assert report["loaded"] == report["saved"]  # bit-exact
        assert report["resumed"] == report["trained"]  # the step after the load, bit-exact
        assert report["saved"] != report["trained"]
    assert reports[0]["trained"] == reports[1]["trained"]
    assert (tmp_path / "checkpoint" / "manifest.json").is_file()


@pytest.mark.parametrize(
    ("job_name", "environment"),
    [
        ("train", SLURMEnvironment),
        ("interactive", LightningEnvironment),
        ("bash", LightningEnvironment),
    ],
)
def test_interactive_job_names_are_not_slurm_launches(
    job_name: str, environment: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside ``salloc``'s shell (job name ``interactive`` or ``bash``) Lightning does not
    treat the process as an ``srun`` task: Fabric launches the two processes itself."""
    for name in set(os.environ) - set(_without_launchers()):
        monkeypatch.delenv(name)
    for name, value in _task_env(0, 1, 2, free_port(), job_name).items():
        monkeypatch.setenv(name, value)
    strategy = MegatronFSDPStrategy()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    assert type(fabric.strategy.cluster_environment) is environment
    assert strategy.cluster_environment is fabric.strategy.cluster_environment
    # An srun task was started by SLURM; otherwise Fabric's launcher starts the processes.
    assert (strategy.launcher is None) == (environment is SLURMEnvironment)
    assert torch.distributed.is_initialized() is False
