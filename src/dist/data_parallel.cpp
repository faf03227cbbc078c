// Gradient buckets and the first replica's broadcast: see Note [Gradient
// buckets] in data_parallel.h.

#include "dist/data_parallel.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/trace.h>
#include <torch/torch.h>

#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <utility>

#include "dist/connection.h"

namespace gpipe::dist::detail {

namespace {

// `tensors` packed into groups of one dtype and device, at most `bytes`
// bytes each unless one tensor alone is larger, from the last tensor to the
// first.
std::vector<std::vector<torch::Tensor>> pack(
    const std::vector<torch::Tensor>& tensors, int64_t bytes) {
  std::vector<std::vector<torch::Tensor>> groups;
  std::vector<int64_t> sizes;
  for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {
    const auto& t = *it;
    const auto n = static_cast<int64_t>(t.numel() * t.element_size());
    const bool fits = !groups.empty() &&
                      groups.back().front().scalar_type() == t.scalar_type() &&
                      groups.back().front().device() == t.device() &&
                      sizes.back() + n <= bytes;
    if (!fits) {
      groups.emplace_back();
      sizes.push_back(0);
    }
    groups.back().push_back(t);
    sizes.back() += n;
  }
  return groups;
}

torch::Tensor flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) {
    views.push_back(t.reshape({-1}));
  }
  return torch::cat(views);
}

// Copies the pieces of `flat` back into `tensors`, in the order flatten()
// read them.
void unflatten(
    const torch::Tensor& flat, const std::vector<torch::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const auto n = t.numel();
    t.copy_(flat.narrow(0, offset, n).view_as(t));
    offset += n;
  }
}

void wait_for(
    const World& data,
    const c10::intrusive_ptr<c10d::Work>& work,
    const std::string& what) {
  try {
    work->wait(data.timeout());
  } catch (const c10::Error& e) {
    TORCH_CHECK(
        false,
        "gpipe::dist: the ",
        what,
        " over the replicas failed on data rank ",
        data.rank(),
        " of ",
        data.size(),
        " [c10d: ",
        std::string(e.what_without_backtrace()).substr(0, 300),
        "]");
  }
}

}  // namespace

GradientBuckets::GradientBuckets(
    World data,
    const std::vector<torch::Tensor>& parameters,
    int64_t bucket_bytes)
    : data_(std::move(data)) {
  TORCH_CHECK_VALUE(
      bucket_bytes > 0,
      "the gradient bucket size must be positive, but got ",
      bucket_bytes,
      " bytes");
  std::vector<torch::Tensor> trainable;
  for (const auto& p : parameters) {
    if (p.requires_grad()) {
      trainable.push_back(p);
      bytes_ += static_cast<int64_t>(p.numel() * p.element_size());
    }
  }
  for (auto& group : pack(trainable, bucket_bytes)) {
    buckets_.push_back(Bucket{std::move(group), torch::Tensor()});
  }
}

void GradientBuckets::start() {
  TORCH_INTERNAL_ASSERT(works_.empty(), "gradient buckets started twice");
  torch::NoGradGuard no_grad;
  auto& connection = *data_.connection();
  connection.check();
  started_at_ = std::chrono::steady_clock::now();
  done_at_ = std::make_shared<std::atomic<int64_t>>(0);
  for (auto& bucket : buckets_) {
    std::vector<torch::Tensor> grads;
    grads.reserve(bucket.parameters.size());
    for (auto& p : bucket.parameters) {
      if (!p.grad().defined()) {
        p.mutable_grad() = torch::zeros_like(p);
      }
      grads.push_back(p.grad());
    }
    bucket.flat = flatten(grads);
    std::vector<torch::Tensor> tensors{bucket.flat};
    works_.push_back(connection.group->allreduce(tensors));
  }
  if (!works_.empty()) {
    // Buckets run in order: the last one's end is the all-reduce's.
    works_.back()->getFuture()->addCallback([done = done_at_](
                                                c10::ivalue::Future&) {
      done->store(std::chrono::steady_clock::now().time_since_epoch().count());
    });
  }
}

void GradientBuckets::finish(Trace* trace, int64_t lane) {
  if (works_.empty()) {
    return;
  }
  auto works = std::move(works_);
  works_.clear();
  torch::NoGradGuard no_grad;
  const auto replicas = static_cast<double>(data_.size());
  for (const auto k : c10::irange(buckets_.size())) {
    auto& bucket = buckets_[k];
    wait_for(
        data_,
        works[k],
        "gradient all-reduce of bucket " + std::to_string(k) + " of " +
            std::to_string(buckets_.size()));
    bucket.flat.div_(replicas);
    std::vector<torch::Tensor> grads;
    grads.reserve(bucket.parameters.size());
    for (auto& p : bucket.parameters) {
      grads.push_back(p.grad());
    }
    unflatten(bucket.flat, grads);
    bucket.flat = torch::Tensor();
  }
  if (trace != nullptr) {
    // (The callback has run once the wait returned.)
    const auto ticks = done_at_->load();
    const auto end = ticks > 0 ? std::chrono::steady_clock::time_point(
                                     std::chrono::steady_clock::duration(ticks))
                               : std::chrono::steady_clock::now();
    trace->record(lane, 0, TraceKind::AllReduce, started_at_, end);
  }
}

void broadcast_from_first_replica(
    const World& data, const std::vector<torch::Tensor>& tensors) {
  if (data.size() <= 1) {
    return;
  }
  torch::NoGradGuard no_grad;
  auto& connection = *data.connection();
  for (auto& group : pack(tensors, kDefaultBucketBytes)) {
    auto flat = flatten(group);
    std::vector<torch::Tensor> list{flat};
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    wait_for(data, connection.group->broadcast(list, options), "broadcast");
    unflatten(flat, group);
  }
}

}  // namespace gpipe::dist::detail
