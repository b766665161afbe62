"""The model stays usable after ``fit``, as with Lightning's other strategies.

Lightning's contract: the process group lives until the process ends, ``on_fit_end`` runs
after ``teardown``, and users call their model and its submodules anywhere: hooks,
callbacks, after ``fit``, between stages. Each test runs real ranks (2 and 3) in a gloo
group that the strategy creates, with the real ``Trainer``.

The LightningModule here owns no parameter; its ``self.model`` (a tied, packed LM whose
blocks are policy units) is the top-level unit, so ``self.model(x)`` works on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.megatron._megatron import FsdpModule
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock, build_packed_lm, lm_loss, make_batch, make_trainer

PROBE = make_batch(99, batch_size=2, seq_len=4)[0]  # tokens every rank evaluates


class LitLM(pl.LightningModule):
    """A LightningModule around a packed LM, recording forwards from every hook."""

    def __init__(self, seed: int = 0, fail_on_rank: int | None = None) -> None:
        super().__init__()
        self.model = build_packed_lm(seed=seed)
        self.fail_on_rank = fail_on_rank
        self.seen: dict[str, Tensor] = {}

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.fail_on_rank == self.global_rank and batch_idx == 1:
            raise RuntimeError(f"injected failure in training_step on rank {self.global_rank}")
        return lm_loss(self.model, batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.model, batch), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", lm_loss(self, batch), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def _probe(self, name: str) -> None:
        with torch.no_grad():
            self.seen[name] = self.model(PROBE).clone()  # a submodule, called from a hook

    def on_train_start(self) -> None:
        self._probe("on_train_start")

    def on_train_end(self) -> None:
        self._probe("on_train_end")

    def on_fit_end(self) -> None:  # Lightning calls this after strategy.teardown()
        self._probe("on_fit_end")


class ProbeCallback(Callback):
    """A callback that calls the LightningModule's forward, as sampling callbacks do."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            pl_module.seen["callback"] = pl_module(PROBE).clone()  # type: ignore[operator]


def _data(world_size: int, steps: int) -> DataLoader:
    tokens, targets = make_batch(7, batch_size=2 * world_size * steps, seq_len=4)
    return DataLoader(TensorDataset(tokens, targets), batch_size=2)


def _trainer(world_size: int, root: Path | None = None, **kwargs: Any) -> pl.Trainer:
    options = {"max_steps": 3, "limit_val_batches": 1, "default_root_dir": root}
    return make_trainer(world_size, **{**options, **kwargs})


def _use_after_fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model = LitLM(seed=0)
    data = _data(world_size, steps=3)
    trainer = _trainer(world_size, Path(root), callbacks=[ProbeCallback()])
    trainer.fit(model, data, data)
    facts: dict[str, Any] = {"seen": dict(model.seen)}
    with torch.no_grad():
        facts["after_fit"] = model(PROBE).clone()
        facts["submodule_after_fit"] = model.model(PROBE).clone()
    # torch.distributed is still usable: the group lives until the process ends.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    facts["all_reduce"] = total.item()
    facts["units"] = sorted(n for n, m in model.named_modules() if isinstance(m, FsdpModule))
    # Every stage after fit, then the model again.
    facts["validate"] = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    facts["test"] = trainer.test(model, data, verbose=False)[0]["test_loss"]
    facts["predict"] = [p.clone() for p in trainer.predict(model, data)]
    with torch.no_grad():
        facts["after_stages"] = model(PROBE).clone()
    # A save after fit is a collective of all ranks over the same live group.
    path = Path(root, "after_fit.ckpt")
    trainer.save_checkpoint(path)
    # A second fit in the same process: a fresh model (other initial weights) resumes it.
    resumed = LitLM(seed=1)
    second = _trainer(world_size, Path(root), max_steps=5)
    second.fit(resumed, data, ckpt_path=str(path))
    facts["resumed_start"] = resumed.seen["on_train_start"]
    facts["resumed_global_step"] = second.global_step
    with torch.no_grad():
        facts["resumed_after_fit"] = resumed(PROBE).clone()
    # README, Limitations: a sharded model keeps its mesh; a later Trainer asking for
    # another one is refused on every rank (before any collective), and the model still works.
    strategy = MegatronFSDPStrategy(
        auto_wrap_policy={PackedBlock}, device_mesh=(1, world_size), timeout=PROCESS_GROUP_TIMEOUT
    )
    try:
        _trainer(world_size, Path(root), strategy=strategy).validate(resumed, data, verbose=False)
        facts["other_mesh"] = "no error"
    except ValueError as err:
        facts["other_mesh"] = str(err)
    with torch.no_grad():
        facts["after_refusal"] = resumed(PROBE).clone()
    return facts


@pytest.mark.both_versions
@pytest.mark.parametrize("world_size", [2, 3])
def test_model_usable_in_hooks_and_after_fit(world_size: int, tmp_path: Path) -> None:
    """on_fit_end, callbacks, after fit, between stages, a second fit: all on one group."""
    results = run_distributed(
        _use_after_fit, world_size, str(tmp_path), init_process_group=False, timeout=240
    )
    for rank, facts in enumerate(results):
        seen = facts["seen"]
        end = seen["on_train_end"]
        assert end.shape == (2, 4, 11)
        # Nothing changes the weights after training ends: every later forward is the same.
        for name in ("on_fit_end",):
            torch.testing.assert_close(seen[name], end, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(facts["after_fit"], end, rtol=0, atol=0)
        torch.testing.assert_close(facts["submodule_after_fit"], end, rtol=0, atol=0)
        torch.testing.assert_close(facts["after_stages"], end, rtol=0, atol=0)
        assert "callback" in seen  # the callback ran its forward during validation
        assert not torch.equal(seen["on_train_start"], end)  # training changed the model
        assert facts["all_reduce"] == sum(range(1, world_size + 1)), rank
        assert facts["units"] == ["model", "model.blocks.0", "model.blocks.1"]
        assert facts["validate"] == results[0]["validate"]
        assert len(facts["predict"]) == 3
        # The fresh model starts its fit from the saved weights, then trains on.
        torch.testing.assert_close(facts["resumed_start"], end, rtol=0, atol=0)
        assert facts["resumed_global_step"] == 5
        assert not torch.equal(facts["resumed_after_fit"], end)
        assert facts["other_mesh"].startswith(
            f"MegatronFSDPStrategy: the model is already sharded on a mesh of shape "
            f"({world_size},), but this strategy asks for (1, {world_size})."
        ), facts["other_mesh"]
        torch.testing.assert_close(
            facts["after_refusal"], facts["resumed_after_fit"], rtol=0, atol=0
        )


def _fit_failing_on_one_rank(rank: int, world_size: int) -> str:
    model = LitLM(seed=0, fail_on_rank=world_size - 1)
    trainer = _trainer(world_size, None)
    try:
        trainer.fit(model, _data(world_size, steps=3))
    except Exception as err:  # every rank must get here, none may hang
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_failure_on_one_rank_gives_every_rank_an_error(world_size: int) -> None:
    """A rank that raises mid-fit: it reports its error, and its peers fail promptly too."""
    results = run_distributed(
        _fit_failing_on_one_rank, world_size, init_process_group=False, timeout=150
    )
    failing = world_size - 1
    assert "injected failure in training_step" in results[failing]
    for rank, message in enumerate(results):
        if rank == failing:
            continue
        assert message != "no error", rank
        assert "MegatronFSDPStrategy" in message and "another rank" in message, message
