"""Our collective rounds per save and per load, counted in a real 2-rank fit and held.

At thousands of ranks every round is a latency and a chance for a straggler to time out,
so a save and a load each take at most three collective rounds of ours (DESIGN.md, "Save
path", "Load path"); DCP's own collectives come on top and are not counted. The count is
taken at torch.distributed's Python functions (the calls the collective trap of
``test_checkpoint_roundtrip`` forbids), each outermost call counted once, attributed to us
when the package is on the stack and DCP is not.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.checkpoint.metadata_slices import MetadataSlices
from lightning_megatron_fsdp.common.exact_resume import RNG_STATES_KEY
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy as FabricStrategy
from lightning_megatron_fsdp.storage import commit
from lightning_megatron_fsdp.storage.commit import LocalDirectories
from lightning_megatron_fsdp.storage.filesystem import (
    ChecksummingFileSystemWriter,
    VerifyingFileSystemReader,
)
from lightning_megatron_fsdp.storage.format import Manifest
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock
from tests.scripts.fault_injection import checkpoint_dict, init_group, live_state, step, trained
from tests.test_checkpoint_roundtrip import _C10D_COLLECTIVES
from tests.test_trainer_checkpointing import CheckpointedLM, make_trainer, token_loader

TIMEOUT = 180.0
MAX_ROUNDS = 3
PACKAGE = "/lightning_megatron_fsdp/"
DCP = "/torch/distributed/checkpoint/"


@contextlib.contextmanager
def our_rounds() -> Iterator[list[str]]:
    """Record every collective our code issues inside the block, outside DCP, as
    ``"<function> from <file>:<line>"`` (the package frame nearest the call)."""
    rounds: list[str] = []
    depth = threading.local()
    saved: list[tuple[Any, str, Any]] = []

    def counted(name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            outermost = getattr(depth, "n", 0) == 0
            if outermost and threading.current_thread() is threading.main_thread():
                stack = traceback.extract_stack()[:-1]
                ours = [f for f in stack if PACKAGE in f.filename]
                callers = [f for f in ours if not f.filename.endswith("agreement.py")]
                if ours and not any(DCP in f.filename for f in stack):
                    where = (callers or ours)[-1]
                    rounds.append(f"{name} from {Path(where.filename).name}:{where.lineno}")
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.n -= 1

        return call

    for target in (dist, dist.distributed_c10d):
        for name in _C10D_COLLECTIVES:
            if hasattr(target, name):
                original = getattr(target, name)
                saved.append((target, name, original))
                setattr(target, name, counted(name, original))
    try:
        yield rounds
    finally:
        for target, name, original in saved:
            setattr(target, name, original)


@contextlib.contextmanager
def calls_to(owner: Any, name: str) -> Iterator[list[int]]:
    """Count the calls to ``owner.<name>`` inside the block (the real function runs)."""
    count = [0]
    original = inspect.getattr_static(owner, name)
    function = original.__func__ if isinstance(original, classmethod) else original

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return function(*args, **kwargs)

    setattr(owner, name, classmethod(counted) if isinstance(original, classmethod) else counted)
    try:
        yield count
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def counting_load(counted: dict[str, list[Any]], **more: tuple[Any, str]) -> Iterator[None]:
    """Append one load's rounds of ours to ``counted["load"]`` and its manifest parses,
    crash recoveries and ``.metadata`` reads (and each of ``more``, key -> (owner, name)) to
    ``counted[key]``, once the load returns (nothing is appended if it raises)."""
    targets = {
        "parsed": (Manifest, "from_json"),
        "recovered": (commit, "recover_checkpoint"),
        "metadata_read": (VerifyingFileSystemReader, "_read_metadata_file"),
        "keys_read": (MetadataSlices, "read"),
        **more,
    }
    with contextlib.ExitStack() as stack:
        rounds = stack.enter_context(our_rounds())
        counts = {key: stack.enter_context(calls_to(*target)) for key, target in targets.items()}
        yield
    counted["load"].append(rounds)
    for key, count in counts.items():
        counted[key].append(count[0])


class CountingStrategy(MegatronFSDPStrategy):
    """The strategy, with our rounds of each save and load recorded, and per load the
    manifest parses and crash recoveries."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counted: dict[str, list[Any]] = {
            "save": [],
            "load": [],
            "parsed": [],
            "recovered": [],
            "metadata_read": [],
            "keys_read": [],
        }

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with our_rounds() as rounds:
            super().save_checkpoint(*args, **kwargs)
        self.counted["save"].append(rounds)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with counting_load(self.counted):
            return super().load_checkpoint(*args, **kwargs)


def _fit_save_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    path = Path(root) / "saved.ckpt"
    first = CountingStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT)
    trainer = make_trainer(world_size, strategy=first, max_steps=2, enable_checkpointing=False)
    trainer.fit(CheckpointedLM(), token_loader(world_size))
    trainer.save_checkpoint(path)
    second = CountingStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT)
    trainer = make_trainer(world_size, strategy=second, max_steps=3, enable_checkpointing=False)
    trainer.fit(CheckpointedLM(), token_loader(world_size), ckpt_path=str(path))
    return {"save": first.counted["save"]} | {
        key: second.counted[key]
        for key in ("load", "parsed", "recovered", "metadata_read", "keys_read")
    }


REPLICA_DATA = "from replicated_reads.py"


def coordination(load: list[str]) -> list[str]:
    """A load's rounds less the collectives that carry replicated tensors and byte records
    to the other ranks (data, as DCP's reads are; checkpoint.replicated_reads). A
    FULL_SHARD load has two, however many ranks read some: the all-gathers of the sizes and
    of the shares of the plain tensors every rank holds whole (Adam's ``step``) and the
    byte records (learning rates), each read by the rank that wrote it."""
    data = [r for r in load if r.endswith(REPLICA_DATA, 0, r.rfind(":"))]
    assert len(data) <= 2, f"{len(data)} collectives of replicated data: {load}"
    return [r for r in load if r not in data]


def test_a_save_and_a_load_take_at_most_three_rounds_of_ours(tmp_path: Path) -> None:
    results = run_distributed(
        _fit_save_resume, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    for rank, result in enumerate(results):
        (save,) = result["save"]
        (load,) = result["load"]
        print(f"rank {rank}: save {len(save)} rounds {save}; load {len(load)} rounds {load}")
        # Not vacuous: the counter sees our rounds (the save's agreement at least).
        assert save and load, (save, load)
        assert len(save) <= MAX_ROUNDS, f"rank {rank}: {len(save)} rounds per save: {save}"
        assert len(coordination(load)) <= MAX_ROUNDS, (rank, load)
        # Rank 0 parses the manifest once and runs crash recovery once, for every rank.
        assert result["parsed"] == [1 if rank == 0 else 0], result["parsed"]
        assert result["recovered"] == [1 if rank == 0 else 0], result["recovered"]
        # ... and reads the index the save wrote beside .metadata (.metadata.keys) once, in
        # the first round; no rank unpickles .metadata (metadata_slices).
        assert result["keys_read"] == [1 if rank == 0 else 0], result["keys_read"]
        assert result["metadata_read"] == [0], result["metadata_read"]


class CountingFabricStrategy(FabricStrategy):
    """The Fabric strategy, with each load's rounds, manifest parses, crash recoveries,
    ``.metadata`` and ``meta.pt`` reads recorded as :class:`CountingStrategy` records them
    (``meta.pt`` alone, and with ``.metadata.keys`` in the first round)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counted: dict[str, list[Any]] = {"load": [], "parsed": [], "recovered": []}
        self.counted |= {"metadata_read": [], "keys_read": [], "meta_read": [], "files_read": []}

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with counting_load(
            self.counted,
            meta_read=(LocalDirectories, "read_bytes"),
            files_read=(VerifyingFileSystemReader, "read_files"),
        ):
            return super().load_checkpoint(*args, **kwargs)


def _fabric_save_load(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from tests.test_fabric import _loss, _rank_batch, _two_optimizers

    path = str(Path(root) / "fabric.ckpt")
    strategy = CountingFabricStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model, opt_a, opt_b = _two_optimizers(fabric, seed=0)
    fabric.backward(_loss(model, *_rank_batch(0, rank, world_size)))
    opt_a.step()
    opt_b.step()
    fabric.save(path, {"model": model, "a": opt_a, "b": opt_b, "step": 1})
    fresh, fresh_a, fresh_b = _two_optimizers(fabric, seed=7)
    state = {"b": fresh_b, "model": fresh, "a": fresh_a, "step": 0}
    fabric.load(path, state)
    return strategy.counted | {"step": state["step"]}


def test_a_fabric_load_takes_as_many_rounds_as_the_trainers(tmp_path: Path) -> None:
    """``fabric.load`` goes through the Trainer's load: three rounds of ours, the manifest
    parsed, crash recovery run and ``.metadata.keys`` read once on rank 0 (``.metadata``
    never), and ``meta.pt`` read once, by rank 0 with ``.metadata.keys`` for every rank
    (not once more to learn the saved optimizer keys)."""
    results = run_distributed(
        _fabric_save_load, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    for rank, result in enumerate(results):
        (load,) = result["load"]
        print(f"rank {rank}: fabric.load {len(load)} rounds {load}")
        assert result["step"] == 1, result
        assert load and len(coordination(load)) <= MAX_ROUNDS, (rank, load)
        assert result["parsed"] == [1 if rank == 0 else 0], result["parsed"]
        assert result["recovered"] == [1 if rank == 0 else 0], result["recovered"]
        assert result["keys_read"] == [1 if rank == 0 else 0], result["keys_read"]
        assert result["metadata_read"] == [0], result["metadata_read"]
        # meta.pt: read by rank 0 with .metadata.keys, for every rank (no rank reads it alone).
        assert result["files_read"] == [1 if rank == 0 else 0], result["files_read"]
        assert result["meta_read"] == [0], result["meta_read"]


class _PlanRecordingWriter(ChecksummingFileSystemWriter):
    """The default writer, recording on the coordinator which local plans reached it."""

    seen: list[list[tuple[bool, int]]] = []

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        _PlanRecordingWriter.seen.append([(plan.usable, len(plan.items)) for plan in plans])
        return super().prepare_global_plan(plans)


def _saves_of_one_layout(rank: int, world_size: int, root: str) -> dict[str, Any]:
    init_group(rank, world_size)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO(storage_writer_factory=_PlanRecordingWriter)
    for index in range(3):
        if index:
            step(model, adam, index)  # new values, the same layout
        plugin.save_checkpoint(checkpoint_dict(model, adam, index), Path(root) / f"c{index}")
    target_model, target_adam = trained(world_size, steps=0)
    state = live_state(target_model, target_adam)
    plugin.load_checkpoint(Path(root) / "c2", state=state)
    expected = live_state(model, adam)
    same = all(
        torch.equal(_local(a), _local(b))
        for a, b in zip(_tensors(state), _tensors(expected), strict=True)
    )
    return {"seen": _PlanRecordingWriter.seen, "loaded_exactly": same}


def _local(tensor: Any) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(obj: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for key in sorted(obj, key=str) for t in _tensors(obj[key])]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in _tensors(value)]
    return []


def test_dcp_plans_a_layout_once_and_reuses_the_plan(tmp_path: Path) -> None:
    """The first save of a layout sends every rank's local plan to the coordinator; later
    saves of the same layout send empty ones (DCP's plan caching, keyed by our layout
    digest), and the checkpoint they write still loads bit-exactly."""
    results = run_distributed(
        _saves_of_one_layout, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    seen = results[0]["seen"]  # the coordinator's view
    assert len(seen) == 3, seen
    first, *later = seen
    assert all(usable and items for usable, items in first), first
    for plans in later:
        assert all(not usable and items == 0 for usable, items in plans), plans
    assert all(result["loaded_exactly"] for result in results)


class LoggingIO(CheckpointIO):
    """A user's wrapper around our plugin (not a ``MegatronFSDPCheckpointIO`` itself): the
    strategy takes the general path, a round per step."""

    def __init__(self) -> None:
        self.inner = MegatronFSDPCheckpointIO()
        self.calls: list[str] = []

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.calls.append("save")
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("load")
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _wrapped_fit_save_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    path = Path(root) / "saved.ckpt"
    io = LoggingIO()
    first = CountingStrategy(
        auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT, checkpoint_io=io
    )
    trainer = make_trainer(world_size, strategy=first, max_steps=2, enable_checkpointing=False)
    trainer.fit(CheckpointedLM(), token_loader(world_size))
    trainer.save_checkpoint(path)
    second = CountingStrategy(
        auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT, checkpoint_io=io
    )
    trainer = make_trainer(world_size, strategy=second, max_steps=3, enable_checkpointing=False)
    trainer.fit(CheckpointedLM(), token_loader(world_size), ckpt_path=str(path))
    meta = torch.load(path / "meta.pt", weights_only=False)
    return {
        "calls": io.calls,
        "rng": meta[RNG_STATES_KEY]["world_size"],
        "states": len(meta[RNG_STATES_KEY]["states"]),
        "step": trainer.global_step,
        "save_rounds": len(first.counted["save"][0]),
        "load_rounds": len(second.counted["load"][0]),
    }


def test_a_wrapped_plugin_takes_the_general_path_and_still_saves_every_ranks_streams(
    tmp_path: Path,
) -> None:
    results = run_distributed(
        _wrapped_fit_save_resume, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    for result in results:
        assert result["calls"] == ["save", "load"], result
        assert result["rng"] == 2 and result["states"] == 2, result
        assert result["step"] == 3, result
        # The general path pays a round per step (path, streams, attach; open, targets).
        assert result["save_rounds"] > MAX_ROUNDS and result["load_rounds"] > MAX_ROUNDS, result
