"""Replicated modes train one model, whatever each rank's seed (``megatron/replicas.py``).

Every rank seeds differently before building the model (``seed_everything(1234 + rank)``, as
``examples/litgpt_pretrain.py`` does), and every rank trains on its own batches. Real ranks
(``tests.harness``), real gloo, the real Trainer and Fabric. Asserted, for every mode the
installed megatron-fsdp trains and HSDP at (2, 1) and (2, 2):

* every rank's full parameters, buffers (a ``BatchNorm``'s running stats, a random mask)
  and probe output are bit-identical after setup, after the steps and after a resume;
* a replicated tensor holds its replica group's first rank's values at setup (buffers rank
  0's; each parameter row the one some rank of the first replica row built);
* the run equals one process trained from the state after setup on every rank's batches
  with DDP's buffer rule (rank 0's buffers before each forward) within 1e-6;
* resumes convert between modes in both directions (``FULL_SHARD`` <-> ``HYBRID_SHARD``
  and, on 0.7, a ring through every mode; world size 2 -> 4 for the (2, 2) mesh), each
  resumed state equal to the saved one bit for bit;
* the agreement check names the first tensor whose replicas differ, and the ranks, on
  every rank.

Without the fix (each rank keeping the values it built) the replicated modes fail the first
assertion: the probe outputs of rank 0 and rank 1 differ after setup and after training.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import MegatronFSDPStrategy, full_tensor
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy as FabricStrategy
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron.replicas import ReplicaMismatchError, check_replicas
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.test_portability import make_trainer

pytestmark = pytest.mark.both_versions

LR = 1e-2
BATCHES = 2  # per rank and epoch
BATCH = 4
ATOL = 1e-6
FEATURES = 8

#: (case name, mode, device mesh, the case whose checkpoint its resume loads).
TWO_RANKS: list[tuple[str, str, tuple[int, int] | None, str]] = [
    ("FULL_SHARD", "FULL_SHARD", None, "HYBRID_SHARD(2,1)"),
    ("HYBRID_SHARD(2,1)", "HYBRID_SHARD", (2, 1), "FULL_SHARD"),
]
FOUR_RANKS: list[tuple[str, str, tuple[int, int] | None, str]] = [
    ("HYBRID_SHARD(2,2)", "HYBRID_SHARD", (2, 2), "FULL_SHARD"),
]
if _megatron.REPLICATED_PARAMETERS:  # megatron-fsdp 0.7: the other modes, in a ring
    TWO_RANKS = [
        ("FULL_SHARD", "FULL_SHARD", None, "HYBRID_SHARD_GRAD_OP(2,1)"),
        ("HYBRID_SHARD(2,1)", "HYBRID_SHARD", (2, 1), "FULL_SHARD"),
        ("NO_SHARD", "NO_SHARD", None, "HYBRID_SHARD(2,1)"),
        ("SHARD_OPTIMIZER", "SHARD_OPTIMIZER", None, "NO_SHARD"),
        ("SHARD_GRAD_OP", "SHARD_GRAD_OP", None, "SHARD_OPTIMIZER"),
        ("HYBRID_SHARD_GRAD_OP(2,1)", "HYBRID_SHARD_GRAD_OP", (2, 1), "SHARD_GRAD_OP"),
    ]
    FOUR_RANKS = [
        *FOUR_RANKS,
        ("HYBRID_SHARD_GRAD_OP(2,2)", "HYBRID_SHARD_GRAD_OP", (2, 2), "NO_SHARD"),
    ]


class Net(nn.Module):
    """BatchNorm -> Linear -> ReLU -> mask -> Linear: running stats that forwards change
    with each rank's data, and a random persistent mask. (A bias right before a
    BatchNorm would get a gradient of rounding noise only, which Adam amplifies.)"""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(FEATURES)
        self.inp = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("mask", (torch.rand(16) > 0.3).float())

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.inp(self.norm(x))) * self.mask)

    def reset_parameters(self) -> None:
        """The mask again (a meta-device init materialises it with each rank's generator)."""
        self.mask.copy_((torch.rand(16) > 0.3).float())


class LitNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


def _batches(rank: int, world_size: int) -> list[tuple[Tensor, Tensor]]:
    """Rank ``rank``'s batches of one epoch (the same every epoch)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCHES * world_size * BATCH, FEATURES, generator=generator)
    y = torch.randn(BATCHES * world_size * BATCH, 4, generator=generator)
    rows = [(j * world_size + rank) * BATCH for j in range(BATCHES)]
    return [(x[r : r + BATCH], y[r : r + BATCH]) for r in rows]


PROBE = torch.linspace(-2, 2, 3 * FEATURES).reshape(3, FEATURES)


def _full_state(module: nn.Module) -> dict[str, np.ndarray]:
    """Full parameters (a collective each), buffers and the probe output (eval mode)."""
    state = {name: full_tensor(p).detach().numpy().copy() for name, p in module.named_parameters()}
    state.update({name: b.detach().numpy().copy() for name, b in module.named_buffers()})
    was_training = module.training
    module.eval()
    with torch.no_grad():
        state["probe"] = module(PROBE).numpy().copy()
    module.train(was_training)
    return state


def _local_state(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


class _Record(Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = _full_state(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = _full_state(pl_module)


def _fit(
    rank: int, world_size: int, mode: str, mesh: Any, epochs: int, seed: int, **fit: Any
) -> tuple[dict[str, np.ndarray], _Record, pl.Trainer]:
    pl.seed_everything(seed + rank)  # a different model on every rank
    model = LitNet()
    built = _local_state(model)
    strategy = MegatronFSDPStrategy(
        timeout=PROCESS_GROUP_TIMEOUT, sharding_strategy=mode, device_mesh=mesh, check_replicas=True
    )
    record = _Record()
    trainer = make_trainer(
        world_size, strategy, max_epochs=epochs, callbacks=[record], use_distributed_sampler=False
    )
    loader = DataLoader(
        TensorDataset(*map(torch.cat, zip(*_batches(rank, world_size), strict=True))), BATCH
    )
    trainer.fit(model, loader, **fit)
    return built, record, trainer


def _trainer_cases(
    rank: int, world_size: int, cases: list[tuple[str, str, Any, str]], root: str
) -> dict[str, Any]:
    """Per case: fit one epoch and save; then every case resumes its partner's checkpoint
    with a fresh model (other seeds) and fits a second epoch."""
    results: dict[str, Any] = {}
    for name, mode, mesh, _ in cases:
        built, record, trainer = _fit(rank, world_size, mode, mesh, 1, 100)
        trainer.save_checkpoint(f"{root}/{name}")
        results[name] = {"built": built, "start": record.start, "end": record.end}
    for name, mode, mesh, partner in cases:
        _, record, trainer = _fit(
            rank, world_size, mode, mesh, 2, 500, ckpt_path=f"{root}/{partner}"
        )
        results[name] |= {"resumed": record.start, "resumed_end": record.end}
    results["check"] = _made_to_differ(rank, trainer.lightning_module.net)
    return results


# ---------------------------------------------------------------------- the reference


def _reference(start: dict[str, np.ndarray], world_sizes: list[int]) -> dict[str, np.ndarray]:
    """One process from ``start``, one epoch per entry of ``world_sizes``: every rank's batch
    per step, gradients averaged, and buffers as DDP keeps them (each forward starts from
    rank 0's; rank 0's updates stay)."""
    model = LitNet()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in start.items() if k != "probe"})
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for world_size in world_sizes:
        ranks = [_batches(r, world_size) for r in range(world_size)]
        for j in range(BATCHES):
            optimizer.zero_grad()
            before = {n: b.clone() for n, b in model.named_buffers()}
            after: dict[str, Tensor] = {}
            for r in range(world_size):
                for n, b in model.named_buffers():
                    b.copy_(before[n])
                x, y = ranks[r][j]
                (F.mse_loss(model(x), y) / world_size).backward()
                if r == 0:
                    after = {n: b.clone() for n, b in model.named_buffers()}
            for n, b in model.named_buffers():
                b.copy_(after[n])
            optimizer.step()
    result = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        result["probe"] = model(PROBE).numpy()
    return result


BUFFERS = {name for name, _ in LitNet().named_buffers()}


def probe_gap(per_rank: list[dict[str, Any]], case: str, key: str) -> float:
    """max |probe(rank r) - probe(rank 0)| over the ranks (the issue's measure)."""
    probes = [r[case][key]["probe"] for r in per_rank]
    return max(float(np.abs(p - probes[0]).max()) for p in probes)


def _assert_ranks_agree(per_rank: list[dict[str, Any]], case: str, key: str) -> None:
    first = per_rank[0][case][key]
    for rank, result in enumerate(per_rank[1:], 1):
        for name, value in result[case][key].items():
            assert np.array_equal(value, first[name]), (
                f"{case}, {key}: rank {rank}'s {name} differs from rank 0's by up to "
                f"{np.abs(value - first[name]).max()}; max |probe(rank r) - probe(rank 0)| = "
                f"{probe_gap(per_rank, case, key)}"
            )


def _assert_close(
    actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], what: str
) -> None:
    for name, value in expected.items():
        np.testing.assert_allclose(
            actual[name], value, rtol=0, atol=ATOL, err_msg=f"{what}: {name}"
        )


def _assert_built_by_sources(
    per_rank: list[dict[str, Any]], case: str, mesh: tuple[int, int] | None
) -> None:
    """Buffers are rank 0's; each parameter row is the one some rank of the first replica
    row built; for NO_SHARD and HSDP (2, 1) every parameter is rank 0's, whole."""
    start = per_rank[0][case]["start"]
    built = [r[case]["built"] for r in per_rank]
    first_row = mesh[1] if mesh is not None else len(per_rank)
    whole = case == "NO_SHARD" or mesh == (2, 1)
    for name, value in start.items():
        if name == "probe":
            continue
        if name in BUFFERS or whole:
            assert np.array_equal(value, built[0][name]), f"{case}: {name} is not rank 0's"
            continue
        rows = value.reshape(value.shape[0], -1)
        for i, values in enumerate(rows):
            sources = [
                r
                for r in range(len(built))
                if np.array_equal(values, built[r][name].reshape(rows.shape)[i])
            ]
            assert sources and min(sources) < first_row, f"{case}: {name} row {i} from {sources}"


def check_cases(
    per_rank: list[dict[str, Any]], cases: list[Any], saved: dict[str, dict[str, Any]]
) -> None:
    """Every assertion of the module docstring for ``cases`` (``saved``: every case's rank-0
    results with its world size, partners included)."""
    world_size = len(per_rank)
    for name, _, mesh, partner in cases:
        for key in ("start", "end", "resumed", "resumed_end"):
            _assert_ranks_agree(per_rank, name, key)
        _assert_built_by_sources(per_rank, name, mesh)
        ours = per_rank[0][name]
        _assert_close(ours["end"], _reference(ours["start"], [world_size]), f"{name} epoch 1")
        source = saved[partner]
        for key, value in source["end"].items():  # the resume restores the saved state
            assert np.array_equal(ours["resumed"][key], value), f"{name} <- {partner}: {key}"
        expected = _reference(source["start"], [source["world_size"], world_size])
        _assert_close(ours["resumed_end"], expected, f"{name} epoch 2 (from {partner})")


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Both launches (2 ranks, then 4 ranks resuming the 2-rank checkpoints)."""
    root = str(tmp_path_factory.mktemp("replicas"))
    two = run_distributed(_trainer_cases, 2, TWO_RANKS, root, timeout=600)
    four = run_distributed(_trainer_cases, 4, FOUR_RANKS, root, timeout=600)
    return {2: two, 4: four}


def test_trainer_replicas_agree_and_train_one_model(
    trainer_runs: dict[int, list[dict[str, Any]]],
) -> None:
    saved = {name: {**trainer_runs[2][0][name], "world_size": 2} for name, *_ in TWO_RANKS}
    saved |= {name: {**trainer_runs[4][0][name], "world_size": 4} for name, *_ in FOUR_RANKS}
    check_cases(trainer_runs[2], TWO_RANKS, saved)
    check_cases(trainer_runs[4], FOUR_RANKS, saved)


# ---------------------------------------------------------------------- Fabric

#: (case name, mode, device mesh, how the model is set up).
FABRIC_CASES: list[tuple[str, str, tuple[int, int] | None, str]] = [
    ("HYBRID_SHARD(2,1) setup_module", "HYBRID_SHARD", (2, 1), "setup_module"),
    ("HYBRID_SHARD(2,1) setup", "HYBRID_SHARD", (2, 1), "setup"),
    ("HYBRID_SHARD(2,1) meta", "HYBRID_SHARD", (2, 1), "meta"),
]
if _megatron.REPLICATED_PARAMETERS:
    FABRIC_CASES.append(("NO_SHARD meta", "NO_SHARD", None, "meta"))


def _fabric_model(rank: int, world_size: int, mode: str, mesh: Any, how: str, seed: int) -> Any:
    strategy = FabricStrategy(
        timeout=PROCESS_GROUP_TIMEOUT, sharding_strategy=mode, device_mesh=mesh, check_replicas=True
    )
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(seed + rank)
    with fabric.init_module(empty_init=how == "meta"):
        net = Net()
    built = _local_state(net) if how != "meta" else None
    if how == "setup":
        model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=LR))
    else:
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    return fabric, net, model, optimizer, built


def _fabric_epoch(fabric: Any, model: Any, optimizer: Any, rank: int, world_size: int) -> None:
    for x, y in _batches(rank, world_size):
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _fabric_cases(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per case: set up, train an epoch, save; a fresh model (other seeds) loads it and
    trains a second epoch."""
    results: dict[str, Any] = {}
    for name, mode, mesh, how in FABRIC_CASES:
        fabric, net, model, optimizer, built = _fabric_model(rank, world_size, mode, mesh, how, 100)
        start = _prefixed(_full_state(net))
        _fabric_epoch(fabric, model, optimizer, rank, world_size)
        end = _prefixed(_full_state(net))
        path = f"{root}/fabric-{name.replace(' ', '-')}"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        fabric, net, model, optimizer, _ = _fabric_model(rank, world_size, mode, mesh, how, 500)
        fabric.load(path, {"model": model, "optimizer": optimizer})
        resumed = _prefixed(_full_state(net))
        _fabric_epoch(fabric, model, optimizer, rank, world_size)
        results[name] = {
            "built": None if built is None else {f"net.{k}": v for k, v in built.items()},
            "start": start,
            "end": end,
            "resumed": resumed,
            "resumed_end": _prefixed(_full_state(net)),
        }
    results["check"] = _made_to_differ(rank, net)
    if importlib.util.find_spec("litgpt") is not None:
        results["litgpt"] = _litgpt_example(rank, world_size)
    return results


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "litgpt_pretrain.py"


def _litgpt_example(rank: int, world_size: int) -> dict[str, Any]:
    """``examples/litgpt_pretrain.py``'s model, seeds, meta init and loader, on HSDP (2, 1):
    two steps, each rank's full state after setup and after them."""
    from litgpt import GPT
    from litgpt.model import Block
    from torchdata.stateful_dataloader import StatefulDataLoader

    spec = importlib.util.spec_from_file_location("litgpt_pretrain", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = example.tiny_config()
    strategy = FabricStrategy(
        timeout=PROCESS_GROUP_TIMEOUT,
        auto_wrap_policy={Block, nn.Embedding, config.norm_class},
        device_mesh=(2, 1),
    )
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(1234 + fabric.global_rank)  # as the example
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(
        StatefulDataLoader(example.RepeatedPatterns(64, config.vocab_size), batch_size=8)
    )

    def state() -> dict[str, np.ndarray]:
        full = {n: full_tensor(p).detach().numpy().copy() for n, p in model.named_parameters()}
        full |= {n: b.detach().numpy().copy() for n, b in model.named_buffers()}
        with torch.no_grad():
            full["probe"] = model(example.PROBE).numpy().copy()
        return full

    result = {"start": state()}
    for _, batch in zip(range(2), loader, strict=False):
        logits = model(batch[:, :-1])
        fabric.backward(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
        optimizer.step()
        optimizer.zero_grad()
    result["end"] = state()
    return result


def _made_to_differ(rank: int, net: nn.Module) -> list[str]:
    """The agreement check's error on this rank when rank 1 alone changes a parameter's
    main weight, then (that undone) a buffer; and that it passes in between."""
    errors = []
    with torch.no_grad():
        for tensor in (net.out.weight.to_local(), net.norm.running_var):
            saved = tensor.clone()
            if rank == 1:
                tensor.add_(1.0)
            try:
                check_replicas(net, "test")
            except ReplicaMismatchError as err:
                errors.append(str(err))
            tensor.copy_(saved)
            check_replicas(net, "test (undone)")
    return errors


def _prefixed(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A bare ``Net``'s state under ``LitNet``'s names (what the reference builds)."""
    return {k if k == "probe" else f"net.{k}": v for k, v in state.items()}


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("fabric-replicas"))
    return run_distributed(_fabric_cases, 2, root, init_process_group=False, timeout=600)


def test_fabric_replicas_agree_and_train_one_model(fabric_runs: list[dict[str, Any]]) -> None:
    per_rank = fabric_runs
    for name, _, mesh, _ in FABRIC_CASES:
        for key in ("start", "end", "resumed", "resumed_end"):
            _assert_ranks_agree(per_rank, name, key)
        if per_rank[0][name]["built"] is not None:
            _assert_built_by_sources(per_rank, name, mesh)
        else:  # meta init: every buffer and parameter is rank 0's materialisation
            assert probe_gap(per_rank, name, "start") == 0
        ours = per_rank[0][name]
        _assert_close(ours["end"], _reference(ours["start"], [2]), f"{name} epoch 1")
        for key, value in ours["end"].items():
            assert np.array_equal(ours["resumed"][key], value), f"{name} resumed: {key}"
        expected = _reference(ours["start"], [2, 2])
        _assert_close(ours["resumed_end"], expected, f"{name} epoch 2")


def test_agreement_check_names_the_first_tensor_and_ranks(
    fabric_runs: list[dict[str, Any]],
) -> None:
    """Every rank raises the same error, naming the tensor, rank 1 and the group's source."""
    parameter, buffer = fabric_runs[0]["check"]
    assert [r["check"] for r in fabric_runs] == [[parameter, buffer]] * 2
    assert re.match(
        r"test: replicated tensors differ: 'out\.weight': rank\(s\) \[1\] hold other values "
        r"than rank 0, the source of replica group \[0, 1\]",
        parameter,
    ), parameter
    assert "'norm.running_var (buffer)': rank(s) [1] hold other values than rank 0" in buffer
    assert "check_replicas=False" in parameter


def test_litgpt_example_replicas_agree(fabric_runs: list[dict[str, Any]]) -> None:
    """The example seeds every rank differently; on HSDP (2, 1) the replicas still agree."""
    if "litgpt" not in fabric_runs[0]:
        pytest.skip("litgpt is not installed: pip install --no-deps litgpt==0.5.13")
    for key in ("start", "end"):
        _assert_ranks_agree(fabric_runs, "litgpt", key)


def test_agreement_check_on_a_2_by_2_mesh(trainer_runs: dict[int, list[dict[str, Any]]]) -> None:
    """HSDP (2, 2): rank 1 is the source of column 1's group, so rank 3 differs there;
    every rank, in both groups, raises the same error."""
    parameter, buffer = trainer_runs[4][0]["check"]
    assert [r["check"] for r in trainer_runs[4]] == [[parameter, buffer]] * 4
    assert "'out.weight': rank(s) [3] hold other values than rank 1, the source of " in parameter
    assert "replica group [1, 3]" in parameter
    assert "'norm.running_var (buffer)': rank(s) [1] hold other values than rank 0" in buffer


def test_check_replicas_option_is_validated() -> None:
    for strategy in (MegatronFSDPStrategy, FabricStrategy):
        assert strategy()._options.check_replicas is False  # the default (benchmarks)
        with pytest.raises(TypeError, match=r"check_replicas must be a bool, got 'yes'"):
            strategy(check_replicas="yes")  # type: ignore[arg-type]
