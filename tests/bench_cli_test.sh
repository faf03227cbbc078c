#!/usr/bin/env bash
# gpipe-bench's command line: each bad flag exits with status 2 and one line
# on stderr naming the flag, before any section runs (no crash, no LibTorch
# backtrace, no CLI11 exit code, no JSON written); a cheap valid run writes
# its JSON and Markdown where asked.
#
#   bench_cli_test.sh GPIPE_BENCH [FORKS]
#
# FORKS (tests/cli_forks.cpp) runs gpipe-bench's program in processes forked
# after LibTorch's start-up; the first cases (and every case without FORKS)
# start the binary itself.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench=$(realpath "$1")
forks=${2:+$(realpath "$2")}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ulimit -c 0
cd "$tmp" || exit 1
failures=0
if [[ -n $forks ]]; then
  source "$here/cli_forks.sh"
  forks_start "$forks" "$bench"
fi

# Each case: the flag stderr must name, a tab, then the arguments (eval'd,
# so that '' is an empty argument).
cases=0
while IFS=$'\t' read -r flag args; do
  [[ -z $flag || $flag == \#* ]] && continue
  eval "set -- $args"
  cases=$((cases + 1))
  if [[ -n $forks && $cases -gt 4 ]]; then
    forks_run "$tmp/out" "$tmp/err" "$@"
  else
    timeout 60 "$bench" "$@" >out 2>err
    status=$?
  fi
  lines=$(wc -l <err)
  if [[ $status -ne 2 || $lines -ne 1 ]] || ! grep -qF -- "$flag" err ||
    grep -q "frame #" err || [[ -e gpipe-bench.json ]]; then
    echo "FAIL: gpipe-bench $args: status $status, $lines stderr lines: $(head -c 400 err)"
    failures=$((failures + 1))
    rm -f gpipe-bench.json
  else
    echo "ok: $args -> $(cat err)"
  fi
done <<'EOF'
--iters	--only random --iters 0
--iters	--only checkpoint --iters -3
--iters	--only checkpoint --iters ''
--iters	--only random --iters 3x
--iters was given 2 times; give it once	--only random --iters 1 --iters 2
--iters expects a number from 1 to 100000, but got '3x'	--only random --iters 3x
--json expects a value after it	--only random --json
unknown flag '--bogus'	--bogus --only random
unknown flag '--iter' (did you mean --iters?)	--only random --iter 3
--quick is a switch: give it alone (or =true, =false), but got ''	--only random --quick=
--width	--only random --width -5
--batch	--only random --batch 0
--blocks	--only speed --blocks 1 --quick
--blocks	--only speed --blocks 0 --quick
--chunks	--only speed --chunks 0
--budget-mib	--only unet-memory --budget-mib 0
--budget-mib	--only unet-memory --budget-mib nan
--budget-mib	--only unet-memory --budget-mib inf
--only	--only nope
--only	--only ''
--bogus	--bogus
--only mesh	--only mesh
--only dist	--only dist
--json	--only random --json /nonexistent/folder/x.json
--json	--only random --json .
--json	--only random --json ''
--markdown	--only random --markdown /nonexistent/folder/x.md
--quick is a switch: give it alone (or =true, =false), but got 'maybe'	--only random --quick=maybe
--svg-dir '/nonexistent/folder' is not a folder this user can write into	--only unet-memory --svg-dir /nonexistent/folder
--markdown expects a path, but got ''	--only random --markdown ''
--svg-dir expects a path, but got ''	--only random --svg-dir ''
--dist-trace expects a path, but got ''	--only random --dist-trace ''
--markdown 'same.out' is the file --json 'same.out' names	--only random --json same.out --markdown same.out
--markdown './r.out' is the file --json 'r.out' names	--only random --json r.out --markdown ./r.out
--budget-mib: expected a positive number of MiB up to 16384, but got '16385'	--only unet-memory --budget-mib 16385
--budget-mib: expected a positive number of MiB up to 16384, but got '0'	--only unet-memory --budget-mib 0
EOF

# The mesh section on other than 4 ranks: refused before joining (it
# printed a line and exited 0 with "mesh": null).
WORLD_SIZE=2 timeout 60 "$bench" --only mesh >out 2>err
status=$?
if [[ $status -ne 2 ]] || ! grep -qF "runs on 4 ranks" err || [[ -e gpipe-bench.json ]]; then
  echo "FAIL: --only mesh on 2 ranks: status $status: $(head -c 400 err)"
  failures=$((failures + 1))
else
  echo "ok: --only mesh on 2 ranks -> $(cat err)"
fi

# A WORLD_SIZE that is no positive integer: refused naming it (it was
# read as 0, so "--only dist needs ranks" sent the user to gpipe-run).
for value in abc -2 3x 0; do
  if [[ -n $forks ]]; then
    WORLD_SIZE=$value forks_run "$tmp/out" "$tmp/err" --only dist
  else
    WORLD_SIZE=$value timeout 60 "$bench" --only dist >out 2>err
    status=$?
  fi
  expected="WORLD_SIZE must be a positive integer (as gpipe-run and torchrun set it), but got '$value'"
  if [[ $status -ne 2 || $(wc -l <err) -ne 1 ]] || ! grep -qF -- "$expected" err; then
    echo "FAIL: WORLD_SIZE=$value --only dist: status $status: $(head -c 400 err)"
    failures=$((failures + 1))
  else
    echo "ok: WORLD_SIZE=$value -> $(cat err)"
  fi
done

# A valid run: the cheapest section, its results where they were asked for.
if ! timeout 120 "$bench" --only random --json r.json --markdown r.md >out 2>err; then
  echo "FAIL: gpipe-bench --only random failed: $(head -c 400 err)"
  failures=$((failures + 1))
elif [[ ! -s r.json || ! -s r.md ]] || ! grep -q '"random"' r.json; then
  echo "FAIL: gpipe-bench --only random wrote no results: $(ls -la)"
  failures=$((failures + 1))
else
  echo "ok: --only random --json r.json --markdown r.md"
fi

# Chunk counts a batch cannot be cut into are left out, not timed as fewer
# micro-batches under their label (a batch of 1 ran 1 micro-batch as
# "gpipe-2p-chunks8").
if ! timeout 120 "$bench" --only inference --blocks 2 --width 8 --batch 1 \
  --iters 1 --json i.json >out 2>err; then
  echo "FAIL: gpipe-bench --only inference --batch 1 failed: $(head -c 400 err)"
  failures=$((failures + 1))
elif ! grep -q '^# chunks 8 left out: 1 rows cut into 1 micro-batches, not 8' out ||
  grep -q 'chunks8' i.json; then
  echo "FAIL: --batch 1 timed chunk counts it cannot cut: $(grep -i chunks out i.json | head -5)"
  failures=$((failures + 1))
else
  echo "ok: --only inference --batch 1 leaves chunks 4 and 8 out"
fi

if [[ $failures -gt 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "all gpipe-bench command-line checks passed"
