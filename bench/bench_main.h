#pragma once

// gpipe-bench's whole program, as its main() runs it. Apart from main() so
// that the command-line test can run it in processes forked after LibTorch's
// start-up (tests/cli_forks.cpp).

namespace gpipe::bench {

// Bad flags: one line, exit status 2, before any section runs. An error in a
// section: one line without LibTorch's backtrace, exit status 1.
int bench_program(int argc, char** argv);

}  // namespace gpipe::bench
