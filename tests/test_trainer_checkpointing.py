"""Trainer end to end: ``ModelCheckpoint`` + ``fit(ckpt_path=...)`` continue a run bit for bit.

Every test runs real ranks (``tests.harness``) with the real ``lightning.pytorch.Trainer``,
``MegatronFSDPStrategy`` and its default ``MegatronFSDPCheckpointIO``, writing real DCP
directories. The model is ``tests.models.PackedLM`` (a tied embedding/head, blocks whose
packing defeats canonical ``Shard(0)``), trained with AdamW, a per-step ``StepLR`` and
gradient accumulation over 2 micro-batches; one epoch is 2 optimizer steps.

Continuation: run A (one set of processes) trains 8 steps uninterrupted, then trains a
fresh model 4 steps while ``ModelCheckpoint(every_n_train_steps=2)`` saves; run B (new
processes, so a new process group and optimizers that never stepped) resumes from the
step-4 checkpoint to step 8. Step 4 ends an epoch, so ``DistributedSampler`` deals the
resumed run the batches the uninterrupted run saw, and bit-exact is the bar: every
micro-batch loss and logged loss of steps 5-8, the final weights, the optimizer state and
the LR scheduler. Both runs use the same world size, so each rank's shards and optimizer
state compare rank-locally. At 2 ranks run B resumes with ``ckpt_path="last"`` after the
test put the directory into the state a crash between the two renames of a ``last.ckpt``
overwrite leaves (no ``last.ckpt``, its previous version renamed aside), next to a newer,
damaged ``last-v1.ckpt`` that Lightning's own modification-time lookup would pick; at 3
ranks it resumes from the checkpoint directory by path.

The same two runs also check: ``trainer.save_checkpoint`` by hand after ``fit`` (one
checkpoint at rank 0's path, though teardown had destroyed the process group);
``save_top_k=2`` on a monitored metric (exactly 2 directories plus ``last``), and that
``validate``/``test``/``predict(ckpt_path=...)`` load each checkpoint's weights and nothing
else. Separate tests cover two optimizers under manual optimization, and the bytes each
rank writes (its own shards, never a gathered tensor).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.storage.format import MANIFEST_FILE, META_FILE, read_manifest
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import VOCAB, PackedBlock, adamw_step_lr, build_packed_lm, lm_loss
from tests.test_strategy import Block, TwoOptimizers, _regression_data

TIMEOUT = 120.0
MICRO_BATCH = 2  # per rank
ACCUMULATE = 2
STEPS_PER_EPOCH = 2
TOTAL_STEPS = 8
SAVED_STEP = 4  # the end of epoch 2 (epochs 0 and 1)
SAVED_NAME = f"epoch=1-step={SAVED_STEP}.ckpt"
ASIDE_TOKEN = "5eed" * 8  # hex, as a real commit's token

Weights = dict[str, np.ndarray]


# ---------------------------------------------------------------------- model and probes


class CheckpointedLM(pl.LightningModule):
    """``PackedLM`` with AdamW and a per-step ``StepLR``; records every micro-batch loss."""

    def __init__(self, lr: float = 0.05, num_blocks: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lm = build_packed_lm(0, num_blocks=num_blocks)
        self.losses: list[float] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = lm_loss(self.lm, (batch[0], batch[1]))
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")))
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.lm, (batch[0], batch[1])), sync_dist=True)

    def test_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self.log("test_loss", lm_loss(self.lm, (batch[0], batch[1])), sync_dist=True)

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.lm(batch[0]).float()

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_step_lr(self.parameters(), self.hparams.lr)


class BatchCounter(Callback):
    """A stateful callback: counts training micro-batches, saved and restored with the run."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


class Probe(Callback):
    """What each stage starts from, i.e. the state right after a checkpoint restore."""

    def __init__(self) -> None:
        self.train_start: dict[str, Any] = {}
        self.eval_weights: list[Weights] = []
        self.epoch_end_weights: dict[int, Weights] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_start = snapshot(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_end_weights[trainer.global_step] = weights(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.eval_weights.append(weights(pl_module))

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.eval_weights.append(weights(pl_module))

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.eval_weights.append(weights(pl_module))


class MemoryLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call, on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Not recorded."""

    def losses(self) -> list[tuple[int, float]]:
        """``(step, train_loss_step)`` of every optimizer step that logged one."""
        return [(step, m["train_loss_step"]) for step, m in self.logged if "train_loss_step" in m]


def weights(model: nn.Module) -> Weights:
    """This rank's local shard of every parameter (fp32 main weights), by FQN."""
    return {
        name: parameter._local_tensor.detach().float().cpu().numpy().copy()
        for name, parameter in model.named_parameters()
        if isinstance(parameter, DTensor)
    }


def optimizer_state(trainer: pl.Trainer, model: nn.Module) -> dict[str, Any]:
    """Every optimizer's rank-local state by ``"<index>/<param fqn>/<name>"``, and its lrs."""
    names = {id(p): n for n, p in model.named_parameters()}
    state: dict[str, Any] = {}
    for index, optimizer in enumerate(trainer.optimizers):
        state[f"{index}/lr"] = [float(group["lr"]) for group in optimizer.param_groups]
        for parameter, entries in optimizer.state.items():
            for key, value in entries.items():
                local = getattr(value, "_local_tensor", value)
                if isinstance(local, Tensor):
                    local = local.detach().float().cpu().numpy().copy()
                state[f"{index}/{names[id(parameter)]}/{key}"] = local
    return state


def snapshot(trainer: pl.Trainer, model: nn.Module) -> dict[str, Any]:
    """Training position, weights, optimizer, schedulers and callback state of this rank."""
    counters = [c for c in trainer.callbacks if isinstance(c, BatchCounter)]  # type: ignore[attr-defined]
    return {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "weights": weights(model),
        "optimizer": optimizer_state(trainer, model),
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "counter": counters[0].state_dict() if counters else None,
    }


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Bit-exact equality of nested dicts/lists of arrays and plain values."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), where
        np.testing.assert_array_equal(actual, expected, err_msg=where, strict=True)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------- trainer and data


def token_loader(world_size: int, epochs_of_data: int = 1) -> DataLoader:
    """One epoch = STEPS_PER_EPOCH optimizer steps of ACCUMULATE micro-batches per rank."""
    rows = world_size * MICRO_BATCH * ACCUMULATE * STEPS_PER_EPOCH * epochs_of_data
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (rows, 5), generator=generator)
    targets = torch.randint(0, VOCAB, (rows, 5), generator=generator)
    return DataLoader(TensorDataset(tokens, targets), batch_size=MICRO_BATCH, shuffle=True)


def make_trainer(
    world_size: int,
    precision: str = "32-true",
    strategy: MegatronFSDPStrategy | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world_size,
        "strategy": strategy
        or MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT),
        "precision": precision,
        "accumulate_grad_batches": ACCUMULATE,
        "log_every_n_steps": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def every_two_steps(root: Path) -> ModelCheckpoint:
    """The checkpoint callback of the interrupted run and of its resumption (same state key)."""
    return ModelCheckpoint(
        dirpath=root / "run", every_n_train_steps=2, save_top_k=-1, save_last=True
    )


def local_bytes(strategy: Any) -> dict[str, int]:
    """Bytes of this rank's DTensor shards, and of plain tensors, in what the strategy saves."""
    seen: set[int] = set()
    sizes = {"sharded": 0, "plain": 0}

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, Tensor) and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, DTensor):
                sizes["sharded"] += value._local_tensor.nbytes
            else:
                sizes["plain"] += value.nbytes

    visit(strategy.lightning_module_state_dict())
    visit([strategy.optimizer_state(o) for o in strategy.optimizers])
    return sizes


# ---------------------------------------------------------------------- continuation


def _train_and_save(rank: int, world_size: int, root: str, precision: str) -> dict[str, Any]:
    """Run A: 8 uninterrupted steps, then 4 steps saved by ``ModelCheckpoint``."""
    root_path = Path(root)
    result: dict[str, Any] = {}

    pl.seed_everything(0, verbose=False)
    model, logger, probe = CheckpointedLM(), MemoryLogger(), Probe()
    top_k = ModelCheckpoint(
        dirpath=root_path / "topk",
        monitor="train_loss_epoch",
        mode="min",
        save_top_k=2,
        save_last=True,
        every_n_epochs=1,
    )
    trainer = make_trainer(
        world_size,
        precision,
        max_steps=TOTAL_STEPS,
        callbacks=[BatchCounter(), probe, top_k],
        logger=logger,
    )
    trainer.fit(model, token_loader(world_size))
    result["reference"] = {
        **snapshot(trainer, model),
        "losses": model.losses,
        "logged": logger.losses(),
    }
    result["epoch_end_weights"] = probe.epoch_end_weights
    result["top_k"] = sorted(Path(p).name for p in top_k.best_k_models)

    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    trainer = make_trainer(
        world_size,
        precision,
        max_steps=SAVED_STEP,
        callbacks=[BatchCounter(), every_two_steps(root_path)],
        logger=MemoryLogger(),
    )
    trainer.fit(model, token_loader(world_size))
    result["saved"] = snapshot(trainer, model)
    # By hand after fit (the group lives on): one checkpoint, at rank 0's path.
    trainer.save_checkpoint(root_path / f"manual-rank{rank}.ckpt")
    result["group_alive_after_save"] = dist.is_initialized()
    return result


def _resume(
    rank: int, world_size: int, root: str, precision: str, ckpt_path: str, evaluate: bool
) -> dict[str, Any]:
    """Run B, in fresh processes: resume to step 8; then load weights for evaluation."""
    root_path = Path(root)
    pl.seed_everything(0, verbose=False)
    model, logger, probe = CheckpointedLM(), MemoryLogger(), Probe()
    trainer = make_trainer(
        world_size,
        precision,
        max_steps=TOTAL_STEPS,
        callbacks=[BatchCounter(), probe, every_two_steps(root_path)],
        logger=logger,
    )
    trainer.fit(model, token_loader(world_size), ckpt_path=ckpt_path)
    result: dict[str, Any] = {
        "start": probe.train_start,
        "final": snapshot(trainer, model),
        "losses": model.losses,
        "logged": logger.losses(),
        "ckpt_path": trainer.ckpt_path,
        "group_alive_after_fit": dist.is_initialized(),
    }
    if evaluate:
        # validate/test/predict load weights only, from any complete checkpoint.
        loads = [
            ("validate", root_path / "manual-rank0.ckpt"),
            *[("validate", root_path / "topk" / name) for name in _top_k_names(root_path)],
            ("test", root_path / "run" / SAVED_NAME),
            ("predict", root_path / "run" / SAVED_NAME),
        ]
        loader = token_loader(world_size)
        for stage, path in loads:
            getattr(trainer, stage)(model, loader, ckpt_path=str(path))
        result["eval_loads"] = [(stage, path.name) for stage, path in loads]
        result["eval_weights"] = probe.eval_weights
        result["optimizer_after_eval"] = optimizer_state(trainer, model)
        result["group_alive_after_eval"] = dist.is_initialized()
    return result


def _top_k_names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "topk").iterdir())


def _simulate_crash_of_last_overwrite(run_dir: Path) -> None:
    """Leave ``run_dir`` as a crash between the two renames of a ``last.ckpt`` overwrite
    does, plus a newer damaged ``last-v1.ckpt`` and an interrupted save's temp directory."""
    (run_dir / "last.ckpt").rename(run_dir / f".last.ckpt.old-{ASIDE_TOKEN}")
    damaged = run_dir / "last-v1.ckpt"
    shutil.copytree(run_dir / "epoch=0-step=2.ckpt", damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size - 1)
    future = time.time() + 60
    os.utime(damaged, (future, future))  # Lightning's "last" lookup picks the newest mtime
    stale = run_dir / f".last.ckpt.tmp-{'ab' * 16}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half written")


@pytest.mark.parametrize(
    ("world_size", "precision"),
    [
        (2, "32-true"),
        pytest.param(2, "bf16-true", marks=pytest.mark.both_versions),
        (3, "32-true"),
        (3, "bf16-true"),
    ],
)
def test_resume_continues_bit_exactly(tmp_path: Path, world_size: int, precision: str) -> None:
    """Fit 8 steps == fit 4 (saved by ModelCheckpoint) + resume to 8 in new processes."""
    saved_runs = run_distributed(
        _train_and_save,
        world_size,
        str(tmp_path),
        precision,
        init_process_group=False,
        timeout=TIMEOUT,
    )
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "epoch=0-step=2.ckpt",
        SAVED_NAME,
        "last.ckpt",
    ]
    # trainer.save_checkpoint after fit: rank 0's path, all ranks' shards, group still alive.
    manual = read_manifest(tmp_path / "manual-rank0.ckpt")
    assert (manual.world_size, manual.global_step) == (world_size, SAVED_STEP)
    assert not any((tmp_path / f"manual-rank{r}.ckpt").exists() for r in range(1, world_size))
    assert all(run["group_alive_after_save"] for run in saved_runs)
    # save_top_k=2 on a monitored metric left exactly 2 checkpoints, plus last.
    top_k = saved_runs[0]["top_k"]
    assert len(top_k) == 2
    assert _top_k_names(tmp_path) == sorted([*top_k, "last.ckpt"])

    if world_size == 2:
        _simulate_crash_of_last_overwrite(run_dir)
        ckpt_path = "last"
    else:
        ckpt_path = str(run_dir / SAVED_NAME)
    resumed_runs = run_distributed(
        _resume,
        world_size,
        str(tmp_path),
        precision,
        ckpt_path,
        precision == "32-true",
        init_process_group=False,
        timeout=TIMEOUT,
    )

    for saved_run, resumed in zip(saved_runs, resumed_runs, strict=True):
        reference, saved, start = saved_run["reference"], saved_run["saved"], resumed["start"]
        # Restored: position, weights, optimizer state, schedulers, callback state.
        assert (start["epoch"], start["global_step"]) == (2, SAVED_STEP)
        assert (saved["epoch"], saved["global_step"]) == (2, SAVED_STEP)
        assert start["counter"] == saved["counter"] == {"batches": SAVED_STEP * ACCUMULATE}
        assert start["schedulers"][0]["last_epoch"] == SAVED_STEP
        assert_same(start, saved, "restored")
        # Continued: steps 5-8 and the end state equal the uninterrupted run's, bit for bit.
        assert len(resumed["losses"]) == (TOTAL_STEPS - SAVED_STEP) * ACCUMULATE
        assert resumed["losses"] == reference["losses"][SAVED_STEP * ACCUMULATE :]
        assert len(resumed["logged"]) == TOTAL_STEPS - SAVED_STEP
        assert resumed["logged"] == reference["logged"][SAVED_STEP:]
        assert_same(resumed["final"], {k: v for k, v in reference.items() if k in saved}, "end")
        assert resumed["final"]["global_step"] == TOTAL_STEPS
        # Not vacuous: training moved the weights between step 4 and step 8.
        assert any(
            not np.array_equal(saved["weights"][n], reference["weights"][n])
            for n in saved["weights"]
        )
        assert resumed["group_alive_after_fit"] is True

    if world_size == 2:  # "last" was the recovered last.ckpt, not the damaged newer last-v1
        assert resumed_runs[0]["ckpt_path"] == str(run_dir / "last.ckpt")
        assert not list(run_dir.glob(".last.ckpt.*"))  # recovered; the stale temp dir removed
    else:
        assert resumed_runs[0]["ckpt_path"] == str(run_dir / SAVED_NAME)
    assert read_manifest(run_dir / "last.ckpt").global_step == TOTAL_STEPS

    if precision == "32-true":
        _check_weights_only_loads(tmp_path, saved_runs, resumed_runs)


def _check_weights_only_loads(
    root: Path, saved_runs: list[dict[str, Any]], resumed_runs: list[dict[str, Any]]
) -> None:
    """validate/test/predict(ckpt_path=...) restored each checkpoint's weights, nothing else."""
    for saved_run, resumed in zip(saved_runs, resumed_runs, strict=True):
        by_step = saved_run["epoch_end_weights"]
        expected = []
        for _, name in resumed["eval_loads"]:
            if name in ("manual-rank0.ckpt", SAVED_NAME):
                expected.append(saved_run["saved"]["weights"])
            else:
                step = read_manifest(root / "topk" / name).global_step
                assert step in by_step, (name, step)
                expected.append(by_step[step])
        assert_same(resumed["eval_weights"], expected, "evaluation loads")
        # The optimizers kept the fit's final state: evaluation loads weights only.
        assert_same(resumed["optimizer_after_eval"], resumed["final"]["optimizer"], "optim")
        assert resumed["group_alive_after_eval"] is True


def _tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors_in(item)]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors_in(item)]
    return []


# ---------------------------------------------------------------------- no gathered tensor


class WideNet(pl.LightningModule):
    """Two auto-wrapped ``Block`` units large enough that tensor bytes dwarf file framing."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block(96, 320)
        self.b2 = Block(320, 96)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.b2(self.b1(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _save_wide(rank: int, world_size: int, root: str) -> dict[str, int]:
    pl.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4 * world_size, 96, generator=generator),
        torch.randn(4 * world_size, 96, generator=generator),
    )
    trainer = make_trainer(
        world_size,
        strategy=MegatronFSDPStrategy(auto_wrap_policy={Block}, timeout=PROCESS_GROUP_TIMEOUT),
        accumulate_grad_batches=1,
        max_steps=1,
        callbacks=[ModelCheckpoint(dirpath=root, filename="wide", every_n_train_steps=1)],
    )
    trainer.fit(WideNet(), DataLoader(data, batch_size=4))
    return local_bytes(trainer.strategy)


def test_each_rank_writes_only_its_own_shard_bytes(tmp_path: Path) -> None:
    """No gathered tensor: rank r's file holds rank r's shard bytes, the total one copy."""
    world_size = 3
    sizes = run_distributed(
        _save_wide, world_size, str(tmp_path), init_process_group=False, timeout=TIMEOUT
    )
    checkpoint = tmp_path / "wide.ckpt"
    files = {p.name: p.stat().st_size for p in checkpoint.glob("*.distcp")}
    written = [
        sum(size for name, size in files.items() if name.startswith(f"__{rank}_"))
        for rank in range(world_size)
    ]
    sharded = [size["sharded"] for size in sizes]
    full = sum(sharded)  # every element of every parameter and optimizer state, once
    plain = sizes[0]["plain"]  # replicated step counters: DCP writes each once, on some rank
    framing = 64 * 1024  # torch.save framing per item (~1.5 KB) and rank 0's param_groups
    assert full > 8 * framing  # big enough for the bounds below to discriminate
    for rank in range(world_size):
        assert sharded[rank] <= written[rank] <= sharded[rank] + plain + framing, (rank, files)
    total_bound = full + plain + world_size * framing
    assert full <= sum(written) <= total_bound < world_size * full, (written, full)
    # meta.pt is the non-tensor rest of Lightning's dict: no state tensor hides in it (the
    # per-rank random-generator states, a few KB each, are the one set of tensors it holds).
    from lightning_megatron_fsdp.common.exact_resume import RNG_STATES_KEY

    meta = torch.load(checkpoint / META_FILE, weights_only=False)
    assert RNG_STATES_KEY in meta
    tensors = _tensors_in({k: v for k, v in meta.items() if k != RNG_STATES_KEY})
    assert all(t.numel() <= 1 for t in tensors), [tuple(t.shape) for t in tensors]
    assert (checkpoint / MANIFEST_FILE).is_file()


# ---------------------------------------------------------------------- two optimizers


def _two_optimizer_trainer(world_size: int, root: Path, max_steps: int) -> pl.Trainer:
    # Manual optimization: each training step steps both optimizers (2 global steps).
    return make_trainer(
        world_size,
        strategy=MegatronFSDPStrategy(auto_wrap_policy={Block}, timeout=PROCESS_GROUP_TIMEOUT),
        accumulate_grad_batches=1,
        max_steps=max_steps,
        callbacks=[Probe(), ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_last=True)],
    )


def _two_optimizers_loader(world_size: int) -> DataLoader:
    x, y = _regression_data(world_size * MICRO_BATCH * 2, seed=10)  # 2 training steps an epoch
    return DataLoader(TensorDataset(x, y), batch_size=MICRO_BATCH, shuffle=True)


def _two_optimizers_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    result = {}
    for name, steps in (("reference", 8), ("saved", 4)):
        pl.seed_everything(0, verbose=False)
        model = TwoOptimizers()
        trainer = _two_optimizer_trainer(world_size, Path(root) / name, steps)
        trainer.fit(model, _two_optimizers_loader(world_size))
        result[name] = {**snapshot(trainer, model), "losses": model.step_losses}
    return result


def _two_optimizers_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = TwoOptimizers()
    trainer = _two_optimizer_trainer(world_size, Path(root) / "saved", 8)
    trainer.fit(model, _two_optimizers_loader(world_size), ckpt_path="last")
    (probe,) = [c for c in trainer.callbacks if isinstance(c, Probe)]  # type: ignore[attr-defined]
    return {
        "start": probe.train_start,
        "final": snapshot(trainer, model),
        "losses": model.step_losses,
    }


def test_two_optimizers_round_trip_by_fqn(tmp_path: Path) -> None:
    """Manual optimization with SGD(momentum) and Adam: both restore by FQN and continue."""
    world_size = 2
    saved_runs = run_distributed(
        _two_optimizers_save, world_size, str(tmp_path), init_process_group=False, timeout=TIMEOUT
    )
    manifest = read_manifest(tmp_path / "saved" / "last.ckpt")
    assert manifest.global_step == 4
    sgd, adam = (sorted(fingerprint) for fingerprint in manifest.optimizer_fingerprints)
    assert sgd == ["encoder.lin.bias/momentum_buffer", "encoder.lin.weight/momentum_buffer"]
    assert adam == [
        f"decoder.lin.{p}/{s}"
        for p in ("bias", "weight")
        for s in ("exp_avg", "exp_avg_sq", "step")
    ]
    resumed_runs = run_distributed(
        _two_optimizers_resume,
        world_size,
        str(tmp_path),
        init_process_group=False,
        timeout=TIMEOUT,
    )
    for saved_run, resumed in zip(saved_runs, resumed_runs, strict=True):
        saved, reference = saved_run["saved"], saved_run["reference"]
        assert_same(resumed["start"], {k: saved[k] for k in resumed["start"]}, "restored")
        assert {k.split("/")[0] for k in saved["optimizer"]} == {"0", "1"}
        assert len(resumed["start"]["schedulers"]) == 2
        assert resumed["losses"] == reference["losses"][2:]  # training steps 3 and 4
        assert_same(resumed["final"], {k: reference[k] for k in resumed["final"]}, "end")


def _async_stages(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Async saves in two Trainer stages (each stage's teardown drops the background gloo
    group, the next creates its own), then ``trainer.save_checkpoint`` after ``fit`` (no
    stage will wait for its background write, so it must be committed when it returns)."""
    from lightning_megatron_fsdp import MegatronFSDPCheckpointIO

    def strategy() -> MegatronFSDPStrategy:
        return MegatronFSDPStrategy(
            auto_wrap_policy={PackedBlock},
            timeout=PROCESS_GROUP_TIMEOUT,
            checkpoint_io=MegatronFSDPCheckpointIO(async_save=True),
        )

    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    first = make_trainer(
        world_size, strategy=strategy(), max_steps=2, callbacks=[every_two_steps(Path(root))]
    )
    first.fit(model, token_loader(world_size, epochs_of_data=4))
    second = make_trainer(
        world_size, strategy=strategy(), max_steps=4, callbacks=[every_two_steps(Path(root))]
    )
    second.fit(model, token_loader(world_size, epochs_of_data=4), ckpt_path="last")
    second.save_checkpoint(Path(root) / "after-fit.ckpt")
    return {"weights": weights(model), "global_step": second.global_step}


@pytest.mark.both_versions
def test_async_saves_across_stages_and_after_fit(tmp_path: Path) -> None:
    from lightning_megatron_fsdp import verify_checkpoint

    results = run_distributed(_async_stages, 2, str(tmp_path), init_process_group=False)
    assert [r["global_step"] for r in results] == [4, 4]
    for path in (tmp_path / "run" / "last.ckpt", tmp_path / "after-fit.ckpt"):
        assert verify_checkpoint(path) == [], path
        assert read_manifest(path).global_step == 4, path
    for directory in (tmp_path, tmp_path / "run"):  # no interrupted or leftover saves
        assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]
