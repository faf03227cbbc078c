#pragma once

// gpipe-bench's sections that live in files of their own.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace gpipe::dist {
class World;
}  // namespace gpipe::dist

namespace gpipe::bench {

/// The cost of Note [Random streams of concurrent cells] per cell: the
/// shared lease with two generator snapshots (a cell that draws nothing),
/// and the exclusive, seeded run (a cell that draws). Prints a table and
/// returns the numbers.
nlohmann::json random_section();

/// The four schedules through train_step, 4 lanes, 8 micro-batches: on
/// fixed-cost layers against their simulations ("fixed_cost": step time,
/// simulated time, bubble, bubble over 1F1B's, micro-batches held), and on
/// 16 x Linear(1024) ("real": step time and peak memory). Prints two
/// tables and returns their rows.
nlohmann::json schedules_section(int iters);

/// 8 x Conv2d(32,32,3)+ReLU, batch 64: training steps of the plain model
/// and of GPipe on 2 lanes at chunks 1 and 4 (one thread each), with
/// their minor page faults. Prints a table and returns its rows.
nlohmann::json conv_section(int iters);

/// Forward under InferenceMode of `blocks` x Linear(`width`), batch
/// `batch`: the plain model on 1 and 2 threads, GPipe on 2 partitions at
/// chunks 1, 4 and 8. Prints a table and returns its rows.
nlohmann::json inference_section(
    int64_t blocks, int64_t width, int64_t batch, int iters);

/// Training steps with a gpipe::Trace recording against none, on the speed
/// model (`blocks` x Linear(`width`), batch `batch`, `iters` rounds) and on
/// a tiny-layer model, and one recorded event alone. Returns "trace" (per
/// model) and "event_seconds".
nlohmann::json trace_section(
    int64_t blocks, int64_t width, int64_t batch, int iters);

/// Run on every rank of a job (`gpipe-run -n 2 -- gpipe-bench --only
/// dist`): PipelineStage's training step against the single-process
/// 2-lane GPipe on the same model, one gpipe message against a bare c10d
/// send/recv, and a timeline of one step written to `trace_prefix`.svg and
/// .json. Rank 0 prints the tables; every rank returns its numbers.
nlohmann::json dist_section(
    const gpipe::dist::World& world,
    int64_t blocks,
    int64_t width,
    int64_t batch,
    int iters,
    const std::string& trace_prefix);

}  // namespace gpipe::bench
