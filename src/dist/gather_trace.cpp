// gather_trace: every rank's trace of a PipelineStage, merged on rank 0
// with a row per rank.

#include <c10/util/irange.h>
#include <gpipe/dist.h>
#include <gpipe/trace.h>

#include <chrono>

#include "dist/connection.h"
#include "dist/stage_engine.h"

namespace gpipe::dist {

using detail::Message;
using detail::MessageId;
using detail::MessageKind;

namespace {

// When `trace` began, in microseconds of the system clock (steady clocks
// of different hosts do not share an epoch).
double system_origin_us(const Trace& trace) {
  using us = std::chrono::duration<double, std::micro>;
  const auto age = std::chrono::steady_clock::now() - trace.origin();
  return us((std::chrono::system_clock::now() - age).time_since_epoch())
      .count();
}

}  // namespace

std::shared_ptr<Trace> gather_trace(const PipelineStage& stage) {
  const auto& impl = *stage;
  auto& connection = *impl.world().connection();
  auto* engine = impl.engine_.get();
  // A pass of its own, so that its messages cannot meet a step's.
  std::lock_guard<std::mutex> passes(connection.passes_mutex);
  auto held = engine->pipeline->begin_pass();
  connection.check();
  const auto pass = engine->next_pass();
  const MessageId id{MessageKind::Trace, 0, 0};
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  try {
    auto trace = impl.trace();
    TORCH_CHECK_VALUE(
        trace != nullptr,
        "gather_trace expects a stage with a trace set (set_trace) on every "
        "rank, but rank ",
        connection.rank,
        " has none");
    const double origin = system_origin_us(*trace);
    if (connection.rank != 0) {
      std::vector<double> values;
      for (const auto& e : trace->events()) {
        values.insert(
            values.end(),
            {static_cast<double>(e.lane),
             static_cast<double>(e.micro_batch),
             static_cast<double>(static_cast<int>(e.kind)),
             e.start_us + origin,
             e.end_us + origin,
             e.failed ? 1.0 : 0.0,
             static_cast<double>(e.stage)});
      }
      connection.send(
          0,
          pass,
          id,
          Message{{torch::tensor(values, torch::kDouble)}, true},
          sends);
      connection.wait_sends(sends);
      return nullptr;
    }
    auto merged = std::make_shared<Trace>();
    merged->set_row_label("rank");
    const double base = system_origin_us(*merged);
    auto add = [&](const std::vector<TraceEvent>& events, double from) {
      for (auto e : events) {
        e.start_us += from - base;
        e.end_us += from - base;
        merged->add(e);
      }
    };
    add(trace->events(), origin);
    for (const auto r : c10::irange(int64_t{1}, connection.size)) {
      auto m = connection.recv(r, pass, id);
      TORCH_CHECK(
          m.tensors.size() == 1 && m.tensors[0].defined() &&
              m.tensors[0].scalar_type() == torch::kDouble,
          "gpipe::dist: a malformed trace message came from rank ",
          r);
      auto t = m.tensors[0].contiguous();
      TORCH_CHECK(
          t.dim() == 1 && t.numel() % 7 == 0,
          "gpipe::dist: a malformed trace message came from rank ",
          r,
          " (",
          t.numel(),
          " numbers, not 7 per event: a rank of another gpipe?)");
      const auto* p = t.data_ptr<double>();
      std::vector<TraceEvent> events;
      for (int64_t k = 0; k + 7 <= t.numel(); k += 7) {
        TraceEvent e;
        e.lane = static_cast<int64_t>(p[k]);
        e.micro_batch = static_cast<int64_t>(p[k + 1]);
        e.kind = static_cast<TraceKind>(static_cast<int>(p[k + 2]));
        e.start_us = p[k + 3];
        e.end_us = p[k + 4];
        e.failed = p[k + 5] != 0.0;
        e.stage = static_cast<int32_t>(p[k + 6]);
        events.push_back(e);
      }
      add(events, 0.0);
    }
    return merged;
  } catch (...) {
    for (auto& work : sends) {
      detail::keep_forever(std::move(work));
    }
    connection.fail_with(std::current_exception());
    throw;
  }
}

}  // namespace gpipe::dist
