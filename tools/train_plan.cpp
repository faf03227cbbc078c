// gpipe-train's --plan: a CSV plan read, checked against the pipeline the
// other flags describe, and kept in Args (see train_args.h).

#include <gpipe/plan.h>

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
    TORCH_CHECK_VALUE(
        static_cast<int64_t>(args.plan.lanes.size()) == lanes &&
            args.plan.stages == args.partitions,
        "it has ",
        args.plan.stages,
        " stages on ",
        args.plan.lanes.size(),
        " rows (lanes), but the pipeline has ",
        args.partitions,
        " partitions on ",
        lanes,
        " lanes");
  } catch (const c10::Error& e) {
    usage_check(
        false, "--plan '", args.plan_path, "': ", e.what_without_backtrace());
  }
  args.schedule = "plan";
}

}  // namespace gpipe_train
