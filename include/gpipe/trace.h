#pragma once

// Timelines of the pipeline as it really ran: every cell's lane,
// micro-batch, kind, start and end, written as Chrome trace JSON (Perfetto,
// chrome://tracing) or as a self-contained SVG picture.
//
// ```
// auto trace = std::make_shared<gpipe::Trace>();
// model->set_trace(trace);          // record from now on
// model->train_step(x, y, loss_fn);
// model->set_trace(nullptr);        // stop recording
// trace->write_chrome_json("steps.json");
// trace->write_svg("steps.svg");
// ```
//
// With no trace set, the engine pays one pointer test per cell.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gpipe {

/// What a traced interval was. Trace::add and Trace::record refuse any
/// other value (a new kind goes last, after AllReduce).
enum class TraceKind {
  Forward,    // a cell's forward (checkpointed or not)
  Backward,   // a cell's backward (after its recomputation, if any)
  Recompute,  // the recomputation of a checkpointed cell in backward
  Copy,       // moving a cell's inputs to its device
  Receive,    // waiting for a message from another rank (gpipe::dist)
  Send,       // waiting for this rank's sends to finish (gpipe::dist)
  Weight,     // the weight part of a split backward (zero-bubble schedules)
  Loss,       // a micro-batch's loss, on the last stage of a training step
  AllReduce,  // a stage's gradients averaged over the replicas (gpipe::dist
              // with a Mesh): from its start to the last bucket's end, on
              // c10d's threads while the lane goes on
};

/// "forward", "backward", "recompute", "copy", "receive", "send", "weight",
/// "loss", "all-reduce".
std::string to_string(TraceKind kind);

/// One interval on one lane. Times are microseconds since the trace began.
struct TraceEvent {
  int64_t lane = 0;
  /// -1 for what is no one micro-batch's: the wait at a pass's end for
  /// every send of the pass (Send).
  int64_t micro_batch = 0;
  TraceKind kind = TraceKind::Forward;
  double start_us = 0;
  double end_us = 0;
  /// The cell threw: the interval ends where it failed (the step's error
  /// names the same partition and micro-batch). Drawn outlined in red.
  bool failed = false;
  /// The stage (partition) whose cell this is, which tells apart the
  /// stages of a lane that holds several (interleaved, V-shaped
  /// placements); -1 for what is no one cell's: waits for other ranks
  /// (Receive, Send) and all-reduces.
  int32_t stage = -1;
};

/// What a trace says about how busy its lanes were, as `gpipe::simulate`
/// says it of a plan (but in seconds, from the clock).
struct TraceSummary {
  /// Seconds from the first interval's start to the last one's end.
  double span = 0;
  /// Per lane (row 0 to the highest one traced): the seconds it worked, the
  /// union of its intervals (overlapping ones count once). Receive and Send
  /// intervals are waits for another rank, and AllReduce ones run beside
  /// the lane: neither counts as work.
  std::vector<double> busy;
  /// Mean idle seconds within the span (span - busy) over the lanes with
  /// any event, waits included: the bubble. A rank's own trace (only its
  /// row) is then measured alone; a gathered one over every rank. Times are
  /// the host's: on CUDA lanes a cell ends when its kernels are queued.
  double bubble = 0;
  /// bubble / span; 0 for an empty trace.
  double bubble_fraction = 0;
};

/// A thread-safe recording of pipeline events.
class Trace {
 public:
  Trace();

  /// Adds an event (called by the engine's lanes); `failed`: the cell
  /// threw at `end`; `stage`: as TraceEvent::stage.
  void record(
      int64_t lane,
      int64_t micro_batch,
      TraceKind kind,
      std::chrono::steady_clock::time_point start,
      std::chrono::steady_clock::time_point end,
      bool failed = false,
      int64_t stage = -1);

  /// Adds an event whose times are already relative to origin(); throws
  /// `c10::Error` for a lane outside [0, 2^20), a stage or micro-batch
  /// below -1, a time
  /// that is not finite, or an end before the start.
  void add(const TraceEvent& event);
  /// When the trace began (times are microseconds since then).
  std::chrono::steady_clock::time_point origin() const;

  /// The events so far, by start time.
  std::vector<TraceEvent> events() const;
  /// The span, each lane's busy time and the bubble of the events so far
  /// (e.g. of one step: `clear()` before it).
  TraceSummary summary() const;
  /// Forgets every event and restarts the clock. A trace keeps every event
  /// until then (48 bytes each, one per cell and per copy and wait): a
  /// trace left on for a whole run grows with it.
  void clear();

  /// What the rows of the pictures are called: "lane" (the default), or
  /// "rank" for a trace gathered from several processes.
  void set_row_label(std::string label);
  std::string row_label() const;

  /// Chrome trace JSON: one complete ("X") event per interval, one thread
  /// per lane.
  std::string chrome_json() const;
  /// An SVG timeline: one row per lane, one box per interval coloured by
  /// kind and labelled with its micro-batch (outlined in red where the cell
  /// failed); idle time (the bubble) stays white.
  std::string svg() const;
  /// Write those to `path`; throw `c10::Error` if the file cannot be
  /// written.
  void write_chrome_json(const std::string& path) const;
  void write_svg(const std::string& path) const;

 private:
  mutable std::mutex mutex_;
  std::chrono::steady_clock::time_point origin_;
  std::vector<TraceEvent> events_;  // guarded by mutex_
  std::string row_label_ = "lane";  // guarded by mutex_
};

}  // namespace gpipe
