"""Full weights into a sharded model: from files, DCP directories and object stores."""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "pretrained": (
        "FullWeightsLoad",
        "PretrainedWeights",
        "apply_pretrained_weights",
        "as_pretrained_weights",
        "load_full_weights",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
