#include "pipeline.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/checkpoint.h>
#include <gpipe/trace.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

namespace gpipe::detail {

namespace {

bool is_differentiable(const torch::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

// `t` detached and on `device`: a leaf of the graph of the cell that takes it.
torch::Tensor leaf_on(const torch::Tensor& t, torch::Device device) {
  if (!t.defined()) {
    return t;
  }
  return t.device() == device ? t.detach() : t.to(device).detach();
}

// The gradient of input k joined from every micro-batch's input gradients
// (`sizes` rows each), on `options`' device; a micro-batch whose gradient did
// not reach the input contributes zeros. Undefined when none did.
torch::Tensor join_input_grad(
    const std::vector<Packet>& dx,
    size_t k,
    const std::vector<int64_t>& sizes,
    std::vector<int64_t> shape,
    const torch::TensorOptions& options) {
  std::vector<torch::Tensor> pieces;
  bool any = false;
  for (const auto i : c10::irange(dx.size())) {
    const auto& g = dx[i].tensors.at(k);
    if (g.defined()) {
      any = true;
      pieces.push_back(g.to(options.device()));
    } else {
      shape[0] = sizes[i];
      pieces.push_back(torch::zeros(shape, options));
    }
  }
  return any ? torch::cat(pieces, 0) : torch::Tensor();
}

// Thrown by a cell that finds the pass already failed; never reaches a user.
struct Aborted {};

// Note [Backward on CUDA lanes]
// The pipeline's autograd node runs on the thread the autograd engine gives
// it. For CPU tensors that is the thread that called backward(), and lanes
// calling torch::autograd::backward run their own graph tasks on their own
// threads. For CUDA tensors the engine runs every node on one shared thread
// per device; our node would occupy it while lanes queue their work on it, a
// deadlock. With a CUDA device in the pipeline the backward cells therefore
// run on the node's thread, in schedule order, as reentrant backward calls;
// the GPU still overlaps partitions because kernel launches are asynchronous.

// Puts a partition's buffers back to the values they had when saved, on
// restore() or on destruction (a failing backward).
class BufferRestore {
 public:
  BufferRestore() = default;
  BufferRestore(const BufferRestore&) = delete;
  BufferRestore& operator=(const BufferRestore&) = delete;
  ~BufferRestore() {
    try {
      restore();
    } catch (...) {
      // Already failing; the first error is the one reported.
    }
  }

  void save(std::vector<torch::Tensor> buffers) {
    buffers_ = std::move(buffers);
    saved_.clear();
    for (const auto& b : buffers_) {
      saved_.push_back(b.clone());
    }
  }

  void restore() {
    // Through variable_data(), which has its own version counter: a version
    // bump would fail the backward of a cell that saved these buffers and
    // has not run its backward yet (BatchNorm saves its running statistics;
    // 1F1B interleaves such cells with this one).
    torch::NoGradGuard no_grad;
    for (const auto k : c10::irange(buffers_.size())) {
      buffers_[k].variable_data().copy_(saved_[k]);
    }
    buffers_.clear();
    saved_.clear();
  }

 private:
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> saved_;
};

}  // namespace

// The per-pass state shared by the caller and the lanes.
class Run {
 public:
  Run(Pipeline& pipeline, int64_t micro_batches, PassOptions options)
      : trace_(pipeline.trace()),
        pipeline_(pipeline),
        m_(micro_batches),
        n_(pipeline.size()),
        options_(options),
        cells_(m_, std::vector<CellState>(n_)),
        column_cvs_{
            std::vector<std::condition_variable>(n_ + 1),
            std::vector<std::condition_variable>(n_ + 1)} {}

  struct CellState {
    Packet input;   // leaves; kept for backward when a graph is built
    Packet output;  // with graph; kept for backward unless checkpointed
    // Skips from earlier partitions (leaves, in the order of the stage's
    // skips_in) and to later ones (with graph, unless checkpointed).
    std::vector<torch::Tensor> skip_inputs;
    std::map<SkipKey, torch::Tensor> skip_outputs;
    torch::Tensor loss;  // training step, last partition, not checkpointed
    bool checkpointed = false;
    uint64_t seed = 0;
  };

  // Runs `steps` on the lanes (or here, when `inline_cells`), handing
  // packets through `slots_`, and rethrows the first error once every cell
  // has finished or been skipped.
  void run_pass(
      const Steps& steps, bool inline_cells, const std::shared_ptr<Run>& self) {
    at::ThreadLocalState tls;
    if (inline_cells) {
      for (const auto& step : steps) {
        for (const auto& cell : step) {
          run_cell(cell);
        }
      }
    } else {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        pending_ = n_;
      }
      for (const auto j : c10::irange(n_)) {
        // One task per lane and pass runs the lane's cells in schedule
        // order; the task owns a reference to the run, so once it has
        // counted itself done the caller may drop its own.
        pipeline_.lane(j).post(
            [self, cells = cells_of_partition(steps, j), tls] {
              {
                at::ThreadLocalStateGuard guard(tls);
                for (const auto& cell : cells) {
                  self->run_cell(cell);
                }
              }
              self->finish_lane();
            });
      }
      std::unique_lock<std::mutex> lock(mutex_);
      done_cv_.wait(lock, [this] { return pending_ == 0; });
    }
    error_.rethrow_and_clear();
  }

  // Slot (i, k) holds the packet between partitions k-1 and k of micro-batch
  // i: the forward input of cell (i, k), the gradient coming back into cell
  // (i, k-1).
  void reset_slots() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto d : c10::irange(2)) {
      slots_[d].assign(m_, std::vector<Packet>(n_ + 1));
      ready_[d].assign(m_, std::vector<char>(n_ + 1, 0));
      waiting_[d].assign(n_ + 1, -1);
      skip_slots_[d].assign(m_, {});
    }
  }

  // Forward and backward slots are apart (a training step runs both in one
  // pass). Each column k of one direction has one taker (forward: lane k,
  // backward: lane k-1, or the caller after the pass), so a put wakes at
  // most the one thread waiting on that column, and only when it is
  // waiting: waking threads that go back to sleep costs more than a small
  // cell's work.
  void put(Phase phase, int64_t i, int64_t k, Packet packet) {
    const auto d = static_cast<size_t>(phase);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_[d][i][k] = std::move(packet);
      ready_[d][i][k] = 1;
      wake = waiting_[d][k] == i;
    }
    if (wake) {
      column_cvs_[d][k].notify_one();
    }
  }

  Packet take(Phase phase, int64_t i, int64_t k) {
    const auto d = static_cast<size_t>(phase);
    std::unique_lock<std::mutex> lock(mutex_);
    auto& ready = ready_[d];
    if (!ready[i][k] && !failed_) {
      waiting_[d][k] = i;
      column_cvs_[d][k].wait(lock, [&] { return ready[i][k] || failed_; });
      waiting_[d][k] = -1;
    }
    if (!ready[i][k]) {
      throw Aborted{};
    }
    ready[i][k] = 0;
    return std::move(slots_[d][i][k]);
  }

  // A skip between partitions, for micro-batch i: the stashed tensor in
  // forward, its gradient in backward. The schedule makes every skip ready
  // before its taker runs: the stashing cell puts it before its boundary
  // output, on which the taking cell depends.
  void put_skip(
      Phase phase, int64_t i, const SkipKey& key, torch::Tensor tensor) {
    std::lock_guard<std::mutex> lock(mutex_);
    skip_slots_[static_cast<size_t>(phase)][i].insert_or_assign(
        key, std::move(tensor));
  }

  torch::Tensor take_skip(Phase phase, int64_t i, const SkipKey& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slots = skip_slots_[static_cast<size_t>(phase)][i];
    auto it = slots.find(key);
    TORCH_INTERNAL_ASSERT(it != slots.end(), "skip ", key, " is not ready");
    auto tensor = std::move(it->second);
    slots.erase(it);
    return tensor;
  }

  int64_t micro_batches() const {
    return m_;
  }

  bool needs_grad = false;
  // Set for a training step: the last partition computes the loss of each
  // micro-batch, scaled by its share of the batch, and backward starts from
  // it (no gradient comes in from outside).
  const LossFunction* loss_fn = nullptr;
  std::vector<torch::Tensor> targets;
  std::vector<double> loss_scales;
  std::vector<torch::Tensor> losses;  // detached values, per micro-batch
  bool seeded = false;
  uint64_t step_seed = 0;
  bool retain_cells = false;  // backward keeps cells (retain_graph)
  bool consumed = false;      // backward freed the cells

 private:
  void run_cell(const Cell& cell) {
    try {
      if (failed()) {
        return;  // a cell that depends on a failed one never starts
      }
      if (cell.phase == Phase::Forward) {
        forward_cell(cell.micro_batch, cell.partition);
      } else {
        backward_cell(cell.micro_batch, cell.partition);
      }
    } catch (const Aborted&) {
      // The error that aborted the pass is recorded already.
    } catch (...) {
      fail(with_context(
          std::current_exception(),
          "partition " + std::to_string(cell.partition) + ", micro-batch " +
              std::to_string(cell.micro_batch) +
              (cell.phase == Phase::Forward ? ", forward" : ", backward")));
    }
  }

  void finish_lane() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--pending_ == 0) {
      done_cv_.notify_all();
    }
  }

  bool failed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failed_;
  }

  void fail(std::exception_ptr error) {
    error_.set(std::move(error));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed_ = true;
    }
    for (auto& column : column_cvs_) {
      for (auto& cv : column) {
        cv.notify_all();
      }
    }
  }

  using Clock = std::chrono::steady_clock;
  // Now, when tracing; the engine pays only this test otherwise.
  Clock::time_point stamp() const {
    return trace_ ? Clock::now() : Clock::time_point();
  }

  void forward_cell(int64_t i, int64_t j) {
    Stage& stage = pipeline_.stage(j);
    c10::OptionalDeviceGuard device_guard;
    if (stage.device.type() != torch::kCPU) {
      device_guard.reset_device(stage.device);
    }
    Packet in = take(Phase::Forward, i, j);
    const auto started = stamp();
    bool copied = false;
    // A skip from an earlier partition is a leaf of this cell's graph, like
    // the boundary input.
    std::map<SkipKey, torch::Tensor> incoming;
    std::vector<torch::Tensor> skip_inputs;
    for (const auto& key : stage.skips_in) {
      auto t = take_skip(Phase::Forward, i, key);
      copied = copied || (t.defined() && t.device() != stage.device);
      auto leaf = leaf_on(t, stage.device);
      if (needs_grad && is_differentiable(leaf)) {
        leaf.requires_grad_(true);
      }
      incoming.emplace(key, leaf);
      skip_inputs.push_back(std::move(leaf));
    }
    CellSkipTracker skips(stage.skips_out, std::move(incoming));
    Packet x{{}, in.atomic};
    x.tensors.reserve(in.tensors.size());
    for (auto& t : in.tensors) {
      copied = copied || (t.defined() && t.device() != stage.device);
      auto leaf = leaf_on(t, stage.device);
      // A boundary input is a leaf of the cell's own graph: it requires grad
      // when the tensor it stands for does (the user's input on partition
      // 0, every differentiable activation after it).
      if (needs_grad && is_differentiable(leaf) &&
          (j > 0 || t.requires_grad())) {
        leaf.requires_grad_(true);
      }
      x.tensors.push_back(std::move(leaf));
    }

    auto computing = started;
    if (trace_ && copied) {
      computing = Clock::now();
      trace_->record(j, i, TraceKind::Copy, started, computing);
    }

    auto& c = cells_[i][j];
    c.checkpointed = needs_grad && i < options_.checkpoint_stop;
    c.seed = seeded ? cell_seed(step_seed, i, j) : 0;
    Packet y;
    auto body = [&] {
      SkipTrackerGuard tracker(&skips);
      y = call_partition(stage, x, j);
    };
    if (c.checkpointed) {
      torch::NoGradGuard no_grad;
      CheckpointingGuard checkpointing;
      stage.random.run_seeded(stage.device, options_.training, c.seed, body);
    } else {
      stage.random.run_seeded(stage.device, options_.training, c.seed, body);
    }

    Packet out{{}, y.atomic};
    out.tensors.reserve(y.tensors.size());
    for (const auto& t : y.tensors) {
      out.tensors.push_back(t.defined() ? t.detach() : t);
    }
    auto& outgoing = skips.outgoing();
    for (const auto& key : stage.skips_out) {
      const auto& t = outgoing[key];
      put_skip(Phase::Forward, i, key, t.defined() ? t.detach() : t);
    }
    if (needs_grad) {
      c.input = std::move(x);
      c.skip_inputs = std::move(skip_inputs);
      if (!c.checkpointed) {
        c.output = std::move(y);
        c.skip_outputs = std::move(outgoing);
      }
    }
    // Whatever this cell does not keep is let go before the next cell can
    // run, so that a skip's last user frees it.
    outgoing.clear();
    if (loss_fn != nullptr && j == n_ - 1) {
      torch::Tensor loss;
      {
        c10::optional<torch::NoGradGuard> no_grad;
        if (c.checkpointed) {
          no_grad.emplace();
        }
        loss = loss_of(i, needs_grad && !c.checkpointed ? c.output : y);
      }
      losses[i] = loss.detach();
      if (needs_grad && !c.checkpointed) {
        c.loss = std::move(loss);
        c.output = Packet{};
      }
      if (trace_) {
        trace_->record(j, i, TraceKind::Forward, computing, Clock::now());
      }
      return;
    }
    if (trace_) {
      trace_->record(j, i, TraceKind::Forward, computing, Clock::now());
    }
    put(Phase::Forward, i, j + 1, std::move(out));
  }

  // The loss of micro-batch i from the last partition's output, scaled by
  // the micro-batch's share of the batch.
  torch::Tensor loss_of(int64_t i, const Packet& y) {
    TORCH_CHECK_TYPE(
        y.atomic && y.tensors.size() == 1,
        "train_step expects the last layer to return one tensor, but it "
        "returned ",
        y.tensors.size(),
        " tensors");
    auto loss = (*loss_fn)(y.tensors[0], targets[i]);
    TORCH_CHECK_VALUE(
        loss.defined() && loss.numel() == 1,
        "train_step expects loss_fn to return a scalar, but it returned a "
        "tensor of shape ",
        loss.defined() ? loss.sizes() : c10::IntArrayRef{});
    return loss.reshape({}) * loss_scales[i];
  }

  void backward_cell(int64_t i, int64_t j) {
    Stage& stage = pipeline_.stage(j);
    c10::OptionalDeviceGuard device_guard;
    if (stage.device.type() != torch::kCPU) {
      device_guard.reset_device(stage.device);
    }
    const bool from_loss = loss_fn != nullptr && j == n_ - 1;
    Packet dy = from_loss ? Packet{} : take(Phase::Backward, i, j + 1);
    const auto started = stamp();
    auto& c = cells_[i][j];
    TORCH_INTERNAL_ASSERT(
        c.input.tensors.size() > 0, "backward of a cell with no saved input");

    auto backward_started = started;
    Packet y;
    std::map<SkipKey, torch::Tensor> skip_outputs;
    // Recomputation must not update running statistics a second time; the
    // buffers are put back once the cell's backward, which may read them,
    // is done, also when it fails.
    BufferRestore buffers;
    if (c.checkpointed) {
      torch::AutoGradMode grad_mode(true);
      RecomputingGuard recomputing;
      buffers.save(stage.module->buffers());
      std::map<SkipKey, torch::Tensor> incoming;
      for (const auto k : c10::irange(stage.skips_in.size())) {
        incoming.emplace(stage.skips_in[k], c.skip_inputs[k]);
      }
      CellSkipTracker skips(stage.skips_out, std::move(incoming));
      auto body = [&] {
        SkipTrackerGuard tracker(&skips);
        y = call_partition(stage, c.input, j);
      };
      stage.random.run_seeded(stage.device, options_.training, c.seed, body);
      skip_outputs = std::move(skips.outgoing());
      if (trace_) {
        backward_started = Clock::now();
        trace_->record(j, i, TraceKind::Recompute, started, backward_started);
      }
    } else {
      y = c.output;
      skip_outputs = c.skip_outputs;
    }

    std::vector<torch::Tensor> roots;
    std::vector<torch::Tensor> grads;
    if (from_loss) {
      torch::AutoGradMode grad_mode(true);
      auto loss = c.checkpointed ? loss_of(i, y) : c.loss;
      if (loss.requires_grad()) {
        grads.push_back(torch::ones_like(loss));
        roots.push_back(std::move(loss));
      }
    }
    for (const auto k : c10::irange(y.tensors.size())) {
      const auto& yk = y.tensors[k];
      if (k < dy.tensors.size() && dy.tensors[k].defined() && yk.defined() &&
          yk.requires_grad()) {
        roots.push_back(yk);
        const auto& g = dy.tensors[k];
        grads.push_back(g.device() == yk.device() ? g : g.to(yk.device()));
      }
    }
    dy.tensors.clear();
    // The gradients of skips to later partitions came back from the cells
    // that popped them.
    for (const auto& key : stage.skips_out) {
      auto g = take_skip(Phase::Backward, i, key);
      const auto& s = skip_outputs[key];
      if (g.defined() && s.defined() && s.requires_grad()) {
        roots.push_back(s);
        grads.push_back(g.device() == s.device() ? g : g.to(s.device()));
      }
    }
    skip_outputs.clear();
    // Input leaves of a retained cell collect gradients again on the next
    // backward: start from nothing each time.
    for (auto* leaves : {&c.input.tensors, &c.skip_inputs}) {
      for (auto& x : *leaves) {
        if (x.defined() && x.grad().defined()) {
          x.mutable_grad().reset();
        }
      }
    }
    if (!roots.empty()) {
      torch::autograd::backward(
          roots, grads, /*retain_graph=*/retain_cells, /*create_graph=*/false);
    }
    roots.clear();
    y = Packet{};
    buffers.restore();

    for (const auto k : c10::irange(stage.skips_in.size())) {
      const auto& leaf = c.skip_inputs[k];
      put_skip(
          Phase::Backward,
          i,
          stage.skips_in[k],
          leaf.defined() && leaf.requires_grad() ? leaf.grad()
                                                 : torch::Tensor());
    }
    Packet dx{{}, c.input.atomic};
    for (auto& x : c.input.tensors) {
      dx.tensors.push_back(
          x.defined() && x.requires_grad() ? x.grad() : torch::Tensor());
    }
    if (!retain_cells) {
      c = CellState{};
    }
    if (trace_) {
      trace_->record(j, i, TraceKind::Backward, backward_started, Clock::now());
    }
    put(Phase::Backward, i, j, std::move(dx));
  }

  const std::shared_ptr<Trace> trace_;  // null when not tracing
  Pipeline& pipeline_;
  const int64_t m_;
  const int64_t n_;
  const PassOptions options_;
  // Cell (i, j) is touched by lane j only while a pass runs, by the caller
  // between passes.
  std::vector<std::vector<CellState>> cells_;

  std::mutex mutex_;
  std::condition_variable done_cv_;  // pending_ reached zero
  // Indexed by direction (Phase), then micro-batch, then column.
  std::vector<std::condition_variable> column_cvs_[2];  // a slot is ready
  std::vector<std::vector<Packet>> slots_[2];           // guarded by mutex_
  std::vector<std::vector<char>> ready_[2];             // guarded by mutex_
  // Per column: the micro-batch its taker waits for, or -1.
  std::vector<int64_t> waiting_[2];                              // mutex_
  std::vector<std::map<SkipKey, torch::Tensor>> skip_slots_[2];  // mutex_
  int64_t pending_ = 0;  // guarded by mutex_
  bool failed_ = false;  // guarded by mutex_
  FirstError error_;
};

namespace {

// The autograd node of a GPipe output. Its backward is the pipelined
// backward of every cell.
class PipelineBackward : public torch::autograd::Node {
 public:
  PipelineBackward(
      std::shared_ptr<Pipeline> pipeline,
      std::shared_ptr<Run> run,
      std::vector<int64_t> output_slots,
      std::vector<int64_t> micro_batch_sizes,
      Batch inputs)
      : pipeline_(std::move(pipeline)),
        run_(std::move(run)),
        output_slots_(std::move(output_slots)),
        micro_batch_sizes_(std::move(micro_batch_sizes)) {
    for (const auto& x : inputs) {
      inputs_.push_back(
          InputInfo{x.sizes().vec(), x.options(), x.requires_grad()});
    }
  }

  void set_output_slots(std::vector<int64_t> slots) {
    output_slots_ = std::move(slots);
  }

  std::string name() const override {
    return "gpipe::PipelineBackward";
  }

  void release_variables() override {
    run_.reset();
  }

  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override {
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    TORCH_CHECK(
        exec_info == nullptr || exec_info->empty(),
        "gpipe::GPipe supports only backward() over all leaves: the pipelined "
        "backward accumulates every parameter's .grad, so "
        "torch::autograd::grad "
        "and backward(inputs=...) through a GPipe output are not supported");
    TORCH_CHECK(
        run_ && !run_->consumed,
        "trying to backward through a gpipe::GPipe output a second time, but "
        "its saved activations have been freed; pass retain_graph=true to the "
        "first backward, or run forward again");
    Run& run = *run_;
    const int64_t m = run.micro_batches();
    const int64_t n = pipeline_->size();

    // Gradient of output tensor k, cut per micro-batch.
    const size_t width = output_slots_.size();
    run.reset_slots();
    std::vector<Packet> dys(m);
    for (const auto k : c10::irange(width)) {
      torch::Tensor g;
      if (output_slots_[k] >= 0) {
        g = grads[output_slots_[k]];
      }
      int64_t offset = 0;
      for (const auto i : c10::irange(m)) {
        dys[i].tensors.push_back(
            g.defined() ? g.narrow(0, offset, micro_batch_sizes_[i])
                        : torch::Tensor());
        offset += micro_batch_sizes_[i];
      }
    }
    for (const auto i : c10::irange(m)) {
      run.put(Phase::Backward, i, n, std::move(dys[i]));
    }

    run.retain_cells = torch::autograd::get_current_graph_task_keep_graph();
    {
      // Recomputation reseeds the generators; the user's streams must not
      // notice. See Note [Random streams of concurrent cells].
      std::unique_ptr<GeneratorStateGuard> generators;
      if (run.seeded) {
        std::vector<torch::Device> devices;
        for (const auto j : c10::irange(n)) {
          devices.push_back(pipeline_->stage(j).device);
        }
        generators = std::make_unique<GeneratorStateGuard>(devices);
      }
      try {
        run.run_pass(
            reverse_clock_cycles(m, n), pipeline_->backward_inline(), run_);
      } catch (...) {
        run.consumed = true;
        throw;
      }
    }
    run.consumed = !run.retain_cells;

    std::vector<Packet> dx(m);
    for (const auto i : c10::irange(m)) {
      dx[i] = run.take(Phase::Backward, i, 0);
    }
    torch::autograd::variable_list dxs;
    for (const auto k : c10::irange(inputs_.size())) {
      const auto& input = inputs_[k];
      dxs.push_back(
          input.requires_grad
              ? join_input_grad(
                    dx, k, micro_batch_sizes_, input.shape, input.options)
              : torch::Tensor());
    }
    return dxs;
  }

 private:
  std::shared_ptr<Pipeline> pipeline_;
  std::shared_ptr<Run> run_;
  // Output tensor k is this node's input number output_slots_[k], or -1 when
  // it is not differentiable.
  std::vector<int64_t> output_slots_;
  std::vector<int64_t> micro_batch_sizes_;
  struct InputInfo {
    std::vector<int64_t> shape;
    torch::TensorOptions options;
    bool requires_grad = false;
  };
  std::vector<InputInfo> inputs_;
};

}  // namespace

Packet call_partition(Stage& stage, const Packet& input, int64_t partition) {
  auto& module = stage.module;
  auto it = module->begin();
  TORCH_INTERNAL_ASSERT(it != module->end(), "empty partition ", partition);
  size_t layer = 0;
  auto call = [&](auto&& argument) {
    const Skippable* skippable = stage.skippables[layer++];
    if (skippable == nullptr) {
      return it->any_forward(std::forward<decltype(argument)>(argument));
    }
    SkipUsageGuard usage(skippable);
    auto output = it->any_forward(std::forward<decltype(argument)>(argument));
    usage.check();
    return output;
  };
  torch::nn::AnyValue value =
      input.atomic ? call(input.tensors.at(0)) : call(input.tensors);
  for (++it; it != module->end(); ++it) {
    value = call(std::move(value));
  }
  return packet_of(std::move(value), "partition", partition);
}

Pipeline::Pipeline(
    std::vector<torch::nn::Sequential> partitions,
    std::vector<torch::Device> devices,
    int64_t threads_per_lane) {
  TORCH_INTERNAL_ASSERT(partitions.size() == devices.size());
  for (const auto j : c10::irange(partitions.size())) {
    auto stage = std::make_unique<Stage>();
    stage->module = partitions[j];
    stage->device = devices[j];
    for (const auto& layer : partitions[j]->children()) {
      stage->skippables.push_back(as_skippable(*layer));
    }
    for (const auto& module : partitions[j]->modules()) {
      if (auto* bn = module->as<DeferredBatchNormImpl>()) {
        bn->engine_commits_ = true;
        stage->deferred_batch_norms.push_back(bn);
      }
    }
    backward_inline_ = backward_inline_ || devices[j].is_cuda();
    stages_.push_back(std::move(stage));
  }
  skip_layout_ = SkipLayout(partitions);
  for (const auto j : c10::irange(partitions.size())) {
    for (const auto& route : skip_layout_.copy_policy(j)) {
      stages_[j]->skips_in.push_back(route.second);
    }
    stages_[j]->skips_out = skip_layout_.routed_out(j);
  }
  for (const auto j : c10::irange(partitions.size())) {
    const bool cpu = devices[j].is_cpu();
    lanes_.push_back(std::make_unique<Lane>([cpu, threads_per_lane] {
      if (cpu) {
        // Initialise this thread's intra-op pool first, so that the lazy
        // initialisation of the first parallel op does not undo our count.
        at::internal::lazy_init_num_threads();
        at::set_num_threads(static_cast<int>(threads_per_lane));
      }
    }));
  }
}

Pipeline::~Pipeline() = default;

namespace {

// What every pass starts with: the run, whether a graph is built, and the
// per-cell seeds with the user's generators saved (see Note [Random streams
// of concurrent cells]).
std::shared_ptr<Run> start_run(
    Pipeline& pipeline,
    int64_t m,
    const Batch& original_inputs,
    const PassOptions& options,
    std::unique_ptr<GeneratorStateGuard>& generators) {
  auto run = std::make_shared<Run>(pipeline, m, options);
  bool any_requires_grad = false;
  for (const auto& x : original_inputs) {
    any_requires_grad = any_requires_grad || x.requires_grad();
  }
  std::vector<torch::Device> devices;
  for (const auto j : c10::irange(pipeline.size())) {
    auto& stage = pipeline.stage(j);
    for (const auto& p : stage.module->parameters()) {
      any_requires_grad = any_requires_grad || p.requires_grad();
    }
    run->seeded = run->seeded || stage.random.may_draw(options.training);
    devices.push_back(stage.device);
  }
  run->needs_grad = torch::GradMode::is_enabled() && any_requires_grad;
  if (run->seeded) {
    run->step_seed = draw_step_seed();
    generators = std::make_unique<GeneratorStateGuard>(devices);
  }
  return run;
}

}  // namespace

void Pipeline::run_and_commit(
    const std::shared_ptr<Run>& run, const Steps& steps) {
  try {
    run->run_pass(steps, /*inline_cells=*/false, run);
  } catch (...) {
    // A failed mini-batch leaves no statistics behind.
    for (const auto& stage : stages_) {
      for (auto* bn : stage->deferred_batch_norms) {
        bn->discard();
      }
    }
    throw;
  }
  // The statistics of every micro-batch are in: update the running ones
  // once for the mini-batch. See gpipe/batchnorm.h.
  for (const auto& stage : stages_) {
    for (auto* bn : stage->deferred_batch_norms) {
      bn->commit();
    }
  }
}

Packet Pipeline::forward(
    std::vector<Packet> inputs,
    const Batch& original_inputs,
    const PassOptions& options) {
  const int64_t m = static_cast<int64_t>(inputs.size());
  const int64_t n = size();
  std::unique_ptr<GeneratorStateGuard> generators;
  auto run = start_run(*this, m, original_inputs, options, generators);

  std::vector<int64_t> sizes;
  run->reset_slots();
  for (const auto i : c10::irange(m)) {
    sizes.push_back(inputs[i].tensors.at(0).size(0));
    run->put(Phase::Forward, i, 0, std::move(inputs[i]));
  }
  run_and_commit(run, clock_cycles(m, n));
  generators.reset();

  std::vector<Packet> outputs;
  for (const auto i : c10::irange(m)) {
    outputs.push_back(run->take(Phase::Forward, i, n));
  }

  // One node stands behind each whole output tensor.
  const auto width = outputs.at(0).tensors.size();
  Packet gathered{{}, outputs[0].atomic};
  {
    std::vector<Batch> pieces;
    for (auto& packet : outputs) {
      TORCH_CHECK_VALUE(
          packet.tensors.size() == width,
          "every micro-batch must give the same number of output tensors, but "
          "one gave ",
          width,
          " and another ",
          packet.tensors.size());
      pieces.push_back(std::move(packet.tensors));
    }
    gathered.tensors = gather(pieces);
  }
  if (!run->needs_grad) {
    return gathered;
  }
  auto node = std::shared_ptr<PipelineBackward>(
      new PipelineBackward(shared_from_this(), run, {}, sizes, original_inputs),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(original_inputs));
  std::vector<int64_t> slots;
  int64_t next_slot = 0;
  for (auto& t : gathered.tensors) {
    if (is_differentiable(t)) {
      torch::autograd::set_history(t, node);
      slots.push_back(next_slot++);
    } else {
      slots.push_back(-1);
    }
  }
  node->set_output_slots(std::move(slots));
  return gathered;
}

torch::Tensor Pipeline::train(
    std::vector<Packet> inputs,
    std::vector<torch::Tensor> targets,
    const Batch& original_inputs,
    const LossFunction& loss_fn,
    Schedule schedule,
    const PassOptions& options) {
  const int64_t m = static_cast<int64_t>(inputs.size());
  const int64_t n = size();
  std::unique_ptr<GeneratorStateGuard> generators;
  auto run = start_run(*this, m, original_inputs, options, generators);
  TORCH_CHECK(
      run->needs_grad,
      "train_step needs grad mode on and something that requires grad (a "
      "parameter or the input)");
  int64_t total = 0;
  std::vector<int64_t> sizes;
  for (const auto i : c10::irange(m)) {
    sizes.push_back(inputs[i].tensors.at(0).size(0));
    total += sizes.back();
  }
  run->loss_fn = &loss_fn;
  run->targets = std::move(targets);
  run->losses.resize(m);
  for (const auto i : c10::irange(m)) {
    run->loss_scales.push_back(
        static_cast<double>(sizes[i]) / static_cast<double>(total));
  }
  run->reset_slots();
  for (const auto i : c10::irange(m)) {
    run->put(Phase::Forward, i, 0, std::move(inputs[i]));
  }
  run_and_commit(run, training_steps(schedule, m, n));
  generators.reset();

  // Gradients of inputs that require grad continue into their graph.
  std::vector<Packet> dx(m);
  for (const auto i : c10::irange(m)) {
    dx[i] = run->take(Phase::Backward, i, 0);
  }
  for (const auto k : c10::irange(original_inputs.size())) {
    const auto& x = original_inputs[k];
    if (!x.requires_grad()) {
      continue;
    }
    auto g = join_input_grad(dx, k, sizes, x.sizes().vec(), x.options());
    if (g.defined()) {
      torch::autograd::backward({x}, {g});
    }
  }
  return torch::stack(run->losses).sum();
}

}  // namespace gpipe::detail
