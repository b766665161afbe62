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
fail when ``CI`` is truthy (``1``, ``true``, ``yes``, any case).
"""

from __future__ import annotations

import megatron_fsdp
import pytest

from lightning_megatron_fsdp import read_manifest
from tests.cross_version import ENV_VAR, OtherSide, assert_same_state, other_python
from tests.scripts.cross_version import run_job


def test_checkpoint_saved_here_resumes_under_the_other_version(other_side: OtherSide) -> None:
    saved = other_side.saved_here
    assert saved["version"] == megatron_fsdp.__version__
    loaded = other_side.loaded_there
    assert loaded["version"] == other_side.version
    assert_same_state(loaded, saved, cross_version=True)


def test_checkpoint_saved_under_the_other_version_resumes_here(other_side: OtherSide) -> None:
    path, saved = other_side.saved_there_path, other_side.saved_there
    assert saved["version"] == other_side.version
    assert read_manifest(path).versions["megatron_fsdp"] == other_side.version
    loaded = run_job("load-ours", str(path), 2)
    assert_same_state(loaded, saved, cross_version=True)


def _without_interpreter(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> type:
    """The exception ``other_python()`` raises with ``CI`` set to ``ci`` (``None``: unset)
    and no other interpreter named; it must say that the variable is not set."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.delenv(ENV_VAR, raising=False)
    other_python.cache_clear()
    try:
        with pytest.raises(BaseException, match=f"{ENV_VAR} is not set") as outcome:
            other_python()
    finally:
        other_python.cache_clear()
    return outcome.type


@pytest.mark.parametrize("value", ["1", "true", "True", "TRUE", "yes", "Yes", " on "])
def test_a_truthy_ci_fails_instead_of_skipping(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """CI services set ``CI=true`` or ``CI=1``; either must make a missing other interpreter
    fail the run, never skip (``CI=1`` used to skip silently)."""
    assert _without_interpreter(monkeypatch, value) is pytest.fail.Exception  # not a skip


@pytest.mark.parametrize("value", [None, "", "0", "false", "no"])
def test_outside_ci_a_missing_interpreter_skips(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    assert _without_interpreter(monkeypatch, value) is pytest.skip.Exception
