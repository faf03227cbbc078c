#pragma once

// What a PipelineStage holds beside its module: its connection, the engine's
// pipeline with only its own stage local, where every stage lives, and its
// pass count. Shared by pipeline_stage.cpp and gather_trace.cpp.

#include <gpipe/dist.h>
#include <gpipe/trace.h>

#include <array>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>

#include "dist/c10d_transport.h"
#include "dist/connection.h"
#include "dist/data_parallel.h"
#include "engine/pipeline.h"

namespace gpipe::dist {

struct PipelineStageImpl::Engine {
  std::shared_ptr<detail::Connection> connection;
  std::shared_ptr<gpipe::detail::Pipeline> pipeline;
  detail::Routes routes;
  int64_t stage_id = 0;
  int64_t passes = 0;   // passes started, the same count on every rank
  int64_t current = 0;  // the pass whose transport is being made
  // On the pipeline's rank 0: the hash of the plan it left in the store
  // last (Note [Telling two plans apart]).
  uint64_t published_plan = 0;
  // With replicas: per local stage (in the order of partitions()), its
  // gradients' all-reduce over the data World.
  int64_t bucket_bytes = detail::kDefaultBucketBytes;
  int64_t buckets_made_with = 0;  // the bucket_bytes `buckets` were made with
  std::vector<std::unique_ptr<detail::GradientBuckets>> buckets;
  // With replicas, on a stage without partition 0: the step's first
  // collective over the data World, begun as the step begins and finished
  // before the gradients' (Note [The first collective's words]).
  std::optional<detail::PendingFirstCollective> step_start;
  // The bucket words step_start carries (Note [The replicas' buckets
  // agree]). Set as a step begins, before its lanes run; while they run,
  // finish_step_start (on a lane, then at the step's end) reads and writes
  // step_start, step_start_failure and step_start_finishing under
  // step_start_mutex.
  std::array<int64_t, 4> step_words{};
  // How finishing step_start failed on a lane, met again at the step's end
  // (where a rank killed in another replica is named).
  std::exception_ptr step_start_failure;
  bool step_start_finishing = false;  // a call is reading the words
  std::mutex step_start_mutex;
  mutable std::mutex trace_mutex;
  std::shared_ptr<Trace> trace;  // guarded by trace_mutex

  // A pass number that also names the stage (see describe_pass).
  int64_t next_pass() {
    return (stage_id << detail::kPassBits) | ++passes;
  }

  // Finishes step_start, once (nothing if it is not pending), and throws
  // the c10::ValueError of buckets_disagree where the replicas' buckets
  // differ: before this rank's first bucket of the step starts. A failure
  // of the collective itself is kept, with `on_lane`, for the call at the
  // step's end, which throws it; until then the lane is told (false) to
  // leave its buckets unstarted (the step fails). A lane never waits for
  // words that have not arrived: it starts its buckets unchecked (true).
  bool finish_step_start(const World& data, int64_t replica, bool on_lane);

  std::shared_ptr<Trace> current_trace() const {
    std::lock_guard<std::mutex> lock(trace_mutex);
    return trace;
  }
};

}  // namespace gpipe::dist
