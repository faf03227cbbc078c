#pragma once

// What the ranks of a pipeline must agree on, and how they check it: the
// model and options when they build their stages (through the store), and
// each pass's kind, schedule, mode, micro-batch sizes and seed (rank 0's
// begin message). A difference is an error naming both sides.

#include <gpipe/options.h>
#include <gpipe/schedule.h>
#include <gpipe/skip.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dist/connection.h"

namespace gpipe {
struct Plan;
}  // namespace gpipe

namespace gpipe::dist::detail {

enum class PassKind : int64_t { Forward = 0, Train = 1 };

/// Begin::schedule of a training step that runs a plan given by the caller.
constexpr int64_t kPlanSchedule = -1;

/// What rank 0 tells the others when it starts a pass.
struct Begin {
  PassKind kind = PassKind::Forward;
  int64_t schedule = 0;
  int64_t checkpoint_stop = 0;
  bool training = false;
  uint64_t seed = 0;
  uint64_t plan_hash = 0;  // with schedule == kPlanSchedule
  // The plan's own text (plan_identity), which plan_hash hashes: not sent.
  // Rank 0 leaves it in the store once per plan, so that a rank whose
  // plan differs can say where (Note [Telling two plans apart]).
  std::string plan_text;
  // The rank's options (alike on every rank: checked, with their names,
  // before checkpoint_stop, which follows from them).
  int64_t chunks = 0;
  int64_t checkpoint = 0;      // a gpipe::Checkpoint
  std::vector<int64_t> sizes;  // rows of each micro-batch
  // Not empty: rank 0 refused the pass before it began (refuse_pass), with
  // this message and this kind of c10::Error (kRefusal*).
  std::string refusal;
  int64_t refusal_kind = 0;

  static constexpr int64_t kRefused = -1;  // in the kind's word

  torch::Tensor encode() const {
    if (!refusal.empty()) {
      std::vector<int64_t> words{kRefused, refusal_kind, 0, 0, 0, 0};
      words.insert(words.end(), refusal.begin(), refusal.end());
      return torch::tensor(words, torch::kLong);
    }
    std::vector<int64_t> words{
        static_cast<int64_t>(kind),
        schedule,
        checkpoint_stop,
        training ? 1 : 0,
        0,
        0,
        chunks,
        checkpoint};
    std::memcpy(&words[4], &seed, sizeof(seed));
    std::memcpy(&words[5], &plan_hash, sizeof(plan_hash));
    words.insert(words.end(), sizes.begin(), sizes.end());
    return torch::tensor(words, torch::kLong);
  }
  static Begin decode(const torch::Tensor& t) {
    TORCH_CHECK(
        t.defined() && t.scalar_type() == torch::kLong && t.dim() == 1 &&
            t.numel() >= 7,
        "gpipe::dist: a malformed begin message came from rank 0");
    auto w = t.contiguous();
    const auto* p = w.data_ptr<int64_t>();
    Begin b;
    if (p[0] == kRefused) {
      b.refusal_kind = p[1];
      for (int64_t k = 6; k < w.numel(); ++k) {
        b.refusal.push_back(static_cast<char>(p[k]));
      }
      return b;
    }
    b.kind = static_cast<PassKind>(p[0]);
    b.schedule = p[1];
    b.checkpoint_stop = p[2];
    b.training = p[3] != 0;
    std::memcpy(&b.seed, &p[4], sizeof(b.seed));
    std::memcpy(&b.plan_hash, &p[5], sizeof(b.plan_hash));
    TORCH_CHECK(
        w.numel() >= 9,
        "gpipe::dist: a malformed begin message came from rank 0");
    b.chunks = p[6];
    b.checkpoint = p[7];
    b.sizes.assign(p + 8, p + w.numel());
    return b;
  }
};

inline const char* kind_name(PassKind kind) {
  return kind == PassKind::Train ? "train_step" : "forward";
}

/// What tells a plan apart from another, as text: its micro-batches and
/// stages on the first line, then its CSV (placement and actions).
std::string plan_identity(const gpipe::Plan& plan);

/// Where two plan_identity texts first differ, as "the plans first differ
/// at ...", naming `here` and `there` as the sides (e.g. "rank 1" and
/// "rank 0"); "" when they are the same.
std::string plan_difference(
    const std::string& mine,
    const std::string& theirs,
    const std::string& here,
    const std::string& there);

/// Rank 0: leaves `local.plan_text` in the store under its hash, for
/// plans_differ (Note [Telling two plans apart]), and takes back the plan
/// it left before (hash `previous`; 0: none). Once per plan.
void publish_plan(
    Connection& connection, const Begin& local, uint64_t previous);

/// Where this rank's plan differs from rank 0's (`theirs.plan_hash`), as
/// plan_difference says it, or "" when rank 0's plan is not in the store.
/// Never waits, never throws.
std::string plans_differ(
    Connection& connection, const Begin& local, const Begin& theirs);

/// What a training step runs: "schedule 1f1b", "a plan (hashed to N)".
inline std::string step_name(int64_t s, uint64_t plan_hash) {
  if (s == kPlanSchedule) {
    return "a plan (hashed to " + std::to_string(plan_hash) + ")";
  }
  const auto name =
      s >= 0 ? gpipe::to_string(static_cast<gpipe::Schedule>(s)) : "unknown";
  return "schedule " + (name == "unknown" ? std::to_string(s) : name);
}

/// A skip by where it is in the model: the layers (indices in the whole
/// Sequential) that stash and pop it, and its name. The same on every rank,
/// whatever order each rank made its namespaces in.
struct SkipPlace {
  int64_t stash_layer = 0;
  int64_t pop_layer = 0;
  std::string name;
  gpipe::SkipKey key;  // this rank's own key (its namespace's id)

  bool operator<(const SkipPlace& other) const {
    return std::tie(stash_layer, pop_layer, name) <
           std::tie(other.stash_layer, other.pop_layer, other.name);
  }
};

/// What a PipelineStage checks of its model and options before anything
/// is built (the checks GPipe makes, and those of a pipeline over `ranks`
/// ranks); a c10::Error naming what is wrong.
void verify_stage_options(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    int64_t ranks);

/// Every skip of `module` (verified), ordered by place.
std::vector<SkipPlace> skips_by_place(const torch::nn::Sequential& module);

/// What every rank must agree on at construction, field by field.
std::vector<std::pair<std::string, std::string>> fingerprint(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    int64_t world_size);

/// What the fingerprint's "layers" and "parameters and buffers" hash, in
/// full: each layer's name and type, each tensor's name, shape and dtype,
/// entries joined by "; ". Read only when a hash differs, so that the
/// error names the first layer or tensor that differs.
std::vector<std::pair<std::string, std::string>> fingerprint_details(
    const torch::nn::Sequential& module);

/// Of two "; "-joined lists, the first entries that differ, each quoted
/// with its place ("'3: torch::nn::Tanh' (entry 4 of 7)"); "nothing" past
/// a list's end.
std::pair<std::string, std::string> first_difference(
    const std::string& mine, const std::string& theirs);

/// Publishes this rank's fields under `prefix` in the store (and its
/// `details` beside them) and compares them with every other rank's;
/// throws naming the first difference (from the details where a field has
/// them), or the other rank's own error.
void agree_on_build(
    Connection& connection,
    const std::string& prefix,
    const std::vector<std::pair<std::string, std::string>>& mine,
    const std::vector<std::pair<std::string, std::string>>& details = {});

/// Publishes why this rank could not build its stage, so that the others
/// fail at once with it.
void publish_build_error(
    Connection& connection, const std::string& prefix, const std::string& why);

/// The kind of c10::Error `error` is (ValueError, TypeError, IndexError or
/// plain Error), as a number a message can carry; refusal_error makes an
/// error of that kind again.
int64_t refusal_kind_of(const std::exception_ptr& error);
std::exception_ptr refusal_error(int64_t kind, std::string message);

/// Rank 0 refuses pass `pass` before it begins (its own input or arguments
/// are wrong: `error`, a c10::Error): the others get a begin message that
/// says so and refuse it too, and every rank throws an AgreedRefusal
/// (collective_pass.h), so that the connection stays open. Only where the
/// pass involves no other replica (their all-reduce would wait).
[[noreturn]] void refuse_pass(
    detail::Connection& connection,
    int64_t pass,
    const std::exception_ptr& error,
    std::vector<c10::intrusive_ptr<c10d::Work>>& sends);

/// Rank 0 starts a pass; the others learn what it is and check it against
/// what they were asked to run (`local`), failing with both sides named.
/// Rank 0's sends go into `sends`, to be waited for at the end of the pass
/// (a send completes only when its receiver takes it).
Begin begin_pass(
    Connection& connection,
    int64_t pass,
    Begin local,
    const std::vector<int64_t>& sizes,
    std::vector<c10::intrusive_ptr<c10d::Work>>& sends);

}  // namespace gpipe::dist::detail
