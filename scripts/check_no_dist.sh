#!/usr/bin/env bash
# Builds gpipe without c10d (-DGPIPE_DIST=OFF) in build-nodist/ and checks
# that it works: gpipe::dist::is_available() is false, gpipe-train trains in
# one process, and under a launcher it says on one line that this build has
# no gpipe::dist (exit 1). .ci/run calls it after the sanitizers.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build-nodist}
jobs=${JOBS:-$(nproc)}
cmake -S "$root" -B "$build" -DGPIPE_DIST=OFF -DGPIPE_BUILD_BENCHMARKS=OFF \
  -DCMAKE_UNITY_BUILD=ON >/dev/null
cmake --build "$build" -j "$jobs" --target gpipe-train gpipe_dist_available_test
"$build/tests/gpipe_dist_available_test"
data=/usr/share/datasets/fashion-mnist
if [[ -f $data/train-images-idx3-ubyte.gz ]]; then
  "$build/tools/gpipe-train" --limit 640 --test-limit 500 --json | tail -1
fi
set +e
out=$(WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
  "$build/tools/gpipe-train" --limit 64 2>&1)
status=$?
set -e
if [[ $status -ne 1 || $out != *"built without c10d"* ]]; then
  echo "check_no_dist.sh: gpipe-train under a launcher exited $status: $out" >&2
  exit 1
fi
echo "check_no_dist.sh: ok (gpipe::dist unavailable, said so under a launcher)"
