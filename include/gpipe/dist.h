#pragma once

// gpipe::dist: pipeline stages in separate processes and hosts, over
// PyTorch's own distributed engine (c10d: a TCPStore to meet, Gloo or NCCL
// to talk, as GPIPE_DIST_BACKEND says; docs/guide.md, "Backends").
//
// Every process builds the same Sequential and the same GPipeOptions; rank r
// keeps partition r (and r + size, r + 2 size, ... with stages_per_lane > 1)
// and runs its cells, and activations, gradients and skips travel between
// ranks. Results equal the single-process GPipe's with the
// same balance, chunks, checkpoint mode and seed.
//
// ```
// auto world = gpipe::dist::init_from_env();  // torchrun's or gpipe-run's
// gpipe::dist::PipelineStage stage(net, gpipe::GPipeOptions({4, 4}).chunks(8),
//                                  world);
// torch::optim::SGD opt(stage->parameters(), 0.1);  // this rank's partition
// auto loss = stage->train_step(x, y, loss_fn, gpipe::Schedule::OneFOneB);
// opt.step();
// ```

#include <c10/util/intrusive_ptr.h>
#include <gpipe/checkpoint_io.h>
#include <gpipe/options.h>
#include <gpipe/schedule.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace gpipe {
class Trace;
struct Plan;
}  // namespace gpipe

namespace gpipe::dist {

namespace detail {
struct Connection;
}  // namespace detail

/// Whether this build of gpipe has gpipe::dist: false when it was built
/// with -DGPIPE_DIST=OFF or against a LibTorch without c10d, where every
/// init_* throws a c10::Error saying so.
bool is_available();

/// The processes of one job and the c10d group they talk over. Copies share
/// one connection; the last copy to go closes it. After a failure its
/// group (threads, sockets, and on rank 0 the store's port) is kept until
/// the process exits: Gloo may still write into a receive it posted.
class World {
 public:
  explicit World(std::shared_ptr<detail::Connection> connection);
  ~World();

  /// This process's rank, 0 <= rank() < size().
  int64_t rank() const;
  /// Number of processes.
  int64_t size() const;
  /// This process's rank on its host (it picks cuda:<local_rank>).
  int64_t local_rank() const;
  /// Number of processes on this host.
  int64_t local_size() const;
  /// How long a rank waits for another before it gives up.
  std::chrono::milliseconds timeout() const;
  /// The c10d process group of this World's ranks (Gloo or NCCL, as
  /// GPIPE_DIST_BACKEND says; null in a World of one rank that
  /// World::split or a Mesh made); usable for
  /// collectives of one's own between passes. On Gloo gpipe's messages go
  /// over it too (point-to-point: tags from 2^30 up are yours); NCCL's
  /// tensors live on the rank's GPU.
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const;
  /// The rendezvous store.
  const c10::intrusive_ptr<c10d::Store>& store() const;

  /// Collective over this World: a World of the ranks that passed the same
  /// `color`, ranked by `key` (ties by rank here), as c10d::new_group and
  /// MLX's group split. Every rank of this World calls it, in the same order
  /// as its other splits; each new World has a c10d group, a store prefix
  /// and a failure channel of its own. local_rank() and local_size() stay
  /// this World's (they describe the host, not the group). A negative color
  /// is a c10::ValueError.
  World split(int64_t color, int64_t key) const;

  /// Collectives of one's own between passes, over this World's group; each
  /// waits at most timeout() and throws a c10::Error naming the operation
  /// and this rank. `tensor` is dense and contiguous, the same shape and
  /// dtype on every rank, on any device (it is copied to the backend's
  /// device and back where that is another). all_reduce and broadcast
  /// first agree on what they are and on the tensor's size and dtype (a
  /// collective of eleven numbers, which barrier, split, Mesh's and
  /// PipelineStage's constructors and, on a replica's first stage, a
  /// training step with replicas begin with too): where they differ, or a
  /// rank runs another of these at once, every rank throws a
  /// c10::ValueError. On each rank these (and split) run one at a time:
  /// calls from several threads are paired across ranks in the order each
  /// rank runs them, so give them an order, or each thread a World of its
  /// own (split). Any dtype is broadcast; all_reduce sums real numbers
  /// (int16 and, on Gloo, bfloat16 in a wider dtype, rounded back once).
  /// Sums `tensor` over the ranks, in place.
  void all_reduce(torch::Tensor& tensor) const;
  /// Copies rank `root`'s `tensor` into every rank's, in place.
  void broadcast(torch::Tensor& tensor, int64_t root) const;
  /// Returns when every rank has called it.
  void barrier() const;

  /// The shared connection (for gpipe's own use).
  const std::shared_ptr<detail::Connection>& connection() const {
    return connection_;
  }

 private:
  std::shared_ptr<detail::Connection> connection_;
};

/// Joins the job described by the environment, as torchrun and gpipe-run
/// set it: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (and
/// LOCAL_WORLD_SIZE when set). Rank 0 hosts the TCPStore unless torchrun's
/// agent hosts it (TORCHELASTIC_USE_AGENT_STORE=True). Waits at most
/// `timeout` (at least 1 s) for the others, also when the port answers
/// nothing; ranks with another WORLD_SIZE than the first to come, or a
/// RANK that came twice, end every rank at once, saying so. A missing or
/// malformed variable is a c10::ValueError naming it. Like init_from_store, it
/// sets SIGPIPE to be ignored unless the program has a handler of its own, so
/// that a write to a rank that died fails with an error naming it instead of
/// ending this process without a word. The backend is GPIPE_DIST_BACKEND's
/// ("gloo", the default, or "nccl" where the build has it); one this build
/// lacks is a c10::ValueError before anything waits. Rank 0's store outlives
/// its World, serving the other ranks' last calls, until this process's
/// next World has met (or one is made on its port); a job made again by the
/// same processes should take another MASTER_PORT (a rank that comes before
/// rank 0 may meet the old store, and both then fail within the timeout).
World init_from_env(std::chrono::milliseconds timeout);
/// As above, with the timeout from GPIPE_DIST_TIMEOUT (seconds, in [1,
/// 604800]; default 120).
World init_from_env();

/// Joins a job whose ranks meet in `store` (any c10d store: a TCPStore of
/// one's own, or a HashStore shared by threads of one process), as rank
/// `rank` of `size`, on GPIPE_DIST_BACKEND's backend. Gloo ranks talk over
/// GLOO_SOCKET_IFNAME when it is set, else over loopback when MASTER_ADDR
/// is unset or local, else over this host's interface. local_rank() is
/// `rank` and local_size() is `size`. A store may serve several Worlds one
/// after another (a job that makes its World again after an error): each
/// rank's nth World on it meets the other ranks' nth, so every rank makes
/// them in the same order, as with c10d's new_group (a rank that never
/// called, or whose call was refused before it joined, leaves the counts
/// apart: the next World then needs a store of its own).
World init_from_store(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    std::chrono::milliseconds timeout = std::chrono::seconds(120));

/// The timeout GPIPE_DIST_TIMEOUT asks for (seconds in [1, 604800], digits
/// with an optional fraction such as 2.5; default 120 when unset). A
/// c10::ValueError for any other text, an empty one included.
std::chrono::milliseconds default_timeout();

/// Pipeline x data parallelism over one World: `data_size()` replicas of a
/// pipeline of `pipeline_size` stages. A replica's stages are neighbours:
/// global rank = data_rank * pipeline_size + pipeline_rank. pipeline() is
/// the World of this rank's replica (its stages), data() the World of the
/// ranks that hold the same stage in every replica (where gradients are
/// averaged). Collective: every rank of `world` builds it, in the same
/// order as its other splits.
class Mesh {
 public:
  /// `world.size()` must be a multiple of `pipeline_size` (else a
  /// c10::ValueError naming both).
  Mesh(World world, int64_t pipeline_size);

  const World& world() const {
    return world_;
  }
  const World& pipeline() const {
    return pipeline_;
  }
  const World& data() const {
    return data_;
  }
  int64_t pipeline_rank() const;
  int64_t data_rank() const;
  int64_t pipeline_size() const;
  int64_t data_size() const;

 private:
  World world_;
  World pipeline_;
  World data_;
};

class PipelineStage;

/// One rank's part of a pipeline: the partitions of `module` split by
/// `options.balance()` that fall on `world.rank()`. With `stages_per_lane`
/// v, balance has `world.size() * v` partitions and partition j runs on rank
/// `j % world.size()` (the layout interleaved schedules need); with v = 1,
/// the default, rank r holds partition r. `options.placement()` puts
/// partition j on pipeline rank `placement.lane_of(j)` instead (e.g.
/// `Placement::v_shape(world.size())` for `Schedule::ZeroBubbleV`); it has
/// one lane per pipeline rank.
///
/// Parameters are named `partitions.<j>.<name>` as in gpipe::GPipe, so the
/// ranks' parameters together are GPipe's. The partitions run on the CPU,
/// or on `options.devices()[rank]` when devices are given (one per rank).
///
/// Every rank calls the same passes in the same order: `train_step` and
/// `forward` are collective. A pass that fails on one rank fails on every
/// rank still in it, with the first rank's error; after such a failure the
/// connection is closed and later passes are refused (restart the job).
/// Except for rank 0's own arguments (its input, loss_fn, grad mode),
/// checked before the pass begins: every rank refuses that pass alike,
/// nothing runs, and the stage stays usable. With replicas the first
/// stages agree before a training step, so that one replica's mistake, or
/// shards of different rows, is refused alike by every replica.
///
/// With a Mesh, each of its `data_size()` replicas runs its own pipeline
/// over `mesh.pipeline()` on its own shard of the batch, and train_step
/// averages the gradients over the replicas (`mesh.data()`) before it
/// returns: with a mean loss and equal shards, the step equals one pipeline
/// on the whole batch. The replicas start from data rank 0's parameters and
/// buffers (copied at construction); BatchNorm statistics stay per replica.
/// Replica d's micro-batch i draws what micro-batch d * m + i of one GPipe
/// with D * m micro-batches on the whole batch draws (processes seeded
/// alike): random layers such as dropout equal that GPipe's.
class PipelineStageImpl : public torch::nn::Module {
 public:
  /// One pipeline over all of `world`: Mesh(world, world.size()).
  PipelineStageImpl(
      torch::nn::Sequential module, GPipeOptions options, World world);
  /// This rank's stage of its replica's pipeline (`mesh.pipeline()`);
  /// balance has `mesh.pipeline_size() * stages_per_lane` partitions.
  PipelineStageImpl(
      torch::nn::Sequential module, GPipeOptions options, Mesh mesh);
  ~PipelineStageImpl() override;

  /// Inference through the pipeline: `input` is read on rank 0 (the other
  /// ranks may pass an undefined tensor); the output is returned on the
  /// last rank and undefined elsewhere. (Ranks are those of the first and
  /// the last partition: with `Placement::v_shape` both are rank 0.) Runs
  /// without autograd graph, as under torch::NoGradGuard; train with
  /// `train_step`.
  torch::Tensor forward(torch::Tensor input = {});

  /// One training step over all ranks, as GPipe::train_step: `input` is read
  /// on rank 0, `target` on the last rank (the last partition's rank;
  /// other ranks may pass undefined tensors); ranks are pipeline ranks, and
  /// each replica reads its own shard. Gradients accumulate into this rank's
  /// parameters, averaged over the replicas. Returns the mini-batch loss,
  /// detached, on every rank (with replicas, their mean).
  torch::Tensor train_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      Schedule schedule = Schedule::FillDrain);

  /// As above, running `plan` (`gpipe::make_plan`, written by hand, or
  /// `Plan::from_csv`) as written: rank r runs lane r. Every rank passes the
  /// same plan (compared when the pass begins; a difference fails every
  /// rank, naming both). A plan that does not fit (other stages or lanes,
  /// another number of micro-batches than the input cuts into, a stage on
  /// the wrong rank, one that cannot run) is a `c10::ValueError` on every
  /// rank, and the stage stays usable.
  torch::Tensor train_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      const Plan& plan);

  /// Refused: the stage's device is fixed.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false)
      override;
  /// Casts the partition to `dtype` (do it on every rank).
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// Refused: the stage's device is fixed.
  void to(torch::Device device, bool non_blocking = false) override;

  /// Records this rank's cells and its waits for other ranks into `trace`;
  /// nullptr stops. See gpipe/trace.h and gather_trace().
  void set_trace(std::shared_ptr<Trace> trace);
  std::shared_ptr<Trace> trace() const;

  /// `gpipe::dist::PipelineStage(rank=1/2, balance=[4, 4], chunks=8, ...)`.
  void pretty_print(std::ostream& stream) const override;

  /// This rank's first partition (partition `rank()` with the default
  /// placement).
  const torch::nn::Sequential& partition() const {
    return partitions_.front();
  }
  /// This rank's partitions, in order: `partitions()[k]` is partition
  /// `partition_indices()[k]` (`rank() + k * world size` with the default
  /// placement).
  const std::vector<torch::nn::Sequential>& partitions() const {
    return partitions_;
  }
  /// The partitions this rank holds, in increasing order.
  std::vector<int64_t> partition_indices() const;
  /// Which pipeline rank holds each partition (lane l is pipeline rank l):
  /// `options.placement()`, or `Placement::modulo(world size,
  /// stages_per_lane)`.
  Placement placement() const;
  torch::Device device() const {
    return device_;
  }
  /// The pipeline's World (mesh().pipeline()): rank() is the pipeline rank.
  const World& world() const {
    return world_;
  }
  const Mesh& mesh() const {
    return mesh_;
  }
  /// The size of the gradient buckets all-reduced over the replicas (about
  /// 25 MiB by default, as DDP's; Note [Gradient buckets] in
  /// src/dist/data_parallel.h). Smaller buckets start during the last
  /// backward sooner and hide more of the all-reduce. Set it on every rank
  /// alike, between steps.
  void set_gradient_bucket_bytes(int64_t bytes);
  int64_t gradient_bucket_bytes() const;
  int64_t rank() const {
    return world_.rank();
  }
  /// The layout as built (`options`' balance and stages_per_lane).
  const std::vector<int64_t>& balance() const {
    return built_.balance();
  }
  int64_t stages_per_lane() const {
    return built_.stages_per_lane();
  }
  int64_t chunks() const {
    return options.chunks();
  }
  /// The intra-op threads of this rank's lane: `threads_per_lane` when it
  /// was given, else the host's cores divided by its ranks.
  int64_t threads_per_lane() const {
    return threads_per_lane_;
  }

  /// The options it was built with. As GPipe's: `chunks` and `checkpoint`
  /// may be changed between passes (alike on every rank); a pass after the
  /// layout (balance, devices, stages_per_lane, placement, threads_per_lane,
  /// deferred_batch_norm) was changed here fails on every rank with a
  /// c10::ValueError naming the change (and, unless only rank 0 changed it
  /// and it was refused before the pass began, the connection closes).
  GPipeOptions options;

 private:
  friend std::shared_ptr<Trace> gather_trace(const PipelineStage& stage);
  // The options as built: the layout the stage has.
  GPipeOptions built_;
  struct Engine;
  torch::Tensor run_train_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      Schedule schedule,
      const Plan* plan);
  // With replicas, the end of a step: the gradients' and the loss's
  // average; a failure there is passed on to this replica's pipeline.
  torch::Tensor average_over_replicas(torch::Tensor loss);
  std::exception_ptr failed_over_replicas(std::exception_ptr error);
  // The pipeline's own part of a step (run_train_step adds the replicas').
  torch::Tensor run_pipeline_step(
      torch::Tensor input,
      torch::Tensor target,
      const LossFunction& loss_fn,
      Schedule schedule,
      const Plan* plan);

  Mesh mesh_;
  World world_;
  std::vector<torch::nn::Sequential> partitions_;
  int64_t threads_per_lane_ = 1;
  torch::Device device_ = torch::kCPU;
  std::shared_ptr<Engine> engine_;
};

/// A `ModuleHolder` for `PipelineStageImpl`.
TORCH_MODULE(PipelineStage);

/// Collective over the stage's pipeline World: every rank sends its trace
/// to pipeline rank 0, which gets one trace with a lane per rank (rank r's
/// cells on lane r, its waits and all-reduces beside them); with a Mesh,
/// each replica's first stage gets its replica's. Other ranks get nullptr.
/// Call between passes.
std::shared_ptr<Trace> gather_trace(const PipelineStage& stage);

/// Collective over the stage's whole World (every rank of every replica
/// calls it, between steps): a training checkpoint as
/// gpipe::save_checkpoint writes it (gpipe/checkpoint_io.h), each pipeline
/// rank of the first replica writing its own partitions' file (the other
/// replicas hold the same parameters and write only their layers' buffers,
/// BatchNorm's statistics being per replica), rank 0 the manifest once
/// every file is on disk. `dir` must be one directory for every rank (one
/// host, or a shared file system); `state` is rank 0's (its epoch, position
/// and user strings). Every rank returns once the checkpoint is whole, or
/// throws the first rank's error. Ranks that call another checkpoint
/// function, another step or an optimizer of another kind all throw a
/// c10::ValueError naming both sides before anything is written; a rank
/// that does not come is waited for as long as the World's timeout, which
/// also bounds the whole save, its writing included (raise
/// GPIPE_DIST_TIMEOUT for a large model on slow storage).
void save_checkpoint(
    const std::string& dir,
    const PipelineStage& stage,
    const torch::optim::Optimizer& optimizer,
    const TrainingState& state);

/// Collective over the stage's whole World: loads the newest checkpoint in
/// `dir` (as rank 0 finds it), whatever layout wrote it, into every rank's
/// partitions and optimizer, and returns its TrainingState (its CPU
/// generator state also put into the default generator). When any rank
/// cannot load (a missing file, another model), every rank throws before
/// anything changes.
TrainingState load_checkpoint(
    const std::string& dir,
    PipelineStage& stage,
    torch::optim::Optimizer& optimizer);

}  // namespace gpipe::dist
