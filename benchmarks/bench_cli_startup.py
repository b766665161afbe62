"""Wall time of the offline console script against a bare ``import torch``.

The offline tools need neither Lightning nor megatron-fsdp, and ``inspect`` not even
``torch.distributed.checkpoint``, so ``inspect`` of a small checkpoint should cost about an
interpreter that imports torch. Each row is the median (and min-max) of ``--repeats`` fresh
interpreters, all rows interleaved in rotating order so a busy machine slows them alike,
with the median CPU seconds (user plus system), which time spent waiting for a busy
machine's cores does not inflate.
``--tree`` (repeatable) runs the library of other checkouts (e.g. an export of an older
commit) in the same rotation, for a before/after comparison. It also reports whether any
command printed a third-party warning (megatron's "Transformer Engine and Apex are not
installed").

    python -m benchmarks.bench_cli_startup CHECKPOINT_DIR [--repeats 5] [--tree PATH ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_SCRIPT = (
    "import sys; sys.argv = ['lightning-megatron-fsdp', *sys.argv[1:]]; "
    "from lightning_megatron_fsdp.tools.cli import main; sys.exit(main())"
)


def _commands(checkpoint: str, scratch: str) -> dict[str, list[str]]:
    return {
        "inspect": ["-c", _SCRIPT, "inspect", checkpoint],
        "inspect --verify": ["-c", _SCRIPT, "inspect", "--verify", checkpoint],
        "consolidate": [
            "-c",
            _SCRIPT,
            "consolidate",
            checkpoint,
            os.path.join(scratch, "out.pt"),
            "--overwrite",
        ],
        "export-lightning": [
            "-c",
            _SCRIPT,
            "export-lightning",
            checkpoint,
            os.path.join(scratch, "out.ckpt"),
            "--overwrite",
        ],
    }


def _children_cpu() -> float:
    """User plus system CPU seconds of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--tree", action="append", default=None, help="checkout whose library to run (repeatable)"
    )
    args = parser.parse_args()
    trees = args.tree or [os.getcwd()]
    with tempfile.TemporaryDirectory() as scratch:
        commands = _commands(os.path.abspath(args.checkpoint), scratch)
        # (row name, working directory, interpreter arguments)
        runs = [("python -c 'import torch'", os.getcwd(), ["-c", "import torch"])]
        for tree in trees:
            label = f" [{tree}]" if len(trees) > 1 else ""
            runs += [(name + label, tree, argv) for name, argv in commands.items()]
        times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        cpu: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        warned: dict[str, bool] = dict.fromkeys(times, False)
        for repeat in range(args.repeats):
            shift = repeat % len(runs)
            for name, cwd, argv in runs[shift:] + runs[:shift]:
                used = _children_cpu()
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, *argv], cwd=cwd, capture_output=True, text=True
                )
                times[name].append(time.perf_counter() - start)
                cpu[name].append(_children_cpu() - used)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
                warned[name] |= "Warning" in done.stderr
    libraries = ", ".join(str(Path(tree) / "lightning_megatron_fsdp") for tree in trees)
    print(f"library: {libraries}; load average {os.getloadavg()}")
    print(
        "| command | median s | min-max s | median CPU s | third-party warning |\n"
        "|---|---|---|---|---|"
    )
    for name, values in times.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} "
            f"| {statistics.median(cpu[name]):.2f} | {'yes' if warned[name] else 'no'} |"
        )


if __name__ == "__main__":
    main()
