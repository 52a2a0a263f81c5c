"""Training and held-out data for ``naflex-accum train``: webdataset shards -> NaFlex batches.

Invariant: an epoch is a set of samples, each read once, whatever the workers, ranks or resumes. Modules:
docs/architecture.md. Importing this package imports neither torch nor PIL; the names below load on first use.
They are the public face: the trainer (train/) imports data/ through them only.
"""
import importlib

# name -> its module, or "module:attribute" where the module's own name is too plain outside it
_EXPORTS = {
    "DataConfig": "schedule", "BatchSpec": "schedule", "Schedule": "schedule", "check_data_config": "loader",
    "make_train_loader": "loader", "make_val_loader": "loader", "TrainLoader": "loader", "ValLoader": "loader",
    "data_index": "loader", "Segment": "order", "check_slots": "order",
    "write_demo_data": "demo", "DemoData": "demo", "caption_for": "demo",
    "expand_urls": "shards", "normalize_patches": "patches",
    **dict.fromkeys(("LabelledBatches", "FolderSource", "ShardSource", "Problems", "SHOWN_PROBLEMS"), "labelled"),
    "held_worker_failures": "workers:held", "loader_failure": "workers:failure", "stop_workers": "workers:stop_all",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module, _, attribute = _EXPORTS[name].partition(":")
        return getattr(importlib.import_module(f".{module}", __name__), attribute or name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
