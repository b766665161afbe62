"""The Fabric strategy: a hand-written Fabric loop with Megatron-FSDP, checkpoints included.

Real ranks (``tests.harness``, torchrun-style environment, Fabric joins the group), the
real ``Fabric`` and ``lightning_megatron_fsdp.fabric.MegatronFSDPStrategy``, real DCP
checkpoints. The model is ``tests.models.PackedLM`` (packed shards that defeat canonical
``Shard(0)``, a tied embedding/head, nested units), here with dropout on its embedding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_megatron_fsdp import full_tensor
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy
from tests.harness import run_distributed
from tests.models import PackedBlock, PackedLM, build_packed_lm, make_batch

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


def _train(rank: int, world_size: int, setup: str, accumulate: int, clip: float | None) -> Any:
    fabric = _fabric(world_size)
    model = _build()
    if setup == "joint":  # optimizer built before sharding, re-pointed by setup
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            tokens, targets = _rank_batch(step * accumulate + micro, rank, world_size)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = _loss(model, tokens, targets)
                fabric.backward(loss / accumulate)
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
    ("world_size", "setup", "accumulate", "clip"),
    [(1, "joint", 1, None), (2, "split", 1, None), (3, "joint", 2, 0.05), (2, "joint", 2, 0.05)],
)
def test_fabric_loop_equals_single_process(
    world_size: int, setup: str, accumulate: int, clip: float | None
) -> None:
    """Losses, clipped norms and final weights equal one process training on the whole batch."""
    results = run_distributed(
        _train, world_size, setup, accumulate, clip, init_process_group=False, timeout=150
    )
    reference = _reference(world_size, accumulate, clip)
    for result in results:
        assert result["gathered"] == list(range(world_size))
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=0, atol=1e-5)
        torch.testing.assert_close(result["norms"], reference["norms"], rtol=1e-5, atol=0)
        assert set(result["full"]) == set(reference["full"])
        for name, value in reference["full"].items():
            torch.testing.assert_close(result["full"][name], value, rtol=0, atol=1e-5)
    if clip is not None:
        assert min(reference["norms"]) > clip  # clipping was active
    assert len({r["after"] for r in results}) == 1
