"""The Fabric strategy: a hand-written Fabric loop with Megatron-FSDP, checkpoints included.

Real ranks (``tests.harness``, torchrun-style environment, Fabric joins the group), the
real ``Fabric`` and ``lightning_megatron_fsdp.fabric.MegatronFSDPStrategy``, real DCP
checkpoints. The model is ``tests.models.PackedLM`` (packed shards that defeat canonical
``Shard(0)``, a tied embedding/head, nested units), here with dropout on its embedding.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_megatron_fsdp
from lightning_megatron_fsdp import MegatronFSDPStrategy as TrainerStrategy
from lightning_megatron_fsdp import full_tensor
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy
from lightning_megatron_fsdp.megatron import _megatron
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock, PackedLM, build_packed_lm, make_batch
from tests.object_store import SeaweedServer

LR = 0.05
STEPS = 4


class DropLM(PackedLM):
    """:class:`PackedLM` with dropout after the embedding (``p=0`` by default)."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.drop(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(p: float = 0.0, seed: int = 0) -> DropLM:
    model = DropLM(p)
    model.load_state_dict(build_packed_lm(seed).state_dict())
    return model


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _fabric(world_size: int, precision: str = "32-true", **options: Any) -> Fabric:
    options.setdefault("timeout", PROCESS_GROUP_TIMEOUT)
    strategy = MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, **options)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def _full(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter in full, by FQN (ties under each name): a collective."""
    return {
        name: full_tensor(p).detach().float().clone()
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def _rank_batch(step: int, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    return make_batch(step * world_size + rank)


# ---------------------------------------------------------------------- the loop


def _train(
    rank: int,
    world_size: int,
    setup: str,
    accumulate: int,
    clip: float | None,
    mesh: tuple[int, int] | None = None,
    sharding_strategy: str | None = None,
) -> Any:
    fabric = _fabric(world_size, device_mesh=mesh, sharding_strategy=sharding_strategy)
    model = _build()
    if setup == "joint":  # optimizer built before sharding, re-pointed by setup
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    losses, norms, placements = [], [], []
    probe = model.module.blocks[0].fc.weight
    for step in range(STEPS):
        for micro in range(accumulate):
            tokens, targets = _rank_batch(step * accumulate + micro, rank, world_size)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = _loss(model, tokens, targets)
                fabric.backward(loss / accumulate)
            placements.append(str(probe.grad.placements))
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        if clip is not None:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=clip).item())
        optimizer.step()
        optimizer.zero_grad()
    fabric.barrier()
    gathered = fabric.all_gather(torch.tensor([rank]))
    return {
        "losses": losses,
        "norms": norms,
        "placements": placements,
        "full": _full(model.module),
        "gathered": gathered.flatten().tolist(),
        "after": _loss(model, *make_batch(99)).item(),  # usable after the loop
    }


def _reference(world_size: int, accumulate: int, clip: float | None) -> dict[str, Any]:
    model = _build()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            batches = [
                _rank_batch(step * accumulate + micro, r, world_size) for r in range(world_size)
            ]
            loss = _loss(
                model, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            )
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
    full = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "norms": norms, "full": full}


@pytest.mark.both_versions
@pytest.mark.parametrize(
    ("world_size", "setup", "accumulate", "clip", "mesh"),
    [
        (1, "joint", 1, None, None),
        (2, "split", 1, None, None),
        (3, "joint", 2, 0.05, None),
        (2, "joint", 2, 0.05, None),
        (4, "split", 2, 0.05, (2, 2)),
    ],
)
def test_fabric_loop_equals_single_process(
    world_size: int, setup: str, accumulate: int, clip: float | None, mesh: tuple[int, int] | None
) -> None:
    """Losses, clipped norms and final weights equal one process training on the whole batch.

    Under HSDP only the last micro-batch all-reduces across replicas (``no_backward_sync``):
    the gradients of the others are still ``Partial``.
    """
    results = run_distributed(
        _train, world_size, setup, accumulate, clip, mesh, init_process_group=False, timeout=150
    )
    reference = _reference(world_size, accumulate, clip)
    for result in results:
        assert result["gathered"] == list(range(world_size))
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=0, atol=1e-5)
        torch.testing.assert_close(result["norms"], reference["norms"], rtol=1e-5, atol=0)
        assert set(result["full"]) == set(reference["full"])
        for name, value in reference["full"].items():
            torch.testing.assert_close(result["full"][name], value, rtol=0, atol=1e-5)
        if mesh is None:
            assert set(result["placements"]) == {"(Shard(dim=0),)"}
        else:
            partial, final = "(Partial(avg), Shard(dim=0))", "(Replicate(), Shard(dim=0))"
            assert result["placements"] == [partial, final] * STEPS
    if clip is not None:
        assert min(reference["norms"]) > clip  # clipping was active
    assert len({r["after"] for r in results}) == 1


@pytest.mark.both_versions
@pytest.mark.skipif(
    not _megatron.REPLICATED_PARAMETERS,
    reason="ZeRO-1/2 and no-shard need megatron-fsdp 0.7 (CI's second pass runs this)",
)
@pytest.mark.parametrize("mode", ["SHARD_OPTIMIZER", "SHARD_GRAD_OP", "NO_SHARD"])
def test_fabric_loop_in_each_sharding_mode_equals_single_process(mode: str) -> None:
    """``sharding_strategy`` under Fabric: with accumulation and clipping, each mode trains
    like one process on the whole batch. ZeRO-1 and no-shard defer the gradient reduction to
    the last micro-batch (``no_backward_sync``); without marking the others, ZeRO-1 keeps
    only the last micro-batch's gradient."""
    results = run_distributed(
        _train, 2, "split", 2, 0.05, None, mode, init_process_group=False, timeout=150
    )
    reference = _reference(2, 2, 0.05)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=0, atol=1e-5)
        torch.testing.assert_close(result["norms"], reference["norms"], rtol=1e-5, atol=0)
        for name, value in reference["full"].items():
            torch.testing.assert_close(result["full"][name], value, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- checkpoints

SAVE_AT = 3  # mid-epoch: each rank has 6 batches per epoch
TOTAL = 6
DROPOUT = 0.3
PROBE = make_batch(123)[0]


def _data(world_size: int) -> TensorDataset:
    batches = [make_batch(1000 + i) for i in range(6 * world_size)]
    return TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for parameter in (p for g in optimizer.param_groups for p in g["params"]):
        for key, value in sorted(optimizer.state[parameter].items()):
            if isinstance(value, Tensor) and value.dim() > 0:
                state[f"{names[id(parameter)]}.{key}"] = full_tensor(value).float().clone()
    return state


def _checkpointed_run(
    rank: int, world_size: int, path: str, mode: str, dropout: float = DROPOUT
) -> dict[str, Any]:
    """``mode="save"``: train TOTAL steps, saving after SAVE_AT; ``"resume"``: load, go on."""
    fabric = _fabric(world_size)
    with fabric.init_module(empty_init=False):
        model = _build(dropout, seed=0 if mode == "save" else 7)
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(StatefulDataLoader(_data(world_size), batch_size=2))
    torch.manual_seed(100 + rank if mode == "save" else 555)  # per-rank streams
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0, "loader": loader}
    result: dict[str, Any] = {"losses": {}}
    if mode == "resume":
        result["remainder"] = fabric.load(path, state)
        result["loaded"] = _full(model.module)
        result["loaded_optimizer"] = _optimizer_state(model.module, optimizer.optimizer)
    iterator = iter(loader)
    for step in range(state["step"], TOTAL):
        tokens, targets = next(iterator)
        loss = _loss(model, tokens, targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        result["losses"][step] = loss.item()
        if mode == "save" and step + 1 == SAVE_AT:
            state["step"] = step + 1
            fabric.save(path, {**state, "note": "not requested"})
            result["saved"] = _full(model.module)
            result["saved_optimizer"] = _optimizer_state(model.module, optimizer.optimizer)
    model.eval()
    result["logits"] = model(PROBE).detach()
    result["final"] = _full(model.module)
    return result


@pytest.mark.both_versions
@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_is_bit_exact_with_dropout_mid_epoch(tmp_path: Path, world_size: int) -> None:
    """Weights, optimizer state, loader position and each rank's dropout masks resume exactly."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(
        _checkpointed_run, world_size, path, "save", init_process_group=False, timeout=150
    )
    resumed = run_distributed(
        _checkpointed_run, world_size, path, "resume", init_process_group=False, timeout=150
    )
    for before, after in zip(saved, resumed, strict=True):
        assert after["remainder"] == {"note": "not requested"}
        for name, value in before["saved"].items():
            torch.testing.assert_close(after["loaded"][name], value, rtol=0, atol=0)
        for name, value in before["saved_optimizer"].items():
            torch.testing.assert_close(after["loaded_optimizer"][name], value, rtol=0, atol=0)
        assert sorted(after["losses"]) == list(range(SAVE_AT, TOTAL))
        for step, loss in after["losses"].items():
            assert loss == before["losses"][step], step
        torch.testing.assert_close(after["logits"], before["logits"], rtol=0, atol=0)
        for name, value in before["final"].items():
            torch.testing.assert_close(after["final"][name], value, rtol=0, atol=0)


def _load_only(rank: int, world_size: int, path: str) -> dict[str, Any]:
    fabric = _fabric(world_size)
    model = _build(seed=7)
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=LR))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remainder = fabric.load(path, state, strict=False)
    return {
        "warnings": [str(w.message) for w in caught if "random streams" in str(w.message)],
        "step": state["step"],
        "remainder": remainder,
        "loaded": _full(model.module),
        "loaded_optimizer": _optimizer_state(model.module, optimizer.optimizer),
    }


@pytest.mark.both_versions
@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 1), (3, 2)])
def test_reshard_on_load(tmp_path: Path, saved_by: int, loaded_by: int) -> None:
    """A checkpoint of N ranks loads at M ranks: weights and optimizer state bit-exact."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(
        _checkpointed_run, saved_by, path, "save", init_process_group=False, timeout=150
    )[0]
    results = run_distributed(_load_only, loaded_by, path, init_process_group=False)
    (warning,) = results[0]["warnings"]  # rank 0 says once which streams were not restored
    assert f"saved by {saved_by} ranks and this run has {loaded_by}" in warning
    for result in results:
        assert result["step"] == SAVE_AT
        assert set(result["remainder"]) == {"loader", "note"}  # not requested: returned
        assert set(result["loaded"]) == set(saved["saved"])
        for name, value in saved["saved"].items():
            torch.testing.assert_close(result["loaded"][name], value, rtol=0, atol=0)
        assert set(result["loaded_optimizer"]) == set(saved["saved_optimizer"])
        for name, value in saved["saved_optimizer"].items():
            torch.testing.assert_close(result["loaded_optimizer"][name], value, rtol=0, atol=0)


# ---------------------------------------------------------------------- Trainer <-> Fabric


class LitLM(pl.LightningModule):
    """The same model for both: ``self.model`` (FQNs ``model.*``), Adam, one loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model = _build(seed=seed)
        self.seen: dict[str, Any] = {}

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return _loss(self, *batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)

    def on_train_start(self) -> None:  # what the resume loaded, before any step
        self.seen["loaded"] = _full(self)
        optimizer = self.optimizers().optimizer
        self.seen["loaded_optimizer"] = _optimizer_state(self, optimizer)


def _fabric_saves(rank: int, world_size: int, path: str) -> dict[str, Any]:
    fabric = _fabric(world_size)
    module = LitLM()
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=LR))
    for step in range(2):
        fabric.backward(_loss(model, *_rank_batch(step, rank, world_size)))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    return {
        "saved": _full(module),
        "saved_optimizer": _optimizer_state(module, optimizer.optimizer),
    }


def _trainer_resumes_and_saves(rank: int, world_size: int, path: str, out: str) -> dict[str, Any]:

    module = LitLM(seed=7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=TrainerStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(_data(world_size), batch_size=2)
    trainer.fit(module, data, ckpt_path=path)
    trainer.save_checkpoint(out)
    return {
        **module.seen,
        "global_step": trainer.global_step,
        "final": _full(module),
        "final_optimizer": _optimizer_state(module, trainer.optimizers[0]),
    }


def _fabric_loads_trainer(rank: int, world_size: int, path: str) -> dict[str, Any]:
    fabric = _fabric(world_size)
    module = LitLM(seed=3)
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=LR))
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    return {
        "remainder": sorted(remainder),
        "global_step": remainder["global_step"],
        "loaded": _full(module),
        "loaded_optimizer": _optimizer_state(module, optimizer.optimizer),
    }


def _assert_equal(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert set(actual) == set(expected) and expected
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0)


@pytest.mark.both_versions
def test_fabric_and_trainer_checkpoints_load_both_ways(tmp_path: Path) -> None:
    """Fabric save -> Trainer ``fit(ckpt_path=...)`` -> Trainer save -> ``fabric.load``."""
    fabric_ckpt, trainer_ckpt = str(tmp_path / "fabric"), str(tmp_path / "trainer")
    saved = run_distributed(_fabric_saves, 2, fabric_ckpt, init_process_group=False)[0]
    trained = run_distributed(
        _trainer_resumes_and_saves, 2, fabric_ckpt, trainer_ckpt, init_process_group=False
    )[0]
    assert trained["global_step"] == 2  # Lightning's loops started from zero
    _assert_equal(trained["loaded"], saved["saved"])
    _assert_equal(trained["loaded_optimizer"], saved["saved_optimizer"])
    for result in run_distributed(_fabric_loads_trainer, 3, trainer_ckpt, init_process_group=False):
        assert result["global_step"] == 2
        assert {"epoch", "loops", "lr_schedulers", "pytorch-lightning_version"} <= set(
            result["remainder"]
        )
        _assert_equal(result["loaded"], trained["final"])
        _assert_equal(result["loaded_optimizer"], trained["final_optimizer"])


def _load_raw(rank: int, world_size: int, paths: list[str]) -> list[dict[str, Tensor]]:
    fabric = _fabric(world_size)
    loaded = []
    for path in paths:
        module = LitLM(seed=9)
        model = fabric.setup_module(module)
        fabric.load_raw(path, model)
        loaded.append(_full(module))
    return loaded


def test_offline_tools_and_load_raw_on_a_fabric_checkpoint(tmp_path: Path) -> None:
    """``inspect --verify``, ``consolidate``, ``export-lightning`` read a Fabric checkpoint;
    the consolidated file goes back in with ``fabric.load_raw`` at another world size."""
    from lightning_megatron_fsdp.tools.cli import main

    path = tmp_path / "fabric"
    saved = run_distributed(_fabric_saves, 2, str(path), init_process_group=False)[0]
    assert main(["inspect", "--verify", str(path)]) == 0
    full = tmp_path / "full.pt"
    assert main(["consolidate", str(path), str(full)]) == 0
    weights = torch.load(full, weights_only=True)
    _assert_equal({k: v.float() for k, v in weights.items()}, saved["saved"])
    exported = tmp_path / "model.ckpt"
    assert main(["export-lightning", str(path), str(exported)]) == 0
    restored = LitLM.load_from_checkpoint(exported, seed=5)
    _assert_equal(dict(restored.named_parameters(remove_duplicate=False)), saved["saved"])
    safetensors = tmp_path / "full.safetensors"
    assert main(["consolidate", str(path), str(safetensors)]) == 0
    files = [str(full), str(safetensors), str(exported)]
    for result in run_distributed(_load_raw, 3, files, init_process_group=False):
        for loaded in result:  # .pt, .safetensors, Lightning .ckpt
            _assert_equal(loaded, saved["saved"])


# ---------------------------------------------------------------------- precision


def _fabric_precision(rank: int, world_size: int, precision: str) -> dict[str, Any]:
    fabric = _fabric(world_size, precision=precision)
    module = LitLM()
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(_rank_loader(rank, world_size), use_distributed_sampler=False)
    losses = []
    for step, (tokens, targets) in enumerate(loader):
        if step == 3:
            break
        loss = _loss(model, tokens, targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return _precision_facts(module, optimizer.optimizer, losses)


def _rank_loader(rank: int, world_size: int) -> DataLoader:
    data = _data(world_size)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=2, sampler=sampler)


def _precision_facts(
    module: nn.Module, optimizer: torch.optim.Optimizer, losses: list[float]
) -> dict[str, Any]:
    parameter = module.model.blocks[0].fc.weight
    return {
        "losses": losses,
        "full": _full(module),
        "main_dtype": str(parameter._local_tensor.dtype),
        "state_dtypes": sorted(
            {str(v.dtype) for s in optimizer.state.values() for v in s.values() if v.dim()}
        ),
        "logits_dtype": str(module(PROBE).dtype),
    }


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(outputs["loss"].item())


def _trainer_precision(rank: int, world_size: int, precision: str) -> dict[str, Any]:

    module, record = LitLM(), _Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=TrainerStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT),
        precision=precision,
        max_steps=3,
        callbacks=[record],
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _rank_loader(rank, world_size))
    with trainer.strategy.precision_plugin.forward_context():
        return _precision_facts(module, trainer.optimizers[0], record.losses)


@pytest.mark.both_versions
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16-true", "bf16-mixed"])
def test_precisions_train_as_under_the_trainer(precision: str) -> None:
    """Each flag means what it means in the Trainer table: the same losses and weights as
    the Trainer strategy's fit, bit for bit; fp32 main weights and optimizer state."""
    fabric = run_distributed(_fabric_precision, 2, precision, init_process_group=False)
    trainer = run_distributed(_trainer_precision, 2, precision, init_process_group=False)
    for mine, theirs in zip(fabric, trainer, strict=True):
        assert mine["losses"] == theirs["losses"]
        _assert_equal(mine["full"], theirs["full"])
        assert mine["main_dtype"] == "torch.float32"
        assert mine["state_dtypes"] == ["torch.float32"]
        compute = {"bf16-true": "torch.bfloat16", "16-true": "torch.float16"}
        assert mine["logits_dtype"] == compute.get(precision, "torch.float32")


# ---------------------------------------------------------------------- two optimizers


def _two_optimizers(fabric: Fabric, seed: int) -> tuple[nn.Module, Any, Any]:
    """The model with Adam on its blocks ("a") and SGD with momentum on the rest ("b")."""
    module = LitLM(seed=seed)
    blocks = [p for n, p in module.named_parameters() if ".blocks." in n]
    rest = [p for n, p in module.named_parameters() if ".blocks." not in n]
    model, opt_a, opt_b = fabric.setup(
        module, torch.optim.Adam(blocks, lr=LR), torch.optim.SGD(rest, lr=LR, momentum=0.9)
    )
    return model, opt_a, opt_b


def _keyed_optimizers(
    rank: int, world_size: int, env: dict[str, str], paths: list[str]
) -> dict[str, Any]:
    """Save {"model", "a", "b"} at each path; load it back with the keys in the other order
    into a fresh model and optimizers, and with an unknown key."""
    os.environ.update(env)  # the bucket's endpoint and credentials, as a user's job has them
    fabric = _fabric(world_size)
    model, opt_a, opt_b = _two_optimizers(fabric, seed=0)
    for step in range(2):
        fabric.backward(_loss(model, *_rank_batch(step, rank, world_size)))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    saved = {
        "a": _optimizer_state(model.module, opt_a.optimizer),
        "b": _optimizer_state(model.module, opt_b.optimizer),
    }
    result: dict[str, Any] = {"saved": saved, "loaded": {}, "unknown": {}, "fewer": {}}
    for path in paths:
        fabric.save(path, {"model": model, "a": opt_a, "b": opt_b})
        fresh, fresh_a, fresh_b = _two_optimizers(fabric, seed=7)
        fabric.load(path, {"b": fresh_b, "model": fresh, "a": fresh_a})
        result["loaded"][path] = {
            "a": _optimizer_state(fresh.module, fresh_a.optimizer),
            "b": _optimizer_state(fresh.module, fresh_b.optimizer),
        }
        for name, state in (
            ("unknown", {"model": fresh, "a": fresh_a, "c": fresh_b}),
            ("fewer", {"model": fresh, "a": fresh_a}),
        ):
            try:
                fabric.load(path, state)
                result[name][path] = None
            except Exception as err:
                result[name][path] = f"{type(err).__name__}: {err}"
    return result


def test_optimizers_are_matched_by_key_on_a_bucket_and_locally(
    tmp_path: Path, seaweed: SeaweedServer
) -> None:
    """``fabric.save(path, {"model", "a", "b"})`` on a bucket and on disk: a load with the
    keys in the other order restores each optimizer bit-exactly (Adam and SGD, over
    different parameters), and a load with a key the checkpoint does not hold, or with
    fewer optimizers, raises ``CheckpointMismatchError`` on every rank naming both sets of
    keys (read from ``meta.pt`` through the load's own store)."""
    paths = [f"s3://{seaweed.new_bucket()}/run/keyed.ckpt", str(tmp_path / "keyed.ckpt")]
    results = run_distributed(
        _keyed_optimizers, 2, seaweed.env, paths, init_process_group=False, timeout=240
    )
    for result in results:
        for path in paths:
            for key in ("a", "b"):
                _assert_equal(result["loaded"][path][key], result["saved"][key])
            error = result["unknown"][path]
            assert error is not None and error.startswith("CheckpointMismatchError:"), error
            assert "under the keys ['a', 'b']" in error and "optimizers under ['a', 'c']" in error
            error = result["fewer"][path]
            assert error is not None and error.startswith("CheckpointMismatchError:"), error
            assert "under the keys ['a', 'b']" in error and "optimizers under ['a']." in error


def _refusals(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Loads of a {"model", "a", "b"} checkpoint that do not fit, one of a weights-only
    {"model"} checkpoint, and one of a checkpoint whose ``meta.pt`` was damaged."""
    fabric = _fabric(world_size)
    model, opt_a, opt_b = _two_optimizers(fabric, seed=0)
    fabric.backward(_loss(model, *_rank_batch(0, rank, world_size)))
    opt_a.step()
    opt_b.step()
    keyed, weights, damaged = (str(Path(root) / name) for name in ("keyed", "weights", "damaged"))
    fabric.save(keyed, {"model": model, "a": opt_a, "b": opt_b})
    fabric.save(weights, {"model": model})
    fabric.save(damaged, {"model": model, "a": opt_a, "b": opt_b})
    if rank == 0:  # one byte of meta.pt flipped after the save: its checksum fails
        meta = Path(damaged) / "meta.pt"
        data = bytearray(meta.read_bytes())
        data[len(data) // 2] ^= 0xFF
        meta.write_bytes(bytes(data))
    fabric.barrier()
    fresh, fresh_a, fresh_b = _two_optimizers(fabric, seed=7)
    loads = {
        "fewer": (keyed, {"model": fresh, "a": fresh_a}, True),
        "more": (weights, {"model": fresh, "a": fresh_a}, True),
        "damaged": (damaged, {"model": fresh, "a": fresh_a, "b": fresh_b}, True),
        "weights only, not strict": (weights, {"model": fresh, "a": fresh_a}, False),
    }
    errors: dict[str, str | None] = {}
    for name, (path, state, strict) in loads.items():
        try:
            fabric.load(path, state, strict=strict)
            errors[name] = None
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
    return {
        "errors": errors,
        "weights": _full(model.module),
        "loaded": _full(fresh.module),
        "a": _optimizer_state(fresh.module, fresh_a.optimizer),
    }


def test_a_load_that_does_not_fit_or_cannot_be_read_raises_on_every_rank(
    tmp_path: Path,
) -> None:
    """Optimizer keys are checked by count too (fewer than saved, or some where none were
    saved), naming both sets; ``strict=False`` loads a weights-only checkpoint and leaves the
    optimizers as they are; a damaged ``meta.pt`` is refused (never taken for "no keys")."""
    results = run_distributed(_refusals, 2, str(tmp_path), init_process_group=False, timeout=240)
    assert results[0]["errors"] == results[1]["errors"]
    errors = results[0]["errors"]
    assert errors["fewer"].startswith("CheckpointMismatchError:"), errors["fewer"]
    assert "2 optimizer state(s) under the keys ['a', 'b']" in errors["fewer"]
    assert "optimizers under ['a']" in errors["fewer"]
    assert errors["more"].startswith("CheckpointMismatchError:"), errors["more"]
    assert "0 optimizer state(s) under the keys []" in errors["more"]
    assert "strict=False loads it" in errors["more"]
    assert errors["damaged"].startswith("CheckpointCorruptedError:"), errors["damaged"]
    assert "meta.pt" in errors["damaged"]
    assert errors["weights only, not strict"] is None
    for result in results:
        _assert_equal(result["loaded"], result["weights"])
        assert result["a"] == {}  # never stepped, and nothing loaded into it


# ---------------------------------------------------------------------- bad input


def _bad_inputs(rank: int, world_size: int, path: str) -> dict[str, str | None]:
    fabric = _fabric(world_size)
    module = LitLM()
    model, _ = fabric.setup(module, torch.optim.Adam(module.parameters(), lr=LR))
    calls = {
        "filter": lambda: fabric.save(path, {"model": model}, filter={"model": lambda k, v: True}),
        "no model": lambda: fabric.save(path, {"step": 1}),
        "reserved key": lambda: fabric.save(path, {"model": model, "state_dict": {}}),
        "no state": lambda: fabric.load(path),
        "foreign optimizer": lambda: fabric.setup_optimizers(
            torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
        ),
        "stepped optimizer": lambda: _setup_stepped(fabric),
    }
    errors: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
    return errors


def _setup_stepped(fabric: Fabric) -> None:
    module = LitLM()
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    _loss(module, *make_batch(0)).backward()
    optimizer.step()
    fabric.setup(module, optimizer)


def test_bad_input_raises_one_clear_error_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_bad_inputs, 2, str(tmp_path / "ckpt"), init_process_group=False)
    assert results[0] == results[1]
    errors = results[0]
    assert errors["filter"].startswith("ValueError:") and "filter=" in errors["filter"]
    assert (
        errors["no model"].startswith("ValueError:") and "exactly one module" in errors["no model"]
    )
    assert "'state_dict' is used by the checkpoint format" in errors["reserved key"]
    assert errors["no state"].startswith("ValueError:") and "needs a state" in errors["no state"]
    assert errors["foreign optimizer"].startswith("ValueError:")
    assert "not a Megatron-FSDP sharded parameter" in errors["foreign optimizer"]
    assert "has state already" in errors["stepped optimizer"]
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        Fabric(accelerator="cpu", devices=1, strategy=MegatronFSDPStrategy(), precision="64-true")
    with pytest.raises(TypeError, match="auto_wrap_policy must"):
        MegatronFSDPStrategy(auto_wrap_policy="Block")  # type: ignore[arg-type]


def test_registered_as_megatron_fsdp() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="megatron_fsdp", precision="bf16-true")
    assert type(fabric.strategy) is MegatronFSDPStrategy
    assert lightning_megatron_fsdp.fabric.MegatronFSDPStrategy is MegatronFSDPStrategy
    assert fabric.strategy.precision.compute_dtype == torch.bfloat16
