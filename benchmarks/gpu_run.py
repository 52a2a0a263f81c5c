"""Run ``python -m MODULE ARGS`` in this process and, at its exit, write its peak CUDA memory and wall time.

    python benchmarks/gpu_run.py RESULT.json [--timm-sizes] MODULE [ARGS...]

``gpu_check.py`` runs both trainers through it (``naflex_accum.cli train`` and ``naflex_accum.openclip``),
so each one's peak is ``torch.cuda.max_memory_allocated`` of the process that trains, read the same way.
``--timm-sizes`` registers the project's extra timm NaFlexVit sizes first (``models.register_timm_models``),
so that upstream's factory builds ``naflex-S-16``'s tower exactly as ours does.
Only the starting process writes (loader workers it forks exit without running ``atexit``).
"""
import atexit
import json
import os
import runpy
import sys
import time


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__.splitlines()[2].strip())
    result, rest = sys.argv[1], sys.argv[2:]
    if rest[0] == "--timm-sizes":
        from naflex_accum.models import register_timm_models

        register_timm_models()
        rest = rest[1:]
    module, args = rest[0], rest[1:]
    pid, start = os.getpid(), time.perf_counter()

    def record():
        if os.getpid() != pid:
            return
        import torch

        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
        with open(result, "w") as f:
            json.dump({"peak_bytes": peak, "wall_s": time.perf_counter() - start}, f)

    atexit.register(record)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
