// gpipe-train: trains a small CNN, ResNet or U-Net on Fashion-MNIST through a
// GPipe pipeline and reports progress, test accuracy and time.
//
//   gpipe-train [--model cnn] [--partitions 2] [--chunks 4] ...
//   gpipe-run -n 2 -- gpipe-train ...   (one partition per process)

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include "fashion_mnist.h"
#include "train_args.h"

namespace {

using namespace gpipe_train;

int train_with(const Args& given, std::optional<gpipe::dist::World>& world) {
  Args args = given;  // --autotune fills in its choice
  const int64_t rank = world ? world->rank() : 0;
  const int64_t ranks = world ? world->size() : 1;
  // Replicas of a pipeline of --pipeline-size ranks: a replica's stages
  // are neighbours (rank = replica * pipeline_size + stage rank).
  const int64_t pipeline_size = world ? args.pipeline_size : 1;
  const int64_t replicas = ranks / pipeline_size;
  const int64_t replica = rank / pipeline_size;
  const bool lead = rank == 0;
  // Replica d's rows of a batch of `rows`: [rows * d / D, rows * (d + 1) /
  // D).
  auto shard = [&](const torch::Tensor& t) {
    const auto rows = t.size(0);
    const auto begin = rows * replica / replicas;
    return t.narrow(0, begin, rows * (replica + 1) / replicas - begin);
  };
  std::FILE* out = text_out(args);
  if (args.chunks_from_plan && lead) {
    std::fprintf(
        out,
        "--chunks %lld: the micro-batches of --plan %s\n",
        static_cast<long long>(args.chunks),
        args.plan_path.c_str());
  }
  torch::manual_seed(args.seed);
  // The model first (reading the data draws no random numbers), so that a
  // bad --load is told before the data is read or the balance measured.
  const auto& spec = model_spec(args.model);
  auto net = make_model(spec);
  if (!args.load_path.empty()) {
    // Into the plain model, before the balance is measured on it: a file
    // that cannot be read, or holds another model, is a bad --load.
    try {
      gpipe::load_into_sequential(net, args.load_path);
    } catch (const c10::Error& e) {
      throw UsageError(c10::str(
          "--load '", args.load_path, "': ", e.what_without_backtrace()));
    }
    std::fprintf(out, "loaded weights from %s\n", args.load_path.c_str());
  }
  verify_resume(args, net);
  if (resume_is_finished(args, world ? &*world : nullptr, lead, out)) {
    return 0;
  }
  // Only the images --limit and --test-limit keep are read.
  auto data = gpipe_data::read_fashion_mnist(
      args.data_dir, args.limit, args.test_limit);
  auto train_x = data.train_x;
  auto train_y = data.train_y;
  auto test_x = data.test_x;
  auto test_y = data.test_y;
  if (args.autotune) {
    autotune_args(args, net, train_x, train_y, world ? &*world : nullptr, out);
  }
  const int64_t n = train_x.size(0);
  const int64_t batch_size = args.batch_size;
  const int64_t epochs = args.epochs;

  const bool tracing = !args.trace_path.empty() || !args.timeline_path.empty();
  const int64_t steps_per_epoch = (n - 1) / batch_size + 1;
  verify_trace_steps(args, n);

  // Under a launcher lane l of the pipeline is its rank l: the first and
  // the last partition are on lane 0 and the last lane, or both on lane 0
  // in a V.
  const auto placement = pipeline_placement(args);
  // In one process every lane is here.
  const bool first = !world || rank % pipeline_size == placement.lane_of(0);
  const bool last =
      !world || rank % pipeline_size == placement.lane_of(args.partitions - 1);

  const auto balance =
      args.balance_given
          ? args.balance
          : choose_balance(args, net, train_x, world ? &*world : nullptr);
  const auto options =
      gpipe::GPipeOptions(balance)
          .chunks(args.chunks)
          .checkpoint(gpipe::checkpoint_from_string(args.checkpoint))
          .threads_per_lane(args.threads_per_lane)
          .stages_per_lane(args.stages_per_lane)
          .placement(placement.is_modulo() ? gpipe::Placement() : placement)
          .deferred_batch_norm(args.deferred_batch_norm);
  auto lane_options = options;
  lane_options.devices(args.devices);
  const auto& plan = args.plan;
  gpipe::GPipe model{nullptr};
  gpipe::dist::PipelineStage stage{nullptr};
  torch::nn::Module* module = nullptr;
  if (world) {
    stage = gpipe::dist::PipelineStage(
        net, options, gpipe::dist::Mesh(*world, pipeline_size));
    module = stage.get();
  } else {
    model = gpipe::GPipe(net, lane_options);
    module = model.get();
  }
  torch::optim::SGD optimizer(
      module->parameters(), torch::optim::SGDOptions(args.lr).momentum(0.9));
  // --resume: where the run stood, with the weights, the optimizer and the
  // random generator as they were then.
  const auto resumed =
      args.resume ? resume_training(args, model, stage, optimizer, lead)
                  : gpipe::TrainingState{};
  verify_resumed_steps(args, resumed, steps_per_epoch, lead, out);
  const auto out_device = world ? stage->device() : model->devices().back();
  {
    std::ostringstream line;
    if (world) {
      stage->pretty_print(line);
      line << " ranks=" << ranks;
      if (replicas > 1) {
        line << " (" << replicas << " replicas of " << pipeline_size << ")";
      }
    } else {
      line << *model << " threads_per_lane=" << model->threads_per_lane()
           << (model->threads_follow_plan() ? " (shared by the plan)" : "");
    }
    line << " train=" << n << " test=" << test_x.size(0);
    std::fprintf(out, "%s\n", line.str().c_str());
    std::fflush(out);
  }
  auto set_trace = [&](std::shared_ptr<gpipe::Trace> t) {
    if (world) {
      stage->set_trace(std::move(t));
    } else {
      model->set_trace(std::move(t));
    }
  };

  std::shared_ptr<gpipe::Trace> trace;
  if (tracing) {
    trace = std::make_shared<gpipe::Trace>();
  }
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::nn::functional::cross_entropy(out, target);
  };

  // Whether a batch of `rows` trains, alike on every rank (each reads the
  // same batches). A short last batch is left out where it does not split
  // into equal shards of the replicas, leaves a replica nothing, or cuts
  // into fewer micro-batches than the plan has (rather than run by another
  // plan). The learning-rate schedule counts the steps that train.
  enum class Trained { Yes, Uneven, Short };
  auto left_out = [&](int64_t rows) {
    if (rows % replicas != 0) {
      return Trained::Uneven;
    }
    // The smallest shard decides, alike on every replica.
    const auto fewest = rows / replicas;
    if (fewest == 0 ||
        (args.schedule == "plan" &&
         gpipe::scatter({torch::empty({fewest})}, args.chunks).size() !=
             static_cast<size_t>(plan.micro_batches))) {
      return Trained::Short;
    }
    return Trained::Yes;
  };
  const int64_t trained_per_epoch =
      (steps_per_epoch - 1) * (left_out(batch_size) == Trained::Yes ? 1 : 0) +
      (left_out(n - (steps_per_epoch - 1) * batch_size) == Trained::Yes ? 1
                                                                        : 0);
  // A run that would train nothing is refused before it starts: it trained
  // no step, saved checkpoints of step 0 and reported a loss of 0.
  if (trained_per_epoch == 0) {
    const bool one = steps_per_epoch == 1;
    const auto rows = one ? n : batch_size;  // (the full ones decide)
    const bool uneven = left_out(rows) == Trained::Uneven;
    usage_check(
        false,
        "no batch trains: the ",
        n,
        " training images make ",
        one ? c10::str("one batch of ", n) : c10::str("batches of ", rows),
        uneven ? c10::str(
                     ", which ",
                     one ? "does" : "do",
                     " not split evenly over the ",
                     replicas,
                     " replicas")
               : c10::str(
                     ", which ",
                     one ? "cuts" : "cut",
                     " into fewer micro-batches than --plan's ",
                     plan.micro_batches),
        one ? "; raise --limit" : "; change --batch-size");
  }

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int64_t step = resumed.step;
  int64_t skipped_batches = 0;
  int64_t uneven_batches = 0;
  int64_t trained_rows = 0;  // by this run (since a resume), all epochs
  int64_t epoch_rows = 0;    // by the last epoch: the short batches left out
  double last_loss = 0;
  double lr = args.lr;
  double train_seconds = 0;
  // Ends the recording, which began with the run's second step, and
  // writes it: after --trace-steps steps, or sooner where the epoch ends
  // (`epoch_ended`), so that the test passes are not recorded among them.
  auto end_trace = [&](bool epoch_ended) {
    if (world) {
      // One timeline with a row per rank, on rank 0.
      trace = gpipe::dist::gather_trace(stage);
      if (!lead) {
        trace.reset();  // another replica's: rank 0 writes its own
      }
    }
    set_trace(nullptr);
    if (trace) {
      write_trace(args, *trace, resumed.step + 2, step, epoch_ended, out);
    }
    trace.reset();
  };
  // With the results so far, so that resuming a finished run can report
  // them (resume_is_finished): the last step's loss, and at an epoch's end its
  // test accuracy.
  auto save = [&](int64_t epochs_done,
                  int64_t position,
                  std::optional<double> accuracy = std::nullopt) {
    gpipe::TrainingState state;
    state.step = step;
    state.epoch = epochs_done;
    state.position = position;
    state.user[kFinalLossKey] = exact_text(last_loss);
    state.user[kBalanceKey] = c10::Join(",", balance);
    if (accuracy) {
      state.user[kTestAccuracyKey] = exact_text(*accuracy);
    }
    save_training(args, model, stage, optimizer, state);
    if (lead) {
      std::fprintf(
          out,
          "saved a checkpoint of step %lld to %s\n",
          static_cast<long long>(step),
          args.save_path.c_str());
    }
  };
  for (int64_t epoch = resumed.epoch; epoch < epochs; ++epoch) {
    module->train();
    // Each epoch's order from its own generator: a resumed run reads the
    // same batches whatever the default generator did.
    auto order = torch::randperm(
        n,
        at::make_generator<at::CPUGeneratorImpl>(
            static_cast<uint64_t>(args.seed) * 1000003u +
            static_cast<uint64_t>(epoch)),
        torch::kLong);
    auto window_start = Clock::now();
    int64_t window_samples = 0;
    const int64_t first_batch = epoch == resumed.epoch ? resumed.position : 0;
    // A run resumed in the middle of an epoch trained the epoch's batches
    // before its place in an earlier run: full batches, each trained (a
    // batch that cannot be is refused before training).
    epoch_rows = std::min(n, first_batch * batch_size);
    for (int64_t begin = first_batch * batch_size; begin < n;
         begin += batch_size) {
      auto idx = order.narrow(0, begin, std::min(batch_size, n - begin));
      // Each replica its own shard (all of it without replicas).
      auto x = shard(train_x.index_select(0, idx));
      auto y = shard(train_y.index_select(0, idx)).to(out_device);
      if (trace && step - resumed.step == 1) {
        trace->clear();
        set_trace(trace);
      }
      optimizer.zero_grad();
      torch::Tensor loss;
      if (const auto why = left_out(idx.size(0)); why != Trained::Yes) {
        ++(why == Trained::Uneven ? uneven_batches : skipped_batches);
        continue;
      }
      if (world && args.schedule == "plan") {
        loss = stage->train_step(
            first ? x : torch::Tensor(),
            last ? y : torch::Tensor(),
            loss_fn,
            plan);
      } else if (world) {
        loss = stage->train_step(
            first ? x : torch::Tensor(),
            last ? y : torch::Tensor(),
            loss_fn,
            gpipe::schedule_from_string(args.schedule));
      } else if (args.schedule == "plan") {
        loss = model->train_step(x, y, loss_fn, plan);
      } else if (args.schedule == "autograd") {
        loss = loss_fn(model->forward(x), y);
        loss.backward();
      } else {
        loss = model->train_step(
            x, y, loss_fn, gpipe::schedule_from_string(args.schedule));
      }
      lr = lr_at(args, step, epochs * trained_per_epoch);
      for (auto& group : optimizer.param_groups()) {
        static_cast<torch::optim::SGDOptions&>(group.options()).lr(lr);
      }
      optimizer.step();
      ++step;
      if (trace && step - resumed.step == 1 + args.trace_steps) {
        end_trace(false);
      }
      window_samples += idx.size(0);
      trained_rows += idx.size(0);
      epoch_rows += idx.size(0);
      last_loss = loss.item<double>();
      // As a trainer should: a loss that is no longer finite ends the run
      // (every rank has the loss, so every rank stops here).
      TORCH_CHECK(
          std::isfinite(last_loss),
          "the loss is ",
          // printf's "-nan" for a NaN whose sign bit is set is still NaN.
          std::isnan(last_loss) ? std::string("nan") : c10::str(last_loss),
          " at step ",
          step,
          " (epoch ",
          epoch + 1,
          "): training diverged; lower --lr (",
          args.lr,
          ") or check the data");
      if (lead && step % args.log_every == 0) {
        const double secs =
            std::chrono::duration<double>(Clock::now() - window_start).count();
        std::fprintf(
            out,
            "epoch %lld step %lld loss %.4f samples/s %.1f\n",
            static_cast<long long>(epoch + 1),
            static_cast<long long>(step),
            last_loss,
            window_samples / secs);
        std::fflush(out);
        window_start = Clock::now();
        window_samples = 0;
      }
      if (!args.save_path.empty() && args.save_every_steps > 0 &&
          step % args.save_every_steps == 0 && begin + batch_size < n) {
        save(epoch, begin / batch_size + 1);  // the epoch's end saves below
      }
    }
    train_seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (trace && step - resumed.step >= 2) {
      end_trace(true);
    }

    module->eval();
    torch::NoGradGuard no_grad;
    // Every pass draws its step seed from the default generator (on every
    // rank), the test passes too: it is put back after them, so that how
    // much is tested (--test-limit, a replica's share) does not change the
    // training that follows.
    auto generator = at::detail::getDefaultCPUGenerator();
    const auto before_test = [&] {
      std::lock_guard<std::mutex> lock(generator.mutex());
      return generator.get_state();
    }();
    int64_t correct = 0;
    // Each replica tests its own shard of the test set.
    const auto my_test_x = shard(test_x);
    const auto my_test_y = shard(test_y);
    for (int64_t begin = 0; begin < my_test_x.size(0); begin += 500) {
      const auto len = std::min<int64_t>(500, my_test_x.size(0) - begin);
      auto x = my_test_x.narrow(0, begin, len);
      auto out = world ? stage->forward(first ? x : torch::Tensor())
                       : model->forward(x);
      if (last) {
        correct += out.argmax(1)
                       .eq(my_test_y.narrow(0, begin, len).to(out.device()))
                       .sum()
                       .item<int64_t>();
      }
    }
    if (world) {
      // Each replica's last rank has its outputs; rank 0 prints.
      auto count = torch::tensor({correct}, torch::kLong);
      world->all_reduce(count);
      correct = count.item<int64_t>();
    }
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_state(before_test);
    }
    const double accuracy = double(correct) / test_x.size(0);
    if (!args.save_path.empty()) {
      // Every rank: a collective under a launcher.
      save(epoch + 1, 0, accuracy);
    }
    const double total =
        std::chrono::duration<double>(Clock::now() - start).count();
    if (!lead) {
      continue;
    }
    std::fprintf(
        out,
        "epoch %lld done: test accuracy %.4f, lr %.6g, elapsed %.1f s\n",
        static_cast<long long>(epoch + 1),
        accuracy,
        lr,
        total);
    // The epoch's short batches left out, and why; counted afresh.
    auto say_left_out = [&](int64_t& count, const std::string& why) {
      if (count > 0) {
        std::fprintf(
            out,
            "left out %lld short %s: %s %s\n",
            static_cast<long long>(count),
            count == 1 ? "batch" : "batches",
            count == 1 ? "it" : "they",
            why.c_str());
        count = 0;
      }
    };
    say_left_out(
        skipped_batches,
        std::string(skipped_batches == 1 ? "cuts" : "cut") +
            " into fewer micro-batches than --plan has");
    say_left_out(
        uneven_batches,
        std::string(uneven_batches == 1 ? "does" : "do") +
            " not split evenly over the " + std::to_string(replicas) +
            " replicas");
    if (epoch + 1 == epochs) {
      std::fprintf(out, "total time %.1f s\n", total);
      if (args.json) {
        nlohmann::json summary = {
            {"model", args.model},
            {"balance", balance},
            {"chunks", args.chunks},
            {"checkpoint", args.checkpoint},
            {"schedule", args.schedule},
            {"stages_per_lane", args.stages_per_lane},
            {"placement", gpipe::to_string(placement)},
            {"autotune", args.autotune},
            {"deferred_batch_norm", args.deferred_batch_norm},
            {"lr_schedule", args.lr_schedule},
            {"final_lr", lr},
            // The count the lanes run with, as the text says it.
            {"threads_per_lane",
             world ? stage->threads_per_lane() : model->threads_per_lane()},
            {"threads_shared_by_plan", !world && model->threads_follow_plan()},
            {"ranks", ranks},
            {"pipeline_size", pipeline_size},
            {"replicas", replicas},
            {"epochs", epochs},
            {"batch_size", batch_size},
            {"steps", step},
            {"train_samples", epoch_rows},
            {"test_samples", test_x.size(0)},
            // (None where this run trained no step: a resumed one.)
            {"final_loss",
             step > resumed.step ? nlohmann::json(last_loss)
                                 : nlohmann::json(nullptr)},
            {"test_accuracy", accuracy},
            {"train_seconds", train_seconds},
            {"resumed_at_step", resumed.step},
            {"train_samples_per_second", double(trained_rows) / train_seconds},
            {"total_seconds", total}};
        write_json_line(summary);
      }
    }
  }
  return 0;
}

}  // namespace

int gpipe_train::train(const Args& args) {
  // Under a launcher: one partition per rank; rank 0 prints.
  std::optional<gpipe::dist::World> world;
  if (args.world_size > 1) {
    try {
      world = gpipe::dist::init_from_env();
    } catch (const c10::ValueError& e) {
      // A malformed variable of the environment (GPIPE_DIST_TIMEOUT=abc) is
      // part of the command line: every start would repeat it, so it exits
      // 2, which gpipe-run does not restart. A MASTER_ADDR that does not
      // resolve may yet (a name service that starts with the cluster).
      const std::string message = e.what_without_backtrace();
      if (message.find("MASTER_ADDR to be a host name") != std::string::npos) {
        throw;
      }
      throw UsageError(message);
    }
  }
  try {
    return train_with(args, world);
  } catch (...) {
    // Said before the stage and the process group are torn down: the other
    // ranks learn of the failure and exit, and the launcher may stop this
    // rank before a teardown that waits on them ends.
    return report_error(std::current_exception());
  }
}
