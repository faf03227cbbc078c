// gpipe::Trace: what the engine records, and the JSON and SVG it writes.

#include <gpipe/gpipe.h>
#include <gpipe/models/timed.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "common.h"
#include "error_of.h"

namespace gpipe {
namespace {

using testing::SeededTest;

class TraceTest : public SeededTest {};

torch::nn::Sequential linears() {
  return torch::nn::Sequential(
      torch::nn::Linear(8, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      torch::nn::Tanh());
}

int64_t count(const std::vector<TraceEvent>& events, TraceKind kind) {
  return std::count_if(events.begin(), events.end(), [kind](const auto& e) {
    return e.kind == kind;
  });
}

TEST_F(TraceTest, SummaryCountsEachLanesWorkOnce) {
  Trace trace;
  auto add = [&](int64_t lane, TraceKind kind, double start, double end) {
    trace.add(TraceEvent{lane, 0, kind, start, end});
  };
  // Lane 0: two overlapping intervals (0 to 15), a gap, one with another
  // inside it (20 to 30): 25 us of work.
  add(0, TraceKind::Forward, 0, 10);
  add(0, TraceKind::Recompute, 5, 15);
  add(0, TraceKind::Backward, 20, 30);
  add(0, TraceKind::Copy, 22, 25);
  // Lane 1: a wait for another rank (not work), then 30 us of work, the
  // last interval touching the one before it.
  add(1, TraceKind::Receive, 0, 10);
  add(1, TraceKind::Forward, 10, 30);
  add(1, TraceKind::Weight, 30, 40);
  // Lane 2: only waits.
  add(2, TraceKind::Send, 35, 40);
  const auto summary = trace.summary();
  EXPECT_DOUBLE_EQ(summary.span, 40e-6);
  ASSERT_EQ(summary.busy.size(), 3u);
  EXPECT_DOUBLE_EQ(summary.busy[0], 25e-6);
  EXPECT_DOUBLE_EQ(summary.busy[1], 30e-6);
  EXPECT_DOUBLE_EQ(summary.busy[2], 0.0);
  EXPECT_NEAR(summary.bubble, 40e-6 - 55e-6 / 3, 1e-15);
  EXPECT_NEAR(summary.bubble_fraction, summary.bubble / 40e-6, 1e-12);

  // A trace of one rank's row (here row 3, as a PipelineStage on rank 3
  // records it) is measured over that row alone, not over rows 0 to 2.
  trace.clear();
  add(3, TraceKind::Receive, -5, 0);  // a wait that began before the clock
  add(3, TraceKind::Forward, 0, 10);
  add(3, TraceKind::Backward, 15, 20);
  const auto rank = trace.summary();
  EXPECT_DOUBLE_EQ(rank.span, 25e-6);
  ASSERT_EQ(rank.busy.size(), 4u);
  EXPECT_DOUBLE_EQ(rank.busy[3], 15e-6);
  EXPECT_NEAR(rank.bubble, 10e-6, 1e-15);

  trace.clear();
  const auto empty = trace.summary();
  EXPECT_EQ(empty.span, 0.0);
  EXPECT_TRUE(empty.busy.empty());
  EXPECT_EQ(empty.bubble, 0.0);
  EXPECT_EQ(empty.bubble_fraction, 0.0);
}

// One event on lane 2^20 - 1 (a lane add() takes) drew a row for every
// lane below it: an SVG of 135 MB.
TEST_F(TraceTest, PicturesOfFewEventsOnHighLanesStaySmall) {
  Trace trace;
  trace.add(TraceEvent{3, 0, TraceKind::Forward, 0, 1});
  trace.add(TraceEvent{(int64_t{1} << 20) - 1, 1, TraceKind::Backward, 1, 2});
  const auto svg = trace.svg();
  EXPECT_LT(svg.size(), 10000u);
  EXPECT_NE(svg.find("on 2 lanes with events, of 1048576,"), std::string::npos)
      << svg;
  EXPECT_NE(svg.find(">lane 3</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">lane 1048575</text>"), std::string::npos) << svg;
  EXPECT_EQ(svg.find(">lane 0</text>"), std::string::npos) << svg;
  const auto json = trace.chrome_json();
  EXPECT_LT(json.size(), 10000u);
  EXPECT_NE(json.find("\"lane 1048575\""), std::string::npos) << json;
  // Up to 1024 lanes every one gets a row, idle or not.
  Trace few;
  few.add(TraceEvent{2, 0, TraceKind::Forward, 0, 1});
  EXPECT_NE(few.svg().find(">lane 1</text>"), std::string::npos);
  EXPECT_NE(few.svg().find("on 3 lanes,"), std::string::npos);
}

TEST_F(TraceTest, AddRejectsABadEvent) {
  Trace trace;
  EXPECT_THROW(
      trace.add(TraceEvent{-1, 0, TraceKind::Forward, 0, 1}), c10::IndexError);
  try {
    trace.add(TraceEvent{0, 0, TraceKind::Forward, 5, 4});
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("start_us 5 and end_us 4"),
        std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(trace.events().empty());
  EXPECT_EQ(trace.summary().span, 0.0);
  // Times that are not finite, and lanes so high that the picture would
  // take gigabytes, were taken; record() asserted on a negative lane.
  EXPECT_THROW(
      trace.add(TraceEvent{0, 0, TraceKind::Forward, 0, INFINITY}),
      c10::ValueError);
  EXPECT_THROW(
      trace.add(TraceEvent{3000000, 0, TraceKind::Forward, 0, 1}),
      c10::IndexError);
  const auto now = std::chrono::steady_clock::now();
  EXPECT_THROW(
      trace.record(-1, 0, TraceKind::Forward, now, now), c10::IndexError);
  // A kind outside the enum was drawn as "unknown".
  try {
    trace.add(TraceEvent{0, 0, static_cast<TraceKind>(42), 0, 1});
    FAIL() << "expected c10::ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("got 42"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(
      trace.record(0, 0, static_cast<TraceKind>(-1), now, now),
      c10::ValueError);
  EXPECT_THROW(
      trace.record(
          0, 0, TraceKind::Forward, now, now - std::chrono::milliseconds(5)),
      c10::ValueError);
  // A stage is -1 (none) or a stage's number.
  TraceEvent no_stage{0, 0, TraceKind::Forward, 0, 1};
  no_stage.stage = -2;
  EXPECT_THROW(trace.add(no_stage), c10::IndexError);
  EXPECT_THROW(
      trace.record(0, 0, TraceKind::Forward, now, now, false, -2),
      c10::IndexError);
  EXPECT_TRUE(trace.events().empty());
}

// A row label is the user's text: escaped in both files (a label with <, &
// or " made the SVG and the JSON unreadable), its column as wide as it
// needs, and named as given in the title ("12 pipeline-stages" before).
TEST_F(TraceTest, ARowLabelIsEscapedAndFitsItsColumn) {
  Trace trace;
  trace.add(TraceEvent{0, 0, TraceKind::Forward, 0, 10});
  trace.add(TraceEvent{1, 0, TraceKind::Forward, 10, 20});
  trace.set_row_label("GPU<0> & \"stage\"");
  const auto json = trace.chrome_json();
  EXPECT_NE(
      json.find("\"name\":\"GPU<0> & \\\"stage\\\" 1\""), std::string::npos)
      << json;
  const auto svg = trace.svg();
  EXPECT_NE(
      svg.find(">GPU&lt;0&gt; &amp; &quot;stage&quot; 1</text>"),
      std::string::npos)
      << svg;
  EXPECT_NE(
      svg.find("on 2 rows (GPU&lt;0&gt; &amp; &quot;stage&quot;)"),
      std::string::npos)
      << svg;
  EXPECT_EQ(svg.find("GPU<0>"), std::string::npos) << svg;
  // The boxes start right of the longest label (18 characters here).
  EXPECT_NE(svg.find("<rect x=\"125\""), std::string::npos) << svg;
  trace.set_row_label("lane");
  EXPECT_NE(trace.svg().find("on 2 lanes,"), std::string::npos);
}

TEST_F(TraceTest, SummaryOfAStepOnFixedCostLayers) {
  // 2 lanes, 2 micro-batches, fill-drain; each layer waits 2 ms in forward
  // and in backward. Each lane works at least its layers' time, and
  // its first and last cells leave it idle at least one cell's time.
  const auto part = std::chrono::microseconds(2000);
  torch::nn::Sequential net;
  for (int k = 0; k < 2; ++k) {
    net->push_back(models::TimedLayer(4, models::TimedCosts{part, part, part}));
  }
  GPipe model(
      net, GPipeOptions({1, 1}).chunks(2).checkpoint(Checkpoint::Never));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->train_step(
      torch::randn({4, 4}).requires_grad_(true),
      torch::randn({4, 4}),
      [](auto y, auto t) { return torch::mse_loss(y, t); },
      Schedule::FillDrain);
  model->set_trace(nullptr);
  const auto summary = trace->summary();
  ASSERT_EQ(summary.busy.size(), 2u);
  const double cell_forward = 2e-3;
  const double cell_backward = 4e-3;  // input and weight parts
  for (double busy : summary.busy) {
    EXPECT_GE(busy, 2 * (cell_forward + cell_backward));
    EXPECT_LE(busy, summary.span);
  }
  // Lane 1 waits for lane 0's first forward, lane 0 for lane 1's last
  // backward.
  EXPECT_GE(summary.bubble, cell_forward / 2 + cell_backward / 2);
  EXPECT_GE(summary.span, 2 * (cell_forward + cell_backward) + cell_forward);
  EXPECT_NEAR(
      summary.bubble,
      summary.span - (summary.busy[0] + summary.busy[1]) / 2,
      1e-12);
}

TEST_F(TraceTest, RecordsEveryCellOfATrainingStep) {
  GPipe model(
      linears(),
      GPipeOptions({2, 2}).chunks(4).checkpoint(Checkpoint::ExceptLast));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  EXPECT_EQ(model->trace(), trace);
  auto x = torch::randn({8, 8});
  model->forward(x).sum().backward();
  model->set_trace(nullptr);
  model->forward(x).sum().backward();  // not recorded

  const auto events = trace->events();
  EXPECT_EQ(count(events, TraceKind::Forward), 8);
  EXPECT_EQ(count(events, TraceKind::Backward), 8);
  EXPECT_EQ(count(events, TraceKind::Recompute), 6);  // 3 per partition
  EXPECT_EQ(count(events, TraceKind::Copy), 0);       // all on the CPU
  for (const auto& e : events) {
    EXPECT_GE(e.end_us, e.start_us);
    EXPECT_TRUE(e.lane == 0 || e.lane == 1);
    EXPECT_TRUE(e.micro_batch >= 0 && e.micro_batch < 4);
  }
  // A lane runs one cell at a time, and a micro-batch's forward on lane 1
  // starts after it ended on lane 0.
  for (int64_t lane : {0, 1}) {
    double last_end = -1;
    for (const auto& e : events) {
      if (e.lane == lane) {
        EXPECT_GE(e.start_us, last_end);
        last_end = e.end_us;
      }
    }
  }
  for (int64_t i = 0; i < 4; ++i) {
    double end0 = -1, start1 = -1;
    for (const auto& e : events) {
      if (e.kind == TraceKind::Forward && e.micro_batch == i) {
        (e.lane == 0 ? end0 : start1) = e.lane == 0 ? e.end_us : e.start_us;
      }
    }
    EXPECT_GE(start1, end0) << "micro-batch " << i;
  }
}

// A lane that holds two stages (interleaved: stages 0 and 2 on lane 0)
// records each cell with its stage, which tells them apart; the pictures
// name it.
TEST_F(TraceTest, EachCellIsRecordedWithItsStage) {
  torch::nn::Sequential net;
  for (int k = 0; k < 4; ++k) {
    net->push_back(torch::nn::Linear(4, 4));
  }
  GPipe model(
      net,
      GPipeOptions({1, 1, 1, 1})
          .chunks(4)
          .stages_per_lane(2)
          .checkpoint(Checkpoint::Always));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->train_step(
      torch::randn({8, 4}),
      torch::randn({8, 4}),
      [](torch::Tensor y, torch::Tensor t) { return torch::mse_loss(y, t); },
      Schedule::Interleaved1F1B);
  std::map<std::tuple<int32_t, int64_t, TraceKind>, int> cells;
  for (const auto& e : trace->events()) {
    ASSERT_GE(e.stage, 0) << to_string(e.kind);
    EXPECT_EQ(e.stage % 2, e.lane) << to_string(e.kind);
    ++cells[{e.stage, e.micro_batch, e.kind}];
  }
  for (int32_t j = 0; j < 4; ++j) {
    for (int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ((cells[{j, i, TraceKind::Forward}]), 1) << j << " " << i;
      EXPECT_EQ((cells[{j, i, TraceKind::Recompute}]), 1) << j << " " << i;
      EXPECT_EQ((cells[{j, i, TraceKind::Backward}]), 1) << j << " " << i;
      EXPECT_EQ((cells[{j, i, TraceKind::Loss}]), j == 3 ? 1 : 0);
    }
  }
  EXPECT_NE(
      trace->svg().find("forward micro-batch 1 of stage 2"), std::string::npos);
  EXPECT_NE(trace->chrome_json().find("\"stage\":3"), std::string::npos);
}

// The guide's figures for a trace's growth: 48 bytes an event, and about
// 100 events per 1F1B step on 4 lanes at 8 micro-batches (the default
// except_last: 32 forwards, 32 backwards, 28 recomputations, 8 losses).
TEST_F(TraceTest, AStepsEventsAreAsTheGuideCountsThem) {
  EXPECT_EQ(sizeof(TraceEvent), 48u);
  torch::nn::Sequential net;
  for (int k = 0; k < 4; ++k) {
    net->push_back(torch::nn::Linear(4, 4));
  }
  GPipe model(net, GPipeOptions({1, 1, 1, 1}).chunks(8));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->train_step(
      torch::randn({8, 4}),
      torch::randn({8, 4}),
      [](torch::Tensor y, torch::Tensor t) { return torch::mse_loss(y, t); },
      Schedule::OneFOneB);
  EXPECT_EQ(trace->events().size(), 100u);
}

TEST_F(TraceTest, ChromeJsonHasOneCompleteEventPerInterval) {
  GPipe model(linears(), GPipeOptions({1, 3}).chunks(2));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->train_step(
      torch::randn({4, 8}),
      torch::randn({4, 8}),
      [](torch::Tensor y, torch::Tensor t) { return torch::mse_loss(y, t); },
      Schedule::OneFOneB);
  const auto events = trace->events();
  auto json = nlohmann::json::parse(trace->chrome_json());
  int64_t complete = 0;
  int64_t names = 0;
  for (const auto& e : json["traceEvents"]) {
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      EXPECT_TRUE(e["args"].contains("micro_batch"));
    } else if (e["ph"] == "M") {
      ++names;
    }
  }
  EXPECT_EQ(complete, static_cast<int64_t>(events.size()));
  EXPECT_EQ(names, 2);  // one per lane
}

// A trace gathered from ranks holds times before rank 0's origin: the
// Chrome trace had negative timestamps. And receive and recompute were
// both "R<micro-batch>".
TEST_F(TraceTest, ChromeJsonStartsAtZeroAndNamesEveryKindApart) {
  Trace trace;
  trace.add(TraceEvent{0, 0, TraceKind::Receive, -150.0, -100.0});
  trace.add(TraceEvent{0, 0, TraceKind::Recompute, -90.0, -50.0});
  trace.add(TraceEvent{1, 1, TraceKind::Forward, 10.0, 20.0});
  const auto json = nlohmann::json::parse(trace.chrome_json());
  std::vector<std::pair<std::string, double>> got;
  for (const auto& e : json["traceEvents"]) {
    if (e["ph"] == "X") {
      got.emplace_back(e["name"].get<std::string>(), e["ts"].get<double>());
    }
  }
  const std::vector<std::pair<std::string, double>> expected{
      {"recv 0", 0.0}, {"R0", 60.0}, {"F1", 160.0}};
  EXPECT_EQ(got, expected);
}

TEST_F(TraceTest, AShortTraceIsLabelledInMicroseconds) {
  // A 7 us trace read "0.00 ms, 0.00 ms, 0.00 ms, 0.01 ms, 0.01 ms".
  Trace trace;
  trace.add(TraceEvent{0, 0, TraceKind::Forward, 100.0, 104.0});
  trace.add(TraceEvent{1, 0, TraceKind::Backward, 104.0, 107.0});
  const auto svg = trace.svg();
  EXPECT_NE(svg.find(">0.0 us</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">7.0 us</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(", 7.0 us</text>"), std::string::npos) << svg;
  EXPECT_EQ(svg.find(" ms<"), std::string::npos) << svg;
  // The times of the intervals are on the axis's scale, from the earliest
  // start whatever the order of the events (a gathered trace of ranks read
  // "receive micro-batch 0, -256.367--249.887 ms" on an axis from 0).
  EXPECT_NE(
      svg.find("backward micro-batch 0, 4.0-7.0 us</title>"), std::string::npos)
      << svg;
  Trace gathered;
  gathered.add(TraceEvent{1, 0, TraceKind::Backward, -2.0, 1.0});
  gathered.add(TraceEvent{0, 0, TraceKind::Forward, -6.0, -2.0});
  const auto gathered_svg = gathered.svg();
  EXPECT_NE(
      gathered_svg.find("forward micro-batch 0, 0.0-4.0 us</title>"),
      std::string::npos)
      << gathered_svg;
  EXPECT_NE(gathered_svg.find("<rect x=\"70.00\""), std::string::npos)
      << gathered_svg;
  // A rank's wait at the end of a pass for its sends is no one
  // micro-batch's: it read "send micro-batch 0".
  gathered.add(TraceEvent{0, -1, TraceKind::Send, 1.0, 3.0});
  EXPECT_NE(
      gathered.svg().find("send (every send of the pass), 7.0-9.0 us"),
      std::string::npos)
      << gathered.svg();
  const auto json = gathered.chrome_json();
  EXPECT_NE(json.find("\"name\":\"send of the pass\""), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"args\":{}"), std::string::npos) << json;
  gathered.add(TraceEvent{1, -1, TraceKind::Receive, 1.0, 2.0});
  EXPECT_NE(
      gathered.svg().find("receive of the pass, 7.0-8.0 us"), std::string::npos)
      << gathered.svg();
  EXPECT_THROW(
      gathered.add(TraceEvent{0, -2, TraceKind::Send, 1.0, 3.0}),
      c10::IndexError);
  // A longer one stays in ms.
  trace.add(TraceEvent{0, 1, TraceKind::Forward, 107.0, 2107.0});
  EXPECT_NE(trace.svg().find(">2.01 ms</text>"), std::string::npos)
      << trace.svg();
  // One of a second or more in s (three hours read "10800000.00 ms").
  trace.add(TraceEvent{1, 1, TraceKind::Backward, 2107.0, 100.0 + 3 * 3600e6});
  const auto long_svg = trace.svg();
  EXPECT_NE(long_svg.find(", 10800.00 s</text>"), std::string::npos)
      << long_svg;
  EXPECT_NE(long_svg.find(">2700.00 s</text>"), std::string::npos) << long_svg;
  EXPECT_EQ(long_svg.find(" ms<"), std::string::npos) << long_svg;
  // The title gives the span as it is, not the 1 us the drawing takes at
  // least (a trace of 0.001 us said "1.0 us").
  Trace tiny;
  tiny.add(TraceEvent{0, 0, TraceKind::Forward, 5.0, 5.001});
  EXPECT_NE(tiny.svg().find(", 0.0 us</text>"), std::string::npos)
      << tiny.svg();
}

TEST_F(TraceTest, SvgDrawsEveryIntervalAndWritesFiles) {
  GPipe model(linears(), GPipeOptions({2, 2}).chunks(3));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  model->forward(torch::randn({6, 8})).sum().backward();
  const auto svg = trace->svg();
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  size_t titles = 0;
  for (size_t at = svg.find("<title>"); at != std::string::npos;
       at = svg.find("<title>", at + 1)) {
    ++titles;
  }
  EXPECT_EQ(titles, trace->events().size());
  // The time axis's last label ends where the axis does, inside the
  // picture (centred there, its right half was cut off).
  // (In ms, or in us for a trace shorter than 1 ms.)
  const auto last_label = std::max(
      svg.rfind(" ms</text>") == std::string::npos ? 0
                                                   : svg.rfind(" ms</text>"),
      svg.rfind(" us</text>") == std::string::npos ? 0
                                                   : svg.rfind(" us</text>"));
  ASSERT_GT(last_label, 0u);
  ASSERT_NE(last_label, std::string::npos);
  const auto its_tag = svg.rfind("<text ", last_label);
  EXPECT_NE(
      svg.substr(its_tag, last_label - its_tag).find("text-anchor=\"end\""),
      std::string::npos)
      << svg.substr(its_tag, last_label - its_tag);

  const std::string path = ::testing::TempDir() + "gpipe_trace_test.svg";
  trace->write_svg(path);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(text.str(), svg);
  std::remove(path.c_str());
  EXPECT_THROW(trace->write_chrome_json("/nonexistent/dir/x.json"), c10::Error);

  trace->clear();
  EXPECT_TRUE(trace->events().empty());
}

// A layer that throws on one micro-batch's forward (its rows are marked
// with a NaN in the first column).
struct ThrowOnMarkImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) {
    TORCH_CHECK_VALUE(
        !x.select(1, 0).isnan().any().item<bool>(), "a marked micro-batch");
    return x;
  }
};
TORCH_MODULE(ThrowOnMark);

// The events of `trace` marked failed.
std::vector<TraceEvent> failed_events(const Trace& trace) {
  std::vector<TraceEvent> failed;
  for (const auto& e : trace.events()) {
    if (e.failed) {
      failed.push_back(e);
    }
  }
  return failed;
}

// A step that failed used to leave a trace of the cells that ran and
// nothing of the one that threw: it is recorded where it failed, marked as
// failed (and only it), outlined in red in the SVG, flagged in the JSON; the
// next step's trace has none.
TEST_F(TraceTest, TheCellThatFailedIsMarked) {
  auto net = linears();
  net->push_back(ThrowOnMark());
  GPipe model(net, GPipeOptions({2, 3}).chunks(4));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  auto x = torch::randn({8, 8});
  auto marked = x.clone();
  marked[5][0] = std::numeric_limits<float>::quiet_NaN();  // micro-batch 2
  // A NaN stays NaN through Linear and Tanh.
  EXPECT_THROW(model->forward(marked), c10::ValueError);
  auto failed = failed_events(*trace);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].lane, 1);
  EXPECT_EQ(failed[0].micro_batch, 2);
  EXPECT_EQ(failed[0].kind, TraceKind::Forward);
  EXPECT_EQ(failed[0].stage, 1);
  EXPECT_GE(failed[0].end_us, failed[0].start_us);
  const auto svg = trace->svg();
  EXPECT_NE(svg.find("stroke=\"#d00000\""), std::string::npos);
  EXPECT_NE(svg.find("micro-batch 2 of stage 1 (failed)"), std::string::npos);
  EXPECT_NE(svg.find(">failed</text>"), std::string::npos);  // the legend
  const auto json = nlohmann::json::parse(trace->chrome_json());
  int flagged = 0;
  for (const auto& e : json["traceEvents"]) {
    if (e.contains("args") && e["args"].contains("failed")) {
      ++flagged;
      EXPECT_EQ(e["name"], "F2 failed");
    }
  }
  EXPECT_EQ(flagged, 1);

  // A loss that throws, in train_step: a Loss interval, failed.
  trace->clear();
  EXPECT_THROW(
      model->train_step(
          x,
          x,
          [](torch::Tensor, torch::Tensor) -> torch::Tensor {
            TORCH_CHECK_VALUE(false, "no loss today");
          },
          Schedule::OneFOneB),
      c10::ValueError);
  failed = failed_events(*trace);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].kind, TraceKind::Loss);
  EXPECT_EQ(failed[0].micro_batch, 0);

  trace->clear();
  model->forward(x).sum().backward();
  for (const auto& e : trace->events()) {
    EXPECT_FALSE(e.failed);
  }
  EXPECT_EQ(trace->svg().find("d00000"), std::string::npos);
}

// A backward that failed while it recomputed its forward was marked as a
// failed backward, and its error said "backward": the recomputation, a
// kind of its own, is named.
TEST_F(TraceTest, AFailedRecomputationIsMarkedAsOne) {
  int calls = 0;
  auto boom = testing::lambda([&calls](torch::Tensor x) {
    // Fill-drain: calls 1 and 2 are micro-batches 0 and 1's forwards;
    // call 3 is the first recomputation (of micro-batch 1).
    TORCH_CHECK_VALUE(++calls != 3, "the layer broke on purpose");
    return x;
  });
  torch::nn::Sequential net(
      torch::nn::Linear(4, 4), boom, torch::nn::Linear(4, 4));
  GPipe model(
      net, GPipeOptions({1, 2}).chunks(2).checkpoint(Checkpoint::Always));
  auto trace = std::make_shared<Trace>();
  model->set_trace(trace);
  const auto message = testing::error_of([&] {
    model->train_step(
        torch::randn({4, 4}),
        torch::randn({4, 4}),
        [](torch::Tensor y, torch::Tensor t) { return torch::mse_loss(y, t); },
        Schedule::FillDrain);
  });
  EXPECT_NE(message.find("recomputing its forward"), std::string::npos)
      << message;
  auto failed = failed_events(*trace);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].kind, TraceKind::Recompute);
  EXPECT_EQ(failed[0].stage, 1);
  // A failure after it in a forward is a forward's again.
  calls = 2;
  trace->clear();
  const auto again = testing::error_of([&] {
    model->forward(torch::randn({4, 4}));
  });
  EXPECT_EQ(again.find("recomputing"), std::string::npos) << again;
  failed = failed_events(*trace);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].kind, TraceKind::Forward);
}

}  // namespace
}  // namespace gpipe
