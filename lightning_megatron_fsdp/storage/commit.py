"""A checkpoint directory's whole life: staged under a hidden name, committed, recovered, removed.

Every rank writes into a hidden sibling ``.<name>.tmp-<token>``; rank 0 writes the manifest
last and puts the directory in place with one atomic exchange (two renames where the system
has none), so ``<name>`` always holds a complete checkpoint, the previous or the new one. A
crash between the two renames is repaired on the next load or lookup; a removal renames the
directory aside before deleting it. :class:`CheckpointStore` is the seam: the local
filesystem is one backend (:class:`LocalDirectories`), and a store without rename can be
another (docs/DESIGN.md, "Commit and crash phases").
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import functools
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from lightning_megatron_fsdp.errors import (
    CheckpointError,
    CheckpointSaveError,
    NotACheckpointError,
)
from lightning_megatron_fsdp.storage.checksums import file_digest
from lightning_megatron_fsdp.storage.confined_files import linux_call, read_regular
from lightning_megatron_fsdp.storage.format import (
    ASIDE,
    DELETING,
    MANIFEST_FILE,
    STAGING,
    Manifest,
    check_files,
    hidden_path,
    is_complete_checkpoint,
    parse_hidden_name,
    read_manifest,
)

__all__ = [
    "CheckpointStore",
    "LocalDirectories",
    "check_replaceable",
    "fsync_path",
    "interrupted_saves",
    "latest_complete_checkpoint",
    "matching_checkpoints",
    "reach",
    "recover_checkpoint",
    "recover_matching",
    "remove_tree",
    "report_interrupted_saves",
    "resolve_latest_checkpoint",
]

log = logging.getLogger(__name__)

_FAULT_HOOK: Callable[[str], None] | None = None
"""Test seam: when set, called with the name of each commit step as it is reached.

Fault-injection tests raise or kill the process at one commit step (no ``StorageWriter``
reaches those). Points, in order: ``"commit:hashed"`` (every rank, its files' sizes and
digests collected, before the gather), ``"commit:manifest"`` (rank 0, before writing
``manifest.json``), ``"commit:publish"`` (rank 0, manifest written, before the rename),
``"commit:aside"`` (rank 0, two-rename fallback only: the previous checkpoint renamed aside,
the new one not yet in place), ``"commit:replaced"`` (rank 0, the new checkpoint in
place, the previous one not yet deleted) and ``"commit:retiring"`` (rank 0, object stores
only: a previous version's manifest deleted, its objects not yet). ``None`` in production.
"""

_USE_RENAME_EXCHANGE = True
"""Commit with one ``renameat2(RENAME_EXCHANGE)`` where the OS supports it; tests set this
to ``False`` to exercise the two-rename fallback that other systems use."""


def reach(point: str) -> None:
    """Mark a commit step (see ``_FAULT_HOOK``); nothing happens in production."""
    if _FAULT_HOOK is not None:
        _FAULT_HOOK(point)


class CheckpointStore(Protocol):
    """Where checkpoints live and how a staged one becomes visible: the commit's backend.

    A save calls :meth:`check_target` (rank 0, before the ranks agree), :meth:`stage` (rank
    0, after), lets every rank write into :meth:`staging_path`, then :meth:`publish` (rank
    0) or, on failure, :meth:`discard`. A load calls
    :meth:`recover` (rank 0) before any rank looks at the checkpoint. A backend without an
    atomic rename commits by writing the manifest last in :meth:`publish`.

    Locations are the backend's own (a ``Path`` here; an object-store backend has its
    own type, see :mod:`~lightning_megatron_fsdp.storage.object_store`): every method
    below that reads or writes files takes one, so the save and load phases never touch a
    filesystem themselves.
    """

    def location(self, path: str | os.PathLike[str]) -> Any:
        """The location a user's path names (same on every rank for the same path)."""
        ...

    def staging_path(self, final: Path, token: str) -> Path:
        """Where the save ``token`` of ``final`` writes (pure naming: the same on every rank)."""
        ...

    def check_target(self, final: Path, token: str) -> str:
        """Refuse (raise) if ``final`` holds something a save must not replace; rank 0,
        before the ranks agree. Returns the token of the save: ``token``, or one the
        backend chose (an object store's next version)."""
        ...

    def stage(self, final: Path, token: str) -> Path:
        """Create the staging location of a save of ``final``."""
        ...

    def write_files(self, staging: Path, files: Mapping[str, bytes]) -> None:
        """Write whole files (durably) into a staging location, by name."""
        ...

    def sizes(self, location: Path) -> dict[str, int]:
        """Every file directly in ``location``, by name, with its size."""
        ...

    def digest(self, location: Path, name: str, algorithm: str) -> str:
        """A file's digest, read back."""
        ...

    def resolve(self, final: Path) -> Path:
        """Where a load of ``final`` reads (after :meth:`recover`; rank 0)."""
        ...

    def read_manifest(self, location: Path) -> Manifest:
        """The manifest at ``location``; :class:`NotACheckpointError` if none parses."""
        ...

    def check_files(
        self, location: Path, manifest: Manifest, *, checksum_files: list[str] | None = None
    ) -> list[str]:
        """One line per listed file that is missing, has another size or (for
        ``checksum_files``) another digest."""
        ...

    def read_bytes(self, location: Path, name: str) -> bytes:
        """A whole file of ``location``."""
        ...

    def discard(self, final: Path, token: str) -> None:
        """Delete a staging location; never raises."""
        ...

    def publish(self, final: Path, staging: Path, manifest: Manifest, token: str) -> None:
        """Write ``manifest`` into ``staging`` and make it the checkpoint at ``final``."""
        ...

    def recover(self, final: Path) -> bool:
        """Repair what a crash in :meth:`publish` left; whether it restored ``final``."""
        ...

    def removal_waits(self, final: Path, saving: Any) -> bool:
        """Whether removing ``final`` must wait for the save in flight to ``saving`` (a
        location, or ``None``) to commit first."""
        ...

    def remove(self, final: Path) -> None:
        """Delete the checkpoint at ``final`` so no crash leaves a damaged one there."""
        ...


def _recency(path: Path) -> tuple[int, int]:
    """Sort key of a complete checkpoint: manifest global_step, then manifest mtime."""
    step = read_manifest(path).global_step
    return (-1 if step is None else step, (path / MANIFEST_FILE).stat().st_mtime_ns)


def recover_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Restore a checkpoint that a crash left renamed aside, if its final name is missing.

    A commit renames the previous checkpoint to ``.<name>.old-<token>`` before renaming the
    new one into place. A crash between the two renames leaves no ``<name>``; this renames
    the newest complete aside copy back. Filesystem work: call it on one rank only.

    Returns:
        Whether a checkpoint was restored.
    """
    path = Path(path)
    if path.exists() or path.is_symlink() or not path.parent.is_dir():
        return False
    asides = [
        sibling
        for sibling in path.parent.iterdir()
        if parse_hidden_name(sibling.name) == (path.name, ASIDE) and is_complete_checkpoint(sibling)
    ]
    if not asides:
        return False
    os.rename(max(asides, key=_recency), path)
    return True


def interrupted_saves(dirpath: str | os.PathLike[str]) -> list[Path]:
    """Return the hidden ``.<name>.tmp-<token>`` directories in ``dirpath``, sorted.

    Each is a save that has not committed: one in progress, or one that crashed (a rank
    was killed, the disk filled up); or the previous checkpoint that a commit swapped out
    and a crash kept from being deleted. None is ever loaded or returned by
    :func:`resolve_latest_checkpoint`; the next save under the same name deletes them.
    Pure listing: no process group.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    return sorted(
        p
        for p in dirpath.iterdir()
        if (hidden := parse_hidden_name(p.name)) is not None and hidden[1] == STAGING
    )


def recover_matching(dirpath: str | os.PathLike[str], pattern: str) -> list[Path]:
    """Restore every checkpoint matching ``pattern`` that a crash left renamed aside.

    Safe on several ranks at once: a rank that loses a rename race finds the checkpoint
    already restored.

    Returns:
        The checkpoints restored by this call.
    """
    dirpath = Path(dirpath)
    restored: list[Path] = []
    with contextlib.suppress(OSError):
        for sibling in list(dirpath.iterdir()):
            hidden = parse_hidden_name(sibling.name)
            if hidden is None or hidden[1] != ASIDE or not fnmatch.fnmatch(hidden[0], pattern):
                continue
            # Another rank restored it first: the rename fails, or the copy this rank
            # found complete is gone by the time its manifest is read.
            with contextlib.suppress(OSError, NotACheckpointError):
                if recover_checkpoint(dirpath / hidden[0]):
                    restored.append(dirpath / hidden[0])
    return restored


def matching_checkpoints(dirpath: str | os.PathLike[str], pattern: str) -> list[Path]:
    """Entries of ``dirpath`` whose name matches ``pattern``, hidden ones never."""
    dirpath = Path(dirpath)
    try:
        return [
            p
            for p in dirpath.iterdir()
            if not p.name.startswith(".") and fnmatch.fnmatch(p.name, pattern)
        ]
    except OSError:
        return []


def latest_complete_checkpoint(
    candidates: Iterable[str | os.PathLike[str]], *, by: str = "step"
) -> Path | None:
    """The newest complete checkpoint among ``candidates``; incomplete ones never.

    Args:
        candidates: Checkpoint paths (missing or incomplete ones are skipped).
        by: ``"step"``: highest manifest ``global_step``, then latest manifest mtime;
            ``"written"``: latest manifest mtime only (Lightning's ``"last"`` rule: a run
            restarted from scratch into the same directory is newer than an older run's
            higher step).

    Returns:
        The checkpoint's path, or ``None`` if none is complete.

    Raises:
        ValueError: For another ``by``.
    """
    if by not in ("step", "written"):
        raise ValueError(f"latest_complete_checkpoint: by must be 'step' or 'written', got {by!r}.")
    newest: tuple[tuple[int, ...], Path] | None = None
    for candidate in {Path(c) for c in candidates}:
        try:
            if not is_complete_checkpoint(candidate):
                continue
            mtime = (candidate / MANIFEST_FILE).stat().st_mtime_ns
            key = (*_recency(candidate)[:1], mtime) if by == "step" else (mtime,)
        except (OSError, CheckpointError):
            continue
        if newest is None or (key, str(candidate)) > (newest[0], str(newest[1])):
            newest = (key, candidate)
    return None if newest is None else newest[1]


def resolve_latest_checkpoint(
    dirpath: str | os.PathLike[str], pattern: str = "last*", *, recover: bool = True
) -> Path | None:
    """Return the newest complete checkpoint in ``dirpath`` whose name matches ``pattern``.

    Newest means the highest manifest ``global_step``, then the latest manifest mtime.
    Hidden directories (saves in progress, renamed-aside and half-removed checkpoints) and
    incomplete directories are never returned.

    Args:
        dirpath: Directory holding checkpoints.
        pattern: ``fnmatch`` pattern for checkpoint names, Lightning's ``last*`` by default.
        recover: First restore any matching checkpoint that a crash left renamed aside
            (see :func:`recover_checkpoint`).

    Returns:
        The checkpoint's path, or ``None`` if there is none.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return None
    if recover:
        recover_matching(dirpath, pattern)
    return latest_complete_checkpoint(matching_checkpoints(dirpath, pattern), by="step")


def remove_tree(path: Path) -> None:
    """Delete a directory tree, or a file; a missing path is not an error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=False)
    elif path.exists() or path.is_symlink():
        path.unlink()


def report_interrupted_saves(parent: Path, log: logging.Logger) -> None:
    """Log the hidden directories of saves that never finished to ``log`` (rank 0, on load)."""
    try:
        leftovers = interrupted_saves(parent)
    except OSError:
        return
    if leftovers:
        log.warning(
            "%d hidden directory(ies) left by interrupted saves in %s: %s. None of them is "
            "ever loaded; the next save under the same name deletes them (or delete them by "
            "hand while no save is running).",
            len(leftovers),
            parent,
            ", ".join(p.name for p in leftovers),
        )


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path``, on disk (written, flushed, fsync'd) on return."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk.

    A directory's fsync is what makes a rename or a new file in it survive a power cut, so
    its failure is an error. Only what says "this cannot be done here" is tolerated: a
    filesystem that does not sync directories answers ``EINVAL`` (fsync's documented
    "does not support synchronization"), and Windows cannot open a directory at all.

    Raises:
        OSError: If the path cannot be opened or the sync fails for any other reason.
    """
    if os.name == "nt" and path.is_dir():
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno != errno.EINVAL or not path.is_dir():
            raise
    finally:
        os.close(fd)


def check_replaceable(final: Path) -> None:
    """Refuse to overwrite anything but one of our checkpoints, a plain file or a link.

    A plain file is a single-file checkpoint (say from another strategy), which Lightning
    would overwrite too; a link (Lightning's ``save_last="link"``) is replaced, never its
    target.

    Raises:
        CheckpointSaveError: If ``final`` is a directory without a readable manifest.
    """
    if final.is_symlink() or not final.exists() or final.is_file():
        return
    with contextlib.suppress(NotACheckpointError):
        read_manifest(final)
        return
    raise CheckpointSaveError(
        f"Refusing to overwrite {final}: it exists and is not a checkpoint written by "
        "MegatronFSDPCheckpointIO (no readable manifest.json). Move it away or save "
        "under another name."
    )


_RENAME_EXCHANGE_FLAG = 2  # linux/fs.h

_AT_FDCWD = -100

_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, or ``None`` where there is none."""
    return linux_call(
        "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    )


def _exchange(a: Path, b: Path, *, use_exchange: bool = True) -> bool:
    """Atomically swap two existing directory entries; ``False`` where unsupported.

    Raises:
        OSError: If the exchange is supported but failed (say, permissions).
    """
    function = _renameat2() if use_exchange else None
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE_FLAG) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE): {os.strerror(code)}", str(a), None, str(b))


class LocalDirectories:
    """:class:`CheckpointStore` on a local or shared POSIX filesystem: hidden sibling
    directories and renames (one ``renameat2(RENAME_EXCHANGE)`` where supported)."""

    def location(self, path: str | os.PathLike[str]) -> Path:
        """``path``, absolute."""
        return Path(os.path.abspath(os.fspath(path)))

    def staging_path(self, final: Path, token: str) -> Path:
        """``.<name>.tmp-<token>`` beside ``final``."""
        return hidden_path(final, STAGING, token)

    def check_target(self, final: Path, token: str) -> str:
        """:func:`check_replaceable`; returns ``token``.

        Raises:
            CheckpointSaveError: If ``final`` is a directory that is not a checkpoint.
        """
        check_replaceable(final)
        return token

    def stage(self, final: Path, token: str) -> Path:
        """Create ``.<name>.tmp-<token>`` beside ``final``."""
        staging = self.staging_path(final, token)
        staging.mkdir(parents=True, exist_ok=True)  # a peer's writer may be first
        return staging

    def write_files(self, staging: Path, files: Mapping[str, bytes]) -> None:
        """Write each ``staging/<name>``, fsync'd."""
        for name, data in files.items():
            _write_synced(staging / name, data)

    def sizes(self, location: Path) -> dict[str, int]:
        """Every entry of the directory with its size."""
        return {p.name: p.stat().st_size for p in location.iterdir()}

    def digest(self, location: Path, name: str, algorithm: str) -> str:
        """:func:`~lightning_megatron_fsdp.storage.checksums.file_digest`."""
        return file_digest(location / name, algorithm)

    def resolve(self, final: Path) -> Path:
        """``final`` itself (:meth:`recover` has put it back if a crash left it aside)."""
        return final

    def read_manifest(self, location: Path) -> Manifest:
        """:func:`~lightning_megatron_fsdp.storage.format.read_manifest`."""
        return read_manifest(location)

    def check_files(
        self, location: Path, manifest: Manifest, *, checksum_files: list[str] | None = None
    ) -> list[str]:
        """:func:`~lightning_megatron_fsdp.storage.format.check_files`."""
        return check_files(location, manifest, checksum_files=checksum_files)

    def read_bytes(self, location: Path, name: str) -> bytes:
        """A whole file of ``location``, confined to it (a plain name, a regular file)."""
        return read_regular(location, name)

    def discard(self, final: Path, token: str) -> None:
        """Delete the staging directory of the save ``token``; errors are ignored."""
        with contextlib.suppress(OSError):
            remove_tree(hidden_path(final, STAGING, token))

    def publish(self, final: Path, staging: Path, manifest: Manifest, token: str) -> None:
        """Write the manifest last, then put ``staging`` in place at ``final``.

        Raises:
            CheckpointSaveError: If ``final`` exists and is not replaceable.
            OSError: If a write, a sync or the rename failed; ``final`` then holds the
                previous checkpoint.
            CheckpointSaveError: If the new checkpoint is in place but its directory could
                not be synced; the previous one is kept beside it. Once that sync is done
                nothing raises: leftovers are logged.
        """
        reach("commit:manifest")
        partial = staging / f"{MANIFEST_FILE}.partial"
        _write_synced(partial, manifest.dumps().encode("utf-8"))
        os.replace(partial, staging / MANIFEST_FILE)
        fsync_path(staging)
        reach("commit:publish")
        if final.exists() or final.is_symlink():
            check_replaceable(final)
            if not _exchange(staging, final, use_exchange=_USE_RENAME_EXCHANGE):
                aside = hidden_path(final, ASIDE, token)
                os.rename(final, aside)
                try:
                    reach("commit:aside")
                    os.rename(staging, final)
                except BaseException:
                    os.rename(aside, final)
                    raise
        else:
            os.rename(staging, final)
        try:
            fsync_path(final.parent)
        except OSError as err:
            # In place, but a power cut may undo the rename: keep the previous checkpoint.
            previous = hidden_path(final, ASIDE, token)
            if staging.exists():  # the exchange left it here, where discard would delete it
                os.rename(staging, previous)
            raise CheckpointSaveError(
                f"{final} holds the new checkpoint, but syncing its directory "
                f"{final.parent} failed ({type(err).__name__}: {err}), so a power cut may "
                f"undo the rename. The previous checkpoint is kept as {previous.name} until "
                "the next save; check the filesystem, then save again."
            ) from err
        # Committed: from here on only space can be lost, so nothing may fail the save.
        try:
            reach("commit:replaced")
            for sibling in list(final.parent.iterdir()):
                hidden = parse_hidden_name(sibling.name)
                if hidden is not None and hidden[0] == final.name:
                    try:
                        remove_tree(sibling)
                    except OSError as err:
                        log.warning("Could not delete stale %s: %s", sibling, err)
        except Exception as err:
            log.warning(
                "Checkpoint %s is committed, but cleaning up after it failed: %s", final, err
            )

    def recover(self, final: Path) -> bool:
        """:func:`recover_checkpoint`, logged; also reports interrupted saves beside it."""
        restored = False
        try:
            restored = recover_checkpoint(final)
            if restored:
                log.warning("Restored %s, which an interrupted save had renamed aside.", final)
        except OSError as err:
            log.warning("Could not restore %s from a renamed-aside copy: %s", final, err)
        report_interrupted_saves(final.parent, log)
        return restored

    def removal_waits(self, final: Path, saving: Any) -> bool:
        """Only for a save of ``final`` itself: the commit would re-create it."""
        return saving is not None and str(saving) == str(final)

    def remove(self, final: Path) -> None:
        """Delete a checkpoint directory (renamed to ``.<name>.del-<token>`` first), a
        hidden directory of ours, or a link (its target kept); a missing path is fine.

        Raises:
            CheckpointError: If ``final`` is not one of our checkpoints: nothing else is
                deleted.
        """
        if final.is_symlink():  # e.g. Lightning's save_last="link": only the link goes
            final.unlink()
            return
        if not final.exists():
            return
        hidden = parse_hidden_name(final.name)
        ours = final.is_dir()
        if ours and hidden is None:
            try:
                read_manifest(final)
            except NotACheckpointError:
                ours = False
        if not ours:
            raise CheckpointError(
                f"MegatronFSDPCheckpointIO.remove_checkpoint: refusing to delete {final}: it "
                "is not a checkpoint written by this plugin (expected a directory with a "
                "manifest.json, or a hidden .<name>.tmp-/.old-/.del-<token> directory). "
                "Delete it by hand if it is really unwanted."
            )
        if hidden is None:
            trash = hidden_path(final, DELETING, uuid.uuid4().hex)
            os.rename(final, trash)
            fsync_path(final.parent)
            final = trash
        remove_tree(final)
