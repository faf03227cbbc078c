#!/usr/bin/env bash
# Rules about the source that no build here can check, each for a reason
# given where it applies:
# - no std::filesystem::remove_all and no recursive_directory_iterator: in
#   a program linked with PyTorch's 2.x wheels they bind to broken copies
#   inside libtorch.so (Note [Removing a directory tree] in
#   src/checkpoint_write.cpp); Debian's LibTorch 1.13, which CI builds
#   with, does not show it.
#
#   tests/source_rules_test.sh SOURCE_DIR
set -uo pipefail
root=${1:?source directory}
found=$(cd "$root" && grep -rnE '(remove_all|recursive_directory_iterator)\b' \
  src include tools bench models examples tests --include='*.cpp' \
  --include='*.h' | grep -vE '^[^:]+:[0-9]+:\s*//')
if [[ -n $found ]]; then
  echo "source_rules: std::filesystem::remove_all or recursive_directory_iterator" \
    "(use gpipe::detail::remove_tree; Note [Removing a directory tree]):"
  echo "$found"
  exit 1
fi
# - every installed header is in tests/public_headers.cpp, which compiles
#   them under a strict consumer's warnings.
missing=$(cd "$root" && for h in include/gpipe/*.h models/include/gpipe/models/*.h; do
  name=${h#include/}
  name=${name#models/include/}
  grep -qF "#include <$name>" tests/public_headers.cpp || echo "$name"
done)
if [[ -n $missing ]]; then
  echo "source_rules: installed headers missing from tests/public_headers.cpp:"
  echo "$missing"
  exit 1
fi
echo "source_rules: OK"
