"""Turn a checkpoint into what format 1 wrote: sha256 digests, no per-record checksums.

Format 1 (before CRC32C) recorded each file's sha256 in ``manifest.json`` (no
``"checksum"`` field) and left DCP's ``.metadata`` exactly as torch writes it. Checkpoints
in that format must keep loading and verifying, so the tests make one from a fresh save:
strip the per-record annotations from ``.metadata`` and rewrite the manifest with sha256
digests computed here with ``hashlib``, independently of the library. Format 1 wrote no
``.metadata.keys`` (``storage.metadata_index``): it is removed, so a load falls back to
``.metadata``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

from lightning_megatron_fsdp.storage.filesystem import RECORD_ATTR

__all__ = ["downgrade_to_format_1"]


def downgrade_to_format_1(path: Path) -> None:
    """Rewrite the checkpoint at ``path`` in place as format 1 (one process only)."""
    metadata_file = path / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    for info in metadata.storage_data.values():
        if hasattr(info, RECORD_ATTR):
            delattr(info, RECORD_ATTR)
    metadata_file.write_bytes(pickle.dumps(metadata))
    (path / ".metadata.keys").unlink(missing_ok=True)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"].pop(".metadata.keys", None)
    manifest["format_version"] = 1
    del manifest["checksum"]
    manifest["files"] = {
        name: {
            "size": (path / name).stat().st_size,
            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest(),
        }
        for name in manifest["files"]
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
