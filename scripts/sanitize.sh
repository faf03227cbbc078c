#!/usr/bin/env bash
# Builds the project with AddressSanitizer and UndefinedBehaviorSanitizer in
# build-asan/ (RelWithDebInfo at -O1, no tools or benchmarks; a unity build,
# as scripts/setup.sh's) and runs the ctest suite under them. Any sanitizer
# report fails its test: ASan stops at its first error, and UBSan is built
# with -fno-sanitize-recover (see CMakeLists.txt). Needs the packages
# scripts/setup.sh installs.
#
#   scripts/sanitize.sh               the whole suite
#   scripts/sanitize.sh -E models     extra arguments go to ctest
#
# JOBS sets the build parallelism (default: every core); ctest runs a test
# per core.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build-asan
jobs=${JOBS:-$(nproc)}

# Only our code is instrumented; LibTorch, OpenBLAS and libgomp are
# Debian's plain builds. ASan still intercepts their malloc/free and
# new/delete, so heap errors inside them are reported too. LibTorch 1.13.1
# (CPU) needs no option turned off: LeakSanitizer stays on (detect_leaks=1,
# the default; LibTorch's registries stay reachable from globals, so they are
# not leaks), new_delete_type_mismatch and alloc_dealloc_mismatch report
# nothing, and protect_shadow_gap=0 is only wanted by the CUDA driver.
asan_options=(
  # Stop at the first report (ASan's default without -fsanitize-recover,
  # spelled out).
  halt_on_error=1
  # Static initialisers that read another file's globals before those are
  # constructed (cheap; our own code only, as only it is instrumented).
  check_initialization_order=1
  strict_init_order=1
  # Stack frames outliving their function (a lambda posted to a lane that
  # captured a local by reference): costs some speed, catches exactly the
  # bug a threaded engine is prone to.
  detect_stack_use_after_return=1
)
export ASAN_OPTIONS=${ASAN_OPTIONS:-$(IFS=:; echo "${asan_options[*]}")}
# Stack traces with UBSan's reports (they abort the test either way).
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# The long run (tests/long_run_test.cpp), much slower under ASan, is
# shortened; its memory check is skipped under ASan and LeakSanitizer checks
# instead.
export GPIPE_LONG_RUN_STEPS=${GPIPE_LONG_RUN_STEPS:-600}

# The options are set before building too: gtest_discover_tests runs each
# test binary at build time to list its tests.
cmake -S "$root" -B "$build" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" \
  -DGPIPE_USE_ASAN=ON -DGPIPE_USE_UBSAN=ON -DGPIPE_USE_TSAN=OFF \
  -DCMAKE_UNITY_BUILD=ON \
  -DGPIPE_BUILD_TOOLS=OFF -DGPIPE_BUILD_BENCHMARKS=OFF
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"
