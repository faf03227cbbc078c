// Trace::summary: a trace's span, each lane's busy time and its bubble, in
// gpipe::simulate's terms.

#include <gpipe/trace.h>

#include <algorithm>
#include <vector>

namespace gpipe {

TraceSummary Trace::summary() const {
  TraceSummary summary;
  const auto events = this->events();  // by start time
  if (events.empty()) {
    return summary;
  }
  double first = events.front().start_us;
  double last = first;
  int64_t lanes = 0;
  for (const auto& e : events) {
    last = std::max(last, e.end_us);
    lanes = std::max(lanes, e.lane + 1);
  }
  // Per lane, sweep its intervals in start order, adding each run of
  // overlapping ones once.
  std::vector<double> busy_us(lanes, 0.0);
  std::vector<bool> traced(lanes, false);  // any event, waits included
  for (const auto& e : events) {
    traced[e.lane] = true;
  }
  std::vector<bool> started(lanes, false);
  std::vector<double> open(lanes, 0.0);
  std::vector<double> close(lanes, 0.0);
  for (const auto& e : events) {
    if (e.kind == TraceKind::Receive || e.kind == TraceKind::Send ||
        e.kind == TraceKind::AllReduce) {
      continue;
    }
    const auto lane = e.lane;
    if (!started[lane] || e.start_us > close[lane]) {
      if (started[lane]) {
        busy_us[lane] += close[lane] - open[lane];
      }
      started[lane] = true;
      open[lane] = e.start_us;
      close[lane] = e.end_us;
    } else {
      close[lane] = std::max(close[lane], e.end_us);
    }
  }
  summary.span = (last - first) * 1e-6;
  double total = 0;
  int64_t counted = 0;
  for (int64_t lane = 0; lane < lanes; ++lane) {
    if (started[lane]) {
      busy_us[lane] += close[lane] - open[lane];
    }
    summary.busy.push_back(busy_us[lane] * 1e-6);
    if (traced[lane]) {
      total += busy_us[lane] * 1e-6;
      ++counted;
    }
  }
  summary.bubble = summary.span - total / static_cast<double>(counted);
  summary.bubble_fraction =
      summary.span > 0 ? summary.bubble / summary.span : 0.0;
  return summary;
}

}  // namespace gpipe
