"""With the real Trainer: a rank SIGKILLed during a ``ModelCheckpoint`` save loses nothing.

Run A trains 3 epochs on 2 ranks with ``MegatronFSDPStrategy`` and
``ModelCheckpoint(save_last=True)``, which saves ``epoch=<e>-step=<s>.ckpt`` and then
``last.ckpt`` at the end of every epoch; the sixth save (``last.ckpt`` at the end of
epoch 2, replacing epoch 1's) kills rank 1 right after it wrote its shard files. Run B,
a fresh ``Trainer`` with the
strategy's default checkpoint IO, calls ``fit(ckpt_path="last")``: Lightning's own
``last*`` lookup must find the epoch-1 checkpoint, the strategy must restore it
bit-exactly, and retraining epoch 2 must land bit-exactly on the state run A had when it
was killed (recorded by ``on_save_checkpoint``, before the save began).

Epoch-boundary checkpoints make the resumed data order the uninterrupted one
(``DistributedSampler`` reshuffles by epoch), so bit-exact is the right bar.

And an async save whose background write fails (the kernel refuses a file's size on
rank 1) raises out of ``fit`` at the next training step, leaving ``last.ckpt`` as it was.
"""

from __future__ import annotations

import concurrent.futures
import resource
import signal
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import CheckpointSaveError, MegatronFSDPStrategy
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.storage.format import parse_hidden_name, read_manifest
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.harness import run_distributed
from tests.models import VOCAB, PackedBlock, build_packed_lm, lm_loss, make_trainer
from tests.scripts.fault_injection import PG_TIMEOUT, Fault, FaultyWriter
from tests.shard_facts import assert_same_facts

TIMEOUT = 120.0
EPOCHS = 3
BATCH = 2
BATCHES_PER_EPOCH = 2


class _LM(pl.LightningModule):
    """``PackedLM`` (tied, packed unevenly) that records its local state at every save."""

    def __init__(self, facts_dir: str) -> None:
        super().__init__()
        self.lm = build_packed_lm(0)
        self.facts_dir = Path(facts_dir)
        self.run = "a"

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return lm_loss(self.lm, (batch[0], batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def on_train_start(self) -> None:  # after any restore
        self._record(f"start-{self.run}", self.trainer.strategy.lightning_module_state_dict(), None)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._record(
            f"save-{self.run}-step{checkpoint['global_step']}",
            checkpoint["state_dict"],
            checkpoint["optimizer_states"][0],
        )

    def _record(self, name: str, model_state: Any, optimizer_state: Any) -> None:
        snapshot = {f"model/{k}": _local(v) for k, v in model_state.items()}
        if optimizer_state is not None:
            for fqn, entries in optimizer_state["state"].items():
                snapshot.update({f"optim/{fqn}/{k}": _local(v) for k, v in entries.items()})
        self.facts_dir.mkdir(parents=True, exist_ok=True)
        torch.save(snapshot, self.facts_dir / f"{name}-rank{self.global_rank}.pt")


def _local(value: Any) -> tuple[str, Any]:
    local = getattr(value, "_local_tensor", value)
    return ("tensor", local.detach().clone())


class _KillOnSave:
    """A ``storage_writer_factory``: the ``n``-th save gets a writer that kills ``fault``'s
    rank at its phase; every other save a plain ``FileSystemWriter`` behaviour."""

    def __init__(self, n: int, fault: Fault) -> None:
        self.n, self.fault, self.calls = n, fault, 0

    def __call__(self, path: Path) -> FaultyWriter:
        self.calls += 1
        armed = self.calls == self.n
        return FaultyWriter(path, fault=self.fault if armed else Fault("never", -1))


def _data() -> DataLoader:
    rows = 2 * BATCH * BATCHES_PER_EPOCH
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (rows, 5), generator=generator)
    targets = torch.randint(0, VOCAB, (rows, 5), generator=generator)
    return DataLoader(TensorDataset(tokens, targets), batch_size=BATCH)


def _trainer(root: Path, checkpoint_io: MegatronFSDPCheckpointIO | None) -> pl.Trainer:
    return make_trainer(
        2,
        MegatronFSDPStrategy(
            auto_wrap_policy={PackedBlock}, timeout=PG_TIMEOUT, checkpoint_io=checkpoint_io
        ),
        max_epochs=EPOCHS,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=True)],
        num_sanity_val_steps=0,
    )


def _fit_and_die(rank: int, world_size: int, root: str) -> None:
    pl.seed_everything(0, verbose=False)
    model = _LM(str(Path(root) / "facts"))
    killer = _KillOnSave(6, Fault("write:after", 1, "kill"))
    trainer = _trainer(Path(root), MegatronFSDPCheckpointIO(storage_writer_factory=killer))
    trainer.fit(model, _data())


def _resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = _LM(str(Path(root) / "facts"))
    model.run = "b"
    trainer = _trainer(Path(root), None)
    trainer.fit(model, _data(), ckpt_path="last")
    return {"ckpt_path": trainer.ckpt_path, "global_step": trainer.global_step}


def _facts(root: Path, name: str, rank: int) -> dict[str, Any]:
    return torch.load(root / "facts" / f"{name}-rank{rank}.pt", weights_only=False)


def test_trainer_resumes_bit_exactly_after_a_rank_is_killed_mid_save(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as excinfo:
        run_distributed(_fit_and_die, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False)
    report = str(excinfo.value)
    assert "--- rank 1 failed ---\nprocess died with exit code -9" in report, report
    # The survivor raised out of fit() with the save's error; it did not hang.
    assert "--- rank 0 failed ---" in report, report
    assert "CheckpointSaveError: Saving checkpoint " in report, report  # fit() raised it
    assert "ckpt/last.ckpt failed on rank 0" in report, report
    assert "did not finish" not in report, report

    ckpt = tmp_path / "ckpt"
    steps_per_epoch = BATCHES_PER_EPOCH
    # Epoch 2's own checkpoint was saved; last.ckpt is still epoch 1's; rank 0 cleaned up.
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=2-step=6.ckpt", "last.ckpt"]
    assert read_manifest(ckpt / "last.ckpt").global_step == 2 * steps_per_epoch
    assert verify_checkpoint(ckpt / "last.ckpt") == []

    results = run_distributed(_resume, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False)
    final_step = EPOCHS * steps_per_epoch
    for rank, result in enumerate(results):
        assert result["ckpt_path"] == str(ckpt / "last.ckpt")
        assert result["global_step"] == final_step
        restored = _facts(tmp_path, "start-b", rank)
        saved = _facts(tmp_path, f"save-a-step{2 * steps_per_epoch}", rank)
        assert_same_facts(restored, {k: v for k, v in saved.items() if k.startswith("model/")})
        # Epoch 2 retrained from the restored state equals the state run A was killed saving.
        killed = _facts(tmp_path, f"save-a-step{final_step}", rank)
        assert_same_facts(_facts(tmp_path, f"save-b-step{final_step}", rank), killed)
    assert not [p for p in ckpt.iterdir() if parse_hidden_name(p.name)]
    assert read_manifest(ckpt / "last.ckpt").global_step == final_step
    assert verify_checkpoint(ckpt / "last.ckpt") == []


# ---------------------------------------------------------------------------------------
# A background save that fails inside fit
# ---------------------------------------------------------------------------------------

ASYNC_STEPS = 6  # saves of last.ckpt after steps 2 (A), 4 (B, fails) and 6


class _FailSecondAsyncSave(Callback):
    """After save A is committed, lets rank 1 write no file larger than half its shard of
    A (the kernel's ``RLIMIT_FSIZE``: save B's background write fails with ``EFBIG``),
    and records ``last.ckpt``'s bytes. Before step 5 it waits until save B's background
    thread has ended on this rank, so the strategy's next poll sees the outcome."""

    def __init__(self, last: Path) -> None:
        self.last = last
        self.committed: dict[str, bytes] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        checkpoint_io = trainer.strategy.checkpoint_io
        assert isinstance(checkpoint_io, MegatronFSDPCheckpointIO)
        if trainer.global_step == 3:
            checkpoint_io.wait()  # save A, committed without error
            self.committed = {p.name: p.read_bytes() for p in self.last.iterdir()}
            if trainer.global_rank == 1:
                limit = len(self.committed["__1_0.distcp"]) // 2
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        elif trainer.global_step == 4:
            in_flight = checkpoint_io._in_flight  # save B's future (only observed here)
            assert in_flight is not None, "save B is not in flight"
            concurrent.futures.wait([in_flight], timeout=PG_TIMEOUT.total_seconds())


def _fit_with_failing_async_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    last = Path(root) / "ckpt" / "last.ckpt"
    watcher = _FailSecondAsyncSave(last)
    trainer = make_trainer(
        2,
        MegatronFSDPStrategy(
            auto_wrap_policy={PackedBlock},
            timeout=PG_TIMEOUT,
            checkpoint_io=MegatronFSDPCheckpointIO(async_save=True),
        ),
        max_steps=ASYNC_STEPS,
        callbacks=[
            ModelCheckpoint(
                dirpath=last.parent, save_last=True, save_top_k=0, every_n_train_steps=2
            ),
            watcher,
        ],
        num_sanity_val_steps=0,
    )
    try:
        trainer.fit(_LM(str(Path(root) / "facts")), _data())
    except CheckpointSaveError as err:
        frames = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(err.__traceback__)]
        return {
            "error": str(err),
            "global_step": trainer.global_step,
            "frames": frames,
            "committed": watcher.committed,
        }
    return {"error": None, "global_step": trainer.global_step}


def test_a_failed_async_save_raises_at_the_next_training_step(tmp_path: Path) -> None:
    """A background write that fails for real (the kernel refuses the file's size) raises
    ``CheckpointSaveError`` out of ``fit`` on every rank at the first training step after
    the save ended, from the strategy's per-step poll, not at the next save or teardown;
    ``last.ckpt`` stays the previous save's, byte for byte."""
    results = run_distributed(
        _fit_with_failing_async_save, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    last = tmp_path / "ckpt" / "last.ckpt"
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, result)
        assert f"{last}" in result["error"] and "rank 1" in result["error"], result["error"]
        assert "File too large" in result["error"], result["error"]
        # Raised before step 5 ran (save B followed step 4), by the strategy's poll.
        assert result["global_step"] == 4, result
        assert ("strategy.py", "on_train_batch_start") in result["frames"], result["frames"]
        assert not any(name == "save_checkpoint" for _, name in result["frames"]), result
        # last.ckpt is save A's, every file byte-identical; no hidden directory left.
        assert {p.name: p.read_bytes() for p in last.iterdir()} == result["committed"]
    assert read_manifest(last).global_step == 2
    assert verify_checkpoint(last) == []
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
