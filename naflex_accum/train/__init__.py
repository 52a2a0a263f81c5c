"""The built-in NaFlex CLIP/SigLIP trainer (``naflex-accum train``), for any open_clip release."""
