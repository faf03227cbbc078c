#!/usr/bin/env bash
# What CI runs (.ci/run): set up, build and run the test suite in build/,
# then the format check (scripts/format.sh) and the whole suite again under
# AddressSanitizer and UndefinedBehaviorSanitizer in build-asan/
# (scripts/sanitize.sh). About 45 minutes on a busy 2-core machine, most of
# it the two builds; ThreadSanitizer (scripts/tsan.sh) is not part of it.
# JOBS sets the build parallelism (default: every core).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

part() {
  local name=$1 start=$SECONDS
  shift
  echo "== test.sh: $name"
  "$@"
  echo "== test.sh: $name took $((SECONDS - start)) s"
}

part "set-up and build" "$root/scripts/setup.sh"
part "tests" ctest --test-dir "$root/build" --output-on-failure -j "$(nproc)"
part "format check" "$root/scripts/format.sh"
part "tests under ASan + UBSan" "$root/scripts/sanitize.sh"
