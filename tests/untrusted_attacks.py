"""Hostile checkpoints made from a real one, as an attacker would make them, and the offline
entry points run against them in a child process with a time limit per call.

Each attack copies an intact checkpoint and plants one thing (a pickle that would create a
marker file when unpickled in full, a path outside the directory, a symbolic link, a FIFO,
a huge claimed shape, a compressed record, a ZStandard bomb), then rewrites
``manifest.json``'s sizes and CRC32Cs (and ``.metadata``'s record CRCs) to match, so
integrity checks alone see nothing.

``python -m tests.untrusted_attacks OUTPUT.json DIR...`` runs every offline entry point
(the console script's commands in-process through ``main``, and the Python loaders) on
each directory and writes one outcome per pair: ``ok`` (it succeeded), ``refused`` (a
``CheckpointError``/``OSError``/``ValueError``, or exit status 1 with one message and no
traceback), ``crash`` (anything else: a traceback), ``hang`` (past the time limit). A
refusal of the bomb counts only if it names the record and the call's peak RSS rose by less
than :data:`BOMB_RSS_LIMIT` (:func:`judge`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shlex
import shutil
import signal
import sys
import traceback
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c as crc32c_package
import torch
import zstandard

ATTACKS = (
    "metadata",
    "meta_pt",
    "byte_record",
    "no_manifest",
    "metadata_alone",
    "outside_path",
    "symlink",
    "fifo",
    "huge_shape",
    "compressed",
    "zstd_bomb",
)
SHARD = "__0_0.distcp"
BYTE_KEY = "optimizer_states.0.param_groups.0.lr"
TENSOR_KEY = "state_dict.lm.embed.weight"
CALL_TIMEOUT = 30  # seconds per entry point call; a FIFO would block forever
BOMB = "zstd_bomb"
BOMB_BYTES = 1 << 30  # what the bomb's 32 KiB ZStandard frame inflates to: zeros
BOMB_RSS_LIMIT = 64 << 20


class Payload:
    """Unpickled in full, runs ``touch MARKER``; the marker's existence is the proof."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _crc(data: bytes) -> str:
    return f"{crc32c_package.crc32c(data):08x}"


def reseal(directory: Path, sizes: dict[str, tuple[int, str]] | None = None) -> None:
    """Rewrite the manifest's size and CRC32C of every listed regular file to match."""
    manifest_file = directory / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    for name in manifest["files"]:
        path = directory / name
        if sizes and name in sizes:
            size, crc = sizes[name]
        elif path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            size, crc = len(data), _crc(data)
        else:
            continue
        manifest["files"][name] = {"size": size, "crc32c": crc}
    manifest_file.write_text(json.dumps(manifest))


def _metadata(directory: Path) -> Any:
    return pickle.loads((directory / ".metadata").read_bytes())


def _write_metadata(directory: Path, metadata: Any) -> None:
    """Write ``.metadata`` and, as an attacker would, its cut by key to match (what a load
    reads instead: ``.metadata.keys``), where the checkpoint has one."""
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    if (directory / ".metadata.keys").exists():
        from lightning_megatron_fsdp.checkpoint.metadata_slices import MetadataSlices

        cut = MetadataSlices.cut(metadata, source=".metadata")
        (directory / ".metadata.keys").write_bytes(cut.encoded())


def _append_record(
    directory: Path,
    key: str,
    record: bytes,
    *,
    keep_payload: bool,
    transforms: list[str] | None = None,
) -> None:
    """Append ``record`` to the shard and point ``key``'s storage entry at it, its CRC32C
    annotation rewritten (and its direct-read offsets dropped unless ``keep_payload``), read
    back through the DCP stream ``transforms``."""
    shard = directory / SHARD
    offset = shard.stat().st_size
    with shard.open("ab") as file:
        file.write(record)
    metadata = _metadata(directory)
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            info.offset, info.length = offset, len(record)
            info.transform_descriptors = transforms
            annotation = dict(getattr(info, "lmf_record", {}) or {})
            annotation["crc32c"] = crc32c_package.crc32c(record)
            if not keep_payload:
                annotation.pop("payload", None)
            info.lmf_record = annotation
    _write_metadata(directory, metadata)


def _compressed_record(directory: Path, key: str) -> bytes:
    """The record of ``key`` rewritten as a zip whose entries are DEFLATE-compressed."""
    metadata = _metadata(directory)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
    data = (directory / SHARD).read_bytes()[info.offset : info.offset + info.length]
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
        for entry in source.infolist():
            target.writestr(entry.filename, source.read(entry), zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _zstd_bomb() -> bytes:
    """A ZStandard frame, as torch's ``ZStandard`` extension writes records, of
    :data:`BOMB_BYTES` zeros (built a MiB at a time)."""
    compressor = zstandard.ZstdCompressor().compressobj()
    zeros = bytes(1 << 20)
    frame = [compressor.compress(zeros) for _ in range(BOMB_BYTES >> 20)]
    return b"".join([*frame, compressor.flush()])


def compress_records(directory: Path) -> Path:
    """Rewrite every record of ``directory``'s shard as torch's ZStandard extension stores
    it (one frame of the record's bytes), their CRC32Cs and the manifest resealed: what a
    writer with ``_extensions=[ZStandard()]`` saves. A control, not an attack."""
    metadata = _metadata(directory)
    data = (directory / SHARD).read_bytes()
    shard = bytearray()
    compressor = zstandard.ZstdCompressor()
    for info in metadata.storage_data.values():
        assert info.relative_path == SHARD, info.relative_path
        frame = compressor.compress(data[info.offset : info.offset + info.length])
        info.offset, info.length = len(shard), len(frame)
        info.transform_descriptors = ["stream.zstd/1"]
        info.lmf_record = {"crc32c": crc32c_package.crc32c(frame)}
        shard += frame
    (directory / SHARD).write_bytes(shard)
    _write_metadata(directory, metadata)
    reseal(directory)
    return directory


def make_attack(name: str, source: Path, destination: Path, markers: Path) -> Path:
    """Copy ``source`` to ``destination`` and plant attack ``name``; return the directory."""
    shutil.copytree(source, destination)
    marker = markers / name
    if name in ("metadata", "no_manifest", "metadata_alone"):
        metadata = _metadata(destination)
        metadata.storage_meta.modules = [Payload(marker)]
        _write_metadata(destination, metadata)
        reseal(destination)
        if name == "no_manifest":
            (destination / "manifest.json").unlink()
        if name == "metadata_alone":
            for path in destination.iterdir():
                if path.name != ".metadata":
                    path.unlink()
    elif name == "meta_pt":
        meta = torch.load(destination / "meta.pt", weights_only=True)
        meta["hyper_parameters"]["payload"] = Payload(marker)
        torch.save(meta, destination / "meta.pt")
        reseal(destination)
    elif name == "byte_record":
        buffer = io.BytesIO()
        torch.save(Payload(marker), buffer)
        _append_record(destination, BYTE_KEY, buffer.getvalue(), keep_payload=False)
        reseal(destination)
    elif name == "outside_path":
        outside = destination.parent / f"{destination.name}-outside.distcp"
        shutil.copyfile(destination / SHARD, outside)
        metadata = _metadata(destination)
        for i, info in enumerate(metadata.storage_data.values()):
            if info.relative_path == SHARD:  # relative and absolute paths out
                info.relative_path = f"../{outside.name}" if i % 2 else str(outside)
        _write_metadata(destination, metadata)
        reseal(destination)
    elif name == "symlink":
        outside = destination.parent / f"{destination.name}-outside.distcp"
        (destination / SHARD).rename(outside)
        (destination / SHARD).symlink_to(outside)
    elif name == "fifo":
        (destination / SHARD).unlink()
        os.mkfifo(destination / SHARD)
        reseal(destination, {SHARD: (0, _crc(b""))})
    elif name == "huge_shape":
        metadata = _metadata(destination)
        entry = metadata.state_dict_metadata[TENSOR_KEY]
        huge = torch.Size([10**6, 10**6])
        entry.size = huge
        entry.chunks = [type(entry.chunks[0])(offsets=torch.Size([0, 0]), sizes=huge)]
        _write_metadata(destination, metadata)
        manifest = json.loads((destination / "manifest.json").read_text())
        manifest["fingerprint"][TENSOR_KEY.removeprefix("state_dict.")]["shape"] = list(huge)
        (destination / "manifest.json").write_text(json.dumps(manifest))
        reseal(destination)
    elif name == "compressed":
        record = _compressed_record(destination, TENSOR_KEY)
        _append_record(destination, TENSOR_KEY, record, keep_payload=False)
        reseal(destination)
    elif name == BOMB:
        bomb = _zstd_bomb()
        _append_record(
            destination, TENSOR_KEY, bomb, keep_payload=False, transforms=["stream.zstd/1"]
        )
        reseal(destination)
    else:
        raise ValueError(f"unknown attack {name!r}")
    return destination


# ------------------------------------------------------------------ offline entry points


class _Hang(BaseException):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[list[int]]:
    """How far this process's peak RSS rises above its RSS at entry, in bytes: the yielded
    list's item, set on exit (Linux: ``clear_refs`` resets the peak, ``VmHWM``)."""
    growth = [0]
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss()
    try:
        yield growth
    finally:
        growth[0] = _peak_rss() - before


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM in /proc/self/status")


def judge(name: str, outcome: str, said: str, growth: int) -> str:
    """``outcome`` of an entry point on directory ``name``; for the bomb, a refusal counts
    only if it names the record (file and key, as inflating past its bound) and the call's
    peak RSS rose by less than :data:`BOMB_RSS_LIMIT`."""
    if name != BOMB or outcome != "refused":
        return outcome
    if growth >= BOMB_RSS_LIMIT:
        return f"refused after the peak RSS grew {growth >> 20} MiB"
    named = (SHARD, TENSOR_KEY.removeprefix("state_dict."), "inflates past")
    if not all(part in said for part in named):
        return f"refused without naming the record: {said[-400:]}"
    return outcome


def _cli(*argv: str) -> Callable[[Path, Path], tuple[str, str]]:
    def run(path: Path, out: Path) -> tuple[str, str]:
        from lightning_megatron_fsdp.tools.cli import main

        stderr, stdout = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            status = main([argv[0], str(path), *[a.format(out=out) for a in argv[1:]]])
        text = stderr.getvalue() + stdout.getvalue()
        if status == 0:
            return "ok", text
        said = stderr.getvalue().startswith("lightning-megatron-fsdp: error: ") or (
            "verify: FAILED" in stdout.getvalue()
        )
        if status == 1 and said and "Traceback" not in text:
            return "refused", text
        return f"crash: exit {status}: {text[-400:]}", text

    return run


def _python(call: Callable[[Path, Path], Any]) -> Callable[[Path, Path], tuple[str, str]]:
    def run(path: Path, out: Path) -> tuple[str, str]:
        from lightning_megatron_fsdp import CheckpointError

        try:
            result = call(path, out)
        except (CheckpointError, OSError, ValueError) as err:
            return "refused", str(err)
        if isinstance(result, list):  # verify_checkpoint: its problems
            return ("refused" if result else "ok"), "\n".join(result)
        return "ok", ""

    return run


def _entry_points() -> dict[str, Callable[[Path, Path], tuple[str, str]]]:
    import lightning_megatron_fsdp as lmf
    from tests.test_lightning_export import ExportLM

    return {
        "cli inspect": _cli("inspect"),
        "cli inspect --verify": _cli("inspect", "--verify"),
        "cli consolidate": _cli("consolidate", "{out}/w.safetensors"),
        "cli consolidate --optimizer": _cli("consolidate", "{out}/w.pt", "--optimizer"),
        "cli export-lightning --optimizer": _cli("export-lightning", "{out}/m.ckpt", "--optimizer"),
        "inspect_checkpoint": _python(lambda p, o: lmf.inspect_checkpoint(p)),
        "verify_checkpoint": _python(lambda p, o: lmf.verify_checkpoint(p)),
        "consolidate_checkpoint": _python(
            lambda p, o: lmf.consolidate_checkpoint(p, o / "c.pt", include_optimizer=True)
        ),
        "export_lightning_checkpoint": _python(
            lambda p, o: lmf.export_lightning_checkpoint(p, o / "e.ckpt", optimizer=True)
        ),
        "load_lightning_module": _python(lambda p, o: lmf.load_lightning_module(ExportLM, p)),
    }


def run_offline(directories: list[Path], scratch: Path) -> dict[str, dict[str, str]]:
    """Every offline entry point on every directory: ``{dir name: {entry: outcome}}``."""
    signal.signal(signal.SIGALRM, _alarm)
    outcomes: dict[str, dict[str, str]] = {}
    for directory in directories:
        outcomes[directory.name] = {}
        for entry, run in _entry_points().items():
            out = scratch / f"{directory.name}-{len(outcomes[directory.name])}"
            out.mkdir(parents=True)
            said = ""
            signal.alarm(CALL_TIMEOUT)
            try:
                with peak_rss_growth() as growth:
                    outcome, said = run(directory, out)
            except _Hang:
                outcome = "hang"
            except BaseException as err:  # a traceback the user would see
                outcome = f"crash: {type(err).__name__}: {err}"[:400]
                traceback.print_exc()
            finally:
                signal.alarm(0)
            outcomes[directory.name][entry] = judge(directory.name, outcome, said, growth[0])
    return outcomes


if __name__ == "__main__":
    result_file, scratch_dir, *dirs = sys.argv[1:]
    result = run_offline([Path(d) for d in dirs], Path(scratch_dir))
    Path(result_file).write_text(json.dumps(result))
