// Transfers as plan actions: SEND_F/RECV_F/SEND_B/RECV_B placed by
// Plan::with_transfers or written by hand, checked by validate(), read and
// written as CSV, and run where the plan lists them. (Across processes:
// tests/dist.)

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "common.h"
#include "error_of.h"

namespace gpipe {
namespace {

using testing::expect_same_gradients;
using testing::SeededTest;

using testing::error_of;

std::string table_of(const Plan& plan) {
  std::ostringstream out;
  out << plan;
  return out.str();
}

const Schedule kSchedules[] = {
    Schedule::FillDrain,
    Schedule::OneFOneB,
    Schedule::Interleaved1F1B,
    Schedule::ZeroBubble};

TEST(TransfersTest, WithTransfersPlacesEveryMessageBetweenLanes) {
  // 1F1B on 2 lanes: each send right after the cell that makes it; each
  // receive before the compute action that precedes its consumer.
  const auto plan = make_plan(Schedule::OneFOneB, 3, 2).with_transfers();
  EXPECT_EQ(
      plan.to_csv(),
      "0F0,0SEND_F0,0RECV_B0,0F1,0SEND_F1,0B0,0RECV_B1,0F2,0SEND_F2,"
      "0RECV_B2,0B1,0B2\n"
      "1RECV_F0,1F0,1L0,1RECV_F1,1B0,1SEND_B0,1F1,1L1,1RECV_F2,1B1,"
      "1SEND_B1,1F2,1L2,1B2,1SEND_B2\n");
  EXPECT_NO_THROW(plan.validate());
  // One lane: nothing crosses lanes.
  const auto one = make_plan(Schedule::OneFOneB, 3, 1, 2);
  EXPECT_EQ(one.with_transfers().to_csv(), one.to_csv());
}

TEST(TransfersTest, TransfersTakeNoStepAndCostNothing) {
  for (auto schedule : kSchedules) {
    for (int64_t lanes = 1; lanes <= 4; ++lanes) {
      for (int64_t v = 1; v <= 2; ++v) {
        for (int64_t m = 1; m <= 9; m += 4) {
          SCOPED_TRACE(
              to_string(schedule) + " lanes=" + std::to_string(lanes) +
              " v=" + std::to_string(v) + " m=" + std::to_string(m));
          const auto plain = make_plan(schedule, m, lanes, v);
          const auto plan = plain.with_transfers();
          ASSERT_NO_THROW(plan.validate());
          // Placed again, the same plan; through CSV, the same plan.
          EXPECT_EQ(plan.with_transfers().to_csv(), plan.to_csv());
          EXPECT_EQ(Plan::from_csv(plan.to_csv()).to_csv(), plan.to_csv());
          EXPECT_EQ(table_of(plan), table_of(plain));
          ActionCosts costs;
          costs.transfer = 0.25;
          const auto a = simulate(plain, costs);
          const auto b = simulate(plan, costs);
          EXPECT_DOUBLE_EQ(a.makespan, b.makespan);
          EXPECT_EQ(a.peak_live, b.peak_live);
          // Messages: 2 per micro-batch and boundary between lanes (every
          // boundary when there are several lanes), each a send and a
          // receive.
          size_t transfers = 0;
          for (const auto& row : plan.lanes) {
            for (const auto& c : row) {
              transfers += is_transfer(c.phase) ? 1 : 0;
            }
          }
          const auto boundaries = lanes > 1 ? lanes * v - 1 : 0;
          EXPECT_EQ(static_cast<int64_t>(transfers), 4 * m * boundaries);
        }
      }
    }
  }
}

TEST(TransfersTest, CsvSpellsThemAsPyTorchDoes) {
  const auto plan = Plan::from_csv(
      "0F0,0SEND_F0,0RECV_B0,0B0\n"
      "1RECV_F0,1F0,1B0,1SEND_B0\n");
  ASSERT_EQ(plan.lanes[0].size(), 4u);
  EXPECT_EQ(plan.lanes[0][1], (Cell{0, 0, Phase::SendForward}));
  EXPECT_EQ(plan.lanes[0][2], (Cell{0, 0, Phase::RecvBackward}));
  EXPECT_EQ(plan.lanes[1][0], (Cell{0, 1, Phase::RecvForward}));
  EXPECT_EQ(plan.lanes[1][3], (Cell{0, 1, Phase::SendBackward}));
  EXPECT_NO_THROW(plan.validate());
  EXPECT_EQ(to_string(Cell{3, 1, Phase::RecvForward}), "RECV_F(3,1)");
  const auto message = error_of([] { Plan::from_csv("0F0,0SEND_X0\n"); });
  EXPECT_NE(message.find("'0SEND_X0'"), std::string::npos) << message;
  EXPECT_NE(message.find("SEND_F"), std::string::npos) << message;
}

TEST(TransfersTest, ValidateNamesTheProblem) {
  auto check = [](const std::string& csv, const std::string& expected) {
    const auto message = error_of([&] { Plan::from_csv(csv).validate(); });
    EXPECT_NE(message.find(expected), std::string::npos)
        << csv << " -> " << message;
  };
  // A receive after the forward that needs it.
  check(
      "0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n",
      "deadlocks: lane 1 waits at F(0,1) for RECV_F(0,1)");
  // A send before the cell that makes it.
  check(
      "0SEND_F0,0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
      "deadlocks: lane 0 waits at SEND_F(0,0) for F(0,0)");
  // One message listed, its partners not.
  check(
      "0F0,0SEND_F0,0B0\n1F0,1B0\n", "it lists transfers, but not RECV_F(0,1)");
  check(
      "0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0\n",
      "it lists transfers, but not SEND_B(0,1)");
  // Between stages of one lane.
  check(
      "0F0,1F0,0SEND_F0,1RECV_F0,1B0,0B0\n",
      "between stages 0 and 1, which run on the same lane 0");
  // Past the ends of the pipeline, and without the cells it connects.
  check("0RECV_F0,0F0,0B0\n", "outside 0..0");
  check(
      "0RECV_B0,0B0,0SEND_F0\n1B0,1SEND_B0\n",
      "SEND_F(0,0) moves a message between F(0,0) and F(0,1), but the plan "
      "does not run both");
}

class TransfersRunTest : public SeededTest {};

torch::nn::Sequential small_net() {
  torch::nn::Sequential net(
      torch::nn::Linear(5, 6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 6),
      torch::nn::Tanh(),
      torch::nn::Linear(6, 4));
  net->to(torch::kFloat64);
  return net;
}

torch::Tensor cross_entropy(torch::Tensor y, torch::Tensor t) {
  return torch::nn::functional::cross_entropy(y, t);
}

TEST_F(TransfersRunTest, PlansWithTransfersGiveThePlainGradients) {
  for (auto schedule : kSchedules) {
    for (auto mode : {Checkpoint::Never, Checkpoint::Always}) {
      SCOPED_TRACE(to_string(schedule));
      auto net = small_net();
      auto copy = testing::copy_of(net);
      const bool interleaved = schedule == Schedule::Interleaved1F1B;
      GPipe model(
          copy,
          GPipeOptions(
              interleaved ? std::vector<int64_t>{2, 1, 1, 1}
                          : std::vector<int64_t>{2, 2, 1})
              .chunks(4)
              .checkpoint(mode)
              .stages_per_lane(interleaved ? 2 : 1));
      auto x = torch::randn({8, 5}, torch::kFloat64);
      auto t = torch::randint(0, 4, {8});
      auto expected = cross_entropy(net->forward(x), t);
      expected.backward();
      const auto plan =
          make_plan(schedule, 4, interleaved ? 2 : 3, interleaved ? 2 : 1)
              .with_transfers();
      auto got = model->train_step(x, t, cross_entropy, plan);
      EXPECT_NEAR(got.item<double>(), expected.item<double>(), 1e-12);
      expect_same_gradients(*net, *copy);
    }
  }
}

TEST_F(TransfersRunTest, ASendRunsWhereThePlanPutsIt) {
  auto net = small_net();
  GPipe model(net, GPipeOptions({3, 2}).chunks(2));
  // Lane 0 holds micro-batch 0's output until it has run F1: lane 1's
  // first forward cannot start before lane 0's second one ends.
  const auto plan = Plan::from_csv(
      "0F0,0F1,0SEND_F0,0SEND_F1,0RECV_B0,0RECV_B1,0B0,0B1\n"
      "1RECV_F0,1RECV_F1,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n");
  ASSERT_NO_THROW(plan.validate());
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  auto x = torch::randn({4, 5}, torch::kFloat64);
  auto t = torch::randint(0, 4, {4});
  model->train_step(x, t, cross_entropy, plan);
  model->set_trace(nullptr);
  double lane0_f1_end = -1;
  double lane1_f0_start = -1;
  for (const auto& e : trace->events()) {
    if (e.kind == TraceKind::Forward && e.lane == 0 && e.micro_batch == 1) {
      lane0_f1_end = e.end_us;
    }
    if (e.kind == TraceKind::Forward && e.lane == 1 && e.micro_batch == 0) {
      lane1_f0_start = e.start_us;
    }
  }
  ASSERT_GE(lane0_f1_end, 0);
  EXPECT_GE(lane1_f0_start, lane0_f1_end);
  // An error in a cell whose message waits in the outbox still ends the
  // pass cleanly, and the model runs the next step.
  auto bad = torch::randint(4, 5, {4});  // class 4 of 4: out of range
  EXPECT_THROW(model->train_step(x, bad, cross_entropy, plan), c10::Error);
  EXPECT_NO_THROW(model->train_step(x, t, cross_entropy, plan));
}

}  // namespace
}  // namespace gpipe
