"""The public surface: every name docs/api.md documents imports, the package's face stays where users find it,
and importing it patches nothing."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

API = (ROOT / "docs" / "api.md").read_text()

# What users call by these names, whatever the package's layout (DEVELOPERS: "the public surface does not move").
TOP_LEVEL = ("train_step_eager", "replay_step", "cached_loss_step", "install", "uninstall", "patched",
             "is_installed", "PatchError", "window_loss_scale", "AccumulationStep", "CachedLossStep", "ReplayStep")


def resolve(dotted: str):
    """``naflex_accum.a.b.Name`` -> the object, importing the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def documented_names():
    names = set(re.findall(r"\bnaflex_accum(?:\.[A-Za-z_]\w*)+", API))
    for module, imported in re.findall(r"from (naflex_accum[\w.]*) import ([\w, ]+)", API):
        names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
    return sorted(names)


def test_the_docs_name_something():
    assert len(documented_names()) > 10


@pytest.mark.parametrize("dotted", documented_names())
def test_every_name_the_api_docs_document_imports(dotted):
    assert resolve(dotted) is not None


def test_the_top_level_names_stay():
    import naflex_accum

    for name in TOP_LEVEL:
        assert getattr(naflex_accum, name) is not None, name
    assert naflex_accum.train_step_eager is naflex_accum.cached_loss_step
    assert naflex_accum.window_loss_scale([32, 8], reference_batch_size=16, mode="linear") == 1.25


def test_the_package_shows_the_three_ways_to_use_it():
    package = ROOT / "naflex_accum"
    for folder in ("accum", "upstream", "train", "data"):
        assert (package / folder / "__init__.py").is_file(), folder
    for face in ("__init__.py", "cli.py", "errors.py", "openclip.py"):
        assert (package / face).is_file(), face
