#!/usr/bin/env bash
# Checks that every C++ source and header of the project is formatted by
# clang-format with the repository's .clang-format (PyTorch's settings; see
# STYLE.md, convention 13). Files are found with git ls-files, so new files
# are covered as soon as git knows them (tracked, or untracked and not
# ignored). Exits non-zero, listing the offending lines, if any file differs.
#
#   scripts/format.sh        check (what CI runs)
#   scripts/format.sh -i     reformat the files in place
#
# The check is pinned to Debian 12's clang-format 14 (other versions format
# some constructs differently); set CLANG_FORMAT to use another binary.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

clang_format=${CLANG_FORMAT:-clang-format}
if ! command -v "$clang_format" >/dev/null; then
  echo "format.sh: $clang_format not found; install Debian's clang-format" \
    "package (scripts/setup.sh does)" >&2
  exit 2
fi
version=$("$clang_format" --version)
if [[ $version != *"version 14."* ]]; then
  echo "format.sh: warning: the check is meant for clang-format 14, got:" \
    "$version" >&2
fi

patterns=('*.cpp' '*.cc' '*.cxx' '*.h' '*.hpp' '*.cu' '*.cuh')
list_files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard -- "${patterns[@]}"
  else  # an exported tree without .git: the project's own directories
    local names=()
    for p in "${patterns[@]}"; do names+=(-o -name "$p"); done
    find src include tests tools bench models examples -type f \
      \( "${names[@]:1}" \) -print0 2>/dev/null || true
  fi
}
files=()
while IFS= read -r -d '' f; do
  [[ -f $f ]] && files+=("$f")  # skip deletions not yet committed
done < <(list_files | sort -zu)
if ((${#files[@]} == 0)); then
  echo "format.sh: no C++ files found" >&2
  exit 2
fi

if [[ ${1:-} == -i ]]; then
  "$clang_format" -i "${files[@]}"
  echo "format.sh: formatted ${#files[@]} files"
  exit 0
fi

# One clang-format process for every file; the files to fix are read back
# from its "FILE:LINE:COL: error:" lines.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$clang_format" --dry-run --Werror "${files[@]}" 2>"$log"; then
  cat "$log" >&2
  mapfile -t failed < <(grep -oE '^[^:]+:[0-9]+:[0-9]+: error' "$log" |
    cut -d: -f1 | sort -u)
  echo "format.sh: ${#failed[@]} of ${#files[@]} files need clang-format" \
    "(fix with scripts/format.sh -i, or clang-format -i FILE):" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files formatted"
