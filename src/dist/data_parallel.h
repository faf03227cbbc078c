#pragma once

// Data parallelism across pipeline replicas: the gradients of the ranks that
// hold the same stage are averaged, bucket by bucket, over their data World
// (Mesh::data()).
//
// Note [Gradient buckets]
// As DDP does, gradients are packed into flat buckets of about
// `bucket_bytes` (25 MiB by default), filled from the last parameter to the
// first (the order in which backward makes them final), the first bucket
// of all at most 1 MiB (so that the all-reduce starts early in the last
// backward), one dtype and device per bucket; each bucket is one
// all-reduce of its sum. Each `.grad` shares the memory of its slot in a
// bucket (as DDP's gradient_as_bucket_view, but not as an autograd view,
// which the optimizer's zero_grad could not detach), so that backward
// accumulates straight into the bucket and nothing is copied in or out; a
// gradient made anew (the first step, or after it was set to none, as
// LibTorch 2's zero_grad does by default) is written into its slot once and
// replaced by the slot. A bucket's gradients are divided by the number of
// replicas as it starts, so that the sum is their average: a gradient made
// anew is divided on its way into its slot, in the one pass that copies it,
// where dividing after the all-reduce would cost a second. Every replica
// divides before its sum, whatever its gradients were. The buckets are kept
// while the same parameters train (made again when one is frozen or thawed).
// During a stage's last backward of the step (its last B or W), each bucket
// starts as soon as every gradient in it has been accumulated (a post hook on
// each parameter's gradient accumulator counts them), in bucket order; whatever
// has not started when that backward ends starts then. The all-reduces run on
// c10d's threads while the lanes go on; the step waits for them before it
// returns. Every replica runs the same plan, so the ranks of a data World start
// their buckets in the same order, as a collective needs. Each bucket is one
// all-reduce even when several are ready at once: which ones are depends on
// the timing and on the parameters a replica's data used, and joining them
// would give the replicas collectives of other sizes. A parameter
// without a gradient (a layer the step did not use) takes part with zeros,
// so that the replicas agree on every bucket's layout. Each bucket also
// carries, after its gradients, one number per parameter: whether this
// replica had its gradient. A parameter that no replica had a gradient for
// gets none afterwards, as one pipeline on the whole batch leaves it (not
// zeros, which weight decay and Adam's steps would read); one
// that some replica had gets the average with the others' zeros, as the
// whole batch's mean.

#include <c10/util/intrusive_ptr.h>
#include <gpipe/dist.h>
#include <torch/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class Work;
}  // namespace c10d

namespace gpipe {
class Trace;
}  // namespace gpipe

namespace gpipe::dist::detail {

constexpr int64_t kDefaultBucketBytes = 25 * 1024 * 1024;
// The first bucket (the last layers') holds at most this much, as DDP's
// does, so that the all-reduce starts early in the last backward.
constexpr int64_t kFirstBucketBytes = 1024 * 1024;

/// The gradient all-reduce of one stage's parameters over `data`.
class GradientBuckets {
 public:
  /// `parameters` in layer order; those that do not require grad are left
  /// out. Hooks on their gradient accumulators (removed by the destructor)
  /// tell which bucket is ready while the stage's last backward runs.
  GradientBuckets(
      World data,
      const std::vector<torch::Tensor>& parameters,
      int64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  /// The stage's last backward of the step (its last B or W) is about to
  /// run: a bucket whose every gradient is accumulated during it is final,
  /// and starts then (in bucket order).
  void arm();
  /// The stage's gradients are final: starts every bucket not started yet.
  void start();
  /// Waits for the buckets started (the gradients are then averaged).
  /// Throws a c10::Error naming the bucket if an all-reduce fails. With a
  /// trace, records the all-reduce on `lane`: from its first bucket's start
  /// to its last bucket's end.
  void finish(Trace* trace = nullptr, int64_t lane = 0);
  /// Whether every bucket has started since the last finish().
  bool started() const;
  /// Bytes all-reduced per step.
  int64_t bytes() const {
    return bytes_;
  }
  /// Each bucket's bytes, in the order the buckets start.
  std::vector<int64_t> bucket_bytes() const;
  /// Whether these buckets are made for `parameters` as they are now (the
  /// same ones requiring grad, in the same order).
  bool holds(const std::vector<torch::Tensor>& parameters) const;
  /// How many buckets, and a hash of their layout: each one's elements,
  /// dtype and device type, in order.
  int64_t count() const {
    return static_cast<int64_t>(buckets_.size());
  }
  int64_t layout_hash() const;
  /// The names of the trainable parameters' dtypes ("Double", "Half").
  std::vector<std::string> dtype_names() const;

 private:
  struct Bucket {
    std::vector<torch::Tensor> parameters;
    std::vector<torch::Tensor> slots;  // each parameter's part of `flat`
    torch::Tensor flat;
    // `flat`'s last part: per parameter, whether a replica had its gradient
    // (summed by the all-reduce).
    torch::Tensor had;
    // The parameters this replica had no gradient for when the bucket
    // started.
    std::vector<size_t> missing;
    // `flat` where the group reduces it (itself unless the group's device
    // is another: CPU stages on NCCL), while the all-reduce runs.
    torch::Tensor staged;
    int64_t pending = 0;  // gradients not yet accumulated while armed
    c10::intrusive_ptr<c10d::Work> work;  // null until started
  };
  struct Hooked;
  // Called by the hook of bucket `b`'s parameter after its accumulation.
  void accumulated(size_t b);
  // Starts the buckets that are ready, in order.
  void start_ready();
  void start_bucket(Bucket& bucket);

  std::vector<torch::Tensor> trainable_;
  // Each trainable parameter's dtype and device when the buckets were made.
  std::vector<std::pair<c10::ScalarType, c10::Device>> slot_options_;
  World data_;
  std::vector<Bucket> buckets_;
  std::vector<Hooked> hooks_;
  bool armed_ = false;
  size_t next_ = 0;  // the next bucket to start
  int64_t bytes_ = 0;
  std::chrono::steady_clock::time_point started_at_;
  // When the last bucket's all-reduce ended (set on c10d's thread), in
  // steady_clock ticks.
  std::shared_ptr<std::atomic<int64_t>> done_at_;
};

/// Note [The replicas' buckets agree]
/// A bucket's all-reduce whose replicas hold other sizes or dtypes aborts
/// the process inside Gloo (a message longer than the buffer posted for
/// it): replicas whose set_gradient_bucket_bytes differ, one replica frozen
/// or cast to another dtype. So the first collective of each training step
/// over a data World (agree_to_start on the first stages, the step's start
/// words on the others: Note [The first collective's words]) carries these
/// four numbers, and every replica checks them alike before any bucket
/// starts (on a later stage, unless the words are late: a lane does not wait
/// for them, and they are read at the step's end): the bucket size asked for
/// (named in the message only), the bytes all-reduced, the buckets and a hash
/// of their layout (each parameter's elements, dtype and device type), over all
/// of a rank's stages.
std::array<int64_t, 4> bucket_words(
    const std::vector<std::unique_ptr<GradientBuckets>>& buckets,
    int64_t bucket_bytes);
/// Null where the replicas' words (first_collective's result: `reduced`)
/// agree; else the c10::ValueError every replica of the stage meets alike,
/// naming the ranges over the replicas and this rank's own (`mine`,
/// `dtypes`, on data rank `replica`).
std::exception_ptr buckets_disagree(
    const std::vector<int64_t>& reduced,
    const std::array<int64_t, 4>& mine,
    const std::string& dtypes,
    int64_t replica);
/// The dtypes of `buckets`' parameters (GradientBuckets::dtypes over all).
std::string dtypes_of(
    const std::vector<std::unique_ptr<GradientBuckets>>& buckets);

/// Copies data rank 0's `tensors` (parameters and buffers) into every
/// replica's, bucket by bucket, so that the replicas start equal.
void broadcast_from_first_replica(
    const World& data, const std::vector<torch::Tensor>& tensors);

/// Before a training step begins, the first stages of the replicas (`data`,
/// the data World of pipeline rank 0) agree that every one of them can run
/// it: each gives its shard's rows, or `mine`, the error its own arguments
/// met. Returns the error every replica refuses the step with alike (this
/// replica's own, the news that another refused it, or shards of
/// different sizes, which an average with equal weights would weigh
/// wrongly), or null when the step may begin. One all-reduce of D numbers
/// (`pass`: the step's number, the same on every replica); a refusal's
/// words go through the store.
std::exception_ptr agree_to_start(
    const World& data,
    int64_t pass,
    int64_t rows,
    const std::exception_ptr& mine,
    const std::vector<std::unique_ptr<GradientBuckets>>& buckets,
    int64_t bucket_bytes);

}  // namespace gpipe::dist::detail
