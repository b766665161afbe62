"""The package's shape, as docs/DESIGN.md states it: sizes, a one-way import graph, and
megatron-fsdp internals (imports and attributes) reached through one module only.

Pure source analysis (``ast``), no imports of the package: fast, and it fails the moment a
change adds an upward import, a private megatron-fsdp access elsewhere, or grows a module
past its bound.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_megatron_fsdp"
DESIGN = PACKAGE.parent / "docs" / "DESIGN.md"
# The modules that may reach into megatron-fsdp's internals (DESIGN.md, "Modules").
MEGATRON_MODULES = {"_megatron", "cpu_execution"}
# Public megatron-fsdp names any module may use.
PUBLIC_MEGATRON = {"megatron_fsdp": {"MixedPrecisionPolicy"}}


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _design_order() -> list[str]:
    """Module names in the order of DESIGN.md's module table."""
    order = []
    for line in DESIGN.read_text().splitlines():
        if line.startswith("| `"):
            order.extend(re.findall(r"`(\w+)\.py`", line.split("|")[1]))
    return order


def test_strategy_is_glue_and_no_module_is_huge() -> None:
    sizes = {p.stem: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert sizes["strategy"] <= 1000, sizes["strategy"]
    too_big = {name: n for name, n in sizes.items() if n > 1000}
    assert not too_big, too_big


def test_import_graph_is_one_way_in_design_order() -> None:
    order = _design_order()
    modules = _modules()
    assert set(modules) - {"__init__"} <= set(order), set(modules) - set(order)
    rank = {name: i for i, name in enumerate(order)}
    upward = []
    for name, tree in modules.items():
        if name == "__init__":
            continue
        for target, _ in _imports(tree):
            if not target.startswith("lightning_megatron_fsdp."):
                continue
            imported = target.split(".")[1]
            # cli.py shares its table row with export.py but sits at the bottom of the graph.
            mine = len(order) if name == "cli" else rank[name]
            if rank[imported] >= mine and imported != name:
                upward.append(f"{name} imports {imported}")
    assert not upward, upward


def test_megatron_internals_only_through_one_module() -> None:
    offenders = []
    for name, tree in _modules().items():
        if name in MEGATRON_MODULES:
            continue
        for target, names in _imports(tree):
            if not target.startswith("megatron_fsdp"):
                continue
            allowed = PUBLIC_MEGATRON.get(target, set())
            if not names or not set(names) <= allowed:
                offenders.append(f"{name}: from {target} import {', '.join(names) or '*'}")
    assert not offenders, offenders


# Attributes of megatron-fsdp's internal objects (modules, parameter groups, DBuffers,
# layouts, contexts) on 0.6.1 or 0.7. Outside MEGATRON_MODULES none may be read or written:
# the package asks _megatron for them (``main_weight``, ``owned_range``, ``group_mesh``,
# ...), so a renamed internal breaks one module, not several. Generic names (``mesh``,
# ``offset``, ``context``) are left out: they are common on torch and DCP objects too.
MEGATRON_ATTRIBUTES = {
    "_context",
    "_FSDP_CONTEXT",
    "_lazy_init_context",
    "_mfsdp_parameter_group",
    "_owning_module",
    "_parameter_groups",
    "_reshard_parameter_groups",
    "_set_module_parameter",
    "_set_module_parameters",
    "_switch_to_sharded_parameters",
    "_switch_to_unsharded_parameters",
    "_unshard_event",
    "_unshard_parameter_groups",
    "_unsharded_model_weight",
    "allgather_stream",
    "allocation_stream",
    "backward_order",
    "forward_order",
    "fsdp_parameters",
    "get_dtensor",
    "get_local_tensor",
    "is_last_microbatch",
    "layout",
    "local_buffer",
    "main_grad",
    "main_weight",
    "model_weight",
    "owning_module",
    "parameter_groups",
    "parameter_names",
    "phase",
    "pre_backward",
    "reduce_scatter_stream",
    "sharded_parameters",
    "sync_model_weight_from_main_weight",
    "tensor_to_offset",
    "unsharded_parameters",
}


# (module, attribute) pairs that name a torch attribute of the same name, reviewed:
# tensor_records reads ``torch.Tensor.layout`` (strided or not), not a ``GlobalLayout``.
TORCH_NAMESAKES = {("tensor_records", "layout")}


def test_megatron_attributes_only_in_one_module() -> None:
    offenders = []
    for name, tree in _modules().items():
        if name in MEGATRON_MODULES:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in MEGATRON_ATTRIBUTES:
                continue
            if (name, node.attr) in TORCH_NAMESAKES:
                continue
            # ``_megatron.main_weight(group)``: the shim's function of that name is the way.
            if not (isinstance(node.value, ast.Name) and node.value.id == "_megatron"):
                offenders.append(f"{name}.py:{node.lineno}: .{node.attr}")
    assert not offenders, offenders
    # Not vacuous: the shim module itself reads them.
    shim = _modules()["_megatron"]
    used = {n.attr for n in ast.walk(shim) if isinstance(n, ast.Attribute)}
    assert {"main_weight", "layout", "tensor_to_offset", "_unshard_event"} <= used
