"""Training and held-out data for ``naflex-accum train``: webdataset shards -> NaFlex batches.

Modules, one concern each: ``schedule`` (the per-epoch batch plan, pure),
``shards`` (URL expansion, validation, per-reader shard order), ``tario`` (tar
members), ``samples`` (grouping, checks, shuffle), ``images`` (decoding to uint8
RGB, every mode), ``text`` (per-batch tokenizing), ``pipeline`` (worker side:
decode, batch, skip), ``loader`` (main side: the loaders and their stats),
``demo`` (synthetic data), ``bench`` (throughput). Importing this package
imports neither torch nor PIL; the names below load their module on first use.
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
