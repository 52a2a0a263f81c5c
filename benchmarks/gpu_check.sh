#!/usr/bin/env bash
# The GPU check kit: prepare it here, run it on a GPU machine in one go, or smoke-test it on the CPU.
#
#   bash benchmarks/gpu_check.sh prepare              # here (network): wheels into .whl/, upstream into .gpu-kit/
#   bash benchmarks/gpu_check.sh run --out DIR        # there: DIR/gpu_check.md + DIR/gpu_check.json, <= 8 min
#   bash benchmarks/gpu_check.sh run --smoke [--out DIR]   # CPU, tiny sizes, about a minute (CI)
#
# On the GPU machine (Python 3.12 with torch, torchvision and timm, no network), `run` installs the
# kit's wheels into /tmp/naflex-gpu-site when open_clip, webdataset, braceexpand or simplejpeg cannot
# be imported, and puts the checkout first on PYTHONPATH. Both folders are git-ignored; carry them:
#   device run  carry [".whl", ".gpu-kit"]  command "bash benchmarks/gpu_check.sh run --out $OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
# What the GPU machine lacks (timm too: the project needs >= 1.0.31). webdataset 0.2.86: the one version
# both the project and upstream's loader accept (see pyproject.toml).
WHEELS=(open_clip_torch==3.3.0 timm==1.0.31 webdataset==0.2.86 braceexpand==0.1.7 ftfy==6.3.1 wcwidth==0.2.13
        simplejpeg==1.9.0)
SNAPSHOT=../shared/upstream/open_clip-89fb801.tar.gz

if [[ -x .venv/bin/python ]]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi

prepare() {
    local pyver=${GPU_PYTHON_VERSION:-3.12}
    mkdir -p .whl .gpu-kit/upstream
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    if [[ ! -f $SNAPSHOT ]]; then
        echo "gpu_check.sh prepare: $SNAPSHOT not found (the pinned upstream); nothing else to prepare" >&2
        exit 2
    fi
    rm -rf .gpu-kit/upstream/open_clip-89fb801
    tar xzf "$SNAPSHOT" -C .gpu-kit/upstream
    du -sh .whl .gpu-kit | sed 's/^/gpu_check.sh prepare: /'
}

install_kit() {
    # found, not imported: an import of them all costs seconds of the GPU machine's time
    if "$PY" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, sys.argv[1:])))" \
            open_clip webdataset braceexpand simplejpeg timm 2>/dev/null; then return; fi
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu_check.sh: packages missing and no wheels in .whl/; run 'bash benchmarks/gpu_check.sh prepare'" \
             "where pip works, then carry .whl" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/naflex-gpu-site .whl/*.whl
    export PYTHONPATH=/tmp/naflex-gpu-site${PYTHONPATH:+:$PYTHONPATH}
}

case "${1:-}" in
    prepare) prepare ;;
    run)
        shift
        install_kit
        export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
        exec "$PY" benchmarks/gpu_check.py "$@" ;;
    *)
        echo "usage: bash benchmarks/gpu_check.sh prepare | run [--smoke] [--out DIR]" >&2
        exit 2 ;;
esac
