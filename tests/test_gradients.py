"""Full parameters, gradients and gradient norms the usual ways, against DDP's values.

The same LightningModule trains under Lightning's ``strategy="ddp"`` and under
``MegatronFSDPStrategy`` on 2 real gloo ranks. Its packed LM (``tests.models``) shards
unevenly at 2 ranks (rank 0 owns all 5 rows of ``mix``, canonical ``Shard(0)`` says 3), and
a 1-element ``temperature`` leaves rank 1 an empty shard, so DTensor's own
``full_tensor()`` would abort the process here. In ``on_after_backward`` and
``on_before_optimizer_step`` the module reads, per route:

* ``lightning_megatron_fsdp.grad_norm(self, p)`` (ours) / Lightning's ``grad_norm`` (DDP);
* ``full_tensor(p.grad)``, ``p.grad.full_tensor()``, ``full_tensor(p)``, ``p.full_tensor()``,
  ``full_tensor(p.detach())``, ``full_tensor(p.grad.data)`` (ours) / ``p.grad`` and ``p`` (DDP);
  and DTensor's own ``p.detach().full_tensor()``, which the README warns is wrong here;
* ``full_tensor`` of Adam's ``exp_avg`` (ours) / DDP's ``exp_avg``;
* ``sharded_grad_norm(self.parameters())`` (ours) / torch's total norm (DDP).

Lightning's own ``grad_norm`` under our strategy raises an error naming our route, on
every rank. On a 2 x 2 HSDP mesh (no Trainer), ``full_tensor`` and ``grad_norm`` match one
process's full-batch values.
"""

from __future__ import annotations

import pickle
import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import (
    enable_cpu_execution,
    full_tensor,
    grad_norm,
    hsdp_placements,
    shard_module,
    sharded_grad_norm,
    sharding_scope,
)
from lightning_megatron_fsdp.megatron.gather import _FullTensorMethod
from tests.harness import run_distributed
from tests.models import build_packed_lm, lm_loss, make_batch, make_trainer, route_strategy

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

WORLD_SIZE = 2
STEPS = 2


class LitPacked(pl.LightningModule):
    """A packed LM (policy units, tied weights) plus a root parameter with one element."""

    def __init__(self, route: str) -> None:
        super().__init__()
        self.model = build_packed_lm(seed=0)
        self.temperature = nn.Parameter(torch.tensor([1.25]))
        self.route = route
        self.seen: list[dict[str, Any]] = []
        self.after_backward: Tensor | None = None

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self.model(tokens) * self.temperature
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def on_after_backward(self) -> None:
        if self.route == "megatron_fsdp":  # bound before the hooks run, every backward
            self.after_backward = self.model.embed.weight.grad.full_tensor()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        named = dict(self.named_parameters())
        state = optimizer.state
        if self.route == "lightning_grad_norm":
            lightning_grad_norm(self, norm_type=2)  # refused with our route named
        record: dict[str, Any] = {"after_backward": self.after_backward}
        # The README's form: log the norms (compared through callback_metrics).
        self.log_dict(lightning_grad_norm(self, 2) if self.route == "ddp" else grad_norm(self, 2))
        if self.route == "ddp":
            record["norms"] = _floats(lightning_grad_norm(self, 2))
            record["norms_inf"] = _floats(lightning_grad_norm(self, "inf"))
            record["total"] = float(torch.nn.utils.get_total_norm([p.grad for p in named.values()]))
            record["grads"] = {n: p.grad.clone() for n, p in named.items()}
            record["params"] = {n: p.detach().clone() for n, p in named.items()}
            record["exp_avg"] = {
                n: state[p]["exp_avg"].clone() for n, p in named.items() if p in state
            }
        else:
            record["norms"] = _floats(grad_norm(self, 2))
            record["norms_inf"] = _floats(grad_norm(self, "inf"))
            record["total"] = float(sharded_grad_norm(self.parameters()))
            record["grads"] = {n: full_tensor(p.grad) for n, p in named.items()}
            record["grads_method"] = {n: p.grad.full_tensor() for n, p in named.items()}
            record["params"] = {n: full_tensor(p) for n, p in named.items()}
            record["params_method"] = {n: p.full_tensor() for n, p in named.items()}
            # A derived tensor is a plain DTensor: full_tensor() of it works, its own method
            # does not (README): `mix` (5 rows on rank 0, none on rank 1, canonical 3 + 2)
            # comes back cropped and zero-padded, without an error.
            record["derived"] = {n: full_tensor(p.detach()) for n, p in named.items()}
            record["grads_derived"] = {n: full_tensor(p.grad.data) for n, p in named.items()}
            record["mix_derived_method"] = named["model.blocks.0.mix"].detach().full_tensor()
            record["exp_avg"] = {
                n: full_tensor(state[p]["exp_avg"]) for n, p in named.items() if p in state
            }
            record["local_rows"] = {n: p._local_tensor.shape[0] for n, p in named.items()}
        self.seen.append(record)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _floats(norms: dict[str, Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in norms.items()}


def _fit(rank: int, world_size: int, route: str) -> list[dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    model = LitPacked(route)
    tokens, targets = zip(*(make_batch(seed, batch_size=1) for seed in range(8)), strict=True)
    data = TensorDataset(torch.cat(tokens), torch.cat(targets))
    trainer = make_trainer(world_size, route_strategy(route), max_steps=STEPS)
    trainer.fit(model, DataLoader(data, batch_size=2))
    model.seen.append({"logged": _floats(trainer.callback_metrics)})
    return model.seen


def _both(rank: int, world_size: int) -> dict[str, list[dict[str, Any]]]:
    return {route: _fit(rank, world_size, route) for route in ("ddp", "megatron_fsdp")}


def _assert_tensors(ours: dict[str, Tensor], ddp: dict[str, Tensor], atol: float) -> None:
    assert ours.keys() == ddp.keys()
    for name, value in ours.items():
        torch.testing.assert_close(value, ddp[name], rtol=0, atol=atol, msg=name)


def test_full_tensors_and_grad_norms_match_ddp() -> None:
    """Every route gives DDP's parameters, gradients, optimizer state and norms."""
    results = run_distributed(_both, WORLD_SIZE, init_process_group=False, timeout=240)
    for rank, result in enumerate(results):
        ddp, ours = result["ddp"], result["megatron_fsdp"]
        assert len(ddp) == len(ours) == STEPS + 1
        logged, expected_logged = ours.pop()["logged"], ddp.pop()["logged"]
        assert logged.keys() == expected_logged.keys() and "grad_2.0_norm_total" in logged
        for key, value in logged.items():
            assert value == pytest.approx(expected_logged[key], rel=1e-6), key
        for step, (expected, actual) in enumerate(zip(ddp, ours, strict=True)):
            # Shards really are uneven: rank 1 owns no row of `temperature`.
            assert actual["local_rows"]["temperature"] == (1 if rank == 0 else 0)
            assert actual["local_rows"]["model.blocks.0.mix"] == (5 if rank == 0 else 0)
            # Bit-exact: both average the same per-rank gradients of 2 ranks ((a + b) / 2,
            # all-reduce or reduce-scatter), so Adam's steps and states agree too.
            _assert_tensors(actual["params"], expected["params"], 0.0)
            _assert_tensors(actual["params_method"], expected["params"], 0.0)
            _assert_tensors(actual["grads"], expected["grads"], 0.0)
            _assert_tensors(actual["grads_method"], actual["grads"], 0.0)
            _assert_tensors(actual["derived"], expected["params"], 0.0)
            _assert_tensors(actual["grads_derived"], expected["grads"], 0.0)
            mix, wrong = expected["params"]["model.blocks.0.mix"], actual["mix_derived_method"]
            assert wrong.shape == mix.shape and not torch.equal(wrong, mix), (
                "DTensor's own full_tensor() of a derived tensor now gathers packed shards "
                "right: update the README's 'Full parameters' section and this check"
            )
            torch.testing.assert_close(
                actual["after_backward"], actual["grads"]["model.embed.weight"], rtol=0, atol=0
            )
            if step > 0:  # Adam's state exists from the first step on
                _assert_tensors(actual["exp_avg"], expected["exp_avg"], 0.0)
                assert expected["exp_avg"], "no optimizer state compared"
            # Norms sum the squares shard by shard, not in DDP's order: rounding differs.
            for key in ("norms", "norms_inf"):
                assert actual[key].keys() == expected[key].keys()
                for name, value in actual[key].items():
                    assert value == pytest.approx(expected[key][name], rel=1e-6), (key, name)
            assert actual["total"] == pytest.approx(expected["total"], rel=1e-6)
            total = actual["norms"]["grad_2.0_norm_total"]
            assert total == pytest.approx(actual["total"], rel=1e-6)


def _lightning_grad_norm(rank: int, world_size: int) -> str:
    try:
        _fit(rank, world_size, "lightning_grad_norm")
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_lightning_grad_norm_names_our_route_on_every_rank() -> None:
    for message in run_distributed(_lightning_grad_norm, WORLD_SIZE, init_process_group=False):
        assert re.match(
            r"lightning.pytorch.utilities.grad_norm cannot read Megatron-FSDP's sharded "
            r"gradients .* Use lightning_megatron_fsdp.grad_norm\(self, norm_type\) instead",
            message,
        ), message


def test_full_tensor_method_of_a_copy_explains_itself() -> None:
    """A pickled or deep-copied sharded tensor's bound method says what to call instead."""
    method = pickle.loads(pickle.dumps(_FullTensorMethod(torch.zeros(2))))
    with pytest.raises(RuntimeError, match=r"call lightning_megatron_fsdp.full_tensor\(tensor\)"):
        method()


def _hsdp(rank: int, world_size: int) -> dict[str, Any]:
    enable_cpu_execution()
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard"))
    model = build_packed_lm(seed=0)
    with sharding_scope():
        for block in model.blocks:
            shard_module(block, mesh, hsdp_placements())
        shard_module(model, mesh, hsdp_placements())
    lm_loss(model, make_batch(rank)).backward()
    named = dict(model.named_parameters())
    return {
        "params": {n: full_tensor(p) for n, p in named.items()},
        "grads": {n: full_tensor(p.grad) for n, p in named.items()},
        "norms": _floats(grad_norm(model, 2)),
        "local_rows": {n: p._local_tensor.shape[0] for n, p in named.items()},
    }


def test_full_tensor_and_grad_norm_on_hsdp_match_one_process() -> None:
    """On a 2 x 2 HSDP mesh: shards gathered within a row, replicas counted once."""
    results = run_distributed(_hsdp, 4, timeout=180)
    reference = build_packed_lm(seed=0)
    (sum(lm_loss(reference, make_batch(rank)) for rank in range(4)) / 4).backward()
    expected = dict(reference.named_parameters())
    norms = {name: float(p.grad.norm()) for name, p in expected.items()}
    for result in results:
        assert any(rows == 0 for rows in result["local_rows"].values())  # uneven shards
        for name, value in result["params"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0)
        for name, value in result["grads"].items():
            # The reference sums the 4 losses in another order: rounding differs.
            torch.testing.assert_close(value, expected[name].grad, rtol=0, atol=1e-6)
        for name, value in norms.items():
            assert result["norms"][f"grad_2.0_norm/{name}"] == pytest.approx(value, rel=1e-5)
        total = float(torch.tensor(list(norms.values())).norm())
        assert result["norms"]["grad_2.0_norm_total"] == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("norm_type", [0, -2.0, float("nan")])
def test_norm_type_must_be_positive(norm_type: float) -> None:
    """Both gradient norms refuse a norm type that is not a positive number, naming it."""
    with pytest.raises(ValueError, match=r"sharded_grad_norm: norm_type must be a positive"):
        sharded_grad_norm([nn.Parameter(torch.ones(2))], norm_type)
    with pytest.raises(ValueError, match=r"grad_norm: norm_type must be a positive"):
        grad_norm(nn.Linear(2, 2), norm_type)
