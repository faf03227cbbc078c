#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/trace.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "text.h"

namespace gpipe {

namespace {

const char* colour_of(TraceKind kind) {
  switch (kind) {
    case TraceKind::Forward:
      return "#4e79a7";
    case TraceKind::Backward:
      return "#59a14f";
    case TraceKind::Recompute:
      return "#f28e2b";
    case TraceKind::Copy:
      return "#9c9c9c";
    case TraceKind::Receive:
      return "#e15759";
    case TraceKind::Send:
      return "#b07aa1";
    case TraceKind::Weight:
      return "#8cd17d";
    case TraceKind::Loss:
      return "#edc948";
    case TraceKind::AllReduce:
      return "#76b7b2";
  }
  return "#000000";
}

std::string fixed(double value, int digits = 3) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, value);
  return buffer;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "cannot open '", path, "' for writing");
  out << text;
  out.close();
  TORCH_CHECK(out.good(), "cannot write '", path, "'");
}

}  // namespace

std::string to_string(TraceKind kind) {
  switch (kind) {
    case TraceKind::Forward:
      return "forward";
    case TraceKind::Backward:
      return "backward";
    case TraceKind::Recompute:
      return "recompute";
    case TraceKind::Copy:
      return "copy";
    case TraceKind::Receive:
      return "receive";
    case TraceKind::Send:
      return "send";
    case TraceKind::Weight:
      return "weight";
    case TraceKind::Loss:
      return "loss";
    case TraceKind::AllReduce:
      return "all-reduce";
  }
  return "unknown";
}

Trace::Trace() : origin_(std::chrono::steady_clock::now()) {}

namespace {

// The most rows a trace draws: a lane (or rank) number beyond made an SVG
// of gigabytes. As many as a job has ranks (WORLD_SIZE's limit).
constexpr int64_t kMaxTraceLanes = int64_t{1} << 20;

// A kind cast from a number outside the enum drew as "unknown" in black.
void check_kind(const char* where, TraceKind kind) {
  const auto value = static_cast<int64_t>(kind);
  TORCH_CHECK_VALUE(
      value >= static_cast<int64_t>(TraceKind::Forward) &&
          value <= static_cast<int64_t>(TraceKind::AllReduce),
      where,
      ": expected a TraceKind (forward to all-reduce, 0 to ",
      static_cast<int64_t>(TraceKind::AllReduce),
      "), got ",
      value);
}

}  // namespace

void Trace::record(
    int64_t lane,
    int64_t micro_batch,
    TraceKind kind,
    std::chrono::steady_clock::time_point start,
    std::chrono::steady_clock::time_point end,
    bool failed,
    int64_t stage) {
  TORCH_CHECK_INDEX(
      lane >= 0 && lane < kMaxTraceLanes,
      "Trace::record: expected a lane in [0, ",
      kMaxTraceLanes,
      "), got ",
      lane);
  TORCH_CHECK_INDEX(
      stage >= -1 && stage <= std::numeric_limits<int32_t>::max(),
      "Trace::record: expected a stage >= 0 (or -1: none), got ",
      stage);
  TORCH_CHECK_INDEX(
      micro_batch >= -1,
      "Trace::record: expected a micro-batch >= 0 (or -1: none), got ",
      micro_batch);
  check_kind("Trace::record", kind);
  TORCH_CHECK_VALUE(
      end >= start,
      "Trace::record: expected an interval that ends at or after its start");
  std::lock_guard<std::mutex> lock(mutex_);
  using us = std::chrono::duration<double, std::micro>;
  events_.push_back(TraceEvent{
      lane,
      micro_batch,
      kind,
      us(start - origin_).count(),
      us(end - origin_).count(),
      failed,
      static_cast<int32_t>(stage)});
}

void Trace::add(const TraceEvent& event) {
  TORCH_CHECK_INDEX(
      event.lane >= 0 && event.lane < kMaxTraceLanes,
      "Trace::add: expected a lane in [0, ",
      kMaxTraceLanes,
      "), got ",
      event.lane);
  check_kind("Trace::add", event.kind);
  TORCH_CHECK_INDEX(
      event.stage >= -1,
      "Trace::add: expected a stage >= 0 (or -1: none), got ",
      event.stage);
  TORCH_CHECK_INDEX(
      event.micro_batch >= -1,
      "Trace::add: expected a micro-batch >= 0 (or -1: none), got ",
      event.micro_batch);
  TORCH_CHECK_VALUE(
      std::isfinite(event.start_us) && std::isfinite(event.end_us),
      "Trace::add: expected finite times, got start_us ",
      event.start_us,
      " and end_us ",
      event.end_us);
  TORCH_CHECK_VALUE(
      event.end_us >= event.start_us,
      "Trace::add: expected an event that ends at or after its start, got ",
      "start_us ",
      event.start_us,
      " and end_us ",
      event.end_us);
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(event);
}

std::chrono::steady_clock::time_point Trace::origin() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return origin_;
}

std::vector<TraceEvent> Trace::events() const {
  std::vector<TraceEvent> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events = events_;
  }
  std::stable_sort(
      events.begin(), events.end(), [](const auto& a, const auto& b) {
        return a.start_us < b.start_us;
      });
  return events;
}

void Trace::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
  origin_ = std::chrono::steady_clock::now();
}

void Trace::set_row_label(std::string label) {
  std::lock_guard<std::mutex> lock(mutex_);
  row_label_ = std::move(label);
}

std::string Trace::row_label() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return row_label_;
}

namespace {

// `text` inside a JSON string.
std::string json_escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", c);
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

namespace {

// An event's name in a Chrome trace: its kind's letter (receive and
// recompute both begin with r: transfers are named in words), then the
// micro-batch.
const char* short_name(TraceKind kind) {
  switch (kind) {
    case TraceKind::Forward:
      return "F";
    case TraceKind::Backward:
      return "B";
    case TraceKind::Recompute:
      return "R";
    case TraceKind::Weight:
      return "W";
    case TraceKind::Loss:
      return "L";
    case TraceKind::Copy:
      return "C";
    case TraceKind::Receive:
      return "recv ";
    case TraceKind::Send:
      return "send ";
    case TraceKind::AllReduce:
      return "all-reduce ";
  }
  return "?";
}

}  // namespace

std::string Trace::chrome_json() const {
  const auto events = this->events();
  const auto label = json_escaped(row_label());
  // A name for each lane with events (Chrome shows no others).
  std::set<int64_t> lanes;
  for (const auto& e : events) {
    lanes.insert(e.lane);
  }
  std::ostringstream out;
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto comma = [&] {
    out << (first ? "\n" : ",\n");
    first = false;
  };
  for (const auto lane : lanes) {
    comma();
    out << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << lane
        << ",\"args\":{\"name\":\"" << label << " " << lane << "\"}}";
  }
  // Chrome's timestamps start at 0: a gathered trace's other ranks may
  // have begun before rank 0's origin (negative times), so everything
  // moves by the earliest of those.
  double shift = 0;
  for (const auto& e : events) {
    shift = std::min(shift, e.start_us);
  }
  for (const auto& e : events) {
    comma();
    const bool one = e.micro_batch >= 0;  // one micro-batch's
    out << "{\"name\":\""
        << (one ? short_name(e.kind) + std::to_string(e.micro_batch)
                : to_string(e.kind) + " of the pass")
        << (e.failed ? " failed" : "") << "\",\"cat\":\"" << to_string(e.kind)
        << "\",\"ph\":\"X\",\"pid\":0,\"tid\":" << e.lane
        << ",\"ts\":" << fixed(e.start_us - shift)
        << ",\"dur\":" << fixed(e.end_us - e.start_us) << ",\"args\":{";
    const char* separator = "";
    if (one) {
      out << "\"micro_batch\":" << e.micro_batch;
      separator = ",";
    }
    if (e.stage >= 0) {
      out << separator << "\"stage\":" << e.stage;
      separator = ",";
    }
    out << (e.failed ? std::string(separator) + "\"failed\":true" : "") << "}}";
  }
  out << "\n]}\n";
  return out.str();
}

std::string Trace::svg() const {
  const auto events = this->events();
  const auto raw_label = row_label();
  const auto label = detail::xml_escaped(raw_label);
  int64_t lanes = 0;
  double begin = events.empty() ? 0 : events.front().start_us;
  double end = begin;
  std::set<int64_t> used;
  for (const auto& e : events) {
    lanes = std::max(lanes, e.lane + 1);
    begin = std::min(begin, e.start_us);
    end = std::max(end, e.end_us);
    used.insert(e.lane);
  }
  // A row for every lane up to the highest, where an idle lane shows; but a
  // few events on lanes numbered up to a million made a picture of
  // gigabytes: past kDenseRows rows, only the lanes with events get one.
  constexpr int64_t kDenseRows = 1024;
  std::vector<int64_t> shown;
  if (lanes <= kDenseRows) {
    for (int64_t lane = 0; lane < lanes; ++lane) {
      shown.push_back(lane);
    }
  } else {
    shown.assign(used.begin(), used.end());
  }
  std::map<int64_t, int64_t> row_of;
  for (const auto k : c10::irange(shown.size())) {
    row_of.emplace(shown[k], static_cast<int64_t>(k));
  }
  const auto rows = static_cast<int64_t>(shown.size());
  const double span = std::max(end - begin, 1.0);
  // Times in ms; in us for a trace shorter than 1 ms (its labels would all
  // read 0.00 ms), in s for one of a second or more (a step of hours read
  // "10000000.00 ms").
  const bool in_us = end - begin < 1e3;
  const bool in_s = end - begin >= 1e6;
  auto number = [in_us, in_s](double us, int digits) {
    return in_us  ? fixed(us, 1)
           : in_s ? fixed(us / 1e6, digits)
                  : fixed(us / 1e3, digits);
  };
  auto time_text = [&](double us, int digits) {
    return number(us, digits) + (in_us ? " us" : in_s ? " s" : " ms");
  };
  // The label column fits "<label> <last lane>" (about 6.5 px a character
  // at 11 px), at least the 70 px that "lane 12" takes.
  const double label_chars = static_cast<double>(
      raw_label.size() + 1 +
      std::to_string(std::max<int64_t>(lanes - 1, 0)).size());
  const double left = std::max(70.0, 8 + 6.5 * label_chars);
  const double top = 30, row = 28, width = 1000;
  const double height = top + row * static_cast<double>(rows) + 50;
  auto x_of = [&](double t) { return left + (t - begin) / span * width; };

  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\""
      << fixed(left + width + 20, 0) << "\" height=\"" << fixed(height, 0)
      << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  out << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  // "lane" and "rank" (gpipe's labels) take an s; another label is named
  // as given.
  const bool plain_noun = raw_label == "lane" || raw_label == "rank";
  out << "<text x=\"" << fixed(left, 0)
      << "\" y=\"18\" font-size=\"13\">gpipe timeline: " << events.size()
      << (events.size() == 1 ? " interval" : " intervals") << " on " << rows
      << " "
      << (plain_noun
              ? label + (rows == 1 ? "" : "s")
              : std::string(rows == 1 ? "row" : "rows") + " (" + label + ")")
      << (rows < lanes ? " with events, of " + std::to_string(lanes) : "")
      << ", " << time_text(end - begin, 2) << "</text>\n";
  for (const auto k : c10::irange(rows)) {
    const double y = top + row * static_cast<double>(k);
    out << "<text x=\"4\" y=\"" << fixed(y + row * 0.65, 1) << "\">" << label
        << " " << shown[k] << "</text>\n";
    out << "<rect x=\"" << left << "\" y=\"" << fixed(y + 2, 1) << "\" width=\""
        << width << "\" height=\"" << row - 4
        << "\" fill=\"none\" stroke=\"#dddddd\"/>\n";
  }
  for (const auto& e : events) {
    const double x0 = x_of(e.start_us);
    const double w = std::max(x_of(e.end_us) - x0, 0.5);
    const double y = top + row * static_cast<double>(row_of.at(e.lane));
    // An all-reduce runs beside the lane's cells: a thin bar under them.
    const bool beside = e.kind == TraceKind::AllReduce;
    out << "<rect x=\"" << fixed(x0, 2) << "\" y=\""
        << fixed(beside ? y + row - 7 : y + 3, 1) << "\" width=\""
        << fixed(w, 2) << "\" height=\"" << (beside ? 5.0 : row - 6)
        << "\" fill=\"" << colour_of(e.kind) << "\""
        << (e.failed ? " stroke=\"#d00000\" stroke-width=\"2\"" : "")
        << "><title>" << to_string(e.kind)
        << (e.micro_batch >= 0 ? " micro-batch " + std::to_string(e.micro_batch)
            : e.kind == TraceKind::Send
                ? std::string(" (every send of the pass)")
                : std::string(" of the pass"))
        << (e.stage >= 0 ? " of stage " + std::to_string(e.stage) : "")
        << (e.failed ? " (failed)" : "") << ", "
        << number(e.start_us - begin, 3) << "-"
        << time_text(e.end_us - begin, 3) << "</title></rect>\n";
    if (w > 14 && !beside && e.micro_batch >= 0) {
      out << "<text x=\"" << fixed(x0 + w / 2, 2) << "\" y=\""
          << fixed(y + row * 0.65, 1)
          << "\" fill=\"white\" text-anchor=\"middle\">" << e.micro_batch
          << "</text>\n";
    }
  }
  // Time axis (none without intervals) and legend.
  const double axis = top + row * static_cast<double>(rows) + 14;
  for (int k = 0; k <= 4 && !events.empty(); ++k) {
    const double t = span * k / 4;
    // The last label ends at the axis's end, inside the picture.
    out << "<text x=\"" << fixed(left + width * k / 4, 1) << "\" y=\""
        << fixed(axis, 1) << "\" text-anchor=\"" << (k == 4 ? "end" : "middle")
        << "\">" << time_text(t, 2) << "</text>\n";
  }
  double lx = left;
  for (auto kind :
       {TraceKind::Forward,
        TraceKind::Backward,
        TraceKind::Recompute,
        TraceKind::Copy,
        TraceKind::Receive,
        TraceKind::Send,
        TraceKind::Weight,
        TraceKind::Loss,
        TraceKind::AllReduce}) {
    out << "<rect x=\"" << fixed(lx, 1) << "\" y=\"" << fixed(axis + 10, 1)
        << "\" width=\"12\" height=\"12\" fill=\"" << colour_of(kind)
        << "\"/><text x=\"" << fixed(lx + 16, 1) << "\" y=\""
        << fixed(axis + 20, 1) << "\">" << to_string(kind) << "</text>\n";
    lx += 100;
  }
  if (std::any_of(events.begin(), events.end(), [](const TraceEvent& e) {
        return e.failed;
      })) {
    out << "<rect x=\"" << fixed(lx, 1) << "\" y=\"" << fixed(axis + 10, 1)
        << "\" width=\"12\" height=\"12\" fill=\"white\" stroke=\"#d00000\" "
           "stroke-width=\"2\"/><text x=\""
        << fixed(lx + 16, 1) << "\" y=\"" << fixed(axis + 20, 1)
        << "\">failed</text>\n";
  }
  out << "</svg>\n";
  return out.str();
}

void Trace::write_chrome_json(const std::string& path) const {
  write_file(path, chrome_json());
}

void Trace::write_svg(const std::string& path) const {
  write_file(path, svg());
}

}  // namespace gpipe
