"""Run a script as many fresh processes without paying its imports each time.

``python script.py`` spends most of a short run importing torch, Lightning and
megatron-fsdp (about 9 CPU-seconds per process on a 2-core CI machine); a test that must
start the same script 40 times pays that 40 times. Here one *zygote* process imports
them once, then forks a child per run. Each child is a complete OS process that runs the
script as ``__main__`` (``runpy.run_path``, with its own ``sys.argv``, environment and
output file) and then leaves exactly as ``python script.py`` does: through the
interpreter's normal finalisation (``atexit`` hooks, thread joins, module teardown),
with exit code 0, 1 for an uncaught exception, or the signal that killed it. That is the
part the exit tests are about, so it must not be skipped: ``multiprocessing``'s children,
by contrast, end with ``os._exit`` and never finalise.

Protocol: the zygote reads one JSON request per line on stdin
(``{"script", "argv", "env", "output", "timeout"}``), answers ``{"pid"}`` when it has forked,
and ``{"pid", "returncode"}`` when that child has ended (``-N`` for signal N, as
``subprocess`` reports it; a child past its ``timeout`` is killed with its session).

    python -m tests.prefork      # started by :class:`Zygote`, not by hand

Alternatives rejected:
    * ``multiprocessing``'s forkserver (what ``tests.harness.run_distributed`` uses): its
      children call ``os._exit`` after the target returns, so interpreter finalisation,
      where the exit abort happens, never runs.
    * Starting fewer processes: the issue asks for 20 runs of 2 ranks.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["Zygote"]

_PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "megatron_fsdp.experimental",
    "lightning.pytorch",
    "lightning_megatron_fsdp",
)
ROOT = Path(__file__).resolve().parents[1]

# The script's globals, kept alive until interpreter finalisation as ``python script.py``
# keeps its ``__main__`` module's (runpy would otherwise drop them when the run returns).
_SCRIPT_GLOBALS: list[dict[str, Any]] = []


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python script argv...`` and run it. Never returns."""
    os.setsid()  # its own session: a timeout kills whatever it started, too
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    script = str(Path(request["script"]).resolve())
    sys.argv = [script, *request["argv"]]
    sys.path[0] = str(Path(script).parent)  # what ``python script.py`` puts first
    _SCRIPT_GLOBALS.append(runpy.run_path(script, run_name="__main__"))
    sys.exit(0)  # unwinds to the top: the interpreter finalises as after a script's end


def _serve() -> None:
    for name in _PRELOAD:
        __import__(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        raise RuntimeError(f"zygote: {threads} native threads after imports; fork needs one")
    print(json.dumps({"ready": True}), flush=True)
    children: dict[int, float] = {}  # pid -> deadline
    stdin_open = True
    while stdin_open or children:
        for pid, deadline in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0 and time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                done, status = os.waitpid(pid, 0)
            if done:
                del children[pid]
                code = os.waitstatus_to_exitcode(status)
                print(json.dumps({"pid": pid, "returncode": code}), flush=True)
        if not stdin_open:
            time.sleep(0.05)
            continue
        readable, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not readable:
            continue
        line = sys.stdin.readline()
        if not line:
            stdin_open = False
            continue
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        children[pid] = time.monotonic() + float(request["timeout"])
        print(json.dumps({"pid": pid}), flush=True)


class Zygote:
    """A zygote process for :func:`run_many`-style tests; use as a context manager.

    Args:
        env: The zygote's own environment (children get theirs per request).
    """

    def __init__(self, env: dict[str, str]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.prefork"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        ready = self._read()
        if ready != {"ready": True}:
            raise RuntimeError(f"prefork zygote did not start: {ready}")

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        finally:
            if self._process.poll() is None:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()

    def _read(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"prefork zygote exited with {self._process.wait()}")
        return json.loads(line)

    def run(
        self,
        script: Path,
        argvs: list[list[str]],
        envs: list[dict[str, str]],
        outputs: list[Path],
        timeout: float,
    ) -> list[tuple[int, str]]:
        """Run ``script`` once per ``(argv, env, output)`` at the same time; each (rc, output).

        The processes start together (the ranks of one run) and are each killed, with
        anything they started, after ``timeout`` seconds.
        """
        assert self._process.stdin is not None
        pids = []
        for argv, env, output in zip(argvs, envs, outputs, strict=True):
            request = {
                "script": str(script),
                "argv": argv,
                "env": env,
                "output": str(output),
                "timeout": timeout,
            }
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            pids.append(self._read()["pid"])
        codes: dict[int, int] = {}
        while len(codes) < len(pids):
            reply = self._read()
            codes[reply["pid"]] = reply["returncode"]
        return [(codes[pid], output.read_text()) for pid, output in zip(pids, outputs, strict=True)]


if __name__ == "__main__":
    _serve()
