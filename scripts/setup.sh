#!/usr/bin/env bash
# Creates .venv (if needed) and installs naflex-accum into it, editable:
#   scripts/setup.sh        the package and its runtime dependencies (make demo, make table)
#   scripts/setup.sh test   the same with the test extra (make test: pytest, upstream's needs, wandb, shellcheck)
# Re-runs an install only when pyproject.toml changed since the last one of that kind.
# TORCH_SPEC picks the torch build (default: the versions this project is tested with).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
runtime_stamp="$VENV/.naflex-accum-installed"
case "${1:-}" in
  "") target="."; stamp="$runtime_stamp" ;;
  test) target=".[test]"; stamp="$VENV/.naflex-accum-installed-test" ;;
  *) echo "usage: scripts/setup.sh [test]" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  default_spec="torch==2.14.1 torchvision==0.29.1"
  if [ "$TORCH_SPEC" = "$default_spec" ] && ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    # torch 2.14.1's CUDA build takes about 5.8 GB once installed; pip's own failure would be a traceback
    free_kb=$(df -Pk "$VENV" | awk 'NR == 2 {print $4}')
    if [ "${free_kb:-0}" -lt $((6 * 1024 * 1024)) ]; then
      echo "setup: $default_spec needs about 6 GB in $VENV; only $((free_kb / 1024)) MB are free there." \
           "Free some space and run this again." >&2
      exit 1
    fi
  fi
  echo "setup: installing $TORCH_SPEC and naflex-accum${target#.} into $VENV (first time takes a few minutes)"
  # shellcheck disable=SC2086  # TORCH_SPEC is a list of requirement specifiers
  "$VENV/bin/python" -m pip install -q --no-compile $TORCH_SPEC 2> >(grep -v "is ignored: it is neither" >&2)
  "$VENV/bin/python" -m pip install -q --no-compile -e "$target" 2> >(grep -v "is ignored: it is neither" >&2)
  # the bytecode pip would make one file at a time, on every CPU (a few files of torch's are not Python 3.11's);
  # the packages' own test folders (a fifth of the files: pandas', sympy's, numpy's) are never imported
  "$VENV/bin/python" -c 'import compileall as c, re, sysconfig as s; p = s.get_path("purelib")
c.compile_dir(p, quiet=2, workers=0, rx=re.compile(re.escape(p) + r"/(.+/)?tests?/"))' || true
  touch "$stamp" "$runtime_stamp"  # the test extra holds the runtime dependencies too
fi
# the package's own bytecode, for processes that do not write it (PYTHONDONTWRITEBYTECODE)
"$VENV/bin/python" -m compileall -q naflex_accum >/dev/null || true
