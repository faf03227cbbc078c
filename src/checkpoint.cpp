#include <gpipe/checkpoint.h>

namespace gpipe {

namespace {
thread_local bool checkpointing = false;
thread_local bool recomputing = false;
}  // namespace

bool is_checkpointing() {
  return checkpointing;
}

bool is_recomputing() {
  return recomputing;
}

namespace detail {

CheckpointingGuard::CheckpointingGuard() : previous_(checkpointing) {
  checkpointing = true;
}

CheckpointingGuard::~CheckpointingGuard() {
  checkpointing = previous_;
}

RecomputingGuard::RecomputingGuard() : previous_(recomputing) {
  recomputing = true;
}

RecomputingGuard::~RecomputingGuard() {
  recomputing = previous_;
}

}  // namespace detail
}  // namespace gpipe
