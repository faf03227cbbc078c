// train_step under every schedule and plan: gradients equal the plain
// model's, the split backward runs each part once, plans run as written,
// and plans that do not fit are refused.

#include <gpipe/gpipe.h>
#include <gpipe/models/timed.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>

#include "common.h"

namespace gpipe {
namespace {

using testing::expect_same_gradients;
using testing::SeededTest;

using testing::PopAdd;
using testing::TanhStash;

// 8 layers with a skip from layer 1 to layer 6, and dropout (or an
// identity) and batch norm (or tanh).
torch::nn::Sequential model_of(bool batch_norm, double dropout = 0.3) {
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(5, 6));
  net->push_back(TanhStash());
  net->push_back(torch::nn::Linear(6, 6));
  net->push_back(
      batch_norm ? torch::nn::AnyModule(torch::nn::BatchNorm1d(6))
                 : torch::nn::AnyModule(torch::nn::Tanh()));
  net->push_back(
      dropout > 0 ? torch::nn::AnyModule(torch::nn::Dropout(dropout))
                  : torch::nn::AnyModule(torch::nn::Identity()));
  net->push_back(torch::nn::Linear(6, 6));
  net->push_back(PopAdd());
  net->push_back(torch::nn::Linear(6, 4));
  return net;
}

// One Linear applied twice: its weight (and bias) get two uses.
struct TwiceImpl : torch::nn::Module {
  explicit TwiceImpl(bool bias = true)
      : linear(register_module(
            "linear",
            torch::nn::Linear(torch::nn::LinearOptions(4, 4).bias(bias)))) {}
  torch::Tensor forward(torch::Tensor x) {
    return linear(torch::tanh(linear(x)));
  }
  torch::nn::Linear linear;
};
TORCH_MODULE(Twice);

// One weight, scaled by a parameter once, applied twice without bias: the
// scaling's backward (which saves tensors) lies beyond two forks.
struct ScaledTwiceImpl : torch::nn::Module {
  ScaledTwiceImpl()
      : weight(register_parameter("weight", torch::randn({4, 4}) * 0.5)),
        scale(register_parameter("scale", torch::full({4, 1}, 1.5))) {}
  torch::Tensor forward(torch::Tensor x) {
    namespace F = torch::nn::functional;
    auto w = weight * scale;
    return F::linear(torch::tanh(F::linear(x, w)), w);
  }
  torch::Tensor weight;
  torch::Tensor scale;
};
TORCH_MODULE(ScaledTwice);

torch::Tensor loss_of(torch::Tensor y, torch::Tensor t) {
  return torch::nn::functional::cross_entropy(y, t);
}

struct Layout {
  std::vector<int64_t> balance;
  int64_t stages_per_lane;
  Placement placement = {};
};

class SchedulesTrainTest : public SeededTest,
                           public ::testing::WithParamInterface<
                               std::tuple<Schedule, Checkpoint, Layout>> {};

TEST_P(SchedulesTrainTest, GradientsEqualThePlainModel) {
  const auto& [schedule, mode, layout] = GetParam();
  auto net = model_of(/*batch_norm=*/false, /*dropout=*/0.0);
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(
      copy,
      GPipeOptions(layout.balance)
          .chunks(5)
          .checkpoint(mode)
          .stages_per_lane(layout.stages_per_lane)
          .placement(layout.placement));
  // 9 rows in 5 chunks: 2, 2, 2, 2, 1.
  auto x = torch::randn({9, 5}, torch::kFloat64).requires_grad_(true);
  auto x2 = x.detach().clone().requires_grad_(true);
  auto target = torch::randint(0, 4, {9}, torch::kLong);
  auto expected = loss_of(net->forward(x), target);
  expected.backward();
  auto got = model->train_step(x2, target, loss_of, schedule);
  EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12);
  ASSERT_TRUE(x2.grad().defined());
  EXPECT_TRUE(torch::allclose(x2.grad(), x.grad(), 1e-10, 1e-13));
  expect_same_gradients(*net, *copy);
}

TEST_P(SchedulesTrainTest, TrainingModeMatchesFillDrainWithDropout) {
  const auto& [schedule, mode, layout] = GetParam();
  auto net = model_of(/*batch_norm=*/true);
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  auto options = GPipeOptions(layout.balance)
                     .chunks(4)
                     .checkpoint(mode)
                     .deferred_batch_norm(true)
                     .stages_per_lane(layout.stages_per_lane)
                     .placement(layout.placement);
  GPipe reference(net, options);
  GPipe model(copy, options);
  auto x = torch::randn({8, 5}, torch::kFloat64);
  auto target = torch::randint(0, 4, {8}, torch::kLong);
  // The same seed gives every cell the same dropout mask under any plan.
  torch::manual_seed(7);
  auto expected =
      reference->train_step(x, target, loss_of, Schedule::FillDrain);
  torch::manual_seed(7);
  auto got = model->train_step(x, target, loss_of, schedule);
  EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12);
  expect_same_gradients(*reference, *model);
  // DeferredBatchNorm folded the same statistics in.
  auto b1 = reference->buffers();
  auto b2 = model->buffers();
  ASSERT_EQ(b1.size(), b2.size());
  for (size_t k = 0; k < b1.size(); ++k) {
    EXPECT_TRUE(
        torch::allclose(b1[k].to(torch::kFloat64), b2[k].to(torch::kFloat64)))
        << "buffer " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table,
    SchedulesTrainTest,
    ::testing::Combine(
        ::testing::Values(
            Schedule::Interleaved1F1B,
            Schedule::ZeroBubble,
            Schedule::OneFOneB),
        ::testing::Values(
            Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never),
        ::testing::Values(
            Layout{{4, 4}, 1},
            Layout{{2, 2, 2, 2}, 1},
            Layout{{2, 2, 2, 2}, 2},
            Layout{{1, 1, 1, 1, 1, 1, 1, 1}, 4})));

// Schedules on placements other than modulo: ZB-V on its V, looped BFS and
// the others on a V and on a list whose skip (layer 1 to layer 6) crosses
// lanes.
INSTANTIATE_TEST_SUITE_P(
    Placed,
    SchedulesTrainTest,
    ::testing::Combine(
        ::testing::Values(
            Schedule::ZeroBubbleV,
            Schedule::LoopedBFS,
            Schedule::FillDrain,
            Schedule::ZeroBubble),
        ::testing::Values(
            Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never),
        ::testing::Values(
            Layout{{4, 4}, 1, Placement::v_shape(1)},
            Layout{{2, 2, 2, 2}, 1, Placement::v_shape(2)},
            Layout{{1, 1, 1, 1, 1, 1, 1, 1}, 1, Placement::v_shape(4)})));

INSTANTIATE_TEST_SUITE_P(
    Listed,
    SchedulesTrainTest,
    ::testing::Combine(
        ::testing::Values(
            Schedule::LoopedBFS, Schedule::OneFOneB, Schedule::ZeroBubble),
        ::testing::Values(Checkpoint::ExceptLast),
        ::testing::Values(
            Layout{{2, 2, 2, 2}, 1, Placement({0, 0, 1, 1})},
            Layout{{2, 2, 2, 2}, 2},
            Layout{{2, 2, 1, 1, 1, 1}, 1, Placement({1, 0, 2, 2, 0, 1})})));

TEST_F(SchedulesTrainTest, SplitBackwardRunsEachPartOncePerCell) {
  auto counts = std::make_shared<models::TimedCounts>();
  models::TimedCosts free{
      std::chrono::microseconds(0),
      std::chrono::microseconds(0),
      std::chrono::microseconds(0)};
  torch::nn::Sequential net;
  for (int k = 0; k < 6; ++k) {
    net->push_back(models::TimedLayer(3, free, counts));
  }
  GPipe model(
      net, GPipeOptions({3, 3}).chunks(4).checkpoint(Checkpoint::Never));
  auto x = torch::randn({8, 3});
  model->train_step(
      x,
      torch::randn({8, 3}),
      [](auto y, auto t) { return torch::mse_loss(y, t); },
      Schedule::ZeroBubble);
  // 4 micro-batches x 6 layers; the first layer's input needs no grad.
  EXPECT_EQ(counts->forward.load(), 24);
  EXPECT_EQ(counts->backward_weight.load(), 24);
  EXPECT_EQ(counts->backward_input.load(), 20);
}

// Keeps, for its backward only, a tensor of its own (as GELU keeps its
// input), and lets `kept` watch it.
struct Keep : torch::autograd::Function<Keep> {
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      torch::Tensor x,
      c10::weak_intrusive_ptr<c10::TensorImpl>* kept) {
    auto own = x * 2;
    *kept = c10::weak_intrusive_ptr<c10::TensorImpl>(own.getIntrusivePtr());
    ctx->save_for_backward({own});
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    EXPECT_TRUE(ctx->get_saved_variables()[0].defined());
    return {grads[0], torch::Tensor()};
  }
};

// Records, in its backward, whether the tensor that a later Keep kept has
// been freed by then.
struct Look : torch::autograd::Function<Look> {
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      torch::Tensor x,
      const c10::weak_intrusive_ptr<c10::TensorImpl>* kept,
      std::vector<bool>* freed) {
    ctx->saved_data["kept"] = reinterpret_cast<int64_t>(kept);
    ctx->saved_data["freed"] = reinterpret_cast<int64_t>(freed);
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto* kept =
        reinterpret_cast<const c10::weak_intrusive_ptr<c10::TensorImpl>*>(
            ctx->saved_data["kept"].toInt());
    auto* freed =
        reinterpret_cast<std::vector<bool>*>(ctx->saved_data["freed"].toInt());
    freed->push_back(kept->expired());
    return {grads[0], torch::Tensor(), torch::Tensor()};
  }
};

struct LookThenKeepImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) {
    return Keep::apply(Look::apply(x, &kept, &freed), &kept);
  }
  // (A weak pointer has no empty state: this one starts expired.)
  c10::weak_intrusive_ptr<c10::TensorImpl> kept{
      torch::empty({0}).getIntrusivePtr()};
  std::vector<bool> freed;
};
TORCH_MODULE(LookThenKeep);

TEST_F(SchedulesTrainTest, InputPartFreesWhatOnlyItNeedsAsItGoes) {
  // A weight part holds its layers' inputs and output gradients until it
  // runs; what only the input part needs (here Keep's tensor) must go as
  // soon as the input part is past it, as a whole backward frees it, not
  // when the input part ends: otherwise zero-bubble holds more than 1F1B.
  // With recomputation too: the input part then runs on the recomputed
  // graph.
  for (auto schedule : {Schedule::OneFOneB, Schedule::ZeroBubble}) {
    for (auto mode : {Checkpoint::Never, Checkpoint::Always}) {
      SCOPED_TRACE(to_string(schedule) + ", " + to_string(mode));
      LookThenKeep probe;
      torch::nn::Sequential net(
          torch::nn::Linear(3, 3), probe, torch::nn::Linear(3, 3));
      GPipe model(net, GPipeOptions({1, 2}).chunks(1).checkpoint(mode));
      model->train_step(
          torch::randn({2, 3}),
          torch::randn({2, 3}),
          [](auto y, auto t) { return torch::mse_loss(y, t); },
          schedule);
      // Under recomputation Look's backward runs once, after the recomputed
      // forward's Keep.
      EXPECT_EQ(probe->freed, std::vector<bool>{true});
    }
  }
}

TEST_F(SchedulesTrainTest, SplitBackwardWithFrozenLayersAndSharedModules) {
  // A frozen first partition (its input needs no grad either: its cells
  // have nothing to do), one Linear used twice in a layer of the second
  // (its bias is added by both uses: that graph is not split, and must
  // still be right), and a scaled bias-free weight used twice in the third
  // (split; the scaling's backward is reached from two forks, so they wait
  // for one engine run together: run apart, it would run twice).
  for (auto schedule : {Schedule::OneFOneB, Schedule::ZeroBubble}) {
    SCOPED_TRACE(to_string(schedule));
    auto make = [] {
      torch::manual_seed(3);
      torch::nn::Sequential net;
      net->push_back(torch::nn::Linear(4, 4));
      net->push_back(torch::nn::Tanh());
      net->push_back(Twice());
      net->push_back(torch::nn::Tanh());
      net->push_back(torch::nn::Linear(4, 4));
      net->push_back(ScaledTwice());
      net->push_back(torch::nn::Linear(4, 2));
      net->to(torch::kFloat64);
      for (auto& p : net[0]->parameters()) {
        p.requires_grad_(false);
      }
      return net;
    };
    auto net = make();
    auto copy = make();
    GPipe model(copy, GPipeOptions({2, 3, 2}).chunks(3));
    auto x = torch::randn({6, 4}, torch::kFloat64);
    auto t = torch::randint(0, 2, {6}, torch::kLong);
    loss_of(net->forward(x), t).backward();
    model->train_step(x, t, loss_of, schedule);
    expect_same_gradients(*net, *copy);
  }
}

TEST_F(SchedulesTrainTest, PlanFromCsvRunsExactlyAsWritten) {
  auto net = model_of(false);
  GPipe model(net, GPipeOptions({2, 2, 2, 2}).chunks(2).stages_per_lane(2));
  // Two lanes: lane 0 holds stages 0 and 2, lane 1 stages 1 and 3. An odd
  // but valid order: lane 0 finishes micro-batch 1's forward first.
  const std::string csv =
      "0F1,0F0,2F1,2F0,2B0,2W0,2B1,2W1,0B0,0B1,0W1,0W0\n"
      "1F1,3F1,1F0,3F0,3B0,1B0,3B1,1B1,3W0,3W1,1W1,1W0\n";
  const auto plan = Plan::from_csv(csv);
  plan.validate();
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->train_step(
      torch::randn({4, 5}), torch::randint(0, 4, {4}), loss_of, plan);
  model->set_trace(nullptr);
  std::map<int64_t, std::string> rows;
  for (const auto& e : trace->events()) {
    const char* letter = e.kind == TraceKind::Forward    ? "F"
                         : e.kind == TraceKind::Backward ? "B"
                         : e.kind == TraceKind::Weight   ? "W"
                                                         : nullptr;
    if (letter != nullptr) {
      rows[e.lane] += letter + std::to_string(e.micro_batch) + " ";
    }
  }
  EXPECT_EQ(rows[0], "F1 F0 F1 F0 B0 W0 B1 W1 B0 B1 W1 W0 ");
  EXPECT_EQ(rows[1], "F1 F1 F0 F0 B0 B0 B1 B1 W0 W1 W1 W0 ");
}

TEST_F(SchedulesTrainTest, PlansThatDoNotFitAreRefused) {
  auto net = model_of(false);
  GPipe model(net, GPipeOptions({2, 2, 2, 2}).chunks(2).stages_per_lane(2));
  EXPECT_EQ(model->lanes(), 2);
  EXPECT_EQ(model->devices().size(), 4u);
  auto x = torch::randn({4, 5});
  auto t = torch::randint(0, 4, {4});
  auto error_of = [&](const Plan& plan) -> std::string {
    try {
      model->train_step(x, t, loss_of, plan);
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(
      error_of(make_plan(Schedule::OneFOneB, 2, 4)).find("4 stages on 4 lanes"),
      std::string::npos);
  EXPECT_NE(
      error_of(make_plan(Schedule::OneFOneB, 3, 2, 2)).find("cut into 2"),
      std::string::npos);
  auto swapped = make_plan(Schedule::OneFOneB, 2, 2, 2);
  std::swap(swapped.lanes[0], swapped.lanes[1]);
  // The plan's own placement refuses its rows; without one, the pipeline's.
  EXPECT_NE(
      error_of(swapped).find("but the plan's placement modulo(2 lanes, 2 "
                             "stages per lane) puts stage 1 on lane 1"),
      std::string::npos)
      << error_of(swapped);
  swapped.placement = {};
  EXPECT_NE(
      error_of(swapped).find("on lane 0, but the pipeline's placement "
                             "modulo(2 lanes, 2 stages per lane) runs it on "
                             "lane 1"),
      std::string::npos)
      << error_of(swapped);
  EXPECT_NE(
      error_of(Plan::from_csv("0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n"
                              "1F0,1F1,3F0,3F1,3B1,3B0,1B0\n"))
          .find("never run"),
      std::string::npos);
  // The model is still usable.
  EXPECT_NO_THROW(model->train_step(x, t, loss_of, Schedule::Interleaved1F1B));
  // The plan checked last passes again; any other is checked again, also
  // right after it.
  const auto fits = make_plan(Schedule::OneFOneB, 2, 2, 2);
  EXPECT_NO_THROW(model->train_step(x, t, loss_of, fits));
  EXPECT_NE(error_of(swapped).find("on lane 0"), std::string::npos);
  EXPECT_NO_THROW(model->train_step(x, t, loss_of, fits));
  // A schedule's plan is made again when the micro-batches change (one row
  // makes one micro-batch): the one kept for two would be refused.
  EXPECT_NO_THROW(model->train_step(x, t, loss_of, Schedule::OneFOneB));
  EXPECT_NO_THROW(model->train_step(
      x.narrow(0, 0, 1), t.narrow(0, 0, 1), loss_of, Schedule::OneFOneB));
  EXPECT_NO_THROW(model->train_step(x, t, loss_of, Schedule::OneFOneB));
}

TEST_F(SchedulesTrainTest, PlacementsThatDoNotFitAreRefused) {
  auto net = model_of(false);
  auto x = torch::randn({4, 5});
  auto t = torch::randint(0, 4, {4});
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const c10::ValueError& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  GPipe v(
      net,
      GPipeOptions({2, 2, 2, 2}).chunks(2).placement(Placement::v_shape(2)));
  EXPECT_EQ(v->lanes(), 2);
  EXPECT_EQ(v->placement(), Placement::v_shape(2));
  EXPECT_EQ(v->devices().size(), 4u);
  EXPECT_NO_THROW(v->train_step(x, t, loss_of, Schedule::ZeroBubbleV));
  GPipe modulo(net, GPipeOptions({2, 2, 2, 2}).chunks(2).stages_per_lane(2));
  EXPECT_NE(
      error_of([&] {
        modulo->train_step(x, t, loss_of, Schedule::ZeroBubbleV);
      }).find("zero_bubble_v runs on Placement::v_shape"),
      std::string::npos);
  // A plan made for another placement of as many stages and lanes.
  EXPECT_NE(
      error_of([&] {
        modulo->train_step(
            x, t, loss_of, make_plan(Schedule::FillDrain, 2, v->placement()));
      })
          .find("the plan's placement is v_shape(2 lanes), but the pipeline's "
                "is modulo(2 lanes, 2 stages per lane)"),
      std::string::npos);
  EXPECT_NE(
      error_of([&] {
        v->train_step(
            x, t, loss_of, make_plan(Schedule::Interleaved1F1B, 2, 2, 2));
      }).find("but the pipeline's is v_shape(2 lanes)"),
      std::string::npos);
  // A blank first line of a CSV made an empty lane 0: the refusal says so.
  EXPECT_NE(
      error_of([&] {
        modulo->train_step(
            x,
            t,
            loss_of,
            Plan::from_csv(
                "\n" + make_plan(Schedule::FillDrain, 2, 2, 2).to_csv()));
      })
          .find("on 3 lanes, but the pipeline has 4 partitions on 2 lanes "
                "(lane 0 of the plan list no action; in a plan's CSV a blank "
                "line between rows is an empty lane)"),
      std::string::npos);
  // Both are still usable.
  EXPECT_NO_THROW(modulo->train_step(x, t, loss_of, Schedule::LoopedBFS));
  EXPECT_NO_THROW(v->train_step(x, t, loss_of, Schedule::LoopedBFS));
  // Options: the placement must place every partition, and agree with
  // stages_per_lane when that is given.
  EXPECT_NE(
      error_of([&] {
        GPipe(net, GPipeOptions({4, 4}).placement(Placement({0, 1, 1})));
      }).find("places 3 stages, but the pipeline has 2 stages"),
      std::string::npos);
  EXPECT_NE(
      error_of([&] {
        GPipe(
            net,
            GPipeOptions({2, 2, 2, 2})
                .placement(Placement::v_shape(2))
                .stages_per_lane(4));
      }).find("stages_per_lane is 4"),
      std::string::npos);
  EXPECT_NO_THROW(GPipe(
      net,
      GPipeOptions({2, 2, 2, 2})
          .placement(Placement::v_shape(2))
          .stages_per_lane(2)));
  // One device per lane, whatever the placement.
  GPipe listed(
      net,
      GPipeOptions({4, 2, 2})
          .placement(Placement({0, 0, 1}))
          .devices({torch::kCPU, torch::kCPU}));
  EXPECT_EQ(listed->lanes(), 2);
  EXPECT_EQ(listed->devices().size(), 3u);
  EXPECT_NO_THROW(listed->train_step(x, t, loss_of, Schedule::OneFOneB));
}

TEST_F(SchedulesTrainTest, ForwardAndAutogradBackwardWithStagesPerLane) {
  auto net = model_of(/*batch_norm=*/false, /*dropout=*/0.0);
  net->to(torch::kFloat64);
  auto copy = testing::copy_of(net);
  GPipe model(
      copy,
      GPipeOptions({2, 2, 2, 2})
          .chunks(3)
          .checkpoint(Checkpoint::Always)
          .stages_per_lane(2));
  auto x = torch::randn({7, 5}, torch::kFloat64);
  auto expected = net->forward(x);
  auto got = model->forward(x);
  EXPECT_TRUE(torch::allclose(got, expected, 1e-12, 1e-12));
  expected.pow(2).sum().backward();
  got.pow(2).sum().backward();
  expect_same_gradients(*net, *copy);
}

TEST_F(SchedulesTrainTest, StagesPerLaneMustDivideThePartitions) {
  auto net = model_of(false);
  EXPECT_THROW(
      GPipe(net, GPipeOptions({4, 2, 2}).stages_per_lane(2)), c10::ValueError);
  EXPECT_THROW(
      GPipe(net, GPipeOptions({4, 4}).stages_per_lane(0)), c10::ValueError);
}

}  // namespace
}  // namespace gpipe
