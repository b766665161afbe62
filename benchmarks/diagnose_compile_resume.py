"""Diagnosis (issue 12): why an inductor-compiled run resumed off by 1 ulp at isolated steps.

Not a benchmark with a target: a reproducible experiment whose table benchmarks/RESULTS.md
("torch.compile resume") quotes. The setup is ``tests/test_compile.py``'s, with inductor instead
of ``aot_eager``: a ``PackedLM`` whose 4 identical blocks are sharded and compiled one by
one (``block.compile()``) in ``configure_model``, 2 CPU ranks, the real ``Trainer``,
``StatefulDataLoader``, 6 steps over 3 epochs with a checkpoint after every step. Each
variant trains uninterrupted, then resumes from every checkpoint (steps 1-5) in the same
process, as the test does, and compares every resumed step's loss with the uninterrupted
run's, in units in the last place (ulps of the fp32 loss).

Variants:

* ``ours``: the integration as shipped (one FSDP class per user class, unit hooks run
  eagerly), resumed in the same process; ``ours, fresh process``: the same checkpoints
  resumed in new processes (a new dynamo cache: each compiles again).
* ``eager kernels``: the uninterrupted run with dynamo's ``eager`` backend (the kernels a
  layer runs when dynamo gives up on it), compared step by step with ``ours``.
* ``per-instance classes``: the integration's fix undone (megatron-fsdp's own
  ``ExperimentalFsdp<Name>`` class per module instance, and its hooks traced by dynamo), at
  dynamo's default ``recompile_limit`` (8) and at 64.

Run: ``python -m benchmarks.diagnose_compile_resume`` from the repository root (3-5
minutes on 2 cores; inductor compiles C++ kernels on the first run, cached afterwards).
"""

from __future__ import annotations

import argparse
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.harness import run_distributed

BACKEND = "inductor"
TIMEOUT = 1800.0


def _undo_the_fix() -> None:
    """Per-instance FSDP classes and dynamo-traced unit hooks, as megatron-fsdp builds them."""
    from lightning_megatron_fsdp.megatron import _megatron
    from lightning_megatron_fsdp.megatron._megatron import FsdpModule

    made = iter(range(1 << 30))

    def per_instance(cls: type) -> type:
        return type(f"ExperimentalFsdp{cls.__name__}{next(made)}", (FsdpModule, cls), {})

    _megatron._shared_fsdp_class = per_instance  # type: ignore[assignment]
    _megatron._hide_hooks_from_dynamo = lambda module: None  # type: ignore[assignment]


def _resume_all(world_size: int, root: Path, backend: Any) -> dict[int, dict[int, float]]:
    import tests.test_compile as tc

    resumed = {}
    for start in range(1, tc.STEPS):
        model = tc.CompiledLM(backend)
        checkpoint = root / f"step={start}.ckpt"
        tc._trainer(world_size, root).fit(model, tc._loader(), ckpt_path=checkpoint)
        resumed[start] = {step: loss.item() for step, loss in model.losses.items()}
    return resumed


def _variant(
    rank: int,
    world_size: int,
    root: str,
    undo: bool,
    limit: int | None,
    train: bool,
    backend: str = BACKEND,
) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch._dynamo.testing import CompileCounterWithBackend

    import tests.test_compile as tc

    if undo:
        _undo_the_fix()
    if limit is not None:
        torch._dynamo.config.recompile_limit = limit
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    facts: dict[str, Any] = {}
    if train:
        saver = ModelCheckpoint(
            dirpath=Path(root), filename="{step}", every_n_train_steps=1, save_top_k=-1
        )
        full = tc.CompiledLM(counter)
        trainer = tc._trainer(world_size, Path(root), callbacks=[saver], enable_checkpointing=True)
        trainer.fit(full, tc._loader())
        facts["full"] = {step: loss.item() for step, loss in full.losses.items()}
    resume = backend == BACKEND
    facts["resumed"] = _resume_all(world_size, Path(root), counter) if resume else {}
    facts["frames"] = counter.frame_count
    facts["limit"] = torch._dynamo.config.recompile_limit
    return facts


def _ulps(a: float, b: float) -> int:
    def bits(x: float) -> int:
        return struct.unpack("<i", struct.pack("<f", x))[0]

    return bits(a) - bits(b)


def _row(name: str, results: list[dict[str, Any]], full: list[dict[int, float]]) -> str:
    compared = off = worst = 0
    where = []
    for rank, facts in enumerate(results):
        for start, losses in facts["resumed"].items():
            for step, loss in losses.items():
                ulps = _ulps(loss, full[rank][step])
                compared += 1
                if ulps:
                    off += 1
                    worst = max(worst, abs(ulps))
                    where.append(f"r{rank} from {start}: step {step} {ulps:+d}")
    frames = results[0]["frames"]
    return (
        f"| {name} | {results[0]['limit']} | {frames} | {compared} | {off} | {worst} | "
        f"{'; '.join(where) or '-'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    rows = [
        "| variant | recompile_limit | frames compiled (rank 0) | resumed steps compared "
        "| steps off | max ulps | where (rank, resumed from, step, ulps) |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        variants = [
            ("ours", False, None),
            ("per-instance classes", True, None),
            ("per-instance classes", True, 64),
        ]
        for index, (name, undo, limit) in enumerate(variants):
            root = str(Path(tmp, f"v{index}"))
            results = run_distributed(
                _variant, 2, root, undo, limit, True, init_process_group=False, timeout=TIMEOUT
            )
            full = [r["full"] for r in results]
            if index == 0:
                ours = full
            rows.append(_row(name, results, full))
            print(rows[-1], flush=True)
            if index == 0:
                fresh = run_distributed(
                    _variant, 2, root, False, None, False, init_process_group=False,
                    timeout=TIMEOUT,
                )  # fmt: skip
                rows.append(_row("ours, fresh process", fresh, full))
                print(rows[-1], flush=True)
        # The mechanism: dynamo's "eager" backend (eager kernels) against inductor's.
        eager = run_distributed(
            _variant, 2, str(Path(tmp, "eager")), False, None, True, "eager",
            init_process_group=False, timeout=TIMEOUT,
        )  # fmt: skip
        for facts in eager:
            facts["resumed"] = {0: facts["full"]}
        rows.append(_row("eager kernels, uninterrupted (vs ours)", eager, ours))
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
