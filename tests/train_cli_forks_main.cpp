// cli_forks's program: gpipe-train's (Note [Forked command-line runs] in
// tests/cli_forks.cpp).

#include "cli_forks.h"
#include "train_main.h"

int program_main(int argc, char** argv) {
  return gpipe_train::train_main(argc, argv);
}
