// Plans as data: make_plan for every schedule, CSV, validation errors and
// the simulation's bubbles and memory.

#include <gpipe/plan.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <sstream>

#include "error_of.h"
#include "schedule/actions.h"
#include "schedule/simulate.h"

namespace gpipe {
namespace {

const Schedule kSchedules[] = {
    Schedule::FillDrain,
    Schedule::OneFOneB,
    Schedule::Interleaved1F1B,
    Schedule::ZeroBubble};

using testing::error_of;

TEST(PlanTest, EverySchedulesPlanRunsEveryCellOnce) {
  for (auto schedule : kSchedules) {
    for (int64_t lanes = 1; lanes <= 5; ++lanes) {
      for (int64_t v = 1; v <= 3; ++v) {
        for (int64_t m = 1; m <= 12; ++m) {
          SCOPED_TRACE(
              to_string(schedule) + " lanes=" + std::to_string(lanes) +
              " v=" + std::to_string(v) + " m=" + std::to_string(m));
          const auto plan = make_plan(schedule, m, lanes, v);
          ASSERT_NO_THROW(plan.validate());
          EXPECT_EQ(plan.stages, lanes * v);
          EXPECT_EQ(static_cast<int64_t>(plan.lanes.size()), lanes);
          size_t cells = 0;
          for (size_t l = 0; l < plan.lanes.size(); ++l) {
            for (const auto& c : plan.lanes[l]) {
              EXPECT_EQ(c.partition % lanes, static_cast<int64_t>(l));
            }
            cells += plan.lanes[l].size();
          }
          const auto per_cell = schedule == Schedule::ZeroBubble ? 3 : 2;
          // And one loss per micro-batch.
          EXPECT_EQ(static_cast<int64_t>(cells), per_cell * m * lanes * v + m);
        }
      }
    }
  }
}

TEST(PlanTest, SchedulesParseAndPrint) {
  for (auto schedule : kSchedules) {
    EXPECT_EQ(schedule_from_string(to_string(schedule)), schedule);
  }
  EXPECT_EQ(to_string(Schedule::Interleaved1F1B), "interleaved");
  EXPECT_EQ(to_string(Schedule::ZeroBubble), "zero_bubble");
  EXPECT_THROW(schedule_from_string("zb"), c10::ValueError);
}

TEST(PlanTest, EveryErrorIsAC10Error) {
  // Callers catch c10::Error for everything the library refuses.
  EXPECT_THROW(schedule_from_string("pipedream"), c10::ValueError);
  EXPECT_THROW(training_plan(Schedule::OneFOneB, -1, 2), c10::ValueError);
  EXPECT_THROW(make_plan(Schedule::OneFOneB, -1, 2), c10::ValueError);
  EXPECT_THROW(lane_order(Schedule::FillDrain, 2, 2, 2), c10::IndexError);
  // A Phase outside the enum (a cast): gpipe's ValueError, not an internal
  // assertion that asks to report a bug to PyTorch.
  const auto msg = error_of([] {
    (void)to_string(Cell{0, 0, static_cast<Phase>(99)});
  });
  EXPECT_NE(
      msg.find("expected a gpipe::Phase, but got the value 99"),
      std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("PyTorch"), std::string::npos) << msg;
}

TEST(PlanTest, FromCsvSaysANumberIsOutOfRange) {
  for (const char* text : {"0F1000000000", "1000000000F0", "0F99999999999"}) {
    try {
      Plan::from_csv(text);
      ADD_FAILURE() << text << " was accepted";
    } catch (const c10::ValueError& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("out of range"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("expected an action"), std::string::npos) << msg;
    }
  }
  // A number of 100,000 digits is quoted by its ends and its length, not
  // in full twice (a 200,000-character message before).
  const auto digits = std::string(100000, '1');
  const auto long_msg = error_of([&] { Plan::from_csv("0F" + digits); });
  EXPECT_LT(long_msg.size(), 600u) << long_msg.substr(0, 600);
  EXPECT_NE(long_msg.find("(100000 characters)"), std::string::npos)
      << long_msg;
  EXPECT_NE(long_msg.find("(100002 characters)"), std::string::npos)
      << long_msg;
  const auto junk_msg = error_of([&] { Plan::from_csv("0Q" + digits); });
  EXPECT_LT(junk_msg.size(), 600u) << junk_msg.substr(0, 600);
  // The largest number accepted, and a malformed action still named so.
  EXPECT_EQ(Plan::from_csv("0F999999999").micro_batches, 1000000000);
  const auto msg = error_of([] { Plan::from_csv("0X1"); });
  EXPECT_NE(msg.find("expected an action"), std::string::npos) << msg;
}

TEST(PlanTest, ZeroBubbleDefersWeightsByTheStage) {
  // n = 2, m = 3: the last stage defers each W by one micro-batch.
  const auto plan = make_plan(Schedule::ZeroBubble, 3, 2);
  EXPECT_EQ(
      plan.to_csv(),
      "0F0,0F1,0B0,0W0,0F2,0B1,0W1,0B2,0W2\n"
      "1F0,1L0,1B0,1F1,1L1,1B1,1W0,1F2,1L2,1B2,1W1,1W2\n");
  std::ostringstream table;
  table << plan;
  std::cout << table.str();
  EXPECT_NE(table.str().find("W"), std::string::npos);
}

TEST(PlanTest, LossesFollowTheirForwardAndTakeNoStep) {
  for (auto schedule : kSchedules) {
    const auto plan = make_plan(schedule, 4, 2, 1);
    const auto compute = training_plan(schedule, 4, 2);
    // Each loss right after the last stage's forward, nothing else moved.
    std::vector<Cell> without;
    for (size_t k = 0; k < plan.lanes[1].size(); ++k) {
      const auto& c = plan.lanes[1][k];
      if (c.phase == Phase::Loss) {
        ASSERT_GT(k, 0u);
        EXPECT_EQ(
            plan.lanes[1][k - 1], (Cell{c.micro_batch, 1, Phase::Forward}));
      } else {
        without.push_back(c);
      }
    }
    EXPECT_EQ(without, compute.lanes[1]);
    // The unit-time tables are the same, and a loss is listed in its
    // forward's step.
    const auto steps = plan.steps();
    EXPECT_EQ(steps.size(), compute.steps().size());
    for (const auto& step : steps) {
      for (const auto& c : step) {
        if (c.phase == Phase::Loss) {
          EXPECT_NE(
              std::find(
                  step.begin(),
                  step.end(),
                  Cell{c.micro_batch, 1, Phase::Forward}),
              step.end());
        }
      }
    }
    std::ostringstream a;
    std::ostringstream b;
    a << plan;
    b << compute;
    EXPECT_EQ(a.str(), b.str());
  }
  // A loss costs what it is given.
  ActionCosts costs;
  costs.loss = 0.5;
  const auto sim = simulate(Plan::from_csv("0F0,0L0,0B0\n"), costs);
  EXPECT_DOUBLE_EQ(sim.makespan, 3.5);
  EXPECT_EQ(sim.peak_live, std::vector<int64_t>{1});
}

TEST(PlanTest, CsvRoundTrips) {
  for (auto schedule : kSchedules) {
    const auto plan = make_plan(schedule, 8, 4, 2);
    const auto back = Plan::from_csv(plan.to_csv());
    EXPECT_EQ(back.micro_batches, 8);
    EXPECT_EQ(back.stages, 8);
    ASSERT_EQ(back.lanes.size(), plan.lanes.size());
    for (size_t l = 0; l < plan.lanes.size(); ++l) {
      EXPECT_EQ(back.lanes[l], plan.lanes[l]) << to_string(schedule);
    }
  }
  // A plan of 0 micro-batches has no cells to show its stages and their
  // lanes: its placement line carries them (they came back as 0 stages).
  for (auto schedule : kSchedules) {
    const auto plan = make_plan(schedule, 0, 2, 2);
    const auto back = Plan::from_csv(plan.to_csv());
    EXPECT_EQ(back.micro_batches, 0) << to_string(schedule);
    EXPECT_EQ(back.stages, plan.stages) << to_string(schedule);
    EXPECT_EQ(back.placement, plan.placement) << to_string(schedule);
    EXPECT_EQ(back.lanes.size(), plan.lanes.size()) << to_string(schedule);
  }
}

TEST(PlanTest, CsvReadsPyTorchSpellings) {
  // Newer PyTorch writes the input part as I; idle slots are empty.
  const auto plan = Plan::from_csv(
      "0F0,,0I0,0W0\n"
      " 1F0 ,1B0,1W0\n");
  ASSERT_EQ(plan.lanes.size(), 2u);
  EXPECT_EQ(plan.lanes[0][1].phase, Phase::BackwardInput);
  EXPECT_EQ(plan.lanes[1][1].phase, Phase::BackwardInput);  // B with a W
  EXPECT_NO_THROW(plan.validate());
  // Whole backwards stay whole.
  EXPECT_EQ(Plan::from_csv("0F0,0B0\n").lanes[0][1].phase, Phase::Backward);
  // A byte order mark first (as some editors save UTF-8) was quoted,
  // invisibly, as part of a malformed first action.
  const auto marked = Plan::from_csv(
      "\xEF\xBB\xBF"
      "0F0,0B0\n");
  ASSERT_EQ(marked.lanes.size(), 1u);
  EXPECT_EQ(marked.lanes[0].size(), 2u);
  EXPECT_NO_THROW(marked.validate());
}

TEST(PlanTest, CsvErrorsNameRowColumnAndText) {
  const auto message = error_of([] { Plan::from_csv("0F0,0B0\n1F0,1X0\n"); });
  EXPECT_NE(message.find("row 2, column 2"), std::string::npos) << message;
  EXPECT_NE(message.find("'1X0'"), std::string::npos) << message;
  EXPECT_THROW(Plan::from_csv("F0\n"), c10::ValueError);
  EXPECT_THROW(Plan::from_csv("0F\n"), c10::ValueError);
  EXPECT_THROW(Plan::from_csv("0F0x\n"), c10::ValueError);
  EXPECT_THROW(Plan::from_csv("-1F0\n"), c10::ValueError);
}

TEST(PlanTest, ValidateNamesTheProblem) {
  auto check = [](const std::string& csv, const std::string& expected) {
    const auto message = error_of([&] { Plan::from_csv(csv).validate(); });
    EXPECT_NE(message.find(expected), std::string::npos)
        << csv << " -> " << message;
  };
  check("0F0,0B0,0F0\n", "listed twice");
  // A B written twice beside a W reads as the input part twice: said so.
  check(
      "0F0,0B0,0W0,0B0\n",
      "I(0,0) (an input part: I, or B where the cell also has a W) is listed "
      "twice");
  check("0F0,0I0\n", "has no weight part W(0,0)");
  check("0F0,0W0\n", "has no input part I(0,0)");
  // (B beside a W reads as the input part, so build this one directly.)
  Plan both = Plan::from_csv("0F0,0B0\n");
  both.lanes[0].push_back(Cell{0, 0, Phase::BackwardInput});
  both.lanes[0].push_back(Cell{0, 0, Phase::BackwardWeight});
  const auto message = error_of([&] { both.validate(); });
  EXPECT_NE(message.find("a whole backward"), std::string::npos) << message;
  check("0F0,0F1,0B0\n", "is never run, although other backwards are");
  // Stage 1's backward waits for its own forward, later on its lane.
  check("0F0,0B0\n1B0,1F0\n", "deadlocks");
  check("0F0,1F0,0B0,1B0\n", "deadlocks");
  check("0W0,0F0,0I0\n", "deadlocks");
  check("0F0,0B0\n0F1,0B1\n", "runs on lane 0 and on lane 1");
  check("0F0,0L0,0B0\n1F0,1B0\n", "losses belong to the last stage, 1");
  check("0F0,0F1,0L1,0B1,0B0\n", "L(0,0) is never run");
  check("0L0,0B0\n", "has no forward F(0,0)");
  check("0F0,0B0,0L0\n", "deadlocks: lane 0 waits at B(0,0) for L(0,0)");
  EXPECT_NO_THROW(Plan::from_csv("0F0,0F1,0L1,0L0,0B0,0B1\n").validate());
}

TEST(PlanTest, ValidateWorksThroughTheActionsNotEveryPair) {
  // One action naming micro-batch and stage 999999999: validate() walked
  // every (micro-batch, stage) pair, 10^18 of them, and never ended.
  for (const char* text :
       {"999999999L999999999\n",
        "99999L99999\n",
        "5F999999999\n",
        "999999999B0\n"}) {
    EXPECT_THROW(Plan::from_csv(text).validate(), c10::ValueError) << text;
  }
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("999999999L999999999\n").validate();
      }).find("L(999999999,999999999) has no forward"),
      std::string::npos);
  // The first missing cell is the one named, as before.
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("0F0,0F2,0B0,0B2\n").validate();
      }).find("F(1,0) is never run, although other forwards are"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("0F0,0F1,0F2,0B0,0B2\n").validate();
      }).find("the backward of micro-batch 1 on stage 0"),
      std::string::npos);
  // Transfers: a missing message is still found among the named pairs.
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("0F0,0SEND_F0,0F1,0B1,0B0\n1RECV_F0,1F0,1F1,1B1,1B0\n")
            .validate();
      }).find("it lists transfers, but not"),
      std::string::npos);
  // A user's plan whose sizes overflow their product: no actions, nothing
  // to walk.
  Plan big;
  big.micro_batches = int64_t{1} << 40;
  big.stages = int64_t{1} << 40;
  EXPECT_NO_THROW(big.validate());
}

TEST(PlanTest, MakePlanRefusesBadSizes) {
  EXPECT_THROW(make_plan(Schedule::OneFOneB, -1, 2), c10::ValueError);
  EXPECT_THROW(make_plan(Schedule::OneFOneB, 4, 0), c10::ValueError);
  EXPECT_THROW(make_plan(Schedule::OneFOneB, 4, 2, -1), c10::ValueError);
  // Sizes no memory holds: a ValueError naming them, not std::bad_alloc.
  const int64_t huge = int64_t{1} << 40;
  for (const auto schedule : schedules()) {
    const auto msg = error_of([&] { (void)make_plan(schedule, huge, 4); });
    EXPECT_NE(
        msg.find("but got 1099511627776 micro-batches on"), std::string::npos)
        << to_string(schedule) << ": " << msg;
    EXPECT_THROW(training_plan(schedule, huge, 2), c10::ValueError);
  }
  EXPECT_THROW(forward_plan(huge, 2), c10::ValueError);
  EXPECT_THROW(backward_plan(2, huge), c10::ValueError);
}

// make_plan on lanes takes the placement the schedule chooses, as
// placement_for does (it took one stage per lane: interleaved silently ran
// as 1F1B, and ZB-V was refused for a stages_per_lane nobody gave).
TEST(PlanTest, MakePlanOnLanesTakesTheSchedulesPlacement) {
  for (const auto schedule : schedules()) {
    SCOPED_TRACE(to_string(schedule));
    const auto chosen = placement_for(schedule, 2);
    const auto plan = make_plan(schedule, 4, 2);
    EXPECT_EQ(plan.placement, chosen);
    EXPECT_EQ(plan.stages, chosen.stages());
    EXPECT_EQ(plan.to_csv(), make_plan(schedule, 4, chosen).to_csv());
  }
  EXPECT_EQ(
      make_plan(Schedule::ZeroBubbleV, 4, 2).placement, Placement::v_shape(2));
  EXPECT_EQ(
      make_plan(Schedule::Interleaved1F1B, 4, 2).placement,
      Placement::modulo(2, 2));
  EXPECT_EQ(
      make_plan(Schedule::OneFOneB, 4, 2).placement, Placement::modulo(2, 1));
  EXPECT_EQ(
      make_plan(Schedule::Interleaved1F1B, 4, 2, 1).placement,
      Placement::modulo(2, 1));
}

// The targets of the schedules, in unit costs: F = 1, B = W = 1 (a whole
// backward 2), each stage of an interleaved plan half of that.
TEST(PlanTest, SimulatedBubblesShrinkAsPromised) {
  const int64_t n = 4;
  const int64_t m = 8;
  const auto one_f_one_b = simulate(make_plan(Schedule::OneFOneB, m, n));
  // 1F1B: (n - 1) (F + B) idle per lane.
  EXPECT_DOUBLE_EQ(one_f_one_b.bubble, 3.0 * (n - 1));
  EXPECT_DOUBLE_EQ(one_f_one_b.makespan, 3.0 * (m + n - 1));

  ActionCosts halves;
  halves.forward = 0.5;
  halves.backward = 1.0;
  const auto interleaved =
      simulate(make_plan(Schedule::Interleaved1F1B, m, n, 2), halves);
  EXPECT_LE(interleaved.bubble, 0.55 * one_f_one_b.bubble);
  std::cout << "interleaved bubble " << interleaved.bubble << " against "
            << one_f_one_b.bubble << "\n";

  const auto zero_bubble = simulate(make_plan(Schedule::ZeroBubble, m, n));
  EXPECT_DOUBLE_EQ(zero_bubble.bubble, 1.0 * (n - 1));
  EXPECT_LE(zero_bubble.bubble, 0.4 * one_f_one_b.bubble);

  // Memory: no lane holds more micro-batches than 1F1B's first.
  int64_t most_1f1b = 0;
  for (auto p : one_f_one_b.lane_peak_live) {
    most_1f1b = std::max(most_1f1b, p);
  }
  EXPECT_EQ(most_1f1b, n);
  for (auto p : zero_bubble.lane_peak_live) {
    EXPECT_LE(p, most_1f1b);
  }
  EXPECT_EQ(one_f_one_b.peak_live, (std::vector<int64_t>{4, 3, 2, 1}));
  const auto fill_drain = simulate(make_plan(Schedule::FillDrain, m, n));
  EXPECT_EQ(fill_drain.peak_live, (std::vector<int64_t>{8, 8, 8, 8}));
}

TEST(PlanTest, SimulationTimesActionsByCostAndTransfer) {
  ActionCosts costs;
  costs.transfer = 0.5;
  costs.cost = [](const Cell& c) {
    return c.phase == Phase::Loss ? 0.0 : c.partition == 0 ? 2.0 : 1.0;
  };
  const auto sim = simulate(make_plan(Schedule::FillDrain, 1, 2), costs);
  // F(0,0) 0-2, F(0,1) 2.5-3.5, L(0,1) 3.5, B(0,1) 3.5-4.5, B(0,0) 5-7.
  EXPECT_DOUBLE_EQ(sim.makespan, 7.0);
  ASSERT_EQ(sim.lanes[1].size(), 3u);
  EXPECT_EQ(sim.lanes[1][1].cell, (Cell{0, 1, Phase::Loss}));
  EXPECT_DOUBLE_EQ(sim.lanes[1][0].start, 2.5);
  EXPECT_DOUBLE_EQ(sim.busy[0], 4.0);
  EXPECT_DOUBLE_EQ(sim.busy[1], 2.0);
  EXPECT_DOUBLE_EQ(sim.bubble, 4.0);
  EXPECT_THROW(simulate(Plan::from_csv("0B0,0F0\n")), c10::ValueError);
  // An infinite cost is refused as a NaN's is (it gave a NaN bubble).
  const auto plan = make_plan(Schedule::OneFOneB, 4, 2);
  for (const double bad :
       {std::numeric_limits<double>::infinity(),
        std::numeric_limits<double>::quiet_NaN(),
        -1.0}) {
    const auto refusal = [&](double ActionCosts::*field) {
      ActionCosts costs;
      costs.*field = bad;
      return error_of([&] { simulate(plan, costs); });
    };
    EXPECT_NE(
        refusal(&ActionCosts::forward)
            .find("expected finite, non-negative costs"),
        std::string::npos)
        << bad;
    EXPECT_NE(
        refusal(&ActionCosts::transfer)
            .find("expected a finite, non-negative transfer cost"),
        std::string::npos)
        << bad;
  }
}

// Cells that draw random numbers on CPU lanes hold the generators alone
// (Note [Random streams of concurrent cells]); the planner's simulation
// runs such actions beside no other holder of the lease.
TEST(PlanTest, ExclusiveHoldersOfTheLeaseRunAlone) {
  using detail::Held;
  using detail::Lease;
  for (const auto schedule : gpipe::schedules()) {
    SCOPED_TRACE(to_string(schedule));
    const auto plan = make_plan(schedule, 4, placement_for(schedule, 2));
    ActionCosts costs;
    costs.transfer = 0.25;
    // No lease, or only shared ones: the plain simulation, action for
    // action.
    const auto plain = simulate(plan, costs);
    for (const auto& free :
         {std::function<Held(const Cell&)>{},
          std::function<Held(const Cell&)>(
              [](const Cell&) { return Held{Lease::Shared}; })}) {
      const auto same = detail::simulate_with_lease(plan, costs, free);
      EXPECT_DOUBLE_EQ(same.makespan, plain.makespan);
      ASSERT_EQ(same.lanes.size(), plain.lanes.size());
      for (size_t l = 0; l < plain.lanes.size(); ++l) {
        ASSERT_EQ(same.lanes[l].size(), plain.lanes[l].size());
        for (size_t k = 0; k < plain.lanes[l].size(); ++k) {
          EXPECT_EQ(same.lanes[l][k].cell, plain.lanes[l][k].cell);
          EXPECT_DOUBLE_EQ(same.lanes[l][k].start, plain.lanes[l][k].start);
        }
      }
    }
    // Forwards exclusive, backwards without the lease: no forward beside
    // another, backwards beside forwards allowed.
    const auto lease = [](const Cell& c) {
      return Held{c.phase == Phase::Forward ? Lease::Exclusive : Lease::None};
    };
    const auto sim = detail::simulate_with_lease(plan, costs, lease);
    EXPECT_GT(sim.makespan, plain.makespan);
    std::vector<SimulatedAction> forwards;
    for (const auto& lane : sim.lanes) {
      for (const auto& a : lane) {
        if (a.cell.phase == Phase::Forward) {
          forwards.push_back(a);
        }
      }
    }
    for (const auto& a : forwards) {
      for (const auto& b : forwards) {
        if (!(a.cell == b.cell)) {
          EXPECT_FALSE(std::min(a.end, b.end) > std::max(a.start, b.start))
              << to_string(a.cell) << " beside " << to_string(b.cell);
        }
      }
    }
  }
  // A backward that holds the lease only while it recomputes (the first
  // half here) lets the other lane's forwards start before it ends.
  const auto plan = make_plan(Schedule::OneFOneB, 4, 2);
  const auto holding = [](double backward_hold) {
    return [backward_hold](const Cell& c) {
      if (c.phase == Phase::Forward) {
        return Held{Lease::Exclusive};
      }
      return c.phase == Phase::Backward ? Held{Lease::Exclusive, backward_hold}
                                        : Held{};
    };
  };
  const auto whole =
      detail::simulate_with_lease(plan, ActionCosts(), holding(-1)).makespan;
  const auto half =
      detail::simulate_with_lease(plan, ActionCosts(), holding(1.0)).makespan;
  EXPECT_LT(half, whole);
  EXPECT_GE(half, simulate(plan).makespan);
  // One lane: nothing beside anything, so the same time.
  const auto one = make_plan(Schedule::FillDrain, 3, 1);
  EXPECT_DOUBLE_EQ(
      detail::simulate_with_lease(
          one,
          ActionCosts(),
          [](const Cell&) { return Held{Lease::Exclusive}; })
          .makespan,
      simulate(one).makespan);
}

}  // namespace
}  // namespace gpipe

namespace gpipe {
namespace {

// Note [One table of actions]: an entry for every phase, in order, whose
// spelling CSV reads back, and whose cost field is what simulate charges.
TEST(PlanTest, OneTableDescribesEveryAction) {
  const auto& table = detail::action_table();
  ASSERT_EQ(table.size(), static_cast<size_t>(Phase::RecvBackward) + 1);
  for (size_t k = 0; k < table.size(); ++k) {
    const auto& a = table[k];
    EXPECT_EQ(static_cast<size_t>(a.phase), k);
    EXPECT_EQ(a.transfer, is_transfer(a.phase)) << a.letter;
    EXPECT_EQ(a.step, !a.transfer && a.phase != Phase::Loss) << a.letter;
    EXPECT_EQ(a.transfer, a.cost == nullptr) << a.letter;
    // Read back as written (a B stays a whole backward without its W).
    const auto read = Plan::from_csv(std::string("0") + a.read_as + "0\n");
    ASSERT_EQ(read.lanes.size(), 1u);
    EXPECT_EQ(read.lanes[0][0].phase, a.phase) << a.read_as;
  }
  // Each compute action and the loss priced by its own field.
  Plan plan;
  plan.micro_batches = 1;
  plan.stages = 1;
  plan.lanes = {
      {Cell{0, 0, Phase::Forward},
       Cell{0, 0, Phase::Loss},
       Cell{0, 0, Phase::BackwardInput},
       Cell{0, 0, Phase::BackwardWeight}}};
  ActionCosts costs;
  costs.forward = 1;
  costs.loss = 10;
  costs.backward_input = 100;
  costs.backward_weight = 1000;
  EXPECT_DOUBLE_EQ(simulate(plan, costs).makespan, 1111);
}

}  // namespace
}  // namespace gpipe
