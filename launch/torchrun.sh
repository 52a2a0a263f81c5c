#!/usr/bin/env bash
# One node, NGPU processes under torchrun.
#
#   launch/torchrun.sh NGPU [trainer arguments...]
#
# TRAINER=builtin (default) runs `naflex-accum train`; TRAINER=openclip runs upstream open_clip main's
# trainer with the fixed step (python -m naflex_accum.openclip). Other settings, with defaults:
#   PYTHON=python  OMP_NUM_THREADS=4  DRY_RUN=1 (print the command, run nothing)
# --standalone picks a free rendezvous port, so several runs can share a node.
# torchrun refuses `--logs DIR` (ambiguous with its --logs-specs): for the built-in trainer this script
# passes it on as --logs-dir; upstream's trainer has no such alias, so start it where ./logs should be.
set -euo pipefail

if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/torchrun.sh NGPU [trainer arguments...]  (NGPU a positive integer)" >&2
  exit 2
fi
NGPU=$1
shift
TRAINER=${TRAINER:-builtin}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

case "$TRAINER" in
  builtin) module=naflex_accum.train ;;
  openclip) module=naflex_accum.openclip ;;
  *) echo "launch/torchrun.sh: TRAINER=$TRAINER: valid values are builtin, openclip" >&2; exit 2 ;;
esac

args=()
for arg in "$@"; do
  if [ "$TRAINER" = builtin ] && [ "$arg" = --logs ]; then
    args+=(--logs-dir)
  elif [ "$TRAINER" = builtin ] && [[ $arg == --logs=* ]]; then
    args+=("--logs-dir=${arg#--logs=}")
  else
    args+=("$arg")
  fi
done

cmd=("$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NGPU"
     -m "$module" "${args[@]}")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
# The launch time: the trainer removes only a STOP file older than it (one written since stops the run)
NAFLEX_ACCUM_LAUNCHED=$(date +%s)
export NAFLEX_ACCUM_LAUNCHED
exec "${cmd[@]}"
