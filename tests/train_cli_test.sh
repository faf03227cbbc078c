#!/usr/bin/env bash
# gpipe-train's command line: every bad flag exits with status 2 and one line
# on stderr naming the flag (no signal, no core dump, no CLI11 exit code), and
# a valid run still trains.
#
#   train_cli_test.sh GPIPE_TRAIN bad [DATA_DIR [FORKS]] # needs no data set
#   train_cli_test.sh GPIPE_TRAIN run [DATA_DIR]         # exits 77 (skip) without one
#
# FORKS (tests/cli_forks.cpp) runs gpipe-train's program in processes
# forked after LibTorch's start-up, a few milliseconds a run where starting
# the binary takes 0.4 s; the cases marked `real` (and every case without
# FORKS) start the binary itself.
set -uo pipefail

bin=$1
mode=$2
data=${3:-/usr/share/datasets/fashion-mnist}
forks=${4:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ulimit -c 0
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# run ARGS...: runs gpipe-train, leaving $status, $tmp/out and $tmp/err.
# ${as[@]} goes first when set (another user). Through FORKS unless the
# case is `real` or runs as another user.
as=()
via_forks=0
if [[ -n $forks ]]; then
  source "$(dirname "${BASH_SOURCE[0]}")/cli_forks.sh"
  forks_start "$forks" "$bin"
  via_forks=1
fi
run() {
  if ((via_forks)) && [[ ${#as[@]} -eq 0 ]]; then
    forks_run "$tmp/out" "$tmp/err" "$@"
  else
    timeout 120 "${as[@]}" "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
    status=$?
  fi
}

# real COMMAND...: COMMAND with the binary itself started for each run.
real() {
  local saved=$via_forks
  via_forks=0
  "$@"
  via_forks=$saved
}

# bad FLAG ARGS...: ARGS must exit 2 with one stderr line that names FLAG.
bad() {
  local flag=$1
  shift
  run "$@"
  local lines
  lines=$(wc -l <"$tmp/err")
  if [[ $status -ne 2 ]]; then
    fail "gpipe-train $* exited $status, expected 2; stderr: $(head -c 500 "$tmp/err")"
  elif [[ $lines -ne 1 ]]; then
    fail "gpipe-train $* wrote $lines lines on stderr, expected 1: $(head -c 500 "$tmp/err")"
  elif ! grep -qF -- "$flag" "$tmp/err"; then
    fail "gpipe-train $*: stderr does not name $flag: $(cat "$tmp/err")"
  elif [[ -s $tmp/out ]]; then
    fail "gpipe-train $* wrote on stdout: $(head -c 500 "$tmp/out")"
  else
    echo "ok: $* -> $(cat "$tmp/err")"
  fi
}

if [[ $mode == bad ]]; then
  # The flags are checked before the data is read, so empty files will do
  # (and keep the data-set check from answering first).
  fake="$tmp/data"
  mkdir "$fake"
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
    t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
    touch "$fake/$f"
  done
  d=(--data-dir "$fake")

  # The failures gpipe-train used to have: SIGFPE, std::terminate (twice),
  # OpenMP out of memory, and exit 0 having done nothing.
  # (The binary itself, as the cases of each kind below.)
  real bad --log-every "${d[@]}" --log-every 0
  real bad --balance "${d[@]}" --balance 4,,5
  real bad --balance "${d[@]}" --balance abc
  real bad --threads-per-lane "${d[@]}" --threads-per-lane 99999999999
  real bad --epochs "${d[@]}" --epochs 0

  # CLI11's own errors, mapped to 2.
  real bad --no-such-flag "${d[@]}" --no-such-flag
  bad --no-such-flag "${d[@]}" --no-such-flag=3
  bad "--chunks expects a value after it" "${d[@]}" --chunks
  bad --chunks "${d[@]}" --chunks abc
  bad --chunks "${d[@]}" --chunks 1.5
  bad "--chunks was given 2 times; give it once" "${d[@]}" --chunks 3 --chunks 5
  bad --epochs "${d[@]}" --epochs 1e3
  bad "--lr: expected a number, but got 'abc'" "${d[@]}" --lr abc
  # CLI11 read an empty value as 0, "0x3" as 3, and took " 0.1" but not
  # "0.1 "; and it took a switch twice where it refuses a value twice.
  bad "--lr: expected a number, but got ''" "${d[@]}" --lr ''
  bad "--lr: expected a number, but got ' 0.1'" "${d[@]}" --lr ' 0.1'
  bad "--save-every-steps: expected a decimal integer, but got '0x3'" "${d[@]}" \
    --save "$tmp/s" --save-every-steps 0x3
  bad "--save-every-steps: expected a decimal integer, but got ''" "${d[@]}" \
    --save "$tmp/s" --save-every-steps ''
  bad "--json was given 2 times; give it once" "${d[@]}" --json --json
  bad "--resume was given 2 times; give it once" "${d[@]}" --save "$tmp/s" --resume --resume
  # A file the folder cannot take: told before training, not after it.
  bad --timeline "${d[@]}" --timeline /proc/gpipe-cli-test.svg
  # A default given explicitly is taken as the default: the run gets as far
  # as reading the (empty) data.
  run "${d[@]}" --stages-per-lane 1 --trace-steps 3
  if [[ $status -ne 1 ]] || ! grep -q "too short for IDX" "$tmp/err"; then
    fail "--stages-per-lane 1 --trace-steps 3 (the defaults) exited $status: $(cat "$tmp/err")"
  else
    echo "ok: the defaults given explicitly are taken"
  fi
  # Image and label files of other lengths: the pair and both counts (it
  # said only "the image and label files do not have as many entries").
  uneven="$tmp/uneven"
  mkdir "$uneven"
  images() { # count: an IDX image file of `count` 28 x 28 images
    { printf '\x00\x00\x08\x03\x00\x00\x00'"\\x0$1"'\x00\x00\x00\x1c\x00\x00\x00\x1c'
      head -c $(($1 * 784)) /dev/zero; } | gzip
  }
  labels() { # count: an IDX label file of `count` labels
    { printf '\x00\x00\x08\x01\x00\x00\x00'"\\x0$1"; head -c "$1" /dev/zero; } | gzip
  }
  images 2 >"$uneven/train-images-idx3-ubyte.gz"
  labels 2 >"$uneven/train-labels-idx1-ubyte.gz"
  images 2 >"$uneven/t10k-images-idx3-ubyte.gz"
  labels 3 >"$uneven/t10k-labels-idx1-ubyte.gz"
  run --data-dir "$uneven"
  if [[ $status -ne 1 ]] ||
    ! grep -qF "t10k-images-idx3-ubyte.gz has 2 images but t10k-labels-idx1-ubyte.gz has 3 labels" "$tmp/err"; then
    fail "image and label files of other lengths: exited $status: $(cat "$tmp/err")"
  else
    echo "ok: $(cat "$tmp/err")"
  fi
  bad "unknown flag '--no-such-flag'" "${d[@]}" --no-such-flag
  bad "unexpected argument 'stray'" "${d[@]}" stray
  # A mistyped flag with its value: named, with the flag it may mean
  # (CLI11's message gave "'1 --epoch'", the words last first).
  bad "unknown flag '--epoch' (did you mean --epochs?)" "${d[@]}" --epoch 1
  bad "unknown flag '--ep' (did you mean --epochs?)" "${d[@]}" --ep 1 --bar 2
  bad "unexpected argument 'stray'" "${d[@]}" stray --also
  # An empty value is refused for a switch as for any flag (CLI11 read it
  # as true).
  bad "--json is a switch: give it alone (or =true, =false), but got ''" \
    "${d[@]}" --json=
  bad --json "${d[@]}" --json=maybe
  bad --model "${d[@]}" --model vgg
  bad --schedule "${d[@]}" --schedule gpipe
  bad --checkpoint "${d[@]}" --checkpoint sometimes

  # Integers: plain decimals that fit, in range.
  bad --chunks "${d[@]}" --chunks 99999999999999999999
  bad --chunks "${d[@]}" --chunks 0x10
  bad --chunks "${d[@]}" --chunks 0
  bad --chunks "${d[@]}" --chunks -1
  bad --chunks "${d[@]}" --chunks 65 --batch-size 64
  bad --epochs "${d[@]}" --epochs -1
  bad --batch-size "${d[@]}" --batch-size 0
  bad --batch-size "${d[@]}" --batch-size -64
  bad --partitions "${d[@]}" --partitions 0
  bad --partitions "${d[@]}" --partitions 14
  bad --partitions "${d[@]}" --model resnet --partitions 40
  bad --threads-per-lane "${d[@]}" --threads-per-lane -1
  bad --threads-per-lane "${d[@]}" --threads-per-lane 1025
  bad --limit "${d[@]}" --limit -1
  bad --test-limit "${d[@]}" --test-limit -1
  bad --log-every "${d[@]}" --log-every -5
  bad --seed "${d[@]}" --seed -1
  bad --seed "${d[@]}" --seed 99999999999999999999
  bad --trace-steps "${d[@]}" --trace "$tmp/t.json" --trace-steps 0
  bad --trace-steps "${d[@]}" --trace-steps 2

  # --lr: positive and finite.
  bad --lr "${d[@]}" --lr 0
  bad --lr "${d[@]}" --lr -0.1
  bad --lr "${d[@]}" --lr nan
  bad --lr "${d[@]}" --lr inf
  bad --lr "${d[@]}" --lr 1e999

  # --balance: parseable, positive, one per partition, summing to the layers.
  bad --balance "${d[@]}" --balance ''
  bad --balance "${d[@]}" --balance 6,7,
  bad --balance "${d[@]}" --balance ,6,7
  bad --balance "${d[@]}" --balance 6,0,7
  bad --balance "${d[@]}" --balance 6,-1,8
  bad --balance "${d[@]}" --balance 6,6
  bad --balance "${d[@]}" --balance 99999999999999999999,1
  bad --balance "${d[@]}" --balance 9223372036854775807,9223372036854775807
  bad --balance "${d[@]}" --balance 6,7 --partitions 3
  bad --balance "${d[@]}" --model resnet --balance 6,7
  bad --balance "${d[@]}" --model unet --balance 21,18

  # Files.
  bad --data-dir --data-dir "$tmp/no-such-folder"
  bad --data-dir --data-dir "$tmp"
  bad --data-dir --data-dir "$fake/train-images-idx3-ubyte.gz"
  # A folder where a file of the data set should be: said so (it said the
  # folder had no such file).
  mkdir -p "$tmp/folder-in-place/t10k-images-idx3-ubyte.gz"
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-labels-idx1-ubyte.gz; do
    cp "$fake/$f" "$tmp/folder-in-place/$f"
  done
  bad "holds t10k-images-idx3-ubyte.gz, but not as a file" --data-dir "$tmp/folder-in-place"
  bad "its folder, does not exist" "${d[@]}" --trace "$tmp/no-such-folder/t.json"
  # Under a file, not a folder: it said the folder did not exist.
  touch "$tmp/a-file"
  bad "'$tmp/a-file' is not a folder" "${d[@]}" --trace "$tmp/a-file/t.json"
  bad --trace "${d[@]}" --trace "$tmp"
  bad --trace "${d[@]}" --trace ''
  bad --timeline "${d[@]}" --timeline "$tmp/no-such-folder/t.svg"
  bad --timeline "${d[@]}" --trace "$tmp/t.out" --timeline "$tmp/t.out"

  # Schedules and plans.
  bad --stages-per-lane "${d[@]}" --schedule interleaved --stages-per-lane 3
  bad --stages-per-lane "${d[@]}" --schedule zero_bubble_v --stages-per-lane 3
  bad --memory-limit "${d[@]}" --memory-limit 256M
  bad --memory-limit "${d[@]}" --autotune --memory-limit 12X
  bad --memory-limit "${d[@]}" --autotune --memory-limit -5M
  # Sizes std::stod takes but that are not sizes: hex, a fraction of a
  # byte, a leading space, an exponent, more than 16384G.
  for size in 0x100 1.5 ' 256M' 1e3M 99999999G 1.M; do
    bad --memory-limit "${d[@]}" --autotune --memory-limit "$size"
  done
  bad --chunks "${d[@]}" --autotune --chunks 2
  bad --schedule "${d[@]}" --autotune --schedule 1f1b
  # A flag --autotune chooses is refused as such, before that flag's own
  # checks (this one said "--schedule is autograd").
  bad "--autotune chooses --stages-per-lane itself" "${d[@]}" --autotune --stages-per-lane 2
  bad "needs an even number of partitions" "${d[@]}" --schedule zero_bubble_v --partitions 3
  bad --stages-per-lane "${d[@]}" --schedule 1f1b --stages-per-lane 0
  bad --stages-per-lane "${d[@]}" --stages-per-lane 2
  bad --plan "${d[@]}" --plan "$tmp/no-such-plan.csv"
  printf '0F0,0B0\n1F0,1B0\n' >"$tmp/plan.csv"
  bad --plan "${d[@]}" --plan "$tmp/plan.csv" --schedule 1f1b
  printf '0F0,0X0\n' >"$tmp/bad.csv"
  bad --plan "${d[@]}" --plan "$tmp/bad.csv"
  printf '0F0,0B0\n1B0,1F0\n' >"$tmp/deadlock.csv"
  bad --plan "${d[@]}" --plan "$tmp/deadlock.csv"
  printf '0F0,1F0,1B0,0B0\n' >"$tmp/one-lane.csv"
  bad --plan "${d[@]}" --plan "$tmp/one-lane.csv"
  # A plan of 2 micro-batches against --chunks given otherwise (it used to
  # train nothing and exit 0): both numbers named.
  printf '0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n' >"$tmp/two.csv"
  bad "--chunks is 4" "${d[@]}" --plan "$tmp/two.csv" --chunks 4
  bad "for 2 micro-batches, but --chunks is 8" "${d[@]}" --plan "$tmp/two.csv" --chunks 8
  bad "more than --batch-size 1" "${d[@]}" --plan "$tmp/two.csv" --batch-size 1
  # A count that a batch does not cut into (Tensor::chunk cuts 9 rows asked
  # for 4 into 3): a plan of 4 trained nothing and exited 0, and --chunks 4
  # ran 3 micro-batches while the run said 4.
  printf '0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n' >"$tmp/four.csv"
  bad "--plan '$tmp/four.csv' is for 4 micro-batches, but the 9 rows of a batch cut into 3 micro-batches" \
    "${d[@]}" --plan "$tmp/four.csv" --batch-size 9
  bad "--chunks 4: the 9 rows of a batch cut into 3 micro-batches of up to 3 rows, not 4 (Tensor::chunk's pieces); 3 or 5 micro-batches cut them" \
    "${d[@]}" --chunks 4 --batch-size 9
  printf '0F1000000000,0B0\n' >"$tmp/huge.csv"
  real bad "out of range" "${d[@]}" --plan "$tmp/huge.csv"
  # A forward-only plan (valid for inference) was refused by train_step
  # after profiling and building the model, with exit status 1.
  printf '0F0,0F1\r\n1F0,1F1\r\n' >"$tmp/forward-only.csv"
  bad "--plan '$tmp/forward-only.csv': it has 4 forwards and no backward" \
    "${d[@]}" --plan "$tmp/forward-only.csv"

  # A plan of no micro-batches (a placement line alone, as to_csv writes
  # make_plan(s, 0, ...)): the run divided by zero (SIGFPE), or with
  # --chunks 4 was told to give --chunks 0.
  printf '# placement: 1 0\n' >"$tmp/empty.csv"
  bad "--plan '$tmp/empty.csv': it has no actions (0 micro-batches)" \
    "${d[@]}" --plan "$tmp/empty.csv"
  bad "--plan '$tmp/empty.csv': it has no actions (0 micro-batches)" \
    "${d[@]}" --plan "$tmp/empty.csv" --chunks 4

  bad --lr-schedule "${d[@]}" --lr-schedule linear
  bad --devices "${d[@]}" --devices gpu:0,cpu
  bad --devices "${d[@]}" --devices cpu
  bad --devices "${d[@]}" --devices cpu,cpu,
  # A CUDA device this LibTorch cannot reach: one line before anything is
  # built, not the dispatcher's dump (99 is past any machine's count).
  real bad --devices "${d[@]}" --devices cuda:98,cuda:99

  # Saving and loading weights.
  : >"$tmp/a-file"
  bad "--save '$tmp/a-file' is a file" "${d[@]}" --save "$tmp/a-file"
  bad "--save '$tmp/a-file/m': '$tmp/a-file' is a file, not a directory" \
    "${d[@]}" --save "$tmp/a-file/m"
  # Made with its parents before anything runs (the first checkpoint made
  # them only after an epoch's work, and a missing parent was refused).
  run "${d[@]}" --save "$tmp/no-such-folder/a/m"
  if [[ ! -d $tmp/no-such-folder/a/m ]]; then
    fail "--save of a new nested folder did not make it: $(cat "$tmp/err")"
  else
    echo "ok: --save makes its folder with the parents"
  fi
  # A checkpoint itself: saving into it nested the new ones, which --resume
  # never read (it reads the directory given when it holds a manifest).
  mkdir -p "$tmp/ck/step-00000003"
  echo '{}' >"$tmp/ck/step-00000003/manifest.json"
  bad "--save '$tmp/ck/step-00000003' is a checkpoint itself (it holds manifest.json); give the directory that holds it ('$tmp/ck')" \
    "${d[@]}" --save "$tmp/ck/step-00000003" --resume
  # A newest checkpoint without its manifest (damaged: a step-<n> appears
  # whole or not at all) was "nothing saved yet", and training began again.
  mkdir -p "$tmp/dmg/step-00000004"
  bad "--save '$tmp/dmg': '$tmp/dmg/step-00000004' is not a whole checkpoint (it has no manifest.json)" \
    "${d[@]}" --save "$tmp/dmg" --resume
  bad "'$tmp/dmg/step-00000004' is not a whole checkpoint" "${d[@]}" --save "$tmp/dmg"
  # A --save folder this user cannot write: refused before training, not
  # when the first checkpoint is due, after an epoch's work. (Root writes
  # anywhere: as root, gpipe-train runs as nobody here.)
  mkdir "$tmp/locked"
  chmod 555 "$tmp/locked"
  if [[ $EUID -eq 0 ]]; then
    chmod 755 "$tmp"
    as=(setpriv --reuid=nobody --regid=nogroup --clear-groups --)
  fi
  bad "--save '$tmp/locked' is not writable" "${d[@]}" --save "$tmp/locked"
  bad "--save '$tmp/locked/m': cannot make the directory" "${d[@]}" --save "$tmp/locked/m"
  as=()
  chmod 700 "$tmp"
  bad --save-every-steps "${d[@]}" --save-every-steps 3
  bad --save-every-steps "${d[@]}" --save "$tmp/m" --save-every-steps -1
  # (A run refused leaves no --save folder made.)
  if [[ -e $tmp/m ]]; then
    fail "a refused run made its --save folder $tmp/m"
  fi
  bad --load "${d[@]}" --load "$tmp/no-such-model.pt"
  # Files that are not archives: named, with what was expected, before the
  # data is read (the fake data set would fail first otherwise).
  : >"$tmp/empty.pt"
  bad "--load '$tmp/empty.pt': cannot read '$tmp/empty.pt': the file is empty; expected an archive" \
    "${d[@]}" --load "$tmp/empty.pt"
  printf 'PK\003\004 not really a zip' >"$tmp/corrupt.pt"
  real bad "it is truncated or not such an archive" "${d[@]}" --load "$tmp/corrupt.pt"
  bad --resume "${d[@]}" --resume
  bad --resume "${d[@]}" --resume --save "$tmp/m.pt" --load "$tmp/m.pt"

  # Under a launcher (WORLD_SIZE set): ranks x stages-per-lane partitions,
  # no autograd schedule, a well-formed WORLD_SIZE; all refused before joining the job.
  export WORLD_SIZE=2
  bad --partitions "${d[@]}" --partitions 3
  bad --balance "${d[@]}" --balance 4,4,5
  bad --schedule "${d[@]}" --schedule autograd
  bad --partitions "${d[@]}" --schedule interleaved --partitions 2
  bad --balance "${d[@]}" --stages-per-lane 2 --balance 6,7
  bad --stages-per-lane "${d[@]}" --stages-per-lane 0
  bad --devices "${d[@]}" --schedule 1f1b --devices cpu,cpu
  bad "for 2 micro-batches, but --chunks is 8" "${d[@]}" --plan "$tmp/two.csv" --chunks 8
  # A plan with partition 0 off lane 0 (rank 0 reads the images): refused
  # here, where it was refused by every rank, exit 1, after balancing.
  printf '# placement: 1 0\n1F0,1B0\n0F0,0B0\n' >"$tmp/off.csv"
  bad "so partition 0 must be on lane 0, but its placement [1, 0] puts it on lane 1" \
    "${d[@]}" --plan "$tmp/off.csv" --chunks 1
  # With replicas, each cuts its own shard: checked against the shard.
  export WORLD_SIZE=4
  bad "--chunks 8 is more than each replica's shard of 4 rows (--batch-size 8 over 2 replicas)" \
    "${d[@]}" --pipeline-size 2 --chunks 8 --batch-size 8
  bad "more than each replica's shard of 1 row (--batch-size 2 over 2 replicas)" \
    "${d[@]}" --pipeline-size 2 --plan "$tmp/two.csv" --batch-size 2
  # More ranks than the model's layers: the message names the ranks (it
  # said "--partitions must be between 1 and 13", a flag not given).
  export WORLD_SIZE=14
  bad "the pipeline has 14 ranks (--pipeline-size, of the 14 the launcher started) with 1 partition each, 14 partitions in all, but --model cnn has 13 layers" "${d[@]}"
  export WORLD_SIZE=7
  bad "with 2 partitions each, 14 partitions in all, but --model cnn has 13 layers, one partition each at most: start fewer ranks, give a smaller --pipeline-size" \
    "${d[@]}" --schedule zero_bubble_v
  export WORLD_SIZE=two
  real bad WORLD_SIZE "${d[@]}"
  export WORLD_SIZE=0
  bad WORLD_SIZE "${d[@]}"
  # One process told it is rank 1: it trained alone, as rank 0 would.
  export WORLD_SIZE=1 RANK=1
  real bad "RANK must be 0 when WORLD_SIZE is 1, but got '1'" "${d[@]}"
  # A malformed variable of the job's environment is a command-line error
  # (exit 2, which gpipe-run does not restart), not a failed run (1).
  export WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 GPIPE_DIST_TIMEOUT=abc
  real bad GPIPE_DIST_TIMEOUT "${d[@]}" --schedule 1f1b
  unset WORLD_SIZE RANK MASTER_ADDR MASTER_PORT GPIPE_DIST_TIMEOUT

  # --help still prints the flags and exits 0, each option with its
  # default.
  real run --help
  if [[ $status -ne 0 ]] || ! grep -qF -- --threads-per-lane "$tmp/out"; then
    fail "gpipe-train --help exited $status; stdout: $(head -c 500 "$tmp/out")"
  elif ! grep -qE -- '--chunks INT=4 ' "$tmp/out" ||
    ! grep -qE -- '--lr FLOAT=0\.05 ' "$tmp/out" ||
    ! grep -qE -- '--checkpoint TEXT:\{[a-z_,]+\}=except_last$' "$tmp/out" ||
    ! grep -qE -- '--data-dir TEXT=/usr/share/datasets/fashion-mnist$' "$tmp/out" ||
    ! grep -qF -- 'under a launcher the default is fill_drain' "$tmp/out"; then
    fail "gpipe-train --help does not show the defaults: $(grep -E -- '--(chunks|lr|checkpoint|data-dir) ' "$tmp/out")"
  else
    echo "ok: --help, with defaults: $(grep -E -- '--chunks ' "$tmp/out")"
  fi
elif [[ $mode == run ]]; then
  # Every run evaluates on 1,000 test images (--test-limit): enough to
  # tell trained weights from fresh ones, a tenth of the time.
  # Skipped (ctest's 77) only without the data: Debian's
  # dataset-fashion-mnist is not installed (scripts/setup.sh installs it).
  if [[ ! -f $data/train-images-idx3-ubyte.gz ]]; then
    # Skipped without Debian's dataset-fashion-mnist (scripts/setup.sh
    # installs it): this check trains on the real data.
    echo "skipped: no Fashion-MNIST in $data"
    exit 77  # skipped: needs Debian's dataset-fashion-mnist (real data)
  fi
  # One epoch over 256 images: 4 steps of 64, steps 2-4 traced.
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json \
    --trace "$tmp/t.json" --timeline "$tmp/t.svg"
  if [[ $status -ne 0 ]]; then
    fail "a valid run exited $status: $(cat "$tmp/err")"
  elif ! grep -q '"steps":4' "$tmp/out"; then
    fail "a valid run printed no JSON summary of 4 steps: $(cat "$tmp/out")"
  elif [[ ! -s $tmp/t.json || ! -s $tmp/t.svg ]]; then
    fail "a valid run wrote no trace: $(cat "$tmp/out")"
  elif ! grep -q '^balance_by_time chose \[[0-9]*, [0-9]*\] from per-layer ms' "$tmp/err"; then
    fail "a run without --balance did not say which balance it chose: $(head -3 "$tmp/err")"
  elif grep -qv '^{.*}$' "$tmp/out"; then
    fail "--json left other lines than JSON on stdout: $(grep -v '^{.*}$' "$tmp/out" | head -3)"
  elif ! grep -q '^epoch 1 done: test accuracy' "$tmp/err"; then
    fail "--json: the progress did not go to stderr: $(head -3 "$tmp/err")"
  else
    echo "ok: valid run: $(tail -n 1 "$tmp/out")"
  fi
  # A --batch-size near 2^63 (one batch of everything) overflowed the
  # check of how it cuts into micro-batches: SIGFPE.
  run --data-dir "$data" --epochs 1 --limit 128 --test-limit 64 --json \
    --batch-size 9223372036854775807
  if [[ $status -ne 0 ]] || ! grep -q '"steps":1,' "$tmp/out"; then
    fail "--batch-size 9223372036854775807 exited $status: $(tail -c 300 "$tmp/err")"
  else
    echo "ok: --batch-size 9223372036854775807 trains one batch of 128"
  fi
  # A recording that would cross an epoch's end ends with the epoch: the
  # test passes (a forward of 64 images in 4 micro-batches per lane) are
  # not recorded among the steps; there were 16 forwards for 8.
  run --data-dir "$data" --epochs 2 --limit 128 --test-limit 64 \
    --trace "$tmp/e.json"
  forwards=$(grep -o '"cat":"forward"' "$tmp/e.json" | wc -l)
  if [[ $status -ne 0 ]]; then
    fail "a traced run of 2 epochs exited $status: $(cat "$tmp/err")"
  elif ! grep -q 'steps 2-2 (the epoch ended: its test passes are not recorded)' "$tmp/out"; then
    fail "a traced run of 2 epochs of 2 steps: $(grep wrote "$tmp/out")"
  elif [[ $forwards -ne 8 ]]; then
    fail "a traced run of 2 epochs recorded $forwards forwards, expected 8 (one step)"
  else
    echo "ok: the recording ends with the epoch: $(grep wrote "$tmp/out")"
  fi
  # The balance is profiled on a micro-batch as the run cuts it: 10 images
  # in 4 chunks are micro-batches of 3 (it profiled and said 10).
  run --data-dir "$data" --epochs 1 --limit 10 --test-limit 100 --json
  if [[ $status -ne 0 ]]; then
    fail "a run of 10 images exited $status: $(cat "$tmp/err")"
  elif ! grep -q 'from per-layer ms (forward + backward of 3 images)' "$tmp/err"; then
    fail "a run of 10 images in 4 chunks did not profile 3: $(grep balance_by_time "$tmp/err")"
  else
    echo "ok: 10 images in 4 chunks profiled on 3"
  fi
  # Only the images the run keeps are read, but those must be there: test
  # labels cut short after 900 of 10,000 train with --test-limit 800 and
  # stop with exit 1 naming the file with 1,000 (or all).
  short="$tmp/short"
  mkdir "$short"
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
    t10k-images-idx3-ubyte.gz; do
    ln -s "$data/$f" "$short/$f"
  done
  gzip -dc "$data/t10k-labels-idx1-ubyte.gz" | head -c 908 | gzip >"$short/t10k-labels-idx1-ubyte.gz"
  run --data-dir "$short" --epochs 1 --limit 64 --test-limit 800 --balance 6,7 --json
  if [[ $status -ne 0 ]] || ! grep -q '"test_samples":800' "$tmp/out"; then
    fail "800 test images of a file cut after 900: exit $status: $(tail -2 "$tmp/err")"
  else
    echo "ok: 800 test images of a file cut after 900 are read"
  fi
  for test_limit in 1000 0; do
    run --data-dir "$short" --epochs 1 --limit 64 --test-limit $test_limit --balance 6,7
    if [[ $status -ne 1 ]] || ! grep -q "t10k-labels-idx1-ubyte.gz: truncated IDX payload" "$tmp/err"; then
      fail "--test-limit $test_limit of a file cut after 900: exit $status: $(tail -2 "$tmp/err")"
    else
      echo "ok: --test-limit $test_limit of a file cut after 900: $(tail -1 "$tmp/err")"
    fi
  done
  # A header that promises 4 billion images of 65535 x 65535 pixels is
  # said, not allocated.
  rm "$short/t10k-images-idx3-ubyte.gz"
  printf '\0\0\10\3\377\377\377\377\0\0\377\377\0\0\377\377' | gzip >"$short/t10k-images-idx3-ubyte.gz"
  run --data-dir "$short" --epochs 1 --limit 64 --test-limit 800 --balance 6,7
  if [[ $status -ne 1 ]] || ! grep -q "t10k-images-idx3-ubyte.gz: expected images of 1 x 1 to 4096 x 4096 pixels in its header, but got 65535 x 65535" "$tmp/err"; then
    fail "an IDX header of 65535 x 65535 images: exit $status: $(tail -2 "$tmp/err")"
  else
    echo "ok: an IDX header of 65535 x 65535 images: $(tail -1 "$tmp/err")"
  fi
  # The new schedules, and a plan written by hand (4 micro-batches on 2
  # lanes, zero-bubble style), run.
  for schedule in interleaved zero_bubble zero_bubble_v looped_bfs; do
    run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --partitions 4 \
      --schedule "$schedule"
    if [[ $status -ne 0 ]] || ! grep -q '"steps":4' "$tmp/out"; then
      fail "--schedule $schedule exited $status: $(cat "$tmp/err") $(cat "$tmp/out")"
    else
      echo "ok: --schedule $schedule: $(grep -o '"stages_per_lane":[0-9]*' "$tmp/out")"
    fi
  done
  # --autotune picks the layout under the limit, says so, and trains.
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --autotune \
    --memory-limit 40M
  if [[ $status -ne 0 ]] || ! grep -q '"autotune":true' "$tmp/out" ||
    ! grep -q '^autotune: balance' "$tmp/err"; then
    fail "--autotune exited $status: $(head -c 800 "$tmp/err") $(cat "$tmp/out")"
  else
    echo "ok: --autotune: $(grep '^autotune: ' "$tmp/err")"
  fi
  # It trains with the threads per lane it chose: a count it fixed is the
  # run's count ("plan" is the default, the lanes sharing by the plan).
  chosen=$(grep -o 'threads per lane [0-9a-z]*' "$tmp/err" | head -n 1 | awk '{print $4}')
  if [[ -z $chosen ]]; then
    fail "--autotune printed no threads per lane: $(head -c 800 "$tmp/err")"
  elif [[ $chosen =~ ^[0-9]+$ ]] && ! grep -q "\"threads_per_lane\":$chosen[,}]" "$tmp/out"; then
    fail "--autotune chose $chosen threads per lane, but the run says $(grep -o '"threads_per_lane":[0-9]*' "$tmp/out")"
  else
    echo "ok: --autotune threads per lane: $chosen"
  fi
  # A batch smaller than --chunks' default: --autotune chooses the chunks,
  # so the default is no reason to refuse.
  run --data-dir "$data" --epochs 1 --limit 12 --test-limit 100 --json --autotune --batch-size 3
  if [[ $status -ne 0 ]] || ! grep -q '^autotune: balance' "$tmp/err"; then
    fail "--autotune --batch-size 3 exited $status: $(tail -c 800 "$tmp/err")"
  else
    echo "ok: --autotune --batch-size 3: $(grep '^autotune: ' "$tmp/err")"
  fi
  # A resumed --autotune run takes the saved choice instead of tuning again
  # (tuning times the layers, and may choose otherwise).
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 100 --json --autotune --save "$tmp/tuned"
  first=$(grep -o '^autotune: balance [^:]*' "$tmp/err" | sed 's/, threads per lane.*//')
  chunks=$(grep -o 'chunks [0-9]*' <<<"$first" | awk '{print $2}')
  run --data-dir "$data" --epochs 2 --limit 256 --test-limit 100 --json --autotune --save "$tmp/tuned" --resume
  if [[ $status -ne 0 ]] || ! grep -q "^autotune: the choice saved in $tmp/tuned, not tuned again: lanes=2 chunks=$chunks " "$tmp/err" ||
    grep -q '^autotune: balance' "$tmp/err"; then
    fail "--autotune --resume exited $status (first run: $first): $(head -c 800 "$tmp/err")"
  else
    echo "ok: --autotune --resume: $(grep '^autotune: ' "$tmp/err")"
  fi
  # Resumed with an explicit --threads-per-lane: tuned for it, not the
  # saved choice's threads (which overrode the flag, 'shared by the plan').
  cp -r "$tmp/tuned" "$tmp/tuned1"
  run --data-dir "$data" --epochs 3 --limit 256 --test-limit 100 --json --autotune \
    --threads-per-lane 1 --save "$tmp/tuned1" --resume
  if [[ $status -ne 0 ]] ||
    ! grep -q "^autotune: the choice saved in $tmp/tuned1 was for --threads-per-lane 0; tuning for 1" "$tmp/err" ||
    ! grep -q '"threads_per_lane":1[,}]' "$tmp/out"; then
    fail "--autotune --resume --threads-per-lane 1 exited $status: $(head -c 800 "$tmp/err") $(tail -1 "$tmp/out")"
  else
    echo "ok: --autotune --resume --threads-per-lane 1 tunes again"
  fi
  # Resumed on other lanes (any layout resumes): tuned for them.
  run --data-dir "$data" --epochs 3 --limit 256 --test-limit 100 --json --autotune --partitions 3 \
    --save "$tmp/tuned" --resume
  if [[ $status -ne 0 ]] || ! grep -q "^autotune: the choice saved in $tmp/tuned was for 2 lanes; tuning for 3" "$tmp/err" ||
    ! grep -q '^autotune: balance' "$tmp/err"; then
    fail "--autotune --resume on 3 lanes exited $status: $(head -c 800 "$tmp/err")"
  else
    echo "ok: --autotune --resume on 3 lanes tunes again"
  fi
  # Resumed with a lower --memory-limit (as after running out of memory):
  # tuned again under it, not the saved choice (made with no limit).
  run --data-dir "$data" --epochs 4 --limit 256 --test-limit 100 --json --autotune --partitions 3 \
    --memory-limit 1K --save "$tmp/tuned" --resume
  if [[ $status -ne 1 ]] ||
    ! grep -q "^autotune: the choice saved in $tmp/tuned was for --memory-limit none; tuning for 1024 bytes" "$tmp/err" ||
    ! grep -q 'no candidate fits the memory limit of 1.0 KiB' "$tmp/err"; then
    fail "--autotune --resume --memory-limit 1K exited $status: $(head -c 800 "$tmp/err")"
  else
    echo "ok: --autotune --resume under a new --memory-limit tunes again"
  fi
  # A limit nothing fits: a clear error naming the smallest peak, exit 1.
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --autotune \
    --memory-limit 1K
  if [[ $status -ne 1 ]] || ! grep -q 'no candidate fits the memory limit of 1.0 KiB' "$tmp/err"; then
    fail "--autotune --memory-limit 1K exited $status: $(tail -c 800 "$tmp/err")"
  else
    echo "ok: --autotune under 1K: $(tail -n 1 "$tmp/err")"
  fi
  # A plan that carries its placement (ZB-V's V, as Plan::to_csv writes
  # it) runs on that placement.
  {
    echo "# placement: 0 1 1 0"
    echo "0F0,0F1,0F2,3F0,3I0,3W0,3F1,3I1,3W1,0F3,0I0,0W0,3F2,3I2,3W2,0I1,0W1,3F3,3I3,3W3,0I2,0W2,0I3,0W3"
    echo "1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2I1,2W1,1F3,1I1,1W1,2F3,2I2,2W2,1I2,2I3,1I3,1W2,2W3,1W3"
  } >"$tmp/v.csv"
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --partitions 4 \
    --stages-per-lane 2 --plan "$tmp/v.csv"
  if [[ $status -ne 0 ]] || ! grep -q '"placement":"v_shape(2 lanes)"' "$tmp/out"; then
    fail "--plan with a V placement exited $status: $(tail -c 600 "$tmp/err") $(cat "$tmp/out")"
  else
    echo "ok: --plan with a placement line: $(grep -o '"placement":"[^"]*"' "$tmp/out")"
  fi
  # ZB-V runs its 4 partitions in a V on 2 lanes.
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --partitions 4 \
    --schedule zero_bubble_v
  if [[ $status -ne 0 ]] || ! grep -q '"placement":"v_shape(2 lanes)"' "$tmp/out"; then
    fail "--schedule zero_bubble_v did not run on a V: $(cat "$tmp/out")"
  else
    echo "ok: --schedule zero_bubble_v on $(grep -o '"placement":"[^"]*"' "$tmp/out")"
  fi
  {
    echo "0F0,0F1,0B0,0W0,0F2,0B1,0W1,0F3,0B2,0W2,0B3,0W3"
    echo "1F0,1B0,1F1,1B1,1W0,1F2,1B2,1W1,1F3,1B3,1W2,1W3"
  } >"$tmp/zb.csv"
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --plan "$tmp/zb.csv"
  if [[ $status -ne 0 ]] || ! grep -q '"schedule":"plan"' "$tmp/out"; then
    fail "--plan exited $status: $(cat "$tmp/err") $(cat "$tmp/out")"
  else
    echo "ok: --plan: $(tail -n 1 "$tmp/out")"
  fi
  # A plan of 2 micro-batches without --chunks: --chunks is the plan's, said
  # so, and every batch trains (it used to train none and exit 0).
  {
    echo "0F0,0F1,0B0,0B1"
    echo "1F0,1B0,1F1,1B1"
  } >"$tmp/two.csv"
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --plan "$tmp/two.csv"
  if [[ $status -ne 0 ]] || ! grep -q '"chunks":2,.*"steps":4' "$tmp/out" ||
    ! grep -qF -- "--chunks 2: the micro-batches of --plan $tmp/two.csv" "$tmp/err"; then
    fail "--plan of 2 micro-batches without --chunks exited $status: $(cat "$tmp/err") $(cat "$tmp/out")"
  else
    echo "ok: --plan of 2 micro-batches: $(grep -o '"chunks":2' "$tmp/out")"
  fi
  # A run where no batch trains is refused before it starts: it trained no
  # step, exited 0 and reported a loss of 0.
  {
    echo "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3"
    echo "1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3"
  } >"$tmp/four_mb.csv"
  run --data-dir "$data" --epochs 1 --limit 9 --test-limit 64 --chunks 4 \
    --plan "$tmp/four_mb.csv" --json
  if [[ $status -ne 2 ]] || [[ -s $tmp/out ]] ||
    ! grep -q "no batch trains: the 9 training images make one batch of 9, which cuts into fewer micro-batches than --plan's 4" "$tmp/err"; then
    fail "a run where no batch trains exited $status: $(tail -2 "$tmp/err") $(cat "$tmp/out")"
  else
    echo "ok: a run where no batch trains: $(tail -1 "$tmp/err")"
  fi
  # A JSON summary that cannot be written (a full disk) fails the run; it
  # exited 0 with the results lost.
  timeout 120 "$bin" --data-dir "$data" --epochs 1 --limit 128 --test-limit 100 \
    --balance 6,7 --json >/dev/full 2>"$tmp/err"
  status=$?
  if [[ $status -ne 1 ]] || ! grep -q "cannot write the JSON summary to standard output" "$tmp/err"; then
    fail "--json into /dev/full exited $status: $(cat "$tmp/err")"
  else
    echo "ok: --json into /dev/full -> $(tail -1 "$tmp/err")"
  fi
  # So does the progress and the accuracy without --json (exit 0, silent).
  timeout 120 "$bin" --data-dir "$data" --epochs 1 --limit 128 --test-limit 100 \
    --balance 6,7 >/dev/full 2>"$tmp/err"
  status=$?
  if [[ $status -ne 1 ]] || ! grep -q "cannot write to standard output: the run's results are lost" "$tmp/err"; then
    fail "a run into /dev/full exited $status: $(cat "$tmp/err")"
  else
    echo "ok: a run into /dev/full -> $(tail -1 "$tmp/err")"
  fi
  # A run whose loss stops being finite ends with exit 1, naming the step.
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --balance 6,7 --lr 1e30
  if [[ $status -ne 1 ]] || ! grep -qE 'gpipe-train: the loss is (nan|-?inf) at step [0-9]+ \(epoch 1\)' "$tmp/err"; then
    fail "--lr 1e30 exited $status: $(cat "$tmp/err") $(tail -2 "$tmp/out")"
  else
    echo "ok: --lr 1e30 -> $(cat "$tmp/err")"
  fi
  # A learning-rate schedule and DeferredBatchNorm: the last step's rate
  # is cosine's, and the run trains.
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --balance 6,7 \
    --lr-schedule cosine --deferred-batch-norm --devices cpu,cpu
  lr=$(grep -o '"final_lr":[0-9.e-]*' "$tmp/out" | cut -d: -f2)
  if [[ $status -ne 0 ]] || ! grep -q '"deferred_batch_norm":true' "$tmp/out" ||
    ! awk -v a="$lr" 'BEGIN { exit !(a > 0.0073 && a < 0.0074) }'; then
    fail "--lr-schedule cosine --deferred-batch-norm exited $status, last rate '$lr': $(cat "$tmp/err") $(tail -1 "$tmp/out")"
  else
    echo "ok: --lr-schedule cosine (last step's rate $lr) --deferred-batch-norm"
  fi
  # A short last batch left out (3 rows cut into 3 micro-batches, the plan
  # has 4) is no step of the schedule: the last rate is the same as above.
  # The schedule counted it, and ended at 0.0173.
  printf '0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n' >"$tmp/four.csv"
  run --data-dir "$data" --epochs 1 --limit 259 --test-limit 1000 --json --balance 6,7 \
    --lr-schedule cosine --plan "$tmp/four.csv"
  lr=$(grep -o '"final_lr":[0-9.e-]*' "$tmp/out" | cut -d: -f2)
  if [[ $status -ne 0 ]] || ! grep -q 'left out 1 short batch' "$tmp/err" ||
    ! awk -v a="$lr" 'BEGIN { exit !(a > 0.0073 && a < 0.0074) }'; then
    fail "--lr-schedule cosine with a short batch left out exited $status, last rate '$lr': $(cat "$tmp/err") $(tail -1 "$tmp/out")"
  else
    echo "ok: --lr-schedule cosine with a short batch left out (last step's rate $lr)"
  fi
  # --save after each epoch (a checkpoint directory), and --load of it into
  # another balance goes on from those weights (a lower loss than from
  # scratch on the same steps).
  run --data-dir "$data" --epochs 2 --limit 512 --test-limit 1000 --json --save "$tmp/m"
  if [[ $status -ne 0 ]] || ! grep -q "saved a checkpoint of step 16 to $tmp/m" "$tmp/err" ||
    [[ ! -s $tmp/m/step-00000016/manifest.json ]]; then
    fail "--save exited $status: $(cat "$tmp/err") $(cat "$tmp/out")"
  else
    echo "ok: --save"
  fi
  # The JSON's thread count is the one the text says (it said 0 when the
  # lanes shared the cores by the plan, and 0 under a launcher).
  said=$(grep -o 'threads_per_lane=[0-9]*' "$tmp/err" | head -n 1 | cut -d= -f2)
  if [[ -z $said ]] || ! grep -q "\"threads_per_lane\":$said," "$tmp/out" ||
    ! grep -q '"threads_shared_by_plan":true' "$tmp/out"; then
    fail "the JSON's threads per lane is not the text's ($said): $(grep -o '"threads[a-z_]*":[0-9a-z]*' "$tmp/out")"
  else
    echo "ok: the JSON says $said threads per lane, shared by the plan, as the text"
  fi
  run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --balance 5,8 --load "$tmp/m"
  loaded=$(grep -o '"test_accuracy":[0-9.]*' "$tmp/out" | cut -d: -f2)
  if [[ $status -ne 0 ]] || ! grep -q "loaded weights from $tmp/m" "$tmp/err"; then
    fail "--load exited $status: $(cat "$tmp/err") $(cat "$tmp/out")"
  else
    run --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --json --balance 5,8
    fresh=$(grep -o '"test_accuracy":[0-9.]*' "$tmp/out" | cut -d: -f2)
    if ! awk -v a="$loaded" -v b="$fresh" 'BEGIN { exit !(a > b) }'; then
      fail "--load did not start from the saved weights: accuracy $loaded, from scratch $fresh"
    else
      echo "ok: --load: accuracy $loaded against $fresh from scratch"
    fi
  fi
  # Another run's checkpoints in --save without --resume: refused, rather
  # than mixed with this run's.
  bad "--save '$tmp/m' already holds checkpoints (the newest: $tmp/m/step-00000016); give --resume" \
    --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --save "$tmp/m"
  # A checkpoint of another model: a bad --load, with the reason, before the
  # balance is measured.
  bad "--load '$tmp/m': the checkpoint in '$tmp/m/step-00000016' has 13 layers, but the model has 39" \
    --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 --model resnet --load "$tmp/m"

  # --resume: a run stopped after epoch 1, or in the middle of epoch 2, and
  # resumed ends exactly as one that never stopped (weights, optimizer,
  # random state, place in the data). With a fixed thread count: by default
  # a cell that ran long (on a loaded machine) runs with every core next
  # time, and rounds otherwise.
  common=(--data-dir "$data" --limit 512 --test-limit 1000 --json --threads-per-lane 1)
  r=("${common[@]}" --balance 6,7 --schedule 1f1b)
  run "${r[@]}" --epochs 2 --save "$tmp/straight"
  ending() { grep -o '"final_loss":[0-9.e-]*\|"test_accuracy":[0-9.]*' "$tmp/out" | tr '\n' ' '; }
  straight=$(ending)
  # Testing after an epoch does not change training: the test passes draw
  # their step seeds, and the generator is put back after them (with 400
  # test images, one pass of 500 rows; with 1000, two).
  run --data-dir "$data" --limit 512 --test-limit 400 --json --threads-per-lane 1 \
    --balance 6,7 --schedule 1f1b --epochs 2
  a=$(grep -o '"final_loss":[0-9.e-]*' "$tmp/out" | cut -d: -f2)
  b=$(grep -o '"final_loss":[0-9.e-]*' <<<"$straight" | cut -d: -f2)
  if [[ $status -ne 0 || -z $a || $a != "$b" ]]; then
    fail "--test-limit 400 ended with loss '$a', --test-limit 1000 with '$b': $(cat "$tmp/err")"
  else
    echo "ok: how much is tested leaves training as it was: $a"
  fi
  run "${r[@]}" --epochs 1 --save "$tmp/r" --resume
  if [[ $status -ne 0 ]] || ! grep -q "nothing saved in $tmp/r yet" "$tmp/err"; then
    fail "--resume with nothing saved exited $status: $(cat "$tmp/err") $(head -2 "$tmp/out")"
  fi
  run "${r[@]}" --epochs 2 --save "$tmp/r" --resume
  resumed=$(ending)
  if [[ $status -ne 0 ]] || ! grep -q "resumed from $tmp/r/step-00000008 at step 8 (epoch 2, batch 0)" "$tmp/err" ||
    [[ -z $straight || $resumed != "$straight" ]]; then
    fail "--resume exited $status, ended with '$resumed', straight '$straight': $(cat "$tmp/err")"
  else
    echo "ok: --resume ends as the run that never stopped: $resumed"
  fi
  # Stopped after step 11 of 16, in epoch 2 (a checkpoint every 11 steps;
  # the end's removed), and resumed with another balance and schedule: the
  # same up to float rounding (fill-drain adds the micro-batches' gradients
  # in another order).
  run "${r[@]}" --epochs 2 --save "$tmp/mid" --save-every-steps 11
  rm -rf "$tmp/mid/step-00000016"
  run "${common[@]}" --balance 3,10 --schedule fill_drain --epochs 2 --save "$tmp/mid" --resume
  resumed=$(ending)
  a=$(grep -o '"final_loss":[0-9.e-]*' <<<"$straight" | cut -d: -f2)
  b=$(grep -o '"final_loss":[0-9.e-]*' <<<"$resumed" | cut -d: -f2)
  # The epoch's samples count the batches before the resume too.
  if [[ $status -ne 0 ]] || ! grep -q "resumed from $tmp/mid/step-00000011 at step 11 (epoch 2, batch 3)" "$tmp/err" ||
    ! grep -q '"train_samples":512,' "$tmp/out" ||
    ! awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && b != "" && d <= 1e-6 * a) }'; then
    fail "--resume in the middle of an epoch exited $status, ended with '$resumed', straight '$straight': $(cat "$tmp/err")"
  else
    echo "ok: --resume in the middle of epoch 2, with another balance and schedule: $resumed against $straight"
  fi
  # Resuming a finished run trains nothing and still prints its JSON line,
  # with the loss and accuracy the run ended with.
  # (Its balance is the one the run trained with, 6,7, not one measured
  # now: without --balance it says so before profiling anything.)
  run "${common[@]}" --epochs 2 --save "$tmp/r" --resume
  if [[ $status -ne 0 ]] || ! grep -q '"nothing_left_to_train":true' "$tmp/out" ||
    ! grep -q '"balance":\[6,7\]' "$tmp/out" ||
    grep -q 'balance_by_time chose' "$tmp/err" ||
    [[ $(ending) != "$straight" ]]; then
    fail "--resume of a finished run exited $status: $(cat "$tmp/err") $(tail -2 "$tmp/out")"
  else
    echo "ok: --resume of a finished run -> $(tail -1 "$tmp/out")"
  fi
  # --trace-steps counts the steps left, not the whole run's: 1 epoch of 8
  # steps left cannot record 8 after the first.
  bad --trace-steps "${r[@]}" --epochs 3 --save "$tmp/r" --resume \
    --trace "$tmp/t.json" --trace-steps 8
  # Other settings than the saved run's, or a damaged checkpoint: a bad
  # command line (exit 2), told before the data is read and the balance
  # measured (it was exit 1, after both).
  bad "with --batch-size 64, but this run has 32" "${r[@]}" --epochs 3 --save "$tmp/r" --resume --batch-size 32
  # A cosine rate follows --epochs: resuming a cosine run with more epochs
  # would change the rate of the epochs already done.
  run "${r[@]}" --epochs 1 --lr-schedule cosine --save "$tmp/c"
  bad "with --lr-schedule cosine over --epochs 1, but this run has cosine over --epochs 2" \
    "${r[@]}" --epochs 2 --lr-schedule cosine --save "$tmp/c" --resume
  printf 'XXXX' | dd of="$tmp/r/step-00000016/rank-0.bin" bs=1 seek=1000 conv=notrunc 2>/dev/null
  bad "rank-0.bin' is corrupt" "${r[@]}" --epochs 3 --save "$tmp/r" --resume

  # Too few steps to trace is known only once the data is read: still 2.
  bad --trace-steps --data-dir "$data" --epochs 1 --limit 256 --test-limit 1000 \
    --trace "$tmp/t.json" --trace-steps 4
else
  echo "usage: $0 GPIPE_TRAIN bad|run [DATA_DIR]"
  exit 1
fi

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
