"""The checkpoint format and where its bytes live, for the layers above.

The on-disk format (manifest, layout fingerprint, records), its checksums and safe
reading, and the storage backends (local directories, object stores) with their commit.
Everything here works without a process group: the offline tools and the weight readers
build on it as the distributed protocol (``checkpoint/``) does.
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "CheckpointStorage": "backends",
    "FilesAndObjects": "backends",
    "bytes_digest": "checksums",
    "crc32c": "checksums",
    "crc32c_hex": "checksums",
    "CheckpointStore": "commit",
    "LocalDirectories": "commit",
    "interrupted_saves": "commit",
    "latest_complete_checkpoint": "commit",
    "matching_checkpoints": "commit",
    "reach": "commit",
    "recover_matching": "commit",
    "resolve_latest_checkpoint": "commit",
    "FileWindow": "confined_files",
    "create_exclusive": "confined_files",
    "open_regular": "confined_files",
    "read_regular": "confined_files",
    "ChecksummingFileSystemWriter": "filesystem",
    "ReadProgress": "filesystem",
    "VerifyingFileSystemReader": "filesystem",
    "DCP_METADATA_FILE": "format",
    "FORMAT_NAME": "format",
    "FileRecord": "format",
    "MANIFEST_FILE": "format",
    "MAX_EXAMPLES": "format",
    "META_FILE": "format",
    "MODEL_PREFIX": "format",
    "Manifest": "format",
    "OPTIMIZER_PREFIX": "format",
    "TensorSpec": "format",
    "check_files": "format",
    "compare_fingerprints": "format",
    "count": "format",
    "finite_int_or_none": "format",
    "is_complete_checkpoint": "format",
    "listed": "format",
    "mesh_info": "format",
    "model_fingerprint": "format",
    "optimizer_fingerprint": "format",
    "package_versions": "format",
    "read_manifest": "format",
    "summarise": "format",
    "VerifyingFsspecReader": "fsspec_storage",
    "ObjectStore": "object_store",
    "ObjectStores": "object_store",
    "StoreCheckpoint": "object_store",
    "abort_upload": "object_store",
    "checkpoints_inside": "object_store",
    "is_url": "object_store",
    "local_path": "object_store",
    "open_store": "object_store",
    "check_tensor_record": "safe_unpickling",
    "inflate_record": "safe_unpickling",
    "is_tensor_entry": "safe_unpickling",
    "load_dcp_metadata": "safe_unpickling",
    "load_weights_only": "safe_unpickling",
    "UPSTREAM_FORMAT_NAME": "upstream_checkpoint",
    "UPSTREAM_NOTE": "upstream_checkpoint",
    "internal_keys": "upstream_checkpoint",
    "is_upstream_checkpoint": "upstream_checkpoint",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
