"""The dependencies' warnings that a run of this package triggers on every machine and that
no user can act on, ignored only while that run lasts: from the strategy's
``setup_environment`` to its ``teardown``.

Each entry names its message, category and the module the warning is attributed to, so a
warning of the user's own, or another of the dependencies', still shows; and the filters
are removed at teardown, one by one, keeping every filter added meanwhile.

Alternatives rejected:
    * ``warnings.catch_warnings`` around each step: every enter and exit invalidates the
      "shown once" registries, so each of the user's own warnings would repeat every step;
      and on exit it drops the filters that modules imported meanwhile installed.
    * Process-wide filters (in ``__init__`` or ``PYTHONWARNINGS``): they would also hide
      these warnings from code that has nothing to do with this package.
"""

from __future__ import annotations

import warnings

__all__ = ["KNOWN_WARNINGS", "ignore", "ignore_known_warnings", "stop_ignoring"]

KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # megatron-fsdp's sharded parameters all-gather and reduce-scatter through torch's
    # deprecated collectives (megatron_fsdp/param_and_grad_buffer.py); torch attributes the
    # warning to its own wrapper.
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger",
    ),
    # torchdata's StatefulDataLoader calls torch's deprecated set_vital when Lightning
    # re-creates it with a distributed sampler.
    (r"'set_vital' is deprecated", UserWarning, r"torchdata\."),
    # Lightning's pytree helper builds torch's deprecated LeafSpec on every batch it flattens.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", Warning, r"lightning\."),
    # megatron-fsdp unshards a unit for backward from a full backward pre-hook on the unit;
    # on the root, whose inputs (token ids) need no gradient, torch says the hook fires on
    # the outputs' gradients, which is what megatron-fsdp means it to do. Attributed to the
    # call of ``backward``: the Fabric precision plugin's, or the LightningModule's.
    (
        r"Full backward hook is firing when gradients are computed with respect to module "
        r"outputs since no inputs require gradients",
        UserWarning,
        r"(lightning_megatron_fsdp\.fabric\.precision|lightning\.pytorch\.core\.module)$",
    ),
)


def ignore_known_warnings() -> list[tuple[object, ...]]:
    """Add an ``ignore`` filter for each of :data:`KNOWN_WARNINGS`.

    Returns:
        The filters added (those not already present), for :func:`stop_ignoring`.
    """
    return [entry for known in KNOWN_WARNINGS for entry in ignore(*known)]


def ignore(message: str, category: type[Warning], module: str) -> list[tuple[object, ...]]:
    """Add one ``ignore`` filter.

    Returns:
        The filter, if it was not already present (else nothing), for :func:`stop_ignoring`.
    """
    present = set(warnings.filters)
    warnings.filterwarnings("ignore", message=message, category=category, module=module)
    return [] if warnings.filters[0] in present else [warnings.filters[0]]


def stop_ignoring(added: list[tuple[object, ...]]) -> None:
    """Remove the filters :func:`ignore_known_warnings` added (any still present), keeping
    every other filter in its place."""
    for entry in added:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
    added.clear()
