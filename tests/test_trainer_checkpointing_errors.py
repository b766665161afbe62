"""Trainer end to end: bad checkpoints and rank-local failures raise one clear error everywhere.

One set of 2 real ranks saves a good checkpoint (2 steps, ``ModelCheckpoint``) and a
weights-only one (``trainer.save_checkpoint(..., weights_only=True)`` after fit), then
runs one ``fit`` per bad input. Each must raise on *every* rank (the harness fails a rank
that hangs), say what was found and what was expected, and leave both the checkpoint on
disk and the model as they were (weights compared with those at ``on_fit_start``, before
the restore). ``strict_loading=False`` skips missing and unexpected keys, never a shape.
Two failures are provoked on one rank only, where the strategy must agree across ranks
before the checkpoint IO's first collective: a save whose state differs on rank 1 (the
chunk metadata cannot be attached there) and a load whose optimizer cannot create state
on rank 1. Without that agreement rank 0 waits in the IO's collective until the process
group's timeout, and the harness reports it as hung.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn

from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.storage.format import read_manifest
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock, build_packed_lm
from tests.test_strategy import _assemble, _shards
from tests.test_trainer_checkpointing import (
    CheckpointedLM,
    Probe,
    Weights,
    make_trainer,
    token_loader,
    weights,
)

WORLD_SIZE = 2
TIMEOUT = 120.0
GOOD_STEP = 2

Shards = dict[str, tuple[int, np.ndarray]]


class ExtraParameter(CheckpointedLM):
    """The model plus a parameter the checkpoint lacks (trained, so the optimizer owns it)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.ones(3))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return super().training_step(batch, batch_idx) + self.extra.square().sum()


class OneBlock(CheckpointedLM):
    """The model without block 1: the checkpoint holds parameters this model lacks."""

    def __init__(self) -> None:
        super().__init__(num_blocks=1)


class Reshaped(CheckpointedLM):
    """Block 0's ``mix`` has 6 kernels instead of 5 (its forward works with any number)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = build_packed_lm(0)
        self.lm.blocks[0].mix = nn.Parameter(torch.zeros(6, 2, 3))


class StateDiffersOnRank1(CheckpointedLM):
    """On rank 1 only, two state-dict entries are swapped before the save (a rank whose
    model differs): their chunk metadata cannot be attached there, and only there."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_rank == 1:
            state = checkpoint["state_dict"]
            mix, gain = "lm.blocks.0.mix", "lm.blocks.0.gain"
            state[mix], state[gain] = state[gain], state[mix]


class _AdamWithoutStateOnRank1(torch.optim.AdamW):
    """AdamW whose zero-learning-rate step, which creates state to load into, fails on rank 1."""

    def step(self, closure: Any = None) -> Any:
        if dist.get_rank() == 1 and all(group["lr"] == 0 for group in self.param_groups):
            raise RuntimeError("this rank's optimizer cannot create state (test)")
        return super().step(closure)


class NoOptimizerStateOnRank1(CheckpointedLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _AdamWithoutStateOnRank1(self.parameters(), lr=0.05)


class _WeightsAtFitStart(Callback):
    """The freshly sharded weights before any restore, and the shards training starts from."""

    def __init__(self) -> None:
        self.weights: Weights = {}
        self.start_shards: Shards = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = weights(pl_module)
        self.start_shards: Shards = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_shards = _shards(pl_module)  # with row offsets: layouts may differ


def _attempt(
    world_size: int,
    model: CheckpointedLM,
    ckpt_path: str,
    *,
    max_steps: int = GOOD_STEP,
    strict: bool = True,
    allow_weights_only_resume: bool = False,
    callbacks: list[Callback] | None = None,
) -> dict[str, Any]:
    """One ``fit``; returns its outcome, the weights before/after and what it started from."""
    pl.seed_everything(0, verbose=False)
    model.strict_loading = strict
    strategy = MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT)
    strategy.allow_weights_only_resume = allow_weights_only_resume
    before, probe = _WeightsAtFitStart(), Probe()
    trainer = make_trainer(
        world_size,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[before, probe, *(callbacks or [])],
        # No default ModelCheckpoint: it would write into the current directory.
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, token_loader(world_size), ckpt_path=ckpt_path)
            outcome = "ok"
        except BaseException as err:  # CheckpointException would be a BaseException
            outcome = f"{type(err).__name__}: {err}"
    return {
        "outcome": outcome,
        "warnings": [str(w.message) for w in caught if "MegatronFSDP" in str(w.message)],
        "before": before.weights,
        "after": weights(model),
        "start": probe.train_start,
        "start_shards": before.start_shards,
    }


def _bad_inputs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    root_path = Path(root)
    good = root_path / "good" / "last.ckpt"
    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    trainer = make_trainer(
        world_size,
        max_steps=GOOD_STEP,
        callbacks=[ModelCheckpoint(dirpath=root_path / "good", save_last=True)],
    )
    trainer.fit(model, token_loader(world_size))
    result: dict[str, Any] = {"good": weights(model), "good_shards": _shards(model)}
    trainer.save_checkpoint(root_path / "weights-only.ckpt", weights_only=True)

    result["missing"] = _attempt(world_size, CheckpointedLM(), str(root_path / "missing.ckpt"))
    result["plain_file"] = _attempt(world_size, CheckpointedLM(), str(root_path / "plain.ckpt"))
    for name, cls in (("extra", ExtraParameter), ("lacking", OneBlock), ("shape", Reshaped)):
        result[f"{name}_strict"] = _attempt(world_size, cls(), str(good))
        result[f"{name}_lenient"] = _attempt(
            world_size, cls(), str(good), strict=False, max_steps=GOOD_STEP + 1
        )
    result["weights_only"] = _attempt(
        world_size, CheckpointedLM(), str(root_path / "weights-only.ckpt")
    )
    result["save_differs_on_rank1"] = _attempt(
        world_size,
        StateDiffersOnRank1(),
        str(good),
        max_steps=GOOD_STEP + 1,
        callbacks=[ModelCheckpoint(dirpath=root_path / "never", every_n_train_steps=1)],
    )
    result["load_fails_on_rank1"] = _attempt(world_size, NoOptimizerStateOnRank1(), str(good))
    # Last, and successful, so its teardown destroys the group the failed runs kept.
    result["weights_only_allowed"] = _attempt(
        world_size,
        CheckpointedLM(),
        str(root_path / "weights-only.ckpt"),
        allow_weights_only_resume=True,
        max_steps=GOOD_STEP + 1,
    )
    result["group_alive_at_end"] = dist.is_initialized()
    return result


def _same(a: Weights, b: Weights, keys: Any = None) -> bool:
    keys = a.keys() if keys is None else keys
    return all(np.array_equal(a[k], b[k]) for k in keys)


def test_bad_checkpoints_raise_clearly_on_every_rank(tmp_path: Path) -> None:
    """Missing path, torch.save file, missing/extra/reshaped FQNs, no optimizer state,
    one-rank failures: one clear error per case on every rank, nothing overwritten."""
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, plain)
    plain_bytes = plain.read_bytes()
    results = run_distributed(
        _bad_inputs, WORLD_SIZE, str(tmp_path), init_process_group=False, timeout=TIMEOUT
    )
    good = tmp_path / "good" / "last.ckpt"

    def outcome(name: str, *, model_unchanged: bool = True) -> str:
        """The error, after checking every rank failed (and left the model alone)."""
        for result in results:
            case = result[name]
            assert case["outcome"] != "ok", name
            if model_unchanged:
                assert _same(case["after"], case["before"]), f"{name}: the model was modified"
        return results[0][name]["outcome"]

    def same_on_every_rank(name: str) -> str:
        text = outcome(name)
        assert all(r[name]["outcome"] == text for r in results), name
        return text

    def full(name: str) -> dict[str, Tensor]:
        """The weights a case started training from, assembled from every rank's shards."""
        return _assemble([r[name]["start_shards"] for r in results])

    missing = same_on_every_rank("missing")
    assert missing.startswith("NotACheckpointError"), missing
    assert f"{tmp_path / 'missing.ckpt'} does not exist" in missing
    assert not (tmp_path / "missing.ckpt").exists()

    plain_error = same_on_every_rank("plain_file")
    assert plain_error.startswith("NotACheckpointError"), plain_error
    assert "single-file torch.save checkpoint" in plain_error
    assert plain.read_bytes() == plain_bytes

    extra = same_on_every_rank("extra_strict")
    assert extra.startswith("CheckpointMismatchError"), extra
    assert "1 key(s) of the target are missing from the checkpoint: ['extra']" in extra
    lacking = same_on_every_rank("lacking_strict")
    assert "6 key(s) in the checkpoint are not in the target: ['lm.blocks.1.fc.bias'" in lacking
    for name in ("shape_strict", "shape_lenient"):  # strict_loading=False never skips a shape
        shape = same_on_every_rank(name)
        assert shape.startswith("CheckpointMismatchError"), shape
        assert "model 'lm.blocks.0.mix': shape (5, 2, 3) in the checkpoint, (6, 2, 3)" in shape
        assert "'lm.blocks.0.mix/exp_avg': shape (5, 2, 3)" in shape  # the optimizer too

    weights_only = same_on_every_rank("weights_only")
    assert weights_only.startswith("CheckpointMismatchError"), weights_only
    assert "holds no optimizer state" in weights_only
    assert "allow_weights_only_resume = True" in weights_only

    good_full = _assemble([r["good_shards"] for r in results])
    # strict_loading=False: the shared keys are loaded, a missing key keeps its value.
    for name in ("extra_lenient", "lacking_lenient"):
        assert all(r[name]["outcome"] == "ok" for r in results), name
        loaded = full(name)
        shared = [k for k in loaded if k in good_full]
        assert len(shared) >= 8, shared
        for key in shared:
            torch.testing.assert_close(loaded[key], good_full[key], rtol=0, atol=0)
    assert set(good_full) - set(full("lacking_lenient")) == {
        f"lm.blocks.1.{p}"
        for p in ("mix", "gain", "fc.weight", "fc.bias", "out.weight", "out.bias")
    }
    torch.testing.assert_close(full("extra_lenient")["extra"], torch.ones(3), rtol=0, atol=0)
    # ... and the optimizer still owns and steps it.
    extra_after = [r["extra_lenient"]["after"]["extra"] for r in results]
    assert sum(a.size for a in extra_after) == 3
    assert not np.array_equal(np.concatenate(extra_after), np.ones(3, dtype=np.float32))

    for rank, result in enumerate(results):
        good_weights = result["good"]
        assert result["lacking_lenient"]["start"]["global_step"] == GOOD_STEP
        # The opt-in weights-only resume: weights and position, fresh optimizer state.
        allowed = result["weights_only_allowed"]
        assert allowed["outcome"] == "ok"
        assert _same(allowed["start"]["weights"], good_weights)
        assert allowed["start"]["global_step"] == GOOD_STEP
        assert allowed["start"]["optimizer"] == {"0/lr": [0.05]}  # no state, initial lr
        # ...and the user is told so, once (rank 0); a full resume warns nothing.
        weights_only_warnings = [
            w for w in allowed["warnings"] if "resuming fit from weights-only checkpoint" in w
        ]
        assert len(weights_only_warnings) == (1 if rank == 0 else 0), allowed["warnings"]
        if rank == 0:
            assert str(tmp_path / "weights-only.ckpt") in weights_only_warnings[0]
            assert "optimizer state and LR schedulers start fresh" in weights_only_warnings[0]
        assert result["lacking_lenient"]["warnings"] == []
        # One rank fails alone: both raise; the failing rank its own error, the other
        # names it; the save wrote nothing.
        saving = result["save_differs_on_rank1"]["outcome"]
        assert saving.startswith("CheckpointSaveError"), saving
        loading = result["load_fails_on_rank1"]["outcome"]
        assert loading.startswith("CheckpointError"), loading
        # The save's agreement gives every rank the same error: rank 1's cause, named.
        assert "failed on rank(s) [1]" in saving and "'lm.blocks.0.mix'" in saving, saving
        if rank == 1:
            assert "failed on rank(s) [1]" in saving and "'lm.blocks.0.mix'" in saving, saving
            assert "this rank's optimizer cannot create state" in loading, loading
        else:
            assert "failed on rank(s) [1]" in loading, loading
        assert result["group_alive_at_end"] is True  # the group lives until exit
    outcome("save_differs_on_rank1", model_unchanged=False)  # it trained a step, then saved
    outcome("load_fails_on_rank1")
    assert not (tmp_path / "never").exists() or not list((tmp_path / "never").iterdir())
    # Nothing overwritten: the checkpoint still verifies, every file against its checksum.
    assert read_manifest(good).global_step == GOOD_STEP
    assert verify_checkpoint(good) == []
