#!/usr/bin/env bash
# The main job: set up, build, and train the Fashion-MNIST CNN through GPipe
# with gpipe-train's defaults. Extra arguments go to gpipe-train.
#
#   ./scripts/train.sh [FLAGS]            one process, a lane per partition
#   RANKS=2 ./scripts/train.sh [FLAGS]    2 processes on this machine (via
#                                         gpipe-run), a partition each
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
ranks=${RANKS:-1}
if [[ ! $ranks =~ ^[1-9][0-9]*$ ]]; then
  echo "train.sh: RANKS must be a positive integer, but got '$ranks'" >&2
  exit 2
fi
if ((ranks > 1)); then
  exec "$root/build/tools/gpipe-run" -n "$ranks" -- \
    "$root/build/tools/gpipe-train" "$@"
fi
exec "$root/build/tools/gpipe-train" "$@"
