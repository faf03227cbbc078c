// gpipe-train's --save, --load and --resume: the model's weights in a
// file, as torch::save of the GPipe writes them (gpipe::load_into_sequential
// reads such a file into the plain model), and beside it the state that
// --resume needs to go on as if the run had not stopped.

#include <ATen/CPUGeneratorImpl.h>
#include <gpipe/gpipe.h>
#include <gpipe/serialize.h>
#include <torch/serialize.h>

#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
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
  app.add_flag(
      "--resume",
      args.resume,
      "Go on from the last epoch --save wrote: its weights, and the "
      "optimizer, random state and step count saved beside them (<save>"
      ".state); train up to --epochs. Without saved files, start at epoch 1");
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
  usage_check(
      !args.resume || save,
      "--resume goes on from the files --save writes; give --save too");
  usage_check(
      !args.resume || !load,
      "--resume and --load both give the starting weights; give one");
  if (load) {
    std::error_code error;
    usage_check(
        fs::is_regular_file(args.load_path, error),
        "--load '",
        args.load_path,
        "' is not a readable file");
  }
}

namespace {

// The settings that a resumed run must share with the saved one: they
// decide the data, its order and the updates.
std::map<std::string, std::string> settings_of(const Args& args) {
  std::ostringstream lr;
  lr.precision(17);
  lr << args.lr;
  return {
      {"--model", args.model},
      {"--batch-size", std::to_string(args.batch_size)},
      {"--limit", std::to_string(args.limit)},
      {"--seed", std::to_string(args.seed)},
      {"--lr", lr.str()},
      // A decaying rate follows the run's length: resuming with another
      // --epochs would change it.
      {"--lr-schedule",
       args.lr_schedule == "constant" ? args.lr_schedule
                                      : args.lr_schedule + " over --epochs " +
                                            std::to_string(args.epochs)},
      {"--deferred-batch-norm", args.deferred_batch_norm ? "on" : "off"}};
}

std::string text_of(const std::map<std::string, std::string>& settings) {
  std::string text;
  for (const auto& [flag, value] : settings) {
    text += flag + "=" + value + "\n";
  }
  return text;
}

std::map<std::string, std::string> parse_settings(const std::string& text) {
  std::map<std::string, std::string> settings;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) {
      settings[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }
  return settings;
}

// A fingerprint of the weights file, kept in the state file: a run killed
// between the two renames leaves files of two epochs, which resuming
// refuses.
std::string fingerprint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "cannot read ", path);
  const std::string bytes(
      (std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return std::to_string(bytes.size()) + ":" +
         std::to_string(std::hash<std::string>{}(bytes));
}

void rename_into_place(const std::string& from, const std::string& to) {
  std::error_code error;
  fs::rename(from, to, error);
  TORCH_CHECK(
      !error, "cannot rename ", from, " to ", to, ": ", error.message());
}

}  // namespace

std::string state_path(const Args& args) {
  return args.save_path + ".state";
}

void save_training(
    const Args& args,
    const gpipe::GPipe& model,
    const torch::optim::Optimizer& optimizer,
    int64_t epochs_done,
    int64_t steps_done) {
  const auto weights_tmp = args.save_path + ".tmp";
  const auto state_tmp = state_path(args) + ".tmp";
  {
    torch::serialize::OutputArchive archive;
    model->save(archive);
    archive.save_to(weights_tmp);
  }
  torch::serialize::OutputArchive state;
  state.write("epochs_done", torch::tensor(epochs_done, torch::kLong));
  state.write("steps_done", torch::tensor(steps_done, torch::kLong));
  state.write("settings", c10::IValue(text_of(settings_of(args))));
  state.write("weights", c10::IValue(fingerprint(weights_tmp)));
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    state.write("generator", generator.get_state());
  }
  torch::serialize::OutputArchive optimizer_state;
  optimizer.save(optimizer_state);
  state.write("optimizer", optimizer_state);
  state.save_to(state_tmp);
  rename_into_place(weights_tmp, args.save_path);
  rename_into_place(state_tmp, state_path(args));
}

Resumed resume_training(
    const Args& args, gpipe::GPipe& model, torch::optim::Optimizer& optimizer) {
  std::error_code error;
  if (!fs::exists(args.save_path, error)) {
    std::fprintf(
        text_out(args),
        "--resume: nothing saved at %s yet; training from epoch 1\n",
        args.save_path.c_str());
    return {};
  }
  const auto path = state_path(args);
  TORCH_CHECK(
      fs::is_regular_file(path, error),
      "--resume: ",
      args.save_path,
      " holds weights but no training state beside it (",
      path,
      "); to start from those weights, use --load ",
      args.save_path,
      " instead");
  torch::serialize::InputArchive state;
  state.load_from(path);
  c10::IValue value;
  state.read("settings", value);
  const auto saved = parse_settings(value.toStringRef());
  for (const auto& [flag, now] : settings_of(args)) {
    auto it = saved.find(flag);
    const auto then = it == saved.end() ? std::string("?") : it->second;
    TORCH_CHECK_VALUE(
        then == now,
        "--resume: ",
        path,
        " was saved by a run with ",
        flag,
        " ",
        then,
        ", but this run has ",
        now,
        "; resume with the same settings");
  }
  state.read("weights", value);
  TORCH_CHECK_VALUE(
      value.toStringRef() == fingerprint(args.save_path),
      "--resume: ",
      args.save_path,
      " is not the file saved with ",
      path,
      " (a run stopped while saving, or the file was replaced); start from "
      "its weights with --load instead");
  gpipe::load_into_gpipe(model, args.save_path);
  torch::serialize::InputArchive optimizer_state;
  state.read("optimizer", optimizer_state);
  optimizer.load(optimizer_state);
  torch::Tensor generator_state;
  state.read("generator", generator_state);
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(generator_state);
  }
  torch::Tensor t;
  Resumed resumed;
  state.read("epochs_done", t);
  resumed.epochs_done = t.item<int64_t>();
  state.read("steps_done", t);
  resumed.steps_done = t.item<int64_t>();
  return resumed;
}

}  // namespace gpipe_train
