#pragma once

// The order in which pipeline cells run. Pure functions over (micro-batches,
// partitions): no tensors, no threads, so the schedule can be read and tested
// on its own.

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// What a cell does.
enum class Phase {
  /// The forward of a micro-batch on a stage.
  Forward,
  /// The whole backward: input and parameter gradients together.
  Backward,
  /// The first part of a split backward (zero-bubble schedules' "B"): the
  /// gradients of the cell's inputs, sent upstream at once. Parameter
  /// gradients wait for the cell's `BackwardWeight`.
  BackwardInput,
  /// The second part (zero-bubble schedules' "W"): the gradients of the
  /// parameters, accumulated into `.grad`; nothing is sent.
  BackwardWeight,
  /// The loss of a micro-batch's output, on the last stage, between its
  /// forward and its backward: `loss_fn(output, target)`, scaled by the
  /// micro-batch's share of the batch, and the gradient of the output that
  /// the last stage's backward starts from. It takes no time step of its
  /// own in the unit-time tables. A plan without losses runs each right
  /// after its forward.
  Loss,
  // Messages between lanes (in gpipe::dist, between ranks), listed only by
  // plans that place them (`Plan::with_transfers`, or a CSV that spells
  // them as torch.distributed.pipelining does: `0SEND_F3`, `1RECV_F3`). They
  // take no time step. The stage is the one that sends or receives.
  /// Stage j sends micro-batch i's output to stage j + 1 (SEND_F). Waits
  /// for the forward of (i, j).
  SendForward,
  /// Stage j posts the receive of micro-batch i's input from stage j - 1
  /// (RECV_F), so that the message can arrive while the lane computes; the
  /// forward of (i, j) waits for it. Waits for nothing itself.
  RecvForward,
  /// Stage j sends the gradient of micro-batch i's input to stage j - 1
  /// (SEND_B). Waits for the backward (or its input part) of (i, j).
  SendBackward,
  /// Stage j posts the receive of the gradient of micro-batch i's output
  /// from stage j + 1 (RECV_B); the backward of (i, j) waits for it.
  RecvBackward,
};

/// A send or receive between lanes.
inline bool is_transfer(Phase phase) {
  return phase == Phase::SendForward || phase == Phase::RecvForward ||
         phase == Phase::SendBackward || phase == Phase::RecvBackward;
}

/// One unit of pipeline work: micro-batch `micro_batch` through partition
/// `partition`, in one direction.
struct Cell {
  int64_t micro_batch = 0;
  int64_t partition = 0;
  Phase phase = Phase::Forward;

  bool operator==(const Cell& other) const {
    return micro_batch == other.micro_batch && partition == other.partition &&
           phase == other.phase;
  }
};

/// A schedule: steps in order; the cells of one step may run at the same time.
using Steps = std::vector<std::vector<Cell>>;

/// GPipe's forward clock cycles: `m + n - 1` steps, step `k` holds the cells
/// `(k - j, j)` for every partition `j` with `0 <= k - j < m`.
/// Example (m=3, n=3): [(0,0)] [(1,0),(0,1)] [(2,0),(1,1),(0,2)] [(2,1),(1,2)]
/// [(2,2)].
Steps clock_cycles(int64_t micro_batches, int64_t partitions);

/// Fill-drain backward: the forward clock cycles in reverse, every cell in
/// reverse order, with `Phase::Backward`. Partition `j` sees micro-batches
/// `m-1, ..., 0`.
Steps reverse_clock_cycles(int64_t micro_batches, int64_t partitions);

/// The cells of one partition in the order the steps give them. A lane runs
/// exactly this list, one cell after the other.
std::vector<Cell> cells_of_partition(const Steps& steps, int64_t partition);

/// "F(0,1)" / "B(2,0)" / "I(2,0)" / "W(2,0)" / "L(2,3)" / "SEND_F(2,0)"
/// (micro-batch, stage): for messages and test output. "I" is the
/// input-gradient part of a split backward, "L" a loss.
std::string to_string(const Cell& cell);

/// The order of forward and backward cells in a training step.
enum class Schedule {
  /// GPipe: every forward (clock cycles), then every backward (reversed).
  /// Partition j holds all m micro-batches' activations when backward
  /// starts.
  FillDrain,
  /// PipeDream-flush: partition j runs n - j - 1 forwards, then alternates
  /// one forward and one backward, then drains the backwards. It holds at
  /// most n - j micro-batches in flight; the bubble is the same.
  OneFOneB,
  /// Megatron-LM's interleaved 1F1B: each lane holds v stages
  /// (`GPipeOptions::stages_per_lane`), stage j on lane j % n, and runs
  /// them in groups of n micro-batches; the bubble shrinks to (n-1)/(v m)
  /// of the ideal step. Best when the micro-batches are a multiple of the
  /// lanes. With v = 1 it is OneFOneB.
  Interleaved1F1B,
  /// ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (2023): every
  /// backward is split into its input part (B, sent upstream at once) and
  /// its parameter part (W); stage j defers its W by j micro-batches to
  /// fill the bubble of the drain. The bubble is about a third of 1F1B's
  /// when F, B and W cost alike; every lane holds at most n micro-batches,
  /// 1F1B's peak (its first stage's).
  ZeroBubble,
  /// ZB-V of Qi et al. (2024): two stages per lane in a V
  /// (`Placement::v_shape`: stage j and 2n - 1 - j on lane j), backwards
  /// split as in ZeroBubble. The first and the last stage share lane 0, so
  /// a micro-batch's backward starts where its forward began, and the
  /// weight parts fill the fill and the drain: with F, B and W of one cost
  /// and m >= 2n the bubble is what a V's own fill costs, about a sixth of
  /// 1F1B's, at 1F1B's peak activation memory. Needs stages_per_lane 2.
  ZeroBubbleV,
  /// Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
  /// 2022; torch.distributed.pipelining's ScheduleLoopedBFS): on each lane
  /// every micro-batch's forward through its first stage, then through its
  /// next stage, ...; then the backwards, last stage first. Several stages
  /// per lane (stage j on lane j % n) as interleaved; holds every
  /// micro-batch like fill-drain. With one stage per lane it is fill-drain.
  LoopedBFS,
};

/// Every schedule, in the enum's order.
const std::vector<Schedule>& schedules();

/// "fill_drain" / "1f1b" / "interleaved" / "zero_bubble" / "zero_bubble_v"
/// / "looped_bfs".
std::string to_string(Schedule schedule);
/// Parses those names; throws c10::ValueError otherwise.
Schedule schedule_from_string(const std::string& name);

/// The compute cells (forwards and backwards, no losses) partition
/// `partition` runs in a training step under `schedule`, in order, with one
/// lane per partition. ZeroBubbleV has no such order (it needs two stages
/// per lane in a V: use make_plan) and is refused with a `c10::ValueError`.
std::vector<Cell> lane_order(
    Schedule schedule,
    int64_t micro_batches,
    int64_t partitions,
    int64_t partition);

/// A whole training step as steps of unit-time cells: each lane runs its
/// `lane_order` and a cell starts at the first step after the cells it
/// depends on (the same micro-batch on the previous partition in forward,
/// on the next partition and its own forward in backward). Shows where the
/// bubbles are; `cells_of_partition` of the result is `lane_order`.
Steps training_steps(
    Schedule schedule, int64_t micro_batches, int64_t partitions);

/// The most micro-batches held between their forward and their (last part
/// of) backward when a lane runs `cells` in order.
int64_t max_in_flight(const std::vector<Cell>& cells);

}  // namespace gpipe
