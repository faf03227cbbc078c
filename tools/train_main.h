#pragma once

// gpipe-train's whole program, as its main() runs it. Apart from main() so
// that the command-line test can run it in processes forked after LibTorch's
// start-up (tests/cli_forks.cpp).

namespace gpipe_train {

// Exit status: 0 after training (or --help), 2 for a bad command line (one
// line on stderr naming the flag), 1 when the run itself fails.
int train_main(int argc, char** argv);

}  // namespace gpipe_train
