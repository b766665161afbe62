"""A failure at any phase of a save or load, on one rank, reaches every rank and changes
nothing final; ranks that disagree get an error, never a hang.

One 2-rank gloo run injects, one after another on the same process group, a failure at
every phase of a save -- local and global planning, before and after writing the shard
files, DCP's ``.metadata``, hashing, the manifest, the rename (both commit flavours) --
plus a full disk (the kernel's ``RLIMIT_FSIZE``: the real writer gets ``EFBIG``) and a
failing background save; then at every phase of a load: reading DCP's metadata, local
and global planning, before and after reading this rank's data. Each must raise on
*both* ranks naming the failing rank and the injected error (a rank left behind would
hang the next collective, and the harness would report it), leave ``last.ckpt``
byte-identical with no debris, and, for loads with ``atomic_load=True``, leave every tensor
of the live model and optimizer bit-identical. With the default ``atomic_load=False`` a
failure before DCP reads (planning) still changes nothing, and one after the reads says on
every rank what each rank had written (and the live state did change: the check is not
vacuous).

A second run makes the ranks disagree: one rank's optimizer lacks state for a parameter,
one passes another dtype, one built a model with an extra block.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lightning_megatron_fsdp.checkpoint.save
import lightning_megatron_fsdp.storage.commit
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
)
from lightning_megatron_fsdp.storage.format import (
    ASIDE,
    STAGING,
    parse_hidden_name,
    read_manifest,
)
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.gpu import assert_ran_on_cuda, cuda_world_size
from tests.harness import run_distributed
from tests.scripts.fault_injection import (
    Fault,
    FaultyReader,
    FaultyWriter,
    WarningRecords,
    arm_commit_fault,
    attempt,
    checkpoint_dict,
    file_size_limit,
    init_group,
    live_state,
    reader_factory,
    step,
    target_state,
    trained,
    writer_factory,
)
from tests.shard_facts import differing, facts

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

TIMEOUT = 90.0

# (phase, failing rank, how it is armed, what every rank's error must say)
SAVE_FAULTS: list[tuple[str, int, str, str]] = [
    ("plan", 1, "writer", r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*injected failure"),
    ("global-plan", 0, "writer", r"failed on rank\(s\) \[0\]:\n  rank 0: OSError: .*injected"),
    ("write:before", 1, "writer", r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*injected"),
    ("write:after", 1, "writer", r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*injected"),
    ("metadata", 0, "writer", r"failed on rank\(s\) \[0\]:\n  rank 0: OSError: .*injected"),
    ("commit:hashed", 1, "hook", r"while committing: rank 1: OSError: .*injected"),
    ("commit:manifest", 0, "hook", r"while committing: OSError: .*injected failure at commit:"),
    ("commit:publish", 0, "hook", r"while committing: OSError: .*injected failure at commit:"),
    ("commit:aside", 0, "fallback", r"while committing: OSError: .*injected failure at commit:"),
    ("disk full", 1, "rlimit", r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: \[Errno 27\]"),
    ("write:after", 0, "async", r"failed on rank\(s\) \[0\]:\n  rank 0: OSError: .*injected"),
]
# Failures once the new checkpoint is in place: the save succeeds, cleanup is left undone.
COMMITTED_FAULTS: list[tuple[str, int, str]] = [
    ("commit:replaced", 0, "hook"),
    ("commit:replaced", 0, "fallback"),
]
LOAD_PHASES: list[tuple[str, int]] = [
    ("read:metadata", 1),
    ("read:plan", 1),
    ("read:global-plan", 0),
    ("read:before", 1),
    ("read:after", 1),
]


def _tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``: "byte-identical" made checkable."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _named_phases(source: object, call: str) -> set[str]:
    """The phase names ``source``'s code passes to ``call("<phase>")``."""
    return set(re.findall(rf'{re.escape(call)}\("([^"]+)"\)', inspect.getsource(source)))


def test_every_phase_the_code_names_is_injected() -> None:
    """Each save phase the code names (the writer's, and the commit steps
    ``commit.reach`` marks) is failed here and SIGKILLed in
    ``test_fault_tolerance.py``; each load phase is failed here. A new phase without a
    scenario fails this test."""
    from tests.test_fault_tolerance import CRASHES

    save = _named_phases(FaultyWriter, "self.fault.reached")
    save |= _named_phases(lightning_megatron_fsdp.storage.commit, "reach")
    save |= _named_phases(lightning_megatron_fsdp.checkpoint.save, "reach")
    load = _named_phases(FaultyReader, "self.fault.reached")
    assert {"plan", "metadata", "commit:hashed", "commit:replaced"} <= save  # parsed
    assert {"read:metadata", "read:after"} <= load
    failed = {phase for phase, _, how, _ in SAVE_FAULTS if how != "rlimit"}  # not a phase
    failed |= {phase for phase, *_ in COMMITTED_FAULTS}
    assert failed == save, (sorted(save - failed), sorted(failed - save))
    killed = {phase for _, _, phase, *_ in CRASHES}
    assert killed == save, (sorted(save - killed), sorted(killed - save))
    assert {phase for phase, _ in LOAD_PHASES} == load


def _save_with(
    plugin: MegatronFSDPCheckpointIO, checkpoint: dict, path: Path, phase: str, rank: int, how: str
) -> str:
    """One save with the fault armed; returns the error this rank got (or a marker)."""
    fault = Fault(phase, rank)
    options = (
        {"storage_writer_factory": writer_factory(fault)} if how in ("writer", "async") else None
    )
    hook = fault if how in ("hook", "fallback") else None
    limit = 4096 if how == "rlimit" and dist.get_rank() == rank else None
    try:
        with arm_commit_fault(hook, rename_exchange=how != "fallback"), file_size_limit(limit):
            plugin.save_checkpoint(checkpoint, path, storage_options=options)
            plugin.wait()
    except CheckpointSaveError as err:
        return str(err)
    return "no error"


def _phase_faults(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_group(rank, world_size)
    base = Path(root)
    path = base / "last.ckpt"
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), path)
    saved = facts(live_state(model, adam))
    before = _tree(path)
    step(model, adam, 2)
    newer = checkpoint_dict(model, adam, 3)
    out: dict[str, Any] = {"save": {}, "load": {}}
    asynchronous = MegatronFSDPCheckpointIO(async_save=True)
    for phase, failing, how, _ in SAVE_FAULTS:
        saver = asynchronous if how == "async" else plugin
        message = _save_with(saver, newer, path, phase, failing, how)
        dist.barrier()
        out["save"][f"{phase} ({how})"] = {
            "message": message,
            "unchanged": _tree(path) == before,
            "listing": sorted(os.listdir(base)),
        }
        dist.barrier()  # no rank stages the next save while another still lists this one

    # After the rename nothing may fail the save: the new checkpoint is committed, and
    # the previous one is left behind for the next save to delete.
    records = WarningRecords()
    logging.getLogger("lightning_megatron_fsdp.storage.commit").addHandler(records)
    for phase, failing, how in COMMITTED_FAULTS:
        replaced = base / f"replaced-{how}" / "last.ckpt"
        plugin.save_checkpoint(checkpoint_dict(model, adam, 2), replaced)
        records.messages.clear()
        message = _save_with(plugin, newer, replaced, phase, failing, how)
        dist.barrier()
        outcome = {
            "message": message,
            "warnings": list(records.messages),
            "global_step": read_manifest(replaced).global_step,
            "hidden": sorted(
                h for n in os.listdir(replaced.parent) if (h := parse_hidden_name(n)) is not None
            ),
            "verified": verify_checkpoint(replaced) if dist.get_rank() == 0 else [],
        }
        plugin.save_checkpoint(newer, replaced)  # the next save deletes what was left
        dist.barrier()
        outcome["listing after the next save"] = sorted(os.listdir(replaced.parent))
        out["save"][f"{phase} ({how})"] = outcome

    live = facts(live_state(model, adam))
    assert differing(live, saved), "the live state must differ from the checkpoint"
    for phase, failing in [*LOAD_PHASES, ("read:plan", 1), ("read:after", 1)]:
        atomic = len(out["load"]) < len(LOAD_PHASES)
        loader = MegatronFSDPCheckpointIO(
            storage_reader_factory=reader_factory(Fault(phase, failing)), atomic_load=atomic
        )
        try:
            loader.load_checkpoint(path, state=live_state(model, adam))
            message = "no error"
        except CheckpointError as err:
            message = str(err)
        key = phase if atomic else f"{phase}, atomic_load=False"
        out["load"][key] = {
            "message": message,
            "changed": differing(facts(live_state(model, adam)), live),
        }
    # The process group and the checkpoint are fine after all that: a real load works.
    _, _, state = target_state(world_size)
    plugin.load_checkpoint(path, state=state)
    out["good load"] = differing(facts(state), saved)
    return out


def test_a_failure_in_any_phase_raises_on_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    results = run_distributed(
        _phase_faults, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    for phase, _, how, pattern in SAVE_FAULTS:
        phase = f"{phase} ({how})"
        for rank, result in enumerate(results):
            seen = result["save"][phase]
            assert seen["message"] != "no error", (phase, rank)
            assert re.search(f"(?s){pattern}", seen["message"]), (phase, rank, seen["message"])
            assert "previous checkpoint there, if any, is untouched" in seen["message"]
            assert seen["unchanged"], (phase, rank)
            assert seen["listing"] == ["last.ckpt"], (phase, rank, seen["listing"])
        # Every rank raised the same error (the survivor of a DCP failure is told by DCP).
        assert results[0]["save"][phase]["message"] == results[1]["save"][phase]["message"]
    assert verify_checkpoint(tmp_path / "last.ckpt") == []
    for phase, failing, how in COMMITTED_FAULTS:
        for rank, result in enumerate(results):
            seen = result["save"][f"{phase} ({how})"]
            assert seen["message"] == "no error", (phase, how, rank, seen["message"])
            assert seen["global_step"] == 3, (phase, how, rank)  # the new one is in place
            assert seen["verified"] == [], (phase, how, rank)
            assert len(seen["hidden"]) == 1 and seen["hidden"][0][0] == "last.ckpt", seen
            assert seen["listing after the next save"] == ["last.ckpt"], seen
            if rank == failing:
                assert any(
                    "is committed, but cleaning up after it failed" in w
                    and f"injected failure at {phase}" in w
                    for w in seen["warnings"]
                ), seen["warnings"]
        # The previous checkpoint stays where the commit flavour moved it.
        kind = results[0]["save"][f"{phase} ({how})"]["hidden"][0][1]
        assert kind == (ASIDE if how == "fallback" else STAGING), (how, kind)

    load_patterns = {
        "read:metadata": r"failed on rank\(s\) \[1\]:\n  rank 1: AssertionError: metadata is None"
        r".*injected failure at read:metadata",
        "read:plan": r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*at read:plan",
        "read:global-plan": r"failed on rank\(s\) \[0\]:\n  rank 0: OSError: .*at read:global-plan",
        "read:before": r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*at read:before",
        "read:after": r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*at read:after",
    }
    for phase, pattern in load_patterns.items():
        for rank, result in enumerate(results):
            seen = result["load"][phase]
            assert re.search(f"(?s){pattern}", seen["message"]), (phase, rank, seen["message"])
            assert "The targets are unchanged (atomic_load)." in seen["message"]
            assert seen["changed"] == [], (phase, rank, seen["changed"][:5])
    # In place (the default), a failure before any rank reads tensor data changes nothing;
    # after the reads, every rank says what each rank had written, and the live model and
    # optimizer were overwritten.
    for rank, result in enumerate(results):
        seen = result["load"]["read:plan, atomic_load=False"]
        assert re.search(
            r"failed on rank\(s\) \[1\]:\n  rank 1: OSError: .*at read:plan", seen["message"]
        )
        assert "Nothing was loaded: no rank had begun reading tensor data." in seen["message"]
        assert seen["changed"] == [], (rank, seen["changed"][:5])
        seen = result["load"]["read:after, atomic_load=False"]
        assert "The targets are partly loaded (atomic_load=False)" in seen["message"]
        assert re.search(
            r"rank 0: wrote all \d+ of its records\n  rank 1: wrote all", seen["message"]
        )
        assert (
            seen["message"] == results[1 - rank]["load"]["read:after, atomic_load=False"]["message"]
        )
        changed = seen["changed"]
        assert any(k.startswith("state_dict/") for k in changed), (rank, changed)
        assert any(k.startswith("optimizer_states/0/state/") for k in changed), (rank, changed)
        assert result["good load"] == []


# ---------------------------------------------------------------------------------------
# Ranks that disagree
# ---------------------------------------------------------------------------------------


def _disagreeing(rank: int, world_size: int, root: str) -> dict[str, str]:
    init_group(rank, world_size)
    base = Path(root)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), base / "good")
    out = {}

    lacking = checkpoint_dict(model, adam, 3)
    if rank == 1:  # as if rank 1's optimizer never stepped that parameter
        del lacking["optimizer_states"][0]["state"]["blocks.0.gain"]
    out["save, optimizer lacks a parameter"] = attempt(
        lambda: plugin.save_checkpoint(lacking, base / "a")
    )

    retyped = checkpoint_dict(model, adam, 3)
    if rank == 1:
        retyped["state_dict"]["head.bias"] = torch.zeros(11, dtype=torch.bfloat16)
    out["save, dtype differs"] = attempt(lambda: plugin.save_checkpoint(retyped, base / "b"))

    # Rank 1 built a model with an extra block (never trained: its collectives would not
    # match rank 0's). Saving it, and loading into it, must fail on both ranks.
    other, other_adam = trained(world_size, steps=0, num_blocks=2 + rank)
    out["save, model differs"] = attempt(
        lambda: plugin.save_checkpoint(checkpoint_dict(other, other_adam, 3), base / "c")
    )
    out["load, model differs"] = attempt(
        lambda: plugin.load_checkpoint(base / "good", state=live_state(other, other_adam))
    )

    _, _, state = target_state(world_size)
    if rank == 1:
        del state["optimizer_states"][0]["state"]["blocks.0.gain"]
    out["load, optimizer lacks a parameter"] = attempt(
        lambda: plugin.load_checkpoint(base / "good", state=state)
    )
    dist.barrier()
    out["listing"] = " ".join(sorted(os.listdir(base)))
    return out


def test_ranks_that_disagree_get_an_error_not_a_hang(tmp_path: Path) -> None:
    results = run_distributed(
        _disagreeing, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    assert results[0] == results[1]  # the same error on both ranks, word for word
    out = results[0]
    lacking = out["save, optimizer lacks a parameter"]
    assert lacking.startswith("CheckpointSaveError: Saving checkpoint ")
    assert "before any tensor was written" in lacking
    assert (
        "rank 1 lacks 3 key(s) of rank 0: ['optimizer_states.0.state.blocks.0.gain.exp_avg', "
        "'optimizer_states.0.state.blocks.0.gain.exp_avg_sq', "
        "'optimizer_states.0.state.blocks.0.gain.step']"
    ) in lacking
    assert "The ranks disagree on the state to save" in lacking
    assert (
        "rank 1 'state_dict.head.bias': (11,) bfloat16, rank 0: (11,) float32"
        in out["save, dtype differs"]
    )
    model_differs = out["save, model differs"]
    assert "rank 1 has 24 key(s) rank 0 has not: ['optimizer_states.0.state.blocks.2." in (
        model_differs
    ), model_differs
    assert "... and 14 more]" in model_differs
    loaded = out["load, model differs"]
    assert loaded.startswith(CheckpointMismatchError.__name__), loaded
    assert "missing from the checkpoint: ['blocks.2." in loaded and "[rank(s) [1]]" in loaded
    lacks = out["load, optimizer lacks a parameter"]
    assert lacks.startswith(CheckpointMismatchError.__name__), lacks
    assert "optimizer 0: 3 key(s) in the checkpoint are not in the target: " in lacks
    assert "'blocks.0.gain/exp_avg'" in lacks and "[rank(s) [1]]" in lacks
    assert out["listing"] == "good"  # no failed save left anything behind


# ---------------------------------------------------------------------------------------
# GPU: the atomic load stages CUDA shards in CPU memory and copies them back
# ---------------------------------------------------------------------------------------


def _gpu_failed_load_keeps_targets(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.models import build_packed_lm, lm_loss, make_batch, shard_packed_lm, sharded_adam

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (world_size,))
    model = shard_packed_lm(build_packed_lm(0).cuda(), mesh)
    adam = sharded_adam(model)
    for seed in range(2):
        lm_loss(model, tuple(t.cuda() for t in make_batch(seed))).backward()
        adam.step()
        adam.zero_grad()
    path = Path(root) / "last.ckpt"
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), path)
    saved = facts(live_state(model, adam))
    lm_loss(model, tuple(t.cuda() for t in make_batch(2))).backward()
    adam.step()
    live = facts(live_state(model, adam))
    failing = MegatronFSDPCheckpointIO(
        storage_reader_factory=reader_factory(Fault("read:after", 0)), atomic_load=True
    )
    try:
        failing.load_checkpoint(path, state=live_state(model, adam))
        message = "no error"
    except CheckpointError as err:
        message = str(err)
    unchanged = differing(facts(live_state(model, adam)), live)
    plugin.load_checkpoint(path, state=live_state(model, adam))
    return {
        "message": message,
        "unchanged": unchanged,
        "loaded": differing(facts(live_state(model, adam)), saved),
        "device": str(next(iter(live_state(model, adam)["state_dict"].values())).device),
    }


@pytest.mark.gpu
def test_failed_load_keeps_cuda_targets_and_a_good_load_fills_them(tmp_path: Path) -> None:
    world_size = cuda_world_size()
    results = run_distributed(
        _gpu_failed_load_keeps_targets,
        world_size,
        str(tmp_path),
        timeout=TIMEOUT,
        init_process_group=False,
    )
    assert_ran_on_cuda([r["device"] for r in results], world_size)
    for result in results:
        assert "injected failure at read:after" in result["message"], result["message"]
        assert "The targets are unchanged (atomic_load)." in result["message"]
        assert result["unchanged"] == []
        assert result["loaded"] == []
