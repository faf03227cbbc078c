#pragma once

// How autotune's results read: figures of bytes, balances and threads, the
// report's table and the line of a choice (autotune_text.cpp). The search
// is in autotune.cpp.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

/// "1.5 MiB", "12.0 KiB" below a MiB, "10 bytes" below a KiB.
std::string mib(double bytes);

/// "[2,1,2,3]".
std::string balance_text(const std::vector<int64_t>& balance);

/// "plan" for threads_per_lane 0 (the lanes share the cores by the plan),
/// else the count.
std::string threads_text(int64_t threads_per_lane);

/// The most loaded lane's figure of `per_lane` (0 when empty).
double most(const std::vector<double>& per_lane);

/// A memory limit and the smallest peak found, as the error of a limit
/// nothing fits names them: rounded ("9.2 KiB"), and in bytes too where
/// the rounded figures read alike ("9.2 KiB (9471 bytes)").
std::pair<std::string, std::string> limit_and_peak_text(
    int64_t limit, double peak);

}  // namespace gpipe::detail
