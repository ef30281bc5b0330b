"""The layers of the house stay apart: the gateway knows backends only through their public surface, backends
never know the gateway, and neither imports the benchmark."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parent.parent / "src"

BACKENDS_SURFACE = frozenset({"backends.interface", "backends.errors", "backends.config", "backends.registry"})
"""The only modules of ``backends`` the gateway may import: the interface, its errors and config, and the registry."""

LOAD_GENERATOR = "loadgen"
"""The benchmark's package (``src/loadgen``): never part of the server; only the CLI's ``bench`` command loads it,
lazily, inside the command (``tests/loadgen/test_packaging.py`` checks that the server never imports it)."""


class Import(NamedTuple):
    module: str  # the importing module, dotted
    imported: str  # the imported module, dotted (``from a import b`` is ``a.b``)
    line: int

    def __str__(self) -> str:
        return f"{self.module} imports {self.imported} (line {self.line})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, source: str | None = None) -> Iterator[Import]:
    """Every import in the file (or in ``source`` as if it were the file), at any depth: inside functions and
    ``TYPE_CHECKING`` blocks too; relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield Import(module, f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno)


def _package_imports(package: str) -> list[Import]:
    return [found for path in sorted((SRC / package).rglob("*.py")) for found in _imports(path)]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _beyond_surface(found: Import) -> bool:
    if not _within(found.imported, "backends") or found.imported == "backends":
        return False
    return not any(_within(found.imported, surface) for surface in BACKENDS_SURFACE)


def gateway_reaching_into_backends() -> list[Import]:
    return [found for found in _package_imports("gateway") if _beyond_surface(found)]


def test_gateway_imports_backends_only_through_interface_errors_config_and_registry() -> None:
    violations = gateway_reaching_into_backends()
    assert not violations, "the gateway reaches past the backends' surface:\n" + "\n".join(map(str, violations))


def test_backends_never_import_the_gateway() -> None:
    violations = [found for found in _package_imports("backends") if _within(found.imported, "gateway")]
    assert not violations, "backends know the gateway:\n" + "\n".join(map(str, violations))


def _in_the_bench_command(found: Import) -> bool:
    """The one sanctioned use: the CLI's ``bench`` command (and its option parsers) import the load generator
    lazily, inside a function, or for its type hints only (under ``if TYPE_CHECKING:``), so ``deepinfer-gateway
    serve`` never loads it."""
    if found.module != "gateway.cli":
        return False
    tree = ast.parse((SRC / "gateway" / "cli.py").read_text())
    return any(
        (isinstance(node, ast.FunctionDef) or _type_checking_only(node))
        and node.lineno <= found.line <= (node.end_lineno or node.lineno)
        for node in tree.body
    )


def _type_checking_only(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def test_neither_gateway_nor_backends_import_the_benchmark() -> None:
    violations = [
        found
        for package in ("gateway", "backends")
        for found in _package_imports(package)
        if (_within(found.imported, "bench") or _within(found.imported, LOAD_GENERATOR))
        and not _in_the_bench_command(found)
    ]
    assert not violations, "serving code imports the benchmark:\n" + "\n".join(map(str, violations))


class Probe(NamedTuple):
    module: str
    what: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}: {self.what} (line {self.line})"


def _backend_probes(path: Path, source: str | None = None) -> Iterator[Probe]:
    """``getattr``/``hasattr`` on something named a backend, and ``__getattr__`` forwarding: capabilities are
    protocols of ``backends.interface``, found with ``gateway.capabilities``, never probed for by name."""
    module = _module_name(path)
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, filename=str(path))):
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            yield Probe(module, "defines __getattr__", node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and "backend" in ast.unparse(node.args[0]).lower()
        ):
            yield Probe(module, f"{node.func.id} on {ast.unparse(node.args[0])}", node.lineno)


def test_the_gateway_never_probes_a_backend_for_attributes() -> None:
    probes = [probe for path in sorted((SRC / "gateway").rglob("*.py")) for probe in _backend_probes(path)]
    assert not probes, "the gateway probes backends by attribute name:\n" + "\n".join(map(str, probes))


def test_the_rule_sees_imports_inside_functions_and_relative_ones() -> None:
    """The walker itself: a lazy import and a relative one are both found, and judged by where they lead."""
    probe = SRC / "gateway" / "endpoints" / "layers_probe.py"  # never written: its source is given
    source = "def f():\n    from backends.engine.driver import DriverStats\nfrom ..capabilities import capability\n"
    found = {item.line: item for item in _imports(probe, source)}
    assert found[2] == Import("gateway.endpoints.layers_probe", "backends.engine.driver.DriverStats", 2)
    assert found[3] == Import("gateway.endpoints.layers_probe", "gateway.capabilities.capability", 3)
    assert _beyond_surface(found[2]) and not _beyond_surface(found[3])


def test_the_probe_rule_sees_getattr_on_a_backend_and_forwarding() -> None:
    probe = SRC / "gateway" / "endpoints" / "layers_probe.py"  # never written: its source is given
    source = (
        "def f(backend, request):\n"
        "    getattr(request.state, 'log', None)\n"
        "    return getattr(backend, 'fingerprint', None)\n"
        "class W:\n"
        "    def __getattr__(self, name):\n"
        "        return name\n"
    )
    found = {item.line: item.what for item in _backend_probes(probe, source)}
    assert found == {3: "getattr on backend", 5: "defines __getattr__"}
