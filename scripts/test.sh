#!/usr/bin/env bash
# The README's test command: installs what is missing (scripts/setup.sh),
# builds in build/, runs the test suite and the format check
# (scripts/format.sh). CI (.ci/run) runs this and then the suite again under
# AddressSanitizer and UndefinedBehaviorSanitizer (scripts/sanitize.sh);
# ThreadSanitizer (scripts/tsan.sh) is run by hand before a change to the
# engine's threads lands. How long each part takes on CI's machine:
# docs/benchmark-history.md. JOBS sets the build parallelism (default: every
# core).
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
