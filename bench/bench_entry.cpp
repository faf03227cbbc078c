// gpipe-bench's entry point: the program is gpipe::bench::bench_program
// (bench/bench.cpp).

#include "bench_main.h"

int main(int argc, char** argv) {
  return gpipe::bench::bench_program(argc, argv);
}
