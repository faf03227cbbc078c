#pragma once

// gpipe-bench's sections that live in files of their own.

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gpipe::dist {
class World;
}  // namespace gpipe::dist

namespace gpipe::bench {

/// --only speed: the speed model `net` on `x` as the plain Sequential and
/// through GPipe on one and two lanes at each of `chunk_list` (only chunks 8
/// and checkpoint never when `quick`).
nlohmann::json speed_section(
    torch::nn::Sequential net,
    const torch::Tensor& x,
    int iters,
    const std::vector<int64_t>& chunk_list,
    bool quick);

/// The cost of Note [Random streams of concurrent cells] per cell: the
/// shared lease with two generator snapshots (a cell that draws nothing),
/// and the exclusive, seeded run (a cell that draws). Prints a table and
/// returns the numbers.
nlohmann::json random_section();

/// Every schedule through train_step, 4 lanes, 8 micro-batches: on
/// fixed-cost layers against their simulations ("fixed_cost": step time,
/// simulated time, bubble, bubble over 1F1B's, micro-batches held), and on
/// 16 x Linear(1024) ("real": step time and peak memory). Prints two
/// tables and returns their rows.
nlohmann::json schedules_section(int iters);

/// The planner against a measured grid on the U-Net and a CNN, 2 lanes:
/// with a memory limit below the unconstrained choice's peak, the tuned
/// choice's measured step against the grid's best, its prediction against
/// its measurement, the peaks against the limit, and the tuning time.
/// Prints a table per model and returns them.
nlohmann::json autotune_section(int iters);

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

/// Run on 4 ranks (`gpipe-run -n 4 -- gpipe-bench --only mesh`): two
/// replicas of a 2-stage pipeline; the gradient all-reduce through gpipe's
/// buckets against a bare c10d all-reduce of the same bytes, and how much
/// of a 1F1B step's all-reduce time is hidden under compute. Rank 0 prints.
nlohmann::json mesh_section(
    const gpipe::dist::World& world, int64_t width, int iters);

/// A training checkpoint of the speed tables' U-Net with Adam's state:
/// save_checkpoint and load_checkpoint per MiB against torch::save and
/// torch::load of the weights. Prints a table and returns its rows.
nlohmann::json checkpoint_section(int iters);

/// Per-cell overhead: 16 x Linear(64) at chunks 32 through 1 and 2 lanes
/// against the plain model on the same micro-batches. Prints a table and
/// returns its rows.
nlohmann::json overhead_section();

/// The engine's cost per cell (issue 28): 32 x Linear(64,64) in one
/// partition, 32 micro-batches of 64 rows, checkpoint never, one thread;
/// plain and GPipe training steps in alternation, per pair the difference
/// over the 64 cells (forward and backward), its median over 101 pairs.
/// `runs` runs; prints a row per run and returns them with their median.
nlohmann::json cell_cost_section(int runs);

/// The speed model's training step (`blocks` x Linear(`width`), batch
/// `batch`, one thread) as 1 to 32 micro-batches in turn, without the
/// engine: its matrix products, the gradient accumulation and the rest;
/// the time per sample at micro-batches of 24 to 65 rows; one weight
/// gradient over gathered micro-batches against m of them. Prints three
/// tables and returns their rows.
nlohmann::json microbatch_section(
    int64_t blocks, int64_t width, int64_t batch, int iters);

/// U-Net(2, 16), batch 64 of 3x64x64: training steps of the plain model
/// (1 and 2 threads) and of GPipe on 1, 2 and 4 lanes at 1, 4 and 32
/// micro-batches under each schedule (interleaved with 2 stages per lane).
/// Writes unet-speedup.svg (speed-up against micro-batches, with the
/// bound) and two timelines (unet-timeline-fill_drain.svg and
/// -1f1b.svg, 4 lanes, 4 micro-batches) into `svg_dir` unless it is empty.
nlohmann::json unet_speed_section(int iters, const std::string& svg_dir);

/// For `budget_mib` per device (each lane counted as one device: its
/// parameters plus the peak of what its thread allocates), the largest
/// U-Net(B, C) of a growing list whose training step fits: the plain
/// model, GPipe on 1 lane with checkpoint always, on 2 and 4 lanes with
/// fill_drain and 1f1b. Writes unet-memory.svg (peak on the fullest device
/// against parameters) into `svg_dir` unless it is empty.
nlohmann::json unet_memory_section(
    double budget_mib, const std::string& svg_dir);

/// resnet_small on Fashion-MNIST from `data_dir` (the first `limit`
/// training images, `epochs` epochs), the plain model against GPipe on 2
/// lanes at chunks 4 and 8, DeferredBatchNorm off and on, each checkpoint
/// mode, `seeds` seeds each: the top-1 test error's mean and deviation.
nlohmann::json accuracy_section(
    const std::string& data_dir, int seeds, int64_t epochs, int64_t limit);

/// `results` (gpipe-bench's JSON) as Markdown: every array of objects a
/// table, every other value a list item, under a heading per section.
std::string to_markdown(const nlohmann::json& results);

/// The same U-Net table across the ranks of a job (`gpipe-run -n N --
/// gpipe-bench --only unet-speed`): PipelineStage at 1, 4 and 32
/// micro-batches under each schedule (interleaved with 2 stages per rank),
/// against the plain model and against the same pipeline as N lanes of one
/// process, both timed on rank 0 in the same run. Rank 0 prints the table;
/// every rank returns the rows.
nlohmann::json unet_speed_dist_section(
    const gpipe::dist::World& world, int iters);

}  // namespace gpipe::bench
