"""Save or load a checkpoint under this interpreter's megatron-fsdp, for cross-version tests.

``tests/test_cross_version.py`` and ``tests/test_upstream_checkpoint.py`` run one side of a
round trip in the pytest process and the other side here, under another virtual
environment's Python (another megatron-fsdp)::

    OTHER_PYTHON -m tests.scripts.cross_version JOB CHECKPOINT_DIR WORLD_SIZE OUT_FILE [...]

``JOB`` is one of :data:`JOBS`; several jobs (four arguments each) run one after another
in one interpreter, so the other side's imports are paid once. Each job runs on
``WORLD_SIZE`` gloo ranks (``tests.harness.run_distributed``); ``OUT_FILE`` receives
``torch.save`` of ``{"version": megatron-fsdp version, "ranks": [each rank's report]}``.
Each report holds
the rank's checkpoint state as :func:`tests.shard_facts.facts` (every shard with its true
row offset, so the pytest process reassembles full tensors whatever the world size) and
its logits on a probe batch.

The jobs are module-level functions so the pytest process runs the same code locally.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import megatron_fsdp
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_megatron_fsdp import (
    MegatronFSDPCheckpointIO,
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    load_full_weights,
)
from lightning_megatron_fsdp.common.sharded_checkpoint import load_into_sharded_model
from tests.harness import run_distributed
from tests.models import (
    bf16_policy,
    lm_loss,
    make_batch,
    sharded_packed_lm,
)
from tests.shard_facts import facts

__all__ = ["JOBS", "run_job"]

TIMEOUT = 240.0
STEPS = 2


def _build(world_size: int, seed: int | None, bf16: bool) -> tuple[Any, Any]:
    enable_cpu_execution()
    dtype = torch.bfloat16 if bf16 else torch.float32
    policy = bf16_policy() if bf16 else None
    return sharded_packed_lm(world_size, seed, dtype=dtype, mixed_precision_policy=policy)


def _train(model: Any, optimizer: Any, rank: int) -> None:
    for step in range(STEPS):
        lm_loss(model, make_batch(100 * step + rank)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _report(model: Any, optimizer: Any) -> dict[str, Any]:
    """This rank's state (shards with their true rows) and its logits on a probe batch."""
    model_state = get_model_state_dict(model)
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    with torch.no_grad():
        logits = model(make_batch(999)[0]).float()
    return {
        "state": facts({"state_dict": model_state, "optimizer_states": [optimizer_state]}),
        "logits": logits,
        "version": megatron_fsdp.__version__,
    }


def save_ours(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Train a bf16 ``PackedLM`` (fp32 main weights) and save it as the strategy does."""
    model, optimizer = _build(world_size, 0, bf16=True)
    _train(model, optimizer, rank)
    model_state = get_model_state_dict(model)
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    checkpoint = {"state_dict": model_state, "optimizer_states": [optimizer_state], "epoch": 0}
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, path)
    return _report(model, optimizer)


def load_ours(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Load a :func:`save_ours` checkpoint into a zero model as the strategy's resume does."""
    model, optimizer = _build(world_size, None, bf16=True)
    load_into_sharded_model(
        MegatronFSDPCheckpointIO(),
        path,
        model,
        [optimizer],
        weights_only=True,
        strict=True,
        allow_missing_optimizers=False,
    )
    return _report(model, optimizer)


def save_upstream(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Train an fp32 ``PackedLM`` and save it with megatron-fsdp's own ``save_checkpoint``."""
    from megatron_fsdp.experimental.checkpoint import save_checkpoint

    model, optimizer = _build(world_size, 0, bf16=False)
    _train(model, optimizer, rank)
    save_checkpoint(model, optimizer, path)
    return _report(model, optimizer)


def load_full_weights_job(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Load any full-weights source (a :func:`save_upstream` directory) with
    ``load_full_weights``, optimizer state included, into a zero fp32 model."""
    model, optimizer = _build(world_size, None, bf16=False)
    result = load_full_weights(model, path, optimizers=[optimizer])
    report = _report(model, optimizer)
    report["result"] = dataclasses.asdict(result) | {"source": str(result.source)}
    return report


JOBS = {
    "save-ours": save_ours,
    "load-ours": load_ours,
    "save-upstream": save_upstream,
    "load-full-weights": load_full_weights_job,
}


def run_job(job: str, path: str, world_size: int) -> dict[str, Any]:
    """Run ``job`` on ``world_size`` ranks; ``{"version": ..., "ranks": [reports]}``."""
    ranks = run_distributed(JOBS[job], world_size, path, timeout=TIMEOUT)
    return {"version": megatron_fsdp.__version__, "ranks": ranks}


def main(argv: list[str]) -> int:
    specs = [argv[i : i + 4] for i in range(0, len(argv), 4)]
    if not specs or any(len(spec) != 4 or spec[0] not in JOBS for spec in specs):
        print(
            f"usage: python -m tests.scripts.cross_version {{{','.join(JOBS)}}} "
            "CHECKPOINT_DIR WORLD_SIZE OUT_FILE [JOB CHECKPOINT_DIR WORLD_SIZE OUT_FILE ...]",
            file=sys.stderr,
        )
        return 2
    for job, path, world_size, out in specs:
        torch.save(run_job(job, path, int(world_size)), out)
    return 0


if __name__ == "__main__":
    # Through the importable module, so the ranks unpickle the jobs by their real name.
    from tests.scripts import cross_version

    sys.exit(cross_version.main(sys.argv[1:]))
