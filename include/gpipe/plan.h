#pragma once

// Plans: a schedule written out as data. For each lane (a worker thread, or
// later a process), the ordered cells it runs: forward or backward of one
// micro-batch on one stage. Forward passes, autograd's backward and
// train_step all run plans, and a schedule (fill-drain, 1F1B) is a function
// that builds one. Plans are pure data: no tensors, no threads.

#include <gpipe/placement.h>
#include <gpipe/schedule.h>

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace gpipe {

/// The ordered cells (actions) of every lane.
///
/// A stage (partition) belongs to exactly one lane; a lane may hold several
/// stages (as interleaved schedules put several on one device). Each lane
/// runs its cells one after the other; a cell waits for its inputs: the
/// forward of micro-batch i on stage j for the forward of (i, j-1), the
/// backward (or its input part) of (i, j) for the backward (or input part)
/// of (i, j+1) and for its own forward, the weight part for the input part,
/// the loss of (i, last stage) for that cell's forward, and the last
/// stage's backward for its loss.
///
/// A training step's plan gives every cell a forward and either a whole
/// backward or both parts of a split one; cells of both kinds may mix. Its
/// losses (`Phase::Loss`) are either all listed, each where the last
/// stage's lane runs it, or none (then each runs right after its forward,
/// as in plans written for torch.distributed.pipelining).
///
/// Messages between lanes (in gpipe::dist, ranks) are sent as soon as a
/// cell is done and received when the cell that needs them starts, unless
/// the plan lists them (`with_transfers`, or `0SEND_F3`-style actions in
/// CSV). A plan that lists any transfer lists every message of a stage's
/// boundary between lanes (forward output and input gradient; skips stay
/// implicit): stage j's `SendForward` of micro-batch i after its forward,
/// stage j + 1's `RecvForward` before its forward, and likewise
/// `SendBackward` and `RecvBackward` in backward. A send then happens where
/// the plan puts it (the message waits in the sender until then), and a
/// receive is posted where the plan puts it, so that it can arrive while
/// the lane computes; the cell that needs it still waits for it. Transfers
/// take no time step, and in one process a receive has nothing to post.
struct Plan {
  int64_t micro_batches = 0;
  int64_t stages = 0;
  /// lanes[l]: the cells lane l runs, in order.
  std::vector<std::vector<Cell>> lanes;
  /// Which lane runs each stage. Empty: the lane whose row lists the
  /// stage's cells. `make_plan` always sets it; a pipeline runs a plan only
  /// when it is the pipeline's own placement.
  Placement placement;

  /// Throws `c10::ValueError` naming the first problem: a cell outside
  /// (micro_batches, stages), a cell listed twice, a stage on two lanes,
  /// forwards or backwards present for some cells but not all, a cell with
  /// a whole backward and a split one, half a split backward, or a cell
  /// whose inputs can never be ready (the lanes would deadlock); a loss
  /// on another stage than the last, without its forward, or listed for
  /// some micro-batches but not all; a transfer between stages of one lane,
  /// without the cells it connects, or missing while others are listed;
  /// a placement of other stages or lanes than the plan's, or a cell on
  /// another lane than its placement's.
  void validate() const;

  /// This plan with every message between lanes listed: each send right
  /// after the cell that makes it, each receive posted before the compute
  /// action that precedes its consumer on the lane (so that it arrives
  /// while the lane computes). Transfers the plan lists already are placed
  /// anew. What gpipe::dist's `train_step` and `forward` run.
  Plan with_transfers() const;

  /// One row per lane, one action per column, in torch.distributed
  /// .pipelining's spelling: `<stage><kind><micro-batch>`, kind F
  /// (forward), B (backward; the input part when the same cell has a W),
  /// W (weight part), L (loss; gpipe's own letter), SEND_F, RECV_F, SEND_B,
  /// RECV_B (transfers), e.g. `0F3,1F3,1L3,1B3,1W3` or
  /// `0F3,0SEND_F3,0RECV_B3,0B3`. Lanes with no actions are empty rows.
  /// A placement other than `Placement::modulo`, or any placement of a plan
  /// of 0 micro-batches, comes first, on a line of its own:
  /// `# placement: 0 1 1 0` (stage j's lane, in stage order).
  std::string to_csv() const;
  /// Reads `to_csv()`'s format (also `I` for an input part, as newer
  /// PyTorch writes it; empty columns are skipped; blank lines at the end
  /// or above a placement line are not lanes, a blank line between rows is an
  /// empty lane; other lines starting with `#` are comments, except one that
  /// starts like a placement line, `#placement 0 1` say, which is refused; a
  /// UTF-8 byte order mark first is skipped). micro_batches and stages are the
  /// largest indices plus one; lanes are the rows, or the placement line's
  /// lanes when more. A placement line must come before the rows of actions and
  /// place as many stages as the actions use (in a plan of 0 micro-batches,
  /// the stages it places). Without a
  /// placement line the placement is the one the rows show when each
  /// stage's cells are on one row, else empty. Throws `c10::ValueError`
  /// naming the row, column and text of a malformed action, or a malformed
  /// placement line, or one of another length; the plan is not
  /// validated (call `validate()`, whose work follows the actions listed,
  /// not micro_batches x stages).
  static Plan from_csv(const std::string& text);

  /// The lane that runs `stage`: its placement's, or without one the lane
  /// that runs its cells, or -1 when none does.
  int64_t lane_of(int64_t stage) const;

  /// Unit-time simulation: every cell takes one step and starts at the
  /// first step after its lane's previous cell and its inputs; a loss or a
  /// transfer takes no step and is listed at the end of the step in which
  /// both its inputs and its lane's previous action are done (a receive
  /// first on its lane, at the start of step 0). Shows
  /// where the bubbles are. Throws like `validate()` when the plan
  /// deadlocks.
  Steps steps() const;
};

/// Where `schedule` runs on `lanes` lanes with `stages_per_lane` stages on
/// each: `Placement::modulo(lanes, stages_per_lane)` (stage j on lane
/// j % lanes), or for `Schedule::ZeroBubbleV` (which needs 2 stages per
/// lane) `Placement::v_shape(lanes)`. With `stages_per_lane` 0 the schedule
/// chooses: 2 for interleaved, looped BFS and ZB-V, 1 for the others.
/// Throws `c10::ValueError` for `lanes` below 1, a negative
/// `stages_per_lane`, or one the schedule cannot run on.
Placement placement_for(
    Schedule schedule, int64_t lanes, int64_t stages_per_lane = 0);

/// The training step of `schedule` on `lanes` lanes holding
/// `stages_per_lane` stages each, for `micro_batches` micro-batches, on
/// `placement_for(schedule, lanes, stages_per_lane)`: with
/// `stages_per_lane` 0 (the default) the schedule chooses, as there.
/// Throws `c10::ValueError` for `lanes` below 1, negative sizes (0
/// micro-batches gives an empty plan), or a `stages_per_lane` the
/// schedule cannot run on.
Plan make_plan(
    Schedule schedule,
    int64_t micro_batches,
    int64_t lanes,
    int64_t stages_per_lane = 0);

/// The training step of `schedule` for `micro_batches` micro-batches on
/// `placement`'s lanes; the plan carries the placement. Fill-drain, 1F1B
/// and zero bubble run on any placement (each lane runs its stages' cells
/// in the order of the one-lane-per-stage plan's time steps), as does
/// looped BFS; interleaved 1F1B needs `Placement::modulo` where a lane
/// holds several stages (with one stage per lane it is 1F1B, on any
/// placement) and ZB-V `Placement::v_shape`. Every micro-batch's loss is listed
/// right after the last stage's forward. Throws `c10::ValueError` naming the
/// schedule and the placement it needs when the placement does not fit.
Plan make_plan(
    Schedule schedule, int64_t micro_batches, const Placement& placement);

/// What each action costs in `simulate`, in any time unit.
struct ActionCosts {
  double forward = 1.0;
  double backward = 2.0;         // a whole backward
  double backward_input = 1.0;   // the input part of a split backward
  double backward_weight = 1.0;  // the weight part
  double loss = 0.0;
  /// Added to a cell's start when an input comes from another lane (a
  /// listed send on another lane, too). Listed transfers cost nothing
  /// themselves, and `cost` is not asked about them.
  double transfer = 0.0;
  /// When set, the cost of each action (e.g. by stage); the fields above
  /// are then unused but `transfer`.
  std::function<double(const Cell&)> cost;
};

/// One action as simulated.
struct SimulatedAction {
  Cell cell;
  double start = 0;
  double end = 0;
};

/// A plan run with fixed action costs: each lane runs its cells in order,
/// each starting as soon as its lane is free and its inputs are done.
struct Simulation {
  /// From the first start to the last end.
  double makespan = 0;
  /// Per lane: the time it computes.
  std::vector<double> busy;
  /// Mean idle time per lane (makespan - busy): the bubble.
  double bubble = 0;
  /// bubble / makespan.
  double bubble_fraction = 0;
  /// Per stage: the most micro-batches between their forward and the end
  /// of their backward (their weight part when split): activation memory.
  std::vector<int64_t> peak_live;
  /// Per lane: the most micro-batches its stages hold together.
  std::vector<int64_t> lane_peak_live;
  /// Per lane: its actions with their times.
  std::vector<std::vector<SimulatedAction>> lanes;
};

/// Simulates `plan` (validated first: throws like `validate()`).
Simulation simulate(const Plan& plan, const ActionCosts& costs = {});

/// One lane per stage, forwards only, in GPipe's clock-cycle order.
Plan forward_plan(int64_t micro_batches, int64_t stages);

/// One lane per stage, backwards only, fill-drain's reversed clock cycles.
Plan backward_plan(int64_t micro_batches, int64_t stages);

/// One lane per stage, forwards and backwards of a training step in the
/// order `schedule` gives; its placement is `Placement::modulo(stages)`.
Plan training_plan(Schedule schedule, int64_t micro_batches, int64_t stages);

/// A table of lanes by time step (the unit-time simulation), e.g.
/// ```
/// lane 0 | F0 F1 .  .  B1 B0
/// lane 1 | .  F0 F1 B1 B0 .
/// ```
/// (with the stage before the letter when a lane holds several stages; a
/// split backward prints as B then W; losses take no step and are not
/// shown, nor are transfers).
std::ostream& operator<<(std::ostream& out, const Plan& plan);

}  // namespace gpipe
