"""Find and drive the *other* megatron-fsdp interpreter for cross-version tests.

CI builds two virtual environments, one with megatron-fsdp 0.6.1 and one with the 0.7
snapshot, and runs the suite in each with ``LMF_OTHER_PYTHON`` naming the other one's
Python (see ``.ci/run``). A cross-version test runs one side of a round trip in the
pytest process and the other side through :func:`run_other`.

Without ``LMF_OTHER_PYTHON`` the tests skip with the reason, except when ``CI`` is
truthy (``tests/ci.py``), where a missing or unusable interpreter
fails them: CI must never pass by skipping.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import megatron_fsdp
import torch

from tests.ci import skip_or_fail
from tests.harness import THIRD_PARTY_WARNINGS
from tests.models import PackedLM
from tests.shard_facts import assemble, same_bits

__all__ = [
    "ENV_VAR",
    "OtherSide",
    "assert_same_state",
    "other_python",
    "run_other",
    "run_other_side",
]

ENV_VAR = "LMF_OTHER_PYTHON"
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
STATES = ("exp_avg", "exp_avg_sq", "step")


def _unavailable(reason: str) -> None:
    skip_or_fail(f"{reason}; .ci/run must set {ENV_VAR}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # Only the named third-party warnings are silenced: ours show in a failure's output.
    env["PYTHONWARNINGS"] = THIRD_PARTY_WARNINGS
    return env


@functools.cache
def other_python() -> tuple[str, str]:
    """The other interpreter and its megatron-fsdp version (which must differ from ours).

    Skips (or fails when ``CI`` is truthy) if ``LMF_OTHER_PYTHON`` is unset or unusable.
    """
    python = os.environ.get(ENV_VAR)
    if not python:
        _unavailable(f"{ENV_VAR} is not set (the Python of a venv with the other megatron-fsdp)")
    assert python is not None
    try:
        probe = subprocess.run(
            [python, "-c", "import megatron_fsdp; print(megatron_fsdp.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=_env(),
        )
    except OSError as err:
        _unavailable(f"{ENV_VAR}={python} cannot run: {err}")
        raise
    if probe.returncode != 0:
        _unavailable(f"{ENV_VAR}={python} cannot import megatron_fsdp: {probe.stderr[-500:]}")
    version = probe.stdout.strip()
    assert version != megatron_fsdp.__version__, (
        f"{ENV_VAR}={python} has megatron-fsdp {version}, the same as this interpreter "
        f"({sys.executable}): a cross-version test would compare a version with itself. "
        "Point it at the other virtual environment."
    )
    return python, version


def run_other(python: str, jobs: list[tuple[str, Path, int, Path]]) -> list[dict[str, Any]]:
    """Run ``tests.scripts.cross_version`` jobs ``(job, checkpoint dir, world size, out
    file)`` in order under ``python``, in one interpreter; each job's result."""
    argv = [str(part) for spec in jobs for part in spec]
    done = subprocess.run(
        [python, "-m", "tests.scripts.cross_version", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
        env=_env(),
    )
    names = ", ".join(job for job, *_ in jobs)
    assert done.returncode == 0, (
        f"{names} under {python} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-6000:]}"
    )
    return [torch.load(out, weights_only=True) for *_, out in jobs]


@dataclasses.dataclass(frozen=True)
class OtherSide:
    """Everything the cross-version tests need from the other interpreter, made in one run.

    Attributes:
        version: The other interpreter's megatron-fsdp version.
        saved_here: :func:`~tests.scripts.cross_version.save_ours` on 2 ranks here.
        loaded_there: That checkpoint loaded on 3 ranks by the other interpreter.
        saved_there_path: A ``save_ours`` checkpoint the other interpreter wrote on 3 ranks.
        saved_there: What its ranks held.
        upstream_path: A megatron-fsdp ``save_checkpoint`` directory (2 ranks) the other
            interpreter wrote, when this one has no ``save_checkpoint``; else ``None``.
        upstream_saved: What its ranks held (``None`` with ``upstream_path``).
    """

    version: str
    saved_here: dict[str, Any]
    loaded_there: dict[str, Any]
    saved_there_path: Path
    saved_there: dict[str, Any]
    upstream_path: Path | None
    upstream_saved: dict[str, Any] | None


def run_other_side(root: Path) -> OtherSide:
    """Save here, then load that, save ours and (0.6.1 only) save megatron's format there."""
    from tests.scripts.cross_version import run_job

    python, version = other_python()
    here = root / "saved-here"
    saved_here = run_job("save-ours", str(here), 2)
    jobs = [
        ("load-ours", here, 3, root / "loaded-there.pt"),
        ("save-ours", root / "saved-there", 3, root / "saved-there.pt"),
    ]
    upstream = importlib.util.find_spec("megatron_fsdp.experimental.checkpoint") is None
    if upstream:
        jobs.append(("save-upstream", root / "upstream", 2, root / "upstream.pt"))
    results = run_other(python, jobs)
    return OtherSide(
        version=version,
        saved_here=saved_here,
        loaded_there=results[0],
        saved_there_path=root / "saved-there",
        saved_there=results[1],
        upstream_path=root / "upstream" if upstream else None,
        upstream_saved=results[2] if upstream else None,
    )


def assert_same_state(got: dict[str, Any], want: dict[str, Any], *, cross_version: bool) -> None:
    """Two ``tests.scripts.cross_version`` results hold the same model and Adam state.

    Full tensors are reassembled from every rank's shards (each row exactly once) and
    compared bit for bit (``rtol=0, atol=0``); non-tensor values by equality; every
    rank's logits on the probe batch equal the saving side's.

    Args:
        got: The loading side.
        want: The saving side.
        cross_version: The two sides must have run different megatron-fsdp versions.
    """
    if cross_version:
        assert got["version"] != want["version"], "both sides ran the same megatron-fsdp"
    got_full = assemble([rank["state"] for rank in got["ranks"]])
    want_full = assemble([rank["state"] for rank in want["ranks"]])
    assert got_full.keys() == want_full.keys(), sorted(set(got_full) ^ set(want_full))
    for key, value in want_full.items():
        if isinstance(value, torch.Tensor):
            assert same_bits(got_full[key], value), f"{key}: differs after the round trip"
        else:
            assert got_full[key] == value, f"{key}: {got_full[key]!r} != {value!r}"
    # Not vacuous: every parameter, and its exp_avg, exp_avg_sq and step, was compared.
    for name, _ in PackedLM().named_parameters():
        for key in (
            f"state_dict/{name}",
            *(f"optimizer_states/0/state/{name}/{state}" for state in STATES),
        ):
            assert isinstance(want_full.get(key), torch.Tensor), f"{key} was not compared"
    assert want_full["state_dict/embed.weight"].abs().sum() > 0
    reference = want["ranks"][0]["logits"]
    for rank in got["ranks"]:
        assert same_bits(rank["logits"], reference), "logits differ: compute weights stale?"
