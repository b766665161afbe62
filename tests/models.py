"""Shared test models whose Megatron-FSDP layouts exercise every packing case we support.

Problem: a checkpoint test on a model whose shards happen to tile like torch's canonical
``Shard(0)`` proves nothing, because DCP's default planner is right for it by accident.
Megatron-FSDP packs each parameter group into one flat buffer with lcm-of-row-sizes
padding (``GlobalLayout.build``), and the cases that break the canonical picture are
specific: a small parameter that fills another's padding gap, a Linear whose bias is
packed away from its weight, a parameter with 3+ dims, a tie under two FQNs, nested
units. :class:`PackedLM` has all of them, small enough to train in milliseconds.

Packing of one :class:`PackedBlock` (a child FSDP unit; group chunk = lcm(6, 6, 6, 1, 4, 1)
= 12 elements; fragments are tensors smaller than a chunk)::

    offset   0            30      36               60               84      90     94
             | mix (5,2,3) | gain  | fc.weight (4,6) | out.weight (6,4) |out.b | fc.b |
             |  30 = 2.5 chunks    |                 |                  |  tail fragments
             |  gap [30, 36) filled by the 6-element fragment ``gain``

    world size 2 (48 elements a rank):  rank 0 owns mix rows 0-4 (all 5, canonical says 3),
    gain, fc.weight rows 0-1; rank 1 owns fc.weight rows 2-3, out.weight, out.bias,
    fc.bias. fc.weight is split between ranks while fc.bias sits whole on rank 1.

The root unit holds ``embed.weight`` (tied to ``head.weight``) and ``head.bias``.

Stable API for the whole test suite (other test modules import these names):
    :class:`PackedLM`, :class:`PackedBlock`, :func:`build_packed_lm`,
    :func:`shard_packed_lm`, :func:`dp_mesh`, :func:`hsdp_mesh`, :func:`fsdp_placements`,
    :func:`bf16_policy`, :func:`make_batch`, :func:`lm_loss`, :func:`fsdp_modules`,
    :func:`sync_compute_weights`, :func:`local_shards`, :func:`sharded_adam`,
    :func:`train_unsharded`, :func:`make_trainer`, :func:`route_strategy`,
    :func:`sequence_loader`, :func:`adamw_step_lr`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy
from megatron_fsdp import MixedPrecisionPolicy
from megatron_fsdp.experimental import Placements, fully_shard_optimizer
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import MegatronFSDPStrategy, shard_module, sharding_scope
from lightning_megatron_fsdp import fsdp_placements as _fsdp_placements
from lightning_megatron_fsdp.megatron._megatron import FsdpModule
from tests.harness import PROCESS_GROUP_TIMEOUT

__all__ = [
    "FFN",
    "HIDDEN",
    "KERNELS",
    "VOCAB",
    "PackedBlock",
    "PackedLM",
    "adamw_step_lr",
    "bf16_policy",
    "build_packed_lm",
    "dp_mesh",
    "fsdp_modules",
    "fsdp_placements",
    "hsdp_mesh",
    "lm_loss",
    "local_shards",
    "make_batch",
    "make_trainer",
    "route_strategy",
    "sequence_loader",
    "shard_packed_lm",
    "sharded_adam",
    "sharded_packed_lm",
    "sync_compute_weights",
    "train_unsharded",
]

VOCAB = 11
HIDDEN = 6
FFN = 4
KERNELS = 5


class PackedBlock(nn.Module):
    """A residual block whose parameter group packs unevenly (see the module docstring).

    Parameters, in Megatron-FSDP packing order (own parameters, then children's):
    ``mix`` (5, 2, 3), ``gain`` (1, 6), ``fc.weight`` (4, 6), ``fc.bias`` (4,),
    ``out.weight`` (6, 4), ``out.bias`` (6,).
    """

    def __init__(self) -> None:
        super().__init__()
        # Registration order is packing order: ``mix`` must come before ``gain`` so the
        # fragment ``gain`` lands in the gap ``mix`` leaves.
        self.mix = nn.Parameter(torch.empty(KERNELS, 2, 3))
        self.gain = nn.Parameter(torch.empty(1, HIDDEN))
        self.fc = nn.Linear(HIDDEN, FFN)
        self.out = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual update of ``x`` (..., HIDDEN) that uses every parameter."""
        h = torch.tanh(self.fc(x))
        z = torch.einsum("...ij,kij->...k", x.unflatten(-1, (2, 3)), self.mix)
        return x + self.out(h) * self.gain + torch.tanh(z).mean(-1, keepdim=True)


class PackedLM(nn.Module):
    """Tiny language model: tied embedding/head, nested blocks, every packing case.

    Args:
        num_blocks: Number of :class:`PackedBlock` children (each its own FSDP unit).
    """

    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        if num_blocks < 1:
            raise ValueError(f"PackedLM: num_blocks must be >= 1, got {num_blocks}.")
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(PackedBlock() for _ in range(num_blocks))
        self.head = nn.Linear(HIDDEN, VOCAB)
        # The tie: one Parameter under two FQNs, ``embed.weight`` (canonical, first in
        # ``named_parameters`` order) and ``head.weight``.
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits (batch, seq, VOCAB) for integer ``tokens`` (batch, seq)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_packed_lm(
    seed: int | None = 0, *, dtype: torch.dtype = torch.float32, num_blocks: int = 2
) -> PackedLM:
    """Build a :class:`PackedLM` with deterministic values, before any sharding.

    Every rank that calls this with the same arguments gets bit-identical parameters,
    which ``fully_shard`` requires (each rank keeps its own slice of its own copy).

    Args:
        seed: Seed for N(0, 0.5) values; ``None`` for all zeros (a load target that
            cannot pass a comparison by accident).
        dtype: Parameter dtype (``torch.bfloat16`` for the mixed-precision cases).
        num_blocks: Number of blocks.

    Returns:
        The unsharded model on CPU.
    """
    model = PackedLM(num_blocks)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if generator is None:
                parameter.zero_()
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model.to(dtype)


def dp_mesh(world_size: int) -> DeviceMesh:
    """A 1-D CPU data-parallel mesh over the default (gloo) process group."""
    return init_device_mesh("cpu", (world_size,))


def hsdp_mesh(
    replicate: int,
    shard: int,
    *,
    names: tuple[str, str] = ("replicate", "shard"),
    timeout: timedelta = timedelta(seconds=45),
) -> DeviceMesh:
    """A 2-D CPU ``(replicate, shard)`` mesh over the default group, as a user builds one.

    Rows of ``arange(replicate * shard).view(replicate, shard)`` are shard groups, columns
    replicate groups; both get ``timeout`` (``init_device_mesh`` would give its sub-groups
    torch's 30-minute default, so a failing peer would stall the test that long).
    ``names`` are the mesh's dim names.
    """
    ranks = torch.arange(replicate * shard).view(replicate, shard)
    shards, _ = dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=timeout)
    replicas, _ = dist.new_subgroups_by_enumeration(ranks.T.tolist(), timeout=timeout)
    return DeviceMesh.from_group([replicas, shards], "cpu", mesh=ranks, mesh_dim_names=names)


def fsdp_placements() -> Placements:
    """Plain FSDP: parameters, gradients and optimizer state all sharded on one axis."""
    return _fsdp_placements()


def bf16_policy() -> MixedPrecisionPolicy:
    """bf16 compute weights (the model's dtype) with fp32 main weights."""
    return MixedPrecisionPolicy(main_params_dtype=torch.float32)


def shard_packed_lm(
    model: PackedLM,
    mesh: DeviceMesh,
    *,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    placements: Placements | None = None,
) -> PackedLM:
    """Shard every block as its own unit, then the root (embedding, tied head, head bias).

    Bottom-up, as megatron-fsdp requires, and through :func:`shard_module` so the tie
    survives.

    Args:
        model: An unsharded model from :func:`build_packed_lm`.
        mesh: Data-parallel mesh (:func:`dp_mesh`, or :func:`hsdp_mesh` with HSDP
            placements).
        mixed_precision_policy: ``None`` for fp32, :func:`bf16_policy` for bf16 models.
        placements: ``None`` for :func:`fsdp_placements`.

    Returns:
        ``model``, sharded in place.
    """
    placements = placements or fsdp_placements()
    policy = mixed_precision_policy
    with sharding_scope():
        for block in model.blocks:
            shard_module(block, mesh, placements, mixed_precision_policy=policy)
        shard_module(model, mesh, placements, mixed_precision_policy=policy)
    return model


def make_batch(
    seed: int, *, batch_size: int = 2, seq_len: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets) of shape (batch_size, seq_len) each."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)
    targets = torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)
    return tokens, targets


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean token cross-entropy, computed in fp32 whatever the model's dtype."""
    tokens, targets = batch
    logits = model(tokens).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def fsdp_modules(model: nn.Module) -> list[FsdpModule]:
    """Every Megatron-FSDP unit in ``model``, root included, in ``modules()`` order."""
    return [module for module in model.modules() if isinstance(module, FsdpModule)]


def sync_compute_weights(model: nn.Module) -> None:
    """Refresh every group's compute weights from its main weights (after a load)."""
    from lightning_megatron_fsdp.megatron import _megatron

    _megatron.sync_compute_weights(model)


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of this rank's local shard of every sharded parameter, by FQN (ties: each FQN).

    Rank-local: reads ``DTensor._local_tensor`` (the main weight slice), no collective.
    """
    return {
        name: parameter._local_tensor.detach().clone()
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if isinstance(parameter, DTensor)
    }


def sharded_adam(model: nn.Module, lr: float = 0.05) -> torch.optim.Adam:
    """Adam over ``model``'s sharded parameters, adapted with ``fully_shard_optimizer``."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    fully_shard_optimizer(optimizer)
    return optimizer


def sharded_packed_lm(
    world_size: int,
    seed: int | None = 0,
    *,
    lr: float = 0.05,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 2,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
) -> tuple[PackedLM, torch.optim.Adam]:
    """:func:`build_packed_lm` sharded on :func:`dp_mesh` (:func:`shard_packed_lm`), and its
    :func:`sharded_adam`."""
    model = build_packed_lm(seed, dtype=dtype, num_blocks=num_blocks)
    mesh = dp_mesh(world_size)
    model = shard_packed_lm(model, mesh, mixed_precision_policy=mixed_precision_policy)
    return model, sharded_adam(model, lr=lr)


def train_unsharded(
    steps: int, *, lr: float = 0.05, num_blocks: int = 2
) -> tuple[PackedLM, torch.optim.Adam]:
    """:func:`build_packed_lm` trained in one process with plain torch Adam, no sharding.

    The oracle for data-parallel runs in which every rank trains on the same
    ``make_batch(step)`` for ``step in range(steps)``: their averaged gradient is this
    one's (up to the rounding of the average), and nothing here depends on a layout.
    """
    model = build_packed_lm(0, num_blocks=num_blocks)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        lm_loss(model, make_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def make_trainer(devices: int, strategy: Any = None, **options: Any) -> pl.Trainer:
    """A quiet CPU ``Trainer`` on ``devices`` processes, as the Trainer tests build it.

    No logger, progress bar or model summary; checkpointing only when ``callbacks`` holds
    a ``ModelCheckpoint`` (Lightning refuses one with ``enable_checkpointing=False``, and
    a default one would write files no test asked for). Any of these, and every other
    ``Trainer`` argument, can be given in ``options``.

    Args:
        devices: Number of CPU processes.
        strategy: ``None`` for a ``MegatronFSDPStrategy`` that wraps each
            :class:`PackedBlock` and gives up on a hung collective after the harness's
            ``PROCESS_GROUP_TIMEOUT``.
        options: ``Trainer`` arguments, overriding the defaults above.
    """
    if strategy is None:
        strategy = route_strategy("megatron_fsdp")
    callbacks = options.get("callbacks") or []
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": strategy,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
    }
    return pl.Trainer(**{**defaults, **options})


def adamw_step_lr(parameters: Iterable[nn.Parameter], lr: float) -> dict[str, Any]:
    """``configure_optimizers``' answer: AdamW (weight decay 0.1) and a ``StepLR`` that
    halves the rate every 3 steps, stepped every step, so both carry state to checkpoint."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def route_strategy(route: str) -> Strategy:
    """The strategy of an equivalence test's route: for ``"ddp"`` Lightning's
    ``DDPStrategy`` on gloo (the reference), for any other route (``"megatron_fsdp"``, or
    a variant of it a test names) :func:`make_trainer`'s default."""
    if route == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
    return MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT)


def sequence_loader(seed: int, rows: int) -> StatefulDataLoader:
    """Shuffled batches of 2 random token sequences of length 6 (inputs ``[:, :-1]``,
    targets ``[:, 1:]``), from a resumable loader: the form users write."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, VOCAB, (rows, 6), generator=generator)
    return StatefulDataLoader(TensorDataset(sequences), batch_size=2, shuffle=True)
