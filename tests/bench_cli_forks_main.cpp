// cli_forks's program: gpipe-bench's (Note [Forked command-line runs] in
// tests/cli_forks.cpp).

#include "bench_main.h"
#include "cli_forks.h"

int program_main(int argc, char** argv) {
  return gpipe::bench::bench_program(argc, argv);
}
