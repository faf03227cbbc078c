// What the replicas agree on before a training step: the first stages'
// shards and refusals (agree_to_start), and every stage's gradient buckets
// (Note [The replicas' buckets agree] in data_parallel.h).

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/torch.h>

#include <array>
#include <exception>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "dist/agreement.h"
#include "dist/connection.h"
#include "dist/data_parallel.h"
#include "text.h"

namespace gpipe::dist::detail {

std::array<int64_t, 4> bucket_words(
    const std::vector<std::unique_ptr<GradientBuckets>>& buckets,
    int64_t bucket_bytes) {
  std::array<int64_t, 4> words{bucket_bytes, 0, 0, 0};
  uint64_t h = 0;
  for (const auto& b : buckets) {
    words[1] += b->bytes();
    words[2] += b->count();
    h = h * 31 + static_cast<uint64_t>(b->layout_hash());
  }
  words[3] = static_cast<int64_t>(h >> 2);
  return words;
}

std::string dtypes_of(
    const std::vector<std::unique_ptr<GradientBuckets>>& buckets) {
  std::set<std::string> names;
  for (const auto& b : buckets) {
    for (const auto& name : b->dtype_names()) {
      names.insert(name);
    }
  }
  std::string out;
  for (const auto& name : names) {
    out += (out.empty() ? "" : ", ") + name;
  }
  return out.empty() ? "none" : out;
}

std::exception_ptr buckets_disagree(
    const std::vector<int64_t>& reduced,
    const std::array<int64_t, 4>& mine,
    const std::string& dtypes,
    int64_t replica) {
  // reduced[1 + k] is the largest of word k over the replicas, and
  // -reduced[5 + k] the smallest.
  const auto high = [&](int k) { return reduced.at(1 + k); };
  const auto low = [&](int k) { return -reduced.at(5 + k); };
  // The buckets themselves (bytes, count, layout) must agree; the size
  // asked for only explains why they do not.
  bool agree = true;
  for (int k = 1; k < 4; ++k) {
    agree = agree && high(k) == low(k);
  }
  if (agree) {
    return nullptr;
  }
  std::ostringstream ranges;
  const char* names[] = {
      "the bucket size asked for (set_gradient_bucket_bytes)",
      "the bytes all-reduced",
      "the buckets"};
  for (int k = 0; k < 3; ++k) {
    if (high(k) != low(k)) {
      ranges << (ranges.tellp() > 0 ? "; " : "") << names[k] << " from "
             << low(k) << " to " << high(k);
    }
  }
  if (high(1) == low(1) && high(2) == low(2)) {
    ranges << (ranges.tellp() > 0 ? "; " : "")
           << "their parameters' shapes, dtypes or devices, bucket by bucket";
  }
  return std::make_exception_ptr(c10::ValueError(
      c10::str(
          "gpipe::dist: the replicas of this stage would all-reduce gradient "
          "buckets of other layouts, which Gloo cannot (it would abort the "
          "process); they differ in ",
          ranges.str(),
          ". This rank (replica ",
          replica,
          ") asks for buckets of ",
          mine[0],
          " bytes and all-reduces ",
          mine[1],
          " bytes in ",
          mine[2],
          mine[2] == 1 ? " bucket" : " buckets",
          ", of parameters of dtype ",
          dtypes,
          ". Every replica must train the same parameters (frozen alike), "
          "in the same dtypes, with the same set_gradient_bucket_bytes"),
      {}));
}

std::exception_ptr agree_to_start(
    const World& data,
    int64_t pass,
    int64_t rows,
    const std::exception_ptr& mine,
    const std::vector<std::unique_ptr<GradientBuckets>>& buckets,
    int64_t bucket_bytes) {
  auto& connection = *data.connection();
  const auto replicas = data.size();
  const auto here = data.rank();
  // The step's first collective over the replicas has the words every
  // operation on a World's group begins with, so that a collective of the
  // user's there at once is refused, not an abort (Note [The first
  // collective's words]). Only the first stages agree here; the other
  // stages begin the same words as their pass begins and read them before
  // their first bucket starts (or at the step's end), where a rank that
  // lost its peer in another replica hears that peer's name from its
  // pipeline (failed_over_replicas). The words carry the buckets' layout
  // (Note [The replicas' buckets agree]).
  const auto words = bucket_words(buckets, bucket_bytes);
  const auto reduced = first_collective(
      connection,
      FirstCollective::TrainStep,
      words,
      0,
      "train_step's start over the replicas");
  // A refusal's words go through the store, read by the others only when
  // one refused (set before the all-reduce below, so there once it ends).
  const auto key = [&](int64_t replica) {
    return "refusal/" + std::to_string(pass) + "/" + std::to_string(replica);
  };
  if (mine) {
    const auto why = message_of(mine);
    connection.store->set(
        key(here), std::vector<uint8_t>(why.begin(), why.end()));
  }
  // A replica's slot: its rows (at least 1), or -1 - the kind of its error.
  auto slots = torch::zeros({replicas}, torch::kLong);
  slots[here] = mine ? -1 - refusal_kind_of(mine) : rows;
  // On the CPU: run_collective stages it where the group needs it.
  std::vector<torch::Tensor> list{slots};
  data.connection()->all_reduce(
      list,
      c10d::ReduceOp::SUM,
      "agreement of the replicas' first stages before a training step");
  const auto all = list[0].cpu();
  const auto* slot = all.data_ptr<int64_t>();
  if (mine) {
    return mine;
  }
  for (const auto k : c10::irange(replicas)) {
    if (slot[k] < 0) {
      const auto why = connection.store->get(key(k));
      return refusal_error(
          -1 - slot[k],
          c10::str(
              "gpipe::dist: the first stage of replica ",
              k,
              " (",
              connection.rank_name(k),
              ") refused this training step before it began (",
              std::string(why.begin(), why.end()),
              "), so every replica refuses it: nothing ran, and the stage "
              "stays usable"));
    }
  }
  if (auto differ =
          buckets_disagree(reduced, words, dtypes_of(buckets), here)) {
    return differ;
  }
  bool equal = true;
  std::ostringstream sizes;
  for (const auto k : c10::irange(replicas)) {
    equal = equal && slot[k] == slot[0];
    sizes << (k > 0 ? ", " : "") << slot[k];
  }
  if (!equal) {
    return std::make_exception_ptr(c10::ValueError(
        c10::str(
            "gpipe::dist: the replicas' shards differ in rows (",
            sizes.str(),
            ", by replica; this is replica ",
            here,
            "), but their gradients are averaged with equal weights, which "
            "would weigh a row of a smaller shard more than one of a larger: "
            "give every replica the same rows (drop the last, smaller batch, "
            "or cut the batch into equal shards). Nothing ran, and the stage "
            "stays usable"),
        {}));
  }
  return nullptr;
}

}  // namespace gpipe::dist::detail
