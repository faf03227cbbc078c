#!/usr/bin/env bash
# Builds the engine's tests (gpipe_tests, and the long run) and the
# distributed stages' worker with ThreadSanitizer in build-tsan/
# (RelWithDebInfo at -O1) and runs them: the check that catches races
# between the caller, the lanes, the autograd engine and, in a distributed
# run, the c10d transport's sends and receives. Not part of CI
# (scripts/test.sh); run it after touching the engine or src/dist. Needs the
# packages scripts/setup.sh installs.
#
#   scripts/tsan.sh                                every test
#   scripts/tsan.sh --gtest_filter='Pipeline*'     extra arguments go to both
#                                                  gtest binaries
#   GPIPE_TSAN_DIST=0 scripts/tsan.sh              without the distributed run
#
# LibTorch is not instrumented: TSan does not see the reference counts it
# drops inside its own code. The engine therefore frees every pass on the
# caller's thread (a lane lets go of the pass before it counts itself done),
# so no tensor's last reference is dropped on a lane behind TSan's back;
# gpipe_tests and the long run report nothing with the suppressions below.
#
# JOBS sets the build parallelism (default: every core).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build-tsan
jobs=${JOBS:-$(nproc)}

tsan_options=(
  # Races inside OpenBLAS and libgomp only; see the file for each entry.
  "suppressions=$root/scripts/tsan.supp"
  # Report every race of the run (each distinct pair of stacks once), then
  # exit with status 66 if there was any.
  halt_on_error=0
  # Both stacks of a lock-order inversion.
  second_deadlock_stack=1
  # Keep more of each thread's history, so the earlier access of a race
  # keeps its stack (lanes run many cells between two accesses).
  history_size=4
)
export TSAN_OPTIONS=${TSAN_OPTIONS:-$(IFS=:; echo "${tsan_options[*]}")}
# The test's own thread runs LibTorch's and OpenBLAS's parallel regions
# inline (the plain-model references the tests compare with), which keeps
# OpenMP and OpenBLAS threads, and their suppressed reports, out of most of
# the run. Lanes still set their own
# count (threads_per_lane), so the engine runs as it would without it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# 600 steps of tests/long_run_test.cpp (its memory check is skipped here).
export GPIPE_LONG_RUN_STEPS=${GPIPE_LONG_RUN_STEPS:-600}

# TSAN_OPTIONS is set before building too: gtest_discover_tests runs the
# test binaries at build time to list their tests.
cmake -S "$root" -B "$build" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" \
  -DGPIPE_USE_TSAN=ON -DGPIPE_USE_ASAN=OFF -DGPIPE_USE_UBSAN=OFF \
  -DGPIPE_BUILD_TOOLS=ON -DGPIPE_BUILD_BENCHMARKS=OFF \
  -DCMAKE_UNITY_BUILD=ON
dist=${GPIPE_TSAN_DIST:-1}
targets=(gpipe_tests gpipe_long_run_tests)
((dist)) && targets+=(gpipe_dist_worker gpipe-run)
cmake --build "$build" -j "$jobs" --target "${targets[@]}"
status=0
"$build/tests/gpipe_tests" "$@" || status=$?
"$build/tests/gpipe_long_run_tests" "$@" || status=$?
if ((dist)); then
  # tests/dist/dist_test.sh parity: every rank of every run is a process
  # under TSan, writing its reports to a file of its own (log_path), kept
  # whole here rather than cut short in the test's output. Gloo's threads
  # (uninstrumented) move the tensors' bytes; TSan sees those copies
  # through its memcpy interceptor, ordered by the Work's wait.
  # A rank with reports exits as it would without TSan (exitcode=0): the
  # reports are judged below, after the filter, not by the ranks' status.
  logs=$(mktemp -d)
  TSAN_OPTIONS="$TSAN_OPTIONS:log_path=$logs/rank:exitcode=0" \
    "$root/tests/dist/dist_test.sh" "$build/tools/gpipe-run" \
    "$build/tests/gpipe_dist_worker" parity || status=$?
  # Reports of an object's lifetime across a thread of a Gloo process
  # group are left out by scripts/tsan_gloo_filter.awk (which says exactly
  # which): the threads of Gloo's collectives finish a work, then drop
  # their references to the work, its future and its tensors inside
  # LibTorch, by atomic decrements TSan does not see, so the free that
  # follows on either side looks raced with the other's earlier access
  # (56 to 67 reports in the replicas' runs: the gradient all-reduce,
  # World::split's all-gather, the replicas' agreement; none in the runs
  # of one pipeline). TSan's suppressions cannot say this: they do not
  # match the stack that made a thread. Races in which a Gloo thread runs
  # our code or copies memory ours use, and races between our own threads
  # (the caller, lanes, the failure listener), stay reported.
  kept=$logs/kept
  for f in "$logs"/rank*; do
    [[ -e $f ]] && awk -f "$root/scripts/tsan_gloo_filter.awk" "$f" >>"$kept"
  done
  if [[ -s $kept ]] && grep -q 'WARNING: ThreadSanitizer' "$kept"; then
    echo "ThreadSanitizer reports from the distributed run:"
    cat "$kept"
    status=66
  fi
  rm -rf "$logs"
fi
exit "$status"
