"""The checkpoint format and where its bytes live, for the layers above.

The on-disk format (manifest, layout fingerprint, records), its checksums and safe
reading, and the storage backends (local directories, object stores) with their commit.
Everything here works without a process group: the offline tools and the weight readers
build on it as the distributed protocol (``checkpoint/``) does.
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "backends": ("CheckpointStorage", "LocationStorage"),
    "checksums": ("bytes_digest", "crc32c", "crc32c_hex"),
    "commit": (
        "CheckpointStore",
        "LocalDirectories",
        "interrupted_saves",
        "latest_complete_checkpoint",
        "reach",
        "resolve_latest_checkpoint",
    ),
    "confined_files": (
        "FileWindow",
        "SeekableStream",
        "read_regular",
    ),
    "filesystem": ("ChecksummingFileSystemWriter", "ReadProgress", "VerifyingFileSystemReader"),
    "format": (
        "DCP_METADATA_FILE",
        "DCP_METADATA_KEYS_FILE",
        "FORMAT_NAME",
        "FileRecord",
        "MANIFEST_FILE",
        "MAX_EXAMPLES",
        "META_FILE",
        "MODEL_PREFIX",
        "Manifest",
        "OPTIMIZER_PREFIX",
        "TensorSpec",
        "compare_fingerprints",
        "count",
        "data_file_rank",
        "finite_int_or_none",
        "is_complete_checkpoint",
        "listed",
        "mesh_info",
        "model_fingerprint",
        "optimizer_fingerprint",
        "package_versions",
        "read_manifest",
        "summarise",
    ),
    "location": ("Location",),
    "metadata_index": (
        "BYTEORDERS",
        "Column",
        "KeyTable",
        "KeyTables",
        "RECORD_ATTR",
        "decode_key_index",
        "encode_key_index",
        "key_tables",
        "without_chunks",
    ),
    "safe_unpickling": (
        "check_dcp_metadata",
        "check_tensor_record",
        "inflate_record",
        "is_tensor_entry",
        "load_dcp_metadata",
        "load_weights_only",
    ),
    "store_location": ("ObjectStores", "locate", "request_deadline"),
    "streaming_reader": ("raw_bytes",),
    "upstream_checkpoint": (
        "UPSTREAM_FORMAT_NAME",
        "UPSTREAM_NOTE",
        "internal_keys",
        "is_upstream_checkpoint",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
