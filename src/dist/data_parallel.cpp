// Gradient buckets and the first replica's broadcast: see Note [Gradient
// buckets] in data_parallel.h.

#include "dist/data_parallel.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <c10/util/strides.h>
#include <gpipe/trace.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>

#include "dist/agreement.h"
#include "dist/connection.h"
#include "dist/stage_engine.h"
#include "text.h"

namespace gpipe::dist::detail {

namespace {

// `tensors` packed into groups of one dtype and device, at most `bytes`
// bytes each (the first group at most `first_bytes`) unless one tensor
// alone is larger, from the last tensor to the first.
std::vector<std::vector<torch::Tensor>> pack(
    const std::vector<torch::Tensor>& tensors,
    int64_t bytes,
    int64_t first_bytes) {
  std::vector<std::vector<torch::Tensor>> groups;
  std::vector<int64_t> sizes;
  for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {
    const auto& t = *it;
    const auto n = static_cast<int64_t>(t.numel() * t.element_size());
    const bool fits =
        !groups.empty() &&
        groups.back().front().scalar_type() == t.scalar_type() &&
        groups.back().front().device() == t.device() &&
        sizes.back() + n <= (groups.size() == 1 ? first_bytes : bytes);
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

}  // namespace

// Tells its buckets that a parameter's gradient was accumulated (an
// AccumulateGrad node's post hook).
struct GradientBuckets::Hooked {
  std::shared_ptr<torch::autograd::Node> accumulator;
  uintptr_t key = 0;
};

namespace {

template <typename F>
struct AfterAccumulation : torch::autograd::FunctionPostHook {
  explicit AfterAccumulation(F f) : f(std::move(f)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    f();
    return outputs;
  }
  F f;
};

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
  for (const auto& p : parameters) {
    if (p.requires_grad()) {
      trainable_.push_back(p);
      slot_options_.emplace_back(p.scalar_type(), p.device());
      bytes_ += static_cast<int64_t>(p.numel() * p.element_size());
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& group : pack(
           trainable_,
           bucket_bytes,
           std::min(bucket_bytes, kFirstBucketBytes))) {
    int64_t numel = 0;
    for (const auto& p : group) {
      numel += p.numel();
    }
    Bucket bucket;
    const auto n = static_cast<int64_t>(group.size());
    bucket.flat = torch::zeros({numel + n}, group.front().options());
    bucket.had = bucket.flat.narrow(0, numel, n);
    int64_t offset = 0;
    for (auto& p : group) {
      // The bucket's memory, but not an autograd view of it: the optimizer's
      // zero_grad detaches gradients in place, which a view refuses.
      bucket.slots.push_back(torch::empty({0}, bucket.flat.options())
                                 .set_(
                                     bucket.flat.storage(),
                                     offset,
                                     p.sizes(),
                                     c10::contiguous_strides(p.sizes())));
      offset += p.numel();
    }
    bucket.parameters = std::move(group);
    buckets_.push_back(std::move(bucket));
  }
  for (const auto b : c10::irange(buckets_.size())) {
    for (const auto& p : buckets_[b].parameters) {
      Hooked hooked;
      hooked.accumulator = torch::autograd::impl::grad_accumulator(p);
      auto hook = [this, b] { accumulated(b); };
      hooked.key = hooked.accumulator->add_post_hook(
          std::make_unique<AfterAccumulation<decltype(hook)>>(hook));
      hooks_.push_back(std::move(hooked));
    }
  }
}

GradientBuckets::~GradientBuckets() {
  for (auto& hooked : hooks_) {
    hooked.accumulator->del_post_hook(hooked.key);
  }
}

bool GradientBuckets::holds(
    const std::vector<torch::Tensor>& parameters) const {
  size_t k = 0;
  for (const auto& p : parameters) {
    if (p.requires_grad()) {
      // The same parameter, still of the dtype and on the device its slot
      // was made for (to(dtype) casts a parameter in place).
      if (k == trainable_.size() || !trainable_[k].is_same(p) ||
          slot_options_[k] != std::make_pair(p.scalar_type(), p.device())) {
        return false;
      }
      ++k;
    }
  }
  return k == trainable_.size();
}

int64_t GradientBuckets::layout_hash() const {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](int64_t v) {
    h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  };
  for (const auto& bucket : buckets_) {
    mix(static_cast<int64_t>(bucket.parameters.size()));
    for (const auto& p : bucket.parameters) {
      mix(p.numel());
      mix(static_cast<int64_t>(p.scalar_type()));
      mix(static_cast<int64_t>(p.device().type()));
    }
  }
  // Non-negative, so that the words' negatives are its minimum.
  return static_cast<int64_t>(h >> 2);
}

std::vector<std::string> GradientBuckets::dtype_names() const {
  std::vector<std::string> names;
  for (const auto& option : slot_options_) {
    const std::string name = c10::toString(option.first);
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(name);
    }
  }
  return names;
}

bool GradientBuckets::started() const {
  return next_ == buckets_.size() && !buckets_.empty();
}

void GradientBuckets::arm() {
  for (auto& bucket : buckets_) {
    bucket.pending = static_cast<int64_t>(bucket.parameters.size());
  }
  armed_ = true;
}

void GradientBuckets::accumulated(size_t b) {
  auto& bucket = buckets_[b];
  if (!armed_ || bucket.work || bucket.pending == 0) {
    return;
  }
  if (--bucket.pending == 0) {
    start_ready();
  }
}

void GradientBuckets::start_ready() {
  while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
    start_bucket(buckets_[next_++]);
  }
}

void GradientBuckets::start() {
  for (auto& bucket : buckets_) {
    bucket.pending = 0;
  }
  armed_ = false;
  start_ready();
}

void GradientBuckets::start_bucket(Bucket& bucket) {
  torch::NoGradGuard no_grad;
  auto& connection = *data_.connection();
  connection.check();
  if (&bucket == &buckets_.front()) {
    started_at_ = std::chrono::steady_clock::now();
    done_at_ = std::make_shared<std::atomic<int64_t>>(0);
  }
  // Each gradient lives in its slot of the bucket (as DDP's
  // gradient_as_bucket_view): backward accumulated into it in place, and
  // only a gradient made anew (the first step, or after it was set to
  // none) is written in, divided on the way. Every gradient is divided by
  // the number of replicas before the sum (Note [Gradient buckets]), as a
  // product with its reciprocal: LibTorch's CPU kernels divide element by
  // element, at about twice the time of a product.
  const auto scale = 1.0 / static_cast<double>(data_.size());
  std::vector<size_t> in_place;  // slots backward accumulated into
  bucket.missing.clear();
  for (const auto k : c10::irange(bucket.parameters.size())) {
    auto& p = bucket.parameters[k];
    auto& slot = bucket.slots[k];
    const auto& grad = p.grad();
    if (!grad.defined()) {
      bucket.missing.push_back(k);
    }
    TORCH_CHECK_TYPE(
        !grad.defined() || grad.layout() == torch::kStrided,
        "gpipe::dist: the replicas average dense gradients, but a parameter "
        "of shape ",
        p.sizes(),
        " has a ",
        grad.layout(),
        " gradient (an Embedding with sparse(true)?); give the layers of a "
        "stage with replicas dense gradients");
    if (!grad.defined()) {
      slot.zero_();
      p.mutable_grad() = slot;
    } else if (
        grad.data_ptr() != slot.data_ptr() ||
        grad.strides() != slot.strides()) {
      at::mul_out(slot, grad, scale);
      p.mutable_grad() = slot;
    } else {
      in_place.push_back(k);
    }
  }
  if (in_place.size() == bucket.parameters.size()) {
    bucket.flat.mul_(scale);
  } else {
    for (const auto k : in_place) {
      bucket.slots[k].mul_(scale);
    }
  }
  // Fills on the bucket's device, without waiting for it (a copy from host
  // memory would, on a GPU, in the middle of the backward).
  bucket.had.fill_(1);
  for (const auto k : bucket.missing) {
    bucket.had.narrow(0, static_cast<int64_t>(k), 1).fill_(0);
  }
  bucket.staged = summable_on_group_device(connection.groups, bucket.flat);
  std::vector<torch::Tensor> tensors{bucket.staged};
  bucket.work = connection.group->allreduce(tensors);
  // When the last bucket to finish ends, the all-reduce has.
  bucket.work->getFuture()->addCallback(
      [done = done_at_](c10::ivalue::Future&) {
        const auto now =
            std::chrono::steady_clock::now().time_since_epoch().count();
        auto seen = done->load();
        while (seen < now && !done->compare_exchange_weak(seen, now)) {
        }
      });
}

std::vector<int64_t> GradientBuckets::bucket_bytes() const {
  std::vector<int64_t> sizes;
  for (const auto& bucket : buckets_) {
    // The gradients' bytes, without the numbers of `had`.
    sizes.push_back(static_cast<int64_t>(
        (bucket.flat.numel() - bucket.had.numel()) *
        bucket.flat.element_size()));
  }
  return sizes;
}

void GradientBuckets::finish(Trace* trace, int64_t lane) {
  if (next_ == 0) {
    return;
  }
  torch::NoGradGuard no_grad;
  const auto started = next_;
  next_ = 0;
  armed_ = false;
  for (const auto k : c10::irange(started)) {
    auto work = std::move(buckets_[k].work);
    buckets_[k].work.reset();
    data_.connection()->wait_collective(
        work,
        "gradient all-reduce over the replicas (bucket " +
            std::to_string(k + 1) + " of " + std::to_string(buckets_.size()) +
            ")");
    auto& bucket = buckets_[k];
    if (!bucket.staged.is_same(bucket.flat)) {
      bucket.flat.copy_(bucket.staged);
    }
    bucket.staged = torch::Tensor();
    // A parameter no replica had a gradient for gets none (Note [Gradient
    // buckets]); only one this replica had none for can be such, so a
    // bucket without one is not read (on a GPU, reading waits for it).
    if (!bucket.missing.empty()) {
      const auto had = bucket.had.to(torch::kCPU, torch::kFloat);
      const auto* any = had.data_ptr<float>();
      for (const auto p : bucket.missing) {
        if (any[p] == 0.0F) {
          bucket.parameters[p].mutable_grad().reset();
        }
      }
      bucket.missing.clear();
    }
  }
  if (trace != nullptr) {
    // (The callbacks have run once the waits returned.)
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
  first_collective(
      connection,
      FirstCollective::Stage,
      {0, 0, 0, 0},
      0,
      "PipelineStage (its agreement over the replicas)");
  for (auto& group : pack(tensors, kDefaultBucketBytes, kDefaultBucketBytes)) {
    auto flat = flatten(group);
    std::vector<torch::Tensor> list{byte_view(flat)};  // any dtype
    c10d::BroadcastOptions options;
    options.rootRank = 0;
    connection.run_collective(
        list,
        [&](std::vector<torch::Tensor>& ts) {
          return connection.group->broadcast(ts, options);
        },
        "broadcast of the first replica's parameters");
    unflatten(flat, group);
  }
}

}  // namespace gpipe::dist::detail
