#!/usr/bin/env bash
# The main job: set up, build, and train the Fashion-MNIST CNN through GPipe
# with gpipe-train's defaults. Extra arguments go to gpipe-train.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
exec "$root/build/tools/gpipe-train" "$@"
