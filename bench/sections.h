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

/// FillDrain against OneFOneB through train_step on 16 x Linear(256), batch
/// 4096, checkpoint never, 2 and 4 lanes: step time (in alternation) and
/// peak memory. Prints a table and returns its rows.
nlohmann::json schedules_section(int iters);

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
