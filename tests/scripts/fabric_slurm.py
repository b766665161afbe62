"""A Fabric loop with the Fabric ``MegatronFSDPStrategy`` under SLURM; each rank reports.

Launched by ``tests/test_fabric_slurm.py`` as the tasks ``srun`` starts, each with the
environment SLURM gives a task (no torchrun variables, no ``MASTER_ADDR``)::

    python tests/scripts/fabric_slurm.py OUT_DIR NUM_NODES DEVICES

``fabric.launch()`` must pick ``SLURMEnvironment`` and start no processes of its own; the
strategy joins the process group from it. The loop trains 2 steps and saves after the
first, then a fresh model and optimizer load that checkpoint and train the second step
again. Each rank writes ``OUT_DIR/rank<r>.json``: what Fabric and the process group saw, and
the full weights after save, after load and after each second step.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_megatron_fsdp import full_tensor
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy
from tests.models import PackedBlock, build_packed_lm, lm_loss, make_batch


def _full(model: torch.nn.Module) -> dict[str, list[float]]:
    return {n: full_tensor(p).flatten().tolist() for n, p in model.named_parameters()}


def _step(fabric: Fabric, model: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    batch = make_batch(i * fabric.world_size + fabric.global_rank)
    fabric.backward(lm_loss(model, batch))
    optimizer.step()
    optimizer.zero_grad()


def main(out: Path, num_nodes: int, devices: int) -> None:
    master_addr_before = os.environ.get("MASTER_ADDR")
    strategy = MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=timedelta(seconds=60))
    fabric = Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy)
    fabric.launch()
    report = {
        "environment": type(fabric.strategy.cluster_environment).__name__,
        "ranks": [fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size],
        "group": [dist.get_rank(), dist.get_world_size(), dist.get_backend()],
        "mesh": list(strategy.device_mesh.shape),
        "master_addr": [master_addr_before, os.environ.get("MASTER_ADDR")],
        "pid_peers": fabric.all_gather(torch.tensor([os.getpid()])).flatten().tolist(),
    }

    model = fabric.setup_module(build_packed_lm(0))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.05))
    _step(fabric, model, optimizer, 0)
    checkpoint = out / "checkpoint"
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "step": 1})
    report["saved"] = _full(model)
    _step(fabric, model, optimizer, 1)
    report["trained"] = _full(model)

    fresh = fabric.setup_module(build_packed_lm(1))  # other weights: the load must replace them
    fresh_optimizer = fabric.setup_optimizers(torch.optim.Adam(fresh.parameters(), lr=0.05))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    report["rest"] = sorted(fabric.load(checkpoint, state))
    report["step"] = state["step"]
    report["loaded"] = _full(fresh)
    _step(fabric, fresh, fresh_optimizer, 1)
    report["resumed"] = _full(fresh)
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
