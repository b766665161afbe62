"""Wall time of the offline console script against a bare ``import torch``.

The offline tools need neither Lightning nor megatron-fsdp, so ``inspect`` of a small
checkpoint should cost about an interpreter that imports torch. Each row is the median
(and min-max) of ``--repeats`` fresh interpreters, the rows interleaved in rotating order
so a busy machine slows them alike. ``--tree`` runs the library of another checkout (e.g.
a worktree of an older commit) for a before/after comparison. It also reports whether any
command printed a third-party warning (megatron's "Transformer Engine and Apex are not
installed").

    python -m benchmarks.bench_cli_startup CHECKPOINT_DIR [--repeats 5] [--tree PATH]
"""

from __future__ import annotations

import argparse
import os
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
        "python -c 'import torch'": ["-c", "import torch"],
        "inspect": ["-c", _SCRIPT, "inspect", checkpoint],
        "inspect --verify": ["-c", _SCRIPT, "inspect", "--verify", checkpoint],
        "export-lightning": [
            "-c",
            _SCRIPT,
            "export-lightning",
            checkpoint,
            os.path.join(scratch, "out.ckpt"),
            "--overwrite",
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", default=None, help="checkout whose library to run")
    args = parser.parse_args()
    cwd = args.tree or os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        commands = _commands(os.path.abspath(args.checkpoint), scratch)
        times: dict[str, list[float]] = {name: [] for name in commands}
        warned: dict[str, bool] = dict.fromkeys(commands, False)
        names = list(commands)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, *commands[name]], cwd=cwd, capture_output=True, text=True
                )
                times[name].append(time.perf_counter() - start)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
                warned[name] |= "Warning" in done.stderr
    print(f"library: {Path(cwd) / 'lightning_megatron_fsdp'}; load average {os.getloadavg()}")
    print("| command | median s | min-max s | third-party warning |\n|---|---|---|---|")
    for name, values in times.items():
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} "
            f"| {'yes' if warned[name] else 'no'} |"
        )


if __name__ == "__main__":
    main()
