"""A rank that hangs during a save (stops answering without dying) costs the others one
timeout, not the job, and loses nothing.

A killed peer is easy: gloo sees the closed connection at once. A stopped one (SIGSTOP: a
swapped-out, deadlocked or frozen process) keeps its connections open, so its peers learn
of it only by the process group's timeout. Each run saves step 2 to ``last.ckpt`` through
``MegatronFSDPCheckpointIO(process_group=group)``, ``group`` a gloo group with a timeout of
a few seconds, then saves step 3 while rank 1 SIGSTOPs itself at a phase of the save
(inside DCP after writing its shards; in our commit, before the gather of the files'
digests). Rank 0 must raise ``CheckpointSaveError`` within about that timeout, naming the
phase it was in; rank 1 must still be stopped (not dead) then; ``last.ckpt`` must be step
2's, byte for byte, with no hidden directory left. Then rank 1 is killed, and a fresh 2-rank
run resumes from ``last.ckpt`` bit-exactly and takes the step the stopped run was saving.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_megatron_fsdp import CheckpointError
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.storage.format import parse_hidden_name, read_manifest
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.harness import run_distributed
from tests.scripts.fault_injection import (
    Fault,
    arm_commit_fault,
    checkpoint_dict,
    init_group,
    live_state,
    resume_optimizer,
    step,
    target_state,
    trained,
    writer_factory,
)
from tests.shard_facts import assert_same_facts, facts

HANG_TIMEOUT_S = 4.0  # the save's process group timeout
TIMEOUT = 120.0


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), or ``gone``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


def _hang_during_save(rank: int, world_size: int, root: str, phase: str) -> str:
    init_group(rank, world_size)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=HANG_TIMEOUT_S))
    pids: list[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    base = Path(root)
    path = base / "ckpt" / "last.ckpt"
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO(process_group=group)
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), path)
    torch.save(facts(live_state(model, adam)), base / f"step2-rank{rank}.pt")
    step(model, adam, 2)
    torch.save(facts(live_state(model, adam)), base / f"step3-rank{rank}.pt")
    dist.barrier()
    before = _tree(path) if rank == 0 else {}
    fault = Fault(phase, 1, "stop")
    in_writer = not phase.startswith("commit:")
    options = {"storage_writer_factory": writer_factory(fault)} if in_writer else None
    started = time.monotonic()
    try:
        with arm_commit_fault(None if in_writer else fault):
            plugin.save_checkpoint(checkpoint_dict(model, adam, 3), path, storage_options=options)
    except CheckpointError as err:
        elapsed = time.monotonic() - started
        peer = _process_state(pids[1])
        outcome = {
            "error": f"{type(err).__name__}: {err}",
            "elapsed": elapsed,
            "peer_state": peer,
            "unchanged": _tree(path) == before,
        }
        (base / "survivor.json").write_text(json.dumps(outcome))
        os.kill(pids[1], signal.SIGKILL)  # the hung rank, now that its peer has given up
        return "raised"
    return "returned without an error"


def _resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_group(rank, world_size)
    path = Path(root) / "ckpt" / "last.ckpt"
    model, adam, state = target_state(world_size)
    loaded = MegatronFSDPCheckpointIO().load_checkpoint(path, state=state)
    result: dict[str, Any] = {"loaded": facts(state), "global_step": loaded["global_step"]}
    resume_optimizer(model, adam, loaded)
    step(model, adam, 2)
    result["stepped"] = facts(live_state(model, adam))
    return result


@pytest.mark.parametrize(
    ("phase", "named"),
    [
        ("write:after", "during DCP's save, after this rank wrote its shard files"),
        ("commit:hashed", "before the commit"),
    ],
)
def test_a_stopped_rank_times_out_its_peers_and_the_run_resumes(
    tmp_path: Path, phase: str, named: str
) -> None:
    with pytest.raises(AssertionError) as excinfo:
        run_distributed(
            _hang_during_save, 2, str(tmp_path), phase, timeout=TIMEOUT, init_process_group=False
        )
    report = str(excinfo.value)
    # Rank 1 was stopped (never returned), then killed by rank 0; rank 0 returned.
    assert "--- rank 1 failed ---\nprocess died with exit code -9" in report, report
    assert "--- rank 0 failed" not in report, report
    survivor = json.loads((tmp_path / "survivor.json").read_text())
    assert survivor["peer_state"] == "T", survivor  # stopped, not dead, when rank 0 gave up
    error = survivor["error"]
    assert error.startswith("CheckpointSaveError: Saving checkpoint "), error
    assert named in error, error
    assert "last.ckpt" in error and "previous checkpoint there, if any, is untouched" in error
    # One timeout of the save's group, not the default group's 30 s, nor a hang.
    assert HANG_TIMEOUT_S * 0.9 <= survivor["elapsed"] <= HANG_TIMEOUT_S + 20, survivor
    # The previous checkpoint: byte-identical, verified, nothing hidden left beside it.
    assert survivor["unchanged"], survivor
    last = tmp_path / "ckpt" / "last.ckpt"
    assert read_manifest(last).global_step == 2
    assert verify_checkpoint(last) == []
    assert not [p for p in last.parent.iterdir() if parse_hidden_name(p.name)]

    # A fresh run resumes bit-exactly and takes the step the stopped run was saving.
    results = run_distributed(_resume, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False)
    for rank, result in enumerate(results):
        assert result["global_step"] == 2
        saved = torch.load(tmp_path / f"step2-rank{rank}.pt", weights_only=False)
        assert_same_facts(result["loaded"], saved)
        lost = torch.load(tmp_path / f"step3-rank{rank}.pt", weights_only=False)
        assert_same_facts(result["stepped"], lost)
