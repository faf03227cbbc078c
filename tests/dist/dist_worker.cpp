// One rank of the distributed tests (tests/dist/dist_test.sh starts them
// with gpipe-run, or by hand). Each rank trains a gpipe::dist::PipelineStage
// and, in the same process, the single-process gpipe::GPipe with the same
// balance, chunks, checkpoint mode and seeds, and checks that losses,
// parameters and buffers agree (float64, relative 1e-10).
//
// Exit codes: 0 passed, 1 a check failed, 3 a pass failed with an error
// (printed), 4 the expected error did not come.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../sanitized.h"

// Note [A rank killed while it saves]
// The die-in-save scenario kills one rank (--kill-rank) in the middle of
// gpipe::dist::save_checkpoint, at its first fsync: the checkpoint's files
// are written through fsync, and this program's definition is the one the
// (static) library calls. Any other fsync, or one before the save, goes to
// the system's.
std::atomic<bool> die_at_fsync{false};

extern "C" int fsync(int fd) {
  if (die_at_fsync.load()) {
    std::raise(SIGKILL);
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}

namespace {

// The minor page faults a new thread takes the second time it allocates,
// touches and frees 96 MiB in blocks of 8 MiB (more than one of glibc's
// heaps), or -1 where that cannot be told (not glibc's malloc, or a
// sanitizer's) or the environment chose its own malloc settings, which
// gpipe leaves alone (Note [Lanes and glibc's malloc] in
// src/engine/lane.cpp). With gpipe's settings the second round reuses the
// first round's pages.
long second_round_faults() {
#if defined(__GLIBC__) && !defined(GPIPE_SANITIZED)
  for (const char* name :
       {"GPIPE_MALLOC",
        "MALLOC_ARENA_MAX",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_MMAP_MAX_",
        "MALLOC_TOP_PAD_",
        "GLIBC_TUNABLES"}) {
    if (std::getenv(name) != nullptr) {
      return -1;
    }
  }
  long faults = -1;
  std::thread([&faults] {
    constexpr size_t kBlock = size_t{8} << 20;
    auto thread_faults = [] {
      rusage usage{};
      getrusage(RUSAGE_THREAD, &usage);
      return usage.ru_minflt;
    };
    for (int round = 0; round < 2; ++round) {
      const long before = thread_faults();
      std::vector<char*> blocks;
      for (int k = 0; k < 12; ++k) {
        blocks.push_back(static_cast<char*>(std::malloc(kBlock)));
        std::memset(blocks.back(), 1, kBlock);
      }
      for (auto* b : blocks) {
        std::free(b);
      }
      faults = thread_faults() - before;
    }
  }).join();
  return faults;
#else
  return -1;
#endif
}

// Set by the forward-throw scenario: the stashing layer (rank 0) throws,
// and the popping layer (the last rank) is slow, so that the failure
// reaches the last rank while it is busy with earlier micro-batches.
bool break_stash = false;
bool slow_pop = false;

struct StashImpl : torch::nn::Cloneable<StashImpl>, gpipe::Skippable {
  StashImpl() : gpipe::Skippable({"skip"}, {}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    if (break_stash && x.size(0) < 3) {  // the last, smaller micro-batch
      throw std::runtime_error("the layer broke on purpose");
    }
    stash("skip", x * 0.5);
    return x;
  }
};
TORCH_MODULE(Stash);

struct PopAddImpl : torch::nn::Cloneable<PopAddImpl>, gpipe::Skippable {
  PopAddImpl() : gpipe::Skippable({}, {"skip"}) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    if (slow_pop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    return x + pop("skip");
  }
};
TORCH_MODULE(PopAdd);

// Nine layers; a skip from layer 2 to layer 7.
torch::nn::Sequential build(bool batch_norm, double dropout) {
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(6, 12));
  net->push_back(torch::nn::Tanh());
  net->push_back(Stash());
  net->push_back(torch::nn::Linear(12, 12));
  if (batch_norm) {
    net->push_back(torch::nn::BatchNorm1d(12));
  } else {
    net->push_back(torch::nn::Dropout(dropout));
  }
  net->push_back(torch::nn::Tanh());
  net->push_back(torch::nn::Linear(12, 12));
  net->push_back(PopAdd());
  net->push_back(torch::nn::Linear(12, 3));
  net->to(torch::kDouble);
  return net;
}

// With two stages per rank, the skip still crosses ranks: from partition 0
// (rank 0) to 3 (rank 1) on 2 ranks, from 1 (rank 1) to 6 (rank 2) on 4.
std::vector<int64_t> balance_for(int64_t n, int64_t v) {
  if (v == 2 && n == 2) {
    return {3, 2, 2, 2};
  }
  if (v == 2 && n == 4) {
    return {1, 2, 1, 1, 1, 1, 1, 1};
  }
  if (v != 1) {
    std::cerr << "dist_worker: stages_per_lane 2 runs on 2 or 4 ranks\n";
    std::exit(2);
  }
  switch (n) {
    case 1:
      return {9};
    case 2:
      return {4, 5};
    case 3:
      return {3, 3, 3};
    case 4:
      return {2, 2, 3, 2};
    default:
      std::cerr << "dist_worker: runs 1 to 4 ranks\n";
      std::exit(2);
  }
}

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() &&
         torch::allclose(a.cpu(), b.cpu(), /*rtol=*/1e-10, /*atol=*/1e-12);
}

std::string arg(int argc, char** argv, const std::string& name, std::string d) {
  for (int k = 1; k + 1 < argc; ++k) {
    if (argv[k] == name) {
      return argv[k + 1];
    }
  }
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  const auto schedule =
      gpipe::schedule_from_string(arg(argc, argv, "--schedule", "1f1b"));
  const auto checkpoint = gpipe::checkpoint_from_string(
      arg(argc, argv, "--checkpoint", "except_last"));
  const bool batch_norm = arg(argc, argv, "--batch-norm", "0") == "1";
  const double dropout = std::stod(arg(argc, argv, "--dropout", "0.3"));
  const int steps = std::stoi(arg(argc, argv, "--steps", "3"));
  const auto scenario = arg(argc, argv, "--scenario", "parity");
  const int kill_step = std::stoi(arg(argc, argv, "--kill-step", "1"));
  const int64_t kill_rank = std::stoll(arg(argc, argv, "--kill-rank", "1"));
  const int64_t v = std::stoll(arg(argc, argv, "--stages-per-lane", "1"));
  // --v-shape 1: the stages in a V over the ranks (stage j and 2 n - 1 - j
  // on rank j), as zero_bubble_v needs; with --stages-per-lane 2.
  const bool v_shape = arg(argc, argv, "--v-shape", "0") == "1";
  const auto plan_file = arg(argc, argv, "--plan", "");
  // --pipeline-size P: replicas of a P-stage pipeline (Mesh), each on its
  // shard of the batch, against GPipe on the whole batch in 4 x replicas
  // micro-batches, so that replica d's micro-batch i is the reference's
  // micro-batch 4 d + i and draws its dropout masks (use no BatchNorm: its
  // statistics are per replica). 0: one pipeline.
  const int64_t pipeline_size =
      std::stoll(arg(argc, argv, "--pipeline-size", "0"));
  // --device cuda: the stages on cuda:0 (and GPipe's lanes too).
  const bool on_cuda = arg(argc, argv, "--device", "cpu") == "cuda";

  // The seconds from here to an error are printed with it: dist_test.sh
  // times refusals by them, apart from how long the process took to start
  // (seconds under ASan on a loaded machine).
  const auto began = std::chrono::steady_clock::now();
  // The World and the stage outlive the try block, so that an error is
  // printed before they are destroyed (a teardown that blocked would
  // otherwise hide it).
  std::optional<gpipe::dist::World> kept_world;
  std::optional<gpipe::dist::PipelineStage> kept_stage;
  try {
    auto world = gpipe::dist::init_from_env();
    kept_world = world;
    const auto r = world.rank();
    if (scenario == "outlive") {
      // Rank 0, which hosts the store, ends first; rank 1 goes on without
      // gpipe for a while, and should take no CPU meanwhile (LibTorch
      // 1.13's store client spun on a core once its host had gone: Note
      // [Letting go of a store whose host ended]).
      world.barrier();
      if (r == 0) {
        std::printf("rank 0: OK (ends first)\n");
        return 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      const auto cpu_before = std::clock();
      std::this_thread::sleep_for(std::chrono::seconds(1));
      const double cpu =
          static_cast<double>(std::clock() - cpu_before) / CLOCKS_PER_SEC;
      if (cpu > 0.3) {
        std::printf(
            "rank %lld: error: %.2f s of CPU in 1 s of sleep after rank 0 "
            "ended\n",
            static_cast<long long>(r),
            cpu);
        return 1;
      }
      std::printf(
          "rank %lld: OK (%.2f s of CPU in 1 s after rank 0 ended)\n",
          static_cast<long long>(r),
          cpu);
      return 0;
    }
    gpipe::dist::Mesh mesh(
        world, pipeline_size > 0 ? pipeline_size : world.size());
    const auto n = mesh.pipeline_size();
    const auto pr = mesh.pipeline_rank();
    const auto replicas = mesh.data_size();
    const auto replica = mesh.data_rank();
    // This replica's rows of a batch of `rows` rows.
    auto shard = [&](const torch::Tensor& t) {
      const auto rows = t.size(0) / replicas;
      return t.narrow(0, replica * rows, rows);
    };
    auto balance = balance_for(n, v);
    // --plan: every step runs the plan read from the file (on both sides);
    // the other-plan scenario gives rank 1 the schedule's own plan instead.
    std::optional<gpipe::Plan> plan;
    if (!plan_file.empty()) {
      std::ifstream in(plan_file);
      std::stringstream text;
      text << in.rdbuf();
      plan = gpipe::Plan::from_csv(text.str());
      if (scenario == "other-plan" && r == 1) {
        plan = gpipe::make_plan(schedule, plan->micro_batches, n, v);
      }
    }
    if (scenario == "mismatch" && pr == 1) {
      std::swap(balance[0], balance[1]);
    }
    auto options =
        gpipe::GPipeOptions(balance)
            .chunks(4)
            .checkpoint(checkpoint)
            .deferred_batch_norm(batch_norm)
            // bad-layout: a balance for v stages per
            // rank, but one stage per rank asked for.
            .stages_per_lane(scenario == "bad-layout" ? 1 : v)
            .placement(
                v_shape ? gpipe::Placement::v_shape(n) : gpipe::Placement())
            .threads_per_lane(1);
    // Every lane on cuda:0, or on the CPU (GPipe's default on a machine
    // with a GPU would be the GPUs).
    options.devices(std::vector<torch::Device>(
        static_cast<size_t>(n),
        on_cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU)));
    torch::manual_seed(0);
    auto net = build(batch_norm, dropout);
    torch::manual_seed(0);
    auto ref_net = build(batch_norm, dropout);

    gpipe::dist::PipelineStage stage(net, options, mesh);
    kept_stage = stage;
    if (scenario == "mismatch" || scenario == "bad-layout") {
      std::cout << "rank " << r << ": no error in scenario " << scenario
                << "\n";
      return 4;
    }
    auto ref_options = options;
    ref_options.chunks(4 * replicas);
    gpipe::GPipe ref(ref_net, ref_options);
    // The ranks of the input and the target: 0 and n - 1, or both 0 in a V.
    const auto placement = stage->placement();
    const auto first_rank = placement.lane_of(0);
    const auto last_rank = placement.lane_of(placement.stages() - 1);
    torch::optim::SGD opt(stage->parameters(), 0.1);
    torch::optim::SGD ref_opt(ref->parameters(), 0.1);
    int loss_calls = 0;
    auto loss_fn = [&](torch::Tensor out, torch::Tensor y) {
      ++loss_calls;
      if (scenario == "throw" && loss_calls > 4) {
        throw std::runtime_error("the loss broke on purpose");
      }
      return torch::nn::functional::cross_entropy(out, y);
    };
    auto ref_loss_fn = [](torch::Tensor out, torch::Tensor y) {
      return torch::nn::functional::cross_entropy(out, y);
    };
    const auto ref_params = ref->named_parameters();
    const auto ref_buffers = ref->named_buffers();
    for (int step = 0; step < steps; ++step) {
      torch::manual_seed(100 + step);
      // 3, 3, 3, 1 rows (3, 3, 3, 2 with BatchNorm, which refuses one row
      // in training); with replicas, 2 rows each.
      const int64_t rows =
          replicas == 1 ? (batch_norm ? 11 : 10) : 8 * replicas;
      auto x = torch::randn({rows, 6}, torch::kDouble);
      auto y = torch::randint(0, 3, {rows}, torch::kLong);
      if (scenario == "kill" && r == kill_rank && step == kill_step) {
        std::raise(SIGKILL);
      }
      if (scenario == "stall" && r == kill_rank && step == kill_step) {
        // Alive but silent for longer than GPIPE_DIST_TIMEOUT: twice it
        // and 2 s.
        std::this_thread::sleep_for(
            2 * gpipe::dist::default_timeout() + std::chrono::seconds(2));
      }
      if (scenario == "forward-throw" && step == 1) {
        // Inference where rank 0's layer fails on the last micro-batch while
        // the last rank still works on the others: its forward must fail
        // with that error, not wait for a micro-batch that never comes.
        break_stash = pr == 0;
        slow_pop = pr == n - 1;
        c10::InferenceMode guard;
        stage->forward(pr == 0 ? shard(x) : torch::Tensor());
      }
      if (scenario == "no-grad" && r == 1 && step == 1) {
        torch::NoGradGuard no_grad;  // a mistake on rank 1 only
        stage->train_step(torch::Tensor(), shard(y), loss_fn, schedule);
      }
      if (scenario == "other-pass" && r == 1 && step == 1) {
        stage->forward();  // while rank 0 runs train_step
      }
      if (scenario == "other-chunks" && r == 1 && step == 1) {
        stage->options.chunks(2);  // rank 0 keeps 4
      }
      if (scenario == "bad-plan" && step == 1) {
        // A plan for 8 micro-batches where the input cuts into 4: refused
        // on every rank alike, and the stage goes on working.
        const auto bad = gpipe::make_plan(schedule, 8, n, v);
        try {
          stage->train_step(
              pr == 0 ? shard(x) : torch::Tensor(),
              pr == last_rank ? shard(y) : torch::Tensor(),
              loss_fn,
              bad);
          std::cout << "rank " << r << ": no error for a plan of 8\n";
          return 4;
        } catch (const c10::ValueError& e) {
          std::cout << "rank " << r
                    << ": refused: " << e.what_without_backtrace() << std::endl;
        }
      }
      // Only the generator of each replica's pipeline rank 0 decides the
      // step's seed: those are seeded alike, as processes usually are, and
      // the others apart on purpose.
      torch::manual_seed(pr == 0 ? 500 + step : 900 + 10 * r + step);
      const auto x_here = pr == first_rank ? shard(x) : torch::Tensor();
      const auto y_here = pr == last_rank ? shard(y) : torch::Tensor();
      auto loss = plan ? stage->train_step(x_here, y_here, loss_fn, *plan)
                       : stage->train_step(x_here, y_here, loss_fn, schedule);
      opt.step();
      opt.zero_grad();
      torch::manual_seed(500 + step);
      auto ref_loss = plan ? ref->train_step(x, y, ref_loss_fn, *plan)
                           : ref->train_step(x, y, ref_loss_fn, schedule);
      ref_opt.step();
      ref_opt.zero_grad();
      if (!close(loss, ref_loss)) {
        std::cout << "rank " << r << ": step " << step << " loss "
                  << loss.item<double>() << " but GPipe's "
                  << ref_loss.item<double>() << "\n";
        return 1;
      }
      for (const auto& p : stage->named_parameters()) {
        if (!close(p.value(), ref_params[p.key()])) {
          std::cout << "rank " << r << ": step " << step << " parameter "
                    << p.key() << " differs from GPipe's\n";
          return 1;
        }
      }
      for (const auto& b : stage->named_buffers()) {
        if (!close(b.value(), ref_buffers[b.key()])) {
          std::cout << "rank " << r << ": step " << step << " buffer "
                    << b.key() << " differs from GPipe's\n";
          return 1;
        }
      }
      std::cout << "rank " << r << ": step " << step << " loss "
                << loss.item<double>() << std::endl;
    }
    if (scenario == "die-in-save") {
      // Note [A rank killed while it saves]: the others must fail at once
      // when the killed rank hosted the store (rank 0), and name it within
      // the World's timeout otherwise.
      die_at_fsync = r == kill_rank;
      gpipe::TrainingState state;
      state.step = steps;
      gpipe::dist::save_checkpoint(
          arg(argc, argv, "--save", ""), stage, opt, state);
    }
    if (scenario != "parity" && scenario != "bad-plan") {
      std::cout << "rank " << r << ": no error in scenario " << scenario
                << "\n";
      return 4;
    }
    // Inference through the pipeline.
    stage->eval();
    ref->eval();
    torch::manual_seed(7);
    auto x =
        torch::randn({replicas == 1 ? 7 : 4 * replicas, 6}, torch::kDouble);
    torch::Tensor out;
    {
      c10::InferenceMode guard;
      out = stage->forward(pr == 0 ? shard(x) : torch::Tensor());
    }
    torch::NoGradGuard no_grad;
    auto ref_out = ref->forward(x);
    if (pr == last_rank ? !close(out, shard(ref_out)) : out.defined()) {
      std::cout << "rank " << r << ": forward differs from GPipe's\n";
      return 1;
    }
    // gpipe's malloc settings hold in a rank, for a thread started after
    // c10d's: a step's memory is reused, not taken from fresh pages (a
    // whole round takes 24,576).
    if (const long faults = second_round_faults(); faults > 1000) {
      std::cout << "rank " << r << ": a second round of 96 MiB took " << faults
                << " fresh pages; gpipe's malloc settings "
                   "should have kept the first round's\n";
      return 1;
    }
    std::cout << "rank " << r << ": OK (" << stage->named_parameters().size()
              << " parameters)" << std::endl;
    return 0;
  } catch (const c10::Error& e) {
    // what() itself, as a user's program would print it: dist_test.sh
    // checks that joining and failures carry no LibTorch backtrace.
    std::cout << "rank " << std::getenv("RANK") << " error: " << e.what()
              << std::endl;
    const std::chrono::duration<double> took =
        std::chrono::steady_clock::now() - began;
    std::cout << "rank " << std::getenv("RANK") << " failed after "
              << took.count() << " s" << std::endl;
    return 3;
  }
}
