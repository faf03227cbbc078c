// gpipe-train's layout flags: --pipeline-size, --partitions, --balance and
// --stages-per-lane against the ranks a launcher started and the model's
// layers (part of verify_args, in train_args.cpp).

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "train_args.h"

namespace gpipe_train {

namespace {

// a / b rounded up, for a >= 0 and b >= 1, without overflow (a
// --batch-size near 2^63 made `a + b - 1` wrap, and the division by zero
// that followed killed gpipe-train with SIGFPE).
int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

// The micro-batches Tensor::chunk cuts `rows` into when asked for `chunks`.
int64_t pieces(int64_t rows, int64_t chunks) {
  return ceil_div(rows, ceil_div(rows, chunks));
}

// "the pipeline has 2 ranks (...) with 1 partition each", for messages.
std::string pipeline_of(const Args& args, int64_t pipeline_ranks) {
  return c10::str(
      "the pipeline has ",
      pipeline_ranks,
      " ranks (--pipeline-size, of the ",
      args.world_size,
      " the launcher started) with ",
      count_of(args.stages_per_lane, "partition", "partitions"),
      " each");
}

}  // namespace

std::string uneven_cut(int64_t rows, int64_t chunks) {
  if (chunks < 1 || chunks > rows || pieces(rows, chunks) == chunks) {
    return "";  // (more micro-batches than rows is refused on its own)
  }
  int64_t below = chunks - 1;
  while (pieces(rows, below) != below) {
    --below;  // 1 always fits
  }
  int64_t above = chunks + 1;
  while (pieces(rows, above) != above) {
    ++above;  // `rows` always fits
  }
  return c10::str(
      "cut into ",
      count_of(pieces(rows, chunks), "micro-batch", "micro-batches"),
      " of up to ",
      ceil_div(rows, chunks),
      " rows, not ",
      chunks,
      " (Tensor::chunk's pieces); ",
      below,
      " or ",
      above,
      " micro-batches cut them, as does any number of rows that ",
      chunks,
      " divides");
}

std::string rows_of_a_batch(const Args& args, int64_t replicas) {
  const int64_t rows = args.batch_size / replicas;
  return replicas > 1 ? c10::str(
                            "the ",
                            rows,
                            " rows of each replica's shard (--batch-size ",
                            args.batch_size,
                            " over ",
                            replicas,
                            " replicas)")
                      : c10::str("the ", rows, " rows of a batch");
}

void verify_layout(const CLI::App& app, Args& args, bool per_lane) {
  const auto& spec = model_spec(args.model);
  // Across ranks: partition j on rank j % ranks, stages_per_lane partitions
  // per rank (2 for the interleaved schedule unless told otherwise).
  int64_t ranks_partitions = 0;
  usage_check(
      args.pipeline_size >= 0,
      "--pipeline-size must be 0 (all ranks) or positive, but got ",
      args.pipeline_size);
  usage_check(
      args.world_size > 1 || args.pipeline_size <= 1,
      "--pipeline-size ",
      args.pipeline_size,
      " needs a launcher with as many ranks or a multiple (gpipe-run -n N or "
      "torchrun), but this is one process");
  if (args.pipeline_size == 0) {
    args.pipeline_size = args.world_size;
  }
  usage_check(
      args.world_size % args.pipeline_size == 0,
      "--pipeline-size ",
      args.pipeline_size,
      " must divide the ",
      args.world_size,
      " ranks the launcher started (WORLD_SIZE)");
  // Replicas train on equal shards of every batch (their step refuses
  // others).
  const int64_t replicas = args.world_size / args.pipeline_size;
  usage_check(
      args.batch_size % replicas == 0,
      "--batch-size ",
      args.batch_size,
      " must split evenly over the ",
      replicas,
      " replicas (--pipeline-size ",
      args.pipeline_size,
      " of ",
      args.world_size,
      " ranks): give a multiple of ",
      replicas);
  // Each replica cuts its own shard into the micro-batches (a --plan's
  // count is checked when it is read).
  usage_check(
      args.autotune || replicas == 1 || app.count("--plan") > 0 ||
          args.chunks <= args.batch_size / replicas,
      "--chunks ",
      args.chunks,
      " is more than each replica's shard of ",
      count_of(args.batch_size / replicas, "row", "rows"),
      " (--batch-size ",
      args.batch_size,
      " over ",
      replicas,
      " replicas); every micro-batch needs at least one sample");
  // A --chunks that the batch does not cut into would run fewer
  // micro-batches than the run reports (a --plan's is checked when it is
  // read).
  if (!args.autotune && app.count("--plan") == 0) {
    const auto why = uneven_cut(args.batch_size / replicas, args.chunks);
    usage_check(
        why.empty(),
        "--chunks ",
        args.chunks,
        ": ",
        rows_of_a_batch(args, replicas),
        " ",
        why);
  }
  const int64_t pipeline_ranks = args.pipeline_size;
  if (args.world_size > 1) {
    // The autograd schedule needs the whole pipeline in one process.
    if (!per_lane) {
      args.stages_per_lane = own_stages_per_lane(args.schedule);
    }
    ranks_partitions = pipeline_ranks * args.stages_per_lane;
    if (app.count("--partitions") == 0 && app.count("--balance") == 0) {
      args.partitions = ranks_partitions;
    }
    usage_check(
        app.count("--partitions") == 0 || args.partitions == ranks_partitions,
        "--partitions is ",
        args.partitions,
        ", but ",
        pipeline_of(args, pipeline_ranks),
        ": give ",
        ranks_partitions,
        " or leave out --partitions");
    if (app.count("--schedule") == 0) {
      args.schedule = "fill_drain";
    }
    usage_check(
        args.schedule != "autograd",
        "--schedule autograd runs in one process; across ranks use ",
        train_step_schedules());
  }
  // Partitions taken from the launcher's ranks: the layers cap the ranks.
  usage_check(
      args.world_size == 1 || app.count("--partitions") > 0 ||
          app.count("--balance") > 0 || args.partitions <= spec.layers,
      pipeline_of(args, pipeline_ranks),
      ", ",
      args.partitions,
      " partitions in all, but --model ",
      spec.name,
      " has ",
      spec.layers,
      " layers, one partition each at most: start fewer ranks, give a "
      "smaller --pipeline-size",
      app.count("--stages-per-lane") > 0 ? " or fewer --stages-per-lane" : "");
  usage_check(
      args.partitions >= 1 && args.partitions <= spec.layers,
      "--partitions must be between 1 and ",
      spec.layers,
      " (the layers of --model ",
      spec.name,
      "), but got ",
      args.partitions);
  if (app.count("--balance") > 0) {
    args.balance = parse_balance(args.balance_text);
    const auto n = static_cast<int64_t>(args.balance.size());
    usage_check(
        app.count("--partitions") == 0 || args.partitions == n,
        "--balance '",
        args.balance_text,
        "' has ",
        count_of(n, "entry", "entries"),
        ", but --partitions is ",
        args.partitions,
        "; give one entry per partition or leave out --partitions");
    int64_t sum = 0;
    for (const auto b : args.balance) {
      // Also keeps the sum from overflowing.
      usage_check(
          b <= spec.layers,
          "--balance '",
          args.balance_text,
          "' has an entry of ",
          b,
          ", but --model ",
          spec.name,
          " has only ",
          spec.layers,
          " layers");
      sum += b;
    }
    usage_check(
        sum == spec.layers,
        "--balance '",
        args.balance_text,
        "' sums to ",
        sum,
        ", but --model ",
        spec.name,
        " has ",
        spec.layers,
        " layers");
    usage_check(
        args.world_size == 1 || n == ranks_partitions,
        "--balance '",
        args.balance_text,
        "' has ",
        count_of(n, "entry", "entries"),
        ", but ",
        pipeline_of(args, pipeline_ranks),
        "; give ",
        ranks_partitions,
        " entries");
    args.partitions = n;
  } else if (args.partitions == 2 && !spec.two_way_balance.empty()) {
    args.balance = spec.two_way_balance;
  } else {
    args.balance = even_balance(spec.layers, args.partitions);
  }
}

}  // namespace gpipe_train
