"""The package's shape, as docs/DESIGN.md states it: a one-way import graph, no private
name crossing a module boundary, and framework internals reached through adapters only.

Pure source analysis (``ast``), no imports of the package: fast, and it fails the moment a
change adds an upward import, imports another module's underscore name, or touches a
private megatron-fsdp, torch or Lightning name outside its adapter.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_megatron_fsdp"
ROOT = PACKAGE.parent
DESIGN = ROOT / "docs" / "DESIGN.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# The framework adapters (DESIGN.md, "Layers"): the only modules that may use private
# names of megatron-fsdp (the first two), torch and Lightning.
MEGATRON_MODULES = {"_megatron", "cpu_execution"}
ADAPTERS = MEGATRON_MODULES | {"_torch", "_lightning"}
FRAMEWORKS = (
    "torch",
    "lightning",
    "lightning_utilities",
    "torchmetrics",
    "torchdata",
    "megatron_fsdp",
)
# Public megatron-fsdp names any module may use.
PUBLIC_MEGATRON = {"megatron_fsdp": {"MixedPrecisionPolicy"}}


def _name(path: Path) -> str:
    """``storage.format`` for ``lightning_megatron_fsdp/storage/format.py``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, ast.Module]:
    return {_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _stem(name: str) -> str:
    """``_megatron`` for ``megatron._megatron``: modules are told apart by file name, so
    the rules hold wherever a module sits in the folder tree."""
    return name.rsplit(".", 1)[-1]


def _module_named(stem: str) -> ast.Module:
    (tree,) = [tree for name, tree in _modules().items() if _stem(name) == stem]
    return tree


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_module(target: str) -> str | None:
    """The package module an import names (``storage.format``), or ``None``."""
    if target == "lightning_megatron_fsdp":
        return None
    if target.startswith("lightning_megatron_fsdp."):
        return target.removeprefix("lightning_megatron_fsdp.")
    return None


# The folders as layers, bottom up (docs/DESIGN.md, "Layers"). A module imports from its
# own folder and from lower layers only, never from a folder beside it, and across folders
# only the names the folder's ``__init__`` lists in ``__all__``. The megatron-fsdp adapter
# module is reached by name (``from lightning_megatron_fsdp.megatron import _megatron``), as
# ``_torch`` and ``_lightning`` are.
LAYERS = [
    {"_torch", "_lightning", "errors", "known_warnings", "lazy_exports"},
    {"agreement"},
    {"megatron"},
    {"storage"},
    {"checkpoint"},
    {"tools", "weights"},
    {"common"},
    {"strategies", "fabric"},
]
ADAPTER_MODULES = {"_megatron"}


def _unit(name: str) -> str:
    """The folder of ``checkpoint.save`` (``checkpoint``), or a top-level module's name."""
    return name.split(".")[0]


def _layer(unit: str) -> int:
    (layer,) = [i for i, units in enumerate(LAYERS) if unit in units]
    return layer


def _folder_exports(folder: str) -> set[str]:
    """The names ``folder/__init__.py`` maps in ``_EXPORTS`` (or lists in ``__all__``)."""
    tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            return set().union(*ast.literal_eval(node.value).values())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def _cross_imports() -> list[tuple[str, str, str, list[str]]]:
    """(importing module, its unit, imported unit, names) for every import, module level or
    inside a function, from one unit of the package into another."""
    found = []
    for name, tree in _modules().items():
        if name == "__init__":
            continue  # the package's face sits above every layer
        for target, names in _imports(tree):
            imported = _package_module(target)
            if target == "lightning_megatron_fsdp":
                units = [(n, []) for n in names]  # ``from lightning_megatron_fsdp import _torch``
            elif imported is None:
                continue
            else:
                units = [(imported, names)]
            for module, imported_names in units:
                if _unit(module) != _unit(name):
                    found.append((name, _unit(name), module, imported_names))
    return found


def test_folders_are_layers() -> None:
    units = {_unit(name) for name in _modules() if name != "__init__"}
    assert units == set().union(*LAYERS), units ^ set().union(*LAYERS)
    upward = [
        f"{name} imports {module}"
        for name, unit, module, _ in _cross_imports()
        if _layer(_unit(module)) >= _layer(unit)
    ]
    assert not upward, upward


def test_folders_are_used_through_their_init() -> None:
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    offenders = []
    used: dict[str, set[str]] = {folder: set() for folder in folders}
    for name, _, module, names in _cross_imports():
        folder = _unit(module)
        if folder not in folders:
            continue
        if module != folder:
            offenders.append(f"{name}: from lightning_megatron_fsdp.{module} import ...")
            continue
        for imported in names:
            if imported in ADAPTER_MODULES:
                continue
            used[folder].add(imported)
            if imported not in _folder_exports(folder):
                offenders.append(f"{name}: {imported} is not in {folder}/__init__.py's __all__")
    assert not offenders, offenders
    # Each folder's face lists what others use, nothing more (the package's own __init__
    # counts as a user: it re-exports the public API).
    package = ast.parse((PACKAGE / "__init__.py").read_text())
    for target, names in _imports(package):
        folder = _unit(_package_module(target) or "")
        if folder in used:
            used[folder].update(names)
    # The top layer's faces (strategies/, fabric/) are the users'.
    unused = {f: sorted(_folder_exports(f) - used[f]) for f in folders - LAYERS[-1]}
    assert not any(unused.values()), unused


def test_folder_exports_name_what_their_modules_define() -> None:
    """Each name a folder's ``_EXPORTS`` maps is defined (or imported) at the top of the
    module it names: a face is imported lazily, so a typo would otherwise surface only at
    its first use."""
    missing = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        folder = init.parent.name
        tree = ast.parse(init.read_text())
        exports = next(
            (
                ast.literal_eval(node.value)
                for node in tree.body
                if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
            ),
            {},
        )
        for module, names in exports.items():
            defined = set()
            for node in _modules()[f"{folder}.{module}"].body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    defined.update(t.id for t in targets if isinstance(t, ast.Name))
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    defined.update((a.asname or a.name).split(".")[0] for a in node.names)
            missing += [
                f"{folder}/__init__.py: {name} is not defined in {folder}.{module}"
                for name in names
                if name not in defined
            ]
    assert not missing, missing


def test_the_package_lists_what_it_exports() -> None:
    """The package's literal ``__all__`` (for type checkers) names exactly what its lazy
    ``_EXPORTS`` imports on first use."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    values = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    exported = set().union(*ast.literal_eval(values["_EXPORTS"]).values())
    assert sorted(ast.literal_eval(values["__all__"])) == sorted(exported)


def test_no_import_cycle_inside_a_folder() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        graph[name] = set()
        for target, names in _imports(tree):
            imported = _package_module(target)
            if imported is None:
                continue
            candidates = [imported, *(f"{imported}.{n}" for n in names)]
            graph[name].update(c for c in candidates if c in modules and c != name)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if _unit(nxt) != _unit(node) or nxt.endswith("__init__"):
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_no_private_name_crosses_a_module_boundary() -> None:
    """A name with a leading underscore is its module's own: no other module imports it.
    The adapters themselves (``from lightning_megatron_fsdp import _torch``) are modules
    meant to be imported."""
    offenders = []
    for name, tree in _modules().items():
        for target, names in _imports(tree):
            if target != "lightning_megatron_fsdp" and _package_module(target) is None:
                continue
            for imported in names:
                if not _private(imported) or imported in {_stem(a) for a in ADAPTERS}:
                    continue
                offenders.append(f"{name}: from {target} import {imported}")
    assert not offenders, offenders


def _attributes_our_classes_define() -> set[str]:
    """Every attribute a class of the package defines: its methods, nested classes and
    class-level variables, and what its methods assign on ``self``/``cls``. An underscore
    attribute outside this set is another library's, whatever the object it is read on;
    a module-level function or a local variable of the same name does not make it ours."""
    ours: set[str] = set()
    for tree in _modules().values():
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    ours.add(node.name)
                elif isinstance(node, ast.Assign):
                    ours.update(t.id for t in node.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    ours.add(node.target.id)
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in {"self", "cls"}
                ):
                    ours.add(node.attr)
    return ours


def _lightning_private_attributes() -> set[str]:
    """Every underscore attribute Lightning's (and torchmetrics') source assigns or defines
    on its classes (read from the installed files, not imported): ours too if a class of
    the package defines the same name, but still Lightning's when read or written on
    Lightning's objects."""
    roots = []
    for package in ("lightning", "torchmetrics"):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is missing"
        roots.extend(spec.submodule_search_locations)
    names: set[str] = set()
    for root in roots:
        for path in Path(root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    attr = node.attr
                elif isinstance(node, ast.ClassDef):
                    names.update(f"_{node.name}{n.name}" for n in node.body if _mangled(n))
                    continue
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    attr = node.name
                else:
                    continue
                if _private(attr):
                    names.add(attr)
    return names


def _mangled(node: ast.AST) -> bool:
    """A ``__name`` method, reachable from outside only as ``_Class__name``."""
    return (
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("__")
        and not node.name.endswith("__")
    )


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _instance_dict_of(node: ast.AST) -> ast.expr | None:
    """``obj`` of ``obj.__dict__`` or ``vars(obj)``, else ``None``."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "vars"
        and len(node.args) == 1
    ):
        return node.args[0]
    return None


def _attribute_uses(tree: ast.Module) -> list[tuple[int, ast.expr | None, str]]:
    """Every attribute read or written, as (line, object, name): ``obj.name``;
    ``getattr``/``setattr``/``hasattr``/``delattr`` and ``object.__setattr__`` with the name
    as a string constant; a string key of ``obj.__dict__`` or ``vars(obj)`` (subscript,
    ``get``, ``pop``, ``setdefault``); and, with the object unknown (``None``), a string in
    a tuple, list or set literal, the way a list of attribute names to read is written."""
    uses: list[tuple[int, ast.expr | None, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            uses.append((node.lineno, node.value, node.attr))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func, name = node.func, _string(node.args[1])
            by_name = isinstance(func, ast.Name) and func.id in {
                "getattr",
                "setattr",
                "hasattr",
                "delattr",
            }
            by_object = (
                isinstance(func, ast.Attribute)
                and func.attr == "__setattr__"
                and isinstance(func.value, ast.Name)
                and func.value.id == "object"
            )
            if name is not None and (by_name or by_object):
                uses.append((node.lineno, node.args[0], name))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"get", "pop", "setdefault"}
            and node.args
        ):
            owner, name = _instance_dict_of(node.func.value), _string(node.args[0])
            if owner is not None and name is not None:
                uses.append((node.lineno, owner, name))
        elif isinstance(node, ast.Subscript):
            owner, name = _instance_dict_of(node.value), _string(node.slice)
            if owner is not None and name is not None:
                uses.append((node.lineno, owner, name))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                name = _string(element)
                if name is not None:
                    uses.append((node.lineno, None, name))
    return uses


def test_private_framework_names_only_in_adapters() -> None:
    """No module but an adapter imports a private torch / Lightning / megatron-fsdp name
    or module, or reads or writes an underscore attribute of a framework's object: one no
    class of the package defines, or one Lightning defines, on anything but ``self`` (a
    subclass may use its base's protected members, as Lightning's own strategies do);
    ``getattr``/``setattr``/``hasattr``/``delattr`` with the name as a string count too."""
    ours = _attributes_our_classes_define()
    lightning = _lightning_private_attributes()
    offenders = []
    for name, tree in _modules().items():
        if _stem(name) in ADAPTERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                root = node.module.split(".")[0]
                if root not in FRAMEWORKS:
                    continue
                private = [a.name for a in node.names if _private(a.name)]
                if private or any(_private(p) for p in node.module.split(".")):
                    offenders.append(
                        f"{name}.py:{node.lineno}: from {node.module} import {private}"
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in FRAMEWORKS and any(_private(p) for p in parts):
                        offenders.append(f"{name}.py:{node.lineno}: import {alias.name}")
        for line, owner, attr in _attribute_uses(tree):
            if not _private(attr):
                continue
            if owner is None:  # a name in a literal: flagged if it names Lightning's attribute
                if attr in lightning:
                    offenders.append(f"{name}.py:{line}: {attr!r}")
                continue
            on_self = isinstance(owner, ast.Name) and owner.id in {"self", "cls"}
            if attr not in ours or (attr in lightning and not on_self):
                offenders.append(f"{name}.py:{line}: .{attr}")
    assert not offenders, offenders
    # Not vacuous: the adapters themselves use such names.
    torch_private = {
        n.attr for n in ast.walk(_module_named("_torch")) if isinstance(n, ast.Attribute)
    }
    assert {"_local_tensor", "_StorageInfo", "_write_files_from_queue"} <= torch_private
    lightning_private = {attr for _, _, attr in _attribute_uses(_module_named("_lightning"))}
    assert {"_Launcher", "_init_dist_connection", "_wrap_closure"} <= lightning_private
    assert {"_optimizer", "_current_fx_name", "_ModelCheckpoint__resolve_ckpt_dir"} <= lightning


def test_megatron_internals_only_through_one_module() -> None:
    offenders = []
    for name, tree in _modules().items():
        if _stem(name) in MEGATRON_MODULES:
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
# tensor_records reads ``torch.Tensor.layout`` (strided or not), not a ``GlobalLayout``;
# metadata_records names ``torch.layout`` and DCP's ``TensorProperties.layout`` field.
TORCH_NAMESAKES = {("storage.records", "layout"), ("storage.metadata_records", "layout")}


def test_megatron_attributes_only_in_one_module() -> None:
    offenders = []
    for name, tree in _modules().items():
        if _stem(name) in MEGATRON_MODULES:
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
    shim = _module_named("_megatron")
    used = {n.attr for n in ast.walk(shim) if isinstance(n, ast.Attribute)}
    assert {"main_weight", "layout", "tensor_to_offset", "_unshard_event"} <= used


# docs/DESIGN.md stays short enough for a newcomer to read; module detail goes in docstrings.
DESIGN_MAX_LINES = 700


def _headings(doc: Path) -> list[str]:
    return [
        line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")
    ]


def _citations(doc_name: str) -> list[tuple[str, str]]:
    """Every ``<doc_name>, "Section"`` citation (``"A", "B" and "C"`` chains too) in the
    package, the tests, the benchmarks, the examples, the docs and the README, as (file,
    section). Comment markers and line breaks inside a citation are folded away first."""
    chain = re.compile(re.escape(doc_name) + r'`?\s*[,(]\s*("[^"]+"(?:\s*(?:,|and)\s*"[^"]+")*)')
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("lightning_megatron_fsdp", "tests", "benchmarks", "examples"):
        files += sorted((ROOT / folder).rglob("*.py")) + sorted((ROOT / folder).rglob("*.md"))
    found = []
    for path in files:
        text = re.sub(r"\s*\n\s*(?:#+ ?)?", " ", path.read_text())
        for match in chain.finditer(text):
            found += [(path.name, s) for s in re.findall(r'"([^"]+)"', match.group(1))]
    return found


def _cites_a_heading(section: str, headings: list[str]) -> bool:
    """``"Save path"`` names ``## Save path (one way)``: a heading that is the section, or
    begins with it and then a space, colon or parenthesis."""
    return any(re.match(re.escape(section) + r"(?:$|[\s:(])", h) for h in headings)


def test_design_is_short() -> None:
    lines = len(DESIGN.read_text().splitlines())
    assert lines <= DESIGN_MAX_LINES, (
        f"docs/DESIGN.md has {lines} lines, more than {DESIGN_MAX_LINES}: move a module's "
        "mechanism into its docstring and measurements into benchmarks/RESULTS.md"
    )


def test_doc_citations_name_existing_sections() -> None:
    for doc in (DESIGN, RESULTS):
        headings = _headings(doc)
        citations = _citations(doc.name)
        # Not vacuous: the package, the tests and the README cite both documents.
        assert len(citations) >= 5, (doc.name, citations)
        wrong = [f"{f}: {s!r}" for f, s in citations if not _cites_a_heading(s, headings)]
        assert not wrong, f"{doc.name} has no such heading: {wrong}"


# Lightning's ``ModelParallelStrategy`` defines 28 methods of its own; ours keeps each
# mechanism in the module that holds it (steps.py, join.py, launcher.py, common/) and its own
# body to Lightning's hooks, thin.
MAX_STRATEGY_METHODS = 30


def test_trainer_strategy_is_thin() -> None:
    """``MegatronFSDPStrategy`` (Trainer) defines at most ``MAX_STRATEGY_METHODS`` methods in
    its own body (a property's getter and setter count as two)."""
    tree = _modules()["strategies.strategy"]
    (strategy,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "MegatronFSDPStrategy"
    ]
    methods = [
        node.name
        for node in strategy.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    assert len(methods) <= MAX_STRATEGY_METHODS, (
        f"MegatronFSDPStrategy defines {len(methods)} methods (at most {MAX_STRATEGY_METHODS}): "
        f"{methods}; move a mechanism into the module that holds it"
    )


def test_every_benchmark_and_example_imports() -> None:
    """A benchmark that no longer imports (a name moved in the package) is found here, not
    by the next person who runs it: each script under ``benchmarks/`` and ``examples/`` is
    imported, in one fresh interpreter, without running its ``main``."""
    import subprocess
    import sys

    modules = sorted(
        f"{folder}.{path.stem}"
        for folder in ("benchmarks",)
        for path in (ROOT / folder).glob("*.py")
        if path.stem != "__init__"
    )
    examples = sorted(str(path) for path in (ROOT / "examples").glob("*.py"))
    script = (
        "import importlib, importlib.util, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"for i, path in enumerate({examples!r}):\n"
        "    spec = importlib.util.spec_from_file_location(f'_example_{i}', path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


# Names that tell one storage backend from another: only storage/ may use them. Everything
# above works through the ``Location`` that ``storage.locate`` returns (issue 32).
BACKEND_SWITCHES = {
    "is_url",
    "url_protocol",
    "local_path",
    "open_store",
    "ObjectStore",
    "StoreLocation",
    "StoreCheckpoint",
    "StoreObject",
    "LocalLocation",
    "VerifyingFsspecReader",
    "ChecksummingFsspecWriter",
}


def _is_path_test(node: ast.AST) -> bool:
    """``isinstance(x, os.PathLike)`` (or ``PathLike``) alone: whether a location is a
    local file the OS opens. A union with ``str`` checks a user's argument, not a backend."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
    ):
        return False
    kind = node.args[1]
    return (isinstance(kind, ast.Attribute) and kind.attr == "PathLike") or (
        isinstance(kind, ast.Name) and kind.id == "PathLike"
    )


def test_no_backend_switch_outside_storage() -> None:
    """No module outside ``storage/`` asks which backend holds a location: it neither
    imports nor names a backend's class or URL test, nor asks whether a location is a
    local path (``isinstance(location, os.PathLike)``)."""
    offenders = []
    for name, tree in _modules().items():
        if _unit(name) == "storage":
            continue
        for node in ast.walk(tree):
            if _is_path_test(node):
                offenders.append(f"{name}:{node.lineno}: isinstance(..., os.PathLike)")
                continue
            if isinstance(node, ast.ImportFrom):
                used = {a.name for a in node.names}
            elif isinstance(node, ast.Name):
                used = {node.id}
            elif isinstance(node, ast.Attribute):
                used = {node.attr}
            else:
                continue
            offenders += [f"{name}:{node.lineno}: {n}" for n in sorted(used & BACKEND_SWITCHES)]
    assert not offenders, offenders
