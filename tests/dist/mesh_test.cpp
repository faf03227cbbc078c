// World::split, Mesh and data-parallel PipelineStages, with every rank a
// thread of this process: Gloo groups over loopback that meet in one
// c10d::HashStore. Real processes are tests/dist/dist_test.sh's.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/trace.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../common.h"
#include "dist/data_parallel.h"
#include "dist/ranks.h"

namespace gpipe {
namespace {

using dist::Mesh;
using dist::World;
using dist::testing::run_ranks;
using testing::PopAdd;
using testing::TanhStash;

TEST(MeshTest, SplitGroupsByColorAndRanksByKey) {
  std::mutex mutex;
  std::vector<std::vector<int64_t>> seen(4);
  run_ranks(4, [&](World world) {
    const auto r = world.rank();
    // Evens and odds, each ranked from the highest rank down.
    auto part = world.split(r % 2, -r);
    auto sum = torch::tensor({r}, torch::kLong);
    part.all_reduce(sum);
    auto root = torch::tensor({r * 10}, torch::kLong);
    part.broadcast(root, 0);
    part.barrier();
    std::lock_guard<std::mutex> lock(mutex);
    seen[r] = {
        part.rank(), part.size(), sum.item<int64_t>(), root.item<int64_t>()};
  });
  // Rank 2 is first among the evens, rank 3 among the odds.
  EXPECT_EQ(seen[0], (std::vector<int64_t>{1, 2, 2, 20}));
  EXPECT_EQ(seen[1], (std::vector<int64_t>{1, 2, 4, 30}));
  EXPECT_EQ(seen[2], (std::vector<int64_t>{0, 2, 2, 20}));
  EXPECT_EQ(seen[3], (std::vector<int64_t>{0, 2, 4, 30}));
}

TEST(MeshTest, SplitRefusesANegativeColor) {
  run_ranks(1, [](World world) {
    EXPECT_THROW(world.split(-1, 0), c10::ValueError);
    // A World of one rank needs no group, and its collectives do nothing.
    auto alone = world.split(0, 0);
    auto t = torch::ones({3});
    alone.all_reduce(t);
    EXPECT_TRUE(t.equal(torch::ones({3})));
  });
}

TEST(MeshTest, LayoutPutsAReplicasStagesSideBySide) {
  std::mutex mutex;
  std::vector<std::vector<int64_t>> seen(4);
  run_ranks(4, [&](World world) {
    Mesh mesh(world, 2);
    // The data World sums what the ranks of one stage hold.
    auto t = torch::tensor({world.rank()}, torch::kLong);
    mesh.data().all_reduce(t);
    std::lock_guard<std::mutex> lock(mutex);
    seen[world.rank()] = {
        mesh.pipeline_rank(),
        mesh.data_rank(),
        mesh.pipeline_size(),
        mesh.data_size(),
        t.item<int64_t>()};
  });
  EXPECT_EQ(seen[0], (std::vector<int64_t>{0, 0, 2, 2, 2}));
  EXPECT_EQ(seen[1], (std::vector<int64_t>{1, 0, 2, 2, 4}));
  EXPECT_EQ(seen[2], (std::vector<int64_t>{0, 1, 2, 2, 2}));
  EXPECT_EQ(seen[3], (std::vector<int64_t>{1, 1, 2, 2, 4}));
}

// Rank 0 given 2, the others 4: three ranks built meshes of 1 replica and
// rank 0 waited in a split until the timeout; one rank given 3 refused
// alone and left the others waiting. Every rank refuses alike now, at
// once, and the World stays usable.
TEST(MeshTest, RanksGivenOtherPipelineSizesAllRefuse) {
  run_ranks(4, [](World world) {
    for (const int64_t odd : {2, 3}) {
      const int64_t mine = world.rank() == (odd == 2 ? 0 : 1) ? odd : 4;
      try {
        Mesh mesh(world, mine);
        ADD_FAILURE() << "no error on rank " << world.rank();
      } catch (const c10::ValueError& e) {
        const std::string what = e.what_without_backtrace();
        EXPECT_NE(
            what.find(
                "expects the same pipeline size on every rank, but the "
                "ranks passed sizes from " +
                std::to_string(odd) + " to 4"),
            std::string::npos)
            << what;
      }
    }
    auto t = torch::ones({2});
    world.all_reduce(t);
    EXPECT_TRUE(t.equal(torch::full({2}, 4.0)));
    Mesh mesh(world, 2);
    EXPECT_EQ(mesh.data_size(), 2);
  });
}

TEST(MeshTest, APipelineSizeThatDoesNotDivideTheWorldIsRefused) {
  run_ranks(4, [](World world) {
    try {
      Mesh mesh(world, 3);
      ADD_FAILURE() << "no error";
    } catch (const c10::ValueError& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("has 4 ranks"), std::string::npos) << what;
      EXPECT_NE(what.find("pipeline size is 3"), std::string::npos) << what;
    }
    // 4 is a multiple of -1: what is wrong is the sign.
    for (const int64_t bad : {0, -1}) {
      try {
        Mesh mesh(world, bad);
        ADD_FAILURE() << "no error for " << bad;
      } catch (const c10::ValueError& e) {
        const std::string what = e.what_without_backtrace();
        EXPECT_NE(what.find("at least 1"), std::string::npos) << what;
      }
    }
  });
}

// Seven layers with a skip from layer 1 to layer 5.
// (`relu`: a ReLU for layer 3's Tanh, a model that differs in one layer.)
torch::nn::Sequential build(int64_t seed, bool relu = false) {
  torch::manual_seed(seed);
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(6, 10));
  net->push_back(TanhStash());
  net->push_back(torch::nn::Linear(10, 10));
  if (relu) {
    net->push_back(torch::nn::ReLU());
  } else {
    net->push_back(torch::nn::Tanh());
  }
  net->push_back(torch::nn::Linear(10, 10));
  net->push_back(PopAdd());
  net->push_back(torch::nn::Linear(10, 3));
  net->to(torch::kDouble);
  return net;
}

// build(0) for each of `ranks` ranks: equal models, one per rank's thread.
std::vector<torch::nn::Sequential> nets_of_ranks(int64_t ranks) {
  std::vector<torch::nn::Sequential> nets;
  for (int64_t r = 0; r < ranks; ++r) {
    nets.push_back(build(0));
  }
  return nets;
}

// What the mesh tests train on: `rows` rows of build()'s 6 features in
// float64 and their classes of 3, from seed 3; and the loss.
struct Batch {
  torch::Tensor x;
  torch::Tensor y;
};

Batch batch_of(int64_t rows) {
  torch::manual_seed(3);
  Batch batch;
  batch.x = torch::randn({rows, 6}, torch::kDouble);
  batch.y = torch::randint(0, 3, {rows}, torch::kLong);
  return batch;
}

torch::Tensor cross_entropy(torch::Tensor out, torch::Tensor target) {
  return torch::nn::functional::cross_entropy(out, target);
}

// A 1F1B step of a 2-stage pipeline on its replica's shard of `batch`, 4
// rows a replica: the inputs on its first stage, the targets on its last.
torch::Tensor train_on_shard(
    dist::PipelineStage& stage,
    const dist::Mesh& mesh,
    const Batch& batch,
    const LossFunction& loss = cross_entropy) {
  const auto d = mesh.data_rank();
  return stage->train_step(
      mesh.pipeline_rank() == 0 ? batch.x.narrow(0, 4 * d, 4) : torch::Tensor(),
      mesh.pipeline_rank() == 1 ? batch.y.narrow(0, 4 * d, 4) : torch::Tensor(),
      loss,
      Schedule::OneFOneB);
}

// A balance of `stages` partitions of build()'s seven layers.
std::vector<int64_t> balance_of(int64_t stages) {
  switch (stages) {
    case 1:
      return {7};
    case 2:
      return {3, 4};
    case 4:
      return {2, 2, 2, 1};
    default:
      return {};
  }
}

struct MeshLayout {
  int64_t data;
  int64_t pipeline;
  int64_t stages_per_lane;
  Schedule schedule;
  Placement placement = {};  // empty: modulo
};

std::string name_of(const MeshLayout& l) {
  return std::to_string(l.data) + "x" + std::to_string(l.pipeline) + " v" +
         std::to_string(l.stages_per_lane) + " " + to_string(l.schedule) +
         " on " + to_string(l.placement);
}

// What the ranks' threads found wrong, reported on the test's thread.
class RankFailures {
 public:
  void add(const std::vector<std::string>& found) {
    std::lock_guard<std::mutex> lock(mutex_);
    failures_.insert(failures_.end(), found.begin(), found.end());
  }
  void report() const {
    for (const auto& f : failures_) {
      ADD_FAILURE() << f;
    }
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> failures_;
};

// "<where>: parameter NAME differs" (or "the gradient of NAME", with
// `grads`) for each parameter of `module` not within 1e-10 of
// `expected(NAME)`.
template <typename Expected>
std::vector<std::string> differing(
    const torch::nn::Module& module,
    const Expected& expected,
    const std::string& where,
    bool grads = false) {
  std::vector<std::string> found;
  for (const auto& p : module.named_parameters()) {
    const auto& value = grads ? p.value().grad() : p.value();
    if (!torch::allclose(value, expected(p.key()), 1e-10, 1e-12)) {
      found.push_back(
          where + (grads ? ": the gradient of " : ": parameter ") + p.key() +
          " differs");
    }
  }
  return found;
}

// Two steps of D replicas of a P-stage pipeline, each replica on its own
// shard, against one GPipe under fill-drain on the whole batch: losses and
// parameters agree (float64, 1e-10). The replicas' models start from
// different seeds: the stage copies data rank 0's parameters.
void expect_equal_to_one_pipeline(const MeshLayout& layout) {
  SCOPED_TRACE(name_of(layout));
  const int64_t stages = layout.placement.empty()
                             ? layout.pipeline * layout.stages_per_lane
                             : layout.placement.stages();
  const auto balance = balance_of(stages);
  const auto options = GPipeOptions(balance)
                           .chunks(4)
                           .checkpoint(Checkpoint::ExceptLast)
                           .stages_per_lane(layout.stages_per_lane)
                           .placement(layout.placement)
                           .threads_per_lane(1);
  const int64_t rows = 8 * layout.data;
  const auto batch = batch_of(rows);
  const auto& x = batch.x;
  const auto& y = batch.y;
  const LossFunction loss_fn = cross_entropy;

  // The reference: one pipeline in this process, on the whole batch.
  GPipe ref(build(0), options);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  std::vector<torch::Tensor> ref_losses;
  for (int step = 0; step < 2; ++step) {
    ref_losses.push_back(ref->train_step(x, y, loss_fn, Schedule::FillDrain));
    ref_opt.step();
    ref_opt.zero_grad();
  }
  const auto ref_params = ref->named_parameters();

  const int64_t n = layout.data * layout.pipeline;
  std::vector<torch::nn::Sequential> nets;
  for (int64_t r = 0; r < n; ++r) {
    nets.push_back(build(r / layout.pipeline));  // a seed per replica
  }
  RankFailures failures;
  run_ranks(n, [&](World world) {
    const auto r = world.rank();
    Mesh mesh(world, layout.pipeline);
    dist::PipelineStage stage(nets[r], options, mesh);
    torch::optim::SGD opt(stage->parameters(), 0.1);
    const auto d = mesh.data_rank();
    const auto shard = rows / layout.data;
    // Where the first and the last partition are (both on rank 0 in a V).
    const auto placement = stage->placement();
    const bool first = mesh.pipeline_rank() == placement.lane_of(0);
    const bool last = mesh.pipeline_rank() == placement.lane_of(stages - 1);
    std::vector<std::string> mine;
    // It prints its placement as GPipe does, last there and before the
    // checkpoint here (it left it out).
    std::ostringstream printed;
    std::ostringstream expected;
    stage->pretty_print(printed);
    ref->pretty_print(expected);
    const auto at = printed.str().find("placement=");
    const auto ref_at = expected.str().find("placement=");
    const auto mine_placed =
        at == std::string::npos
            ? std::string()
            : printed.str().substr(
                  at, printed.str().find(", checkpoint=") - at);
    const auto ref_placed =
        ref_at == std::string::npos
            ? std::string()
            : expected.str().substr(ref_at, expected.str().size() - 1 - ref_at);
    if (mine_placed != ref_placed) {
      mine.push_back(
          "rank " + std::to_string(r) + " prints '" + printed.str() +
          "', GPipe '" + expected.str() + "'");
    }
    for (int step = 0; step < 2; ++step) {
      auto loss = stage->train_step(
          first ? x.narrow(0, d * shard, shard) : torch::Tensor(),
          last ? y.narrow(0, d * shard, shard) : torch::Tensor(),
          loss_fn,
          layout.schedule);
      opt.step();
      opt.zero_grad();
      if (!torch::allclose(loss, ref_losses[step], 1e-10, 1e-12)) {
        mine.push_back(
            "rank " + std::to_string(r) + " step " + std::to_string(step) +
            ": loss " + std::to_string(loss.item<double>()) + " but " +
            std::to_string(ref_losses[step].item<double>()));
      }
    }
    failures.add(mine);
    failures.add(differing(
        *stage,
        [&](const std::string& name) { return ref_params[name]; },
        "rank " + std::to_string(r)));
  });
  failures.report();
}

TEST(MeshTest, ReplicasOfAPipelineEqualOnePipelineOnTheWholeBatch) {
  for (auto schedule :
       {Schedule::FillDrain, Schedule::OneFOneB, Schedule::ZeroBubble}) {
    expect_equal_to_one_pipeline({1, 4, 1, schedule});
    expect_equal_to_one_pipeline({2, 2, 1, schedule});
    expect_equal_to_one_pipeline({4, 1, 1, schedule});
  }
}

TEST(MeshTest, ReplicasOfAnInterleavedPipelineEqualOnePipeline) {
  for (auto schedule :
       {Schedule::FillDrain,
        Schedule::OneFOneB,
        Schedule::Interleaved1F1B,
        Schedule::ZeroBubble}) {
    expect_equal_to_one_pipeline({2, 2, 2, schedule});
  }
}

// The skip (layer 1 to layer 5) crosses ranks in each: stage 0 on rank 0,
// stage 2 on rank 1.
TEST(MeshTest, PipelinesOnOtherPlacementsEqualFillDrain) {
  expect_equal_to_one_pipeline(
      {1, 2, 1, Schedule::ZeroBubbleV, Placement::v_shape(2)});
  expect_equal_to_one_pipeline(
      {2, 2, 1, Schedule::ZeroBubbleV, Placement::v_shape(2)});
  expect_equal_to_one_pipeline({1, 2, 2, Schedule::LoopedBFS});
  expect_equal_to_one_pipeline(
      {1, 2, 1, Schedule::LoopedBFS, Placement::v_shape(2)});
  // Two adjacent partitions on each rank.
  expect_equal_to_one_pipeline(
      {1, 2, 1, Schedule::OneFOneB, Placement({0, 0, 1, 1})});
}

// Rank 0 reads the input: a placement that puts partition 0 elsewhere is
// refused on every rank, before anything is built.
TEST(MeshTest, APlacementWithoutPartitionZeroOnRankZeroIsRefused) {
  std::mutex mutex;
  std::vector<std::string> errors;
  run_ranks(2, [&](World world) {
    try {
      dist::PipelineStage stage(
          build(0), GPipeOptions({3, 4}).placement(Placement({1, 0})), world);
      std::lock_guard<std::mutex> lock(mutex);
      errors.push_back("no error");
    } catch (const c10::ValueError& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors.push_back(e.what_without_backtrace());
    }
  });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) {
    EXPECT_NE(
        e.find("the placement must put partition 0 on lane 0, but [1, 0] "
               "puts it on lane 1"),
        std::string::npos)
        << e;
  }
}

// Between steps a layer is frozen, then thawed, and the gradients are set
// to none once: the buckets follow what trains, and every step still equals
// one pipeline on the whole batch.
TEST(MeshTest, FreezingALayerBetweenStepsIsFollowed) {
  const auto options = GPipeOptions({3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto& x = batch.x;
  const auto& y = batch.y;
  const LossFunction loss_fn = cross_entropy;
  // Step 1: partition 1's first Linear (layer 4) frozen; step 2: thawed;
  // before step 3: every gradient set to none.
  auto prepare = [](torch::nn::Module& m, int step) {
    for (auto& p : m.named_parameters()) {
      if (p.key().rfind("partitions.1.4.", 0) == 0) {
        p.value().requires_grad_(step != 1);
      }
      if (step == 3) {
        p.value().mutable_grad() = torch::Tensor();
      }
    }
  };
  GPipe ref(build(0), options);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  std::vector<torch::Tensor> ref_losses;
  for (int step = 0; step < 4; ++step) {
    prepare(*ref, step);
    ref_losses.push_back(ref->train_step(x, y, loss_fn, Schedule::OneFOneB));
    ref_opt.step();
    ref->zero_grad();
  }
  const auto ref_params = ref->named_parameters();
  const auto nets = nets_of_ranks(4);
  RankFailures failures;
  run_ranks(4, [&](World world) {
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[world.rank()], options, mesh);
    torch::optim::SGD opt(stage->parameters(), 0.1);
    const auto d = mesh.data_rank();
    std::vector<std::string> mine;
    for (int step = 0; step < 4; ++step) {
      prepare(*stage, step);
      auto loss = stage->train_step(
          mesh.pipeline_rank() == 0 ? x.narrow(0, 4 * d, 4) : torch::Tensor(),
          mesh.pipeline_rank() == 1 ? y.narrow(0, 4 * d, 4) : torch::Tensor(),
          loss_fn,
          Schedule::OneFOneB);
      opt.step();
      stage->zero_grad();
      if (!torch::allclose(loss, ref_losses[step], 1e-10, 1e-12)) {
        mine.push_back("step " + std::to_string(step) + ": loss differs");
      }
    }
    failures.add(mine);
    failures.add(differing(
        *stage,
        [&](const std::string& name) { return ref_params[name]; },
        "rank " + std::to_string(world.rank())));
  });
  failures.report();
}

// Replicas whose gradient buckets differ (a bucket size set on one
// replica only, or one replica cast to float32) aborted every rank of
// the stage inside Gloo. Now each rank throws a c10::Error, and a
// difference on the first stage is refused before the step, leaving the
// stages usable.
TEST(MeshTest, ReplicasWhoseBucketsDifferAreRefusedNotAborted) {
  const auto batch = batch_of(8);
  // Who differs: both stages of replica 1 (seen by the first stages before
  // the step), or only its last stage (seen on the lane, before the first
  // bucket starts), in bucket size or in dtype.
  struct Case {
    const char* what;
    std::vector<int64_t> ranks;
    bool dtype;
  };
  for (const auto& c :
       {Case{"bucket size, replica 1", {2, 3}, false},
        Case{"bucket size, rank 3", {3}, false},
        Case{"dtype, replica 1", {2, 3}, true}}) {
    SCOPED_TRACE(c.what);
    const auto nets = nets_of_ranks(4);
    std::mutex mutex;
    std::vector<std::string> errors(4);
    std::vector<bool> usable(4, false);
    run_ranks(4, [&](World world) {
      const auto r = world.rank();
      const bool differs =
          std::find(c.ranks.begin(), c.ranks.end(), r) != c.ranks.end();
      Mesh mesh(world, 2);
      dist::PipelineStage stage(
          nets[r], GPipeOptions({3, 4}).chunks(2).threads_per_lane(1), mesh);
      auto shard = batch;
      if (differs && c.dtype) {
        stage->to(torch::kFloat32);
        shard.x = shard.x.to(torch::kFloat32);
      }
      if (differs && !c.dtype) {
        stage->set_gradient_bucket_bytes(64);
      }
      try {
        train_on_shard(stage, mesh, shard);
        std::lock_guard<std::mutex> lock(mutex);
        errors[r] = "no error";
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r] = e.what_without_backtrace();
      }
      if (c.ranks.size() == 2) {
        // Refused before the step: the stages train once they agree.
        if (differs && c.dtype) {
          stage->to(torch::kFloat64);
        }
        stage->set_gradient_bucket_bytes(1 << 20);
        train_on_shard(stage, mesh, batch);
        // Sizes asked for that differ but make the same buckets (the
        // stages' few bytes fit one bucket either way) are not refused.
        stage->set_gradient_bucket_bytes(r >= 2 ? 1 << 26 : 1 << 20);
        train_on_shard(stage, mesh, batch);
        usable[r] = true;
      }
    });
    for (const auto r : c10::irange(4)) {
      EXPECT_NE(errors[r], "no error") << "rank " << r;
    }
    // Every rank names the difference (the other stage's ranks as what
    // failed the pass).
    for (const auto r : c10::irange(4)) {
      EXPECT_NE(
          errors[r].find("would all-reduce gradient buckets of other layouts"),
          std::string::npos)
          << "rank " << r << ": " << errors[r];
    }
    if (c.ranks.size() == 2) {
      EXPECT_EQ(usable, std::vector<bool>(4, true));
      EXPECT_NE(
          errors[0].find(
              c.dtype ? "they differ in the bytes all-reduced from 720 to 1440"
                      : "set_gradient_bucket_bytes) from 64 to 26214400"),
          std::string::npos)
          << errors[0];
    }
  }
}

// Gradients accumulated over three steps without zeroing, one of them set
// to none before the third while the others keep their sums (a bucket with
// a gradient made anew beside gradients accumulated in place), then set to
// none all at once (as LibTorch 2's zero_grad does) for a fourth: after
// each step every gradient is the average over the replicas of what it
// holds, as one pipeline on the whole batch has it.
TEST(MeshTest, GradientsAccumulatedOverStepsOrSetToNoneAreAveraged) {
  const auto options = GPipeOptions({3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto& x = batch.x;
  const auto& y = batch.y;
  const LossFunction loss_fn = cross_entropy;
  auto prepare = [](torch::nn::Module& m, int step) {
    for (auto& p : m.named_parameters()) {
      if ((step == 2 && p.key() == "partitions.0.0.weight") || step == 3) {
        p.value().mutable_grad() = torch::Tensor();
      }
    }
  };
  GPipe ref(build(0), options);
  std::vector<std::map<std::string, torch::Tensor>> ref_grads;
  for (int step = 0; step < 4; ++step) {
    prepare(*ref, step);
    ref->train_step(x, y, loss_fn, Schedule::OneFOneB);
    ref_grads.emplace_back();
    for (const auto& p : ref->named_parameters()) {
      ref_grads.back()[p.key()] = p.value().grad().clone();
    }
  }
  const auto nets = nets_of_ranks(4);
  RankFailures failures;
  run_ranks(4, [&](World world) {
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[world.rank()], options, mesh);
    const auto d = mesh.data_rank();
    for (int step = 0; step < 4; ++step) {
      prepare(*stage, step);
      stage->train_step(
          mesh.pipeline_rank() == 0 ? x.narrow(0, 4 * d, 4) : torch::Tensor(),
          mesh.pipeline_rank() == 1 ? y.narrow(0, 4 * d, 4) : torch::Tensor(),
          loss_fn,
          Schedule::OneFOneB);
      failures.add(differing(
          *stage,
          [&](const std::string& name) { return ref_grads[step][name]; },
          "rank " + std::to_string(world.rank()) + " step " +
              std::to_string(step),
          /*grads=*/true));
    }
  });
  failures.report();
}

// A sparse gradient (an Embedding with sparse(true)) cannot share a dense
// bucket: every replica refuses the step with a c10::TypeError that says
// so (before, it failed on the gradient's missing storage), and the next
// step is refused at once rather than left waiting.
TEST(MeshTest, ASparseGradientIsRefusedClearly) {
  auto make = [] {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    net->push_back(
        torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
    net->push_back(torch::nn::Flatten());
    net->push_back(torch::nn::Linear(12, 3));
    return net;
  };
  const auto x = torch::randint(0, 10, {8, 3}, torch::kLong);
  const auto y = torch::randint(0, 3, {8}, torch::kLong);
  std::vector<torch::nn::Sequential> nets{make(), make()};
  std::mutex mutex;
  std::vector<std::string> errors(2);
  run_ranks(2, [&](World world) {
    Mesh mesh(world, 1);
    dist::PipelineStage stage(
        nets[world.rank()],
        GPipeOptions({3}).chunks(2).threads_per_lane(1),
        mesh);
    std::string error = "no error";
    try {
      stage->train_step(
          x.narrow(0, 4 * mesh.data_rank(), 4),
          y.narrow(0, 4 * mesh.data_rank(), 4),
          cross_entropy,
          Schedule::FillDrain);
    } catch (const c10::TypeError& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = std::string("another type: ") + e.what();
    }
    // The same step again is refused the same way, not left waiting.
    try {
      stage->train_step(
          x.narrow(0, 4 * mesh.data_rank(), 4),
          y.narrow(0, 4 * mesh.data_rank(), 4),
          cross_entropy,
          Schedule::FillDrain);
      error += "; no error the second time";
    } catch (const c10::Error& e) {
      error += std::string("; then: ") + e.what_without_backtrace();
    }
    std::lock_guard<std::mutex> lock(mutex);
    errors[world.rank()] = error;
  });
  for (const auto& e : errors) {
    EXPECT_NE(
        e.find("the replicas average dense gradients, but a parameter of "
               "shape [10, 4] has a Sparse gradient"),
        std::string::npos)
        << e;
    EXPECT_NE(e.find("; then: "), std::string::npos) << e;
  }
}

// Two replicas of a one-stage pipeline, cast to float between steps: the
// buckets follow the parameters' new dtype.
TEST(MeshTest, CastingBetweenStepsIsFollowed) {
  const auto options = GPipeOptions({7}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto& x = batch.x;
  const auto& y = batch.y;
  const LossFunction loss_fn = cross_entropy;
  GPipe ref(build(0), options);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  std::vector<torch::Tensor> ref_losses;
  for (int step = 0; step < 3; ++step) {
    if (step == 1) {
      ref->to(torch::kFloat);
    }
    const auto dtype = step == 0 ? torch::kDouble : torch::kFloat;
    ref_losses.push_back(
        ref->train_step(x.to(dtype), y, loss_fn, Schedule::FillDrain));
    ref_opt.step();
    ref_opt.zero_grad();
  }
  std::vector<torch::nn::Sequential> nets{build(0), build(0)};
  std::mutex mutex;
  std::vector<std::string> failures;
  run_ranks(2, [&](World world) {
    Mesh mesh(world, 1);
    dist::PipelineStage stage(nets[world.rank()], options, mesh);
    torch::optim::SGD opt(stage->parameters(), 0.1);
    const auto d = mesh.data_rank();
    for (int step = 0; step < 3; ++step) {
      if (step == 1) {
        stage->to(torch::kFloat);
      }
      const auto dtype = step == 0 ? torch::kDouble : torch::kFloat;
      auto loss = stage->train_step(
          x.narrow(0, 4 * d, 4).to(dtype),
          y.narrow(0, 4 * d, 4),
          loss_fn,
          Schedule::FillDrain);
      opt.step();
      opt.zero_grad();
      if (!torch::allclose(
              loss.to(torch::kDouble),
              ref_losses[step].to(torch::kDouble),
              1e-5,
              1e-6)) {
        std::lock_guard<std::mutex> lock(mutex);
        failures.push_back("step " + std::to_string(step) + ": loss differs");
      }
    }
  });
  for (const auto& f : failures) {
    ADD_FAILURE() << f;
  }
}

// One of two Linear(6, 10) for a whole micro-batch: `a` where its first
// column is positive, else `b`.
struct BranchImpl : torch::nn::Cloneable<BranchImpl> {
  BranchImpl() {
    reset();
  }
  void reset() override {
    a = register_module("a", torch::nn::Linear(6, 10));
    b = register_module("b", torch::nn::Linear(6, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x.select(1, 0).min().item<double>() > 0 ? a(x) : b(x);
  }
  torch::nn::Linear a{nullptr};
  torch::nn::Linear b{nullptr};
};
TORCH_MODULE(Branch);

// Each replica's data takes another branch of the first layer, so that on
// each replica one branch's parameters get no gradient in a step, and their
// buckets start only when the stage's backward ends, at another time on each
// replica: the all-reduce still pairs the same buckets, the unused side takes
// part with zeros, and two steps equal one pipeline on the whole batch (where
// each branch has the micro-batches of one replica), under each schedule.
TEST(MeshTest, ReplicasWhoseDataUseOtherLayersAgree) {
  auto build_branchy = [] {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    net->push_back(Branch());
    net->push_back(torch::nn::Tanh());
    net->push_back(torch::nn::Linear(10, 10));
    net->push_back(torch::nn::Tanh());
    net->push_back(torch::nn::Linear(10, 3));
    net->to(torch::kDouble);
    return net;
  };
  torch::manual_seed(3);
  auto x = torch::randn({16, 6}, torch::kDouble);
  // Replica 0's rows (the first 8) take `a`, replica 1's `b`.
  x.narrow(0, 0, 8).select(1, 0).abs_().add_(0.1);
  x.narrow(0, 8, 8).select(1, 0).abs_().add_(0.1).neg_();
  const auto y = torch::randint(0, 3, {16}, torch::kLong);
  const LossFunction loss_fn = cross_entropy;
  for (auto schedule :
       {Schedule::FillDrain, Schedule::OneFOneB, Schedule::ZeroBubble}) {
    SCOPED_TRACE(to_string(schedule));
    // Micro-batches of 4 rows in both.
    GPipe ref(
        build_branchy(), GPipeOptions({2, 3}).chunks(4).threads_per_lane(1));
    torch::optim::SGD ref_opt(ref->parameters(), 0.1);
    for (int step = 0; step < 2; ++step) {
      ref->train_step(x, y, loss_fn, schedule);
      ref_opt.step();
      ref_opt.zero_grad();
    }
    const auto ref_params = ref->named_parameters();
    std::vector<torch::nn::Sequential> nets;
    for (int r = 0; r < 4; ++r) {
      nets.push_back(build_branchy());
    }
    RankFailures failures;
    run_ranks(4, [&](World world) {
      Mesh mesh(world, 2);
      dist::PipelineStage stage(
          nets[world.rank()],
          GPipeOptions({2, 3}).chunks(2).threads_per_lane(1),
          mesh);
      stage->set_gradient_bucket_bytes(256);  // a few buckets per stage
      torch::optim::SGD opt(stage->parameters(), 0.1);
      const auto d = mesh.data_rank();
      for (int step = 0; step < 2; ++step) {
        stage->train_step(
            mesh.pipeline_rank() == 0 ? x.narrow(0, 8 * d, 8) : torch::Tensor(),
            mesh.pipeline_rank() == 1 ? y.narrow(0, 8 * d, 8) : torch::Tensor(),
            loss_fn,
            schedule);
        opt.step();
        opt.zero_grad();
      }
      failures.add(differing(
          *stage,
          [&](const std::string& name) { return ref_params[name]; },
          "rank " + std::to_string(world.rank())));
    });
    failures.report();
  }
}

// A Linear(10, 10) registered but never called, between two layers.
struct HoldsUnusedImpl : torch::nn::Cloneable<HoldsUnusedImpl> {
  HoldsUnusedImpl() {
    reset();
  }
  void reset() override {
    unused = register_module("unused", torch::nn::Linear(10, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x.tanh();
  }
  torch::nn::Linear unused{nullptr};
};
TORCH_MODULE(HoldsUnused);

// A parameter no replica's data reaches gets no gradient, as in one
// pipeline on the whole batch: weight decay then leaves it alone there and
// here (with zeros for a gradient it moved, and the replicas drifted from
// one pipeline step by step). Two replicas of two stages and four of one,
// three steps of SGD with weight decay.
TEST(MeshTest, AParameterNoReplicaUsedGetsNoGradient) {
  auto build_holding = [] {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    net->push_back(torch::nn::Linear(6, 10));
    net->push_back(HoldsUnused());
    net->push_back(torch::nn::Linear(10, 10));
    net->push_back(torch::nn::Tanh());
    net->push_back(torch::nn::Linear(10, 3));
    net->to(torch::kDouble);
    return net;
  };
  const auto batch = batch_of(8);
  const LossFunction loss_fn = cross_entropy;
  const auto sgd = torch::optim::SGDOptions(0.1).weight_decay(0.1);
  for (const int64_t p : {2, 1}) {
    SCOPED_TRACE("pipeline size " + std::to_string(p));
    const auto balance =
        p == 2 ? std::vector<int64_t>{2, 3} : std::vector<int64_t>{5};
    GPipe ref(
        build_holding(), GPipeOptions(balance).chunks(4).threads_per_lane(1));
    torch::optim::SGD ref_opt(ref->parameters(), sgd);
    for (int step = 0; step < 3; ++step) {
      ref->train_step(batch.x, batch.y, loss_fn, Schedule::OneFOneB);
      ref_opt.step();
      if (step < 2) {
        ref_opt.zero_grad();
      }
    }
    const auto ref_params = ref->named_parameters();
    std::vector<torch::nn::Sequential> nets;
    for (int r = 0; r < 4; ++r) {
      nets.push_back(build_holding());
    }
    RankFailures failures;
    run_ranks(4, [&](World world) {
      Mesh mesh(world, p);
      dist::PipelineStage stage(
          nets[world.rank()],
          GPipeOptions(balance)
              .chunks(4 / mesh.data_size())
              .threads_per_lane(1),
          mesh);
      torch::optim::SGD opt(stage->parameters(), sgd);
      const auto d = mesh.data_rank();
      const auto rows = 8 / mesh.data_size();
      for (int step = 0; step < 3; ++step) {
        stage->train_step(
            mesh.pipeline_rank() == 0 ? batch.x.narrow(0, rows * d, rows)
                                      : torch::Tensor(),
            mesh.pipeline_rank() == p - 1 ? batch.y.narrow(0, rows * d, rows)
                                          : torch::Tensor(),
            loss_fn,
            Schedule::OneFOneB);
        opt.step();
        if (step < 2) {
          opt.zero_grad();
        }
      }
      const auto where = "rank " + std::to_string(world.rank());
      failures.add(differing(
          *stage,
          [&](const std::string& name) { return ref_params[name]; },
          where));
      for (const auto& param : stage->named_parameters()) {
        if (param.value().grad().defined() !=
            ref_params[param.key()].grad().defined()) {
          failures.add(
              {where + ": " + param.key() + " has a gradient " +
               (param.value().grad().defined() ? "" : "not ") +
               "where one pipeline on the whole batch has " +
               (param.value().grad().defined() ? "none" : "one")});
        }
      }
    });
    failures.report();
  }
}

// net->eval() on the user's Sequential reaches its DeferredBatchNorm on
// every rank (the pass's mode is the one the layer computes in, the
// layer it replaced), so the ranks agree on the mode of the forward that
// follows; it matched one GPipe's. The mode check had read the
// DeferredBatchNorm's own flag, which only eval() on the stage sets: the
// ranks with the layer said train(), the others eval(), and the job ended.
TEST(MeshTest, NetEvalReachesADeferredBatchNormOnEveryRank) {
  auto build_bn = [] {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    net->push_back(torch::nn::Linear(6, 10));
    net->push_back(torch::nn::Tanh());
    net->push_back(torch::nn::BatchNorm1d(10));
    net->push_back(torch::nn::Linear(10, 3));
    net->to(torch::kDouble);
    return net;
  };
  const auto batch = batch_of(8);
  const auto options =
      GPipeOptions({2, 2}).chunks(2).deferred_batch_norm(true).threads_per_lane(
          1);
  auto ref_net = build_bn();
  GPipe ref(ref_net, options);
  ref->train_step(batch.x, batch.y, cross_entropy, Schedule::FillDrain);
  ref_net->eval();
  const auto expected = ref->forward(batch.x);
  std::vector<torch::nn::Sequential> nets{build_bn(), build_bn()};
  RankFailures failures;
  run_ranks(2, [&](World world) {
    auto& net = nets[world.rank()];
    dist::PipelineStage stage(net, options, world);
    stage->train_step(
        world.rank() == 0 ? batch.x : torch::Tensor(),
        world.rank() == 1 ? batch.y : torch::Tensor(),
        cross_entropy,
        Schedule::FillDrain);
    net->eval();
    const auto out =
        stage->forward(world.rank() == 0 ? batch.x : torch::Tensor());
    if (world.rank() == 1 && !torch::allclose(out, expected, 1e-10, 1e-12)) {
      failures.add({"rank 1: the output in eval() differs from one GPipe's"});
    }
  });
  failures.report();
}

// A collective of the user's on Mesh::data() on one rank while the other
// replica runs a training step: both ranks refuse, naming both operations.
// Gloo aborted the process (a message larger than the buffer posted for the
// step's first collective there).
void expect_a_users_collective_against_a_training_step_refused(
    const std::string& user);

TEST(MeshTest, AUsersCollectiveAgainstATrainingStepIsRefusedNotAnAbort) {
  for (const std::string user : {"World::all_reduce", "World::barrier"}) {
    SCOPED_TRACE(user);
    expect_a_users_collective_against_a_training_step_refused(user);
  }
}

void expect_a_users_collective_against_a_training_step_refused(
    const std::string& user) {
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(2);
  std::vector<std::string> errors(2);
  std::mutex mutex;
  run_ranks(2, [&](World world) {
    Mesh mesh(world, 1);
    dist::PipelineStage stage(
        nets[world.rank()],
        GPipeOptions({7}).chunks(2).threads_per_lane(1),
        mesh);
    try {
      if (world.rank() == 0) {
        stage->train_step(
            batch.x.narrow(0, 0, 4),
            batch.y.narrow(0, 0, 4),
            cross_entropy,
            Schedule::OneFOneB);
      } else if (user == "World::barrier") {
        mesh.data().barrier();
      } else {
        auto t = torch::ones({3});
        mesh.data().all_reduce(t);
      }
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[world.rank()] = e.what_without_backtrace();
    }
  });
  for (const auto& error : errors) {
    EXPECT_NE(error.find("ran other operations at once"), std::string::npos)
        << error;
    EXPECT_NE(error.find(user), std::string::npos) << error;
    EXPECT_NE(error.find("train_step"), std::string::npos) << error;
  }
}

// The same on a stage after the first (2 replicas of 2 stages): rank 3,
// replica 1's last stage, runs an all_reduce of its own on Mesh::data()
// while rank 1, replica 0's last stage, trains. Gloo aborted the process
// (the step's first collective there was its gradient all-reduce); now the
// step begins with words of the size of the user's collective's, read at
// its end: rank 3 refuses naming both operations, the World is closed, and
// every rank fails, none waiting out more than the (short) timeout.
TEST(MeshTest, AUsersCollectiveAgainstALaterStagesStepIsRefusedNotAnAbort) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::vector<std::string> errors(4);
  const auto start = std::chrono::steady_clock::now();
  dist::testing::run_threads(4, [&](int64_t r) {
    auto world = dist::init_from_store(store, r, 4, std::chrono::seconds(3));
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[r], options, mesh);
    try {
      if (r == 3) {
        auto t = torch::ones({3});
        mesh.data().all_reduce(t);
      } else {
        train_on_shard(stage, mesh, batch);
      }
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[r] = e.what_without_backtrace();
    }
  });
  // Rank 1 reads the words at its step's end: by then the failure that
  // rank 3's refusal set off in replica 1 (rank 2 could not reach rank 3)
  // may have reached it first, and the first failure is what every rank
  // reports.
  const auto& error = errors[3];
  EXPECT_NE(error.find("ran other operations at once"), std::string::npos)
      << error;
  EXPECT_NE(error.find("World::all_reduce"), std::string::npos) << error;
  EXPECT_NE(error.find("train_step"), std::string::npos) << error;
  for (const auto r : {0, 1, 2}) {
    EXPECT_FALSE(errors[r].empty()) << "rank " << r << " trained";
  }
  EXPECT_LT(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count(),
      15.0);
}

// Every rank's error names `text`, and all of them came well within the
// ranks' 30 s timeout of `start`.
void expect_every_rank_to_fail_fast(
    const std::vector<std::string>& errors,
    const std::string& text,
    std::chrono::steady_clock::time_point start) {
  const auto seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find(text), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  EXPECT_LT(seconds, 10.0);
}

// A step that fails in one replica (its loss throws) fails on every rank
// of every replica with that message, at once, rather than leaving the
// other replica waiting in its gradient all-reduce until the timeout.
void expect_a_failure_in_one_replica_to_fail_every_rank(int64_t p) {
  SCOPED_TRACE("pipeline size " + std::to_string(p));
  const auto options =
      GPipeOptions(
          p == 2 ? std::vector<int64_t>{3, 4} : std::vector<int64_t>{7})
          .chunks(2)
          .threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto& x = batch.x;
  const auto& y = batch.y;
  const auto nets = nets_of_ranks(4);
  std::mutex mutex;
  std::vector<std::string> errors(4);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(4, [&](World world) {
    Mesh mesh(world, p);
    dist::PipelineStage stage(nets[world.rank()], options, mesh);
    const auto d = mesh.data_rank();
    const auto rows = 8 / mesh.data_size();
    for (int step = 0; step < 3; ++step) {
      try {
        stage->train_step(
            mesh.pipeline_rank() == 0 ? x.narrow(0, rows * d, rows)
                                      : torch::Tensor(),
            mesh.pipeline_rank() == p - 1 ? y.narrow(0, rows * d, rows)
                                          : torch::Tensor(),
            [&](torch::Tensor out, torch::Tensor target) {
              if (step == 1 && d == 0) {
                throw std::runtime_error("the loss broke on purpose");
              }
              return torch::nn::functional::cross_entropy(out, target);
            },
            Schedule::OneFOneB);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[world.rank()] = e.what_without_backtrace();
        return;
      }
    }
  });
  expect_every_rank_to_fail_fast(errors, "the loss broke on purpose", start);
}

// A replica's first or last stage that was given nothing is named by its
// rank in the job, as the launcher knows it, not by its rank in its
// replica's pipeline.
TEST(MeshTest, AMissingInputOrTargetNamesTheRankInTheJob) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  for (const bool input_missing : {true, false}) {
    SCOPED_TRACE(input_missing ? "input" : "target");
    std::mutex mutex;
    std::vector<std::string> errors(4);
    run_ranks(4, [&](World world) {
      Mesh mesh(world, 2);
      dist::PipelineStage stage(nets[world.rank()], options, mesh);
      const auto d = mesh.data_rank();
      // Replica 1 (ranks 2 and 3) forgets its input, or its target.
      const bool forgets = d == 1;
      const bool first = mesh.pipeline_rank() == 0;
      try {
        stage->train_step(
            first && !(forgets && input_missing) ? batch.x.narrow(0, 4 * d, 4)
                                                 : torch::Tensor(),
            !first && !(forgets && !input_missing) ? batch.y.narrow(0, 4 * d, 4)
                                                   : torch::Tensor(),
            cross_entropy,
            Schedule::OneFOneB);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[world.rank()] = e.what_without_backtrace();
      }
    });
    const std::string expected =
        input_missing ? "expects the input on rank 2 (the first stage's)"
                      : "expects the target on the last stage's rank (rank 3)";
    EXPECT_NE(
        errors[2 + (input_missing ? 0 : 1)].find(expected), std::string::npos)
        << errors[2 + (input_missing ? 0 : 1)];
  }
}

// Rank 0's own mistakes before a pass begins (no input, an empty batch, no
// loss_fn, grad mode off) closed the connection for good: every later step
// was refused with "restart the job". Now every rank refuses that pass, with
// rank 0's message and kind, and the next correct step runs, equal to a
// stage that never saw the mistake (with replicas: the next test).
TEST(MeshTest, RankZerosMistakeBeforeAPassLeavesTheStageUsable) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(2);
  const auto fresh = nets_of_ranks(2);
  std::mutex mutex;
  std::vector<std::vector<std::string>> errors(2);
  std::vector<torch::Tensor> losses(2);
  std::vector<torch::Tensor> expected(2);
  run_ranks(2, [&](World world) {
    const auto r = world.rank();
    dist::PipelineStage stage(nets[r], options, world);
    dist::PipelineStage clean(fresh[r], options, world);
    const bool first = r == 0;
    const auto y = first ? torch::Tensor() : batch.y;
    auto note = [&](const std::function<void()>& mistake) {
      try {
        mistake();
        std::lock_guard<std::mutex> lock(mutex);
        errors[r].push_back("no error");
      } catch (const c10::TypeError& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r].push_back(
            std::string("TypeError: ") + e.what_without_backtrace());
      } catch (const c10::ValueError& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r].push_back(
            std::string("ValueError: ") + e.what_without_backtrace());
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r].push_back(
            std::string("Error: ") + e.what_without_backtrace());
      }
    };
    note([&] {
      stage->train_step(torch::Tensor(), y, cross_entropy, Schedule::OneFOneB);
    });
    note([&] {
      stage->train_step(
          first ? batch.x.narrow(0, 0, 0) : torch::Tensor(),
          y,
          cross_entropy,
          Schedule::OneFOneB);
    });
    note([&] {
      stage->train_step(
          first ? batch.x : torch::Tensor(),
          y,
          first ? LossFunction() : LossFunction(cross_entropy),
          Schedule::OneFOneB);
    });
    note([&] { stage->forward(torch::Tensor()); });
    losses[r] = stage->train_step(
        first ? batch.x : torch::Tensor(),
        y,
        cross_entropy,
        Schedule::OneFOneB);
    expected[r] = clean->train_step(
        first ? batch.x : torch::Tensor(),
        y,
        cross_entropy,
        Schedule::OneFOneB);
    for (size_t k = 0; k < stage->parameters().size(); ++k) {
      EXPECT_TRUE(torch::allclose(
          stage->parameters()[k].grad(),
          clean->parameters()[k].grad(),
          1e-12,
          1e-12));
    }
  });
  ASSERT_EQ(errors[0].size(), 4u);
  ASSERT_EQ(errors[1].size(), 4u);
  EXPECT_NE(
      errors[0][0].find("TypeError: train_step expects the input on rank 0"),
      std::string::npos)
      << errors[0][0];
  EXPECT_NE(errors[0][1].find("ValueError: "), std::string::npos)
      << errors[0][1];
  EXPECT_NE(
      errors[0][2].find("ValueError: train_step expects a loss_fn"),
      std::string::npos)
      << errors[0][2];
  EXPECT_NE(
      errors[0][3].find("TypeError: forward expects the input on rank 0"),
      std::string::npos)
      << errors[0][3];
  for (size_t k = 0; k < 4; ++k) {
    const auto kind = errors[0][k].substr(0, errors[0][k].find(':'));
    EXPECT_EQ(
        errors[1][k].rfind(
            kind + ": gpipe::dist: rank 0 refused the pass before it began", 0),
        0u)
        << errors[1][k];
    EXPECT_NE(errors[1][k].find("the stage stays usable"), std::string::npos)
        << errors[1][k];
  }
  EXPECT_TRUE(torch::allclose(losses[1], expected[1], 1e-12, 1e-12));
}

TEST(MeshTest, AFailureInOneReplicaFailsEveryRank) {
  expect_a_failure_in_one_replica_to_fail_every_rank(2);  // 2 x 2
  expect_a_failure_in_one_replica_to_fail_every_rank(1);  // 4 x 1
}

// A failure on one rank of a split World (a replica's pipeline) reaches
// every rank of every replica naming the rank where it happened by its rank
// in the job, once: not by its rank in its replica's pipeline (rank 3 is
// pipeline rank 1 of replica 1), and not again by each rank that passed it
// on, nor with the note that the connection is closed twice.
void expect_every_rank_to_name_the_failing_rank(int64_t failing, bool in_loss) {
  SCOPED_TRACE(
      "rank " + std::to_string(failing) + (in_loss ? ", loss" : ", layer"));
  const auto options =
      GPipeOptions(std::vector<int64_t>{4, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  std::atomic<bool> armed{false};
  std::mutex mutex;
  std::vector<std::string> errors(4);
  const std::string what = "broke on purpose";
  run_ranks(4, [&](World world) {
    const auto me = world.rank();
    // build()'s layers, with one that fails on purpose after the first.
    auto net = torch::nn::Sequential();
    for (const auto& layer : *nets[me]) {
      net->push_back(layer);
      if (net->size() == 1) {
        net->push_back(torch::nn::Functional([&, me](torch::Tensor x) {
          TORCH_CHECK(!(armed && !in_loss && me == failing), what);
          return x;
        }));
      }
    }
    Mesh mesh(world, 2);
    dist::PipelineStage stage(net, options, mesh);
    for (int step = 0; step < 3; ++step) {
      if (step == 1 && me == 0) {
        armed = true;
      }
      try {
        train_on_shard(
            stage, mesh, batch, [&](torch::Tensor out, torch::Tensor target) {
              TORCH_CHECK(!(armed && in_loss && me == failing), what);
              return cross_entropy(out, target);
            });
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[me] = e.what_without_backtrace();
        return;
      }
      world.barrier();
    }
  });
  const auto count = [](const std::string& text, const std::string& part) {
    size_t n = 0;
    for (auto at = text.find(part); at != std::string::npos;
         at = text.find(part, at + 1)) {
      ++n;
    }
    return n;
  };
  for (int64_t r = 0; r < 4; ++r) {
    const auto& error = errors[r];
    SCOPED_TRACE("the error of rank " + std::to_string(r) + ": " + error);
    EXPECT_NE(error.find(what), std::string::npos);
    if (r != failing) {
      EXPECT_EQ(count(error, "rank " + std::to_string(failing) + ": "), 1u);
    }
    for (int64_t other = 0; other < 4; ++other) {
      if (other != failing) {
        EXPECT_EQ(count(error, "rank " + std::to_string(other) + ":"), 0u);
      }
    }
    EXPECT_LE(count(error, "restart the job"), 1u);
  }
}

TEST(MeshTest, AFailureNamesTheRankWhereItHappenedOnEveryRank) {
  // Ranks 1 and 3 hold the last stage, ranks 0 and 2 the first.
  expect_every_rank_to_name_the_failing_rank(3, /*in_loss=*/true);
  expect_every_rank_to_name_the_failing_rank(2, /*in_loss=*/false);
  expect_every_rank_to_name_the_failing_rank(1, /*in_loss=*/true);
}

// 2 replicas of a 2-stage pipeline (ranks as threads, a 2 s timeout)
// train a step, then rank `stalled` skips the next one, alive (its World
// open) until the others have given up: the other ranks' errors.
std::vector<std::string> errors_when_a_rank_stops_coming(int64_t stalled) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::vector<std::string> errors(4);
  std::atomic<int> failed{0};
  dist::testing::run_threads(4, [&](int64_t r) {
    auto world = dist::init_from_store(store, r, 4, std::chrono::seconds(2));
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[r], options, mesh);
    for (int step = 0; step < 2; ++step) {
      if (step == 1 && r == stalled) {
        const auto give_up =
            std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (failed < 3 && std::chrono::steady_clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        return;
      }
      try {
        train_on_shard(stage, mesh, batch);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r] = e.what_without_backtrace();
        ++failed;
        return;
      }
    }
  });
  return errors;
}

// A rank that stops coming (here, rank 2, replica 1's first stage, skips
// step 1 and waits) is named by the ranks that wait for it: rank 0, whose
// step begins with a collective over the replicas that rank 2 never
// reaches, and rank 1, whose receive from rank 0 times out meanwhile,
// through rank 0's notice. Before, rank 0 said only that "a rank stopped
// answering" and rank 1 blamed rank 0 (Note [Who a collective waits for]).
TEST(MeshTest, ARankThatStopsComingIsNamedByThoseWaitingForIt) {
  const auto errors = errors_when_a_rank_stops_coming(2);
  EXPECT_NE(errors[0].find("rank 2 had not reached it"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 2 had not reached it"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[3].find("rank 2"), std::string::npos) << errors[3];
  EXPECT_TRUE(errors[2].empty()) << errors[2];
}

// A rank that stops coming (rank 3, replica 1's last stage, skips step 1
// and waits) is named by those waiting for it, and also by rank 0, which
// waits for rank 2 in their replicas' all-reduce while rank 2, alive,
// waits for rank 3's gradient: rank 0 says so. Before, rank 0 said only
// that rank 2 "had not reached it", when its own timeout came first (Note
// [What a rank waits for]). (Rank 3 stops outside its cells: ranks that
// are threads of one process share the random generators' lease, which a
// cell holds.)
TEST(MeshTest, ARankWaitingForAStalledRankIsNamedWithWhomItWaitsFor) {
  const auto errors = errors_when_a_rank_stops_coming(3);
  std::string all;
  for (const auto r : c10::irange(4)) {
    all += "\nrank " + std::to_string(r) + ": " + errors[r];
  }
  // Each names rank 3: as the rank it waits for, as the rank that the rank
  // it waits for waits for (its own timeout come first: "rank 2 was itself
  // waiting for ... from rank 3", or "... in the train_step's start over
  // the replicas (ranks 1, 3)"), or in another rank's notice. Which comes
  // first depends on the load.
  for (const auto r : {0, 1, 2}) {
    EXPECT_TRUE(
        errors[r].find("rank 3") != std::string::npos ||
        errors[r].find(", 3)") != std::string::npos)
        << all;
  }
}

// A bfloat16 model's replicas: the first replica's parameters are
// broadcast as bytes and the gradients summed in float32 (Gloo does
// neither in bfloat16: the constructor failed, "rank 1 died ... [c10d:
// Invalid scalar type]"). Both replicas end the step with the same
// gradient, their shards' mean.
TEST(MeshTest, ABFloat16ModelHasReplicas) {
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(r);  // other weights: the broadcast makes them one
    nets.emplace_back(torch::nn::Linear(4, 3), torch::nn::Tanh());
    nets.back()->to(torch::kBFloat16);
  }
  torch::manual_seed(5);
  const auto x = torch::randn({8, 4}).to(torch::kBFloat16);
  const auto y = torch::randn({8, 3}).to(torch::kBFloat16);
  std::mutex mutex;
  std::vector<torch::Tensor> grads(2);
  std::vector<torch::Tensor> weights(2);
  run_ranks(2, [&](World world) {
    const auto r = world.rank();
    dist::PipelineStage stage(
        nets[r], GPipeOptions({2}).chunks(2), Mesh(world, 1));
    const auto shard = torch::indexing::Slice(4 * r, 4 * (r + 1));
    stage->train_step(
        x.index({shard}),
        y.index({shard}),
        [](torch::Tensor out, torch::Tensor target) {
          // (LibTorch 1.13's mse_loss has no bfloat16 kernel on a CPU.)
          return (out.to(torch::kFloat) - target.to(torch::kFloat))
              .pow(2)
              .mean();
        });
    const auto linear = nets[r][0]->as<torch::nn::Linear>();
    std::lock_guard<std::mutex> lock(mutex);
    grads[r] = linear->weight.grad().clone();
    weights[r] = linear->weight.detach().clone();
  });
  ASSERT_TRUE(grads[0].defined() && grads[1].defined());
  EXPECT_EQ(grads[0].scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(weights[0], weights[1]));
  EXPECT_TRUE(torch::equal(grads[0], grads[1]));
}

// Replicas whose shards differ in rows would have their gradients averaged
// with equal weights, which no single pipeline on the whole batch does:
// the replicas' first stages agree before the step begins, so every rank
// refuses it alike, naming the sizes, before anything ran (no gradient),
// and the next step on equal shards trains (2 replicas of 2 stages, shards
// of 4 and 3 rows).
TEST(MeshTest, ShardsOfDifferentSizesAreRefusedOnEveryRankBeforeTheyRun) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  std::mutex mutex;
  std::vector<std::string> errors(4);
  std::vector<double> losses(4, 0.0);
  std::vector<int> gradients_after_refusal(4, -1);
  run_ranks(4, [&](World world) {
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[world.rank()], options, mesh);
    const auto d = mesh.data_rank();
    const auto step = [&](int64_t rows) {
      return stage->train_step(
          mesh.pipeline_rank() == 0 ? batch.x.narrow(0, 4 * d, rows)
                                    : torch::Tensor(),
          mesh.pipeline_rank() == 1 ? batch.y.narrow(0, 4 * d, rows)
                                    : torch::Tensor(),
          cross_entropy,
          Schedule::OneFOneB);
    };
    try {
      step(d == 0 ? 4 : 3);
    } catch (const c10::ValueError& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[world.rank()] = e.what_without_backtrace();
    }
    int defined = 0;
    for (const auto& p : stage->parameters()) {
      defined += p.grad().defined() ? 1 : 0;
    }
    const auto loss = step(4).item<double>();
    std::lock_guard<std::mutex> lock(mutex);
    gradients_after_refusal[world.rank()] = defined;
    losses[world.rank()] = loss;
  });
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + errors[r]);
    EXPECT_NE(
        errors[r].find("the replicas' shards differ in rows (4, 3, by "
                       "replica"),
        std::string::npos);
    if (r % 2 == 1) {  // the last stages hear it from their first stage
      EXPECT_NE(
          errors[r].find(
              "rank " + std::to_string(r - 1) +
              " refused the pass before it began"),
          std::string::npos);
    }
    EXPECT_NE(errors[r].find("Nothing ran"), std::string::npos);
    EXPECT_EQ(errors[r].find("stays usable"), errors[r].rfind("stays usable"));
    EXPECT_EQ(gradients_after_refusal[r], 0);
    EXPECT_GT(losses[r], 0.0);
    EXPECT_EQ(losses[r], losses[0]);
  }
}

// With replicas, a first stage's own mistakes before a step (no input, an
// empty batch, no loss_fn) used to end the job: the other replicas'
// gradient all-reduce would have waited for this one. The first stages now
// agree before the step, so every rank of every replica refuses it with the
// mistake's kind, and the next step trains as on stages that never saw it.
TEST(MeshTest, AReplicasMistakeBeforeAStepIsRefusedByEveryReplica) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  const auto fresh = nets_of_ranks(4);
  std::mutex mutex;
  std::vector<std::vector<std::string>> errors(4);
  run_ranks(4, [&](World world) {
    const auto r = world.rank();
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[r], options, mesh);
    dist::PipelineStage clean(fresh[r], options, mesh);
    const auto d = mesh.data_rank();
    const bool first = mesh.pipeline_rank() == 0;
    const bool wrong = first && d == 1;  // replica 1's first stage
    const auto x = first ? batch.x.narrow(0, 4 * d, 4) : torch::Tensor();
    const auto y = first ? torch::Tensor() : batch.y.narrow(0, 4 * d, 4);
    auto note = [&](const std::function<void()>& mistake) {
      std::string seen = "no error";
      try {
        mistake();
      } catch (const c10::TypeError& e) {
        seen = std::string("TypeError: ") + e.what_without_backtrace();
      } catch (const c10::ValueError& e) {
        seen = std::string("ValueError: ") + e.what_without_backtrace();
      } catch (const c10::Error& e) {
        seen = std::string("Error: ") + e.what_without_backtrace();
      }
      std::lock_guard<std::mutex> lock(mutex);
      errors[r].push_back(seen);
    };
    note([&] {
      stage->train_step(
          wrong ? torch::Tensor() : x, y, cross_entropy, Schedule::OneFOneB);
    });
    note([&] {
      stage->train_step(
          wrong ? x.narrow(0, 0, 0) : x, y, cross_entropy, Schedule::OneFOneB);
    });
    note([&] {
      stage->train_step(
          x,
          y,
          wrong ? LossFunction() : LossFunction(cross_entropy),
          Schedule::OneFOneB);
    });
    const auto loss =
        stage->train_step(x, y, cross_entropy, Schedule::OneFOneB);
    const auto expected =
        clean->train_step(x, y, cross_entropy, Schedule::OneFOneB);
    EXPECT_EQ(loss.item<double>(), expected.item<double>());
    for (size_t k = 0; k < stage->parameters().size(); ++k) {
      EXPECT_TRUE(torch::allclose(
          stage->parameters()[k].grad(),
          clean->parameters()[k].grad(),
          1e-12,
          1e-12));
    }
  });
  const std::vector<std::string> kinds{"TypeError", "ValueError", "ValueError"};
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(errors[r].size(), 3u) << "rank " << r;
    for (size_t k = 0; k < 3; ++k) {
      const auto& e = errors[r][k];
      SCOPED_TRACE(
          "rank " + std::to_string(r) + ", mistake " + std::to_string(k) +
          ": " + e);
      EXPECT_EQ(e.rfind(kinds[k] + ": ", 0), 0u);
      if (r == 2) {
        continue;  // its own message
      }
      if (r == 3) {  // replica 1's last stage hears it from rank 2
        EXPECT_NE(
            e.find("rank 2 refused the pass before it began"),
            std::string::npos);
        EXPECT_NE(
            e.find(errors[2][k].substr(kinds[k].size() + 2)),
            std::string::npos);
        continue;
      }
      EXPECT_NE(
          e.find("the first stage of replica 1 (rank 2) refused this "
                 "training step before it began ("),
          std::string::npos);
      // With its cause, and said once.
      EXPECT_NE(
          e.find(errors[2][k].substr(kinds[k].size() + 2)), std::string::npos);
      EXPECT_EQ(e.find("stays usable"), e.rfind("stays usable"));
    }
  }
  EXPECT_NE(
      errors[2][0].find("train_step expects the input on rank 2"),
      std::string::npos)
      << errors[2][0];
  EXPECT_NE(
      errors[2][2].find("train_step expects a loss_fn"), std::string::npos)
      << errors[2][2];
}

// A plan that does not fit one replica's pipeline (4 micro-batches where
// chunks is 2) is found by that replica's ranks only after the replicas
// agreed to start: the other replica ran its step and waited in the
// gradients' all-reduce for a replica that had refused, and the next
// step's agreement met that all-reduce. The plan is checked before the
// agreement now, so every replica refuses the step alike, and the stages
// stay usable.
TEST(MeshTest, APlanThatDoesNotFitOneReplicaIsRefusedByEveryReplica) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  const auto batch = batch_of(8);
  const auto nets = nets_of_ranks(4);
  const auto fresh = nets_of_ranks(4);
  const auto fits = training_plan(Schedule::OneFOneB, 2, 2);
  const auto too_many = training_plan(Schedule::OneFOneB, 4, 2);
  std::mutex mutex;
  std::vector<std::string> errors(4);
  std::vector<double> seconds(4, 0.0);
  run_ranks(4, [&](World world) {
    const auto r = world.rank();
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[r], options, mesh);
    dist::PipelineStage clean(fresh[r], options, mesh);
    const auto d = mesh.data_rank();
    const bool first = mesh.pipeline_rank() == 0;
    const auto x = first ? batch.x.narrow(0, 4 * d, 4) : torch::Tensor();
    const auto y = first ? torch::Tensor() : batch.y.narrow(0, 4 * d, 4);
    const auto began = std::chrono::steady_clock::now();
    std::string seen = "no error";
    try {
      stage->train_step(x, y, cross_entropy, d == 1 ? too_many : fits);
    } catch (const c10::ValueError& e) {
      seen = std::string("ValueError: ") + e.what_without_backtrace();
    } catch (const c10::Error& e) {
      seen = std::string("Error: ") + e.what_without_backtrace();
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      errors[r] = seen;
      seconds[r] = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - began)
                       .count();
    }
    // Usable after it: the next step is a clean stage's.
    const auto loss = stage->train_step(x, y, cross_entropy, fits);
    const auto expected = clean->train_step(x, y, cross_entropy, fits);
    EXPECT_EQ(loss.item<double>(), expected.item<double>());
    for (size_t k = 0; k < stage->parameters().size(); ++k) {
      EXPECT_TRUE(torch::allclose(
          stage->parameters()[k].grad(),
          clean->parameters()[k].grad(),
          1e-12,
          1e-12));
    }
  });
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + errors[r]);
    EXPECT_EQ(errors[r].rfind("ValueError: ", 0), 0u);
    EXPECT_NE(errors[r].find("4 micro-batches"), std::string::npos);
    EXPECT_LT(seconds[r], 10.0);  // the timeout is 30 s
  }
  EXPECT_NE(
      errors[0].find("the first stage of replica 1 (rank 2) refused this "
                     "training step before it began ("),
      std::string::npos);
}

// One rank of one replica builds another model: its replica's ranks find
// out in their own agreement, and the other replica's ranks, which wait for
// them in the replicas' agreement, used to wait out the whole timeout
// ("waited 30 s for rank 2 to build its stage"). They now hear why at once.
TEST(MeshTest, AReplicaThatBuiltAnotherModelTellsTheOtherReplicas) {
  const auto options =
      GPipeOptions(std::vector<int64_t>{3, 4}).chunks(2).threads_per_lane(1);
  auto nets = nets_of_ranks(4);
  nets[3] = build(0, /*relu=*/true);  // rank 3: a ReLU for a Tanh
  std::mutex mutex;
  std::vector<std::string> errors(4);
  std::vector<double> seconds(4, 0.0);
  run_ranks(4, [&](World world) {
    const auto began = std::chrono::steady_clock::now();
    try {
      Mesh mesh(world, 2);
      dist::PipelineStage stage(nets[world.rank()], options, mesh);
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[world.rank()] = e.what_without_backtrace();
    }
    std::lock_guard<std::mutex> lock(mutex);
    seconds[world.rank()] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - began)
            .count();
  });
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + errors[r]);
    EXPECT_LT(seconds[r], 10.0);  // the timeout is 30 s
    EXPECT_NE(errors[r].find("ReLU"), std::string::npos);
    if (r < 2) {
      EXPECT_NE(
          errors[r].find(
              "rank " + std::to_string(r + 2) + " could not build its stage"),
          std::string::npos);
    }
  }
}

// As DDP's, the buckets are filled from the last parameter to the first,
// the first at most 1 MiB (or the bucket size, if less), a tensor larger
// than a bucket alone in its own.
TEST(MeshTest, GradientBucketsStartSmallAndFillFromTheLastLayer) {
  constexpr int64_t KiB = 1024;
  // Floats of 1.5 MiB, 256 KiB, 512 KiB and 512 KiB, in layer order.
  std::vector<torch::Tensor> params;
  for (const int64_t kib : {1536, 256, 512, 512}) {
    params.push_back(torch::zeros({kib * KiB / 4}).requires_grad_());
  }
  run_ranks(1, [&](World world) {
    using dist::detail::GradientBuckets;
    EXPECT_EQ(
        GradientBuckets(world, params, 25 * 1024 * KiB).bucket_bytes(),
        (std::vector<int64_t>{1024 * KiB, 1792 * KiB}));
    EXPECT_EQ(
        GradientBuckets(world, params, 600 * KiB).bucket_bytes(),
        (std::vector<int64_t>{512 * KiB, 512 * KiB, 256 * KiB, 1536 * KiB}));
    EXPECT_EQ(
        GradientBuckets(world, params, 1024 * KiB).bucket_bytes(),
        (std::vector<int64_t>{1024 * KiB, 256 * KiB, 1536 * KiB}));
  });
}

// A rank that waits for its peer to take its messages hears of the peer's
// failure, rather than waiting out the timeout: in inference the first
// stage's last act is to wait until the last stage took every output, and
// here the last stage fails on the first micro-batch before it takes the
// others. (Flaky before: a replica's first stage did so after its last
// stage heard of another replica's failure mid-pass.) On Gloo's tagged
// channel and on the ordered one NCCL uses (GPIPE_DIST_CHANNEL).
void expect_a_waiting_sender_to_hear_of_a_failure(const char* channel) {
  SCOPED_TRACE(std::string("GPIPE_DIST_CHANNEL=") + channel);
  struct Channel {  // read when the ranks' Worlds are made
    explicit Channel(const char* name) {
      if (const char* before = std::getenv("GPIPE_DIST_CHANNEL")) {
        saved = before;
      }
      ::setenv("GPIPE_DIST_CHANNEL", name, 1);
    }
    ~Channel() {
      if (saved) {
        ::setenv("GPIPE_DIST_CHANNEL", saved->c_str(), 1);
      } else {
        ::unsetenv("GPIPE_DIST_CHANNEL");
      }
    }
    std::optional<std::string> saved;
  } set_channel(channel);
  auto make = [] {
    torch::nn::Sequential net;
    net->push_back(torch::nn::Linear(6, 10));
    net->push_back(torch::nn::Tanh());
    net->push_back(torch::nn::Functional([](torch::Tensor x) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      throw std::runtime_error("the layer broke on purpose");
      return x;
    }));
    net->push_back(torch::nn::Linear(10, 3));
    return net;
  };
  const auto options =
      GPipeOptions({2, 2}).chunks(4).checkpoint(Checkpoint::Never);
  const auto x = torch::randn({8, 6});
  std::mutex mutex;
  std::vector<std::string> errors(2);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(2, [&](World world) {
    dist::PipelineStage stage(make(), options, world);
    try {
      torch::NoGradGuard no_grad;
      stage->forward(world.rank() == 0 ? x : torch::Tensor());
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      errors[world.rank()] = e.what_without_backtrace();
    }
  });
  expect_every_rank_to_fail_fast(errors, "the layer broke on purpose", start);
}

TEST(MeshTest, ARankWaitingForItsSendsHearsOfItsPeersFailure) {
  expect_a_waiting_sender_to_hear_of_a_failure("tagged");
  expect_a_waiting_sender_to_hear_of_a_failure("ordered");
}

// The gradient all-reduce of a stage starts as soon as its gradients are
// final, while the rest of the pipeline drains: under 1F1B the last stage
// ends first, and its all-reduce starts before the first stage's last
// backward ends (which waits for the last stage's gradients); the first
// stage's starts within that backward, bucket by bucket. Each stage's
// all-reduce is one interval of its own kind on its lane, per step.
TEST(MeshTest, AStagesAllReduceStartsWhileThePipelineDrains) {
  const auto options = GPipeOptions({3, 4})
                           .chunks(4)
                           .checkpoint(Checkpoint::Never)
                           .threads_per_lane(1);
  const auto nets = nets_of_ranks(4);
  // A trace per replica, shared by its two stages (lanes 0 and 1).
  std::vector<std::shared_ptr<Trace>> traces{
      std::make_shared<Trace>(), std::make_shared<Trace>()};
  torch::manual_seed(5);
  const auto x = torch::randn({16, 6}, torch::kDouble);
  const auto y = torch::randint(0, 3, {16}, torch::kLong);
  run_ranks(4, [&](World world) {
    Mesh mesh(world, 2);
    dist::PipelineStage stage(nets[world.rank()], options, mesh);
    stage->set_gradient_bucket_bytes(256);  // a few buckets per stage
    stage->set_trace(traces[mesh.data_rank()]);
    const auto rows = x.narrow(0, mesh.data_rank() * 8, 8);
    const auto targets = y.narrow(0, mesh.data_rank() * 8, 8);
    for (int step = 0; step < 3; ++step) {
      stage->train_step(
          mesh.pipeline_rank() == 0 ? rows : torch::Tensor(),
          mesh.pipeline_rank() == 1 ? targets : torch::Tensor(),
          cross_entropy,
          Schedule::OneFOneB);
    }
    stage->set_trace(nullptr);
  });
  for (const auto& trace : traces) {
    std::vector<TraceEvent> reduces[2];
    double first_stage_last_backward = 0;
    for (const auto& e : trace->events()) {
      if (e.kind == TraceKind::AllReduce) {
        reduces[e.lane].push_back(e);
      } else if (e.kind == TraceKind::Backward && e.lane == 0) {
        first_stage_last_backward = e.end_us;  // (by start time)
      }
    }
    ASSERT_EQ(reduces[0].size(), 3u);
    ASSERT_EQ(reduces[1].size(), 3u);
    EXPECT_LT(reduces[1].back().start_us, first_stage_last_backward);
    // The first stage's buckets start within its own last backward, as
    // their gradients are accumulated, not after it.
    EXPECT_LT(reduces[0].back().start_us, first_stage_last_backward);
    EXPECT_LE(reduces[1].back().start_us, reduces[1].back().end_us);
  }
  EXPECT_NE(traces[0]->svg().find("all-reduce"), std::string::npos);
}

}  // namespace
}  // namespace gpipe
