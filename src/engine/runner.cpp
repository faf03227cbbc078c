#include "engine/runner.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <utility>

#include "engine/cell.h"
#include "engine/lane_threads.h"
#include "engine/partitions.h"
#include "engine/pipeline.h"
#include "engine/wide_cells.h"
#include "schedule/actions.h"
#include "text.h"

namespace gpipe::detail {

PassOptions pass_options(bool training, const GPipeOptions& options) {
  // Chunks and the checkpoint mode may change between passes.
  verify_checkpoint_mode(options.checkpoint());
  PassOptions pass;
  pass.training = training;
  if (training) {
    switch (options.checkpoint()) {
      case Checkpoint::Always:
        pass.checkpoint_stop = options.chunks();
        break;
      case Checkpoint::ExceptLast:
        pass.checkpoint_stop = options.chunks() - 1;
        break;
      case Checkpoint::Never:
        pass.checkpoint_stop = 0;
        break;
    }
  }
  return pass;
}

namespace {

// Runs `f` here, or where `compute_on` says.
void compute(const ComputeOn* compute_on, const std::function<void()>& f) {
  if (compute_on != nullptr) {
    (*compute_on)(f);
  } else {
    f();
  }
}

const char* phase_name(Phase phase) {
  return action_info(phase).context;
}

}  // namespace

Pass::Pass(Pipeline& pipeline, int64_t m, PassOptions options)
    : pipeline_(pipeline),
      m_(m),
      n_(pipeline.size()),
      options_(options),
      trace_(pipeline.trace()),
      autocast_(AutocastState::current()),
      cells_(m_, std::vector<CellState>(n_)) {
  reset_transport();
}

void Pass::reset_transport() {
  transport_ = pipeline_.make_transport(m_);
}

void Pass::train_with(
    const LossFunction& fn,
    std::vector<torch::Tensor> targets_of_micro_batches,
    const std::vector<int64_t>& rows) {
  int64_t total = 0;
  for (const auto r : rows) {
    total += r;
  }
  loss_fn = &fn;
  targets = std::move(targets_of_micro_batches);
  losses.assign(rows.size(), torch::Tensor());
  loss_scales.clear();
  for (const auto r : rows) {
    loss_scales.push_back(static_cast<double>(r) / static_cast<double>(total));
  }
}

void Pass::run(
    const Plan& plan,
    bool inline_cells,
    const std::shared_ptr<Pass>& self,
    const Steps* steps) {
  explicit_losses_ = false;
  explicit_transfers_ = false;
  lane_of_stage_.assign(n_, -1);
  for (const auto l : c10::irange(plan.lanes.size())) {
    for (const auto& cell : plan.lanes[l]) {
      lane_of_stage_.at(cell.partition) = static_cast<int64_t>(l);
      explicit_transfers_ = explicit_transfers_ || is_transfer(cell.phase);
    }
  }
  if (explicit_transfers_) {
    forward_outbox_.assign(m_, std::vector<Packet>(n_));
    backward_outbox_.assign(m_, std::vector<Packet>(n_));
  }
  for (const auto& row : plan.lanes) {
    for (const auto& cell : row) {
      if (cell.phase == Phase::Loss) {
        explicit_losses_ = true;
        // (In gpipe::dist only the last stage's rank has the loss.)
        TORCH_CHECK_VALUE(
            loss_fn != nullptr || !pipeline_.is_local(cell.partition),
            "the plan lists losses, but this pass has no loss_fn (only "
            "train_step runs losses)");
      }
    }
  }
  // Per lane and cell: the stage whose gradients are final once the cell
  // has ended (its last B or W in the row), else -1.
  std::vector<std::vector<int64_t>> finals(plan.lanes.size());
  if (on_gradients_final) {
    for (const auto l : c10::irange(plan.lanes.size())) {
      const auto& row = plan.lanes[l];
      finals[l].assign(row.size(), -1);
      std::vector<bool> seen(n_, false);
      for (auto k = static_cast<int64_t>(row.size()) - 1; k >= 0; --k) {
        const auto& cell = row[k];
        if ((cell.phase == Phase::Backward ||
             cell.phase == Phase::BackwardWeight) &&
            !seen[cell.partition]) {
          seen[cell.partition] = true;
          finals[l][k] = cell.partition;
        }
      }
    }
  }
  const auto threads = inline_cells ? nullptr : pipeline_.threads_of(plan);
  const bool serial_here = !inline_cells && serial(plan, threads.get());
  if (inline_cells || serial_here) {
    // A serial plan gets every core on this thread while it runs (Note [A
    // serial plan on the calling thread]).
    std::optional<IntraOpThreads> every_core;
    if (serial_here) {
      every_core.emplace(pipeline_.shared_cores());
    }
    Steps own_steps;
    if (steps == nullptr) {
      own_steps = plan.steps();
      steps = &own_steps;
    }
    for (const auto& step : *steps) {
      for (const auto& cell : step) {
        if (pipeline_.is_local(cell.partition)) {
          run_cell(cell, plan.lane_of(cell.partition));
        }
      }
    }
    if (on_gradients_final && !error_.has()) {
      for (const auto& row : finals) {
        for (const auto j : row) {
          if (j >= 0 && pipeline_.is_local(j)) {
            gradients_final(j, /*before=*/false);
          }
        }
      }
    }
  } else {
    run_lanes(plan, std::move(finals), threads.get(), self);
  }
  if (!error_.has()) {
    const auto why = transport_->failure();
    if (!why.empty()) {
      try {
        // Another rank's failure, without LibTorch's backtrace (Note
        // [Errors without LibTorch's backtrace] in src/text.h).
        throw RelayedFailure(why, why);
      } catch (...) {
        error_.set(std::current_exception());
      }
    }
  }
  error_.rethrow_and_clear();
}

// Note [A serial plan on the calling thread]
// A plan that never runs two CPU lanes at once (every plan at chunks 1)
// gives each cell every core (Note [Threads that follow the plan]). On the
// lanes, each cell went to a thread with every core while its own lane
// waited, and the lanes handed each other every message: about four thread
// wake-ups a cell, which cost more than a small cell's work on a loaded
// machine. Such a plan runs on the calling thread instead, as a CUDA
// pipeline's backward does (Note [Backward on CUDA lanes]), its cells in
// the order of Plan::steps (each after its inputs, so that every message
// is sent before it is received), with the thread's intra-op count raised
// to every core for the pass and put back after. Cells keep their lanes in
// contexts and traces. A pipeline with a lane on another device keeps its
// lanes, each with its own count. Where this thread's count cannot be set
// for it alone (LibTorch without OpenMP), it keeps its own.
// A pipeline of one CPU lane runs every cell alone, whatever its plan, so
// it runs on the calling thread too, with its lane's count: on the lane,
// the caller only waited, each pass paid for the handover, and each cell
// for thread-local lookups from another thread and for frees into the
// lane's own malloc arena (docs/benchmark-history.md, "One lane on the
// calling thread").
bool Pass::serial(
    const Plan& plan, const std::vector<std::vector<int64_t>>* threads) const {
  if (threads == nullptr || pipeline_.shared_cores() <= 0) {
    return false;
  }
  for (const auto l : c10::irange(plan.lanes.size())) {
    const auto& row = plan.lanes[l];
    if (!row.empty() && !pipeline_.is_local(row.front().partition)) {
      return false;
    }
    for (const auto k : c10::irange(row.size())) {
      if (action_info(row[k].phase).step &&
          (*threads)[l][k] < pipeline_.shared_cores()) {
        return false;
      }
    }
  }
  return true;
}

void Pass::run_cell_of_row(
    const Cell& cell,
    int64_t lane,
    int64_t final_stage,
    const ComputeOn* compute_on) {
  const bool final = final_stage >= 0;
  if (final && before_final_gradients) {
    gradients_final(final_stage, /*before=*/true);
  }
  run_cell(cell, lane, compute_on);
  if (final) {
    gradients_final(final_stage, /*before=*/false);
  }
}

void Pass::run_lanes(
    const Plan& plan,
    std::vector<std::vector<int64_t>> finals,
    const std::vector<std::vector<int64_t>>* threads,
    const std::shared_ptr<Pass>& self) {
  // Lanes of partitions in other processes run there.
  std::vector<int64_t> lanes;
  for (const auto l : c10::irange(plan.lanes.size())) {
    const auto& row = plan.lanes[l];
    if (!row.empty() && pipeline_.is_local(row.front().partition)) {
      lanes.push_back(static_cast<int64_t>(l));
    }
  }
  auto countdown = std::make_shared<Countdown>(lanes.size());
  const at::ThreadLocalState tls;
  // Cells the plan runs alone, long enough to gain from every core, go to
  // the calling thread (Note [Wide cells on the calling thread]), where
  // every lane is a CPU lane of this process that shares the cores.
  const auto cores = pipeline_.shared_cores();
  bool widen = threads != nullptr && cores > 1;
  for (const auto& row : plan.lanes) {
    widen = widen && (row.empty() ||
                      (pipeline_.is_local(row.front().partition) &&
                       pipeline_.devices()[row.front().partition].is_cpu()));
  }
  for (const auto l : lanes) {
    const auto& row = plan.lanes[l];
    std::vector<bool> wide(row.size(), false);
    for (const auto k : c10::irange(widen ? row.size() : 0)) {
      wide[k] = (*threads)[l][k] == cores &&
                pipeline_.lane_cell_seconds(row[k].partition, row[k].phase) >=
                    kWideCellSeconds;
    }
    // One task per lane and run: the lane's row in plan order.
    pipeline_.lane(l).post([pass = self,
                            countdown,
                            cells = row,
                            finals = std::move(finals[l]),
                            wide = std::move(wide),
                            cores,
                            tls,
                            l]() mutable {
      {
        at::ThreadLocalStateGuard guard(tls);
        for (const auto k : c10::irange(cells.size())) {
          const auto& cell = cells[k];
          const auto final = finals.empty() ? -1 : finals[k];
          if (wide[k]) {
            // The lane takes the cell's messages, so that the caller never
            // waits for another lane's cell (which might be waiting for the
            // caller itself); the caller computes.
            const auto own = at::get_num_threads();
            const ComputeOn on_caller = [&](const std::function<void()>& f) {
              countdown->run_on_caller([&] {
                IntraOpThreads every_core(cores);
                const LaneTimeScale wide_cell(
                    static_cast<double>(cores) / std::max(1, own));
                f();
              });
            };
            pass->run_cell_of_row(cell, l, final, &on_caller);
            continue;
          }
          const LaneTimeScale own_lane(1.0);
          pass->run_cell_of_row(cell, l, final);
        }
      }
      // The caller holds the pass until the countdown is done, so it,
      // not this lane, frees the pass and its tensors.
      pass.reset();
      countdown->done();
    });
  }
  countdown->wait();
}

CellContext Pass::context(int64_t i, int64_t j, int64_t lane) const {
  CellContext ctx;
  ctx.micro_batch = i;
  ctx.training = options_.training;
  ctx.grad = grad;
  ctx.checkpoint = i < options_.checkpoint_stop;
  ctx.checkpoint_in_pass = grad && options_.checkpoint_stop > 0;
  ctx.seed = cell_seed(step_seed, seed_offset + i, j);
  if (loss_fn != nullptr && j == n_ - 1) {
    ctx.loss_fn = loss_fn;
    ctx.target = targets[i];
    ctx.loss_scale = loss_scales[i];
    // Stage n - 1's loss has the seed of a stage n.
    ctx.loss_seed = cell_seed(step_seed, seed_offset + i, n_);
  }
  ctx.last_stage = j == n_ - 1;
  ctx.retain = retain;
  ctx.trace = trace_.get();
  ctx.lane = lane;
  ctx.autocast = autocast_;
  return ctx;
}

void Pass::gradients_final(int64_t stage, bool before) {
  if (error_.has() || transport_->aborted()) {
    return;
  }
  try {
    if (before) {
      before_final_gradients(stage);
    } else {
      on_gradients_final(stage);
    }
  } catch (const RelayedFailure& e) {
    error_.set(std::current_exception());
    transport_->relay(e.origin());
  } catch (const c10::Error& e) {
    error_.set(std::current_exception());
    // The other ranks hear why, not only that it failed.
    transport_->abort_with(
        "the gradients of partition " + std::to_string(stage) +
        " could not be shared: " + e.what_without_backtrace());
  } catch (...) {
    error_.set(std::current_exception());
    transport_->abort_with(
        "the gradients of partition " + std::to_string(stage) +
        " could not be shared");
  }
}

void Pass::run_cell(
    const Cell& cell, int64_t lane, const ComputeOn* compute_on) {
  const auto started = trace_ ? CellClock::now() : CellClock::time_point();
  failed_in_recomputation() = false;
  try {
    if (transport_->aborted()) {
      return;  // a cell that depends on a failed one never starts
    }
    switch (cell.phase) {
      case Phase::Forward:
        forward_cell(cell.micro_batch, cell.partition, lane, compute_on);
        break;
      case Phase::Backward:
      case Phase::BackwardInput:
        backward_cell(
            cell.micro_batch,
            cell.partition,
            lane,
            cell.phase == Phase::BackwardInput,
            compute_on);
        break;
      case Phase::BackwardWeight:
        compute(compute_on, [&] {
          LaneTime time(pipeline_, cell.partition, Phase::BackwardWeight);
          pipeline_.stage(cell.partition)
              .backward_weight(
                  cells_[cell.micro_batch][cell.partition],
                  context(cell.micro_batch, cell.partition, lane));
          time.keep();
        });
        break;
      case Phase::Loss:
        loss_cell(cell.micro_batch, lane);
        break;
      case Phase::SendForward:
        transport_->send(
            Phase::Forward,
            cell.micro_batch,
            cell.partition + 1,
            std::exchange(
                forward_outbox_[cell.micro_batch][cell.partition], Packet{}));
        break;
      case Phase::SendBackward:
        transport_->send(
            Phase::Backward,
            cell.micro_batch,
            cell.partition,
            std::exchange(
                backward_outbox_[cell.micro_batch][cell.partition], Packet{}));
        break;
      case Phase::RecvForward:
        transport_->prefetch(Phase::Forward, cell.micro_batch, cell.partition);
        break;
      case Phase::RecvBackward:
        transport_->prefetch(
            Phase::Backward, cell.micro_batch, cell.partition + 1);
        break;
    }
  } catch (const Aborted&) {
    // The error that aborted the pass is recorded already.
  } catch (const RelayedFailure& e) {
    // Another process failed, and this cell met it (its receive ended):
    // that failure, as it came, not this cell's place in the plan.
    error_.set(std::current_exception());
    transport_->relay(e.origin());
  } catch (...) {
    // A backward that failed while it recomputed the forward: named so.
    const bool recomputing = std::exchange(failed_in_recomputation(), false);
    if (trace_) {  // the cell that failed, outlined in the pictures
      trace_->record(
          lane,
          cell.micro_batch,
          recomputing ? TraceKind::Recompute
                      : action_info(cell.phase).trace_kind,
          started,
          CellClock::now(),
          /*failed=*/true,
          // (A transfer is no one stage's cell: TraceEvent::stage.)
          is_transfer(cell.phase) ? -1 : cell.partition);
    }
    auto error = with_context(
        std::current_exception(),
        "partition " + std::to_string(cell.partition) + ", micro-batch " +
            std::to_string(cell.micro_batch) + phase_name(cell.phase) +
            (recomputing ? ", recomputing its forward" : ""));
    error_.set(error);
    std::string why;
    try {
      std::rethrow_exception(error);
    } catch (const c10::Error& e) {
      why = e.what_without_backtrace();
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
      why = "unknown error";
    }
    transport_->abort_with(why);
  }
}

void Pass::forward_cell(
    int64_t i, int64_t j, int64_t lane, const ComputeOn* compute_on) {
  Stage& stage = pipeline_.stage(j);
  auto& t = *transport_;
  Flow in;
  in.boundary = t.recv(Phase::Forward, i, j);
  for (const auto& key : stage.skips_in()) {
    in.skips.push_back(t.recv_skip(Phase::Forward, i, key));
  }
  auto& c = cells_[i][j];
  Flow out;
  compute(compute_on, [&] {
    LaneTime time(pipeline_, j, Phase::Forward);
    out = stage.forward(c, std::move(in), context(i, j, lane));
    time.keep();
  });
  for (const auto k : c10::irange(stage.skips_out().size())) {
    t.send_skip(
        Phase::Forward, i, stage.skips_out()[k], std::move(out.skips[k]));
  }
  if (held(j)) {
    forward_outbox_[i][j] = std::move(out.boundary);
  } else if (loss_fn == nullptr || j < n_ - 1) {
    t.send(Phase::Forward, i, j + 1, std::move(out.boundary));
  } else if (!explicit_losses_) {
    loss_cell(i, lane);
  }
}

void Pass::loss_cell(int64_t i, int64_t lane) {
  const auto j = n_ - 1;
  auto& c = cells_[i][j];
  pipeline_.stage(j).loss(c, context(i, j, lane));
  losses[i] = std::move(c.loss_value);
  c.loss_value = torch::Tensor();
}

void Pass::backward_cell(
    int64_t i,
    int64_t j,
    int64_t lane,
    bool input_only,
    const ComputeOn* compute_on) {
  Stage& stage = pipeline_.stage(j);
  auto& t = *transport_;
  Flow dy;
  // (The last stage's backward of a training step starts from its loss.)
  if (loss_fn == nullptr || j < n_ - 1) {
    dy.boundary = t.recv(Phase::Backward, i, j + 1);
  }
  for (const auto& key : stage.skips_out()) {
    dy.skips.push_back(t.recv_skip(Phase::Backward, i, key));
  }
  Flow dx;
  compute(compute_on, [&] {
    LaneTime time(
        pipeline_, j, input_only ? Phase::BackwardInput : Phase::Backward);
    dx = stage.backward(
        cells_[i][j], std::move(dy), context(i, j, lane), input_only);
    time.keep();
  });
  for (const auto k : c10::irange(stage.skips_in().size())) {
    t.send_skip(
        Phase::Backward, i, stage.skips_in()[k], std::move(dx.skips[k]));
  }
  if (held(j - 1)) {
    backward_outbox_[i][j] = std::move(dx.boundary);
  } else {
    t.send(Phase::Backward, i, j, std::move(dx.boundary));
  }
}

bool Pass::held(int64_t j) const {
  return explicit_transfers_ && j >= 0 && j + 1 < n_ &&
         lane_of_stage_[j] != lane_of_stage_[j + 1];
}

}  // namespace gpipe::detail
