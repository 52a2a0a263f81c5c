"""The house keeps its plan: docs/architecture.md names every module there is and no other, each module is small
enough to read, and a function-local import says why it is not at the top."""
import ast
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
