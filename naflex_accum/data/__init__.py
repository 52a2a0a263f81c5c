"""Training and held-out data for ``naflex-accum train``: webdataset shards -> NaFlex batches.

Invariant: an epoch is a set of samples, each read once, whatever the workers, ranks or resumes. Modules,
one concern each, from the shards to the training process:

- what an epoch is: ``shards`` (URL expansion, validation, sampling weights), ``index`` (each shard's
  sample count), ``schedule`` (the per-epoch batch plan, pure), ``slots`` (the epoch's global sample
  order), ``order`` (which rank and worker reads which part of it);
- reading: ``pipes`` (opening shards, ``pipe:`` commands), ``tario`` (tar members), ``samples`` (members
  grouped into checked samples), ``reading`` (one slot's pass in its shuffled order);
- making batches: ``decode`` and ``images`` (bytes to uint8 RGB at the NaFlex size, every mode),
  ``patches`` (resize, patchify, pad), ``text`` (per-batch tokenizing), ``fill`` (each row its sample or
  a stand-in), ``pipeline`` (the worker side), ``labelled`` (zero-shot images and labels);
- reaching the training process: ``ring`` and ``handover`` (shared memory from workers), ``assemble`` (a
  batch from its workers' parts), ``delivery`` (torch's DataLoader, pinning, counting), ``workers`` (their
  failures and their end), ``alarm`` (the ``--data-timeout`` bound in this process), ``loader`` (the
  loaders the trainer uses);
- ``demo`` (synthetic data) and ``bench`` (throughput).

Importing this package imports neither torch nor PIL; the names below load their module on first use.
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
