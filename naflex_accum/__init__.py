"""naflex-accum: exact gradient accumulation for OpenCLIP NaFlex CLIP and SigLIP training.

``train_step_eager`` is the drop-in for ``open_clip_train.train._train_step_eager`` (the default ``cached-loss``
mode); ``replay_step`` the other mode. Importing this package patches nothing (``install()``/``patched()`` do)
and imports nothing, ``__version__`` included: each name loads its module on first use, so an entry point
(``python -m naflex_accum.openclip`` runs this file first) sets up Ctrl-C before any of its imports.
"""
# name -> (module, attribute); THE drop-in is the default mode's step itself (so its name says which mode)
_EXPORTS = {
    "window_loss_scale": (".accum.scales", "window_loss_scale"),
    "train_step_eager": (".accum.cached_loss", "cached_loss_step"),
    "cached_loss_step": (".accum.cached_loss", "cached_loss_step"),
    "CachedLossStep": (".accum.cached_loss", "CachedLossStep"),
    "replay_step": (".accum.replay", "replay_step"),
    "ReplayStep": (".accum.replay", "ReplayStep"),
    "AccumulationStep": (".accum.step", "AccumulationStep"),
    **{name: (".upstream.patch", name) for name in ("install", "uninstall", "patched", "is_installed", "PatchError")},
    "__version__": (".version", "__version__"),
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        from importlib import import_module  # here, not at the top: the package imports nothing (see above)
        return getattr(import_module(module, __name__), attribute)
    raise AttributeError(f"module 'naflex_accum' has no attribute {name!r}")
