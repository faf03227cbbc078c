#!/usr/bin/env bash
# What CI runs (.ci/run): set up, build and run the test suite in build/,
# then the format check (scripts/format.sh) and the whole suite again under
# AddressSanitizer and UndefinedBehaviorSanitizer in build-asan/
# (scripts/sanitize.sh), the whole suite: it fits well inside CI's 90
# minutes. Measured from clean with JOBS=1 on a shared 2-core machine: 40
# minutes (build 704 s, tests 229 s, format 0 s, ASan + UBSan build 966 s
# and tests 521 s); each test is its own process, and an ASan process takes
# 1.5 s to start. ThreadSanitizer (scripts/tsan.sh) is not part of it.
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
