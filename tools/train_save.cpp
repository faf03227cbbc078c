// gpipe-train's --save, --save-every-steps, --load and --resume: training
// checkpoints (gpipe/checkpoint_io.h) in a directory, written by one
// process or by every rank under a launcher, read back by any layout.

#include <gpipe/checkpoint_io.h>
#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/serialize.h>
#include <gpipe/trace.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <system_error>

#include "train_args.h"

namespace gpipe_train {

void add_save_options(CLI::App& app, Args& args) {
  app.add_option(
      "--save",
      args.save_path,
      "Write training checkpoints into this directory after each epoch "
      "(and every --save-every-steps steps): weights, optimizer, random "
      "state and position; any layout resumes from them, "
      "gpipe::load_into_sequential reads them into the plain model");
  app.add_option(
         "--save-every-steps",
         args.save_every_steps,
         "With --save: also write a checkpoint every this many steps "
         "(0: after each epoch only)")
      ->capture_default_str()
      ->check(decimal_int64());
  app.add_option(
      "--load",
      args.load_path,
      "Before training, read the model's weights from here: a --save "
      "directory, or a file of torch::save of the plain model or of a GPipe "
      "of it with any balance");
  app.add_flag(
      "--resume",
      args.resume,
      "Go on from the newest checkpoint in --save (written by any -n, "
      "--pipeline-size or --balance): its weights, optimizer, random state "
      "and place in the data; train up to --epochs. Without one, start at "
      "epoch 1");
}

namespace {

// The checkpoint --resume would take in --save ("" when none); a damaged
// newest one is a bad --save.
std::string newest_checkpoint(const Args& args) {
  try {
    return gpipe::latest_checkpoint(args.save_path);
  } catch (const c10::Error& e) {
    throw UsageError(c10::str(
        "--save '", args.save_path, "': ", e.what_without_backtrace()));
  }
}

}  // namespace

void verify_save_options(const CLI::App& app, const Args& args) {
  const bool save = app.count("--save") > 0;
  const bool load = app.count("--load") > 0;
  if (save) {
    std::error_code ignored;
    const auto& path = args.save_path;
    usage_check(!path.empty(), "--save needs a directory");
    usage_check(
        !fs::exists(path, ignored) || fs::is_directory(path, ignored),
        "--save '",
        path,
        "' is a file; name a directory (made when missing) for the "
        "checkpoints");
    // A file where the path needs a folder, named.
    for (auto p = fs::path(path).parent_path();
         !p.empty() && p != p.root_path();
         p = p.parent_path()) {
      usage_check(
          !fs::exists(p, ignored) || fs::is_directory(p, ignored),
          "--save '",
          path,
          "': '",
          p.string(),
          "' is a file, not a directory");
    }
    // Checkpoints saved inside one would never be resumed from: --resume
    // reads it itself.
    if (fs::exists(fs::path(path) / "manifest.json", ignored)) {
      auto holder = fs::path(path).lexically_normal();
      if (!holder.has_filename()) {
        holder = holder.parent_path();
      }
      holder = holder.parent_path();
      usage_check(
          false,
          "--save '",
          path,
          "' is a checkpoint itself (it holds manifest.json); give the "
          "directory that holds it ('",
          holder.empty() ? std::string(".") : holder.string(),
          "'), where --resume takes the newest");
    }
  }
  if (save && !args.resume) {
    const auto newest = newest_checkpoint(args);
    usage_check(
        newest.empty(),
        "--save '",
        args.save_path,
        "' already holds checkpoints (the newest: ",
        newest,
        "); give --resume to go on from them, or another directory");
  }
  usage_check(
      args.save_every_steps >= 0,
      "--save-every-steps must be 0 or more, but got ",
      args.save_every_steps);
  usage_check(
      args.save_every_steps == 0 || save,
      "--save-every-steps writes into the --save directory; give --save too");
  usage_check(
      !args.resume || save,
      "--resume goes on from the checkpoints --save writes; give --save too");
  usage_check(
      !args.resume || !load,
      "--resume and --load both give the starting weights; give one");
  if (load) {
    std::error_code error;
    usage_check(
        fs::exists(args.load_path, error),
        "--load '",
        args.load_path,
        "' does not exist");
  }
  if (save) {
    // Made now, with its parents (last: a run refused for another of these
    // flags leaves none), as the first checkpoint would make it an epoch's
    // work later.
    const auto& path = args.save_path;
    std::error_code error;
    std::error_code ignored;
    fs::create_directories(path, error);
    usage_check(
        fs::is_directory(path, ignored),
        "--save '",
        path,
        "': cannot make the directory",
        error ? ": " + error.message() : std::string());
    usage_check(
        ::access(path.c_str(), W_OK | X_OK) == 0,
        "--save '",
        path,
        "' is not writable");
  }
}

namespace {

// The settings that a resumed run must share with the saved one: they
// decide the data, its order and the updates.
std::map<std::string, std::string> settings_of(const Args& args) {
  // The shortest text that reads back as the same number (0.05, not
  // 0.050000000000000003).
  char lr[32];
  const auto written = std::to_chars(lr, lr + sizeof(lr), args.lr);
  return {
      {"--model", args.model},
      {"--batch-size", std::to_string(args.batch_size)},
      {"--limit", std::to_string(args.limit)},
      {"--seed", std::to_string(args.seed)},
      {"--lr", std::string(lr, written.ptr)},
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

// Why --resume cannot go on from `newest` with this run's settings, or "".
std::string resume_mismatch(const Args& args, const std::string& newest) {
  try {
    const auto saved = gpipe::read_training_state(args.save_path);
    for (const auto& [flag, now] : settings_of(args)) {
      auto it = saved.user.find(flag);
      const auto then = it == saved.user.end() ? std::string("?") : it->second;
      // A rate is compared as a number: checkpoints written before kept
      // 17 digits.
      const bool same = flag == "--lr"
                            ? std::strtod(then.c_str(), nullptr) == args.lr
                            : then == now;
      if (!same) {
        return c10::str(
            "--resume: ",
            newest,
            " was saved by a run with ",
            flag,
            " ",
            then,
            ", but this run has ",
            now,
            "; resume with the same settings");
      }
    }
  } catch (const c10::Error& e) {
    return c10::str("--resume: ", e.what_without_backtrace());
  }
  return "";
}

}  // namespace

void verify_resume(const Args& args, const torch::nn::Sequential& net) {
  if (!args.resume) {
    return;
  }
  const auto newest = newest_checkpoint(args);
  if (newest.empty()) {
    return;
  }
  const auto mismatch = resume_mismatch(args, newest);
  usage_check(mismatch.empty(), mismatch);
  // Every file the weights and the optimizer's state are read from, whole
  // and fitting the model, before the data is read and the balance
  // measured (into a copy: the model is loaded with the optimizer later).
  // (Sequential::clone would drop the layers' names, which loading checks.)
  try {
    torch::nn::Sequential copy;
    const auto names = net->named_children();
    for (size_t k = 0; k < net->size(); ++k) {
      copy->push_back(names[k].key(), net->begin()[k].clone());
    }
    gpipe::load_into_sequential(copy, newest);
  } catch (const c10::Error& e) {
    throw UsageError(c10::str("--resume: ", e.what_without_backtrace()));
  }
}

void save_training(
    const Args& args,
    const gpipe::GPipe& model,
    const gpipe::dist::PipelineStage& stage,
    const torch::optim::Optimizer& optimizer,
    gpipe::TrainingState state) {
  auto results = std::move(state.user);
  state.user = settings_of(args);
  state.user.insert(results.begin(), results.end());
  save_autotune_choice(args, state.user);
  if (!stage.is_empty()) {
    gpipe::dist::save_checkpoint(args.save_path, stage, optimizer, state);
  } else {
    gpipe::save_checkpoint(args.save_path, model, optimizer, state);
  }
}

gpipe::TrainingState resume_training(
    const Args& args,
    gpipe::GPipe& model,
    gpipe::dist::PipelineStage& stage,
    torch::optim::Optimizer& optimizer,
    bool lead) {
  // Under a launcher every rank must take the same way, rank 0's: load
  // together, or all start afresh.
  const auto newest = gpipe::latest_checkpoint(args.save_path);
  bool found = !newest.empty();
  const gpipe::dist::World* world =
      stage.is_empty() ? nullptr : &stage->mesh().world();
  if (world != nullptr) {
    auto flag = torch::tensor({found ? 1 : 0}, torch::kLong);
    world->broadcast(flag, 0);
    found = flag.item<int64_t>() != 0;
  }
  if (!found) {
    if (lead) {
      std::fprintf(
          text_out(args),
          "--resume: nothing saved in %s yet; training from epoch 1\n",
          args.save_path.c_str());
    }
    return {};
  }
  // The settings first, so that a checkpoint of another run is refused
  // before anything is loaded; alike on every rank (verify_resume told it
  // before the run began; a rank on another host may see other files).
  auto mismatch = resume_mismatch(args, newest);
  if (world != nullptr) {
    auto flag = torch::tensor({mismatch.empty() ? 0 : 1}, torch::kLong);
    world->all_reduce(flag);
    if (mismatch.empty() && flag.item<int64_t>() > 0) {
      mismatch = "--resume: another rank could not resume from " + newest +
                 " (its message says why)";
    }
  }
  TORCH_CHECK_VALUE(mismatch.empty(), mismatch);
  return !stage.is_empty()
             ? gpipe::dist::load_checkpoint(args.save_path, stage, optimizer)
             : gpipe::load_checkpoint(args.save_path, model, optimizer);
}

void verify_trace_steps(const Args& args, int64_t n) {
  const int64_t epochs = args.epochs;
  const int64_t batch_size = args.batch_size;
  // Record steps 2 .. trace_steps + 1 (the first one warms up); a run with
  // fewer steps would write nothing. epochs * steps_per_epoch > trace_steps,
  // written so that it cannot overflow.
  const bool tracing = !args.trace_path.empty() || !args.timeline_path.empty();
  const int64_t steps_per_epoch = (n - 1) / batch_size + 1;
  if (tracing && epochs <= args.trace_steps / steps_per_epoch) {
    throw UsageError(c10::str(
        "--trace-steps ",
        args.trace_steps,
        " needs more than ",
        count_of(args.trace_steps, "step", "steps"),
        " (the first one is not recorded), but --epochs ",
        epochs,
        " of ",
        n,
        " images in batches of ",
        batch_size,
        " makes ",
        epochs * steps_per_epoch,
        "; lower --trace-steps or raise --epochs or --limit"));
  }
}

void write_trace(
    const Args& args,
    const gpipe::Trace& trace,
    int64_t first,
    int64_t last,
    bool epoch_ended,
    std::FILE* out) {
  if (!args.trace_path.empty()) {
    trace.write_chrome_json(args.trace_path);
  }
  if (!args.timeline_path.empty()) {
    trace.write_svg(args.timeline_path);
  }
  std::fprintf(
      out,
      "wrote %zu traced intervals of steps %lld-%lld%s%s%s%s%s\n",
      trace.events().size(),
      static_cast<long long>(first),
      static_cast<long long>(last),
      epoch_ended ? " (the epoch ended: its test passes are not recorded)" : "",
      args.trace_path.empty() ? "" : " to ",
      args.trace_path.c_str(),
      args.timeline_path.empty() ? "" : " and ",
      args.timeline_path.c_str());
}

bool resume_is_finished(
    const Args& args,
    const gpipe::dist::World* world,
    bool lead,
    std::FILE* out) {
  if (!args.resume) {
    return false;
  }
  // Rank 0's reading decides for every rank (a rank on another host may
  // see other files); resume_training loads what it found.
  std::optional<gpipe::TrainingState> saved;
  std::string why;  // rank 0 could not read it (taken away since, say)
  if (world == nullptr || world->rank() == 0) {
    try {
      if (!newest_checkpoint(args).empty()) {
        saved = gpipe::read_training_state(args.save_path);
      }
    } catch (const std::exception& e) {
      why = e.what();
      if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
        why = error->what_without_backtrace();
      }
    }
  }
  const int64_t epochs = args.epochs;
  bool finished = saved && saved->epoch >= epochs;
  if (world != nullptr) {
    // (Told to every rank before rank 0 fails: the others would wait.)
    auto flag = torch::tensor(
        {!why.empty() ? 2
         : finished   ? 1
                      : 0},
        torch::kLong);
    world->broadcast(flag, 0);
    usage_check(
        flag.item<int64_t>() != 2 || world->rank() == 0,
        "--resume: rank 0 could not read the newest checkpoint in --save '",
        args.save_path,
        "' (its message says why)");
    finished = flag.item<int64_t>() == 1;
  }
  usage_check(why.empty(), "--resume: ", why);
  if (!finished || !lead) {
    return finished;
  }
  std::fprintf(
      out,
      "--resume: the saved run has done %lld epoch%s of --epochs %lld; "
      "nothing left to train\n",
      static_cast<long long>(saved->epoch),
      saved->epoch == 1 ? "" : "s",
      static_cast<long long>(epochs));
  if (args.json) {
    nlohmann::json summary = {
        {"model", args.model},
        {"epochs", epochs},
        {"steps", saved->step},
        {"resumed_at_step", saved->step},
        {"nothing_left_to_train", true}};
    // The balance the run trained with, when its checkpoint says.
    const auto saved_balance = saved->user.find(kBalanceKey);
    if (saved_balance != saved->user.end()) {
      std::vector<int64_t> parts;
      std::stringstream text(saved_balance->second);
      for (std::string part; std::getline(text, part, ',');) {
        parts.push_back(std::strtoll(part.c_str(), nullptr, 10));
      }
      summary["balance"] = parts;
    }
    // The results the run ended with, as its own summary gave them.
    for (const auto* key : {kFinalLossKey, kTestAccuracyKey}) {
      const auto found = saved->user.find(key);
      if (found != saved->user.end()) {
        summary[key] = std::strtod(found->second.c_str(), nullptr);
      }
    }
    write_json_line(summary);
  }
  return true;
}

void verify_resumed_steps(
    const Args& args,
    const gpipe::TrainingState& resumed,
    int64_t steps_per_epoch,
    bool lead,
    std::FILE* out) {
  const int64_t epochs = args.epochs;
  const bool tracing = !args.trace_path.empty() || !args.timeline_path.empty();
  // --trace-steps was checked against the whole run; a resumed run has
  // only the steps left.
  const int64_t steps_left =
      (epochs - resumed.epoch) * steps_per_epoch - resumed.position;
  if (tracing && steps_left <= args.trace_steps) {
    throw UsageError(c10::str(
        "--trace-steps ",
        args.trace_steps,
        " needs more than ",
        count_of(args.trace_steps, "step", "steps"),
        " (the first one is not recorded), but --resume leaves ",
        steps_left,
        " of --epochs ",
        epochs,
        "; lower --trace-steps or raise --epochs"));
  }
  if (lead && args.resume && resumed.step > 0) {
    std::fprintf(
        out,
        "resumed from %s at step %lld (epoch %lld, batch %lld)\n",
        gpipe::latest_checkpoint(args.save_path).c_str(),
        static_cast<long long>(resumed.step),
        static_cast<long long>(resumed.epoch + 1),
        static_cast<long long>(resumed.position));
  }
}

}  // namespace gpipe_train
