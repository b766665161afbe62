"""Weights and the offline tools on a real S3-compatible server (SeaweedFS,
``tests/object_store.py``): every path may be a URL, reading and writing.

One 2-rank run (``tests.harness``, gloo) trains the tied, unevenly packed ``PackedLit`` one
Adam step and saves the same checkpoint dict twice with ``MegatronFSDPCheckpointIO``: to a
local directory and to ``s3://<bucket>/run/last.ckpt`` (a versioned checkpoint on the
bucket). Its ``meta.pt`` also holds tensors (a callback's ``kth_value``, random states).
Then, against the local path as the reference:

* ``consolidate`` bucket -> bucket (the console script), bucket -> local, local -> bucket:
  the safetensors outputs are byte-identical to the local consolidation, the ``.pt``
  outputs hold equal tensors; no temporary object is left in the bucket;
* ``export-lightning`` bucket -> bucket (``optimizer=True``) and local -> bucket: equal to
  the local export, every ``meta.pt`` tensor included; ``load_lightning_module`` takes the
  exported object's URL and the checkpoint's URL and rebuilds the trained weights;
* an output on the bucket appears only when its streaming upload completes: while parts
  are uploaded nothing is visible under its name, and a failed export aborts the upload
  (no object, no pending multipart upload);
* ``load_full_weights`` at 2 ranks from a ``torch.save`` file, a ``.safetensors`` file, a
  Lightning ``.ckpt`` (positional Adam state) and our DCP checkpoint (with optimizer state)
  on the bucket, and
  ``MegatronFSDPStrategy(init_weights_from=<url>)``, fill each rank bit for bit as the
  same sources on the local disk do; each rank fetches only its rows (ranged reads,
  counted per rank);
* a missing object names the URL; a URL whose filesystem is not installed names what to
  install (``gs://``: gcsfs; ``s3://`` without s3fs: the ``[s3]`` extra), on every rank.

The ranks and this process reach the server through the standard AWS variables only, except
where ``storage_options`` is the point: ``PretrainedWeights(url, storage_options=...)`` and
the tools' ``storage_options=`` with no AWS variable set.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import pytest
import safetensors.torch
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from lightning_megatron_fsdp import (
    CheckpointError,
    CheckpointMismatchError,
    NotACheckpointError,
    PretrainedWeights,
    attach_uneven_dtensor_metadata,
    consolidate_checkpoint,
    enable_cpu_execution,
    export_lightning_checkpoint,
    load_full_weights,
    load_lightning_module,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.tools.cli import main
from tests.harness import run_distributed
from tests.models import lm_loss, make_batch, sharded_adam
from tests.object_store import SeaweedServer
from tests.test_portability import (
    AtTrainStart,
    PackedLit,
    assemble,
    assert_same,
    make_trainer,
    megatron_strategy,
    optimizer_shards,
    param_shards,
    plain_state,
    shard_packed_lit,
    train_loader,
)

TIMEOUT = 180.0
SOURCE_SEED = 5  # the plain model the single-file sources hold


def _meta_tensors() -> dict[str, Any]:
    """Tensors a Lightning ``meta.pt`` holds besides the weights: an export must keep them."""
    return {
        "callbacks": {"ModelCheckpoint": {"kth_value": torch.tensor(float("inf"))}},
        "rng_states": [torch.arange(5, dtype=torch.uint8), torch.tensor([7, -3])],
    }


# ---------------------------------------------------------------------- rank workers


def _train_and_save(rank: int, world_size: int, env: dict[str, str], local: str, url: str) -> Any:
    os.environ.update(env)
    enable_cpu_execution()
    model = shard_packed_lit(PackedLit(seed=3))
    adam = sharded_adam(model)
    lm_loss(model, make_batch(0)).backward()
    adam.step()
    adam.zero_grad()
    model_sd = get_model_state_dict(model)
    adam_sd = get_optimizer_state_dict(model, adam)
    attach_uneven_dtensor_metadata(model, model_sd, adam_sd)
    checkpoint = {
        "state_dict": model_sd,
        "optimizer_states": [adam_sd],
        "epoch": 0,
        "global_step": 1,
        "pytorch-lightning_version": lightning.__version__,
        "hyper_parameters": {"seed": 3},
        **_meta_tensors(),
    }
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint, local)
    plugin.save_checkpoint(checkpoint, url)
    return {"params": param_shards(model), "optimizer": optimizer_shards(model, adam)}


class _FetchCounter:
    """Counts the bytes of the ranged reads of the process's s3fs client, through its
    blocking ``cat_file`` and its coroutine ``_cat_file`` (which reads under a deadline
    take): the real calls, only measured."""

    def __init__(self) -> None:
        import fsspec

        fs = fsspec.filesystem("s3")
        blocking, coroutine = fs.cat_file, fs._cat_file  # cat_file never calls fs._cat_file
        self.fetched: dict[str, int] = {}

        def cat_file(path: str, start: int | None = None, end: int | None = None, **kw: Any):
            return self._count(path, blocking(path, start=start, end=end, **kw))

        async def _cat_file(path: str, start: int | None = None, end: int | None = None, **kw):
            return self._count(path, await coroutine(path, start=start, end=end, **kw))

        fs.cat_file, fs._cat_file = cat_file, _cat_file

    def _count(self, path: str, data: bytes) -> bytes:
        key = path.rsplit("/", 1)[-1]
        self.fetched[key] = self.fetched.get(key, 0) + len(data)
        return data


def _load_weights(
    rank: int, world_size: int, env: dict[str, str], sources: dict[str, tuple[str, str]]
) -> Any:
    """Each source from its local path and from its URL into fresh sharded models."""
    os.environ.update(env)
    enable_cpu_execution()
    counter = _FetchCounter()
    result: dict[str, Any] = {}
    # What reading the layout alone fetches (torch.save's pickle and zip directory): a load
    # whose every key mismatches, refused before any value is read.
    try:
        load_full_weights(
            shard_packed_lit(PackedLit(seed=None)), sources["torch"][1], add_prefix="x."
        )
    except CheckpointMismatchError:
        result["layout"] = counter.fetched.pop("plain.pt")
    for name, (local, url) in sources.items():
        for where, path in (("local", local), ("bucket", url)):
            model = shard_packed_lit(PackedLit(seed=None))
            adam = sharded_adam(model) if name in ("dcp", "ckpt") else None
            loaded = load_full_weights(model, path, optimizers=[adam] if adam else [])
            result[name, where] = {
                "params": param_shards(model),
                "optimizer": optimizer_shards(model, adam) if adam else None,
                "kind": loaded.kind,
                "source": str(loaded.source),
                "missing": loaded.missing,
            }
    result["fetched"] = dict(counter.fetched)
    errors = {}
    for name, path in (
        ("missing", sources["torch"][1].replace("plain.pt", "nothing.pt")),
        ("missing_prefix", sources["torch"][1].replace("plain.pt", "no/such/ckpt")),
        ("gcsfs", "gs://lmf-bucket/model.safetensors"),
    ):
        model = shard_packed_lit(PackedLit(seed=None))
        try:
            load_full_weights(model, path)
        except CheckpointError as err:
            errors[name] = f"{type(err).__name__}: {err}"
    result["errors"] = errors
    return result


def _init_weights_from(rank: int, world_size: int, options: dict[str, str], url: str) -> Any:
    """``MegatronFSDPStrategy(init_weights_from=PretrainedWeights(<url>, storage_options=...))``
    with no AWS variable set: what the model holds when training starts."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        del os.environ[name]
    start = AtTrainStart()
    weights = PretrainedWeights(url, storage_options=options)
    trainer = make_trainer(
        world_size, megatron_strategy(init_weights_from=weights), max_steps=1, callbacks=[start]
    )
    trainer.fit(PackedLit(seed=None), train_loader(world_size))
    return start.params


# ---------------------------------------------------------------------- fixture


_SAVED: dict[str, Any] = {}


@pytest.fixture
def saved(seaweed: SeaweedServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-rank checkpoint, locally and on the bucket, and the assembled references
    (once per session)."""
    if not _SAVED:
        root = tmp_path_factory.mktemp("object_store_tools")
        bucket = seaweed.new_bucket()
        local, url = root / "last.ckpt", f"s3://{bucket}/run/last.ckpt"
        results = run_distributed(_train_and_save, 2, seaweed.env, str(local), url, timeout=TIMEOUT)
        _SAVED.update(
            root=root,
            bucket=bucket,
            local=local,
            url=url,
            params=assemble([r["params"] for r in results]),
            optimizer=assemble([r["optimizer"] for r in results]),
        )
    return _SAVED


@pytest.fixture
def aws(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedServer]:
    """This process configured by the standard AWS variables only, as a user's shell."""
    import s3fs

    for name, value in seaweed.env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a client built from these variables
    yield seaweed
    s3fs.S3FileSystem.clear_instance_cache()


def _objects(server: SeaweedServer, prefix: str) -> list[str]:
    return sorted(server.objects(prefix))


def _state(path: Path | bytes) -> dict[str, Any]:
    import io

    source = io.BytesIO(path) if isinstance(path, bytes) else path
    return torch.load(source, map_location="cpu", weights_only=True)


def _assert_trees_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Equal nests; tensors equal bit for bit, dtype and shape included."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            _assert_trees_equal(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_trees_equal(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=where)
        assert actual.dtype == expected.dtype, where
    else:
        assert actual == expected, where


# ---------------------------------------------------------------------- consolidate


def test_consolidate_reads_and_writes_the_bucket_bit_exactly(
    saved: dict[str, Any], aws: SeaweedServer, tmp_path: Path
) -> None:
    bucket, url, local = saved["bucket"], saved["url"], saved["local"]
    fs = aws.filesystem()
    reference = consolidate_checkpoint(local, tmp_path / "ref.safetensors")
    reference_pt = consolidate_checkpoint(local, tmp_path / "ref.pt", include_optimizer=True)

    # bucket -> bucket, the console script configured by the AWS variables alone
    out = f"s3://{bucket}/export/model.safetensors"
    assert main(["consolidate", url, out]) == 0
    assert fs.cat(out) == reference.read_bytes()
    # bucket -> local and local -> bucket
    to_local = consolidate_checkpoint(url, tmp_path / "from_bucket.pt", include_optimizer=True)
    _assert_trees_equal(_state(to_local), _state(reference_pt))
    to_bucket = consolidate_checkpoint(local, f"s3://{bucket}/export/model.pt", "bf16")
    assert to_bucket == f"s3://{bucket}/export/model.pt"
    expected = _state(consolidate_checkpoint(local, tmp_path / "bf16.pt", "bf16"))
    _assert_trees_equal(_state(fs.cat(to_bucket)), expected)
    assert expected["lm.embed.weight"].dtype == torch.bfloat16
    # The weights are the trained ones, ties under both names.
    state = safetensors.torch.load(fs.cat(out))
    for name, value in saved["params"].items():
        np.testing.assert_array_equal(state[name].numpy(), value, err_msg=name, strict=True)

    # An existing object is not replaced without --overwrite; nothing else appeared.
    before = _objects(aws, bucket)
    with pytest.raises(FileExistsError, match=rf"output {out} already exists"):
        consolidate_checkpoint(url, out)
    assert consolidate_checkpoint(url, out, overwrite=True) == out
    assert fs.cat(out) == reference.read_bytes()
    assert _objects(aws, bucket) == before
    exports = [p for p in before if "/export/" in p]
    assert exports == [f"{bucket}/export/model.pt", f"{bucket}/export/model.safetensors"]
    # No output may land inside the checkpoint (it would block its next save).
    with pytest.raises(ValueError, match="lies inside the checkpoint"):
        consolidate_checkpoint(url, f"{url}/inside.safetensors")


# ---------------------------------------------------------------------- export-lightning


def test_export_lightning_reads_and_writes_the_bucket(
    saved: dict[str, Any], aws: SeaweedServer, tmp_path: Path
) -> None:
    bucket, url, local = saved["bucket"], saved["url"], saved["local"]
    fs = aws.filesystem()
    reference = _state(export_lightning_checkpoint(local, tmp_path / "ref.ckpt", optimizer=True))
    # Every tensor meta.pt holds is exported as it is (not left as reserved zeros).
    _assert_trees_equal(reference["callbacks"], _meta_tensors()["callbacks"])
    _assert_trees_equal(reference["rng_states"], _meta_tensors()["rng_states"])

    out = f"s3://{bucket}/export/trained.ckpt"
    assert export_lightning_checkpoint(url, out, optimizer=True) == out
    _assert_trees_equal(_state(fs.cat(out)), reference)
    # The console script, bucket -> local and local -> bucket (weights only).
    assert main(["export-lightning", url, str(tmp_path / "cli.ckpt")]) == 0
    assert main(["export-lightning", str(local), f"s3://{bucket}/export/cli.ckpt"]) == 0
    weights_only = _state(tmp_path / "cli.ckpt")
    assert "optimizer_states" not in weights_only
    _assert_trees_equal(weights_only["state_dict"], reference["state_dict"])
    _assert_trees_equal(_state(fs.cat(f"s3://{bucket}/export/cli.ckpt")), weights_only)

    # load_lightning_module on the exported object's URL and on the checkpoint's URL.
    for source in (out, url):
        module = load_lightning_module(PackedLit, source, tmp_dir=tmp_path)
        assert_same(plain_state(module), saved["params"])
    with pytest.raises(FileNotFoundError, match=rf"s3://{bucket}/export/none\.ckpt does not"):
        load_lightning_module(PackedLit, f"s3://{bucket}/export/none.ckpt")


# ---------------------------------------------------------------------- atomic upload


def _options(server: SeaweedServer) -> dict[str, str]:
    """The server's endpoint and credentials as fsspec ``storage_options``."""
    return {
        "endpoint_url": server.endpoint,
        "key": server.env["AWS_ACCESS_KEY_ID"],
        "secret": server.env["AWS_SECRET_ACCESS_KEY"],
    }


def reference_ckpt(saved: dict[str, Any], tmp_path: Path) -> Path:
    """The weights of the local export-lightning of the saved checkpoint, as a file."""
    exported = export_lightning_checkpoint(saved["local"], tmp_path / "reference.ckpt")
    path = tmp_path / "reference_state.pt"
    torch.save(_state(exported)["state_dict"], path)
    return path


def test_an_output_on_the_bucket_appears_only_when_complete(
    saved: dict[str, Any], seaweed: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts go out while writing (bounded memory) yet nothing is visible under the name;
    a failure aborts the upload. The filesystem is configured by ``storage_options`` alone
    (no AWS variable set here)."""
    from lightning_megatron_fsdp.storage import locate

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    options = _options(seaweed)
    bucket = seaweed.new_bucket()
    fs = seaweed.filesystem()
    name = f"s3://{bucket}/out/model.safetensors"
    output = locate(name, options)
    block = os.urandom(1 << 20)

    def write(stream: Any, fail: bool) -> None:
        for _ in range(20):  # 20 MiB: two 8 MiB parts are uploaded while writing
            stream.write(block)
        assert len(stream.parts) == 2 and stream.mpu is not None  # uploaded, not buffered
        assert not fs.exists(name), "visible before the upload completed"
        if fail:
            raise RuntimeError("the export failed here")

    with pytest.raises(RuntimeError, match="failed here"):
        output.write_atomically(lambda s: write(s, True), overwrite=False, who="test")
    assert not fs.exists(name)
    pending = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert pending == []  # aborted, not left to linger
    output.write_atomically(lambda s: write(s, False), overwrite=False, who="test")
    assert fs.cat(name) == block * 20

    # The tools take the same storage_options, for both sides.
    reference = consolidate_checkpoint(saved["local"], tmp_path / "ref.safetensors")
    out = f"s3://{bucket}/out/weights.safetensors"
    assert consolidate_checkpoint(saved["url"], out, storage_options=options) == out
    assert fs.cat(out) == reference.read_bytes()
    ckpt = f"s3://{bucket}/out/model.ckpt"
    assert export_lightning_checkpoint(saved["url"], ckpt, storage_options=options) == ckpt
    exported = _state(fs.cat(ckpt))
    _assert_trees_equal(exported["state_dict"], _state(reference_ckpt(saved, tmp_path)))


# ---------------------------------------------------------------------- full weights


def test_weights_from_the_bucket_match_the_local_load_at_two_ranks(
    saved: dict[str, Any], aws: SeaweedServer, tmp_path: Path
) -> None:
    bucket, fs = saved["bucket"], aws.filesystem()
    plain = PackedLit(seed=SOURCE_SEED)
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    safetensors.torch.save_model(plain, os.fspath(tmp_path / "model.safetensors"))
    # A Lightning .ckpt with torch's positional optimizer state: the trained run's export.
    export_lightning_checkpoint(saved["local"], tmp_path / "trained.ckpt", optimizer=True)
    sources = {"dcp": (str(saved["local"]), saved["url"])}
    for kind, name in (
        ("torch", "plain.pt"),
        ("safetensors", "model.safetensors"),
        ("ckpt", "trained.ckpt"),
    ):
        fs.put(str(tmp_path / name), f"{bucket}/weights/{name}")
        sources[kind] = (str(tmp_path / name), f"s3://{bucket}/weights/{name}")
    results = run_distributed(_load_weights, 2, aws.env, sources, timeout=TIMEOUT)

    expected = plain_state(plain)
    for name in sources:
        trained = name in ("dcp", "ckpt")
        for where in ("local", "bucket"):
            full = assemble([r[name, where]["params"] for r in results])
            assert_same(full, saved["params"] if trained else expected)
            kind = {"ckpt": "torch"}.get(name, name)
            assert {r[name, where]["kind"] for r in results} == {kind}
            assert results[0][name, where]["missing"] == ()
            if trained:
                optimizer = assemble([r[name, where]["optimizer"] for r in results])
                assert_same(optimizer, saved["optimizer"])
        for rank in results:  # bucket == local, rank by rank
            for key, (offset, values) in rank[name, "local"]["params"].items():
                bucket_offset, bucket_values = rank[name, "bucket"]["params"][key]
                assert bucket_offset == offset
                np.testing.assert_array_equal(bucket_values, values, err_msg=key, strict=True)
        assert results[0][name, "bucket"]["source"] == sources[name][1]  # the URL, unmangled
    # The uneven case is present: some rank owns no row of some parameter.
    assert any(r["torch", "bucket"]["params"]["lm.head.bias"][1].shape[0] == 0 for r in results)

    # Each rank fetched only the byte ranges of its rows (ranged reads of the data, counted
    # without the layout reads: the safetensors header; torch.save's pickle and zip
    # directory, what a load that reads no value fetched): less than the data, and all of
    # it together.
    header = (
        8
        + struct.unpack("<Q", fs.cat_file(f"{bucket}/weights/model.safetensors", start=0, end=8))[0]
    )
    storages = {t.untyped_storage().data_ptr(): t.nbytes for t in plain.state_dict().values()}
    data = {
        "plain.pt": (sum(storages.values()), None),
        "model.safetensors": (fs.size(f"{bucket}/weights/model.safetensors") - header, header),
    }
    for name, (size, layout) in data.items():
        fetched = [
            r["fetched"][name] - (r["layout"] if layout is None else layout) for r in results
        ]
        assert all(0 < f < size for f in fetched) and sum(fetched) >= size, (name, fetched, size)

    for result in results:  # every rank raises the same clear error
        errors = result["errors"]
        missing = sources["torch"][1].replace("plain.pt", "nothing.pt")
        assert f"{missing} does not exist" in errors["missing"], errors
        assert "no/such/ckpt does not exist" in errors["missing_prefix"], errors
        assert "pip install gcsfs" in errors["gcsfs"], errors
        assert errors["gcsfs"].startswith("CheckpointError: "), errors

    # The strategy option fills the model before training starts, the filesystem configured
    # by storage_options alone (the ranks unset every AWS variable first).
    init = run_distributed(
        _init_weights_from,
        2,
        _options(aws),
        sources["safetensors"][1],
        init_process_group=False,
        timeout=TIMEOUT,
    )
    assert_same(assemble(init), expected)


# ---------------------------------------------------------------------- errors


def test_missing_objects_and_filesystems_are_named(
    saved: dict[str, Any], aws: SeaweedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = saved["bucket"]
    missing = f"s3://{bucket}/run/nothing.ckpt"
    with pytest.raises(NotACheckpointError, match=rf"{missing} does not exist"):
        consolidate_checkpoint(missing, tmp_path / "x.pt")
    with pytest.raises(NotACheckpointError, match=rf"{missing} does not exist"):
        export_lightning_checkpoint(missing, tmp_path / "x.ckpt")
    assert main(["consolidate", missing, str(tmp_path / "x.pt")]) == 1
    assert f"{missing} does not exist" in capsys.readouterr().err
    # ModelCheckpoint's dirpath is not "missing": it names the checkpoints under it.
    parent = f"s3://{bucket}/run"
    named = rf"{parent} is a prefix of checkpoints \(pass one of them: last\.ckpt\)"
    with pytest.raises(NotACheckpointError, match=named):
        consolidate_checkpoint(parent, tmp_path / "x.pt")
    for command in (["inspect", parent], ["inspect", "--verify", parent]):
        assert main(command) == 1, command
        out, err = capsys.readouterr()
        assert re.search(named, out + err) and "does not exist" not in out + err, out + err
    with pytest.raises(ImportError, match=r"gs://b/ckpt.*pip install gcsfs"):
        consolidate_checkpoint("gs://b/ckpt", tmp_path / "x.pt")
    with pytest.raises(ImportError, match=r"gs://b/x.pt.*pip install gcsfs"):
        consolidate_checkpoint(saved["local"], "gs://b/x.pt")
    assert main(["export-lightning", str(saved["local"]), "gs://b/x.ckpt"]) == 1
    assert "pip install gcsfs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, no local "gs:" directory
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from lightning_megatron_fsdp.tools.cli import main\n"
        f"sys.exit(main(['consolidate', {saved['url']!r}, 'out.safetensors']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pip install 'lightning-megatron-fsdp[s3]'" in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())
    # No credentials anywhere: the error says where they come from.
    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    bare.update(
        AWS_ENDPOINT_URL=aws.endpoint,
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    command = [sys.executable, "-m", "lightning_megatron_fsdp.tools.cli", "inspect", saved["url"]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env=bare)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "NoCredentialsError" in out.stderr, out.stderr
    assert "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in out.stderr, out.stderr
