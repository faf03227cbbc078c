// Placement (which lane runs each stage), plans that carry one, and the
// schedules that need one other than modulo: ZB-V and looped BFS. Pure
// data: no tensors.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <string>

#include "error_of.h"

namespace gpipe {
namespace {

using testing::error_of;

TEST(PlacementTest, ShapesAndLists) {
  const auto modulo = Placement::modulo(2, 2);
  EXPECT_EQ(modulo.lane_of_stage(), (std::vector<int64_t>{0, 1, 0, 1}));
  EXPECT_EQ(modulo.lanes(), 2);
  EXPECT_EQ(modulo.stages(), 4);
  EXPECT_EQ(modulo.stages_of(1), (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(modulo.is_modulo());
  EXPECT_FALSE(modulo.is_v_shape());
  EXPECT_EQ(to_string(modulo), "modulo(2 lanes, 2 stages per lane)");

  const auto v = Placement::v_shape(3);
  EXPECT_EQ(v.lane_of_stage(), (std::vector<int64_t>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(v.stages_of(0), (std::vector<int64_t>{0, 5}));
  EXPECT_TRUE(v.is_v_shape());
  EXPECT_FALSE(v.is_modulo());
  EXPECT_EQ(to_string(v), "v_shape(3 lanes)");
  // On one lane the V and modulo's two stages are one list: both named.
  EXPECT_EQ(
      to_string(Placement::v_shape(1)),
      "modulo(1 lane, 2 stages per lane) = v_shape(1 lane)");
  EXPECT_EQ(
      to_string(Placement::modulo(1, 2)),
      "modulo(1 lane, 2 stages per lane) = v_shape(1 lane)");

  const Placement listed({1, 0, 0});
  EXPECT_EQ(listed.lanes(), 2);
  EXPECT_EQ(listed.lane_of(0), 1);
  EXPECT_EQ(to_string(listed), "[1, 0, 0]");
  EXPECT_EQ(to_string(Placement()), "none");
  EXPECT_EQ(Placement::modulo(3), Placement({0, 1, 2}));
  EXPECT_NE(Placement::modulo(2, 2), Placement::v_shape(2));
  EXPECT_THROW(listed.lane_of(3), c10::IndexError);
  // A lane outside the placement is refused as a stage outside it is, not
  // answered with no stages.
  EXPECT_THROW(listed.stages_of(2), c10::IndexError);
  EXPECT_THROW(listed.stages_of(-1), c10::IndexError);
  EXPECT_THROW(Placement().stages_of(0), c10::IndexError);
}

TEST(PlacementTest, ShapesTooLargeAreRefusedNotOverflowed) {
  // lanes x stages_per_lane overflowed (a hang), 2 x lanes too (a crash),
  // and 2^40 stages ran out of memory: each is a ValueError now.
  const int64_t huge = int64_t{1} << 62;
  EXPECT_NE(
      error_of([&] {
        Placement::modulo(huge, 4);
      }).find("Placement::modulo: expected at most 1048576 stages"),
      std::string::npos)
      << error_of([&] { Placement::modulo(huge, 4); });
  EXPECT_THROW(Placement::modulo(int64_t{1} << 40), c10::ValueError);
  EXPECT_THROW(Placement::modulo(2, huge), c10::ValueError);
  EXPECT_NE(
      error_of([&] {
        Placement::v_shape(huge);
      }).find("Placement::v_shape: expected at most 524288 lanes"),
      std::string::npos)
      << error_of([&] { Placement::v_shape(huge); });
  EXPECT_EQ(Placement::modulo(1024, 1024).stages(), 1048576);
  EXPECT_EQ(Placement::v_shape(524288).stages(), 1048576);
  // A list as long: it was taken, and then printing it or is_modulo() said
  // 'Placement::modulo: expected at most 1048576 stages'.
  EXPECT_NE(
      error_of([&] {
        Placement(std::vector<int64_t>(1048577, 0));
      }).find("placement: expected at most 1048576 stages, but got 1048577"),
      std::string::npos);
  const Placement longest(std::vector<int64_t>(1048576, 0));
  EXPECT_TRUE(longest.is_modulo());
  EXPECT_EQ(to_string(longest), "modulo(1 lane, 1048576 stages per lane)");
}

TEST(PlacementTest, BadListsAreRefused) {
  EXPECT_NE(
      error_of([] {
        Placement({0, -1});
      })
          .find("expected a lane >= 0 for every stage, but stage 1 is on "
                "lane -1"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        Placement({0, 2, 2});
      }).find("lane 1 holds no stage, but lane 2 does"),
      std::string::npos);
  // A lane number beyond any the stages could fill, without a huge vector.
  EXPECT_NE(
      error_of([] {
        Placement({0, 999999999});
      })
          .find("stage 1 is on lane 999999999, but 2 stages can fill at "
                "most lanes 0 to 1"),
      std::string::npos);
  // One stage, in the singular ("1 stage fill" before).
  EXPECT_NE(
      error_of([] {
        Placement({1});
      }).find("but 1 stage can fill at most lanes 0 to 0"),
      std::string::npos);
  EXPECT_THROW(Placement::modulo(0), c10::ValueError);
  EXPECT_THROW(Placement::modulo(2, 0), c10::ValueError);
  EXPECT_THROW(Placement::v_shape(0), c10::ValueError);
}

TEST(PlacementTest, VerifyPlacementNamesBothSides) {
  EXPECT_NO_THROW(verify_placement(Placement::v_shape(2), 4, 2));
  EXPECT_NO_THROW(verify_placement(Placement::v_shape(2), 4));
  EXPECT_NE(
      error_of([] { verify_placement(Placement::v_shape(2), 6, 2, "me"); })
          .find("me: the placement v_shape(2 lanes) places 4 stages, but "
                "the pipeline has 6 stages"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        verify_placement(Placement::modulo(2, 2), 4, 4);
      }).find("uses 2 lanes, but the pipeline has 4 lanes"),
      std::string::npos);
  // One lane, said so.
  EXPECT_NE(
      error_of([] {
        verify_placement(Placement::modulo(2, 1), 2, 1);
      }).find("uses 2 lanes, but the pipeline has 1 lane"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        verify_placement(Placement(), 2);
      }).find("expected a placement of 2 stages, but got none"),
      std::string::npos);
  // -1 is any number of lanes; -5 was taken for it too.
  EXPECT_NE(
      error_of([] {
        verify_placement(Placement::modulo(2), 2, -5);
      }).find("expected a number of lanes >= 0 (or -1: any), but got -5"),
      std::string::npos);
}

TEST(PlacementTest, MakePlanCarriesThePlacement) {
  for (const auto& placement :
       {Placement::modulo(2, 2),
        Placement::v_shape(2),
        Placement({0, 0, 1, 1}),
        Placement({1, 0, 2, 2, 0, 1})}) {
    for (auto schedule :
         {Schedule::FillDrain,
          Schedule::OneFOneB,
          Schedule::ZeroBubble,
          Schedule::LoopedBFS}) {
      const auto plan = make_plan(schedule, 5, placement);
      EXPECT_EQ(plan.placement, placement);
      ASSERT_NO_THROW(plan.validate()) << to_string(schedule);
      for (int64_t j = 0; j < placement.stages(); ++j) {
        EXPECT_EQ(plan.lane_of(j), placement.lane_of(j));
      }
      for (size_t l = 0; l < plan.lanes.size(); ++l) {
        for (const auto& c : plan.lanes[l]) {
          EXPECT_EQ(placement.lane_of(c.partition), static_cast<int64_t>(l));
        }
      }
    }
  }
  // The (lanes, stages per lane) overload: modulo, or ZB-V's V.
  EXPECT_EQ(
      make_plan(Schedule::OneFOneB, 3, 2, 2).placement,
      Placement::modulo(2, 2));
  EXPECT_EQ(
      make_plan(Schedule::ZeroBubbleV, 3, 2, 2).placement,
      Placement::v_shape(2));
}

TEST(PlacementTest, SchedulesRefusePlacementsTheyCannotRun) {
  EXPECT_NE(
      error_of([] {
        make_plan(Schedule::ZeroBubbleV, 4, Placement::modulo(2, 2));
      }).find("zero_bubble_v runs on Placement::v_shape"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        make_plan(Schedule::ZeroBubbleV, 4, 2, 1);
      }).find("zero_bubble_v runs 2 stages on each lane"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        make_plan(Schedule::Interleaved1F1B, 4, Placement::v_shape(2));
      }).find("interleaved runs the same number of stages on every lane"),
      std::string::npos);
  // The message says what interleaved needs: a placement that is stage j
  // on lane j % lanes, but with one lane holding fewer stages, is refused
  // for that.
  EXPECT_NE(
      error_of([] {
        make_plan(Schedule::Interleaved1F1B, 3, Placement({0, 1, 2, 0, 1}));
      }).find("the same number of stages on every lane"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        lane_order(Schedule::ZeroBubbleV, 4, 4, 0);
      }).find("zero_bubble_v runs on Placement::v_shape"),
      std::string::npos);
  EXPECT_THROW(make_plan(Schedule::FillDrain, 4, Placement()), c10::ValueError);
  EXPECT_EQ(schedule_from_string("zero_bubble_v"), Schedule::ZeroBubbleV);
  EXPECT_EQ(schedule_from_string("looped_bfs"), Schedule::LoopedBFS);
  EXPECT_EQ(to_string(Schedule::LoopedBFS), "looped_bfs");
}

// Every schedule comes from one table (src/schedule/schedules.def): the
// list, the names, each one's placement and its plan agree.
TEST(PlacementTest, EverySchedulePlacesItselfAndRunsThere) {
  const std::vector<Schedule> expected{
      Schedule::FillDrain,
      Schedule::OneFOneB,
      Schedule::Interleaved1F1B,
      Schedule::ZeroBubble,
      Schedule::ZeroBubbleV,
      Schedule::LoopedBFS};
  EXPECT_EQ(gpipe::schedules(), expected);
  for (const auto s : gpipe::schedules()) {
    SCOPED_TRACE(to_string(s));
    EXPECT_EQ(schedule_from_string(to_string(s)), s);
    for (int64_t lanes : {1, 2, 3}) {
      const auto own = placement_for(s, lanes);
      EXPECT_EQ(own.lanes(), lanes);
      const bool two = s == Schedule::Interleaved1F1B ||
                       s == Schedule::LoopedBFS || s == Schedule::ZeroBubbleV;
      EXPECT_EQ(own.stages(), (two ? 2 : 1) * lanes);
      EXPECT_EQ(
          own,
          s == Schedule::ZeroBubbleV ? Placement::v_shape(lanes)
                                     : Placement::modulo(lanes, two ? 2 : 1));
      // The schedule runs where it places itself, for any micro-batches.
      for (int64_t m : {1, 4, 7}) {
        const auto plan = make_plan(s, m, own);
        EXPECT_EQ(plan.placement, own);
        EXPECT_NO_THROW(plan.validate());
      }
    }
    if (s != Schedule::ZeroBubbleV) {
      EXPECT_EQ(placement_for(s, 2, 3), Placement::modulo(2, 3));
      EXPECT_EQ(make_plan(s, 4, 2, 3).placement, Placement::modulo(2, 3));
    }
  }
  EXPECT_EQ(placement_for(Schedule::ZeroBubbleV, 3, 2), Placement::v_shape(3));
  EXPECT_NE(
      error_of([] {
        placement_for(Schedule::ZeroBubbleV, 2, 3);
      }).find("zero_bubble_v runs 2 stages on each lane"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        placement_for(Schedule::FillDrain, 0);
      }).find("expected lanes >= 1, but got 0"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        placement_for(Schedule::OneFOneB, 2, -1);
      }).find("expected stages_per_lane >= 0"),
      std::string::npos);
  EXPECT_THROW(placement_for(Schedule::FillDrain, 0), c10::ValueError);
  EXPECT_THROW(placement_for(static_cast<Schedule>(99), 2), c10::ValueError);
}

TEST(PlacementTest, ValidateChecksCellsAgainstThePlacement) {
  auto plan = make_plan(Schedule::FillDrain, 2, Placement::v_shape(2));
  plan.placement = Placement::modulo(2, 2);
  EXPECT_NE(
      error_of([&] { plan.validate(); })
          .find("but the plan's placement modulo(2 lanes, 2 stages per lane) "
                "puts stage 3 on lane 1"),
      std::string::npos)
      << error_of([&] { plan.validate(); });
  plan.placement = Placement::v_shape(3);
  EXPECT_NE(
      error_of([&] { plan.validate(); })
          .find("its placement v_shape(3 lanes) places 6 stages, but the plan "
                "has 4 stages"),
      std::string::npos)
      << error_of([&] { plan.validate(); });
  // The plan's own rows, not a pipeline, are what a plan is checked
  // against.
  plan.placement = Placement({0, 1, 2, 0});
  EXPECT_NE(
      error_of([&] {
        plan.validate();
      }).find("uses 3 lanes, but the plan has 2 rows (lanes)"),
      std::string::npos)
      << error_of([&] { plan.validate(); });
  plan.placement = {};
  EXPECT_NO_THROW(plan.validate());
}

TEST(PlacementTest, CsvRoundTripKeepsThePlacement) {
  const auto plan = make_plan(Schedule::ZeroBubbleV, 4, Placement::v_shape(2));
  const auto csv = plan.to_csv();
  EXPECT_EQ(csv.rfind("# placement: 0 1 1 0\n", 0), 0u) << csv;
  const auto back = Plan::from_csv(csv);
  EXPECT_EQ(back.placement, plan.placement);
  EXPECT_EQ(back.to_csv(), csv);
  EXPECT_NO_THROW(back.validate());
  EXPECT_EQ(back.lanes.size(), 2u);

  // Modulo needs no line: the rows show it.
  const auto modulo = make_plan(Schedule::OneFOneB, 3, 2, 2);
  EXPECT_EQ(modulo.to_csv().find('#'), std::string::npos);
  EXPECT_EQ(Plan::from_csv(modulo.to_csv()).placement, modulo.placement);

  // A placement line beats the rows, so a plan for 0 micro-batches keeps
  // its placement too; comments are skipped.
  const auto empty = make_plan(Schedule::FillDrain, 0, Placement({1, 0}));
  const auto read = Plan::from_csv("# a comment\n" + empty.to_csv());
  EXPECT_EQ(read.placement, Placement({1, 0}));
  EXPECT_EQ(read.lanes.size(), 2u);
  EXPECT_EQ(read.stages, 2);
  EXPECT_NO_THROW(read.validate());
  // A placement the rows contradict: validate names it, and the unit steps
  // and the printed table follow the rows, not the placement.
  const auto contradicted = Plan::from_csv("# placement: 1 0\n0F0\n1F0\n");
  EXPECT_THROW(contradicted.validate(), c10::ValueError);
  EXPECT_EQ(contradicted.steps().size(), 2u);
  const auto short_rows = Plan::from_csv("# placement: 0 1\n0F0,1F0\n");
  EXPECT_EQ(short_rows.steps().size(), 2u);
  std::ostringstream table;
  table << short_rows;
  EXPECT_NE(table.str().find("lane 0 | 0F0 1F0"), std::string::npos)
      << table.str();
  // with_transfers keeps the placement.
  EXPECT_EQ(
      make_plan(Schedule::ZeroBubbleV, 2, 2, 2).with_transfers().placement,
      Placement::v_shape(2));

  EXPECT_NE(
      error_of([] {
        Plan::from_csv("# placement: 0 x\n0F0\n");
      }).find("row 1: expected the lane of each stage after '# placement:'"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("# placement: 0 2\n0F0\n");
      }).find("row 1: placement: stage 1 is on lane 2"),
      std::string::npos);
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("# placement: 0 1\n# placement: 0 1\n0F0\n");
      }).find("row 2: a second placement line"),
      std::string::npos);
  // After the rows it was taken (the format puts it first).
  EXPECT_NE(
      error_of([] { Plan::from_csv("0F0,0B0\n1F0,1B0\n# placement: 1 0\n"); })
          .find("row 3: the placement line comes after the actions of 2 lanes; "
                "it must come before them"),
      std::string::npos);
  // Blank rows above it are not lanes (the format puts it first).
  EXPECT_EQ(
      Plan::from_csv("\n \n# placement: 1 0\n1F0,1B0\n0F0,0B0\n").to_csv(),
      Plan::from_csv("# placement: 1 0\n1F0,1B0\n0F0,0B0\n").to_csv());
  EXPECT_EQ(
      Plan::from_csv("\n\n# placement: 1 0\n1F0,1B0\n0F0,0B0\n").lanes.size(),
      2u);
  EXPECT_NE(
      error_of([] {
        Plan::from_csv("0F0,0B0\n\n# placement: 0\n");
      }).find("row 3: the placement line comes after the actions of 2 lanes"),
      std::string::npos);
  // A placement line of another length than the actions' stages.
  EXPECT_NE(
      error_of([] {
        Plan::from_csv(
            "# placement: 0 1 1\n0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
      })
          .find("the placement line places 3 stages, but the actions are "
                "those of 2 stages (0 to 1)"),
      std::string::npos);
  EXPECT_THROW(Plan::from_csv("# placement: 0\n0F0,1F0\n"), c10::ValueError);
  // A plan of no micro-batches keeps the stages its placement names.
  EXPECT_EQ(Plan::from_csv("# placement: 0 1\n").stages, 2);
  // A stage whose cells are on two rows: no placement is made up.
  EXPECT_TRUE(Plan::from_csv("0F0\n0B0\n").placement.empty());
  // ... and its lanes are listed though they have no cells.
  EXPECT_EQ(Plan::from_csv("# placement: 0 1\n").lanes.size(), 2u);
}

TEST(PlacementTest, BlankLinesAtTheEndOfACsvAreNotLanes) {
  // A here-document's or an editor's last newline made a third, empty
  // lane, and the placement the rows show was lost.
  const auto plan = Plan::from_csv("0F0,0B0\n1F0,1B0\n\n\n");
  EXPECT_EQ(plan.lanes.size(), 2u);
  EXPECT_EQ(plan.placement, Placement::modulo(2));
  EXPECT_NO_THROW(plan.validate());
  // A blank line between rows is still an empty lane (train_step's refusal
  // says so: SchedulesTrainTest).
  EXPECT_EQ(Plan::from_csv("\n0F0,0B0\n1F0,1B0\n").lanes.size(), 3u);
  // The plan of 0 micro-batches of training_plan keeps its 3 stages and
  // lanes through the CSV (it came back with none).
  for (const auto schedule : {Schedule::FillDrain, Schedule::ZeroBubble}) {
    const auto empty = training_plan(schedule, 0, 3);
    const auto back = Plan::from_csv(empty.to_csv());
    EXPECT_EQ(back.stages, 3) << empty.to_csv();
    EXPECT_EQ(back.lanes.size(), 3u) << empty.to_csv();
    EXPECT_EQ(back.placement, Placement::modulo(3));
  }
}

TEST(PlacementTest, AMisspeltPlacementLineIsRefusedNotIgnored) {
  // Each was read as a comment, and the rows' placement used instead.
  for (const char* line :
       {"#placement: 1 0 0 1",
        "# Placement: 1 0 0 1",
        "# placement 1 0 0 1",
        "#  PLACEMENT:1 0 0 1"}) {
    const auto message = error_of(
        [&] { Plan::from_csv(std::string(line) + "\n0F0,3F0\n1F0,2F0\n"); });
    EXPECT_NE(
        message.find("row 1: expected a placement line as '# placement: 0 1 "
                     "1 0'"),
        std::string::npos)
        << line << " -> " << message;
  }
  // Comments that only mention the word stay comments.
  EXPECT_NO_THROW(
      Plan::from_csv("# placements are v-shaped\n# the placement "
                     "below\n0F0\n"));
  // A control character in a quoted field is shown, not the end of the
  // message.
  const auto message =
      error_of([] { Plan::from_csv(std::string("0F\0x1,0B0\n", 9)); });
  EXPECT_NE(message.find("'0F\\x00x1'"), std::string::npos) << message;
}

// 1F1B on n lanes of one stage each (F 2, B 4: a stage is two of ZB-V's
// halves) against ZB-V on the same lanes (F, B and W of 1 per half).
TEST(PlacementTest, ZeroBubbleVFillsTheBubbleAtOneFOneBsMemory) {
  const int64_t n = 4;
  const int64_t m = 8;
  ActionCosts whole;
  whole.forward = 2;
  whole.backward = 4;
  const auto one_f_one_b = simulate(make_plan(Schedule::OneFOneB, m, n), whole);
  EXPECT_DOUBLE_EQ(one_f_one_b.bubble, 6.0 * (n - 1));
  ActionCosts halves;
  halves.forward = 1;
  halves.backward_input = 1;
  halves.backward_weight = 1;
  const auto zbv = simulate(make_plan(Schedule::ZeroBubbleV, m, n, 2), halves);
  // A V's own fill: (n - 1) forwards of a half, a sixth of 1F1B's bubble.
  EXPECT_DOUBLE_EQ(zbv.bubble, 1.0 * (n - 1));
  EXPECT_LE(zbv.bubble, 0.2 * one_f_one_b.bubble);
  // Memory: a lane holds at most 2n halves, 1F1B's first lane's n stages.
  for (auto p : zbv.lane_peak_live) {
    EXPECT_LE(p, 2 * n);
  }
  EXPECT_EQ(
      *std::max_element(
          one_f_one_b.lane_peak_live.begin(), one_f_one_b.lane_peak_live.end()),
      n);
}

TEST(PlacementTest, ZeroBubbleVRunsForAnySizes) {
  for (int64_t n = 1; n <= 6; ++n) {
    for (int64_t m = 0; m <= 20; ++m) {
      const auto plan = make_plan(Schedule::ZeroBubbleV, m, n, 2);
      ASSERT_NO_THROW(plan.validate()) << "n " << n << " m " << m;
      size_t cells = 0;
      for (const auto& lane : plan.lanes) {
        for (const auto& c : lane) {
          cells += c.phase == Phase::Loss ? 0 : 1;
        }
      }
      // F, B and W of every micro-batch on every stage.
      EXPECT_EQ(cells, static_cast<size_t>(3 * m * 2 * n));
    }
  }
}

TEST(PlacementTest, LoopedBfsRunsEachStageBreadthFirst) {
  const auto plan = make_plan(Schedule::LoopedBFS, 2, 2, 2);
  // Lane 0 holds stages 0 and 2: every forward of 0, then of 2, then the
  // backwards, stage 2 first, micro-batches in reverse.
  std::string row;
  for (const auto& c : plan.lanes[0]) {
    row += to_string(c) + " ";
  }
  EXPECT_EQ(row, "F(0,0) F(1,0) F(0,2) F(1,2) B(1,2) B(0,2) B(1,0) B(0,0) ");
  const auto lane1 = plan.lanes[1];
  // Stage 3 is the last: losses follow its forwards.
  EXPECT_EQ(to_string(lane1[3]), "L(0,3)");
  // One stage per lane: fill-drain's order.
  EXPECT_EQ(
      make_plan(Schedule::LoopedBFS, 3, 3, 1).to_csv(),
      make_plan(Schedule::FillDrain, 3, 3).to_csv());
  for (int64_t n = 1; n <= 4; ++n) {
    for (int64_t v = 1; v <= 3; ++v) {
      for (int64_t m = 0; m <= 9; ++m) {
        ASSERT_NO_THROW(make_plan(Schedule::LoopedBFS, m, n, v).validate());
      }
    }
  }
}

}  // namespace
}  // namespace gpipe
