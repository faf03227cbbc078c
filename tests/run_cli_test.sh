#!/usr/bin/env bash
# gpipe-run, checked from outside with `sh -c` programs as its ranks: the
# environment each rank gets, the prefixed output, stopping every rank when
# one fails or gpipe-run is signalled, and bad command lines (exit status 2,
# one line on stderr). With DIST_WORKER (tests/dist/dist_worker.cpp), also
# a job on two hosts played by two gpipe-runs on 127.0.0.1, and a host that
# never comes.
#
#   run_cli_test.sh GPIPE_RUN [DIST_WORKER]
set -uo pipefail

bin=$1
worker=${2:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ulimit -c 0
# strerror's words, as the message for a missing program is checked.
export LC_ALL=C
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

ok() {
  echo "ok: $*"
}

# run ARGS...: runs gpipe-run, leaving $status, $elapsed (whole seconds),
# $tmp/out and $tmp/err. The timeout ($limit seconds, 15 unless set) only
# keeps a broken gpipe-run from hanging the test.
run() {
  local start=$SECONDS
  timeout -k 2 "${limit:-15}" "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  status=$?
  elapsed=$((SECONDS - start))
}

# gone PID: true once no process PID is left (a zombie still counts as one
# for kill -0, so give whoever reaps it a moment).
gone() {
  local i
  for i in $(seq 50); do
    kill -0 "$1" 2>/dev/null || return 0
    sleep 0.1
  done
  return 1
}

# wait_for FILE: until FILE holds something (at most 10 s).
wait_for() {
  local i
  for i in $(seq 100); do
    [[ -s $1 ]] && return 0
    sleep 0.1
  done
  return 1
}

# --- The environment, the prefixes, exit status 0 -------------------------

GPIPE_RUN_TEST_INHERITED=kept MASTER_ADDR=overridden RANK=overridden \
  run -n 3 -- sh -c '
    echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $GPIPE_RUN_TEST_INHERITED"
    echo "to-stderr $RANK" >&2
    printf "no-newline %s" "$RANK"'
if [[ $status -ne 0 ]]; then
  fail "3 ranks that succeed: exit status $status; stderr: $(cat "$tmp/err")"
else
  ports=$(sed -n 's/^\[[0-9]*\] env .* 127\.0\.0\.1 \([0-9][0-9]*\) kept$/\1/p' \
    "$tmp/out" | sort -u)
  good=1
  for r in 0 1 2; do
    if ! grep -qxE "\[$r\] env $r 3 $r 3 127\.0\.0\.1 [0-9]+ kept" "$tmp/out"; then
      fail "rank $r's environment is wrong or unprefixed: $(cat "$tmp/out")"
      good=0
    fi
    if ! grep -qxF "[$r] to-stderr $r" "$tmp/err" ||
      grep -qF "to-stderr" "$tmp/out"; then
      fail "rank $r's stderr line is not on stderr, prefixed: $(cat "$tmp/err")"
      good=0
    fi
    if ! grep -qxF "[$r] no-newline $r" "$tmp/out"; then
      fail "rank $r's last line, without a newline, is missing: $(cat "$tmp/out")"
      good=0
    fi
  done
  if [[ $(wc -l <"$tmp/out") -ne 6 || $(wc -l <"$tmp/err") -ne 3 ]]; then
    fail "expected 6 lines on stdout and 3 on stderr: $(cat "$tmp/out" "$tmp/err")"
    good=0
  fi
  if [[ $(printf '%s\n' "$ports" | grep -c .) -ne 1 ]]; then
    fail "the ranks got different or no MASTER_PORTs: '$ports'"
    good=0
  elif ((ports < 1 || ports > 65535)); then
    fail "MASTER_PORT $ports is not a TCP port"
    good=0
  fi
  ((good)) && ok "3 ranks: RANK, WORLD_SIZE, LOCAL_*, MASTER_* (port $ports), prefixes"
fi

run -n 2 --master-port 12345 --master-addr 10.1.2.3 -- \
  sh -c 'echo "$MASTER_ADDR:$MASTER_PORT"'
if [[ $status -ne 0 ]] || ! grep -qxF '[0] 10.1.2.3:12345' "$tmp/out" ||
  ! grep -qxF '[1] 10.1.2.3:12345' "$tmp/out"; then
  fail "--master-port/--master-addr not passed through ($status): $(cat "$tmp/out" "$tmp/err")"
else
  ok "--master-port 12345 --master-addr 10.1.2.3"
fi

# torchrun's variables that gpipe-run does not set do not reach the ranks
# from gpipe-run's environment (an outer torchrun job's values).
GROUP_RANK=7 GROUP_WORLD_SIZE=8 ROLE_RANK=7 ROLE_WORLD_SIZE=8 ROLE_NAME=outer \
  TORCHELASTIC_RUN_ID=x TORCHELASTIC_MAX_RESTARTS=3 \
  TORCHELASTIC_USE_AGENT_STORE=True TORCHELASTIC_RESTART_COUNT=9 \
  run -n 1 -- sh -c 'env'
stale=$(grep -E '^\[0\] (GROUP_|ROLE_|TORCHELASTIC_)' "$tmp/out" |
  grep -vxF '[0] TORCHELASTIC_RESTART_COUNT=0' | tr '\n' ' ')
if [[ $status -ne 0 || -n $stale ]] ||
  ! grep -qxF '[0] TORCHELASTIC_RESTART_COUNT=0' "$tmp/out"; then
  fail "torchrun's variables: exit status $status, the rank saw '$stale'"
else
  ok "torchrun's GROUP_*, ROLE_*, TORCHELASTIC_* (but the restart count) are left out"
fi

# Lines come out whole however the ranks' writes interleave.
run -n 4 -- sh -c '
  pad=$(printf "%0200d" 0)
  i=0
  while [ $i -lt 2000 ]; do echo "$RANK:$i:$pad"; i=$((i + 1)); done'
torn=$(grep -cvE '^\[([0-3])\] \1:[0-9]+:0{200}$' "$tmp/out")
if [[ $status -ne 0 || $torn -ne 0 || $(wc -l <"$tmp/out") -ne 8000 ]]; then
  fail "4 x 2000 lines: exit status $status, $torn torn lines, $(wc -l <"$tmp/out") lines"
else
  ok "4 x 2000 lines of 200 bytes, none torn"
fi

# Ranks' output that could not be written (a full disk) is lost: a job whose
# ranks succeeded exits 1, saying so (it exited 0); a reader that closed the
# output (head -1) has what it wanted, and the job exits 0.
if [[ -w /dev/full ]]; then
  timeout 15 "$bin" -n 2 -- sh -c 'echo result' >/dev/full 2>"$tmp/err"
  status=$?
  if [[ $status -ne 1 ]] || ! grep -q "could not write the ranks' standard output (No space left on device)" "$tmp/err"; then
    fail "stdout on /dev/full: exit status $status, expected 1: $(cat "$tmp/err")"
  else
    ok "stdout on /dev/full: $(cat "$tmp/err")"
  fi
  first=$({
    timeout 15 "$bin" -n 1 -- sh -c 'i=0; while [ $i -lt 20000 ]; do echo line $i; i=$((i + 1)); done' 2>"$tmp/err"
    echo $? >"$tmp/status"
  } | head -1)
  status=$(cat "$tmp/status")
  if [[ $status -ne 0 || $first != "[0] line 0" ]]; then
    fail "stdout closed by head -1: exit status $status, first line '$first': $(cat "$tmp/err")"
  else
    ok "stdout closed by head -1: exit status 0"
  fi
fi

# A line of exactly 1 MiB is one line, and a longer one comes out in
# pieces of 1 MiB, each prefixed, with no empty piece (a line of exactly
# 1 MiB came out as itself and then an empty "[0] ").
run -n 1 -- sh -c '
  head -c 1048576 /dev/zero | tr "\\0" a; echo
  head -c 2097152 /dev/zero | tr "\\0" b; echo
  head -c 1048577 /dev/zero | tr "\\0" c; echo'
lengths=$(awk '{ print length($0) }' "$tmp/out" | tr '\n' ' ')
if [[ $status -ne 0 || $lengths != "1048580 1048580 1048580 1048580 5 " ]]; then
  fail "lines of 1, 2 and 1 MiB + 1 byte: exit status $status, lengths $lengths"
else
  ok "a line of 1 MiB is one line; longer ones come in pieces of 1 MiB"
fi

# A rank that exits 0 while the others run, before one fails (its peers'
# errors can only say that a connection closed): the verdict names it.
run -n 3 -- sh -c '
  if [ "$RANK" = 2 ]; then exit 0; fi
  sleep 0.5
  if [ "$RANK" = 1 ]; then exit 3; fi
  sleep 10'
verdict=$(tail -n 1 "$tmp/err")
if [[ $status -ne 3 || $verdict != *"rank 1 failed first (exited with code 3); stopped rank 0; before it, rank 2 had exited with code 0 while the others ran" ]]; then
  fail "a rank that left early, then a failure: exit status $status, verdict: $verdict"
else
  ok "a rank that exited 0 before another failed is named: $verdict"
fi

# A rank that exits 0 early stops nobody, and is reaped (no zombie) while
# the others run.
timeout -k 2 15 "$bin" -n 2 -- sh -c '
  if [ "$RANK" = 1 ]; then exit 0; fi
  sleep 1.5; echo done' >"$tmp/out" 2>"$tmp/err" &
launcher=$!
sleep 0.8
zombies=$(ps -e -o ppid= -o stat= | awk -v p="$launcher" '$1 == p && $2 ~ /^Z/' | wc -l)
wait "$launcher"
status=$?
if [[ $status -ne 0 ]] || ! grep -qxF '[0] done' "$tmp/out"; then
  fail "rank 1 exiting 0 early: exit status $status: $(cat "$tmp/out" "$tmp/err")"
elif [[ $zombies -ne 0 ]]; then
  fail "rank 1 exiting 0 early was left a zombie"
else
  ok "a rank exiting 0 early is reaped and stops nobody"
fi

# No descriptor of gpipe-run's reaches a rank: the ranks see what a program
# started directly sees.
if [[ -d /proc/self/fd ]]; then
  expected=$(sh -c 'ls /proc/self/fd' | sort | tr '\n' ' ')
  run -n 2 -- sh -c 'ls /proc/self/fd'
  for r in 0 1; do
    got=$(sed -n "s/^\[$r\] //p" "$tmp/out" | sort | tr '\n' ' ')
    if [[ $got != "$expected" ]]; then
      fail "rank $r has descriptors '$got', expected '$expected'"
    else
      ok "rank $r has no extra descriptors ($got)"
    fi
  done
fi

# --- Failures stop every rank ---------------------------------------------

# Stopping must take SIGTERM, not the grace period, which the tests below
# make long enough to tell the two apart.
grace=(--grace 30)

# Rank 1 exits 3 once rank 0 has started a sleep in the background (in
# rank 0's process group, so that SIGTERM must reach the group).
limit=8 run -n 2 "${grace[@]}" -- sh -c '
  if [ "$RANK" = 1 ]; then
    while [ ! -s "$0/sleeper" ]; do sleep 0.05; done
    exit 3
  fi
  sleep 60 & echo $! >"$0/sleeper"; wait' "$tmp"
sleeper=$(cat "$tmp/sleeper" 2>/dev/null)
if [[ $status -ne 3 ]]; then
  fail "rank 1 exiting 3: exit status $status, expected 3: $(cat "$tmp/err")"
elif ((elapsed > 4)); then
  fail "rank 1 exiting 3: gpipe-run took ${elapsed}s to stop"
elif [[ -z $sleeper ]] || ! gone "$sleeper"; then
  fail "rank 1 exiting 3: rank 0's sleep ('$sleeper') is still running"
  [[ -n $sleeper ]] && kill "$sleeper"
elif ! grep -q 'rank 1 exited with code 3' "$tmp/err"; then
  fail "rank 1 exiting 3: no line naming the rank and code: $(cat "$tmp/err")"
else
  ok "rank 1 exits 3: exit status 3 in ${elapsed}s, rank 0's group stopped: $(cat "$tmp/err")"
fi

limit=8 run -n 2 "${grace[@]}" -- sh -c '
  if [ "$RANK" = 1 ]; then kill -9 $$; fi
  exec sleep 60'
if [[ $status -ne 137 ]] || ((elapsed > 4)); then
  fail "rank 1 killed: exit status $status after ${elapsed}s, expected 137: $(cat "$tmp/err")"
elif ! grep -q 'rank 1 was killed by SIGKILL' "$tmp/err"; then
  fail "rank 1 killed: no line naming the rank and signal: $(cat "$tmp/err")"
else
  ok "rank 1 killed by SIGKILL: exit status 137: $(cat "$tmp/err")"
fi

# A rank that ignores SIGTERM gets SIGKILL after --grace.
rm -f "$tmp/sleeper"
limit=8 run -n 2 --grace 1 -- sh -c '
  if [ "$RANK" = 1 ]; then
    while [ ! -s "$0/sleeper" ]; do sleep 0.05; done
    exit 1
  fi
  trap "" TERM
  echo $$ >"$0/sleeper"
  while :; do sleep 0.1; done' "$tmp"
sleeper=$(cat "$tmp/sleeper" 2>/dev/null)
if [[ $status -ne 1 ]] || ((elapsed > 6)); then
  fail "--grace 1: exit status $status after ${elapsed}s: $(cat "$tmp/err")"
elif [[ -z $sleeper ]] || ! gone "$sleeper"; then
  fail "--grace 1: rank 0 ('$sleeper') ignoring SIGTERM is still running"
  [[ -n $sleeper ]] && kill -9 "$sleeper"
elif ! grep -q 'SIGKILL' "$tmp/err"; then
  fail "--grace 1: no line saying SIGKILL was sent: $(cat "$tmp/err")"
else
  ok "--grace 1: a rank ignoring SIGTERM is killed in ${elapsed}s"
fi

# ranks_left CHECK: in $left, the ranks (whose pids are in $tmp/pid.0 and
# pid.1) that CHECK PID does not find ended; each of them is killed.
ranks_left() {
  local r pid
  left=""
  for r in 0 1; do
    pid=$(cat "$tmp/pid.$r" 2>/dev/null)
    if [[ -z $pid ]] || ! "$1" "$pid"; then
      left+=" $r"
      [[ -n $pid ]] && kill -9 "$pid"
    fi
  done
}

# SIGINT and SIGTERM to gpipe-run reach every rank.
for sig in INT TERM; do
  rm -f "$tmp"/pid.*
  # (timeout's own SIGKILL comes late enough not to stand in for a slow
  # exit on a loaded machine: the elapsed time is checked below.)
  timeout -k 10 20 "$bin" -n 2 "${grace[@]}" -- \
    sh -c 'echo $$ >"$0/pid.$RANK"; exec sleep 60' \
    "$tmp" >"$tmp/out" 2>"$tmp/err" &
  launcher=$!
  wait_for "$tmp/pid.0" && wait_for "$tmp/pid.1"
  start=$SECONDS
  kill -"$sig" "$launcher"
  wait "$launcher"
  status=$?
  elapsed=$((SECONDS - start))
  expected=$((128 + $(kill -l "$sig")))
  ranks_left gone
  if [[ $status -ne $expected ]] || ((elapsed > 8)); then
    fail "SIG$sig to gpipe-run: exit status $status after ${elapsed}s, expected $expected: $(cat "$tmp/err")"
  elif [[ -n $left ]]; then
    fail "SIG$sig to gpipe-run: rank(s)$left still running"
  else
    ok "SIG$sig to gpipe-run: exit status $status, every rank stopped"
  fi
done

# SIGKILL to gpipe-run, which can forward nothing: its ranks end with it
# instead of running on unsupervised. (Orphans are reaped by whoever
# adopts them, perhaps never in a container: a zombie counts as ended.)
ended() {
  local i
  for i in $(seq 50); do
    kill -0 "$1" 2>/dev/null || return 0
    [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) == Z ]] && return 0
    sleep 0.1
  done
  return 1
}
rm -f "$tmp"/pid.*
"$bin" -n 2 -- sh -c 'echo $$ >"$0/pid.$RANK"; exec sleep 60' \
  "$tmp" >"$tmp/out" 2>"$tmp/err" &
launcher=$!
wait_for "$tmp/pid.0" && wait_for "$tmp/pid.1"
kill -9 "$launcher"
wait "$launcher" 2>/dev/null
ranks_left ended
if [[ -n $left ]]; then
  fail "SIGKILL to gpipe-run: rank(s)$left still running"
else
  ok "SIGKILL to gpipe-run: every rank ended with it"
fi

# A program that cannot be executed: one line, from gpipe-run, which starts
# no rank after it, and exit status 127.
run -n 2 -- gpipe-run-no-such-program --flag
if [[ $status -ne 127 ]] ||
  [[ $(cat "$tmp/err") != "gpipe-run: cannot execute 'gpipe-run-no-such-program' for rank 0: No such file or directory" ]]; then
  fail "a missing program: exit status $status, expected 127 and one line: $(cat "$tmp/err")"
else
  ok "a missing program: exit status 127: $(cat "$tmp/err")"
fi

# ... and is not restarted, which would only fail the same way again (it
# used to be, at once, --max-restarts times).
run -n 2 --max-restarts 1000 -- /nonexistent/gpipe-run-test-program
if [[ $status -ne 127 || $(wc -l <"$tmp/err") -ne 1 ]] ||
  grep -qF restarting "$tmp/err"; then
  fail "a missing program with --max-restarts 1000: exit status $status, $(wc -l <"$tmp/err") lines, expected 127 and one: $(head -c 300 "$tmp/err")"
else
  ok "a missing program is not restarted: $(cat "$tmp/err")"
fi

# What a rank started (a wrapper script's program, not exec'd) ends too
# when gpipe-run is killed by SIGKILL: the watchdog kills the ranks' groups.
rm -f "$tmp"/child.*
"$bin" -n 2 -- sh -c 'sleep 60 & echo $! >"$0/child.$RANK"; wait' \
  "$tmp" >"$tmp/out" 2>"$tmp/err" &
launcher=$!
wait_for "$tmp/child.0" && wait_for "$tmp/child.1"
kill -9 "$launcher"
wait "$launcher" 2>/dev/null
left=""
for r in 0 1; do
  pid=$(cat "$tmp/child.$r" 2>/dev/null)
  if [[ -z $pid ]] || ! ended "$pid"; then
    left+=" $r"
    [[ -n $pid ]] && kill -9 "$pid"
  fi
done
if [[ -n $left ]]; then
  fail "SIGKILL to gpipe-run: what rank(s)$left started is still running"
else
  ok "SIGKILL to gpipe-run: what the ranks started ended with it"
fi

# A reader that never reads gpipe-run's output does not keep it from acting
# on SIGTERM: the rank, which ignores SIGTERM, gets SIGKILL after --grace 1,
# and gpipe-run gives up the output it holds --grace seconds later.
rm -f "$tmp/pid.0" "$tmp/fifo"
mkfifo "$tmp/fifo"
sleep 30 <"$tmp/fifo" &
reader=$!
"$bin" -n 1 --grace 1 -- sh -c 'trap "" TERM; echo $$ >"$0/pid.0"; exec yes' \
  "$tmp" >"$tmp/fifo" 2>"$tmp/err" &
launcher=$!
wait_for "$tmp/pid.0"
sleep 0.5
kill -TERM "$launcher"
rank_pid=$(cat "$tmp/pid.0" 2>/dev/null)
if [[ -z $rank_pid ]] || ! { gone "$rank_pid" || gone "$rank_pid"; }; then
  fail "SIGTERM with a stalled reader: the rank ('$rank_pid') is still running"
  [[ -n $rank_pid ]] && kill -9 "$rank_pid"
elif ! { gone "$launcher" || gone "$launcher"; }; then
  fail "SIGTERM with a stalled reader: gpipe-run is still running"
else
  ok "SIGTERM with a stalled reader: the rank got SIGKILL after --grace and gpipe-run ended"
fi
kill -9 "$launcher" "$reader" 2>/dev/null
wait "$launcher" "$reader" 2>/dev/null

# signal_mask PID FIELD: the hexadecimal mask FIELD (SigIgn, SigBlk) of
# process PID.
signal_mask() {
  sed -n "s/^$2:[[:space:]]*//p" "/proc/$1/status" 2>/dev/null
}

# SIGHUP ignored when gpipe-run starts (nohup, or `trap '' HUP`) stays
# ignored: by gpipe-run, which goes on, and by its ranks.
if [[ -r /proc/self/status ]]; then
  rm -f "$tmp/pid.0"
  (
    trap '' HUP
    exec "$bin" -n 1 -- sh -c 'echo $$ >"$0/pid.0"; exec sleep 60' "$tmp"
  ) >"$tmp/out" 2>"$tmp/err" &
  launcher=$!
  wait_for "$tmp/pid.0"
  rank_pid=$(cat "$tmp/pid.0" 2>/dev/null)
  ignored=$(signal_mask "$rank_pid" SigIgn)
  kill -HUP "$launcher"
  sleep 0.5
  if ! kill -0 "$launcher" 2>/dev/null; then
    wait "$launcher"
    fail "SIGHUP ignored at the start: gpipe-run ended on SIGHUP with status $?: $(cat "$tmp/err")"
  elif [[ -z $ignored ]] || ((0x$ignored % 2 == 0)); then
    fail "SIGHUP ignored at the start: the rank does not ignore it (SigIgn $ignored)"
  else
    ok "SIGHUP ignored at the start stays ignored, by gpipe-run and its ranks"
  fi
  kill -TERM "$launcher" 2>/dev/null
  wait "$launcher"
  [[ -n $rank_pid ]] && ! gone "$rank_pid" && kill -9 "$rank_pid"
fi

# SIGTERM, SIGINT and SIGHUP blocked when gpipe-run starts are unblocked:
# SIGTERM still stops it.
rm -f "$tmp/pid.0"
perl -e 'use POSIX; sigprocmask(SIG_BLOCK, POSIX::SigSet->new(SIGTERM, SIGINT, SIGHUP)); exec @ARGV or exit 127' \
  "$bin" -n 1 --grace 1 -- sh -c 'echo $$ >"$0/pid.0"; exec sleep 60' "$tmp" \
  >"$tmp/out" 2>"$tmp/err" &
launcher=$!
wait_for "$tmp/pid.0"
rank_pid=$(cat "$tmp/pid.0" 2>/dev/null)
kill -TERM "$launcher"
if ! { gone "$launcher" || gone "$launcher"; }; then
  fail "SIGTERM blocked at the start: gpipe-run does not stop on SIGTERM"
  kill -9 "$launcher"
  [[ -n $rank_pid ]] && kill -9 "$rank_pid"
else
  wait "$launcher"
  status=$?
  if [[ $status -ne 143 ]]; then
    fail "SIGTERM blocked at the start: exit status $status, expected 143: $(cat "$tmp/err")"
  else
    ok "SIGTERM blocked at the start: unblocked, exit status 143"
  fi
fi
wait "$launcher" 2>/dev/null

# --- Every rank's last lines, then the verdict ----------------------------

# Lines written after a rank itself has exited still come out, before
# gpipe-run's last line. Rank 1 fails while its log filter (a process
# substitution, which bash does not wait for) still holds its last line;
# rank 0 is a wrapper whose program, on SIGTERM, prints once the wrapper has
# died; rank 2 is stopped outright.
rm -f "$tmp/ready"
limit=15 run -n 3 "${grace[@]}" -- bash -c '
  case $RANK in
    1)
      while [ ! -e "$0/ready" ]; do sleep 0.05; done
      exec 2> >(while IFS= read -r line; do sleep 1; echo "log: $line" >&2; done)
      echo "rank 1 last words" >&2
      exit 3 ;;
    0)
      sh -c "trap \"sleep 1; echo rank 0 stopped cleanly >&2; exit 143\" TERM
        touch \"\$0/ready\"
        while :; do sleep 0.1; done" "$0"
      echo "rank 0 wrapper: not reached" >&2 ;;
    *) exec sleep 60 ;;
  esac' "$tmp"
verdict='rank 1 failed first (exited with code 3); stopped ranks 0, 2'
if [[ $status -ne 3 ]] || ((elapsed > 6)); then
  fail "last lines: exit status $status after ${elapsed}s, expected 3: $(cat "$tmp/err")"
elif ! grep -qxF '[1] log: rank 1 last words' "$tmp/err"; then
  fail "last lines: the failing rank's last line, written after it exited, is lost: $(cat "$tmp/err")"
elif ! grep -qxF '[0] rank 0 stopped cleanly' "$tmp/err"; then
  fail "last lines: the stopped rank's last line, written after its wrapper died, is lost: $(cat "$tmp/err")"
elif [[ $(tail -n 1 "$tmp/err") != "gpipe-run: $verdict" ]]; then
  fail "last lines: the last line is not the verdict '$verdict': $(cat "$tmp/err")"
elif grep -qF 'not reached' "$tmp/err"; then
  fail "last lines: rank 0's wrapper outlived SIGTERM: $(cat "$tmp/err")"
else
  ok "every rank's last line, then the verdict: $(tail -n 1 "$tmp/err")"
fi

# With no stop under way, a rank that exits 0 is read to its end too.
run -n 1 -- bash -c 'exec > >(sleep 0.5; cat); echo "through the filter"'
if [[ $status -ne 0 ]] || ! grep -qxF '[0] through the filter' "$tmp/out"; then
  fail "a rank's filter after it exited 0: exit status $status: $(cat "$tmp/out" "$tmp/err")"
else
  ok "a rank's filter after it exited 0 is read to its end"
fi

# What a failed rank leaves running holding its output gets SIGKILL after
# --grace, rather than keeping gpipe-run for ever.
rm -f "$tmp/sleeper"
limit=10 run -n 2 --grace 1 -- sh -c '
  if [ "$RANK" = 1 ]; then
    sleep 60 &
    echo $! >"$0/sleeper"
    exit 3
  fi
  exec sleep 60' "$tmp"
sleeper=$(cat "$tmp/sleeper" 2>/dev/null)
if [[ $status -ne 3 ]] || ((elapsed > 5)); then
  fail "a failed rank's leftover: exit status $status after ${elapsed}s: $(cat "$tmp/err")"
elif [[ -z $sleeper ]] || ! gone "$sleeper"; then
  fail "a failed rank's leftover ('$sleeper') is still running"
  [[ -n $sleeper ]] && kill "$sleeper"
elif ! grep -qF 'sending SIGKILL to what rank 1 left' "$tmp/err"; then
  fail "a failed rank's leftover: no line saying SIGKILL was sent: $(cat "$tmp/err")"
else
  ok "a failed rank's leftover holding its output is killed after --grace"
fi

# What ranks that ended well left running holding their output gets SIGTERM
# after --grace (it kept gpipe-run for ever), and the exit status stays 0.
rm -f "$tmp/sleeper"*
limit=10 run -n 2 --grace 1 -- sh -c 'sleep 60 & echo $! >"$0/sleeper$RANK"; echo started' "$tmp"
left=""
for file in "$tmp"/sleeper*; do
  pid=$(cat "$file" 2>/dev/null)
  [[ -n $pid ]] && ! gone "$pid" && left="$left $pid" && kill "$pid" 2>/dev/null
done
if [[ $status -ne 0 ]] || ((elapsed > 4)); then
  fail "ranks that ended well, leaving processes: exit status $status after ${elapsed}s: $(cat "$tmp/err")"
elif [[ -n $left ]]; then
  fail "ranks that ended well: what they left ($left) is still running"
elif ! grep -qxF 'gpipe-run: ranks 0, 1 ended 1 s ago, but what they left still holds their output; sending it SIGTERM' "$tmp/err"; then
  fail "ranks that ended well, leaving processes: $(cat "$tmp/err")"
else
  ok "what ranks that ended well left is stopped after --grace: $(cat "$tmp/err")"
fi

# One rank that fails: one line, the verdict (the same failure was said
# twice).
run -n 1 -- sh -c 'exit 3'
if [[ $status -ne 3 || $(cat "$tmp/err") != 'gpipe-run: rank 0 failed (exited with code 3)' ]]; then
  fail "one failing rank: exit status $status: $(cat "$tmp/err")"
else
  ok "one failing rank, one line: $(cat "$tmp/err")"
fi

# A process outside the rank's group holding its output does not keep
# gpipe-run once the group is gone.
rm -f "$tmp/sleeper"
limit=10 run -n 1 -- sh -c 'setsid sh -c "echo \$\$ >$0/sleeper; exec sleep 5" &
  while [ ! -s "$0/sleeper" ]; do sleep 0.05; done
  echo "rank 0 done"' "$tmp"
sleeper=$(cat "$tmp/sleeper" 2>/dev/null)
[[ -n $sleeper ]] && kill "$sleeper" 2>/dev/null
if [[ $status -ne 0 ]] || ((elapsed > 3)) ||
  ! grep -qxF '[0] rank 0 done' "$tmp/out"; then
  fail "output held outside the rank's group: exit status $status after ${elapsed}s: $(cat "$tmp/out" "$tmp/err")"
else
  ok "output held outside the rank's group does not keep gpipe-run"
fi

# The rank that exited first is named, not the lowest: rank 1 exits 3, then
# rank 0 exits 4, while gpipe-run is stopped (SIGSTOP), so that it finds
# both ended at once when it goes on. (Its loop no longer waits on a slow
# stdout, which this test used to stop it with.)
rm -f "$tmp"/pid.* "$tmp/go" "$tmp/exited1" "$tmp/release"
"$bin" -n 2 -- sh -c '
  echo $$ >"$0/pid.$RANK"
  if [ "$RANK" = 0 ]; then
    while [ ! -e "$0/exited1" ]; do sleep 0.05; done
    sleep 0.5
    echo "rank 0 fails second" >&2
    echo released >"$0/release"
    exit 4
  fi
  while [ ! -e "$0/go" ]; do sleep 0.05; done
  echo "rank 1 fails first" >&2
  touch "$0/exited1"
  exit 3' "$tmp" >"$tmp/out" 2>"$tmp/err" &
launcher=$!
wait_for "$tmp/pid.0" && wait_for "$tmp/pid.1"
kill -STOP "$launcher"
touch "$tmp/go"
wait_for "$tmp/release"
# Rank 0 has ended: a zombie until gpipe-run, stopped, reaps it.
for i in $(seq 100); do
  state=$(ps -o stat= -p "$(cat "$tmp/pid.0")" 2>/dev/null)
  [[ -z $state || $state == Z* ]] && break
  sleep 0.05
done
kill -CONT "$launcher"
if ! { gone "$launcher" || gone "$launcher"; }; then
  kill -9 "$launcher"
fi
wait "$launcher"
status=$?
verdict='rank 1 failed first (exited with code 3); rank 0 exited with code 4 too'
if [[ $status -ne 3 ]]; then
  fail "first to exit: exit status $status, expected rank 1's 3: $(cat "$tmp/err")"
elif [[ $(tail -n 1 "$tmp/err") != "gpipe-run: $verdict" ]] ||
  ! grep -qxF '[0] rank 0 fails second' "$tmp/err" ||
  ! grep -qxF '[1] rank 1 fails first' "$tmp/err"; then
  fail "first to exit: expected both ranks' lines, then '$verdict': $(cat "$tmp/err")"
else
  ok "the rank that exited first is named: $(tail -n 1 "$tmp/err")"
fi

# --- Several hosts ----------------------------------------------------------

# Host 2 of 3, two ranks a host: global RANKs 4 and 5 of 6, LOCAL_RANKs 0
# and 1; gpipe-run's messages name the global ranks.
run --nnodes 3 --node-rank 2 -n 2 --master-addr 127.0.0.1 --master-port 12345 \
  -- sh -c 'echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT"'
if [[ $status -ne 0 ]] ||
  ! grep -qxF '[4] env 4 6 0 2 127.0.0.1:12345' "$tmp/out" ||
  ! grep -qxF '[5] env 5 6 1 2 127.0.0.1:12345' "$tmp/out" ||
  [[ $(wc -l <"$tmp/out") -ne 2 ]]; then
  fail "--nnodes 3 --node-rank 2 -n 2: exit status $status, expected RANK 4 and 5 of 6: $(cat "$tmp/out" "$tmp/err")"
else
  ok "--nnodes 3 --node-rank 2 -n 2: RANK 4, 5 of WORLD_SIZE 6, LOCAL_RANK 0, 1 of 2"
fi

limit=8 run --nnodes 3 --node_rank 2 -n 2 --master-addr 127.0.0.1 \
  --master-port 12345 --grace 30 -- sh -c '
  if [ "$RANK" = 5 ]; then exit 3; fi
  exec sleep 60'
verdict='rank 5 failed first (exited with code 3); stopped rank 4'
if [[ $status -ne 3 ]] || ((elapsed > 4)) ||
  ! grep -qxF 'gpipe-run: rank 5 exited with code 3; sending SIGTERM to the other ranks' "$tmp/err" ||
  [[ $(tail -n 1 "$tmp/err") != "gpipe-run: $verdict" ]]; then
  fail "global rank 5 failing on host 2: exit status $status after ${elapsed}s, expected 3 and '$verdict': $(cat "$tmp/err")"
else
  ok "--node_rank 2: the failing rank and the stopped one by global rank: $(tail -n 1 "$tmp/err")"
fi

# free_port: a port that gpipe-run finds free, for two gpipe-runs to share.
free_port() {
  "$bin" -n 1 -- sh -c 'echo "$MASTER_PORT"' 2>/dev/null | sed -n 's/^\[0\] //p'
}

if [[ -z $worker ]]; then
  echo "skipped: two hosts on 127.0.0.1 (no DIST_WORKER given)"
else
  # Two hosts played by two gpipe-runs on 127.0.0.1, two ranks each: the
  # worker's four ranks check themselves against one-process GPipe.
  port=$(free_port)
  for k in 0 1; do
    GPIPE_DIST_TIMEOUT=60 timeout -k 2 90 "$bin" --nnodes 2 --node-rank $k -n 2 \
      --master-addr 127.0.0.1 --master-port "$port" -- "$worker" --steps 1 \
      >"$tmp/node$k" 2>&1 &
    pids[k]=$!
  done
  for k in 0 1; do
    wait "${pids[k]}"
    codes[k]=$?
  done
  good=1
  for k in 0 1; do
    for r in $((2 * k)) $((2 * k + 1)); do
      if ! grep -qE "^\[$r\] rank $r: OK " "$tmp/node$k"; then
        good=0
      fi
    done
    if [[ ${codes[k]} -ne 0 ]] ||
      grep -qE "^\[$((2 - 2 * k))\]|^\[$((3 - 2 * k))\]" "$tmp/node$k"; then
      good=0
    fi
  done
  if ((good)); then
    ok "two hosts on 127.0.0.1, port $port: host 0 ran ranks 0, 1 and host 1 ranks 2, 3 of 4, all OK"
  else
    fail "two hosts on 127.0.0.1: host 0 exited ${codes[0]}, host 1 ${codes[1]}; expected 0, with ranks 0, 1 OK on host 0 and 2, 3 on host 1:"$'\n'"$(head -c 2000 "$tmp/node0")"$'\n'"---"$'\n'"$(head -c 2000 "$tmp/node1")"
  fi

  # A host that never comes: the ranks of the one that does fail within
  # their rendezvous timeout (5 s; about twice that for host 0, whose rank 0
  # waits for the store's workers, then for the group), and gpipe-run says
  # which failed first. Host 0 alone and host 1 alone, at the same time.
  start=$SECONDS
  for k in 0 1; do
    ports[k]=$(free_port)
    GPIPE_DIST_TIMEOUT=5 timeout -k 2 40 "$bin" --nnodes 2 --node-rank $k -n 2 \
      --master-addr 127.0.0.1 --master-port "${ports[k]}" -- "$worker" --steps 1 \
      >"$tmp/alone$k" 2>&1 &
    pids[k]=$!
  done
  for k in 0 1; do
    wait "${pids[k]}"
    codes[k]=$?
  done
  elapsed=$((SECONDS - start))
  for k in 0 1; do
    ranks="$((2 * k))|$((2 * k + 1))"
    if [[ ${codes[k]} -eq 0 || ${codes[k]} -eq 124 || ${codes[k]} -eq 137 ]] ||
      ((elapsed > 25)) ||
      ! grep -qE "^\[($ranks)\] rank ($ranks) error: .*(within 5 s|waited 5 s)" "$tmp/alone$k" ||
      ! tail -n 1 "$tmp/alone$k" | grep -qE "^gpipe-run: rank ($ranks) failed first \(exited with code [0-9]+\)"; then
      fail "host $k of 2 alone: exit status ${codes[k]} after ${elapsed}s, expected a rank's error within 5 s and a verdict naming it: $(tail -c 2000 "$tmp/alone$k")"
    else
      ok "host $k of 2 alone fails in ${elapsed}s (status ${codes[k]}): $(grep -m 1 -E "^\[($ranks)\] rank ($ranks) error" "$tmp/alone$k" | head -c 200); $(tail -n 1 "$tmp/alone$k")"
    fi
  done
fi

# --- Restarts -----------------------------------------------------------------

# --max-restarts 2: rank 1 fails on the first start only; every rank starts
# again, on a fresh port, told which start it is, and the job succeeds.
limit=20 run -n 2 --max-restarts 2 -- sh -c '
  echo "start $GPIPE_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT port $MASTER_PORT"
  if [ "$GPIPE_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 3; fi'
ports=$(grep -o 'port [0-9]*' "$tmp/out" | sort -u | wc -l)
if [[ $status -ne 0 ]] || ! grep -q '^\[1\] start 1 1 port' "$tmp/out" ||
  ! grep -q 'restarting every rank (restart 1 of at most 2)' "$tmp/err" ||
  [[ $(tail -1 "$tmp/err") != "gpipe-run: done after 1 of at most 2 restarts" ]] ||
  [[ $ports -ne 2 ]]; then
  fail "--max-restarts 2 with one failed start: exit status $status, $ports ports: $(cat "$tmp/out" "$tmp/err")"
else
  ok "--max-restarts 2: restarted once on a fresh port and succeeded"
fi
# A rank that always fails: R restarts, then the failing rank's status.
limit=20 run -n 2 --max-restarts 2 -- sh -c '[ "$RANK" = 0 ] || exit 4'
starts=$(grep -c 'rank 1 failed first (exited with code 4)' "$tmp/err")
if [[ $status -ne 4 || $starts -ne 3 ]] ||
  [[ $(tail -1 "$tmp/err") != "gpipe-run: gave up after 2 of at most 2 restarts" ]]; then
  fail "--max-restarts 2, always failing: exit status $status after $starts starts: $(cat "$tmp/err")"
else
  ok "--max-restarts 2, always failing: 3 starts, exit status 4"
fi
# A rank that exits 2 (a command-line error) is not started again: every
# start would read the same command line.
limit=20 run -n 2 --max-restarts 2 -- sh -c 'echo start; [ "$RANK" = 0 ] || exit 2'
starts=$(grep -c '^\[1\] start' "$tmp/out")
if [[ $status -ne 2 || $starts -ne 1 ]] ||
  ! grep -q 'not restarting: rank 1 exited with status 2' "$tmp/err" ||
  [[ $(tail -1 "$tmp/err") != "gpipe-run: gave up after 0 of at most 2 restarts" ]]; then
  fail "--max-restarts 2, a rank exiting 2: exit status $status after $starts starts: $(cat "$tmp/err")"
else
  ok "--max-restarts 2, a rank exiting 2: one start, not restarted"
fi

# --- Bad command lines -----------------------------------------------------

# bad WORD ARGS...: ARGS must exit 2, with nothing on stdout and one line on
# stderr that has WORD in it.
bad() {
  local word=$1
  shift
  run "$@"
  local lines
  lines=$(wc -l <"$tmp/err")
  if [[ $status -ne 2 ]]; then
    fail "gpipe-run $* exited $status, expected 2; stderr: $(head -c 500 "$tmp/err")"
  elif [[ $lines -ne 1 ]]; then
    fail "gpipe-run $* wrote $lines lines on stderr, expected 1: $(head -c 500 "$tmp/err")"
  elif ! grep -qF -- "$word" "$tmp/err"; then
    fail "gpipe-run $*: stderr does not say '$word': $(cat "$tmp/err")"
  elif [[ -s $tmp/out ]]; then
    fail "gpipe-run $* wrote on stdout: $(head -c 500 "$tmp/out")"
  else
    ok "$* -> $(cat "$tmp/err")"
  fi
}

bad -n -n 0 -- true
bad -n -n -1 -- true
bad -n -n abc -- true
bad -n -n 1.5 -- true
bad -n -n 99999999999999999999 -- true
bad -n -n 100000 -- true
bad -n -- true
bad "-n was given 2 times; give it once" -n 2 -n 3 -- true
bad "--nnodes expects a value after it" -n 2 --nnodes
bad -n -n
bad "'--'" -n 2 true
bad "'--'" -n 2
bad program -n 2 --
bad program -n 2 -- ''
bad --no-such-flag -n 2 --no-such-flag -- true
bad -x -n 2 -x -- true
bad "'stray'" -n 2 stray -- true
bad --master-port -n 2 --master-port 0 -- true
bad --master-port -n 2 --master-port 65536 -- true
bad --master-port -n 2 --master-port -1 -- true
bad --master-port -n 2 --master-port abc -- true
bad --master-port -n 2 --master-port 0x10 -- true
bad --master-port -n 2 --master-port -- true
bad --master-addr -n 2 --master-addr '' -- true
# An address that does not resolve is refused before any rank starts
# (rather than every rank's c10d client retrying it until its timeout).
rm -f "$tmp/started"
bad --master-addr -n 2 --master-addr not.a.host -- \
  sh -c 'touch "$0/started"' "$tmp"
if ! grep -qF "'not.a.host'" "$tmp/err"; then
  fail "--master-addr not.a.host: the error does not name the address: $(cat "$tmp/err")"
elif [[ -e $tmp/started ]]; then
  fail "--master-addr not.a.host: a rank was started"
fi
bad --master-addr -n 2 --master-addr 127.0.0.1:29500 -- true
bad --grace -n 2 --grace -1 -- true
bad --grace -n 2 --grace soon -- true
bad --grace -n 2 --grace 1e300 -- true
bad --max-restarts -n 2 --max-restarts -1 -- true
bad --max-restarts -n 2 --max-restarts many -- true
bad --max-restarts -n 2 --max-restarts 1001 -- true

# bad_host FLAG VALUE ARGS...: as bad, with a program that would leave a
# file behind: the line also names VALUE, and no rank is started.
bad_host() {
  local flag=$1 value=$2
  shift 2
  rm -f "$tmp/started"
  run "$@" -- sh -c 'touch "$0/started"' "$tmp"
  if [[ $status -ne 2 || $(wc -l <"$tmp/err") -ne 1 || -s $tmp/out ]]; then
    fail "gpipe-run $* exited $status, expected 2 and one line on stderr: $(head -c 500 "$tmp/out" "$tmp/err")"
  elif ! grep -qF -- "$flag" "$tmp/err" || ! grep -qF -- "$value" "$tmp/err"; then
    fail "gpipe-run $*: stderr does not say '$flag' and '$value': $(cat "$tmp/err")"
  elif [[ -e $tmp/started ]]; then
    fail "gpipe-run $*: a rank was started"
  else
    ok "$* -> $(cat "$tmp/err")"
  fi
}

bad_host --node-rank "'2'" -n 2 --nnodes 2 --node-rank 2 \
  --master-addr 127.0.0.1 --master-port 12345
bad_host --node-rank "'1'" -n 2 --node-rank 1
bad_host --node-rank "'-1'" -n 2 --nnodes 2 --node_rank -1 \
  --master-addr 127.0.0.1 --master-port 12345
bad_host --nnodes "'0'" -n 2 --nnodes 0
bad_host --nnodes "'two'" -n 2 --nnodes two
bad_host --master-port "--nnodes 2" -n 2 --nnodes 2 --node-rank 1 \
  --master-addr 127.0.0.1
bad_host --master-addr "--nnodes 2" -n 2 --nnodes 2 --master-port 12345
bad_host "needs --master-addr and --master-port" "--nnodes 2" -n 2 --nnodes 2

run --help
if [[ $status -ne 0 ]] || ! grep -qF -- --master-port "$tmp/out"; then
  fail "gpipe-run --help exited $status; stdout: $(head -c 500 "$tmp/out")"
elif ! grep -qE -- '--nnodes .*Default: 1$' "$tmp/out" ||
  ! grep -qE -- '--node-rank.*Default: 0$' "$tmp/out"; then
  fail "gpipe-run --help does not show --nnodes and --node-rank with their defaults: $(cat "$tmp/out")"
else
  ok "--help"
fi

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
