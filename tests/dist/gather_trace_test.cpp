// gather_trace across ranks (threads of this process over one
// c10d::HashStore): every rank's cells arrive on rank 0 on the rank's row,
// each with its stage, and waits with none.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/trace.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <tuple>
#include <vector>

#include "dist/ranks.h"

namespace gpipe {
namespace {

using dist::World;
using dist::testing::run_ranks;

// Two ranks with two stages each (interleaved: stages 0 and 2 on rank 0,
// 1 and 3 on rank 1): the stage is what tells a rank's two stages apart.
TEST(GatherTraceTest, EveryRanksCellsArriveWithTheirStage) {
  torch::manual_seed(0);
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < 2; ++r) {
    torch::manual_seed(0);
    torch::nn::Sequential net;
    for (int k = 0; k < 4; ++k) {
      net->push_back(torch::nn::Linear(4, 4));
    }
    nets.push_back(net);
  }
  const auto x = torch::randn({8, 4});
  const auto y = torch::randn({8, 4});
  std::shared_ptr<Trace> gathered;
  run_ranks(2, [&](World world) {
    dist::PipelineStage stage(
        nets[world.rank()],
        GPipeOptions({1, 1, 1, 1})
            .chunks(4)
            .stages_per_lane(2)
            .threads_per_lane(1),
        world);
    stage->set_trace(std::make_shared<Trace>());
    stage->train_step(
        world.rank() == 0 ? x : torch::Tensor(),
        world.rank() == 1 ? y : torch::Tensor(),  // (stage 3's rank)
        [](const torch::Tensor& out, const torch::Tensor& t) {
          return torch::mse_loss(out, t);
        },
        Schedule::Interleaved1F1B);
    auto merged = dist::gather_trace(stage);
    EXPECT_EQ(merged != nullptr, world.rank() == 0);
    if (merged) {
      gathered = merged;
    }
  });
  ASSERT_NE(gathered, nullptr);
  std::map<std::tuple<int32_t, int64_t, TraceKind>, int> cells;
  int waits = 0;
  std::map<int64_t, int> sends;  // by lane (rank)
  for (const auto& e : gathered->events()) {
    if (e.kind == TraceKind::Receive || e.kind == TraceKind::Send ||
        e.kind == TraceKind::AllReduce) {
      EXPECT_EQ(e.stage, -1) << to_string(e.kind);
      ++waits;
      if (e.kind == TraceKind::Send) {
        // The wait for every send of the pass, once per rank: no one
        // micro-batch's (it was labelled micro-batch 0).
        EXPECT_EQ(e.micro_batch, -1);
        ++sends[e.lane];
      }
      continue;
    }
    ASSERT_GE(e.stage, 0) << to_string(e.kind);
    EXPECT_EQ(e.stage % 2, e.lane) << to_string(e.kind) << " " << e.stage;
    ++cells[{e.stage, e.micro_batch, e.kind}];
  }
  EXPECT_GT(waits, 0);
  EXPECT_EQ(sends, (std::map<int64_t, int>{{0, 1}, {1, 1}}));
  for (int32_t j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ((cells[{j, i, TraceKind::Forward}]), 1) << j << " " << i;
      EXPECT_EQ((cells[{j, i, TraceKind::Backward}]), 1) << j << " " << i;
    }
  }
  // The Chrome trace says it too.
  int with_stage = 0;
  const auto json = nlohmann::json::parse(gathered->chrome_json());
  for (const auto& e : json["traceEvents"]) {
    if (e["ph"] == "X" && e["args"].contains("stage")) {
      ++with_stage;
    }
  }
  EXPECT_GE(with_stage, 32);
}

}  // namespace
}  // namespace gpipe
