"""Full weights into a sharded model: from files, DCP directories and object stores."""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "FullWeightsLoad": "pretrained",
    "PretrainedWeights": "pretrained",
    "apply_pretrained_weights": "pretrained",
    "as_pretrained_weights": "pretrained",
    "load_full_weights": "pretrained",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
