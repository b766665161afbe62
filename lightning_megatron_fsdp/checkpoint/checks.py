"""Checks a load runs before any rank reads tensor data, and the one error every rank raises.

Problem: a checkpoint that does not fit the model (keys, shapes, dtypes) or whose files were
damaged must be refused on every rank, before any tensor is read, with one error that says
everything at once; after a failure part-way through reading, every rank must say what was
already written into the model.

How: each rank compares the manifest's fingerprint with its load targets and collects
problems (kind, text); the ranks agree on them through the one agreement helper
(:meth:`~lightning_megatron_fsdp.agreement.Ranks.agree`), and every rank raises the class of
the most fundamental kind found, with a one-line summary first and the full list after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_megatron_fsdp.agreement import Problem, Ranks
from lightning_megatron_fsdp.checkpoint.format import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    Manifest,
    NotACheckpointError,
    compare_fingerprints,
    model_fingerprint,
    optimizer_fingerprint,
)
from lightning_megatron_fsdp.checkpoint.storage import (
    ReadProgress,
)

# Problem kinds of a load, most fundamental first; the first kind present picks the error.
_LOAD_ERRORS: tuple[type[Exception], ...] = (
    TypeError,
    NotACheckpointError,
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointError,  # meta.pt does not unpickle
)


def _state_shape_error(state: Any) -> str | None:
    if not isinstance(state, Mapping) or not isinstance(state.get("state_dict"), Mapping):
        return (
            "state must be {'state_dict': model_state_dict, 'optimizer_states': [...]} "
            f"(optimizer_states optional), got {state!r:.200}"
        )
    optimizers = state.get("optimizer_states", [])
    if not isinstance(optimizers, (list, tuple)) or not all(
        isinstance(o, Mapping) for o in optimizers
    ):
        return (
            "state['optimizer_states'] must be a list of optimizer state dicts, got "
            f"{optimizers!r:.200}"
        )
    return None


def _fingerprint_problems(manifest: Manifest, state: Mapping[str, Any], strict: bool) -> list[str]:
    problems = compare_fingerprints(
        manifest.fingerprint, model_fingerprint(state["state_dict"]), what="model", strict=strict
    )
    if "optimizer_states" not in state:
        return problems
    targets, saved = state["optimizer_states"], manifest.optimizer_fingerprints
    if targets and not saved:
        problems.append(
            f"the checkpoint holds no optimizer state (it was saved weights-only), but "
            f"{len(targets)} optimizer state dict(s) were given to fill. Load weights only: "
            "leave 'optimizer_states' out of state (the strategy's weights-only load)."
        )
    elif len(targets) != len(saved):
        problems.append(
            f"the checkpoint holds state for {len(saved)} optimizer(s), but {len(targets)} "
            "optimizer state dict(s) were given; configure the same optimizers as when saving"
        )
    else:
        for i, (fingerprint, target) in enumerate(zip(saved, targets, strict=True)):
            problems += compare_fingerprints(
                fingerprint, optimizer_fingerprint(target), what=f"optimizer {i}", strict=strict
            )
    return problems


def agree_before_reading(comm: Ranks, final: Path, problems: list[tuple[int, str]]) -> None:
    """Raise, identically on every rank, the problems all ranks found; else return.

    Through the one agreement helper (:meth:`~lightning_megatron_fsdp.agreement.Ranks.agree`):
    a summary line first, then every problem with the ranks that saw it where not all did,
    then what to do. Nothing has been read at this point, so every error says so.

    Args:
        comm: The ranks of the load.
        final: The checkpoint.
        problems: This rank's ``(kind, text)`` problems; the kind indexes ``_LOAD_ERRORS``.

    Raises:
        TypeError | NotACheckpointError | CheckpointCorruptedError | CheckpointMismatchError
        | CheckpointError: The class of the most fundamental problem kind found;
            ``CheckpointError`` also when the ranks could not agree (a lost peer).
    """
    comm.agree(
        [Problem(kind, text) for kind, text in problems],
        heading=f"Cannot load checkpoint {final}",
        errors=dict(enumerate(_LOAD_ERRORS)),
        advice={cls: text.format(final=final) for cls, text in _LOAD_ADVICE.items()},
        lost_peer_error=CheckpointError,
    )


def _aftermath(final: Path, states: list[dict[str, Any] | None]) -> str:
    """What the targets hold after a failed in-place load, from each rank's reader
    progress (``None``: unknown, another reader or a lost rank)."""
    if all(s is not None and not s["started"] for s in states):
        return (
            "Nothing was loaded: no rank had begun reading tensor data. The targets are unchanged."
        )
    lines = []
    for rank, state in enumerate(states):
        if state is None:
            lines.append(f"  rank {rank}: unknown (another storage reader, or the rank was lost)")
        else:
            progress = ReadProgress(**state)
            lines.append(f"  rank {rank}: {progress.describe()}")
    verb = "may be" if any(state is None for state in states) else "are"
    return (
        f"The targets {verb} partly loaded (atomic_load=False): each rank's reader wrote "
        "records into its targets in order, and the rest keep their previous values:\n"
        + "\n".join(lines)
        + f"\nLoad {final} again once it is intact, or another complete checkpoint, before "
        "training on (atomic_load=True keeps the targets unchanged on any failure, for one "
        "more copy of the shards in memory)."
    )


# What to do, by error class; every load error leaves the targets untouched.
_LOAD_ADVICE: dict[type[Exception], str] = {
    CheckpointCorruptedError: (
        "Nothing was loaded. The files differ from what the save recorded: load an older "
        "complete checkpoint, or restore these files from an intact copy (check it offline "
        "with `lightning-megatron-fsdp inspect --verify {final}`)."
    ),
    CheckpointMismatchError: (
        "Nothing was loaded. Build the model and optimizers the checkpoint was saved from "
        "(strict=False tolerates missing and unexpected keys, not other shapes or dtypes)."
    ),
    CheckpointError: "Nothing was loaded: no rank had read tensor data; the targets are unchanged.",
}
