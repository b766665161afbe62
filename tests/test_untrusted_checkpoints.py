"""Opening a hostile checkpoint never runs its code, reads outside it, hangs, or crashes.

One real checkpoint per session: a 1-rank ``Trainer`` run (``ExportLM``: AdamW, a
scheduler, hyper-parameters) saved by ``ModelCheckpoint`` through our strategy. Each attack
of :mod:`tests.untrusted_attacks` copies it and plants one thing, rewriting the manifest's
sizes and CRC32Cs as an attacker would:

    payload place     .metadata, meta.pt, byte record, no manifest, .metadata alone,
                      a record path outside the directory, a shard that is a symbolic
                      link to a copy elsewhere, a shard that is a FIFO, a huge claimed
                      shape, a DEFLATE-compressed record, a ZStandard bomb (a 32 KiB
                      record of torch's ZStandard extension inflating to 1 GiB)
    x entry point     the console script's commands, the Python loaders,
                      init_weights_from, fit(ckpt_path) at 1 and 2 ranks, and the
                      Fabric strategy's fabric.load and fabric.load_raw at 1 and 2 ranks

Every combination must leave no marker file (a payload unpickled in full would create
it), end within a time limit, and end in a clear refusal (a ``CheckpointError``,
``OSError`` or ``ValueError``; exit status 1 with a message and no traceback), except
where the entry point never reads the planted part (then it may succeed: e.g. ``inspect``
reads no shard). The bomb's refusal must also name the record and come before the call's
peak RSS rose by 64 MiB (:func:`tests.untrusted_attacks.judge`). The controls, an intact
checkpoint, a format-1 checkpoint and one whose records are all ZStandard frames (as
torch's extension writes them), load everywhere. megatron-fsdp's own format goes
through the same readers and is covered by tests/test_upstream_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.legacy_format import downgrade_to_format_1
from tests.untrusted_attacks import (
    ATTACKS,
    compress_records,
    judge,
    make_attack,
    peak_rss_growth,
)

ROOT = Path(__file__).resolve().parents[1]
CONTROLS = ("intact", "format_1", "zstd")
# Entry points that never read the planted part of these attacks, so they may succeed.
MAY_SUCCEED: dict[str, set[str]] = {
    # meta.pt: inspect reports it unreadable (a note); consolidate and init_weights_from
    # do not read it; verify compares its bytes only.
    "meta_pt": {
        "cli inspect",
        "cli inspect --verify",
        "cli consolidate",
        "cli consolidate --optimizer",
        "inspect_checkpoint",
        "verify_checkpoint",
        "consolidate_checkpoint",
        "init_weights_from",
    },
    # An optimizer hyper-parameter: read only where optimizer state is.
    "byte_record": {
        "cli inspect",
        "cli inspect --verify",
        "cli consolidate",
        "inspect_checkpoint",
        "verify_checkpoint",
        "load_lightning_module",
        "init_weights_from",
    },
    # Shard contents: inspect reads .metadata, manifest.json and meta.pt only.
    "symlink": {"cli inspect", "inspect_checkpoint"},
    "fifo": {"cli inspect", "inspect_checkpoint"},
    "compressed": {"cli inspect", "inspect_checkpoint"},
    "zstd_bomb": {"cli inspect", "inspect_checkpoint"},
}
_SAVED: dict[str, Path] = {}


def _train(rank: int, world_size: int, root: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_megatron_fsdp import MegatronFSDPStrategy
    from tests.models import PackedBlock
    from tests.test_lightning_export import ExportLM, TokenData, make_trainer

    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(
        world_size,
        MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT),
        max_steps=2,
        callbacks=[ModelCheckpoint(dirpath=root, filename="saved")],
    )
    trainer.fit(ExportLM(num_blocks=1), datamodule=TokenData(batch_size=2))


@pytest.fixture
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The controls and every attack, built once per session from one real save."""
    if not _SAVED:
        root = tmp_path_factory.mktemp("untrusted")
        run_distributed(_train, 1, str(root / "run"), init_process_group=False, timeout=240)
        saved = root / "run" / "saved.ckpt"
        (root / "markers").mkdir()
        _SAVED["markers"] = root / "markers"
        _SAVED["intact"] = Path(shutil.copytree(saved, root / "intact"))
        _SAVED["format_1"] = Path(shutil.copytree(saved, root / "format_1"))
        downgrade_to_format_1(_SAVED["format_1"])
        _SAVED["zstd"] = compress_records(Path(shutil.copytree(saved, root / "zstd")))
        for attack in ATTACKS:
            _SAVED[attack] = make_attack(attack, saved, root / attack, root / "markers")
    return _SAVED


def _assert_safe(outcomes: dict[str, dict[str, str]], markers: Path) -> int:
    """Check each (directory, entry point) outcome; returns how many combinations held."""
    assert not list(markers.iterdir()), f"a payload ran: {sorted(markers.iterdir())}"
    failures = []
    for name, by_entry in outcomes.items():
        for entry, outcome in by_entry.items():
            if name in CONTROLS:
                expected = {"ok"}
            else:
                expected = {"refused"} | ({"ok"} if entry in MAY_SUCCEED.get(name, ()) else set())
            if outcome not in expected:
                failures.append(f"{name} x {entry}: {outcome} (expected {sorted(expected)})")
    assert not failures, "\n".join(failures)
    return sum(len(v) for v in outcomes.values())


def test_offline_entry_points(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The console script's commands and the Python loaders, each call bounded in time."""
    names = [*CONTROLS, *ATTACKS]
    result = tmp_path / "outcomes.json"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.untrusted_attacks",
            str(result),
            str(tmp_path / "scratch"),
            *[str(checkpoints[n]) for n in names],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    outcomes = json.loads(result.read_text())
    assert sorted(outcomes) == sorted(names)
    assert len(outcomes["intact"]) == 10
    _assert_safe(outcomes, checkpoints["markers"])


def _outcome(err: BaseException | None) -> str:
    from lightning_megatron_fsdp import CheckpointError

    if err is None:
        return "ok"
    if isinstance(err, CheckpointError | OSError | ValueError):
        return "refused"
    return f"crash: {type(err).__name__}: {err}"[:600]


def _training_entry_points(
    rank: int, world_size: int, directories: dict[str, str], init_weights: bool
) -> dict[str, dict[str, str]]:
    """``init_weights_from`` (one step from the weights) and ``fit(ckpt_path)`` (one step
    more) on each directory, each in a fresh ``Trainer`` on this rank."""
    import lightning.pytorch as pl

    from lightning_megatron_fsdp import MegatronFSDPStrategy
    from tests.models import PackedBlock
    from tests.test_lightning_export import ExportLM, TokenData, make_trainer

    outcomes: dict[str, dict[str, str]] = {}
    for name, directory in directories.items():
        runs: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
            "fit(ckpt_path)": ({}, {"ckpt_path": directory})
        }
        if init_weights:
            runs["init_weights_from"] = ({"init_weights_from": directory}, {})
        outcomes[name] = {}
        for entry, (options, fit_options) in runs.items():
            pl.seed_everything(0, verbose=False)
            strategy = MegatronFSDPStrategy(
                auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT, **options
            )
            trainer = make_trainer(world_size, strategy, max_steps=3, enable_checkpointing=False)
            model, data = ExportLM(num_blocks=1), TokenData(batch_size=2)
            error: BaseException | None = None
            with peak_rss_growth() as growth:
                try:
                    trainer.fit(model, datamodule=data, **fit_options)
                except BaseException as err:  # classified below; a crash fails the test
                    error = err
            outcome = judge(name, _outcome(error), str(error), growth[0])
            outcomes[name][f"{entry} {world_size} rank(s)"] = outcome
    return outcomes


def _training_table(outcomes: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Entry names without the rank count, for :data:`MAY_SUCCEED`."""
    return {
        name: {entry.rsplit(" ", 2)[0]: outcome for entry, outcome in by_entry.items()}
        for name, by_entry in outcomes.items()
    }


@pytest.mark.both_versions
def test_init_weights_from_and_fit_on_one_rank(checkpoints: dict[str, Path]) -> None:
    names = [*CONTROLS, *ATTACKS]
    (outcomes,) = run_distributed(
        _training_entry_points,
        1,
        {n: str(checkpoints[n]) for n in names},
        True,
        init_process_group=False,
        timeout=900,
    )
    assert sorted(outcomes) == sorted(names)
    _assert_safe(_training_table(outcomes), checkpoints["markers"])


@pytest.mark.both_versions
def test_fit_on_two_ranks_refuses_on_every_rank(checkpoints: dict[str, Path]) -> None:
    names = [*CONTROLS, *ATTACKS]
    results = run_distributed(
        _training_entry_points,
        2,
        {n: str(checkpoints[n]) for n in names},
        False,
        init_process_group=False,
        timeout=900,
    )
    assert results[0] == results[1], "the ranks ended differently"
    _assert_safe(_training_table(results[0]), checkpoints["markers"])


def test_refusals_name_the_opt_in_which_unpickles_in_full(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal names ``trust_checkpoint``; with it, ``meta.pt`` is unpickled in full
    (the payload runs: the opt-in is real). ``--debug`` shows the traceback."""
    from lightning_megatron_fsdp import CheckpointError, export_lightning_checkpoint
    from lightning_megatron_fsdp.tools.cli import main

    markers = tmp_path / "markers"
    markers.mkdir()
    attacked = make_attack("meta_pt", checkpoints["intact"], tmp_path / "meta_pt", markers)
    with pytest.raises(CheckpointError, match=r"weights_only=True.*trust_checkpoint=True"):
        export_lightning_checkpoint(attacked, tmp_path / "refused.ckpt")
    assert not (tmp_path / "refused.ckpt").exists() and not list(markers.iterdir())

    assert main(["export-lightning", str(attacked), str(tmp_path / "cli.ckpt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-megatron-fsdp: error: ") and "--trust-checkpoint" in err
    assert "Traceback" not in err
    with pytest.raises(CheckpointError, match="trust_checkpoint"):
        main(["export-lightning", str(attacked), str(tmp_path / "cli.ckpt"), "--debug"])

    export_lightning_checkpoint(attacked, tmp_path / "trusted.ckpt", trust_checkpoint=True)
    assert (markers / "meta_pt").exists(), "trust_checkpoint=True did not unpickle in full"


def test_an_export_never_renames_a_swapped_temporary_file(tmp_path: Path) -> None:
    """Whoever can write to the output folder swaps the temporary file for their own while
    the export writes it: the export fails and the output is never their file."""
    from lightning_megatron_fsdp.storage import locate

    output = tmp_path / "out.pt"
    location = locate(output)

    def write_and_get_swapped(stream: Any) -> None:
        stream.write(b"ours")
        (temporary,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.pt.tmp-")]
        temporary.unlink()
        temporary.write_bytes(b"theirs")  # a new file under the same name

    with pytest.raises(FileExistsError, match="was replaced while exporting"):
        location.write_atomically(write_and_get_swapped, overwrite=False, who="test")
    assert not output.exists()

    def write(stream: Any) -> None:
        stream.write(b"ours")
        stream.seek(0)
        assert stream.read() == b"ours"  # re-read through the descriptor

    location.write_atomically(write, overwrite=False, who="test")
    assert output.read_bytes() == b"ours"


def _zstd_record(value: Any, *, size: int | None = None) -> bytes:
    """``torch.save(value)`` as torch's ZStandard extension stores a record; with ``size``,
    first grown to that many bytes by a zip comment (still a valid ``torch.save`` zip)."""
    import io
    import struct

    import torch
    import zstandard

    buffer = io.BytesIO()
    torch.save(value, buffer)
    plain = buffer.getvalue()
    if size is not None:
        comment = size - len(plain)
        assert plain[-22:-18] == b"PK\x05\x06" and 0 <= comment < 1 << 16
        plain = plain[:-2] + struct.pack("<H", comment) + b"c" * comment
    return zstandard.ZstdCompressor().compress(plain)


def _zstd_checkpoint(directory: Path, state: dict[str, Any], key: str, record: bytes) -> None:
    """A DCP save of ``state`` through torch's ZStandard extension whose record of ``key``
    is then replaced by ``record`` (its CRC32C resealed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    from lightning_megatron_fsdp.storage.filesystem import ChecksummingFileSystemWriter
    from tests.untrusted_attacks import _append_record

    writer = ChecksummingFileSystemWriter(directory, _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer)
    _append_record(directory, key, record, keep_payload=False, transforms=["stream.zstd/1"])


@pytest.mark.both_versions
@pytest.mark.parametrize("extra", [0, 1])
def test_a_transformed_record_inflates_to_its_bound_and_not_a_byte_past(
    tmp_path: Path, extra: int
) -> None:
    """A ZStandard tensor record of exactly what its chunk may hold (its bytes and
    ``TENSOR_RECORD_FRAMING``) loads bit-exactly; one byte more is refused, naming the
    file, the record's place and key."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_megatron_fsdp.storage.filesystem import VerifyingFileSystemReader
    from lightning_megatron_fsdp.storage.safe_unpickling import TENSOR_RECORD_FRAMING

    saved = torch.arange(4, dtype=torch.float32) + 0.5
    limit = saved.nbytes + TENSOR_RECORD_FRAMING
    _zstd_checkpoint(tmp_path, {"w": saved}, "w", _zstd_record(saved, size=limit + extra))
    loaded = {"w": torch.zeros(4)}
    reader = VerifyingFileSystemReader(tmp_path)
    if extra:
        refused = (
            rf"__0_0\.distcp: record of 'w' \(chunk at \[0\]\), bytes \[\d+, \d+\): "
            rf"inflates past the {limit} bytes"
        )
        with pytest.raises(CheckpointException, match=refused):
            dcp.load(loaded, storage_reader=reader)
        return
    dcp.load(loaded, storage_reader=reader)
    torch.testing.assert_close(loaded["w"], saved, rtol=0, atol=0)


@pytest.mark.both_versions
def test_a_garbled_transformed_record_is_refused_naming_it(tmp_path: Path) -> None:
    """A ZStandard record whose frame is corrupt (its CRC32C resealed) ends in one clear
    error naming the record, whatever the decompressor raised."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_megatron_fsdp.storage.filesystem import VerifyingFileSystemReader

    garbled = b"\x28\xb5\x2f\xfd" + b"\x00\x38" + b"\x07" * 20  # magic, header, bad block
    _zstd_checkpoint(tmp_path, {"w": torch.ones(4)}, "w", garbled)
    refused = r"CheckpointCorruptedError: .*__0_0\.distcp: record of 'w' .* cannot be inflated"
    with pytest.raises(CheckpointException, match=refused):
        dcp.load({"w": torch.zeros(4)}, storage_reader=VerifyingFileSystemReader(tmp_path))


@pytest.mark.both_versions
def test_a_transformed_byte_record_is_bounded_unless_trusted(tmp_path: Path) -> None:
    """``.metadata`` gives no size for a byte record: a ZStandard one inflating past
    ``BYTE_RECORD_LIMIT`` is refused, naming the opt-in; a trusted checkpoint loads it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from lightning_megatron_fsdp.storage.filesystem import VerifyingFileSystemReader
    from lightning_megatron_fsdp.storage.safe_unpickling import BYTE_RECORD_LIMIT

    large = bytes(BYTE_RECORD_LIMIT)  # its torch.save is a little larger
    _zstd_checkpoint(tmp_path, {"blob": b"small"}, "blob", _zstd_record(large))
    refused = rf"record of 'blob'.*inflates past the {BYTE_RECORD_LIMIT} bytes.*trust_checkpoint"
    with pytest.raises(CheckpointException, match=refused):
        dcp.load({"blob": b""}, storage_reader=VerifyingFileSystemReader(tmp_path))
    loaded = {"blob": b""}
    dcp.load(loaded, storage_reader=VerifyingFileSystemReader(tmp_path, trust_checkpoint=True))
    assert loaded["blob"] == large


def test_malformed_manifest_and_metadata_end_in_one_error(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest nested past the parser's recursion limit, and ``.metadata`` chunk fields
    of the wrong type (resealed), end every command with exit 1 and one message; except
    that plain ``inspect`` lists a directory with an unreadable manifest, saying why in a
    note, as it does one without a manifest."""
    import pickle

    from lightning_megatron_fsdp.tools.cli import main
    from tests.untrusted_attacks import reseal

    nested = Path(shutil.copytree(checkpoints["intact"], tmp_path / "nested"))
    (nested / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    typed = Path(shutil.copytree(checkpoints["intact"], tmp_path / "typed"))
    metadata = pickle.loads((typed / ".metadata").read_bytes())
    next(iter(metadata.state_dict_metadata.values())).chunks[0].sizes = "3"
    (typed / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(typed)
    for directory, expected in ((nested, "nests deeper"), (typed, "malformed DCP metadata")):
        for command in (["inspect"], ["inspect", "--verify"], ["consolidate"]):
            argv = [*command, str(directory)]
            if command == ["consolidate"]:
                argv.append(str(tmp_path / f"{directory.name}.pt"))
            status = main(argv)
            assert status == (0 if (directory, command) == (nested, ["inspect"]) else 1), argv
            out, err = capsys.readouterr()
            assert expected in out + err and "Traceback" not in out + err, (argv, out, err)


# Fabric's loaders read what the Trainer's do: fabric.load as fit(ckpt_path) (optimizer
# state and meta.pt included), fabric.load_raw as init_weights_from (the weights only).
_FABRIC_AS = {"fabric.load": "fit(ckpt_path)", "fabric.load_raw": "init_weights_from"}


def _fabric_entry_points(
    rank: int,
    world_size: int,
    directories: dict[str, str],
    weights_only: bool | None,
    entries: tuple[str, ...] = tuple(_FABRIC_AS),
    explain: bool = False,
) -> dict[str, dict[str, str]]:
    """``fabric.load(path, {"model", "optimizer"})`` and ``fabric.load_raw(path, model)`` on
    each directory, each into a freshly set-up model on this rank (``explain``: a refusal's
    message after its outcome)."""
    import torch
    from lightning.fabric import Fabric

    from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy
    from tests.models import PackedBlock
    from tests.test_lightning_export import ExportLM

    strategy = MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    outcomes: dict[str, dict[str, str]] = {}
    for name, directory in directories.items():
        outcomes[name] = {}
        for entry in entries:
            model = fabric.setup_module(ExportLM(num_blocks=1))
            optimizer = fabric.setup_optimizers(
                torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
            )
            error: BaseException | None = None
            with peak_rss_growth() as growth:
                try:
                    if entry == "fabric.load":
                        state = {"model": model, "optimizer": optimizer}
                        fabric.load(directory, state, weights_only=weights_only)
                    else:
                        fabric.load_raw(directory, model, weights_only=weights_only)
                except BaseException as err:  # classified below; a crash fails the test
                    error = err
            outcomes[name][entry] = judge(name, _outcome(error), str(error), growth[0])
            if explain and error is not None:
                outcomes[name][entry] += f": {error}"
    return outcomes


@pytest.mark.both_versions
@pytest.mark.parametrize("world_size", [1, 2])
def test_fabric_load_and_load_raw(checkpoints: dict[str, Path], world_size: int) -> None:
    """``fabric.load`` and ``fabric.load_raw`` (the Fabric strategy) run none of a
    checkpoint's code and refuse every attack they read, on every rank."""
    names = [*CONTROLS, *ATTACKS]
    results = run_distributed(
        _fabric_entry_points,
        world_size,
        {n: str(checkpoints[n]) for n in names},
        None,
        init_process_group=False,
        timeout=900,
    )
    assert all(r == results[0] for r in results), "the ranks ended differently"
    assert sorted(results[0]) == sorted(names)
    assert _assert_safe(
        {
            name: {_FABRIC_AS[entry]: outcome for entry, outcome in by_entry.items()}
            for name, by_entry in results[0].items()
        },
        checkpoints["markers"],
    ) == 2 * len(names)


@pytest.mark.parametrize(
    ("entry", "attack", "named"),
    [
        ("fabric.load", "meta_pt", "weights_only=False for fabric.load_raw, and for fabric.load's"),
        ("fabric.load_raw", "metadata", "weights_only=False for fabric.load_raw"),
    ],
)
def test_fabric_opt_in_unpickles_in_full(
    checkpoints: dict[str, Path], tmp_path: Path, entry: str, attack: str, named: str
) -> None:
    """Refused by default, with an error that names the opt-in; ``weights_only=False``
    (``fabric.load``: ``meta.pt``; ``fabric.load_raw``: the whole checkpoint) unpickles in
    full: the payload runs, so the opt-in is real."""
    markers = tmp_path / "markers"
    markers.mkdir()
    attacked = {attack: str(make_attack(attack, checkpoints["intact"], tmp_path / attack, markers))}
    (refused,) = run_distributed(
        _fabric_entry_points, 1, attacked, None, (entry,), True, init_process_group=False
    )
    assert refused[attack][entry].startswith("refused") and not list(markers.iterdir())
    assert named in refused[attack][entry]  # the refusal names the opt-in
    run_distributed(_fabric_entry_points, 1, attacked, False, (entry,), init_process_group=False)
    assert (markers / attack).exists(), "weights_only=False did not unpickle in full"
