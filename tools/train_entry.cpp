// gpipe-train's entry point: the program is gpipe_train::train_main
// (tools/train.cpp).

#include "train_main.h"

int main(int argc, char** argv) {
  return gpipe_train::train_main(argc, argv);
}
