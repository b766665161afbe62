"""A rank SIGKILLed in the middle of a save loses nothing that was committed.

Each scenario is a real 2-rank gloo run that saves ``last.ckpt`` at step 2, trains a
step, and starts saving step 3, during which one chosen rank SIGKILLs itself at an exact
point (``tests/scripts/fault_injection.py``), one scenario per save phase the code names:
before any shard is written, while rank 0 plans, before and after its own shards, before
DCP's ``.metadata``, while hashing, before the manifest, after the manifest but before the
rename, after the rename, and -- with the two-rename commit that systems without
``renameat2(RENAME_EXCHANGE)`` use -- between the renames. The surviving rank must raise
a ``CheckpointError`` (not hang: the harness would report it as unfinished), and then:

* ``last.ckpt`` exists under its final name (Lightning's ``ckpt_path="last"`` lookup sees
  only ``last*`` names; only the fallback's window needs our recovery), is complete, and
  ``verify_checkpoint`` finds nothing wrong with it;
* it holds step 2 (step 3 only where the kill came after the commit);
* a second 2-rank run loads it bit-exactly into zeroed targets, takes the same training
  step the crashed run took, and lands bit-exactly on the crashed run's step-3 state;
* that run is told about the interrupted save, and its next save removes the debris.

A rank killed in the middle of a *load* leaves the survivor's live model and optimizer
untouched (``atomic_load=True``). The last scenario kills a rank in the middle of an *async*
save and resumes on 3 ranks: the last complete checkpoint is chosen and resharded
bit-exactly (the 2-rank tensors it must equal are checked against one unsharded process).

The crashed runs are independent, so they run concurrently (threads of the pytest
process, each driving its own ``run_distributed``): each spends most of its time waiting
for the harness to notice the dead rank.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.storage import commit
from lightning_megatron_fsdp.storage.commit import resolve_latest_checkpoint
from lightning_megatron_fsdp.storage.format import (
    ASIDE,
    STAGING,
    hidden_path,
    is_complete_checkpoint,
    parse_hidden_name,
    read_manifest,
)
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.harness import run_distributed
from tests.models import train_unsharded
from tests.scripts.fault_injection import (
    LR,
    Fault,
    WarningRecords,
    arm_commit_fault,
    checkpoint_dict,
    init_group,
    live_state,
    reader_factory,
    resume_optimizer,
    step,
    target_state,
    trained,
    writer_factory,
)
from tests.shard_facts import (
    assemble,
    assert_close_to_reference,
    assert_matches_full,
    assert_same_facts,
    differing,
    facts,
    reference_facts,
)

TIMEOUT = 90.0

# (scenario, rank killed, phase, how the fault is armed, step last.ckpt holds afterwards)
CRASHES: list[tuple[str, int, str, str, int]] = [
    ("before-any-shard", 1, "plan", "writer", 2),
    ("while-planning", 0, "global-plan", "writer", 2),
    ("before-own-shards", 1, "write:before", "writer", 2),
    ("after-own-shards", 0, "write:after", "writer", 2),
    ("before-metadata", 0, "metadata", "writer", 2),
    ("while-hashing", 1, "commit:hashed", "hook", 2),
    ("before-manifest", 0, "commit:manifest", "hook", 2),
    ("before-rename", 0, "commit:publish", "hook", 2),
    ("after-rename", 0, "commit:replaced", "hook", 3),
    ("between-renames-fallback", 0, "commit:aside", "fallback", 2),
]


def _store(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


# ---------------------------------------------------------------------------------------
# Rank workers
# ---------------------------------------------------------------------------------------


def _crash_during_save(
    rank: int, world_size: int, root: str, victim: int, phase: str, how: str
) -> str:
    """Save step 2, train, save step 3 with ``victim`` killed at ``phase``.

    Writes ``facts/step<N>-rank<r>.pt`` (what each save holds) and, on a survivor,
    ``survivor-rank<r>.txt`` (the error it raised). Returns only on a survivor.
    """
    init_group(rank, world_size)
    base = Path(root)
    path = base / "ckpt" / "last.ckpt"
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), path)
    _store(base / "facts" / f"step2-rank{rank}.pt", facts(live_state(model, adam)))
    step(model, adam, 2)
    _store(base / "facts" / f"step3-rank{rank}.pt", facts(live_state(model, adam)))
    dist.barrier()
    fault = Fault(phase, victim, "kill")
    options = {"storage_writer_factory": writer_factory(fault)} if how == "writer" else None
    hook = fault if how != "writer" else None
    try:
        with arm_commit_fault(hook, rename_exchange=how != "fallback"):
            plugin.save_checkpoint(checkpoint_dict(model, adam, 3), path, storage_options=options)
    except CheckpointError as err:
        (base / f"survivor-rank{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        return "raised"
    return "returned without an error"


def _crash_during_async_save(rank: int, world_size: int, root: str) -> str:
    """Async-save step 2 (committed), then async-save step 3 with rank 1 killed while its
    background thread writes; the survivor learns of it at ``wait()``."""
    init_group(rank, world_size)
    base = Path(root)
    path = base / "ckpt" / "last.ckpt"
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO(async_save=True)
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), path)
    _store(base / "facts" / f"step2-rank{rank}.pt", facts(live_state(model, adam)))
    plugin.wait()
    step(model, adam, 2)
    options = {"storage_writer_factory": writer_factory(Fault("write:after", 1, "kill"))}
    plugin.save_checkpoint(checkpoint_dict(model, adam, 3), path, storage_options=options)
    try:
        plugin.wait()
    except CheckpointError as err:
        (base / f"survivor-rank{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        return "raised"
    return "returned without an error"


def _crash_during_load(rank: int, world_size: int, root: str) -> str:
    """Save step 2, train on, then load step 2 into the live model with rank 1 killed
    after it read its data; the survivor's model and optimizer must be untouched."""
    init_group(rank, world_size)
    base = Path(root)
    path = base / "ckpt" / "last.ckpt"
    model, adam = trained(world_size)
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint_dict(model, adam, 2), path)
    step(model, adam, 2)
    live = facts(live_state(model, adam))
    loader = MegatronFSDPCheckpointIO(
        storage_reader_factory=reader_factory(Fault("read:after", 1, "kill")), atomic_load=True
    )
    try:
        loader.load_checkpoint(path, state=live_state(model, adam))
    except CheckpointError as err:
        changed = differing(facts(live_state(model, adam)), live)
        _store(base / f"survivor-rank{rank}.pt", {"message": str(err), "changed": changed})
        return "raised"
    return "returned without an error"


def _resume(rank: int, world_size: int, roots: list[str], expected_steps: list[int]) -> list[dict]:
    """For each crashed run: load its ``last.ckpt`` into zeroed targets, take the step the
    crashed run took after it, save again. Returns facts for the pytest process."""
    init_group(rank, world_size)
    records = WarningRecords()
    logging.getLogger("lightning_megatron_fsdp").addHandler(records)
    out = []
    for root, saved_step in zip(roots, expected_steps, strict=True):
        path = Path(root) / "ckpt" / "last.ckpt"
        model, adam, state = target_state(world_size)
        records.messages.clear()
        loaded = MegatronFSDPCheckpointIO().load_checkpoint(path, state=state)
        result: dict[str, Any] = {
            "loaded": facts(state),
            "global_step": loaded["global_step"],
            "warnings": list(records.messages),
        }
        resume_optimizer(model, adam, loaded)
        if saved_step == 2:  # the crashed run's next step, from the resumed state
            step(model, adam, 2)
            result["stepped"] = facts(live_state(model, adam))
        MegatronFSDPCheckpointIO().save_checkpoint(
            checkpoint_dict(model, adam, saved_step + 1), path
        )
        dist.barrier()
        result["listing"] = sorted(os.listdir(path.parent))
        out.append(result)
    return out


def _load_resharded(rank: int, world_size: int, root: str) -> dict:
    init_group(rank, world_size)
    dirpath = Path(root) / "ckpt"
    latest = None
    if rank == 0:
        latest = resolve_latest_checkpoint(dirpath)
    box = [latest]
    dist.broadcast_object_list(box, src=0)
    _, _, state = target_state(world_size)
    loaded = MegatronFSDPCheckpointIO().load_checkpoint(box[0], state=state)
    return {"path": str(box[0]), "global_step": loaded["global_step"], "loaded": facts(state)}


# ---------------------------------------------------------------------------------------
# Pytest side
# ---------------------------------------------------------------------------------------


def _expect_death(victim: int, worker: Any, *args: Any) -> None:
    """Run a 2-rank crash; exactly ``victim`` must die by SIGKILL, the peer must return."""
    with pytest.raises(AssertionError) as excinfo:
        run_distributed(worker, 2, *args, timeout=TIMEOUT, init_process_group=False)
    report = str(excinfo.value)
    assert f"--- rank {victim} failed ---\nprocess died with exit code -9" in report, report
    survivor = 1 - victim
    assert f"--- rank {survivor} failed" not in report, report
    assert "did not finish" not in report, report


def _rank_facts(root: Path, saved_step: int) -> list[dict]:
    return [
        torch.load(root / "facts" / f"step{saved_step}-rank{r}.pt", weights_only=False)
        for r in range(2)
    ]


def _hidden(dirpath: Path) -> list[tuple[str, str]]:
    return sorted(h for p in dirpath.iterdir() if (h := parse_hidden_name(p.name)) is not None)


def _save_last(rank: int, world_size: int, root: str) -> None:
    init_group(rank, world_size)
    model, adam = trained(world_size, steps=1)
    MegatronFSDPCheckpointIO().save_checkpoint(
        checkpoint_dict(model, adam, 1), Path(root) / "last.ckpt"
    )


def test_a_rank_that_loses_the_race_to_restore_an_aside_checkpoint_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of ``fit(ckpt_path="last")`` restores what a crash left renamed aside
    (``recover_matching``): a rank that found the aside copy complete, and then lost it to
    another rank's rename before reading its manifest, goes on; the checkpoint is restored
    once. (In CI this rank raised "... .last.ckpt.old-<token> does not exist".)"""
    run_distributed(_save_last, 1, str(tmp_path), init_process_group=False, timeout=TIMEOUT)
    final = tmp_path / "last.ckpt"
    aside = hidden_path(final, ASIDE, "5eed" * 8)
    final.rename(aside)
    checked = commit.is_complete_checkpoint

    def other_rank_restores_it_meanwhile(path: Path) -> bool:
        complete = checked(path)
        if Path(path) == aside:
            aside.rename(final)
        return complete

    monkeypatch.setattr(commit, "is_complete_checkpoint", other_rank_restores_it_meanwhile)
    assert commit.recover_matching(tmp_path, "last*.ckpt") == []  # the other rank did it
    assert is_complete_checkpoint(final) and not aside.exists()


def test_sigkill_during_save_keeps_last_complete_checkpoint_and_resumes_bit_exactly(
    tmp_path: Path,
) -> None:
    roots = {name: tmp_path / name for name, *_ in CRASHES}
    loading = tmp_path / "during-load"
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(CRASHES) + 1) as pool:
        futures = [
            pool.submit(
                _expect_death, victim, _crash_during_save, str(roots[name]), victim, phase, how
            )
            for name, victim, phase, how, _ in CRASHES
        ]
        futures.append(pool.submit(_expect_death, 1, _crash_during_load, str(loading)))
        for future in futures:
            future.result()

    # A rank killed mid-load: the survivor raised, and its live state is untouched.
    survived = torch.load(loading / "survivor-rank0.pt", weights_only=False)
    assert "Loading checkpoint" in survived["message"], survived
    assert "by peer" in survived["message"], survived
    assert "The targets are unchanged (atomic_load)." in survived["message"], survived
    assert survived["changed"] == []
    assert verify_checkpoint(loading / "ckpt" / "last.ckpt") == []

    messages = {}
    for name, victim, _, how, holds in CRASHES:
        root = roots[name]
        dirpath = root / "ckpt"
        survivor = 1 - victim
        message = (root / f"survivor-rank{survivor}.txt").read_text()
        messages[name] = message
        assert "CheckpointSaveError" in message, (name, message)
        # gloo noticed the dead peer at once: not a timeout, not a hang.
        assert "by peer" in message, (name, message)
        last = dirpath / "last.ckpt"
        if how == "fallback":
            # The one window the exchange closes: no last.ckpt until recovery.
            assert not last.exists(), name
            assert ("last.ckpt", ASIDE) in _hidden(dirpath), name
        else:
            assert is_complete_checkpoint(last), name  # Lightning's lookup finds it as is
        assert resolve_latest_checkpoint(dirpath) == last, name
        assert verify_checkpoint(last) == [], name
        assert read_manifest(last).global_step == holds, name
        hidden = _hidden(dirpath)
        if victim == 0:  # nobody was left to delete the interrupted save
            assert ("last.ckpt", STAGING) in hidden, (name, hidden)
        else:  # rank 0 survived and deleted it
            assert hidden == [], (name, hidden)

    # What the survivors were told, phase by phase.
    before, after = "before this rank's shard files were all written", "after this rank wrote"
    for name, survivor, where in (
        ("before-any-shard", 0, before),
        ("while-planning", 1, before),
        ("before-own-shards", 0, after),  # the survivor wrote its own, then waited
    ):
        said = messages[name]
        assert f"failed on rank {survivor} during DCP's save, {where}" in said, (name, said)
        assert ": RuntimeError" in said, (name, said)
        assert "another rank probably crashed" in messages[name], name
    assert "failed before the commit" in messages["while-hashing"]
    for name in ("before-manifest", "before-rename", "after-rename", "between-renames-fallback"):
        assert "contact with rank 0 was lost while it committed" in messages[name], name
        assert "holds the previous or the new checkpoint" in messages[name], name

    names = [name for name, *_ in CRASHES]
    holds = [h for *_, h in CRASHES]
    results = run_distributed(
        _resume,
        2,
        [str(roots[n]) for n in names],
        holds,
        timeout=TIMEOUT,
        init_process_group=False,
    )
    for index, (name, victim, _, _, held) in enumerate(CRASHES):
        crashed = _rank_facts(roots[name], held)
        after = _rank_facts(roots[name], 3) if held == 2 else None
        for rank in range(2):
            result = results[rank][index]
            assert result["global_step"] == held, name
            assert_same_facts(result["loaded"], crashed[rank], f"{name} rank {rank} loaded")
            if after is not None:
                assert_same_facts(result["stepped"], after[rank], f"{name} rank {rank} resumed")
            assert result["listing"] == ["last.ckpt"], (name, result["listing"])
        warnings = results[0][index]["warnings"]
        if victim == 0:
            assert any("interrupted save" in w and ".last.ckpt.tmp-" in w for w in warnings), (
                name,
                warnings,
            )
        if name == "between-renames-fallback":
            assert not any("Restored" in w for w in warnings)  # resolve_latest did it above


def test_sigkill_during_async_save_then_resume_on_another_world_size(tmp_path: Path) -> None:
    _expect_death(1, _crash_during_async_save, str(tmp_path))
    message = (tmp_path / "survivor-rank0.txt").read_text()
    assert "CheckpointSaveError" in message and "untouched" in message, message
    dirpath = tmp_path / "ckpt"
    assert _hidden(dirpath) == []  # rank 0 survived and deleted the partial save
    assert resolve_latest_checkpoint(dirpath) == dirpath / "last.ckpt"
    assert verify_checkpoint(dirpath / "last.ckpt") == []
    manifest = read_manifest(dirpath / "last.ckpt")
    assert (manifest.global_step, manifest.world_size) == (2, 2)

    results = run_distributed(
        _load_resharded, 3, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    full = assemble(_rank_facts(tmp_path, 2))
    # The rows, assembled at the offsets under test, are the unsharded model's.
    assert_close_to_reference(full, reference_facts(*train_unsharded(2, lr=LR)), atol=1e-6)
    for result in results:
        assert result["path"] == str(dirpath / "last.ckpt")
        assert result["global_step"] == 2
    assert_matches_full(full, [r["loaded"] for r in results])
