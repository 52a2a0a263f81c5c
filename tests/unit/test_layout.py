"""The house keeps its plan: docs/architecture.md names every module there is and no other, each module is small
enough to read, a function-local import says why it is not at the top, no modules import each other in a circle,
no sub-package imports the package root, and train/ reaches data/ only through ``naflex_accum.data``'s public names."""
import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "naflex_accum"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def test_the_architecture_page_names_every_module_and_only_those():
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b(\w+)\.py\b", page))
    present = {p.stem for p in MODULES}
    outside = {p.stem for folder in ("benchmarks", "launch", "scripts") for p in (ROOT / folder).glob("*.py")}
    assert present - named == set(), "modules docs/architecture.md does not name"
    assert named - present - outside - {"__init__"} == set(), "docs/architecture.md names modules that are not there"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_readable(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= MAX_FUNCTION_LINES, node.name


def local_imports(path: Path):
    lines = path.read_text().splitlines()
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield node.lineno, lines[node.lineno - 1], lines[node.lineno - 2].strip()


def test_every_function_local_import_says_why():
    """A cycle it breaks or a heavy optional import it defers, in a comment on its line or the line above (a hook's
    imports may point at the module's note: 'see above')."""
    silent = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in MODULES + [PACKAGE / "__init__.py"]
              for n, line, above in local_imports(path) if "#" not in line and not above.startswith("#")]
    assert silent == []


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, source: str):
    """(import statement, module) for each package module ``source`` imports, at the top or in a function:
    ``from . import x`` names module ``x`` where there is one, else the package it imports from."""
    package = name if SOURCES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in SOURCES else base for alias in node.names]
        else:
            continue
        yield from ((node, target) for target in targets if target in SOURCES)


def cycles(graph: dict) -> list:
    """The circles of ``graph`` (module -> modules it imports): each strongly connected part of more than one module,
    or a module importing itself (Tarjan's algorithm)."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = set()
            while node not in part:
                part.add(stack.pop())
            if len(part) > 1 or node in graph[node]:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle():
    graph = {name: {target for _, target in imported(name, path.read_text())} for name, path in SOURCES.items()}
    assert cycles(graph) == []


def test_no_sub_package_imports_the_package_root():
    """A sub-package that imports ``naflex_accum`` itself depends on everything the root may load."""
    found = {f"{path.relative_to(ROOT)}:{node.lineno}" for name, path in SOURCES.items() if name.count(".") > 1
             for node, target in imported(name, path.read_text()) if target == "naflex_accum"}
    assert sorted(found) == []


def test_train_reaches_data_through_its_public_names():
    """train/ imports ``naflex_accum.data``'s exported names only, never a module of data/ directly."""
    public = set(importlib.import_module("naflex_accum.data").__all__)
    found = {f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
             for name, path in SOURCES.items() if name.startswith("naflex_accum.train")
             for node, target in imported(name, path.read_text())
             if target.startswith("naflex_accum.data.") or target == "naflex_accum.data"
             and isinstance(node, ast.ImportFrom) and {alias.name for alias in node.names} - public}
    assert sorted(found) == []
