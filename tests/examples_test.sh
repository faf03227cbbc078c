#!/usr/bin/env bash
# The examples as a user builds them: gpipe installed into a fresh prefix,
# examples/ configured against it with find_package(gpipe) (gpipe::gpipe and
# gpipe::models), built and run; and the README's example is
# examples/readme_example.cpp, character for character.
#
#   examples_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail

build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The README's first C++ block after "## Example" is the example file.
awk '/^## Example/ { on = 1; next }
     on && /^```cpp/ { block = 1; next }
     block && /^```/ { exit }
     block { print }' "$src/README.md" >"$tmp/readme.cpp"
if ! diff -u "$src/examples/readme_example.cpp" "$tmp/readme.cpp"; then
  echo "FAIL: README.md's example differs from examples/readme_example.cpp"
  exit 1
fi
echo "ok: README.md's example is examples/readme_example.cpp"

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log"
cmake -S "$src/examples" -B "$tmp/examples" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release \
  >"$tmp/configure.log" 2>&1 || {
  cat "$tmp/configure.log"
  echo "FAIL: examples/ does not configure against the installed gpipe"
  exit 1
}
cmake --build "$tmp/examples" -j "${JOBS:-2}" >"$tmp/build.log" 2>&1 || {
  tail -30 "$tmp/build.log"
  echo "FAIL: examples/ does not build against the installed gpipe"
  exit 1
}
echo "ok: examples/ builds against the installed gpipe::gpipe and gpipe::models"
# A consumer whose find_package(Torch) finds another LibTorch than the one
# gpipe was built with is told so at configure time, not at run time.
mkdir -p "$tmp/other_torch" "$tmp/mismatch"
cat >"$tmp/other_torch/TorchConfig.cmake" <<'CMAKE'
set(TORCH_LIBRARIES "")
set(TORCH_FOUND TRUE)
CMAKE
cat >"$tmp/other_torch/TorchConfigVersion.cmake" <<'CMAKE'
set(PACKAGE_VERSION "99.1.0")
set(PACKAGE_VERSION_COMPATIBLE TRUE)
CMAKE
cat >"$tmp/mismatch/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.18)
project(mismatch CXX)
find_package(gpipe REQUIRED)
CMAKE
if cmake -S "$tmp/mismatch" -B "$tmp/mismatch/build" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" -DTorch_DIR="$tmp/other_torch" \
  >"$tmp/mismatch.log" 2>&1; then
  echo "FAIL: gpipe was found with another LibTorch (99.1.0)"
  exit 1
fi
if ! tr -s ' \n' ' ' <"$tmp/mismatch.log" |
  grep -q "find_package(Torch) found 99.1.0"; then
  cat "$tmp/mismatch.log"
  echo "FAIL: the other LibTorch is not named"
  exit 1
fi
echo "ok: another LibTorch than gpipe's is refused at configure time"

for example in readme_example unet_skips; do
  if ! "$tmp/examples/$example" >"$tmp/$example.out" 2>&1; then
    cat "$tmp/$example.out"
    echo "FAIL: $example exited non-zero"
    exit 1
  fi
  echo "ok: $example: $(tail -n 1 "$tmp/$example.out")"
done
