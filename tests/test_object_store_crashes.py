"""A save killed at each phase of the object-store commit, against the real server
(SeaweedFS, ``tests/object_store.py``): what is left in the bucket, what loads, and that the
next save leaves nothing else behind, pending multipart uploads included.

Two ranks save ``last.ckpt`` twice; the second save is cut short by a SIGKILL:

* rank 0 at a commit step (``commit._FAULT_HOOK``): before the manifest PUT (the previous
  version loads), after it (two complete versions: the newer loads), and while retiring,
  once the previous version's manifest is gone (the newer loads). If the previous version
  were retired before the new manifest was written, the last one would leave no complete
  checkpoint and fail here.
* a rank while its shard object is half uploaded (one part of a multipart upload sent):
  rank 1, and rank 0's failed save deletes the version and aborts the killed rank's
  upload at once; rank 0, and no one is left to abort it, so the next save does.

Every shard is a little over one upload part, so each rank's object is a multipart upload.
The checkpoint is then loaded here, in the test process, into a zeroed full tensor (DCP
reshards) and compared bit for bit, and saved again: afterwards the bucket holds exactly
that save's objects and no pending upload.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.storage.format import MANIFEST_FILE
from lightning_megatron_fsdp.storage.fsspec_storage import ChecksummingFsspecWriter
from lightning_megatron_fsdp.storage.object_store import ObjectStore
from lightning_megatron_fsdp.storage.store_location import StoreLocation
from tests.harness import run_distributed
from tests.object_store import ACCESS_KEY, SECRET_KEY, SeaweedServer
from tests.scripts.fault_injection import Fault, arm_commit_fault, die, init_group

WORLD_SIZE = 2
# Elements per rank: a little over the 5 MiB upload part, so every shard is a multipart
# upload of two parts.
PER_RANK = (5 << 20) // 4 + 4096


def _weights(step: int) -> torch.Tensor:
    """The full tensor saved at ``step`` (deterministic)."""
    return torch.randn(WORLD_SIZE * PER_RANK, generator=torch.Generator().manual_seed(step))


def _checkpoint(step: int, mesh: Any) -> dict[str, Any]:
    local = _weights(step).chunk(WORLD_SIZE)[dist.get_rank()].clone()
    weights = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return {"state_dict": {"w": weights}, "global_step": step}


class _DieAfterFirstPart(ChecksummingFsspecWriter):
    """The object-store writer; rank ``victim`` SIGKILLs itself once its shard's record is
    in the stream: the first part uploaded, the upload neither completed nor aborted."""

    def __init__(self, staging: StoreLocation, *, victim: int) -> None:
        super().__init__(staging.store, staging.path)
        self.victim = victim

    def write_record(self, stream: Any, storage_key: str, item: Any, data: Any) -> Any:
        written = super().write_record(stream, storage_key, item, data)
        if dist.get_rank() == self.victim:
            die()
        return written


def _save_then_crash(rank: int, world_size: int, env: dict[str, str], url: str, kill: str) -> str:
    """Save step 1, then step 2 killed as ``kill`` says (``commit:<step>`` kills rank 0
    there, ``upload:<rank>`` that rank after its first part); this rank's error."""
    os.environ.update(env)
    init_group(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(_checkpoint(1, mesh), f"{url}/last.ckpt")
    fault, options = None, None
    if kill.startswith("commit:"):
        fault = Fault(kill, 0, "kill")
    else:
        victim = int(kill.removeprefix("upload:"))

        def factory(staging: StoreLocation) -> _DieAfterFirstPart:
            return _DieAfterFirstPart(staging, victim=victim)

        options = {"storage_writer_factory": factory}
    try:
        with arm_commit_fault(fault):
            plugin.save_checkpoint(_checkpoint(2, mesh), f"{url}/last.ckpt", options)
    except CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "returned without an error"


# What kills the second save, the step that loads after it, the manifests it leaves.
SCENARIOS = {
    "rank0-before-the-manifest": ("commit:manifest", 1, 1),
    "rank0-after-the-manifest": ("commit:replaced", 2, 2),
    "rank0-while-retiring": ("commit:retiring", 2, 1),
    "rank1-mid-upload": ("upload:1", 1, 1),
    "rank0-mid-upload": ("upload:0", 1, 1),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_killed_save_leaves_the_newest_complete_checkpoint_and_the_next_save_cleans_up(
    seaweed: SeaweedServer, scenario: str
) -> None:
    kill, loaded_step, manifests = SCENARIOS[scenario]
    bucket = seaweed.new_bucket()
    url, checkpoint = f"s3://{bucket}/run", f"{bucket}/run/last.ckpt"
    victim = 0 if kill.startswith("commit:") else int(kill[-1])
    with pytest.raises(AssertionError) as excinfo:
        run_distributed(
            _save_then_crash, WORLD_SIZE, seaweed.env, url, kill, init_process_group=False
        )
    report = str(excinfo.value)
    assert f"--- rank {victim} failed ---\nprocess died with exit code -9" in report, report
    assert "did not finish" not in report, report

    store = ObjectStore(seaweed.filesystem(), "s3")
    versions = store.versions(checkpoint)
    names = [v.name for v in versions]
    objects = seaweed.objects(checkpoint)
    pending = seaweed.pending_uploads(bucket, "run/")
    assert sum(o.endswith("/" + MANIFEST_FILE) for o in objects) == manifests, objects
    if kill == "upload:1":
        # Rank 0's save failed: it deleted the version and aborted the dead rank's upload.
        assert len(versions) == 1 and versions[0].number == 1, names
        assert all(o.startswith(versions[0].path + "/") for o in objects), objects
        assert pending == [], pending
    else:
        assert [v.number for v in versions] == [1, 2], names
        assert store.locate(checkpoint) == versions[loaded_step - 1].path, names
        # What `inspect` says of each version: the loaded one, and the other as it is.
        described = dict(line.split(": ", 1) for line in store.describe(checkpoint))
        other = "complete, superseded" if kill == "commit:replaced" else "INCOMPLETE: no"
        assert described[names[loaded_step - 1]].startswith("complete (the one loaded)")
        assert described[names[2 - loaded_step]].startswith(other), described
    if kill == "upload:0":  # no one aborted the dead rank's upload
        assert pending == [f"run/last.ckpt/{names[1]}/__0_0.distcp"], pending
    elif kill != "upload:1":
        assert pending == [], pending  # every upload completed before the commit

    # Loaded here, into a zeroed full tensor: the newest complete version, bit for bit.
    plugin = MegatronFSDPCheckpointIO(
        storage_options={"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": seaweed.endpoint}
    )
    target = torch.zeros(WORLD_SIZE * PER_RANK)
    loaded = plugin.load_checkpoint(f"s3://{checkpoint}", state={"state_dict": {"w": target}})
    assert loaded["global_step"] == loaded_step
    torch.testing.assert_close(target, _weights(loaded_step), rtol=0, atol=0)

    # The next save leaves its own objects and nothing else: no version, no pending upload.
    plugin.save_checkpoint({"state_dict": {"w": target}, "global_step": 3}, f"s3://{checkpoint}")
    (kept,) = store.versions(checkpoint)
    assert kept.number == versions[-1].number + 1
    left = sorted(o.removeprefix(kept.path + "/") for o in seaweed.objects(bucket))
    assert left == [".metadata", ".metadata.keys", "__0_0.distcp", MANIFEST_FILE, "meta.pt"], left
    assert seaweed.pending_uploads(bucket) == []


def test_every_commit_step_of_the_object_store_is_killed_here() -> None:
    """Each commit step the object store marks (``reach("...")``) has a scenario above; a
    new step without one fails this test."""
    import lightning_megatron_fsdp.storage.object_store as object_store
    import lightning_megatron_fsdp.storage.store_location as store_location

    source = inspect.getsource(object_store) + inspect.getsource(store_location)
    marked = set(re.findall(r'reach\("([^"]+)"\)', source))
    killed = {kill for kill, *_ in SCENARIOS.values() if kill.startswith("commit:")}
    assert marked == killed == {"commit:manifest", "commit:replaced", "commit:retiring"}
