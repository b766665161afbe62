"""Checkpoints cross megatron-fsdp versions: saved under one, resumed under the other.

A checkpoint records each packed shard at its true rows, computed from megatron-fsdp's
``GlobalLayout``; the layout arithmetic is the same in 0.6.1 and 0.7, so a checkpoint
written under one version must load under the other, bit for bit. Each test trains a bf16
``PackedLM`` (fp32 main weights, Adam) under one version, saves it as the strategy does
(``MegatronFSDPCheckpointIO``), and loads it under the other version into a zero model
through the strategy's own resume call (``restore.load_into_sharded_model``) at another
world size (2 <-> 3 ranks, so the chunks are re-cut). Weights and optimizer state are
reassembled from every rank's shards and compared with ``rtol=0, atol=0`` (bytes), and
the loaded model's logits equal the saved model's (the compute weights were refreshed).

The other version runs in another virtual environment (``LMF_OTHER_PYTHON``, set by
``.ci/run``; see ``tests/cross_version.py``); without it these tests skip locally and
fail under ``CI=true``.
"""

from __future__ import annotations

from pathlib import Path

import megatron_fsdp

from lightning_megatron_fsdp import read_manifest
from tests.cross_version import assert_same_state, other_python, run_other
from tests.scripts.cross_version import run_job


def test_checkpoint_saved_here_resumes_under_the_other_version(tmp_path: Path) -> None:
    python, version = other_python()
    path = tmp_path / "ckpt"
    saved = run_job("save-ours", str(path), 2)
    assert read_manifest(path).versions["megatron_fsdp"] == megatron_fsdp.__version__
    loaded = run_other(python, "load-ours", path, 3, tmp_path / "loaded.pt")
    assert loaded["version"] == version
    assert_same_state(loaded, saved, cross_version=True)


def test_checkpoint_saved_under_the_other_version_resumes_here(tmp_path: Path) -> None:
    python, version = other_python()
    path = tmp_path / "ckpt"
    saved = run_other(python, "save-ours", path, 3, tmp_path / "saved.pt")
    assert saved["version"] == version
    assert read_manifest(path).versions["megatron_fsdp"] == version
    loaded = run_job("load-ours", str(path), 2)
    assert_same_state(loaded, saved, cross_version=True)
