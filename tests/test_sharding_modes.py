"""Every sharding mode trains like one process, resumes bit-exactly, and converts.

``MegatronFSDPStrategy(sharding_strategy=...)`` with ZeRO-3 (``FULL_SHARD``), ZeRO-2
(``SHARD_GRAD_OP``), ZeRO-1 (``SHARD_OPTIMIZER``), no-shard (``NO_SHARD``) and the hybrid
forms of ZeRO-3 and ZeRO-2 on a (2, 2) mesh, through the real Trainer on real gloo ranks
(``tests.harness``), with ``tests.test_portability``'s ``PackedLit`` (uneven packing, a tie,
a rank that owns none of some parameters). Asserted:

* options: every name, alias and raw ``Placements`` is validated at construction; on
  megatron-fsdp 0.6.1 every mode but ``FULL_SHARD``/``HYBRID_SHARD`` is refused there,
  naming 0.7, and the hybrid ZeRO-1 everywhere (upstream cannot finalise it);
* each mode at 1-4 ranks (1-D modes with two accumulated micro-batches per step) ends
  where one plain process does on the same global batches (1e-6), and a resume from its
  epoch-0 checkpoint in the same mode and world size ends bit-identical to the
  uninterrupted run;
* conversions: checkpoints of every mode resume in other modes at other world sizes (the
  issue's chain ZeRO-3 at 3 -> ZeRO-1 at 2 -> no-shard at 1 among them); the restored
  parameters, Adam state and buffer equal the saved ones bit for bit, and training then
  ends within 1e-6 of one process;
* replicated tensors (``NO_SHARD``) are written once; the offline tools inspect, verify and
  consolidate every mode's checkpoint into the saved values, bit for bit.

State is assembled from every rank's local shards at the offsets ``chunk_metadata_by_fqn``
reports with every collective trapped (rank-local in every mode): each row exactly once, a
replicated tensor equal on every rank, hybrid meshes one replica row at a time (rows equal).

The multi-rank tests need megatron-fsdp 0.7 (the replicated-parameter modes); they run in
CI's second pass (``both_versions``) and skip on 0.6.1, where the option test checks the
refusal instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import (
    MegatronFSDPStrategy,
    ShardingMode,
    chunk_metadata_by_fqn,
    consolidate_checkpoint,
    fsdp_placements,
    inspect_checkpoint,
    shard_module,
    sharding_scope,
    verify_checkpoint,
)
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron.sharding_modes import MODES, resolve_sharding_mode
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock
from tests.test_checkpoint_roundtrip import collectives_forbidden
from tests.test_portability import (
    GLOBAL_BATCH,
    PackedLit,
    assemble,
    assert_same,
    make_trainer,
    probe_outputs,
    token_data,
    train_reference,
)

pytestmark = pytest.mark.both_versions

ONE_D = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIMIZER", "NO_SHARD")
HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_GRAD_OP")
REFERENCE_ATOL = 1e-6  # sharded vs one process: only the order of the reductions differs
needs_07 = pytest.mark.skipif(
    not _megatron.REPLICATED_PARAMETERS,
    reason=f"needs megatron-fsdp 0.7 (installed: {_megatron.VERSION}); "
    "test_sharding_strategy_is_validated_at_construction checks the refusal here",
)


# ---------------------------------------------------------------------- the option


def test_sharding_strategy_is_validated_at_construction() -> None:
    """Names, aliases, torch's enum and raw placements; refusals name the fix (no group)."""
    supported = {"FULL_SHARD", "HYBRID_SHARD"}
    if _megatron.REPLICATED_PARAMETERS:
        supported |= {"SHARD_GRAD_OP", "SHARD_OPTIMIZER", "NO_SHARD", "HYBRID_SHARD_GRAD_OP"}
    for name, shards in MODES.items():
        mesh = (2, 2) if shards.hybrid else None
        if name in supported:
            strategy = MegatronFSDPStrategy(sharding_strategy=name, device_mesh=mesh)
            assert strategy.sharding_mode.name == name
            assert strategy.placements == strategy.sharding_mode.placements
        elif name == "HYBRID_SHARD_OPTIMIZER":  # upstream finalises one mesh axis at a time
            with pytest.raises(ValueError, match=r"HYBRID_SHARD_OPTIMIZER: .* more than one mesh"):
                MegatronFSDPStrategy(sharding_strategy=name, device_mesh=mesh)
        else:
            with pytest.raises(ValueError, match=rf"{name}: megatron-fsdp 0\.6\.1 .*needs .*0\.7"):
                MegatronFSDPStrategy(sharding_strategy=name, device_mesh=mesh)
    # Defaults: FULL_SHARD on a 1-D mesh, HYBRID_SHARD on a 2-D one (as before the option).
    assert MegatronFSDPStrategy().sharding_mode.name == "FULL_SHARD"
    assert MegatronFSDPStrategy(device_mesh=(1, 2)).sharding_mode.name == "HYBRID_SHARD"
    assert MegatronFSDPStrategy().placements == _megatron.fsdp_placements()
    assert MegatronFSDPStrategy(device_mesh=(2, 1)).placements == _megatron.hsdp_placements()
    # torch's enum, lower case, and raw placements.
    full = resolve_sharding_mode(ShardingStrategy.FULL_SHARD, 1, "S")
    assert (
        full
        == resolve_sharding_mode("full_shard", 1, "S")
        == ShardingMode("FULL_SHARD", _megatron.fsdp_placements())
    )
    custom = MegatronFSDPStrategy(sharding_strategy=_megatron.fsdp_placements())
    assert custom.sharding_mode.name == "custom"
    assert resolve_sharding_mode("optim_grads_params", 1, "S").name == "FULL_SHARD"
    zero1 = _megatron.sharding_placements(
        parameters=False, gradients=False, optimizer=True, hybrid=False
    )
    if _megatron.REPLICATED_PARAMETERS:  # raw placements follow the same rules as names
        assert MegatronFSDPStrategy(sharding_strategy=zero1).placements == zero1
    else:
        with pytest.raises(ValueError, match=r"sharding_strategy=Placements\(.*needs .*0\.7"):
            MegatronFSDPStrategy(sharding_strategy=zero1)
    if _megatron.REPLICATED_PARAMETERS:  # Megatron-LM's and torch's other spellings
        assert resolve_sharding_mode("optim", 1, "S").name == "SHARD_OPTIMIZER"
        assert resolve_sharding_mode("optim_grads", 1, "S").name == "SHARD_GRAD_OP"
        assert resolve_sharding_mode("no_shard", 1, "S").name == "NO_SHARD"
        hybrid_zero2 = resolve_sharding_mode(ShardingStrategy._HYBRID_SHARD_ZERO2, 2, "S")
        assert hybrid_zero2.name == "HYBRID_SHARD_GRAD_OP"
        with pytest.raises(ValueError, match=r"'NO_SHARD' replicates .* leave device_mesh=None"):
            MegatronFSDPStrategy(sharding_strategy="NO_SHARD", device_mesh=(2, 2))
        with pytest.raises(ValueError, match=r"use 'HYBRID_SHARD_GRAD_OP' for its hybrid form"):
            MegatronFSDPStrategy(sharding_strategy="SHARD_GRAD_OP", device_mesh=(2, 2))
    with pytest.raises(ValueError, match=r"use 'HYBRID_SHARD' for its hybrid form"):
        MegatronFSDPStrategy(sharding_strategy="FULL_SHARD", device_mesh=(2, 2))
    with pytest.raises(ValueError, match=r"'HYBRID_SHARD' replicates .* device_mesh=\("):
        MegatronFSDPStrategy(sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match=r"sharding_strategy='ZERO9' is not a sharding mode"):
        MegatronFSDPStrategy(sharding_strategy="ZERO9")
    with pytest.raises(TypeError, match=r"sharding_strategy must be None, a name .* got 3"):
        MegatronFSDPStrategy(sharding_strategy=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Placements with 1 dp_axes needs a 1-D device_mesh"):
        MegatronFSDPStrategy(sharding_strategy=_megatron.fsdp_placements(), device_mesh=(2, 2))
    with pytest.raises(ValueError, match="unknown name 'ZERO9'"):
        ShardingMode("ZERO9", _megatron.fsdp_placements())


class _ShardedByHand(PackedLit):
    """Shards itself in ``configure_model`` with ZeRO-3 placements, whatever the strategy."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        with sharding_scope():
            for block in self.lm.blocks:
                shard_module(block, mesh, fsdp_placements())
            shard_module(self, mesh, fsdp_placements())


def _fit_sharded_by_hand(rank: int, world_size: int) -> str:
    strategy = MegatronFSDPStrategy(timeout=PROCESS_GROUP_TIMEOUT, sharding_strategy="optim")
    trainer = make_trainer(world_size, strategy, max_steps=1)
    with pytest.raises(ValueError) as info:
        trainer.fit(_ShardedByHand(), DataLoader(TensorDataset(*token_data()), batch_size=12))
    return str(info.value)


@needs_07
def test_units_sharded_in_another_mode_are_refused() -> None:
    """A model sharded by hand in ZeRO-3 under a ZeRO-1 strategy: one clear error at setup."""
    (message,) = run_distributed(_fit_sharded_by_hand, 1, init_process_group=False)
    assert re.search(
        r"unit '<root>' is sharded with parameter/gradient/optimizer placements "
        r"\[Shard\(dim=0\)\]/\[Shard\(dim=0\)\]/\[Shard\(dim=0\)\], but sharding_strategy "
        r"asks for \[Replicate\(\)\]/\[Partial\(avg\)\]/\[Shard\(dim=0\)\]\. Shard units in "
        r"configure_model with self\.trainer\.strategy\.shard\(module\)",
        message,
    ), message


# ---------------------------------------------------------------------- state, gathered

# name -> (first global row of this rank's shard, or None for a tensor every rank holds
# whole, values)
Shards = dict[str, tuple[int | None, np.ndarray]]


def _local(value: Any, chunk_offset: int) -> tuple[int | None, np.ndarray]:
    if not isinstance(value, DTensor):
        return None, value.detach().numpy().copy()
    local = value._local_tensor.detach().numpy().copy()
    if all(isinstance(p, Replicate) for p in value.placements):
        return None, local  # held whole by every rank (NO_SHARD): assemble checks they agree
    return chunk_offset, local


def _state(module: pl.LightningModule, optimizer: Any) -> dict[str, Shards]:
    """This rank's parameters and buffer, and its Adam state (``"<fqn>/<name>"``).

    The chunks come from ``chunk_metadata_by_fqn`` with every collective trapped: rank-local
    in every mode.
    """
    with collectives_forbidden():
        chunks = chunk_metadata_by_fqn(module)
    offset = {fqn: int(chunk.offsets[0]) for fqn, chunk in chunks.items()}
    params: Shards = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        params[name] = _local(parameter, offset[name])
    for name, buffer in module.named_buffers():
        params[name] = (None, buffer.detach().numpy().copy())
    names = {id(p): n for n, p in module.named_parameters()}
    states: Shards = {}
    for parameter, state in optimizer.state.items():
        fqn = names[id(parameter)]
        for key, value in state.items():
            states[f"{fqn}/{key}"] = _local(value, offset[fqn])
    return {"params": params, "optimizer": states}


def _full(per_rank: list[dict[str, Shards]], hybrid: bool) -> dict[str, dict[str, np.ndarray]]:
    """Whole tensors from every rank's shards; hybrid: each replica row alone, rows equal."""
    rows = [per_rank[i : i + 2] for i in range(0, len(per_rank), 2)] if hybrid else [per_rank]
    result = {}
    for part in ("params", "optimizer"):
        first = assemble([r[part] for r in rows[0]])
        for other in rows[1:]:
            assert_same(assemble([r[part] for r in other]), first)
        result[part] = first
    return result


class _Record(Callback):
    """The state after any restore (at train start) and at the end of every epoch."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, Shards]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.outputs = probe_outputs(pl_module)
        self.start = _state(pl_module, trainer.optimizers[0])

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epochs.append(_state(pl_module, trainer.optimizers[0]))


def _fit(
    world_size: int,
    mode: str,
    *,
    epochs: int,
    root: str,
    ckpt_path: str | None = None,
    accumulate: int = 1,
) -> dict[str, Any]:
    """Fit ``PackedLit`` in ``mode`` until ``epochs``, checkpointing each epoch into ``root``.

    A resume starts from other values (seed 1, another buffer value), so a restore that
    does nothing cannot pass.
    """
    model = PackedLit(seed=0 if ckpt_path is None else 1)
    if ckpt_path is not None:
        model.temperature.fill_(2.0)
    record = _Record()
    strategy = MegatronFSDPStrategy(
        timeout=PROCESS_GROUP_TIMEOUT,
        auto_wrap_policy={PackedBlock},
        sharding_strategy=mode,
        device_mesh=(2, world_size // 2) if MODES[mode].hybrid else None,
    )
    trainer = make_trainer(
        world_size,
        strategy,
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=True,
        callbacks=[record, ModelCheckpoint(dirpath=root, save_top_k=-1)],
    )
    loader = DataLoader(
        TensorDataset(*token_data()), batch_size=GLOBAL_BATCH // world_size // accumulate
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return {
        "outputs": record.outputs,
        "start": record.start,
        "epochs": record.epochs,
        "global_step": trainer.global_step,
    }


def _jobs(rank: int, world_size: int, jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run each job's fit in order, in one launch."""
    return {name: _fit(world_size, **job) for name, job in jobs.items()}


def _checkpoint(root: Path, name: str, epoch: int) -> str:
    return os.fspath(root / name / f"epoch={epoch}-step={2 * (epoch + 1)}.ckpt")


def _assert_close(actual: dict[str, dict[str, np.ndarray]], expected: Any, what: str) -> None:
    for part in ("params", "optimizer"):
        assert sorted(actual[part]) == sorted(expected[part]), what
        for key, value in expected[part].items():
            np.testing.assert_allclose(
                actual[part][key], value, rtol=0, atol=REFERENCE_ATOL, err_msg=f"{what}: {key}"
            )


def _assert_bits(actual: dict[str, dict[str, np.ndarray]], expected: Any) -> None:
    for part in ("params", "optimizer"):
        assert_same(actual[part], expected[part])


# ---------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run, launch by launch (later launches resume earlier checkpoints).

    Returns:
        ``{"root": the checkpoint root, "<job>": (world size, mode, per-rank results)}``.
    """
    root = tmp_path_factory.mktemp("sharding_modes")
    launches: list[tuple[int, dict[str, dict[str, Any]]]] = []

    def job(name: str, mode: str, epochs: int, **kwargs: Any) -> dict[str, Any]:
        return {"mode": mode, "epochs": epochs, "root": os.fspath(root / name), **kwargs}

    # Each 1-D mode at 2 ranks (two micro-batches per step), uninterrupted and resumed
    # from its epoch-0 checkpoint; ZeRO-3 at 3 ranks too, the chain's first link.
    at_2 = {}
    for mode in ONE_D:
        at_2[f"{mode}@2"] = job(f"{mode}@2", mode, 2, accumulate=2)
        at_2[f"{mode}@2 resumed"] = job(
            f"{mode}@2 resumed", mode, 2, accumulate=2, ckpt_path=_checkpoint(root, f"{mode}@2", 0)
        )
    at_3 = {
        "FULL_SHARD@3": job("FULL_SHARD@3", "FULL_SHARD", 2, accumulate=2),
        "FULL_SHARD@3 resumed": job(
            "FULL_SHARD@3 resumed",
            "FULL_SHARD",
            2,
            accumulate=2,
            ckpt_path=_checkpoint(root, "FULL_SHARD@3", 0),
        ),
    }
    launches.append((3, at_3))
    # The chain: ZeRO-3 at 3 -> ZeRO-1 at 2 (epoch 1) -> no-shard at 1 (epoch 2).
    at_2["chain: SHARD_OPTIMIZER@2"] = job(
        "chain@2", "SHARD_OPTIMIZER", 2, ckpt_path=_checkpoint(root, "FULL_SHARD@3", 0)
    )
    launches.append((2, at_2))
    at_4 = {}
    for mode in HYBRID:
        at_4[f"{mode}@4"] = job(f"{mode}@4", mode, 2)
        at_4[f"{mode}@4 resumed"] = job(
            f"{mode}@4 resumed", mode, 2, ckpt_path=_checkpoint(root, f"{mode}@4", 0)
        )
    at_4["SHARD_GRAD_OP@2 -> HYBRID_SHARD@4"] = job(
        "c1", "HYBRID_SHARD", 2, ckpt_path=_checkpoint(root, "SHARD_GRAD_OP@2", 0)
    )
    at_4["NO_SHARD@2 -> HYBRID_SHARD_GRAD_OP@4"] = job(
        "c2", "HYBRID_SHARD_GRAD_OP", 2, ckpt_path=_checkpoint(root, "NO_SHARD@2", 0)
    )
    launches.append((4, at_4))
    at_1 = {
        "chain: NO_SHARD@1": job(
            "chain@1", "NO_SHARD", 3, ckpt_path=_checkpoint(root, "chain@2", 1)
        ),
        "HYBRID_SHARD_GRAD_OP@4 -> SHARD_GRAD_OP@1": job(
            "c3", "SHARD_GRAD_OP", 2, ckpt_path=_checkpoint(root, "HYBRID_SHARD_GRAD_OP@4", 0)
        ),
        "HYBRID_SHARD@4 -> SHARD_OPTIMIZER@1": job(
            "c4", "SHARD_OPTIMIZER", 2, ckpt_path=_checkpoint(root, "HYBRID_SHARD@4", 0)
        ),
    }
    launches.append((1, at_1))
    at_3_again = {
        "SHARD_OPTIMIZER@2 -> NO_SHARD@3": job(
            "c5", "NO_SHARD", 2, accumulate=2, ckpt_path=_checkpoint(root, "SHARD_OPTIMIZER@2", 0)
        ),
        "NO_SHARD@2 -> SHARD_GRAD_OP@3": job(
            "c6", "SHARD_GRAD_OP", 2, ckpt_path=_checkpoint(root, "NO_SHARD@2", 0)
        ),
        "HYBRID_SHARD_GRAD_OP@4 -> FULL_SHARD@3": job(
            "c7", "FULL_SHARD", 2, ckpt_path=_checkpoint(root, "HYBRID_SHARD_GRAD_OP@4", 0)
        ),
    }
    launches.append((3, at_3_again))

    results: dict[str, Any] = {"root": root}
    for world_size, jobs in launches:
        per_rank = run_distributed(_jobs, world_size, jobs, init_process_group=False, timeout=600)
        for name, spec in jobs.items():
            results[name] = (world_size, spec["mode"], [r[name] for r in per_rank])
    return results


def _epoch(run: tuple[int, str, list[Any]], epoch: int) -> dict[str, dict[str, np.ndarray]]:
    _, mode, per_rank = run
    return _full([r["epochs"][epoch] for r in per_rank], MODES[mode].hybrid)


@needs_07
def test_each_mode_matches_one_process_and_resumes_bit_exactly(runs: dict[str, Any]) -> None:
    """1-D modes at 2 ranks (and ZeRO-3 at 3), hybrid ZeRO-3/ZeRO-2 at (2, 2)."""
    reference = train_reference(3)
    uninterrupted = [f"{m}@2" for m in ONE_D] + ["FULL_SHARD@3"] + [f"{m}@4" for m in HYBRID]
    for name in uninterrupted:
        run = runs[name]
        for epoch in (0, 1):
            _assert_close(_epoch(run, epoch), reference[epoch], f"{name}, epoch {epoch}")
        # Resumed from its own epoch-0 checkpoint, same mode and world size: to the bit.
        resumed = runs[f"{name} resumed"]
        _assert_bits(_full([r["start"] for r in resumed[2]], MODES[run[1]].hybrid), _epoch(run, 0))
        _assert_bits(_epoch(resumed, 0), _epoch(run, 1))
        assert [r["global_step"] for r in resumed[2]] == [4] * run[0]
        # Not vacuous: the second epoch moved the weights.
        assert not np.array_equal(
            _epoch(run, 1)["params"]["lm.embed.weight"], _epoch(run, 0)["params"]["lm.embed.weight"]
        )
    # What each mode keeps per rank: ZeRO-1/2/3 shard the parameters' main weights and
    # the Adam state by the same layout; no-shard holds them whole on every rank.
    for name in ("SHARD_OPTIMIZER@2", "SHARD_GRAD_OP@2", "FULL_SHARD@2"):
        per_rank = runs[name][2]
        for rank_state in (r["epochs"][0] for r in per_rank):
            offset, values = rank_state["params"]["lm.blocks.0.mix"]
            assert offset is not None
            assert rank_state["optimizer"]["lm.blocks.0.mix/exp_avg"][0] == offset
            assert rank_state["optimizer"]["lm.blocks.0.mix/exp_avg"][1].shape == values.shape
    for rank_state in (r["epochs"][0] for r in runs["NO_SHARD@2"][2]):
        assert rank_state["params"]["lm.blocks.0.mix"][0] is None
        assert rank_state["params"]["lm.blocks.0.mix"][1].shape == (5, 2, 3)


@needs_07
def test_checkpoints_convert_between_modes_and_world_sizes(runs: dict[str, Any]) -> None:
    """Each conversion restores the saved state to the bit, then trains like one process."""
    reference = train_reference(3)
    conversions = {  # run -> (the run whose checkpoint it resumed, that checkpoint's epoch)
        "chain: SHARD_OPTIMIZER@2": ("FULL_SHARD@3", 0),
        "chain: NO_SHARD@1": ("chain: SHARD_OPTIMIZER@2", 1),
        "SHARD_GRAD_OP@2 -> HYBRID_SHARD@4": ("SHARD_GRAD_OP@2", 0),
        "NO_SHARD@2 -> HYBRID_SHARD_GRAD_OP@4": ("NO_SHARD@2", 0),
        "HYBRID_SHARD_GRAD_OP@4 -> SHARD_GRAD_OP@1": ("HYBRID_SHARD_GRAD_OP@4", 0),
        "HYBRID_SHARD@4 -> SHARD_OPTIMIZER@1": ("HYBRID_SHARD@4", 0),
        "SHARD_OPTIMIZER@2 -> NO_SHARD@3": ("SHARD_OPTIMIZER@2", 0),
        "NO_SHARD@2 -> SHARD_GRAD_OP@3": ("NO_SHARD@2", 0),
        "HYBRID_SHARD_GRAD_OP@4 -> FULL_SHARD@3": ("HYBRID_SHARD_GRAD_OP@4", 0),
    }
    first_epoch = {"chain: SHARD_OPTIMIZER@2": 1}  # the epoch a resumed source ran first
    for name, (source, saved_epoch) in conversions.items():
        _, mode, per_rank = runs[name]
        restored = _full([r["start"] for r in per_rank], MODES[mode].hybrid)
        _assert_bits(restored, _epoch(runs[source], saved_epoch - first_epoch.get(source, 0)))
        ran = len(per_rank[0]["epochs"])
        assert [r["global_step"] for r in per_rank] == [2 * (saved_epoch + 1 + ran)] * len(per_rank)
        _assert_close(_epoch(runs[name], -1), reference[saved_epoch + ran], name)
    # The chain ends after three epochs, where one process does.
    assert len(runs["chain: NO_SHARD@1"][2][0]["epochs"]) == 1


@needs_07
def test_replicated_tensors_are_written_once_and_offline_tools_read_every_mode(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    """inspect/verify/consolidate each mode's epoch-0 checkpoint; NO_SHARD: one chunk each."""
    root: Path = runs["root"]
    saved = {f"{m}@2": f"{m}@2" for m in ONE_D} | {f"{m}@4": f"{m}@4" for m in HYBRID}
    saved["FULL_SHARD@3"] = "FULL_SHARD@3"
    for name in saved:
        path = _checkpoint(root, name, 0)
        assert verify_checkpoint(path) == [], name
        info = inspect_checkpoint(path)
        mode = runs[name][1]
        assert info.meta is not None
        expected = _epoch(runs[name], 0)
        out = consolidate_checkpoint(path, tmp_path / f"{name}.pt", include_optimizer=True)
        consolidated = torch.load(out, weights_only=True)
        for fqn, value in expected["params"].items():
            np.testing.assert_array_equal(
                consolidated[fqn].numpy(), value, err_msg=f"{name}: {fqn}", strict=True
            )
        for key, value in expected["optimizer"].items():
            fqn, state = key.split("/")
            stored = consolidated[f"optimizer_states.0.state.{fqn}.{state}"]
            np.testing.assert_array_equal(stored.numpy(), value, err_msg=f"{name}: {key}")
        chunks = {t.key: t.chunks for t in info.tensors}
        if mode == "NO_SHARD":  # every rank holds every tensor; DCP writes each once
            assert set(chunks.values()) == {1}, chunks
        else:
            assert max(chunks.values()) > 1, name  # not vacuous: sharded modes have chunks
    # Replicated data on disk once: NO_SHARD's files are no larger than ZeRO-3's (each
    # tensor twice would double them).
    sizes = {
        name: sum(f.stat().st_size for f in Path(_checkpoint(root, name, 0)).glob("*.distcp"))
        for name in ("NO_SHARD@2", "FULL_SHARD@2")
    }
    assert sizes["NO_SHARD@2"] < 1.1 * sizes["FULL_SHARD@2"], sizes
    metadata = FileSystemReader(_checkpoint(root, "NO_SHARD@2", 0)).read_metadata()
    assert all(
        len(md.chunks) == 1 for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks")
    )
