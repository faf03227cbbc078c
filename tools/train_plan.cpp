// gpipe-train's --plan: a CSV plan read, checked against the pipeline the
// other flags describe, and kept in Args (see train_args.h).

#include <gpipe/plan.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <system_error>

#include "train_args.h"

namespace gpipe_train {

void read_plan(const CLI::App& app, Args& args) {
  if (app.count("--plan") == 0) {
    return;
  }
  usage_check(
      app.count("--schedule") == 0,
      "--plan and --schedule both say how to run a step; give one");
  std::error_code error;
  usage_check(
      fs::is_regular_file(args.plan_path, error),
      "--plan '",
      args.plan_path,
      "' is not a readable file");
  std::ifstream in(args.plan_path);
  std::stringstream text;
  text << in.rdbuf();
  const auto lanes = args.partitions / args.stages_per_lane;
  try {
    args.plan = gpipe::Plan::from_csv(text.str());
    args.plan.validate();
    // (A plan of no micro-batches is a plan, of nothing to train.)
    TORCH_CHECK_VALUE(
        args.plan.micro_batches > 0,
        "it has no actions (0 micro-batches); training needs a forward and "
        "a backward of every micro-batch on every stage");
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(args.plan.lanes.size()) == lanes &&
            args.plan.stages == args.partitions,
        "it has ",
        count_of(args.plan.stages, "stage", "stages"),
        " on ",
        count_of(
            static_cast<int64_t>(args.plan.lanes.size()),
            "row (lane)",
            "rows (lanes)"),
        ", but the pipeline has ",
        count_of(args.partitions, "partition", "partitions"),
        " on ",
        count_of(lanes, "lane", "lanes"));
    // Under a launcher lane l is pipeline rank l, and rank 0 reads the
    // images: PipelineStage would refuse another placement once the model
    // is built and balanced.
    TORCH_CHECK_VALUE(
        args.world_size <= 1 || args.plan.placement.empty() ||
            args.plan.placement.lane_of(0) == 0,
        "under a launcher pipeline rank 0 reads the images, so partition 0 "
        "must be on lane 0, but its placement ",
        gpipe::to_string(args.plan.placement),
        " puts it on lane ",
        args.plan.placement.empty() ? 0 : args.plan.placement.lane_of(0));
    // validate() takes a forward-only plan (inference); train_step would
    // refuse it after the model is built.
    int64_t forwards = 0;
    bool backward = false;
    for (const auto& row : args.plan.lanes) {
      for (const auto& c : row) {
        forwards += c.phase == gpipe::Phase::Forward ? 1 : 0;
        backward = backward || c.phase == gpipe::Phase::Backward ||
                   c.phase == gpipe::Phase::BackwardInput;
      }
    }
    TORCH_CHECK_VALUE(
        backward,
        "it has ",
        count_of(forwards, "forward", "forwards"),
        " and no backward; training needs a plan with a B (or an I and a "
        "W) for every F");
  } catch (const c10::Error& e) {
    usage_check(
        false, "--plan '", args.plan_path, "': ", e.what_without_backtrace());
  }
  // Every mini-batch must cut into the plan's micro-batches, or no step
  // would run: --chunks defaults to the plan's count, and a --chunks given
  // must agree with it.
  const auto m = args.plan.micro_batches;
  if (m != args.chunks) {
    usage_check(
        app.count("--chunks") == 0,
        "--plan '",
        args.plan_path,
        "' is for ",
        count_of(m, "micro-batch", "micro-batches"),
        ", but --chunks is ",
        args.chunks,
        "; give --chunks ",
        m,
        " or leave --chunks out");
    args.chunks = m;
    args.chunks_from_plan = true;
  }
  // Under a launcher with replicas, each cuts its own shard.
  const int64_t replicas =
      args.pipeline_size > 0 ? args.world_size / args.pipeline_size : 1;
  const int64_t rows = args.batch_size / std::max<int64_t>(replicas, 1);
  usage_check(
      args.chunks <= rows,
      "--plan '",
      args.plan_path,
      "' is for ",
      count_of(m, "micro-batch", "micro-batches"),
      ", more than ",
      replicas > 1 ? c10::str(
                         "each replica's shard of ",
                         count_of(rows, "row", "rows"),
                         " (--batch-size ",
                         args.batch_size,
                         " over ",
                         replicas,
                         " replicas)")
                   : c10::str("--batch-size ", args.batch_size),
      "; every micro-batch needs at least one sample");
  // Or every batch would be left out: a step runs the plan's count only.
  const auto why = uneven_cut(rows, m);
  usage_check(
      why.empty(),
      "--plan '",
      args.plan_path,
      "' is for ",
      count_of(m, "micro-batch", "micro-batches"),
      ", but ",
      rows_of_a_batch(args, std::max<int64_t>(replicas, 1)),
      " ",
      why);
  args.schedule = "plan";
}

gpipe::Placement pipeline_placement(const Args& args) {
  if (args.schedule == "plan" && !args.plan.placement.empty()) {
    return args.plan.placement;  // a --plan that carries one runs on it
  }
  const auto v = args.stages_per_lane;
  if (args.schedule == "plan" || args.schedule == "autograd") {
    return gpipe::Placement::modulo(args.partitions / v, v);
  }
  return gpipe::placement_for(
      gpipe::schedule_from_string(args.schedule), args.partitions / v, v);
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names{"autograd"};
  for (const auto s : gpipe::schedules()) {
    names.push_back(gpipe::to_string(s));
  }
  return names;
}

std::string train_step_schedules() {
  const auto& all = gpipe::schedules();
  std::string out;
  for (size_t k = 0; k < all.size(); ++k) {
    out += (k == 0                ? ""
            : k + 1 == all.size() ? " or "
                                  : ", ") +
           gpipe::to_string(all[k]);
  }
  return out;
}

namespace {

// The placement the named schedule chooses on 2 lanes; none for
// "autograd" and "plan".
gpipe::Placement own_placement(const std::string& schedule) {
  if (schedule == "autograd" || schedule == "plan") {
    return gpipe::Placement();
  }
  return gpipe::placement_for(gpipe::schedule_from_string(schedule), 2);
}

}  // namespace

int64_t own_stages_per_lane(const std::string& schedule) {
  const auto p = own_placement(schedule);
  return p.empty() ? 1 : p.stages() / p.lanes();
}

bool runs_in_a_v(const std::string& schedule) {
  const auto p = own_placement(schedule);
  return !p.empty() && p == gpipe::Placement::v_shape(2);
}

}  // namespace gpipe_train
