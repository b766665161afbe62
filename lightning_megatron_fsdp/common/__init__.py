"""What both strategies (Trainer and Fabric) share: options, process group and model
setup, precision flags and clipping, exact resume, a sharded model's checkpoint, and the
process's end.
"""

from lightning_megatron_fsdp.lazy_exports import lazy_exports

_EXPORTS = {
    "exact_resume": ("ExactResume", "RNG_STATES_KEY"),
    "model_setup": ("move_unsharded_state",),
    "options": ("ShardingOptions", "StrategyOptionsMixin", "takes_sharding_options"),
    "precision": (
        "MegatronFSDPPrecision",
        "clip_sharded_grad_norm_",
        "clip_sharded_grad_value_",
        "precision_property",
        "reject_closure_optimizer",
    ),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
