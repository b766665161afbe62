"""litgpt as the real client: ``examples/litgpt_pretrain.py`` trains ``litgpt.GPT`` (a tiny
``litgpt.Config``, nothing downloaded) with the Fabric strategy on 2 CPU processes,
checkpoints, resumes in a new process group exactly as an uninterrupted run trains, and
exports ``lit_model.pth``, which litgpt's own loader reads into a plain ``GPT`` whose
logits equal the sharded model's, bit for bit."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron_fsdp import inspect_checkpoint, verify_checkpoint
from tests.ci import in_ci
from tests.harness import free_port, spawned

if importlib.util.find_spec("litgpt") is None:  # installed beside the extras (README)
    _MISSING = "litgpt is not installed: pip install --no-deps litgpt==0.5.13"
    if in_ci():  # CI must never pass by skipping
        raise ImportError(_MISSING)
    pytest.skip(_MISSING, allow_module_level=True)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "litgpt_pretrain.py"
README = Path(__file__).resolve().parents[1] / "README.md"
# One run takes under a minute on an idle machine; CI runs four test passes side by side on
# two cores, where the three runs (four ranks at once, each importing litgpt) took minutes.
RUN_TIMEOUT_S = 480


def _readme_snippet() -> str:
    """The README's Python block that loads the export with litgpt's own loader."""
    section = README.read_text().split("### litgpt", 1)[1]
    block = re.search(r"```python\n(.*?)\n```", section, re.DOTALL)
    assert block is not None and "load_checkpoint" in block.group(1), "README: no litgpt block"
    return block.group(1)


README_SNIPPET = _readme_snippet()


def _runs(*runs: tuple[Path, tuple[str, ...]]) -> None:
    """Run the example once per ``(out, args)``, side by side, as the README does."""
    with contextlib.ExitStack() as stack:
        started = []
        for out, args in runs:
            command = [sys.executable, str(EXAMPLE), "--out", str(out), "--save-every", "2", *args]
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            started.append((command, stack.enter_context(spawned(command, env=env))))
        for command, process in started:
            try:
                _, stderr = process.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                _, stderr = process.communicate()
                pytest.fail(f"{command} ran past {RUN_TIMEOUT_S} s:\n{stderr[-4000:]}")
            assert process.returncode == 0, (
                f"{command} exited {process.returncode}:\n{stderr[-4000:]}"
            )
            assert "terminate called" not in stderr


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "losses.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


@pytest.mark.both_versions
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_litgpt_pretrain_resumes_exactly_and_exports_for_litgpt(tmp_path: Path) -> None:
    resumed, straight = tmp_path / "resumed", tmp_path / "uninterrupted"
    _runs((resumed, ("--max-steps", "4")), (straight, ("--max-steps", "8")))
    last = resumed / "checkpoints" / "last"
    assert inspect_checkpoint(last).world_size == 2
    assert verify_checkpoint(last) == []
    _runs((resumed, ("--max-steps", "8", "--resume", "--export")))

    # The resume is exact: steps 5-8 (mid-epoch, new process group) equal the uninterrupted
    # run's, to the bit; steps 1-4 were logged once.
    losses, reference = _losses(resumed), _losses(straight)
    assert sorted(losses) == list(range(1, 9))
    assert losses == reference

    # litgpt's own loader reads the export into a plain, unsharded GPT: no missing or
    # unexpected key, logits equal to the sharded model's.
    from lightning.fabric import Fabric
    from litgpt import GPT, Config
    from litgpt.utils import load_checkpoint

    final = resumed / "final"
    config = Config.from_file(final / "model_config.yaml")
    model = GPT(config)
    load_checkpoint(Fabric(accelerator="cpu", devices=1), model, final / "lit_model.pth")
    model.eval()
    probe = torch.arange(config.block_size).remainder(7).unsqueeze(0)
    with torch.no_grad():
        logits = model(probe)
    torch.testing.assert_close(logits, torch.load(final / "probe.pt"), rtol=0, atol=0)
    again = GPT(config)
    again.load_state_dict(torch.load(final / "lit_model.pth", weights_only=True), strict=True)
    # The README's snippet, as written (its imports included), loads the same weights.
    snippet = README_SNIPPET.replace("runs/litgpt/final", str(final))
    namespace: dict[str, Any] = {}
    exec(compile(snippet, "README.md (litgpt)", "exec"), namespace)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), namespace["model"].state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), again.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
