#!/usr/bin/env bash
# Distributed stages with real processes on 127.0.0.1 (ports chosen free at
# run time by gpipe-run). Each rank of gpipe_dist_worker checks itself
# against single-process GPipe (losses, parameters, buffers, inference;
# float64, relative 1e-10) and exits 0; see dist_worker.cpp.
#
#   dist_test.sh GPIPE_RUN WORKER parity     # 2 and 4 ranks, three schedules,
#                                            # every checkpoint mode, a skip
#                                            # across ranks, dropout, BN
#   dist_test.sh GPIPE_RUN WORKER failures   # another balance, a failing
#                                            # loss, a killed rank
#   dist_test.sh GPIPE_RUN WORKER rendezvous # init_from_env's errors
#   dist_test.sh GPIPE_RUN WORKER ordered    # parity and failures through
#                                            # NCCL's ordered channel, over
#                                            # Gloo (GPIPE_DIST_CHANNEL)
#   dist_test.sh GPIPE_RUN GPIPE_TRAIN train [DATA_DIR]
#                                            # gpipe-train on 2 ranks equals
#                                            # one process (77: no data set)
#   dist_test.sh GPIPE_RUN GPIPE_TRAIN restart [DATA_DIR]
#                                            # a rank killed mid-run: the job
#                                            # restarts, resumes from its
#                                            # checkpoint and ends as one
#                                            # that never stopped
#
# With GPIPE_DIST_BACKEND=nccl on one GPU (scripts/cuda_check.sh), set
# GPIPE_TEST_HOSTID=1: each rank then calls itself a host of its own
# (NCCL_HOSTID), since NCCL refuses two ranks of one host on one GPU.
set -uo pipefail

run_bin=$1
prog=$2
mode=$3
data=${4:-/usr/share/datasets/fashion-mnist}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ulimit -c 0
failures=0
export GPIPE_DIST_TIMEOUT=${GPIPE_DIST_TIMEOUT:-60}

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# launch N ARGS...: the worker on N ranks under gpipe-run; leaves $status
# and $tmp/out (both streams).
launch() {
  local n=$1
  shift
  if [[ -n ${GPIPE_TEST_HOSTID:-} ]]; then
    timeout 300 "$run_bin" -n "$n" -- sh -c \
      'NCCL_HOSTID=gpipe-rank-$RANK exec "$0" "$@"' "$prog" "$@" \
      >"$tmp/out" 2>&1
  else
    timeout 300 "$run_bin" -n "$n" -- "$prog" "$@" >"$tmp/out" 2>&1
  fi
  status=$?
}

# free_port: a port that was free a moment ago, as gpipe-run finds one.
free_port() {
  "$run_bin" -n 1 -- sh -c 'echo "$MASTER_PORT"' | sed 's/^\[0\] //'
}

# by_hand N ARGS...: the worker on N ranks started here rather than by
# gpipe-run (which stops the others when one fails, before they can print
# their own error); leaves $status (the worst exit code), $codes and
# $tmp/out with every rank's lines.
by_hand() {
  local n=$1
  shift
  local port
  port=$(free_port)
  local pids=()
  for ((r = 0; r < n; r++)); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=$r WORLD_SIZE=$n \
      LOCAL_RANK=$r NCCL_HOSTID=gpipe-rank-$r timeout 120 "$prog" "$@" \
      >"$tmp/rank$r" 2>&1 &
    pids+=($!)
  done
  codes=()
  status=0
  for p in "${pids[@]}"; do
    wait "$p"
    local code=$?
    codes+=("$code")
    ((code > status)) && status=$code
  done
  cat "$tmp"/rank* >"$tmp/out"
}

parity() {
  local n=$1
  shift
  launch "$n" "$@"
  local ok
  ok=$(grep -c ': OK (' "$tmp/out")
  if [[ $status -ne 0 || $ok -ne $n ]]; then
    fail "$n ranks, $*: gpipe-run exited $status with $ok of $n ranks OK:"
    sed 's/^/    /' "$tmp/out" | head -40
  else
    echo "ok: $n ranks, $*"
  fi
}

# no_backtrace WHAT FILE...: the errors in FILE (a worker's record, from
# "rank R error: " to "rank R failed after X s", the error's what() as a
# program would print it) carry no LibTorch backtrace ("frame #0: ..."),
# theirs or a quoted c10d message's: so it is for joining a job and for
# failures between ranks (Note [Errors without LibTorch's backtrace] in
# src/text.h). An error of the program itself (a loss that throws, options
# that differ between ranks) is a TORCH_CHECK's, backtrace and all, as
# LibTorch's own are. c10d's own log records are not gpipe's: over NCCL its
# watchdog logs a failed work, backtrace and all, when a peer goes away.
no_backtrace() {
  local what=$1 file
  shift
  for file in "$@"; do
    # (Per rank: gpipe-run prefixes each rank's lines with "[R] ".)
    if awk '{ p = match($0, /^\[[0-9]+\] /) ? substr($0, 1, RLENGTH) : "" }
            /^(\[[0-9]+\] )?rank [0-9]+ error: / { in_error[p] = 1 }
            in_error[p] && /frame #/ { found = 1 }
            / failed after [0-9.e+-]+ s$/ { in_error[p] = 0 }
            END { exit !found }' "$file"; then
      fail "$what: an error carries LibTorch's backtrace: $(grep -m1 -B2 "frame #" "$file" | head -c 400)"
      return
    fi
  done
}

# expect WHAT TEXT: the last launch failed, and every rank's error names TEXT.
expect_error() {
  local what=$1 text=$2 n=$3
  local errors
  errors=$(grep -c "error: .*$text" "$tmp/out")
  if [[ $status -eq 0 ]]; then
    fail "$what: gpipe-run exited 0"
  elif [[ $errors -ne $n ]]; then
    fail "$what: $errors of $n ranks failed with '$text':"
    sed 's/^/    /' "$tmp/out" | head -40
  else
    echo "ok: $what"
  fi
}

# transfers_plan: $tmp/plan_transfers.csv, transfers as written: rank 1
# posts all its receives first; rank 0 holds micro-batch 0's output until
# it has computed micro-batch 1's, and posts its gradient receives late.
transfers_plan() {
  printf '%s\n' 0F0,0F1,0SEND_F0,0SEND_F1,0F2,0SEND_F2,0F3,0SEND_F3,0RECV_B0,0RECV_B1,0B0,0B1,0RECV_B2,0RECV_B3,0B2,0B3 \
    1RECV_F0,1RECV_F1,1RECV_F2,1RECV_F3,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1,1F2,1B2,1SEND_B2,1F3,1B3,1SEND_B3 >"$tmp/plan_transfers.csv"
}

# failed_after FILE: the seconds, rounded up, that the rank whose output
# FILE holds ran before its error ("rank R failed after X s", timed from
# before init_from_env; how long the process took to start, seconds under
# ASan on a loaded machine, is not in it); 999 if it said none.
failed_after() {
  awk '/ failed after [0-9.e+-]+ s$/ {
         t = $(NF - 1); s = int(t); if (s < t) s++; print s; found = 1; exit
       }
       END { if (!found) print 999 }' "$1"
}

# refused WHAT LIMIT TEXT VAR=VALUE...: rank 0 of 2, started alone with
# the assignments given (after a 20 s GPIPE_DIST_TIMEOUT), exits 3 within
# LIMIT seconds of its own (failed_after) with an error that names TEXT and
# carries no LibTorch backtrace. Uses $port.
refused() {
  local what=$1 limit=$2 text=$3 elapsed code
  shift 3
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=0 WORLD_SIZE=2 \
    GPIPE_DIST_TIMEOUT=20 "$@" timeout 60 "$prog" >"$tmp/refused" 2>&1
  code=$?
  elapsed=$(failed_after "$tmp/refused")
  if [[ $code -ne 3 ]] || ! grep -q "$text" "$tmp/refused"; then
    fail "$what: exit $code after ${elapsed} s: $(head -c 600 "$tmp/refused")"
  elif ((elapsed > limit)); then
    fail "$what took ${elapsed} s to fail"
  elif grep -q "frame #" "$tmp/refused"; then
    fail "$what: the error carries LibTorch's backtrace"
  else
    echo "ok: $what fails in ${elapsed} s: $(grep error "$tmp/refused" | head -c 300)"
  fi
}

# listening PORT SECONDS: waits until a socket on this host listens on
# PORT (IPv4 or IPv6), at most SECONDS; fails if none does.
listening() {
  local hex i
  hex=$(printf ':%04X ' "$1")
  for ((i = 0; i < $2 * 10; i++)); do
    # Column 2 is the local address, column 4 the state (0A: LISTEN).
    if awk -v p="$hex" 'index($2 " ", p) && $4 == "0A" { found = 1 }
         END { exit !found }' /proc/net/tcp /proc/net/tcp6 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

# survivors: without gpipe-run stopping them, the survivors of a killed
# rank fail on their own, fast and with a message naming it (4 ranks, rank
# 2 killed; the timeout is 60 s, so passing here is not the timeout).
survivors() {
  local start elapsed
  start=$(date +%s)
  by_hand 4 --scenario kill --kill-rank 2 --kill-step 1
  elapsed=$(($(date +%s) - start))
  for r in 0 1 3; do
    if [[ ${codes[$r]} -ne 3 ]] || ! grep -q "error: .*rank" "$tmp/rank$r"; then
      fail "rank $r after rank 2 was killed: exit ${codes[$r]}: $(tail -2 "$tmp/rank$r")"
    fi
  done
  no_backtrace "survivors of a killed rank" "$tmp"/rank[013]
  if [[ ${codes[2]} -ne 137 ]]; then
    fail "rank 2 should have been killed, but exited ${codes[2]}"
  fi
  if ((elapsed > 30)); then
    fail "the survivors took ${elapsed} s to fail"
  else
    echo "ok: survivors of a killed rank failed in ${elapsed} s: $(grep error "$tmp/rank3" | head -c 200)"
  fi
}

# survivors_of_a_replica KILLED: the same with 2 replicas of 2 stages, rank
# KILLED killed: every survivor names it. With rank 3 (replica 1's last
# stage), rank 1 too, whose only link to rank 3 is their gradient
# all-reduce (it heard only that the collective broke; now its pipeline
# neighbour tells it). With rank 0, which hosts the store, no notice can
# travel: rank 2 names it as its only peer in their agreement, and rank 3,
# which lost rank 2, says the store is gone with its host.
survivors_of_a_replica() {
  local killed=$1 r
  by_hand 4 --scenario kill --kill-rank "$killed" --kill-step 1 --pipeline-size 2
  for r in 0 1 2 3; do
    [[ $r -eq $killed ]] && continue
    if [[ ${codes[$r]} -ne 3 ]] || ! grep -q "error: .*\(rank $killed died\|its host ended: rank $killed\)" "$tmp/rank$r"; then
      fail "rank $r after rank $killed of a 2 x 2 mesh was killed: exit ${codes[$r]}: $(grep error "$tmp/rank$r" | head -c 400)"
    fi
  done
  echo "ok: survivors of a killed replica's rank name it: $(grep error "$tmp/rank1" | head -c 200)"
}

# died_in_save RANK TIMEOUT LIMIT TEXT: 4 ranks save a checkpoint, and
# RANK dies (SIGKILL) at its first fsync, in the middle of the save (Note
# [A rank killed while it saves] in dist_worker.cpp); every other rank fails
# within LIMIT seconds of its own, with the World's timeout TIMEOUT, with an
# error that matches TEXT.
died_in_save() {
  local killed=$1 timeout=$2 limit=$3 text=$4 r elapsed worst=0
  rm -rf "$tmp/ck"
  GPIPE_DIST_TIMEOUT=$timeout by_hand 4 --scenario die-in-save --kill-rank "$killed" \
    --steps 1 --save "$tmp/ck"
  if [[ ${codes[$killed]} -ne 137 ]]; then
    fail "rank $killed should have died in the save, but exited ${codes[$killed]}: $(tail -2 "$tmp/rank$killed")"
    return
  fi
  for r in 0 1 2 3; do
    [[ $r -eq $killed ]] && continue
    elapsed=$(failed_after "$tmp/rank$r")
    ((elapsed > worst)) && worst=$elapsed
    if [[ ${codes[$r]} -ne 3 ]] || ! grep -q "error: .*$text" "$tmp/rank$r"; then
      fail "rank $r after rank $killed died in a save: exit ${codes[$r]}: $(grep -m 1 error "$tmp/rank$r" | head -c 400)"
    elif ((elapsed > limit)); then
      fail "rank $r took ${elapsed} s to fail after rank $killed died in a save"
    fi
  done
  no_backtrace "the survivors of a rank killed in a save" "$tmp"/rank[0-3]
  echo "ok: rank $killed killed in a save; the others failed within ${worst} s: $(grep -h -m 1 error "$tmp"/rank[0-3] | head -1 | head -c 300)"
}

# stalled: a rank that stops answering (asleep for twice the timeout and
# 2 s) is given up on after GPIPE_DIST_TIMEOUT (6 s here: the ranks must
# also meet within it, and an ASan process can take seconds more than
# another to start) with a message that says so; the sleeper then learns
# of the failure when it wakes.
stalled() {
  GPIPE_DIST_TIMEOUT=6 by_hand 2 --scenario stall --kill-rank 1 --kill-step 1
  no_backtrace "a stalled rank" "$tmp/rank0" "$tmp/rank1"
  if [[ ${codes[0]} -ne 3 ]] || ! grep -q "gave up after 6 s" "$tmp/rank0"; then
    fail "a stalled rank 1: rank 0 exited ${codes[0]}: $(tail -2 "$tmp/rank0")"
  elif [[ ${codes[1]} -ne 3 ]]; then
    fail "the stalled rank exited ${codes[1]}: $(tail -2 "$tmp/rank1")"
  else
    echo "ok: a stalled rank: $(grep error "$tmp/rank0" | head -c 200)"
  fi
}

case $mode in
  parity)
    parity 2 --schedule 1f1b --checkpoint except_last --dropout 0.3
    parity 2 --schedule fill_drain --checkpoint always --dropout 0.5
    # Replicas draw their own dropout masks: those of one pipeline on the
    # whole batch.
    parity 4 --pipeline-size 2 --schedule 1f1b --checkpoint always --dropout 0.3
    parity 2 --pipeline-size 1 --schedule fill_drain --checkpoint except_last --dropout 0.5
    parity 2 --schedule 1f1b --checkpoint never --batch-norm 1
    parity 4 --schedule 1f1b --checkpoint always --dropout 0.3
    parity 4 --schedule fill_drain --checkpoint except_last --batch-norm 1
    parity 2 --schedule zero_bubble --checkpoint except_last --dropout 0.3
    parity 4 --schedule zero_bubble --checkpoint always --batch-norm 1
    # Two stages per rank (partition j on rank j % ranks).
    parity 2 --schedule interleaved --stages-per-lane 2 --checkpoint except_last --dropout 0.3
    parity 2 --schedule zero_bubble --stages-per-lane 2 --checkpoint always --batch-norm 1
    parity 4 --schedule interleaved --stages-per-lane 2 --checkpoint never --dropout 0.3
    # ZB-V on a V (stage j and 2 n - 1 - j on rank j: the input and the
    # target both on rank 0), and looped BFS, each against the same
    # layout's GPipe in one process; the skips cross ranks.
    parity 2 --schedule zero_bubble_v --stages-per-lane 2 --v-shape 1 --checkpoint except_last --dropout 0.3
    parity 4 --schedule zero_bubble_v --stages-per-lane 2 --v-shape 1 --checkpoint always --batch-norm 1
    parity 2 --schedule looped_bfs --stages-per-lane 2 --checkpoint never --dropout 0.3
    parity 4 --schedule looped_bfs --stages-per-lane 2 --v-shape 1 --checkpoint except_last --batch-norm 1
    # A hand-written plan, as written on every rank: rank 1 splits its
    # backwards (B then W) and defers some W; rank 0 runs whole backwards.
    # A plan for 8 micro-batches is refused on both ranks on the way, and
    # the stage goes on.
    printf '%s\n' 0F0,0F1,0F2,0F3,0B3,0B2,0B1,0B0 \
      1F0,1B0,1W0,1F1,1B1,1F2,1W1,1B2,1F3,1B3,1W2,1W3 >"$tmp/plan.csv"
    parity 2 --plan "$tmp/plan.csv" --scenario bad-plan --checkpoint except_last --dropout 0.3
    printf '%s\n' 0F0,0F1,2F0,2F1,0F2,2F2,0F3,2F3,2B0,0B0,2B1,0B1,2B2,0B2,2B3,0B3 \
      1F0,1F1,3F0,3F1,3B0,1F2,3F2,3B1,1F3,1B0,3F3,3B2,1B1,3B3,1B2,1B3 >"$tmp/plan4.csv"
    parity 2 --plan "$tmp/plan4.csv" --stages-per-lane 2 --checkpoint always --batch-norm 1
    # Transfers as written (transfers_plan).
    transfers_plan
    parity 2 --plan "$tmp/plan_transfers.csv" --checkpoint except_last --dropout 0.3
    ;;
  failures)
    # Rank 0 (the store's host) ends first and rank 1 sleeps on: it takes
    # no CPU meanwhile (c10d's store client spun on a core).
    by_hand 2 --scenario outlive
    if [[ $status -ne 0 ]]; then
      fail "a rank that outlives rank 0: $(head -c 600 "$tmp/out")"
    else
      echo "ok: a rank that outlives rank 0 sleeps: $(grep 'rank 1' "$tmp/out")"
    fi

    # Another balance on rank 1: refused at construction on both ranks.
    by_hand 2 --scenario mismatch
    expect_error "another balance" "rank [01] has balance .* but rank [01] has" 2

    # Four partitions for 2 ranks without stages_per_lane 2: refused at
    # construction on both ranks, saying what fits.
    by_hand 2 --scenario bad-layout --stages-per-lane 2
    expect_error "a balance that does not fit the ranks" "balance must have pipeline size x stages_per_lane = 2 x 1 = 2 partitions, but it has 4" 2

    # The last rank's loss throws in step 2: both ranks fail with it, and
    # neither hangs.
    by_hand 2 --scenario throw
    expect_error "a failing loss" "the loss broke on purpose" 2

    # Rank 1 runs forward while rank 0 runs train_step: both fail, naming
    # both passes.
    by_hand 2 --scenario other-pass
    expect_error "another pass" "rank 1 runs pass forward but rank 0 runs train_step" 2

    # Rank 1 changes its chunks before step 1, rank 0 does not: both fail,
    # naming both counts (with checkpoint never, the target's cut was
    # blamed instead).
    by_hand 2 --scenario other-chunks --checkpoint never
    expect_error "other chunks" "rank 1 runs with chunks 2 but rank 0 runs with chunks 4" 2

    # Rank 1 is given another plan than rank 0's: both fail, naming both
    # and where they first differ (rank 1's plan has its losses listed).
    printf '%s\n' 0F0,0F1,0F2,0F3,0B3,0B2,0B1,0B0 \
      1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3 >"$tmp/plan.csv"
    by_hand 2 --scenario other-plan --plan "$tmp/plan.csv" --schedule fill_drain
    expect_error "another plan" "rank 1 runs train_step with a plan (hashed to [0-9]*) but rank 0 runs a plan (hashed to .*the plans first differ at lane 1, action 2: rank 1's is 1L0, rank 0's is 1B0" 2

    # Inference in which rank 0's layer throws on the last micro-batch: the
    # last rank fails with that error instead of waiting for it.
    by_hand 2 --scenario forward-throw
    expect_error "a failing layer in inference" "the layer broke on purpose" 2

    # A mistake on one rank only (train_step under NoGradGuard on rank 1):
    # both fail at once with it, rank 0 does not wait out the timeout.
    start=$(date +%s)
    by_hand 2 --scenario no-grad
    expect_error "grad mode off on one rank" "needs grad mode on" 2
    if (($(date +%s) - start > 20)); then
      fail "grad mode off on one rank took $(($(date +%s) - start)) s"
    fi

    # gpipe-run: a rank killed by a signal stops the job, non-zero.
    launch 2 --scenario kill --kill-rank 1 --kill-step 1
    if [[ $status -eq 0 ]] || ! grep -q "rank 1" "$tmp/out"; then
      fail "killed rank under gpipe-run: exit $status: $(tail -3 "$tmp/out")"
    else
      echo "ok: a killed rank fails gpipe-run ($status)"
    fi

    survivors
    survivors_of_a_replica 3
    survivors_of_a_replica 0
    stalled
    # Rank 0 hosts the store: its death ends the others' waits at once,
    # long before the timeout (20 s). Rank 2's is noticed at the timeout
    # (8 s), and every survivor names it as a rank that began the save.
    died_in_save 0 20 10 "lost the job's store"
    died_in_save 2 8 16 "rank 2, which had begun save_checkpoint but did not finish"
    ;;
  rendezvous)
    # A MASTER_ADDR that does not resolve (here, where gpipe-run would
    # refuse it, set by hand as torchrun would pass it): refused at once,
    # naming it, rather than retried by c10d with a warning a second until
    # the timeout (20 s here).
    MASTER_ADDR=not.a.host MASTER_PORT=29500 RANK=1 WORLD_SIZE=2 \
      GPIPE_DIST_TIMEOUT=20 timeout 60 "$prog" >"$tmp/out" 2>&1
    status=$?
    elapsed=$(failed_after "$tmp/out")
    if [[ $status -ne 3 ]] ||
      ! grep -q "error: .*MASTER_ADDR .*'not.a.host' does not" "$tmp/out"; then
      fail "MASTER_ADDR=not.a.host: exit $status after ${elapsed} s: $(head -c 600 "$tmp/out")"
    elif grep -q "cannot be retrieved" "$tmp/out"; then
      fail "MASTER_ADDR=not.a.host: c10d warned $(grep -c "cannot be retrieved" "$tmp/out") times"
    elif ((elapsed > 10)); then
      fail "MASTER_ADDR=not.a.host: took ${elapsed} s to fail"
    else
      echo "ok: MASTER_ADDR=not.a.host fails at once: $(grep error "$tmp/out" | head -c 300)"
    fi
    # Rank 0 of 2 alone gives up within its timeout (4 s), saying how many
    # came; it used to wait twice the timeout (the store's wait, then
    # Gloo's).
    port=$(free_port)
    refused "rank 0 alone with a 4 s timeout" 6 "only 1 of the 2 ranks" \
      GPIPE_DIST_TIMEOUT=4
    # Rank 1 alone waits for rank 0's store as long as its timeout says:
    # c10d's client gave up on connecting early (2.5 s of 3, 0.8 s of 1,
    # failing healthy jobs whose rank 0 came a moment late).
    port=$(free_port)
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=1 WORLD_SIZE=2 \
      GPIPE_DIST_TIMEOUT=3 timeout 60 "$prog" >"$tmp/out" 2>&1
    status=$?
    took=$(awk '/ failed after [0-9.e+-]+ s$/ { print $(NF - 1); exit }' "$tmp/out")
    if [[ $status -ne 3 ]] || ! grep -q "could not reach rank 0's store" "$tmp/out" ||
      ! awk -v t="$took" 'BEGIN { exit !(t != "" && t >= 2.85 && t <= 6) }'; then
      fail "rank 1 alone with a 3 s timeout: exit $status after ${took} s: $(head -c 600 "$tmp/out")"
    else
      echo "ok: rank 1 alone waits its 3 s timeout (${took} s): $(grep error "$tmp/out" | head -c 300)"
    fi
    # A backend this build lacks (every build lacks mpi; a CPU LibTorch,
    # nccl): refused before the rank waits for the others, naming what the
    # build has.
    for backend in mpi nccl; do
      [[ $backend == nccl && -n ${GPIPE_HAS_NCCL:-} ]] && continue
      refused "GPIPE_DIST_BACKEND=$backend" 3 \
        "GPIPE_DIST_BACKEND to name a backend of this build (.*), but got '$backend'" \
        GPIPE_DIST_BACKEND=$backend
    done
    # A channel that is not one: refused as fast, naming the ones there are.
    refused "GPIPE_DIST_CHANNEL=fast" 3 \
      "GPIPE_DIST_CHANNEL to be unset\(, 'tagged'\)\{0,1\} or 'ordered' on the [a-z]* backend, but got 'fast'" \
      GPIPE_DIST_CHANNEL=fast
    # Ranks that disagree on WORLD_SIZE, or two processes with one RANK:
    # refused at once, and the ranks already waiting end as soon, saying
    # why (they waited out the timeout, then counted "3 of the 2 ranks").
    started_with() {  # started_with FILE VAR=VALUE...: a rank in the background
      local file=$1
      shift
      env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GPIPE_DIST_TIMEOUT=20 "$@" \
        timeout 60 "$prog" >"$file" 2>&1 &
    }
    ended_soon() {  # ended_soon WHAT PID FILE TEXT
      wait "$2"
      local code=$? elapsed
      elapsed=$(failed_after "$3")
      if [[ $code -ne 3 ]] || ! grep -q "$4" "$3" || ((elapsed > 8)); then
        fail "$1: exit $code after ${elapsed} s: $(head -c 600 "$3")"
      else
        echo "ok: $1 ends in ${elapsed} s: $(grep error "$3" | head -c 300)"
      fi
    }
    # A second rank 0 on a port the first one holds: said at once, and the
    # first, which waits for its rank 1, ends as soon, saying why (it
    # waited out the timeout, then blamed the ranks that did not come).
    port=$(free_port)
    started_with "$tmp/first" RANK=0 WORLD_SIZE=2
    first=$!
    if listening "$port" 30; then
      refused "a second rank 0 on a held port" 6 \
        "two processes came as RANK 0 of 2 (the other holds port $port)"
    fi
    ended_soon "rank 0, waiting when a second rank 0 came" "$first" \
      "$tmp/first" "rank 0 cannot join the job at .*two processes came as RANK 0 of 2"
    # The rank 0 of a job of another size on that port is not one of ours:
    # left as it was, and the port named as another process's.
    port=$(free_port)
    started_with "$tmp/first" RANK=0 WORLD_SIZE=3
    first=$!
    if listening "$port" 30; then
      refused "a rank 0 on a port another job's rank 0 holds" 6 \
        "rank 0 cannot listen on port $port: another process holds it"
      if ! kill -0 "$first" 2>/dev/null; then
        fail "another job's rank 0 ended when a rank 0 of 2 met its port: $(head -c 600 "$tmp/first")"
      fi
    fi
    kill "$first" 2>/dev/null
    wait "$first" 2>/dev/null
    port=$(free_port)
    started_with "$tmp/first" RANK=0 WORLD_SIZE=2
    first=$!
    if listening "$port" 30; then
      refused "a rank with another WORLD_SIZE" 6 \
        "rank 2 came with WORLD_SIZE 3, but the first rank to come had WORLD_SIZE 2" \
        RANK=2 WORLD_SIZE=3
    fi
    ended_soon "rank 0, waiting when WORLD_SIZE 3 came" "$first" "$tmp/first" \
      "rank 0 cannot join the job at .*WORLD_SIZE 3"
    port=$(free_port)
    started_with "$tmp/first" RANK=0 WORLD_SIZE=3
    first=$!
    if listening "$port" 30; then
      started_with "$tmp/second" RANK=1 WORLD_SIZE=3
      second=$!
      sleep 1
      refused "a second process as RANK 1" 6 "two processes came as RANK 1 of 3" \
        RANK=1 WORLD_SIZE=3
      ended_soon "rank 1, waiting when another RANK 1 came" "$second" \
        "$tmp/second" "rank 1 cannot join the job at .*two processes came as RANK 1"
    fi
    ended_soon "rank 0, waiting when a second RANK 1 came" "$first" "$tmp/first" \
      "rank 0 cannot join the job at .*two processes came as RANK 1"
    ;;
  train)
    # Skipped (ctest's 77) only without the data: Debian's
    # dataset-fashion-mnist is not installed (scripts/setup.sh installs it).
    if [[ ! -f $data/train-images-idx3-ubyte.gz ]]; then
      # Skipped without Debian's dataset-fashion-mnist (scripts/setup.sh
      # installs it): this check trains on the real data.
      echo "no Fashion-MNIST under $data: skipped"
      exit 77  # skipped: needs Debian's dataset-fashion-mnist (real data)
    fi
    # 1F1B with a partition per rank; interleaved and ZB-V with two per
    # rank (one process: 4 partitions on 2 lanes; ZB-V's in a V, the input
    # and the target both on rank 0).
    for schedule in 1f1b interleaved zero_bubble_v; do
    # One intra-op thread per lane on both sides: float rounding follows the
    # thread count, and one process's lanes share the cores by the plan
    # unless a count is given.
    args=(--data-dir "$data" --limit 640 --test-limit 1000 --epochs 1 --batch-size 64
      --chunks 4 --schedule $schedule --json --log-every 5 --threads-per-lane 1)
    # (A balance given: the default one is measured, on each run anew.)
    single_args=(--balance 6,7)
    [[ $schedule != 1f1b ]] && single_args=(--partitions 4 --balance 3,3,3,4)
    timeout 300 "$prog" "${args[@]}" "${single_args[@]}" >"$tmp/single" 2>&1
    single=$?
    dist_args=(--balance 6,7)
    [[ $schedule != 1f1b ]] && dist_args=(--balance 3,3,3,4)
    timeout 300 "$run_bin" -n 2 -- "$prog" "${args[@]}" "${dist_args[@]}" >"$tmp/dist" 2>&1
    dist=$?
    if [[ $single -ne 0 || $dist -ne 0 ]]; then
      fail "gpipe-train $schedule exited $single (one process), $dist (2 ranks): $(tail -3 "$tmp/dist")"
    else
      # The JSON lines agree on everything but timings and ranks.
      strip() {
        grep -o '{.*}' "$1" | tail -1 |
          sed -E 's/"(ranks|pipeline_size|threads_per_lane|total_seconds|train_seconds|train_samples_per_second)":[^,}]*,?//g'
      }
      a=$(strip "$tmp/single")
      b=$(strip "$tmp/dist")
      if [[ -z $a || $a != "$b" ]]; then
        fail "gpipe-train $schedule differs across ranks:"$'\n'"  one process: $a"$'\n'"  2 ranks:     $b"
      else
        echo "ok: gpipe-train $schedule on 2 ranks equals one process: $b"
      fi
      if grep -q '^\[1\] epoch' "$tmp/dist"; then
        fail "rank 1 printed progress; only rank 0 should"
      fi
    fi
    done
    # --autotune on 2 ranks: rank 0 tunes, both run its choice.
    timeout 300 "$run_bin" -n 2 -- "$prog" --data-dir "$data" --limit 640 --test-limit 1000 \
      --epochs 1 --batch-size 64 --json --autotune --memory-limit 64M >"$tmp/tuned" 2>&1
    code=$?
    if [[ $code -ne 0 ]] || ! grep -q '"autotune":true' "$tmp/tuned" ||
      [[ $(grep -c 'autotune: balance' "$tmp/tuned") -ne 1 ]]; then
      fail "gpipe-train --autotune on 2 ranks exited $code: $(tail -5 "$tmp/tuned")"
    else
      echo "ok: gpipe-train --autotune on 2 ranks: $(grep -o 'autotune: balance[^:]*' "$tmp/tuned")"
    fi
    # Two replicas of a 2-stage pipeline (4 ranks, --pipeline-size 2), each
    # on its own half of every batch. BatchNorm keeps per-replica statistics
    # and the micro-batches are half as large, so the run is not one
    # process's bit for bit: it must train as well and say its layout.
    args=(--data-dir "$data" --limit 640 --test-limit 1000 --epochs 1 --batch-size 64
      --chunks 4 --schedule 1f1b --json --log-every 5)
    timeout 300 "$run_bin" -n 4 -- "$prog" "${args[@]}" --balance 6,7 \
      --pipeline-size 2 >"$tmp/mesh" 2>&1
    code=$?
    json=$(grep -o '{.*}' "$tmp/mesh" | tail -1)
    accuracy=$(grep -o '"test_accuracy":[0-9.]*' <<<"$json" | cut -d: -f2)
    if [[ $code -ne 0 ]]; then
      fail "gpipe-train on 2 x 2 ranks exited $code: $(tail -3 "$tmp/mesh")"
    elif [[ $json != *'"pipeline_size":2'* || $json != *'"replicas":2'* ||
      $json != *'"ranks":4'* || $json != *'"steps":10'* ]]; then
      fail "gpipe-train on 2 x 2 ranks: the summary misses the layout: $json"
    elif ! awk -v a="$accuracy" 'BEGIN { exit !(a >= 0.3) }'; then
      fail "gpipe-train on 2 x 2 ranks reached test accuracy $accuracy after 10 steps (one process: 0.5)"
    elif grep -q '^\[[123]\] epoch' "$tmp/mesh"; then
      fail "a rank other than 0 printed progress on 2 x 2 ranks"
    else
      echo "ok: gpipe-train on 2 replicas x 2 stages: $json"
    fi
    # A pipeline size that does not divide the ranks: one line, exit 2.
    timeout 60 "$run_bin" -n 2 -- "$prog" "${args[@]}" --pipeline-size 3 \
      >"$tmp/bad" 2>&1
    code=$?
    if [[ $code -eq 0 ]] || ! grep -q -- '--pipeline-size 3 must divide the 2 ranks' "$tmp/bad"; then
      fail "--pipeline-size 3 on 2 ranks: exit $code: $(tail -3 "$tmp/bad")"
    else
      echo "ok: --pipeline-size 3 on 2 ranks is refused"
    fi
    # Replicas train on equal shards: a batch size that does not split over
    # them is refused up front (it failed after the first step), and a short
    # last batch that does not is left out (it failed after a whole epoch).
    timeout 60 "$run_bin" -n 2 -- "$prog" --data-dir "$data" --pipeline-size 1 \
      --batch-size 7 >"$tmp/bad" 2>&1
    code=$?
    if [[ $code -ne 2 ]] || ! grep -q -- '--batch-size 7 must split evenly over the 2 replicas' "$tmp/bad"; then
      fail "--batch-size 7 over 2 replicas: exit $code: $(tail -3 "$tmp/bad")"
    else
      echo "ok: --batch-size 7 over 2 replicas is refused"
    fi
    timeout 120 "$run_bin" -n 2 -- "$prog" --data-dir "$data" --limit 255 --test-limit 100 \
      --epochs 1 --batch-size 64 --pipeline-size 1 >"$tmp/uneven" 2>&1
    code=$?
    if [[ $code -ne 0 ]] ||
      ! grep -q 'left out 1 short batch: it does not split evenly over the 2 replicas' "$tmp/uneven"; then
      fail "a short batch of 63 rows over 2 replicas: exit $code: $(tail -3 "$tmp/uneven")"
    else
      echo "ok: a short batch of 63 rows over 2 replicas is left out"
    fi
    # --autotune for replicas tunes the batch each replica runs, its shard
    # (it tuned the whole batch: twice the rows of each micro-batch).
    timeout 300 "$run_bin" -n 2 -- "$prog" --data-dir "$data" --limit 64 --test-limit 100 \
      --epochs 1 --batch-size 32 --pipeline-size 1 --autotune >"$tmp/tuned" 2>&1
    code=$?
    if [[ $code -ne 0 ]] || ! grep -q "autotune: for each replica's shard of a batch, 16 rows" "$tmp/tuned"; then
      fail "--autotune over 2 replicas exited $code: $(tail -5 "$tmp/tuned")"
    else
      echo "ok: --autotune over 2 replicas tunes a shard of 16 rows"
    fi
    ;;
  restart)
    # Skipped (ctest's 77) only without the data: Debian's
    # dataset-fashion-mnist is not installed (scripts/setup.sh installs it).
    if [[ ! -f $data/train-images-idx3-ubyte.gz ]]; then
      # Skipped without Debian's dataset-fashion-mnist (scripts/setup.sh
      # installs it): this check trains on the real data.
      echo "no Fashion-MNIST under $data: skipped"
      exit 77  # skipped: needs Debian's dataset-fashion-mnist (real data)
    fi
    # (--threads-per-lane 1: the one-process run below rounds as the ranks.)
    base=(--data-dir "$data" --limit 1280 --test-limit 1000 --batch-size 64
      --chunks 4 --schedule 1f1b --json --save-every-steps 2 --threads-per-lane 1)
    args=("${base[@]}" --epochs 3 --balance 6,7)
    ending() { grep -o '"final_loss":[0-9.e-]*\|"test_accuracy":[0-9.]*' "$1" | tr '\n' ' '; }
    # The run that never stops.
    timeout 300 "$run_bin" -n 2 -- "$prog" "${args[@]}" --save "$tmp/straight" >"$tmp/straight.out" 2>&1
    code=$?
    straight=$(ending "$tmp/straight.out")
    if [[ $code -ne 0 || -z $straight ]]; then
      fail "the uninterrupted run exited $code: $(tail -3 "$tmp/straight.out")"
    fi
    # The same under --max-restarts 2, rank 1 killed with SIGKILL once its
    # checkpoint of step 6 is on disk.
    timeout 300 "$run_bin" -n 2 --max-restarts 2 -- "$prog" "${args[@]}" \
      --save "$tmp/ck" --resume >"$tmp/ck.out" 2>&1 &
    launcher=$!
    killed=
    for _ in $(seq 1 1200); do
      if [[ -d $tmp/ck/step-00000006 ]]; then
        for pid in $(pgrep -P "$launcher") $(pgrep -P "$(pgrep -P "$launcher" | head -1)" 2>/dev/null); do
          if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx RANK=1 &&
            tr '\0' '\n' <"/proc/$pid/environ" | grep -qx GPIPE_RESTART_COUNT=0 &&
            [[ $(cat "/proc/$pid/comm" 2>/dev/null) == gpipe-train ]]; then
            kill -KILL "$pid" && killed=$pid
          fi
        done
        break
      fi
      sleep 0.05
    done
    wait "$launcher"
    code=$?
    resumed=$(ending "$tmp/ck.out")
    if [[ -z $killed ]]; then
      fail "found no rank 1 to kill: $(tail -5 "$tmp/ck.out")"
    elif [[ $code -ne 0 ]] || ! grep -q 'restarting every rank (restart 1 of at most 2)' "$tmp/ck.out" ||
      ! grep -q 'done after 1 of at most 2 restarts' "$tmp/ck.out" ||
      ! grep -q '^\[0\] resumed from .*step-0000000[68] at step' "$tmp/ck.out"; then
      fail "the restarted job exited $code: $(grep -v '^\[.\] epoch' "$tmp/ck.out" | tail -8)"
    elif [[ $resumed != "$straight" ]]; then
      fail "the restarted job ended with '$resumed', the uninterrupted one with '$straight'"
    else
      echo "ok: rank 1 killed at step 6, restarted and resumed: $(grep -o 'resumed from .*' "$tmp/ck.out" | head -1); ends as the uninterrupted run: $resumed"
    fi
    # Another layout resumes from a 2-rank checkpoint of epoch 1: one
    # process with the same two stages (the dropout layer stays on stage 1,
    # so its masks are the same) ends within 1e-6 of the uninterrupted run.
    timeout 300 "$run_bin" -n 2 -- "$prog" "${base[@]}" --epochs 1 --balance 6,7 \
      --save "$tmp/other" >"$tmp/first.out" 2>&1
    mkdir -p "$tmp/mesh"
    cp -r "$tmp/other/step-00000020" "$tmp/mesh/"  # for the 2 x 2 run below
    timeout 300 "$prog" "${base[@]}" --epochs 3 --balance 3,10 --save "$tmp/other" --resume \
      >"$tmp/other.out" 2>&1
    code=$?
    other=$(ending "$tmp/other.out")
    a=$(grep -o '"final_loss":[0-9.e-]*' <<<"$straight" | cut -d: -f2)
    b=$(grep -o '"final_loss":[0-9.e-]*' <<<"$other" | cut -d: -f2)
    if [[ $code -ne 0 ]] || ! grep -q 'resumed from .* at step 20 (epoch 2, batch 0)' "$tmp/other.out" ||
      ! awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-6 * a) }'; then
      fail "one process with --balance 3,10 resumed from the 2-rank checkpoint: exit $code, '$other' against '$straight': $(tail -3 "$tmp/other.out")"
    else
      echo "ok: one process (--balance 3,10) resumed from a 2-rank checkpoint ends with $other"
    fi
    # And two replicas of the pipeline (4 ranks, --pipeline-size 2) resume
    # from it too: smaller micro-batches and per-replica BatchNorm make
    # another run, so only its start and its training are checked.
    timeout 300 "$run_bin" -n 4 -- "$prog" "${base[@]}" --epochs 2 --balance 6,7 \
      --pipeline-size 2 --save "$tmp/mesh" --resume >"$tmp/mesh.out" 2>&1
    code=$?
    accuracy=$(grep -o '"test_accuracy":[0-9.]*' "$tmp/mesh.out" | cut -d: -f2)
    if [[ $code -ne 0 ]] || ! grep -q '^\[0\] resumed from .*step-00000020 at step 20 (epoch 2, batch 0)' "$tmp/mesh.out" ||
      ! awk -v a="$accuracy" 'BEGIN { exit !(a >= 0.5) }'; then
      fail "2 x 2 ranks resumed from the 2-rank checkpoint: exit $code, accuracy '$accuracy': $(tail -3 "$tmp/mesh.out")"
    else
      echo "ok: 2 replicas x 2 stages resumed from the 2-rank checkpoint at step 20; test accuracy $accuracy"
    fi
    ;;
  ordered)
    # gpipe's messages through the ordered channel NCCL uses (framed, in
    # order per pair of ranks, a reader and a writer thread per peer: Note
    # [Tags over an ordered backend] in src/dist/ordered_channel.cpp), here
    # over Gloo groups of two: the checks that found its defects on a GPU
    # (4 ranks under 1F1B and zero-bubble), two stages per rank, transfers
    # posted as a plan writes them, replicas, a killed and a stalled rank.
    export GPIPE_DIST_CHANNEL=ordered
    parity 4 --schedule 1f1b --checkpoint always --dropout 0.3
    parity 4 --schedule zero_bubble --checkpoint always --batch-norm 1
    parity 4 --schedule interleaved --stages-per-lane 2 --checkpoint never --dropout 0.3
    parity 4 --schedule zero_bubble_v --stages-per-lane 2 --v-shape 1 --checkpoint except_last --batch-norm 1
    transfers_plan
    parity 2 --plan "$tmp/plan_transfers.csv" --checkpoint except_last --dropout 0.3
    parity 2 --pipeline-size 1 --schedule 1f1b --dropout 0
    parity 4 --pipeline-size 2 --schedule zero_bubble --dropout 0
    by_hand 2 --scenario throw
    expect_error "a failing loss" "the loss broke on purpose" 2
    survivors
    stalled
    ;;
  *)
    echo "unknown mode $mode"
    exit 2
    ;;
esac

if ((failures > 0)); then
  echo "$failures failure(s)"
  exit 1
fi
