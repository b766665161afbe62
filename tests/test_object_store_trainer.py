"""The Trainer on a bucket: ``ModelCheckpoint`` and ``fit(ckpt_path="last")`` against a real
S3-compatible server continue a run bit for bit, and the checkpoints are in the bucket.

The runs are ``tests/test_trainer_checkpointing.py``'s: run A trains 8 steps uninterrupted,
then a fresh model 4 steps while ``ModelCheckpoint(every_n_train_steps=2, save_last=True)``
saves into ``s3://<bucket>/...``; run B (new processes) resumes with ``ckpt_path="last"``
to step 8 and must match run A's steps 5-8, weights, optimizer state, schedulers and
callback state exactly. The ranks reach the server through the standard AWS variables
only. At 2 ranks the callback's ``dirpath`` is the URL and the saves are synchronous; at 3
ranks the URL is ``Trainer(default_root_dir=...)`` and the saves are asynchronous
(``MegatronFSDPCheckpointIO(async_save=True)``). Afterwards the bucket holds exactly one
complete version of each checkpoint and nothing else, and no rank created a local ``s3:``
directory (what ``Path("s3://...")`` used to do).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron_fsdp import MegatronFSDPCheckpointIO, MegatronFSDPStrategy
from lightning_megatron_fsdp.storage.format import MANIFEST_FILE
from lightning_megatron_fsdp.storage.object_store import ObjectStore
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock
from tests.object_store import SeaweedServer
from tests.test_trainer_checkpointing import (
    ACCUMULATE,
    SAVED_STEP,
    TOTAL_STEPS,
    BatchCounter,
    CheckpointedLM,
    MemoryLogger,
    Probe,
    assert_same,
    make_trainer,
    snapshot,
    token_loader,
)

TIMEOUT = 240.0


def _setup(
    world_size: int, url: str, async_save: bool, max_steps: int, callbacks: list[Any]
) -> tuple[pl.Trainer, ModelCheckpoint]:
    strategy = MegatronFSDPStrategy(
        auto_wrap_policy={PackedBlock},
        timeout=PROCESS_GROUP_TIMEOUT,
        checkpoint_io=MegatronFSDPCheckpointIO(async_save=async_save),
    )
    if async_save:  # the checkpoint directory comes from default_root_dir
        checkpoints = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, save_last=True)
        extra: dict[str, Any] = {"default_root_dir": url}
    else:
        checkpoints = ModelCheckpoint(
            dirpath=f"{url}/run", every_n_train_steps=2, save_top_k=-1, save_last=True
        )
        extra = {}
    trainer = make_trainer(
        world_size,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[*callbacks, checkpoints],
        logger=MemoryLogger(),
        **extra,
    )
    return trainer, checkpoints


def _train_and_save(
    rank: int, world_size: int, env: dict[str, str], url: str, async_save: bool
) -> dict[str, Any]:
    os.environ.update(env)
    pl.seed_everything(0, verbose=False)
    model, probe = CheckpointedLM(), Probe()
    reference = make_trainer(
        world_size, max_steps=TOTAL_STEPS, callbacks=[BatchCounter()], enable_checkpointing=False
    )
    reference.fit(model, token_loader(world_size))
    result: dict[str, Any] = {"reference": {**snapshot(reference, model), "losses": model.losses}}

    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    trainer, checkpoints = _setup(world_size, url, async_save, SAVED_STEP, [BatchCounter(), probe])
    trainer.fit(model, token_loader(world_size))
    result["saved"] = snapshot(trainer, model)
    result["dirpath"] = checkpoints.dirpath
    result["local_s3_dir"] = any(Path(p).exists() for p in ("s3:", "./s3:"))
    return result


def _resume(
    rank: int, world_size: int, env: dict[str, str], url: str, async_save: bool
) -> dict[str, Any]:
    os.environ.update(env)
    pl.seed_everything(0, verbose=False)
    model, probe = CheckpointedLM(), Probe()
    trainer, _ = _setup(world_size, url, async_save, TOTAL_STEPS, [BatchCounter(), probe])
    trainer.fit(model, token_loader(world_size), ckpt_path="last")
    return {
        "start": probe.train_start,
        "final": snapshot(trainer, model),
        "losses": model.losses,
        "ckpt_path": trainer.ckpt_path,
    }


@pytest.mark.both_versions
@pytest.mark.parametrize(
    ("world_size", "async_save"), [(2, False), (3, True)], ids=["2-ranks-sync", "3-ranks-async"]
)
def test_resume_from_last_on_the_bucket_is_bit_exact(
    seaweed: SeaweedServer, world_size: int, async_save: bool
) -> None:
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/job"
    saved_runs = run_distributed(
        _train_and_save,
        world_size,
        seaweed.env,
        url,
        async_save,
        init_process_group=False,
        timeout=TIMEOUT,
    )
    assert not any(run["local_s3_dir"] for run in saved_runs)
    dirpath = saved_runs[0]["dirpath"]
    # default_root_dir: Lightning's <root>/<logger name>/<version>/checkpoints, on the bucket.
    assert dirpath == (f"{url}/memory/version_0/checkpoints" if async_save else f"{url}/run")
    store = ObjectStore(seaweed.filesystem(), "s3")
    inside = dirpath.removeprefix("s3://")
    names = ["epoch=0-step=2.ckpt", f"epoch=1-step={SAVED_STEP}.ckpt", "last.ckpt"]
    assert store.children(inside) == names
    # Exactly one complete version per checkpoint, and no other object in the bucket.
    expected = set()
    for name in names:
        versions = store.versions(f"{inside}/{name}")
        assert len(versions) == 1, versions
        assert store.locate(f"{inside}/{name}") == versions[0].path
        files = store.read_manifest(versions[0].path).files
        expected |= {f"{versions[0].path}/{f}" for f in [*files, MANIFEST_FILE]}
    assert set(seaweed.objects(bucket)) == expected
    assert store.read_manifest(store.locate(f"{inside}/last.ckpt")).global_step == SAVED_STEP

    resumed_runs = run_distributed(
        _resume, world_size, seaweed.env, url, async_save, init_process_group=False, timeout=TIMEOUT
    )
    for saved_run, resumed in zip(saved_runs, resumed_runs, strict=True):
        reference, saved, start = saved_run["reference"], saved_run["saved"], resumed["start"]
        assert resumed["ckpt_path"] == f"{dirpath}/last.ckpt"
        assert (start["epoch"], start["global_step"]) == (2, SAVED_STEP)
        assert_same(start, saved, "restored")
        assert len(resumed["losses"]) == (TOTAL_STEPS - SAVED_STEP) * ACCUMULATE
        assert resumed["losses"] == reference["losses"][SAVED_STEP * ACCUMULATE :]
        assert_same(resumed["final"], {k: v for k, v in reference.items() if k in saved}, "end")
        assert any(
            not np.array_equal(saved["weights"][n], reference["weights"][n])
            for n in saved["weights"]
        )
    # The resumed run overwrote last.ckpt on the bucket: one version again, at step 8.
    last = f"{inside}/last.ckpt"
    assert len(store.versions(last)) == 1
    assert store.read_manifest(store.locate(last)).global_step == TOTAL_STEPS
