"""megatron-fsdp's own checkpoint format loads through ours, and ``inspect`` recognises it.

megatron-fsdp 0.7 adds ``megatron_fsdp.experimental.checkpoint.save_checkpoint(model,
optimizer, dir)``: a DCP directory with keys ``model.<fqn>`` and
``optimizer.state.<fqn>.<name>`` and megatron's gather-based chunk metadata, no manifest.
Here a 2-rank run (``PackedLM``: uneven packing, a tie, nested units; Adam after two
steps) saves with it, on CPU through our adapter and sharding context, and:

* ``load_full_weights`` fills a zero model *and* a fresh Adam on 3 ranks, bit for bit;
* ``MegatronFSDPStrategy(init_weights_from=PretrainedWeights(dir, add_prefix="lm."))``
  starts a 2-rank ``Trainer`` run from its weights;
* ``lightning-megatron-fsdp inspect`` names the format and ``--verify`` passes it;
* a plain ``dcp.save`` whose keys merely start with ``model.`` is not mistaken for it.

Under megatron-fsdp 0.6.1, which has no ``save_checkpoint``, the 0.7 interpreter of
``LMF_OTHER_PYTHON`` writes the directory, so the reading side is tested on 0.6.1 too
(see ``tests/cross_version.py``: skipped locally without it, failed when ``CI`` is truthy).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import megatron_fsdp
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_megatron_fsdp import PretrainedWeights, inspect_checkpoint, verify_checkpoint
from lightning_megatron_fsdp.storage.upstream_checkpoint import (
    UPSTREAM_FORMAT_NAME,
    UPSTREAM_NOTE,
    internal_keys,
    is_upstream_checkpoint,
)
from lightning_megatron_fsdp.tools.cli import main as cli_main
from tests.cross_version import OtherSide, assert_same_state
from tests.harness import run_distributed
from tests.scripts.cross_version import run_job
from tests.shard_facts import assemble
from tests.test_portability import (
    AtTrainStart,
    PackedLit,
    make_trainer,
    megatron_strategy,
    train_loader,
)
from tests.test_portability import (
    assemble as assemble_numpy,
)

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

HAS_SAVE_CHECKPOINT = importlib.util.find_spec("megatron_fsdp.experimental.checkpoint") is not None


@pytest.fixture(scope="module")
def upstream_save(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, dict[str, Any]]:
    """A ``save_checkpoint`` directory written on 2 ranks, and what the ranks held."""
    if not HAS_SAVE_CHECKPOINT:  # 0.6.1: the other interpreter (0.7) wrote it
        other: OtherSide = request.getfixturevalue("other_side")
        assert other.upstream_path is not None and other.upstream_saved is not None
        assert other.upstream_saved["version"] != megatron_fsdp.__version__
        return other.upstream_path, other.upstream_saved
    path = tmp_path_factory.mktemp("upstream") / "ckpt"
    return path, run_job("save-upstream", str(path), 2)


def test_load_full_weights_reads_weights_and_optimizer_state(
    upstream_save: tuple[Path, dict[str, Any]],
) -> None:
    path, saved = upstream_save
    loaded = run_job("load-full-weights", str(path), 3)
    assert_same_state(loaded, saved, cross_version=not HAS_SAVE_CHECKPOINT)
    for rank in loaded["ranks"]:
        result = rank["result"]
        assert result["kind"] == "dcp" and result["optimizers"] == 1
        assert result["missing"] == () and result["unexpected"] == ()
        assert {"embed.weight", "head.weight", "head.bias"} <= set(result["loaded"])


def _init_from_upstream(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = PackedLit(seed=None)
    start = AtTrainStart()
    weights = PretrainedWeights(path, add_prefix="lm.", strict=False)  # no "temperature"
    trainer = make_trainer(
        world_size, megatron_strategy(init_weights_from=weights), max_steps=1, callbacks=[start]
    )
    trainer.fit(model, train_loader(world_size))
    return {"params": start.params}


def test_init_weights_from_starts_a_trainer_run(
    upstream_save: tuple[Path, dict[str, Any]],
) -> None:
    path, saved = upstream_save
    results = run_distributed(
        _init_from_upstream, 2, str(path), init_process_group=False, timeout=240
    )
    started = assemble_numpy([r["params"] for r in results])
    full = assemble([rank["state"] for rank in saved["ranks"]])
    expected = {
        f"lm.{key.removeprefix('state_dict/')}": value.numpy()
        for key, value in full.items()
        if key.startswith("state_dict/")
    }
    expected["lm.head.weight"] = expected["lm.embed.weight"]  # the tie, saved once
    expected["temperature"] = np.array([3.0], dtype=np.float32)  # not in the source: kept
    assert sorted(started) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(started[name], value, err_msg=name)


def test_inspect_and_verify_recognise_the_format(
    upstream_save: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = upstream_save
    info = inspect_checkpoint(path)
    assert info.source_format == UPSTREAM_FORMAT_NAME and info.manifest is None
    assert info.notes == (UPSTREAM_NOTE,)
    keys = {t.key for t in info.tensors}
    assert {"model.embed.weight", "optimizer.state.embed.weight.exp_avg"} <= keys
    assert "optimizer.param_groups.0.lr" in info.objects
    assert verify_checkpoint(path) == []

    assert cli_main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == UPSTREAM_FORMAT_NAME and data["notes"] == [UPSTREAM_NOTE]
    assert cli_main(["inspect", str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"format       {UPSTREAM_FORMAT_NAME}\n" in out
    assert f"verify: OK ({UPSTREAM_FORMAT_NAME}: no manifest.json" in out

    # A damaged one still fails: the format excuses the missing manifest, not lost data.
    shard = next(path.glob("*.distcp"))
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[: len(original) // 2])
        problems = verify_checkpoint(path)
        assert problems and shard.name in problems[0], problems
        assert cli_main(["inspect", str(path), "--verify"]) == 1
    finally:
        shard.write_bytes(original)


def test_key_mapping_and_plain_state_dicts_are_not_mistaken(tmp_path: Path) -> None:
    """A module with a child ``model`` saved with plain ``dcp.save`` has ``model.`` keys
    too, but one-part planner paths: it stays a plain state dict."""
    plain = {"model.layer.weight": torch.ones(2, 3), "head.bias": torch.zeros(3)}
    dcp.save(plain, checkpoint_id=tmp_path / "plain")
    assert not is_upstream_checkpoint(FileSystemReader(str(tmp_path / "plain")).read_metadata())
    assert inspect_checkpoint(tmp_path / "plain").source_format is None

    nested = {
        "model": {"layer.weight": torch.ones(2, 3)},
        "optimizer": {"state": {"layer.weight": {"exp_avg": torch.zeros(2, 3)}}},
    }
    dcp.save(nested, checkpoint_id=tmp_path / "nested")
    metadata = FileSystemReader(str(tmp_path / "nested")).read_metadata()
    assert is_upstream_checkpoint(metadata)
    assert internal_keys(metadata) == {
        "layer.weight": "model.layer.weight",
        "optimizer_states.0.state.layer.weight.exp_avg": "optimizer.state.layer.weight.exp_avg",
    }
    # Optimizer state alone is not a model checkpoint.
    dcp.save({"optimizer": nested["optimizer"]}, checkpoint_id=tmp_path / "optimizer_only")
    only = FileSystemReader(str(tmp_path / "optimizer_only")).read_metadata()
    assert not is_upstream_checkpoint(only)
