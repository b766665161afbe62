"""``consolidate`` and ``export-lightning`` stream: their peak memory is near the largest
tensor, not the model (the README's claim, measured).

Two gloo ranks save a model of ten 8 MiB weights (80 MiB, plus twice that in Adam state)
through ``MegatronFSDPCheckpointIO``, and a tiny one. Each export runs in a fresh
interpreter: it first exports the tiny checkpoint the same way (so lazy imports and
one-time buffers are paid before measuring), resets its resident-set high-water mark
(``/proc/self/clear_refs``), exports the large one and reports ``VmHWM`` minus the
resident set at the reset: the memory the export added at its peak. glibc's mmap
threshold is pinned (``MALLOC_MMAP_THRESHOLD_``) so each large tensor is mapped and
unmapped rather than recycled inside the heap, where the resident set would not show it.
The peak must stay within 2x the largest tensor (holding the model would take 80 MiB, the
optimizer state 160 MiB more), and reach at least half of it: the measurement sees the
one full tensor a streaming export holds. The outputs are checked against the saved
weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    ensure_optimizer_state,
    fsdp_placements,
    shard_module,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from tests.harness import THIRD_PARTY_WARNINGS, run_distributed

MIB = 1 << 20
WIDTH = 1448  # 1448 x 1448 fp32 = 7.998 MiB per weight
LAYERS = 10
LARGEST = WIDTH * WIDTH * 4
BOUND = 2 * LARGEST

_CHILD = r"""
import json, sys
from pathlib import Path
import torch
from lightning_megatron_fsdp import consolidate_checkpoint, export_lightning_checkpoint

def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

def export(checkpoint, output, optimizer):
    if output.endswith(".ckpt"):
        export_lightning_checkpoint(checkpoint, output, optimizer=optimizer)
    else:
        consolidate_checkpoint(checkpoint, output)

checkpoint, tiny, output, optimizer = sys.argv[1:4] + [sys.argv[4] == "true"]
export(tiny, str(Path(output).with_name("warm-up" + Path(output).suffix)), optimizer)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
baseline = rss("VmRSS")
export(checkpoint, output, optimizer)
print(json.dumps({"added": rss("VmHWM") - baseline}))
"""


def _model(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))


def _save(rank: int, world_size: int, directory: str, width: int) -> None:
    from lightning_megatron_fsdp.megatron._megatron import fully_shard_optimizer

    enable_cpu_execution()
    torch.manual_seed(0)
    model = _model(width)
    shard_module(model, init_device_mesh("cpu", (world_size,)), fsdp_placements())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    fully_shard_optimizer(optimizer)
    ensure_optimizer_state(optimizer)
    model_sd = get_model_state_dict(model)
    optimizer_sd = get_optimizer_state_dict(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_sd, optimizer_sd)
    checkpoint = {"state_dict": model_sd, "optimizer_states": [optimizer_sd], "global_step": 0}
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, directory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export_memory")
    run_distributed(_save, 2, str(root / "checkpoint"), WIDTH, timeout=300)
    run_distributed(_save, 2, str(root / "tiny"), 8, timeout=300)
    return root / "checkpoint"


def _added(checkpoint: Path, output: Path, optimizer: bool) -> int:
    tiny = checkpoint.with_name("tiny")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(checkpoint),
            str(tiny),
            str(output),
            str(optimizer).lower(),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={
            **os.environ,
            "PYTHONWARNINGS": THIRD_PARTY_WARNINGS,
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),  # glibc's default, not raised on free
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(json.loads(result.stdout.strip().splitlines()[-1])["added"])


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (clear_refs, VmHWM)"
)
@pytest.mark.parametrize(
    ("name", "optimizer"),
    [("model.safetensors", False), ("model.pt", False), ("model.ckpt", False), ("full.ckpt", True)],
)
def test_export_peak_memory_is_near_the_largest_tensor(
    saved: Path, tmp_path: Path, name: str, optimizer: bool
) -> None:
    output = tmp_path / name
    added = _added(saved, output, optimizer)
    assert LARGEST // 2 <= added <= BOUND, (
        f"{name}: the export added {added / MIB:.1f} MiB at its peak; the largest tensor is "
        f"{LARGEST / MIB:.1f} MiB (bound {BOUND / MIB:.1f} MiB; the model: "
        f"{LAYERS * LARGEST / MIB:.0f} MiB)"
    )
    # A real export of every weight, bit-exact (the streamed path, not an empty file).
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        weights = load_file(output)
    else:
        weights = torch.load(output, weights_only=True)
        weights = weights.get("state_dict", weights)
    torch.manual_seed(0)
    reference = _model().state_dict()
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)
    if optimizer:
        assert len(torch.load(output, weights_only=True)["optimizer_states"][0]["state"]) == LAYERS
