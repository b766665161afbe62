"""Damaged checkpoints are refused on every rank, before any weight is touched where no
tensor byte is needed to see the damage; a soak leaks nothing.

Damage: a 2-rank run saves a good checkpoint and, one step later, "another run's", then
trains on so the live model differs from both. Copies of the good checkpoint are damaged
the ways checkpoints get damaged -- a truncated or deleted shard, a deleted ``.metadata``
or ``manifest.json``, a shard / ``.metadata.keys`` / ``meta.pt`` / manifest copied over from
the other run, a directory that is no checkpoint, one flipped bit -- and loaded into the
*live* model and optimizer. Each load must raise the documented error on both ranks,
naming the file. Damage visible without reading tensor data (sizes, the manifest,
``meta.pt``, ``.metadata``) must leave every live tensor bit-identical. Damage inside a
shard's tensor data (a shard from another run, a flipped bit) is found by the record's
CRC32C while it is read: the error names the record and says what each rank had written
by then; with ``atomic_load=True`` the same loads leave every live tensor bit-identical.
The offline check (``lightning-megatron-fsdp inspect --verify``) must flag the same files
and pass the good checkpoint. ``verify_checksums=False`` must let the flipped bit through
(the switch works, and only the checksum catches a flip DCP cannot see).

Soak: 20 save/load cycles in one 2-rank run, sync and async alternating, each loaded
bit-exactly into zeroed targets; open file descriptors, Python threads and the process's
native threads (``/proc/self/task``) must not grow between cycle 2 and 20, nor RSS by more
than a few times the state a rank saves (an 8 MiB replicated tensor beside the model, so
the bound is far below what one leaked copy per cycle would add).
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import gc
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.tools.cli import main as cli_main
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.harness import run_distributed
from tests.scripts.fault_injection import (
    attempt,
    checkpoint_dict,
    init_group,
    live_state,
    step,
    target_state,
    trained,
)
from tests.shard_facts import differing, facts

TIMEOUT = 90.0
SOAK_CYCLES = 20
# The soak saves, beside the tiny model, a replicated "ballast" tensor large enough that
# the state dwarfs allocator noise: RSS may grow by at most RSS_BOUND_STATES times the
# bytes a rank saves over 18 cycles, so keeping one copy of the saved state per cycle
# (18 copies) fails, as would keeping a staging buffer per async save.
BALLAST_ELEMENTS = 2 * 1024 * 1024  # 8 MiB of fp32
RSS_BOUND_STATES = 3
FLIP_KEY = "state_dict/blocks.0.mix"


def _truncate(path: Path, other: Path) -> None:
    file = path / "__1_0.distcp"
    os.truncate(file, file.stat().st_size // 2)


def _copy_from_other(name: str) -> Callable[[Path, Path], None]:
    def damage(path: Path, other: Path) -> None:
        shutil.copyfile(other / name, path / name)

    return damage


def _not_a_checkpoint(path: Path, other: Path) -> None:
    shutil.rmtree(path)
    path.mkdir()
    (path / "notes.txt").write_text("not a checkpoint")


# (case, damage done by rank 0 to a copy of the good checkpoint, expected error)
DAMAGE: list[tuple[str, Callable[[Path, Path], None], str]] = [
    (
        "truncated shard",
        _truncate,
        r"CheckpointCorruptedError: .*__1_0\.distcp: \d+ bytes on disk, \d+ in the manifest",
    ),
    (
        "deleted shard",
        lambda path, other: (path / "__0_0.distcp").unlink(),
        r"CheckpointCorruptedError: .*__0_0\.distcp: missing \(expected \d+ bytes\)",
    ),
    (
        "deleted .metadata",
        lambda path, other: (path / ".metadata").unlink(),
        r"CheckpointCorruptedError: .*\.metadata: missing \(expected \d+ bytes\)",
    ),
    (
        "deleted manifest",
        lambda path, other: (path / "manifest.json").unlink(),
        r"NotACheckpointError: .*holds DCP files but no manifest\.json: the save did not finish",
    ),
    (
        "shard from another run",
        _copy_from_other("__1_0.distcp"),
        r"CheckpointCorruptedError: .*__1_0\.distcp: crc32c [0-9a-f]{8} read, [0-9a-f]{8} "
        r"recorded for the record of '[^']+' \(chunk at \[[0-9, ]*\]\), bytes \[\d+, \d+\) \(the "
        r"file changed after it was written\)",
    ),
    (  # what a load reads of the index (.metadata itself only by inspect --verify)
        ".metadata.keys from another run",
        _copy_from_other(".metadata.keys"),
        r"CheckpointCorruptedError: .*\.metadata\.keys: (crc32c [0-9a-f]{8} on disk|\d+ bytes on "
        r"disk)",
    ),
    (
        "meta.pt from another run",
        _copy_from_other("meta.pt"),
        r"CheckpointCorruptedError: .*meta\.pt: (crc32c [0-9a-f]{8} on disk|\d+ bytes on disk)",
    ),
    (
        "manifest from another run",
        _copy_from_other("manifest.json"),
        r"CheckpointCorruptedError: .*: (crc32c [0-9a-f]{8} on disk|\d+ bytes on disk)",
    ),
    (
        "not a checkpoint",
        _not_a_checkpoint,
        r"NotACheckpointError: .*has no manifest\.json: not a checkpoint written by "
        r"MegatronFSDPCheckpointIO",
    ),
    (
        "one flipped bit",
        lambda path, other: None,  # done by _flip_bit, which knows where the data lies
        r"CheckpointCorruptedError: .*__0_0\.distcp: crc32c [0-9a-f]{8} read, [0-9a-f]{8} "
        r"recorded for the record of 'state_dict\.blocks\.0\.mix'",
    ),
]
# Damage inside tensor data: found while reading, after the first write into a target.
WHILE_READING = ("shard from another run", "one flipped bit")


def _flip_bit(path: Path, local: Any) -> int:
    """Flip one bit inside ``local``'s bytes in rank 0's shard file; return the element."""
    local = local.numpy()
    file = path / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    needle = local.tobytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "shard bytes not found exactly once"
    element = local.size // 2
    data[at + element * local.itemsize + 1] ^= 0x10  # a mantissa bit: still a finite float
    file.write_bytes(data)
    return element


def _snapshot(state: Any) -> Any:
    """A deep copy of every tensor of a state (DTensors: their local shards)."""
    if isinstance(state, DTensor):
        return state._local_tensor.clone()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {key: _snapshot(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_snapshot(value) for value in state]
    return state


def _restore(state: Any, snapshot: Any) -> None:
    """Copy a :func:`_snapshot` back into the live tensors of ``state``, in place."""
    with torch.no_grad():
        if isinstance(state, DTensor):
            state._local_tensor.copy_(snapshot)
        elif isinstance(state, torch.Tensor):
            state.copy_(snapshot)
        elif isinstance(state, dict):
            for key, value in state.items():
                _restore(value, snapshot[key])
        elif isinstance(state, list):
            for value, saved in zip(state, snapshot, strict=True):
                _restore(value, saved)


def _load_into(plugin: MegatronFSDPCheckpointIO, path: Path, state: dict) -> str:
    return attempt(lambda: plugin.load_checkpoint(path, state=state))


def _damaged(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_group(rank, world_size)
    base = Path(root)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    good, other = base / "good", base / "other"
    plugin.save_checkpoint(checkpoint_dict(model, adam, 2), good)
    saved = facts(live_state(model, adam))
    step(model, adam, 2)
    plugin.save_checkpoint(checkpoint_dict(model, adam, 3), other)  # "another run"
    step(model, adam, 3)
    live = facts(live_state(model, adam))
    live_copy = _snapshot(live_state(model, adam))
    atomic = MegatronFSDPCheckpointIO(atomic_load=True)
    out: dict[str, Any] = {}
    for case, damage, _ in DAMAGE:
        path = base / case.replace(" ", "-")
        if rank == 0:
            shutil.copytree(good, path)
            damage(path, other)
            if case == "one flipped bit":
                out["flipped element"] = _flip_bit(path, saved[FLIP_KEY][-1])
        dist.barrier()
        out[case] = {
            "message": _load_into(plugin, path, live_state(model, adam)),
            "changed": differing(facts(live_state(model, adam)), live),
        }
        if case in WHILE_READING:  # put the partly loaded live state back, then atomically
            _restore(live_state(model, adam), live_copy)
            out[f"{case}, atomic_load=True"] = {
                "message": _load_into(atomic, path, live_state(model, adam)),
                "changed": differing(facts(live_state(model, adam)), live),
            }
    # Checksums off: the flipped bit loads silently. Only the checksum could have caught it.
    _, _, state = target_state(world_size)
    unchecked = MegatronFSDPCheckpointIO(verify_checksums=False)
    out["unchecked flip"] = _load_into(unchecked, base / "one-flipped-bit", state)
    out["unchecked differs"] = differing(facts(state), saved)
    return out


@pytest.mark.both_versions
def test_damaged_checkpoints_are_refused_before_any_weight_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = run_distributed(_damaged, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False)
    for case, _, pattern in DAMAGE:
        path = tmp_path / case.replace(" ", "-")
        seen = [result[case] for result in results]
        for rank, result in enumerate(seen):
            assert re.search(f"(?s){pattern}", result["message"]), (case, rank, result["message"])
            assert str(path) in result["message"], case
            if "CheckpointCorruptedError" in result["message"]:
                assert "inspect --verify" in result["message"], case
            if case in WHILE_READING:
                assert "The targets are partly loaded (atomic_load=False)" in result["message"]
                assert re.search(r"rank \d: wrote \d+ of \d+ records", result["message"]), case
                assert result["changed"], (case, rank)  # in place: the check is not vacuous
                atomic = results[rank][f"{case}, atomic_load=True"]
                assert re.search(f"(?s){pattern}", atomic["message"]), (case, atomic["message"])
                assert "The targets are unchanged (atomic_load)." in atomic["message"], case
                assert atomic["changed"] == [], (case, rank, atomic["changed"][:5])
            else:
                if "CheckpointCorruptedError" in result["message"]:
                    assert "Nothing was loaded" in result["message"], (case, result["message"])
                assert result["changed"] == [], (case, rank, result["changed"][:5])
        # One rank may have found a bad checksum ("[rank(s) [r]]"), but both raised it.
        assert seen[0]["message"] == seen[1]["message"], case
        # The offline check flags the same damage.
        assert verify_checkpoint(path), case
        assert cli_main(["inspect", "--verify", str(path)]) == 1, case
    assert verify_checkpoint(tmp_path / "good") == []
    assert cli_main(["inspect", "--verify", str(tmp_path / "good")]) == 0
    capsys.readouterr()
    # "Another run's" files are the same size: only the checksums told them apart.
    for name in ("__1_0.distcp", "meta.pt"):
        assert (tmp_path / "good" / name).stat().st_size == (
            tmp_path / "other" / name
        ).stat().st_size, name

    element = results[0]["flipped element"]
    assert results[0]["unchecked flip"] == results[1]["unchecked flip"] == "no error"
    assert results[0]["unchecked differs"] == [FLIP_KEY], element  # rank 0 loaded the flip
    assert results[1]["unchecked differs"] == []


# ---------------------------------------------------------------------------------------
# Soak
# ---------------------------------------------------------------------------------------


def _usage() -> dict[str, int]:
    """Open file descriptors, threads (Python's, and every native one of the process:
    gloo's, a DCP or c10d worker's, a raw ``_thread`` -- ``threading`` sees none of those)
    and resident memory: what is held, after the garbage is collected and glibc has handed
    back the pages it kept once they were freed."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status", encoding="ascii") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "native_threads": len(os.listdir("/proc/self/task")),
        "rss_kb": rss,
    }


def _raw_thread_seen() -> dict[str, int]:
    """Start a native thread ``threading`` does not know of; how much each count grew."""
    before = _usage()
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait()

    _thread.start_new_thread(hold, ())
    started.wait()
    after = _usage()
    release.set()
    return {key: after[key] - before[key] for key in ("threads", "native_threads")}


def _zero(state: Any) -> None:
    """Zero every tensor of a state in place (a DTensor's local shard: no collective)."""
    values = state.values() if isinstance(state, dict) else state
    for value in values:
        if isinstance(value, DTensor):
            value._local_tensor.zero_()
        elif isinstance(value, torch.Tensor):
            value.zero_()
        elif isinstance(value, (dict, list)):
            _zero(value)


def _state_bytes(state: Any) -> int:
    """Bytes of every tensor a rank holds in ``state`` (a DTensor: its local shard)."""
    values = state.values() if isinstance(state, dict) else state
    total = 0
    for value in values:
        if isinstance(value, DTensor):
            value = value._local_tensor
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (dict, list)):
            total += _state_bytes(value)
    return total


def _soak(rank: int, world_size: int, root: str, cycles: int) -> dict[str, Any]:
    init_group(rank, world_size)
    path = Path(root) / "last.ckpt"
    model, adam = trained(world_size, steps=1)
    _, _, target = target_state(world_size)
    ballast = torch.randn(BALLAST_ELEMENTS, generator=torch.Generator().manual_seed(0))
    target["state_dict"]["ballast"] = torch.zeros_like(ballast)
    sync, background = MegatronFSDPCheckpointIO(), MegatronFSDPCheckpointIO(async_save=True)
    usage, compared, saved_bytes = {}, 0, 0
    with torch.no_grad():
        for cycle in range(1, cycles + 1):
            with torch.enable_grad():
                step(model, adam, cycle)
            ballast.add_(1.0)  # each cycle saves other bytes
            plugin = background if cycle % 2 else sync
            checkpoint = checkpoint_dict(model, adam, cycle)
            checkpoint["state_dict"]["ballast"] = ballast
            saved_bytes = _state_bytes(checkpoint)
            plugin.save_checkpoint(checkpoint, path)
            plugin.wait()
            del checkpoint
            _zero(target)
            loaded = sync.load_checkpoint(path, state=target)
            want = facts(live_state(model, adam))
            want["state_dict/ballast"] = ("tensor", ballast.clone())
            bad = differing(facts(target), want)
            if bad or loaded["global_step"] != cycle:
                raise AssertionError(f"cycle {cycle}: not bit-exact: {bad[:5]}")
            compared += sum(f[0] != "value" for f in want.values())
            if cycle in (2, cycles):
                usage[cycle] = _usage()
    background.teardown()
    return {
        "usage": usage,
        "compared": compared,
        "saved_bytes": saved_bytes,
        "raw_thread_seen": _raw_thread_seen(),
    }


def test_twenty_save_load_cycles_leak_no_files_threads_or_memory(tmp_path: Path) -> None:
    results = run_distributed(
        _soak, 2, str(tmp_path), SOAK_CYCLES, timeout=TIMEOUT, init_process_group=False
    )
    for rank, result in enumerate(results):
        early, late = result["usage"][2], result["usage"][SOAK_CYCLES]
        assert result["compared"] > SOAK_CYCLES * 30, result["compared"]  # real tensors
        assert late["fds"] <= early["fds"], (rank, early, late)
        assert late["threads"] <= early["threads"], (rank, early, late)
        assert late["native_threads"] <= early["native_threads"], (rank, early, late)
        # The native count sees a thread threading.active_count() does not.
        assert result["raw_thread_seen"] == {"threads": 0, "native_threads": 1}, result
        bound_kb = RSS_BOUND_STATES * result["saved_bytes"] // 1024
        assert result["saved_bytes"] > BALLAST_ELEMENTS * 4, result["saved_bytes"]
        assert late["rss_kb"] - early["rss_kb"] < bound_kb, (rank, bound_kb, early, late)
    print(
        f"soak usage (cycle 2 -> {SOAK_CYCLES}):",
        [(r["usage"], r["saved_bytes"]) for r in results],
    )
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
