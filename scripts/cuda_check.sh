#!/usr/bin/env bash
# GPU checks, on a machine with an NVIDIA GPU and a CUDA LibTorch 2.x (the
# one of Python's torch by default): builds gpipe, gpipe-train and
# gpipe-bench against it with gpipe::dist on NCCL, runs the GoogleTest
# suites gpipe_tests and gpipe_balance_tests on it (SUITE_ONLY=1: nothing
# more), then gpipe_dist_worker's parity checks over NCCL (each rank a
# process, checked against single-process GPipe in float64), with the
# stages on the CPU and on the GPU, one pipeline and replicas of one, and
# tests/dist/dist_test.sh's parity and failure modes over NCCL.
#
#   scripts/cuda_check.sh [BUILD_DIR]
#   scripts/cuda_check.sh --deps DIR   # here, on Debian: copy the headers,
#                                      # static GoogleTest and CMake files
#                                      # of the packages gpipe builds with
#                                      # into DIR, for a GPU machine that
#                                      # lacks them (then DEPS=DIR there)
#
# TORCH_PREFIX: LibTorch's CMake prefix (default: Python torch's); DEPS:
# extra CMake prefixes (nlohmann_json, CLI11, GoogleTest where the machine
# lacks them). One GPU is enough: NCCL refuses two ranks of one host on one
# GPU, so on a single GPU each rank calls itself a host of its own
# (NCCL_HOSTID) and the ranks talk over loopback sockets.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [[ ${1:-} == --deps ]]; then
  dir=${2:?--deps needs a directory}
  lib=/usr/lib/x86_64-linux-gnu
  mkdir -p "$dir/include" "$dir/share/cmake" "$dir/lib/x86_64-linux-gnu/cmake"
  cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/gtest \
    /usr/include/gmock /usr/include/zlib.h "$dir/include/" || exit 1
  cp /usr/include/zconf.h "$dir/include/" 2>/dev/null ||
    cp /usr/include/x86_64-linux-gnu/zconf.h "$dir/include/"
  cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$dir/share/cmake/"
  cp -r "$lib/cmake/GTest" "$dir/lib/x86_64-linux-gnu/cmake/"
  cp "$lib"/libgtest*.a "$lib"/libgmock*.a "$dir/lib/x86_64-linux-gnu/"
  echo "cuda_check: dependencies in $dir ($(du -sh "$dir" | cut -f1))"
  exit 0
fi
build=${1:-/tmp/gpipe-cuda}
torch_prefix=${TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "cuda_check: torch at $torch_prefix; $gpus GPU(s)"

zlib=()
if [[ -f ${DEPS:-/nonexistent}/include/zlib.h ]]; then
  lib=$(ls /usr/lib/x86_64-linux-gnu/libz.so* /lib/x86_64-linux-gnu/libz.so* 2>/dev/null | head -1)
  zlib=(-DZLIB_INCLUDE_DIR="$DEPS/include" -DZLIB_LIBRARY="$lib")
fi
generator=()
keep_going=(-k)
if command -v ninja >/dev/null; then
  generator=(-G Ninja)
  keep_going=(-k 0)
fi
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;${DEPS:-}" "${zlib[@]}" || exit 1
# The whole log in BUILD_LOG (if given); here, the errors.
cmake --build "$build" -j "$(nproc)" --target gpipe gpipe_dist_worker \
  gpipe-run gpipe_tests gpipe_balance_tests gpipe-train gpipe-bench -- \
  "${keep_going[@]}" >"${BUILD_LOG:-$build/build.log}" 2>&1
grep -E -A4 'error|FAILED' "${BUILD_LOG:-$build/build.log}" | head -120
[[ -x $build/tests/gpipe_dist_worker && -x $build/tools/gpipe-run ]] || exit 1

echo "cuda_check: built in ${SECONDS} s"
failures=0
# The tools are built to see that they compile against this LibTorch.
for program in tools/gpipe-train bench/gpipe-bench; do
  if [[ ! -x $build/$program ]]; then
    echo "FAIL: $program did not build"
    failures=$((failures + 1))
  fi
done
# The suite on this LibTorch. Its tests build pipelines on the default
# devices and compare them with models on the CPU, so they run with the GPU
# hidden (the default is then a CPU lane per partition); its *_CUDA tests
# then run with the GPU, and each must pass, not skip.
start=$SECONDS
if [[ -x $build/tests/gpipe_tests && -x $build/tests/gpipe_balance_tests ]]; then
  suite=$(CUDA_VISIBLE_DEVICES= timeout "${SUITE_TIMEOUT:-300}" ctest \
    --test-dir "$build" -R '^gpipe_(balance_)?tests\.' -j "$(nproc)" \
    --output-on-failure 2>&1)
  if [[ $? -ne 0 ]]; then
    echo "FAIL: the suite on the CPU ($((SECONDS - start)) s)"
    grep -E -A30 '^\[  FAILED  \]|Failure$|\*\*\*|Segmentation|Exception' <<<"$suite" |
      grep -v '^frame #' | head -200 | sed 's/^/    /'
    grep -A20 'tests passed' <<<"$suite" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok: the suite on the CPU: $(grep -m1 -o '[0-9]*% tests passed.*' <<<"$suite") ($((SECONDS - start)) s)"
  fi
  start=$SECONDS
  suite=$(timeout 120 "$build/tests/gpipe_tests" --gtest_filter='*_CUDA' 2>&1)
  status=$?
  cuda_ran=$(grep -c '^\[       OK \] .*_CUDA ' <<<"$suite")
  cuda_all=$(grep -c '^\[ RUN      \] .*_CUDA$' <<<"$suite")
  if [[ $status -ne 0 || $cuda_all -eq 0 || $cuda_ran -ne $cuda_all ]]; then
    echo "FAIL: $cuda_ran of $cuda_all CUDA tests passed, exit $status"
    grep -v '^frame #' <<<"$suite" | head -80 | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok: $cuda_ran CUDA tests on the GPU ($((SECONDS - start)) s)"
  fi
else
  echo "FAIL: the suite did not build"
  failures=$((failures + 1))
fi
if [[ -n ${SUITE_ONLY:-} ]]; then
  echo "cuda_check: $failures failed, ${SECONDS} s in all"
  exit $((failures > 0))
fi

export GPIPE_DIST_BACKEND=nccl GPIPE_DIST_TIMEOUT=${GPIPE_DIST_TIMEOUT:-30}
export NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
check() {  # check N ARGS...: the worker on N ranks; every rank says OK
  local n=$1
  shift
  local out
  local start=$SECONDS
  out=$(timeout 120 "$build/tools/gpipe-run" -n "$n" -- sh -c \
    'NCCL_HOSTID=gpipe-rank-$RANK exec "$0" "$@"' \
    "$build/tests/gpipe_dist_worker" "$@" 2>&1)
  local status=$? ok
  ok=$(grep -c ': OK (' <<<"$out")
  if [[ $status -ne 0 || $ok -ne $n ]]; then
    echo "FAIL: $n ranks, $*: exit $status, $ok of $n OK ($((SECONDS - start)) s)"
    head -40 <<<"$out" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok: $n ranks, $* ($((SECONDS - start)) s)"
  fi
}
# Stages on the CPU: gpipe's messages and collectives go through the GPU.
check 2 --schedule 1f1b --checkpoint except_last --dropout 0.3
check 2 --schedule zero_bubble_v --stages-per-lane 2 --v-shape 1 --checkpoint always --dropout 0.3
check 4 --schedule interleaved --stages-per-lane 2 --checkpoint never --dropout 0.3
check 2 --pipeline-size 1 --schedule 1f1b --dropout 0
check 4 --pipeline-size 2 --schedule zero_bubble --dropout 0
# Stages on the GPU.
check 2 --device cuda --schedule 1f1b --checkpoint except_last --dropout 0
check 4 --device cuda --pipeline-size 2 --schedule 1f1b --checkpoint always --dropout 0
# dist_test.sh's parity and failure checks, over NCCL.
for mode in parity failures; do
  start=$SECONDS
  if ! GPIPE_TEST_HOSTID=1 timeout "${MODE_TIMEOUT:-300}" "$root/tests/dist/dist_test.sh" \
    "$build/tools/gpipe-run" "$build/tests/gpipe_dist_worker" "$mode"; then
    echo "FAIL: dist_test.sh $mode over NCCL ($((SECONDS - start)) s)"
    failures=$((failures + 1))
  fi
  # A mode stopped at its limit leaves its ranks behind (each under a
  # timeout of its own, in a process group of its own): none may run on
  # into the next.
  pkill -9 -f "$build/tests/gpipe_dist_worker" 2>/dev/null
done
echo "cuda_check: $failures failed, ${SECONDS} s in all"
exit $((failures > 0))
