// Training checkpoints across layouts with ranks as threads of this
// process: four steps on one layout, saved, loaded into another, four more
// steps, equal to eight steps of one GPipe that never stopped (float64,
// 1e-10), for SGD with momentum and for Adam.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <tuple>
#include <vector>

#include "checkpoint_io.h"
#include "dist/ranks.h"

namespace gpipe {
namespace {

namespace fs = std::filesystem;
using dist::Mesh;
using dist::World;
using dist::testing::run_ranks;

torch::nn::Sequential make_net() {
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(6, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      torch::nn::Linear(8, 3));
  net->to(torch::kFloat64);
  return net;
}

enum class Opt { SGDMomentum, Adam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    Opt kind, std::vector<torch::Tensor> params) {
  if (kind == Opt::SGDMomentum) {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(
      params, torch::optim::AdamOptions(0.01));
}

constexpr int64_t kRows = 8;

std::pair<torch::Tensor, torch::Tensor> batch(int64_t s) {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(100 + s);
  auto x = torch::randn({kRows, 6}, g, torch::kFloat64);
  auto y = torch::randint(0, 3, {kRows}, g, torch::kLong);
  return {x, y};
}

auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
  return torch::nn::functional::cross_entropy(out, target);
};

// A layout: one GPipe in this process (ranks 0), or D x P ranks.
struct Layout {
  const char* name;
  int64_t data;
  int64_t pipeline;
  std::vector<int64_t> balance;
  int64_t stages_per_lane;
};

const Layout kOneProcess{"one process", 0, 0, {6}, 1};
const Layout kTwoStages{"2 stages", 1, 2, {3, 3}, 1};
const Layout kFourStages{"4 stages", 1, 4, {2, 1, 2, 1}, 1};
const Layout kMesh{"2x2 mesh", 2, 2, {3, 3}, 1};
const Layout kInterleaved{"2 stages, 2 per lane", 1, 2, {1, 2, 1, 2}, 2};

struct Reference {
  std::vector<double> losses;  // of 8 steps
  // After each step s, at [s + 1]: "<layer>.<name>" -> the parameter.
  std::vector<std::map<std::string, torch::Tensor>> params;
};

Reference reference(Opt kind) {
  GPipe model(make_net(), GPipeOptions({6}).chunks(2).devices({torch::kCPU}));
  auto opt = make_optimizer(kind, model->parameters());
  Reference ref;
  for (int64_t s = 0; s < 8; ++s) {
    auto [x, y] = batch(s);
    opt->zero_grad();
    if (s == 0) {
      ref.params.emplace_back();  // unused: steps start at 0
    }
    ref.losses.push_back(model->train_step(x, y, loss_fn).item<double>());
    opt->step();
    ref.params.emplace_back();
    for (const auto& p : model->partitions()->ptr(0)->named_parameters()) {
      ref.params.back()[p.key()] = p.value().detach().clone();
    }
  }
  return ref;
}

// Runs steps [from, to) on `layout` (loading `dir` first when `load`,
// saving into it at the end when `save`), checking every loss against the
// reference, and at the end every parameter.
void run(
    const Layout& layout,
    Opt kind,
    const std::string& dir,
    bool load,
    bool save,
    int64_t from,
    int64_t to,
    const Reference& ref) {
  SCOPED_TRACE(layout.name);
  if (layout.data == 0) {
    GPipe model(
        make_net(),
        GPipeOptions(layout.balance).chunks(2).devices({torch::kCPU}));
    auto opt = make_optimizer(kind, model->parameters());
    if (load) {
      EXPECT_EQ(load_checkpoint(dir, model, *opt).step, from);
    }
    for (int64_t s = from; s < to; ++s) {
      auto [x, y] = batch(s);
      opt->zero_grad();
      EXPECT_NEAR(
          model->train_step(x, y, loss_fn).item<double>(),
          ref.losses[s],
          1e-10);
      opt->step();
    }
    for (const auto& p : model->partitions()->ptr(0)->named_parameters()) {
      EXPECT_TRUE(torch::allclose(
          p.value(), ref.params.at(to).at(p.key()), 1e-10, 1e-12))
          << p.key();
    }
    if (save) {
      TrainingState state;
      state.step = to;
      save_checkpoint(dir, model, *opt, state);
    }
    return;
  }
  std::mutex mutex;
  std::vector<std::string> failures;
  const auto n = layout.data * layout.pipeline;
  // Each replica's shard; within it, micro-batches of 4 rows as the
  // reference's.
  const auto shard = kRows / layout.data;
  const auto chunks = shard / 4;
  // Made here: threads drawing initial weights from one generator at once
  // would each get others' numbers.
  std::vector<torch::nn::Sequential> nets;
  for (int64_t r = 0; r < n; ++r) {
    nets.push_back(make_net());
  }
  run_ranks(n, [&](World world) {
    Mesh mesh(world, layout.pipeline);
    dist::PipelineStage stage(
        nets[world.rank()],
        GPipeOptions(layout.balance)
            .chunks(chunks)
            .stages_per_lane(layout.stages_per_lane)
            .threads_per_lane(1),
        mesh);
    auto opt = make_optimizer(kind, stage->parameters());
    std::vector<std::string> mine;
    auto fail = [&](const std::string& what) {
      mine.push_back("rank " + std::to_string(world.rank()) + ": " + what);
    };
    if (load) {
      const auto state = dist::load_checkpoint(dir, stage, *opt);
      if (state.step != from) {
        fail("loaded step " + std::to_string(state.step));
      }
    }
    const auto d = mesh.data_rank();
    const bool first = mesh.pipeline_rank() == 0;
    const bool last = mesh.pipeline_rank() == layout.pipeline - 1;
    for (int64_t s = from; s < to; ++s) {
      auto [x, y] = batch(s);
      opt->zero_grad();
      const auto loss =
          stage
              ->train_step(
                  first ? x.narrow(0, d * shard, shard) : torch::Tensor(),
                  last ? y.narrow(0, d * shard, shard) : torch::Tensor(),
                  loss_fn)
              .item<double>();
      opt->step();
      if (std::abs(loss - ref.losses[s]) > 1e-10) {
        fail(
            "step " + std::to_string(s) + ": loss " + std::to_string(loss) +
            " but " + std::to_string(ref.losses[s]));
      }
    }
    for (const auto& part : stage->partitions()) {
      for (const auto& p : part->named_parameters()) {
        if (!torch::allclose(
                p.value(), ref.params.at(to).at(p.key()), 1e-10, 1e-12)) {
          fail("parameter " + p.key() + " differs");
        }
      }
    }
    if (save) {
      TrainingState state;
      state.step = to;
      dist::save_checkpoint(dir, stage, *opt, state);
    }
    std::lock_guard<std::mutex> lock(mutex);
    failures.insert(failures.end(), mine.begin(), mine.end());
  });
  for (const auto& f : failures) {
    ADD_FAILURE() << f;
  }
}

struct TempDir {
  TempDir() {
    static int counter = 0;
    path = (fs::temp_directory_path() /
            ("gpipe-dist-ckpt-" + std::to_string(::getpid()) + "-" +
             std::to_string(counter++)))
               .string();
    detail::remove_tree(path);
  }
  ~TempDir() {
    detail::remove_tree(path);
  }
  std::string path;
};

TEST(DistCheckpointTest, EveryLayoutGoesOnFromAnothersCheckpoint) {
  const std::vector<Layout> layouts{
      kOneProcess, kTwoStages, kFourStages, kMesh, kInterleaved};
  std::vector<std::pair<Layout, Layout>> pairs;
  for (const auto& a : layouts) {
    for (const auto& b : layouts) {
      pairs.emplace_back(a, b);
    }
  }
  for (const auto kind : {Opt::SGDMomentum, Opt::Adam}) {
    const auto ref = reference(kind);
    for (const auto& [a, b] : pairs) {
      SCOPED_TRACE(
          std::string(kind == Opt::Adam ? "Adam: " : "SGD: ") + a.name +
          " -> " + b.name);
      TempDir dir;
      run(a, kind, dir.path, /*load=*/false, /*save=*/true, 0, 4, ref);
      run(b, kind, dir.path, /*load=*/true, /*save=*/false, 4, 8, ref);
    }
  }
}

// A file per pipeline rank (the replicas hold the same), the generator's
// state apart, and the layout in the manifest.
TEST(DistCheckpointTest, TheManifestNamesTheMeshLayout) {
  TempDir dir;
  const auto ref = reference(Opt::SGDMomentum);
  run(kMesh, Opt::SGDMomentum, dir.path, false, true, 0, 2, ref);
  const auto ckpt = latest_checkpoint(dir.path);
  ASSERT_FALSE(ckpt.empty());
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(ckpt)) {
    files.push_back(entry.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  EXPECT_EQ(
      files,
      (std::vector<std::string>{
          "manifest.json", "random.bin", "rank-0.bin", "rank-1.bin"}));
  std::ifstream in(fs::path(ckpt) / "manifest.json");
  const std::string text(
      (std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const auto* part :
       {"\"processes\": 4",
        "\"pipeline_size\": 2",
        "\"data_size\": 2",
        "\"writer\": \"gpipe::dist::PipelineStage\"",
        "\"optimizer\": \"SGD\"",
        "\"step\": 2"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << " in " << text;
  }
}

// A rank whose part cannot be written (its optimizer holds a parameter of
// another model) fails the save on every rank, none left waiting, and the
// checkpoint before stays the newest.
TEST(DistCheckpointTest, ARankThatCannotSaveFailsEveryRank) {
  TempDir dir;
  const auto ref = reference(Opt::SGDMomentum);
  run(kTwoStages, Opt::SGDMomentum, dir.path, false, true, 0, 1, ref);
  std::vector<torch::nn::Sequential> nets{make_net(), make_net()};
  auto foreign = make_net();
  std::mutex mutex;
  std::vector<std::string> errors;
  run_ranks(2, [&](World world) {
    dist::PipelineStage stage(
        nets[world.rank()],
        GPipeOptions({3, 3}).chunks(2).threads_per_lane(1),
        world);
    auto params = stage->parameters();
    if (world.rank() == 1) {
      params.push_back(foreign->parameters()[0]);
    }
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
    TrainingState state;
    state.step = 5;
    std::string what = "saved";
    try {
      dist::save_checkpoint(dir.path, stage, opt, state);
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    }
    std::lock_guard<std::mutex> lock(mutex);
    errors.push_back(what);
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& what : errors) {
    EXPECT_NE(what.find("not one of the model's"), std::string::npos) << what;
    EXPECT_NE(
        what.find("build its optimizer from stage->parameters()"),
        std::string::npos)
        << what;
  }
  // Rank 0 (which writes the manifest) names the rank that failed.
  const auto at_zero =
      std::count_if(errors.begin(), errors.end(), [](const std::string& e) {
        return e.find(
                   "rank 1 (pipeline rank 1 of the first replica) could not "
                   "write its partitions") != std::string::npos;
      });
  EXPECT_GE(at_zero, 1) << errors[0] << "\n" << errors[1];
  EXPECT_EQ(read_training_state(dir.path).step, 1);
}

// Each rank's ValueError ("accepted" when none) from loading `dir` into a
// fresh 2-stage pipeline, whose parameters a refused load leaves as they
// were.
std::vector<std::string> load_on_two_ranks(const std::string& dir) {
  std::mutex mutex;
  std::vector<std::string> errors;
  std::vector<torch::nn::Sequential> nets{make_net(), make_net()};
  run_ranks(2, [&](World world) {
    dist::PipelineStage stage(
        nets[world.rank()],
        GPipeOptions({3, 3}).chunks(2).threads_per_lane(1),
        world);
    auto opt = make_optimizer(Opt::SGDMomentum, stage->parameters());
    std::vector<torch::Tensor> before;
    for (const auto& p : stage->parameters()) {
      before.push_back(p.detach().clone());
    }
    std::string what = "accepted";
    try {
      dist::load_checkpoint(dir, stage, *opt);
    } catch (const c10::ValueError& e) {
      what = e.what_without_backtrace();
    }
    const auto after = stage->parameters();
    for (size_t k = 0; k < before.size(); ++k) {
      EXPECT_TRUE(torch::equal(before[k], after[k]));
    }
    std::lock_guard<std::mutex> lock(mutex);
    errors.push_back(what);
  });
  return errors;
}

TEST(
    DistCheckpointTest,
    ARankThatCannotLoadFailsEveryRankBeforeAnythingChanges) {
  TempDir dir;
  const auto ref = reference(Opt::SGDMomentum);
  run(kTwoStages, Opt::SGDMomentum, dir.path, false, true, 0, 1, ref);
  // Damage pipeline rank 1's file only.
  const auto file = fs::path(latest_checkpoint(dir.path)) / "rank-1.bin";
  fs::resize_file(file, fs::file_size(file) - 8);
  const auto errors = load_on_two_ranks(dir.path);
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& what : errors) {
    EXPECT_NE(what.find("rank-1.bin"), std::string::npos) << what;
    EXPECT_NE(what.find("truncated"), std::string::npos) << what;
  }
}

// A newest checkpoint without its manifest: rank 0 chooses what to load,
// and its refusal reaches every rank (none left waiting for its choice).
TEST(DistCheckpointTest, ABrokenNewestCheckpointIsRefusedOnEveryRank) {
  TempDir dir;
  const auto ref = reference(Opt::SGDMomentum);
  run(kTwoStages, Opt::SGDMomentum, dir.path, false, true, 0, 1, ref);
  fs::create_directory(fs::path(dir.path) / "step-00000007");
  const auto errors = load_on_two_ranks(dir.path);
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& what : errors) {
    EXPECT_NE(
        what.find("step-00000007' is not a whole checkpoint"),
        std::string::npos)
        << what;
  }
}

// BatchNorm's running statistics are per replica (each normalizes its own
// shard): a checkpoint kept replica 0's only, and after a load every
// replica held replica 0's, so a resume in the same layout was not the
// uninterrupted run. Each replica gets its own back; a layout with more
// replicas than were saved gives the others replica 0's.
TEST(DistCheckpointTest, EveryReplicaLoadsItsOwnBatchNormStatistics) {
  TempDir dir;
  auto make_bn_net = [] {
    torch::manual_seed(0);
    torch::nn::Sequential net(
        torch::nn::Linear(6, 8),
        torch::nn::BatchNorm1d(8),
        torch::nn::Tanh(),
        torch::nn::Linear(8, 3));
    net->to(torch::kFloat64);
    return net;
  };
  std::vector<torch::nn::Sequential> nets;
  for (int64_t r = 0; r < 8; ++r) {
    nets.push_back(make_bn_net());
  }
  // "<rank>/<layer>.<buffer>" -> the buffer at the save.
  std::map<std::string, torch::Tensor> saved;
  std::map<std::string, torch::Tensor> loaded;
  std::mutex mutex;
  auto buffers_of = [](const dist::PipelineStage& stage, int64_t rank) {
    std::map<std::string, torch::Tensor> out;
    for (const auto& part : stage->partitions()) {
      for (const auto& b : part->named_buffers()) {
        out[std::to_string(rank) + "/" + b.key()] = b.value().clone();
      }
    }
    return out;
  };
  auto stage_of = [&](World world, int64_t replicas, int64_t offset) {
    return dist::PipelineStage(
        nets[offset + world.rank()],
        GPipeOptions({2, 2}).chunks(2).threads_per_lane(1),
        Mesh(world, world.size() / replicas));
  };
  run_ranks(4, [&](World world) {
    auto stage = stage_of(world, 2, 0);
    const auto& mesh = stage->mesh();
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.1));
    for (int64_t s = 0; s < 2; ++s) {
      auto [x, y] = batch(s);
      const auto d = mesh.data_rank();
      // The replicas' shards differ: so do their statistics.
      opt.zero_grad();
      stage->train_step(
          mesh.pipeline_rank() == 0 ? x.narrow(0, d * 4, 4) * (d + 1)
                                    : torch::Tensor(),
          mesh.pipeline_rank() == 1 ? y.narrow(0, d * 4, 4) : torch::Tensor(),
          loss_fn);
      opt.step();
    }
    TrainingState state;
    state.step = 2;
    dist::save_checkpoint(dir.path, stage, opt, state);
    const auto mine = buffers_of(stage, world.rank());
    std::lock_guard<std::mutex> lock(mutex);
    saved.insert(mine.begin(), mine.end());
  });
  ASSERT_FALSE(saved.empty());
  ASSERT_FALSE(
      torch::equal(saved.at("0/1.running_mean"), saved.at("2/1.running_mean")));
  // The same layout, fresh models: each rank its own statistics.
  run_ranks(4, [&](World world) {
    auto stage = stage_of(world, 2, 4);
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.1));
    dist::load_checkpoint(dir.path, stage, opt);
    const auto mine = buffers_of(stage, world.rank());
    std::lock_guard<std::mutex> lock(mutex);
    loaded.insert(mine.begin(), mine.end());
  });
  ASSERT_EQ(loaded.size(), saved.size());
  for (const auto& [key, value] : saved) {
    EXPECT_TRUE(torch::equal(loaded.at(key), value)) << key;
  }
  // Four replicas of the 2-rank pipeline: replicas 2 and 3 were not saved
  // and take replica 0's.
  loaded.clear();
  for (auto& net : nets) {
    net = make_bn_net();
  }
  run_ranks(8, [&](World world) {
    auto stage = dist::PipelineStage(
        nets[world.rank()],
        GPipeOptions({2, 2}).chunks(1).threads_per_lane(1),
        Mesh(world, 2));
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.1));
    dist::load_checkpoint(dir.path, stage, opt);
    const auto mine = buffers_of(stage, world.rank());
    std::lock_guard<std::mutex> lock(mutex);
    loaded.insert(mine.begin(), mine.end());
  });
  for (const auto* buffer : {"1.running_mean", "1.running_var"}) {
    for (int64_t r : {0, 2}) {
      EXPECT_TRUE(torch::equal(
          loaded.at(std::to_string(r) + "/" + buffer),
          saved.at(std::to_string(r) + "/" + buffer)))
          << r << " " << buffer;
    }
    for (int64_t r : {4, 6}) {
      EXPECT_TRUE(torch::equal(
          loaded.at(std::to_string(r) + "/" + buffer),
          saved.at(std::string("0/") + buffer)))
          << r << " " << buffer;
    }
  }
}

// Each rank's message (or "ok"; "ValueError: " before a ValueError's) from
// `call(rank, stage, optimizer)` on two ranks of a 2-stage pipeline whose World
// times out after `timeout`, and the longest a rank took.
using RankCall = std::function<void(
    int64_t, dist::PipelineStage&, torch::optim::Optimizer&)>;

// As on_two_ranks, on `n` ranks (2 or 3) of 6 layers in all.
std::pair<std::vector<std::string>, double> on_ranks(
    int64_t n, std::chrono::milliseconds timeout, const RankCall& call) {
  std::vector<torch::nn::Sequential> nets;
  for (int64_t r = 0; r < n; ++r) {
    nets.push_back(make_net());
  }
  const std::vector<int64_t> balance(
      static_cast<size_t>(n), 6 / std::max<int64_t>(n, 1));
  std::vector<std::string> errors(static_cast<size_t>(n), "ok");
  std::vector<double> seconds(static_cast<size_t>(n), 0.0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  dist::testing::run_threads(n, [&](int64_t r) {
    auto world = dist::init_from_store(store, r, n, timeout);
    dist::PipelineStage stage(
        nets[r], GPipeOptions(balance).chunks(2).threads_per_lane(1), world);
    const auto opt = make_optimizer(Opt::SGDMomentum, stage->parameters());
    const auto began = std::chrono::steady_clock::now();
    try {
      call(r, stage, *opt);
    } catch (const c10::ValueError& e) {
      errors[r] = std::string("ValueError: ") + e.what_without_backtrace();
    } catch (const c10::Error& e) {
      errors[r] = e.what_without_backtrace();
    }
    seconds[r] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - began)
            .count();
  });
  return {errors, *std::max_element(seconds.begin(), seconds.end())};
}

std::pair<std::vector<std::string>, double> on_two_ranks(
    std::chrono::milliseconds timeout, const RankCall& call) {
  return on_ranks(2, timeout, call);
}

// Ranks that do not make the same checkpoint call at once waited on the
// store for 300 s (its own timeout, not the World's) and said only "Wait
// timeout"; ranks that saved with optimizers of different kinds wrote a
// checkpoint no optimizer could load. Every rank now refuses at once,
// naming both calls, and writes nothing (Note [Checkpoint calls within the
// timeout]).
TEST(
    DistCheckpointTest, RanksThatCallAnotherCheckpointFunctionAllRefuseAtOnce) {
  TempDir dir;
  TrainingState state;
  state.step = 3;
  auto [errors, seconds] = on_two_ranks(
      std::chrono::seconds(20),
      [&](int64_t r, dist::PipelineStage& stage, torch::optim::Optimizer& o) {
        if (r == 0) {
          dist::save_checkpoint(dir.path, stage, o, state);
        } else {
          dist::load_checkpoint(dir.path, stage, o);
        }
      });
  EXPECT_LT(seconds, 10.0);
  for (const auto& e : errors) {
    EXPECT_NE(
        e.find("rank 1 called load_checkpoint(optimizer SGD) but rank 0 "
               "called save_checkpoint(step 3, optimizer SGD)"),
        std::string::npos)
        << e;
  }
  EXPECT_EQ(latest_checkpoint(dir.path), "");

  std::tie(errors, seconds) = on_two_ranks(
      std::chrono::seconds(20),
      [&](int64_t r, dist::PipelineStage& stage, torch::optim::Optimizer& o) {
        if (r == 1) {
          torch::optim::Adam adam(
              stage->parameters(), torch::optim::AdamOptions(0.01));
          dist::save_checkpoint(dir.path, stage, adam, state);
        } else {
          dist::save_checkpoint(dir.path, stage, o, state);
        }
      });
  EXPECT_LT(seconds, 10.0);
  for (const auto& e : errors) {
    EXPECT_NE(
        e.find("rank 1 called save_checkpoint(step 3, optimizer Adam) but "
               "rank 0 called save_checkpoint(step 3, optimizer SGD)"),
        std::string::npos)
        << e;
    EXPECT_EQ(e.rfind("ValueError: ", 0), 0u) << e;
  }
  EXPECT_EQ(latest_checkpoint(dir.path), "");
}

// A rank that never comes is waited for as long as the World's timeout
// says, and named; one that comes after the others gave up hears so at
// once, rather than waiting out a timeout of its own.
TEST(DistCheckpointTest, ARankThatNeverSavesIsNamedWithinTheTimeout) {
  TempDir dir;
  auto [errors, seconds] = on_two_ranks(
      std::chrono::seconds(2),
      [&](int64_t r, dist::PipelineStage& stage, torch::optim::Optimizer& o) {
        if (r == 0) {
          dist::save_checkpoint(dir.path, stage, o, TrainingState{});
        }
      });
  EXPECT_LT(seconds, 10.0);
  EXPECT_NE(
      errors[0].find("save_checkpoint: rank 0 waited 2 s for rank 1, which "
                     "had not reached it"),
      std::string::npos)
      << errors[0];
  EXPECT_EQ(errors[1], "ok");
  // Of three ranks, every one that had not reached it (only the first was
  // named).
  std::tie(errors, seconds) = on_ranks(
      3,
      std::chrono::seconds(2),
      [&](int64_t r, dist::PipelineStage& stage, torch::optim::Optimizer& o) {
        if (r == 0) {
          dist::save_checkpoint(dir.path, stage, o, TrainingState{});
        }
      });
  EXPECT_NE(
      errors[0].find("save_checkpoint: rank 0 waited 2 s for rank 1 and rank "
                     "2, which had not reached it"),
      std::string::npos)
      << errors[0];

  std::vector<double> took(2, 0.0);
  std::tie(errors, seconds) = on_two_ranks(
      std::chrono::seconds(2),
      [&](int64_t r, dist::PipelineStage& stage, torch::optim::Optimizer& o) {
        if (r == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3000));
        }
        const auto began = std::chrono::steady_clock::now();
        try {
          dist::save_checkpoint(dir.path, stage, o, TrainingState{});
        } catch (...) {
          took[r] = std::chrono::duration<double>(
                        std::chrono::steady_clock::now() - began)
                        .count();
          throw;
        }
      });
  EXPECT_LT(took[1], 1.5) << errors[1];  // the timeout is 2 s
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0 waited 2 s for rank 1"), std::string::npos) << e;
  }
  EXPECT_NE(errors[1].find("rank 1 gave up too"), std::string::npos)
      << errors[1];
  EXPECT_EQ(latest_checkpoint(dir.path), "");
}

// Rank 0's refusal of the state it saves reaches the other ranks as the
// same kind of error (it was a plain c10::Error there).
TEST(DistCheckpointTest, RankZerosRefusalIsTheSameKindOfErrorOnEveryRank) {
  TempDir dir;
  TrainingState state;
  state.epoch = -1;
  auto [errors, seconds] = on_two_ranks(
      std::chrono::seconds(20),
      [&](int64_t, dist::PipelineStage& stage, torch::optim::Optimizer& o) {
        dist::save_checkpoint(dir.path, stage, o, state);
      });
  for (const auto& e : errors) {
    EXPECT_EQ(e.rfind("ValueError: ", 0), 0u) << e;
    EXPECT_NE(
        e.find("TrainingState expects epoch and position >= 0"),
        std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace gpipe
