"""The distributed checkpoint protocol: a save's and a load's phases and the Lightning plugin.

A save agrees, writes and commits; a load opens, agrees, reads and applies; each phase
is one collective round over the storage layer (``storage/``). Lightning reaches it
through :class:`MegatronFSDPCheckpointIO`.
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "io": ("MegatronFSDPCheckpointIO",),
    "load": ("LoadOptions", "open_checkpoint", "read_checkpoint"),
    "save": ("PerRank",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
