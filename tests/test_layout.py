"""The layout's import rules, read from the source with `ast` (nothing is imported):

- no module-level import cycle inside `vtoken/` or `vtoken_cli/` (imports inside functions and
  under `if TYPE_CHECKING:` run later or never, so they do not count);
- `vtoken/` never imports typer or rich, anywhere in a file;
- a run is made from an experiment in `vtoken/engine/experiment.py` only (`Experiment.run`,
  `Run.with_variant`): no other module builds a `RunSpec` or `replace`s a `variant` in;
- a private method of vtoken's (`def _name`) is called on `self`, `cls` or `super()`, or on
  another instance inside the class that defines it, only: what one object hands another (a
  replayer's loaded model, the runner's copy) is public and documented.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("vtoken", "vtoken_cli")
CLI_LIBRARIES = ("typer", "rich")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    """Every module of both packages: dotted name -> file."""
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported: top level, and inside top-level `if`
    (but not the `if TYPE_CHECKING:` branch) and `try`; never inside a function or a class."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not is_type_checking(node.test):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from module_level_imports(block)


def ancestors(name: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def absolute_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a `from ... import` reads from, with relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imported_modules(importer: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of both packages that importing `importer` imports at once.

    `import a.b.c` imports the packages a and a.b and the module a.b.c; `from a.b import c`
    imports a.b.c when that is a module, else a.b itself. A package that contains `importer` is
    already being imported whenever `importer` is, so reaching it only through a dotted path is
    no edge; reading a name from it (`from pkg import name`) is one.
    """
    own_packages = set(ancestors(importer))
    found: set[str] = set()

    def add_path(name: str) -> None:
        found.update(a for a in [*ancestors(name), name] if a not in own_packages)

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in module_level_imports(tree.body):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add_path(alias.name)
            continue
        base = absolute_base(node, importer, path.name == "__init__.py")
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in modules:
                add_path(submodule)
            else:
                add_path(base)
                found.add(base)  # a name read from it: it must have run, even if it contains `importer`
    return {name for name in found if name in modules and name != importer}


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    modules = set(files)
    return {name: imported_modules(name, path, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One cycle among `nodes` (edges leaving `nodes` ignored), as [a, b, ..., a]; or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node] & nodes):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_sees_both_kinds_of_from_import():
    graph = import_graph()

    assert "vtoken_cli.console" in graph["vtoken_cli.app"]  # from vtoken_cli.console import stdout
    assert "vtoken.defaults" in graph["vtoken_cli.commands.compare"]  # from vtoken import defaults
    assert "vtoken" in graph["vtoken_cli.commands.compare"]  # ... which runs vtoken/__init__.py


def test_find_cycle_reports_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

    assert find_cycle(graph, set(graph)) == ["a", "b", "c", "a"]
    assert find_cycle(graph, {"a", "b", "d"}) is None


def test_no_import_cycle_in_the_cli():
    graph = import_graph()
    cycle = find_cycle(graph, {name for name in graph if in_package(name, "vtoken_cli")})

    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_in_the_library():
    graph = import_graph()
    cycle = find_cycle(graph, {name for name in graph if in_package(name, "vtoken")})

    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_the_library_never_imports_typer_or_rich():
    offenders = []
    for name, path in source_files().items():
        if not in_package(name, "vtoken"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{name} imports {t}" for t in targets if t.split(".")[0] in CLI_LIBRARIES]

    assert offenders == []


RUN_SOURCES = ("vtoken", "vtoken_cli", "benchmarks", "scripts")


def run_builders(tree: ast.AST) -> list[int]:
    """Lines that make a run other than through `Experiment.run`: a `RunSpec(...)` call, or a
    `replace(..., variant=...)` (dataclasses' replace, by name or as `dataclasses.replace`)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else (
            node.func.attr if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "dataclasses" else None)
        if name == "RunSpec" or (name == "replace" and any(k.arg == "variant" for k in node.keywords)):
            lines.append(node.lineno)
    return lines


def test_the_run_builder_detector_sees_both_forms():
    tree = ast.parse("a = replace(config, variant='vtoken', num_blocks=3)\nb = RunSpec('native', 4)\n"
                     "c = dataclasses.replace(x, variant=v)\nd = replace(e, seed=1)\nf = text.replace('a', 'b')\n")

    assert run_builders(tree) == [1, 2, 3]


def test_only_the_experiment_module_makes_a_run_from_an_experiment():
    config = ROOT / "vtoken" / "engine" / "experiment.py"
    paths = [path for package in RUN_SOURCES for path in sorted((ROOT / package).rglob("*.py")) if path != config]
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in paths
                 for line in run_builders(ast.parse(path.read_text(), filename=str(path)))]

    assert offenders == []
    assert run_builders(ast.parse(config.read_text())) != []  # the detector still sees the one place


def private_method_calls(tree: ast.AST, private_names: set[str]) -> list[tuple[int, str]]:
    """(line, call) of every call `x._name(...)` with `_name` in `private_names` on anything but
    `self`, `cls` or `super()`, outside a class that defines `_name` itself (a class may use its
    own private methods on another instance of it)."""
    calls = []

    def visit(node: ast.AST, own_methods: frozenset[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own_methods = frozenset(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        is_method_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if is_method_call and node.func.attr in private_names and node.func.attr not in own_methods:
            owner = node.func.value
            is_own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
            if not (is_own or is_super):
                calls.append((node.lineno, ast.unparse(node.func)))
        for child in ast.iter_child_nodes(node):
            visit(child, own_methods)

    visit(tree, frozenset())
    return sorted(calls)


def test_the_private_call_detector_sees_another_objects_private_method():
    tree = ast.parse("replayer._loaded()\nself._loaded()\nsuper()._loaded()\ncls._loaded()\nx.loaded()\n"
                     "a.b._folder(1)\nobj._other()\n"
                     "class Table:\n    def _folder(self):\n        return other._folder()\n"
                     "    def f(self):\n        return other._loaded()\n")

    assert private_method_calls(tree, {"_loaded", "_folder"}) == [(1, "replayer._loaded"), (6, "a.b._folder"),
                                                                   (12, "other._loaded")]


def test_no_module_calls_a_private_method_of_another_object():
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in source_files().items()}
    private_names = {node.name for tree in trees.values() for node in ast.walk(tree)
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.name.startswith("_") and not node.name.startswith("__")}
    offenders = [f"{name}:{line} {call}" for name, tree in trees.items()
                 for line, call in private_method_calls(tree, private_names)]

    assert offenders == []
