"""The backends and layers packages import in any order, and only along their boundary: layers use
the Backend protocol (backends/base.py) alone, backends import nothing from layers, and no module
of either reaches itself again through its imports."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("forge_service.backends", "forge_service.layers")
BASE = "forge_service.backends.base"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    """Every module of forge_service, by dotted name."""
    return {_module_name(p): p for p in (ROOT / "forge_service").rglob("*.py")}


MODULES = _all_modules()


def _ours(package: str) -> list[str]:
    return sorted(m for m in MODULES if m == package or m.startswith(package + "."))


def imports_of(module: str) -> set[str]:
    """The forge_service modules `module` imports anywhere in its source: at the top, inside
    functions and under TYPE_CHECKING alike (a cycle hides in a deferred import just as well)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import sub` imports the module pkg.sub
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES}


def test_layers_import_nothing_from_backends_but_the_protocol() -> None:
    bad = {m: sorted(t for t in imports_of(m) if t.startswith("forge_service.backends") and t != BASE)
           for m in _ours("forge_service.layers")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_backends_import_nothing_from_layers() -> None:
    bad = {m: sorted(t for t in imports_of(m) if t.startswith("forge_service.layers"))
           for m in _ours("forge_service.backends")}
    assert {m: t for m, t in bad.items() if t} == {}


def _cycle_through(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start along `edges`, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle_through_backends_or_layers() -> None:
    # Every forge_service module's own imports. The root package is left out: its lazy `LLM`
    # attribute (a deferred import of the engine) is not something the modules below it use.
    edges = {module: imports_of(module) - {"forge_service"} for module in MODULES}
    cycles = {m: c for m in _ours(PACKAGES[0]) + _ours(PACKAGES[1]) if (c := _cycle_through(m, edges))}
    assert cycles == {}


# Run in a fresh interpreter: for each order, forget every forge_service module, import the modules
# of backends and layers in that order, and record what the first one loaded of the other package.
_SCRIPT = """
import importlib, json, sys
orders = json.loads(sys.argv[1])
report = []
for order in orders:
    for name in [n for n in sys.modules if n == "forge_service" or n.startswith("forge_service.")]:
        del sys.modules[name]
    loaded_by_first = None
    for i, module in enumerate(order):
        importlib.import_module(module)
        if i == 0:
            loaded_by_first = sorted(n for n in sys.modules if n.startswith(("forge_service.backends",
                                                                              "forge_service.layers")))
    report.append(loaded_by_first)
print(json.dumps(report))
"""


def test_every_module_imports_first_in_a_fresh_interpreter_and_loads_only_its_side() -> None:
    modules = _ours(PACKAGES[0]) + _ours(PACKAGES[1])
    orders = [[m] + [n for n in modules if n != m] for m in modules] + [modules[::-1]]
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(orders)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = dict(zip((order[0] for order in orders), json.loads(proc.stdout.splitlines()[-1])))
    for first, names in loaded.items():
        if first.startswith("forge_service.layers"):
            # a layer loads the protocol (and its package's light __init__), no backend
            assert {n for n in names if n.startswith("forge_service.backends")} <= {"forge_service.backends", BASE}, \
                (first, names)
        else:
            assert not [n for n in names if n.startswith("forge_service.layers")], (first, names)
