// gpipe-train's --save and --load: the model's weights in a file, as
// torch::save of the GPipe writes them (gpipe::load_into_sequential reads
// such a file into the plain model).

#include <system_error>

#include "train_args.h"

namespace gpipe_train {

void add_save_options(CLI::App& app, Args& args) {
  app.add_option(
      "--save",
      args.save_path,
      "After each epoch, write the model's weights here (torch::save of the "
      "GPipe; gpipe::load_into_sequential reads it into the plain model)");
  app.add_option(
      "--load",
      args.load_path,
      "Before training, read the model's weights from here (written by "
      "--save, or by torch::save of the plain model or of a GPipe of it with "
      "any balance)");
}

void verify_save_options(const CLI::App& app, const Args& args) {
  const bool save = app.count("--save") > 0;
  const bool load = app.count("--load") > 0;
  usage_check(
      !(save || load) || args.world_size == 1,
      save ? "--save" : "--load",
      " runs in one process, but the launcher started ",
      args.world_size,
      " ranks (WORLD_SIZE), each holding only its own partitions");
  if (save) {
    verify_output_path("--save", args.save_path);
  }
  if (load) {
    std::error_code error;
    usage_check(
        fs::is_regular_file(args.load_path, error),
        "--load '",
        args.load_path,
        "' is not a readable file");
  }
}

}  // namespace gpipe_train
