// How autotune's results read (autotune_text.h): the report's table, the
// line of a choice, and the figures both use.

#include "balance/autotune_text.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/autotune.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <ostream>
#include <sstream>

namespace gpipe {

namespace detail {

std::string mib(double bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (bytes < 1024.0) {
    out << std::setprecision(0) << bytes << (bytes == 1.0 ? " byte" : " bytes");
  } else if (bytes < 1024.0 * 1024.0) {
    out << bytes / 1024.0 << " KiB";
  } else {
    out << bytes / (1024.0 * 1024.0) << " MiB";
  }
  return out.str();
}

std::string balance_text(const std::vector<int64_t>& b) {
  std::ostringstream out;
  out << "[";
  for (const auto k : c10::irange(b.size())) {
    out << (k == 0 ? "" : ",") << b[k];
  }
  out << "]";
  return out.str();
}

std::string threads_text(int64_t threads_per_lane) {
  return threads_per_lane == 0 ? "plan" : std::to_string(threads_per_lane);
}

double most(const std::vector<double>& per_lane) {
  return per_lane.empty() ? 0.0
                          : *std::max_element(per_lane.begin(), per_lane.end());
}

std::pair<std::string, std::string> limit_and_peak_text(
    int64_t limit, double peak) {
  auto limit_text = mib(static_cast<double>(limit));
  auto peak_text = mib(peak);
  if (limit_text == peak_text) {
    limit_text += c10::str(" (", limit, " bytes)");
    // Up: a peak of 9471.4 bytes is over a limit of 9471.
    peak_text +=
        c10::str(" (", static_cast<int64_t>(std::ceil(peak)), " bytes)");
  }
  return {limit_text, peak_text};
}

}  // namespace detail

using detail::balance_text;
using detail::mib;
using detail::most;
using detail::threads_text;

std::string Autotuned::report(size_t rows) const {
  std::ostringstream out;
  out << *this << "\n";
  // As wide as the longest balance (of 13 partitions, 29 characters).
  size_t balance_width = 22;
  for (const auto& c : candidates) {
    balance_width = std::max(balance_width, balance_text(c.balance).size() + 2);
  }
  const auto bw = static_cast<int>(balance_width);
  out << std::left << std::setw(14) << "schedule" << std::setw(7) << "chunks"
      << std::setw(12) << "checkpoint" << std::setw(bw) << "balance"
      << std::setw(8) << "threads" << std::right << std::setw(10) << "step_ms"
      << std::setw(14) << "peak"
      << "  verdict\n";
  size_t fitting = 0;
  size_t rejected = 0;
  for (const auto& c : candidates) {
    const bool fits = c.rejected.empty();
    if ((fits && fitting++ >= rows) || (!fits && rejected++ >= rows)) {
      continue;
    }
    out << std::left << std::setw(14) << to_string(c.schedule) << std::setw(7)
        << c.chunks << std::setw(12) << to_string(c.checkpoint) << std::setw(bw)
        << balance_text(c.balance) << std::setw(8)
        << threads_text(c.threads_per_lane) << std::right << std::fixed;
    if (c.predicted_peak_bytes.empty()) {
      // Not simulated: its micro-batches do not run.
      out << std::setw(10) << "-" << std::setw(14) << "-";
    } else {
      out << std::setprecision(2) << std::setw(10)
          << c.predicted_step_seconds * 1e3 << std::setw(14)
          << mib(most(c.predicted_peak_bytes));
    }
    out << "  " << (fits ? "fits" : c.rejected) << "\n";
  }
  out << candidates.size() << " candidates, " << fitting << " fit";
  return out.str();
}

std::ostream& operator<<(std::ostream& out, const Autotuned& t) {
  // Formatted apart, so that the caller's stream keeps its own format.
  std::ostringstream text;
  text << "balance " << balance_text(t.balance) << ", chunks " << t.chunks
       << ", schedule " << to_string(t.schedule) << " on "
       << to_string(t.placement) << ", checkpoint " << to_string(t.checkpoint)
       << ", threads per lane " << threads_text(t.threads_per_lane)
       << ": predicted " << std::fixed << std::setprecision(2)
       << t.predicted_step_seconds * 1e3 << " ms per step, peak "
       << mib(most(t.predicted_peak_bytes)) << " on the most loaded lane";
  return out << text.str();
}

}  // namespace gpipe
