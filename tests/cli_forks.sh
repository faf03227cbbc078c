# Sourced by the command-line tests (train_cli_test.sh, bench_cli_test.sh):
# runs a program through tests/cli_forks.cpp, in a process forked after
# LibTorch's start-up (Note [Forked command-line runs] there).
#
#   forks_start FORKS PROGRAM   starts FORKS for PROGRAM (a coprocess)
#   forks_run OUT ERR ARGS...   runs PROGRAM ARGS with this shell's
#                               environment, its output in OUT and ERR;
#                               leaves its exit status in $status

forks_start() {
  coproc FORKS { exec "$1" "$2"; }
}

forks_run() {
  local out=$1 err=$2
  shift 2
  local -a environment
  mapfile -d '' -t environment < <(env -0)
  printf '%s\0' "$out" "$err" "${#environment[@]}" "${environment[@]}" \
    "$#" "$@" >&"${FORKS[1]}"
  if ! read -r status <&"${FORKS[0]}"; then
    status=255
    echo "the forked run of $* got no answer" >>"$err"
  fi
}
