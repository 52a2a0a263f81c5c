"""pyproject.toml declares what the package imports: every third-party top-level module any file of
naflex_accum/ imports (at the top or inside a function) belongs to a distribution named in the dependencies
or in an optional extra, so `pip install .` (with the extra a feature names) in a clean venv pulls it in.

Import names map to distributions through the installed packages' own records
(``importlib.metadata.packages_distributions``: PIL -> pillow, yaml -> PyYAML, open_clip_train ->
open_clip_torch, ...)."""
import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "naflex_accum"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def imported_modules() -> dict:
    """Top-level module -> the first file importing it, for every absolute import under naflex_accum/."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def third_party(modules: dict) -> dict:
    return {m: where for m, where in modules.items()
            if m not in sys.stdlib_module_names and m != "naflex_accum" and m != "__future__"}


def test_every_imported_package_is_declared():
    declared = {requirement_name(r) for r in project()["dependencies"]}
    for extra in project().get("optional-dependencies", {}).values():
        declared |= {requirement_name(r) for r in extra}
    distributions = packages_distributions()
    modules = third_party(imported_modules())
    assert {"torch", "timm", "open_clip", "tqdm", "yaml", "PIL"} <= modules.keys()  # the scan sees imports
    unknown = sorted(m for m in modules if m not in distributions)
    assert unknown == [], f"imported but not installed here, so not mappable to a distribution: {unknown}"
    missing = {m: f"{distributions[m]} (imported in {where})" for m, where in modules.items()
               if not {canonical(d) for d in distributions[m]} & declared}
    assert missing == {}, "imported by naflex_accum/ but declared in no dependency list of pyproject.toml"


def test_runtime_imports_need_no_extra():
    """What every command imports comes with the plain install; an extra covers only optional features."""
    runtime = {requirement_name(r) for r in project()["dependencies"]}
    optional = {"wandb": "--report-to wandb", "pytest": "naflex_accum/testing (the test suite's plugin)"}
    distributions = packages_distributions()
    outside = {m: where for m, where in third_party(imported_modules()).items()
               if m not in optional and not {canonical(d) for d in distributions.get(m, [m])} & runtime}
    assert outside == {}, "imported outside the optional features, yet only in an extra (or nowhere)"
