"""What both strategies (Trainer and Fabric) share: options, process group and model
setup, precision flags and clipping, exact resume, a sharded model's checkpoint, and the
process's end.
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "ExactResume": "exact_resume",
    "RNG_STATES_KEY": "exact_resume",
    "ModelSharder": "model_setup",
    "move_unsharded_state": "model_setup",
    "StrategyOptions": "options",
    "StrategyOptionsMixin": "options",
    "MegatronFSDPPrecision": "precision",
    "clip_sharded_grad_norm_": "precision",
    "clip_sharded_grad_value_": "precision",
    "reject_closure_optimizer": "precision",
    "to_megatron_precision": "precision",
    "load_into_sharded_model": "sharded_checkpoint",
    "save_sharded_checkpoint": "sharded_checkpoint",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
