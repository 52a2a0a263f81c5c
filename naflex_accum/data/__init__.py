"""Training and held-out data for ``naflex-accum train``: webdataset shards -> NaFlex batches.

Invariant: an epoch is a set of samples, each read once, whatever the workers, ranks or resumes. Modules:
docs/architecture.md. Importing this package imports neither torch nor PIL; the names below load on first use.
"""
import importlib

_EXPORTS = {
    "DataConfig": "schedule", "BatchSpec": "schedule", "Schedule": "schedule",
    "make_train_loader": "loader", "make_val_loader": "loader", "TrainLoader": "loader", "ValLoader": "loader",
    "write_demo_data": "demo", "DemoData": "demo", "caption_for": "demo",
    "expand_urls": "shards",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
