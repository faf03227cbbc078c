#pragma once

// The program tests/cli_forks.cpp runs in its children: gpipe-train's
// (train_cli_forks_main.cpp) or gpipe-bench's (bench_cli_forks_main.cpp).
int program_main(int argc, char** argv);
