#pragma once

// gpipe-bench's sections that live in files of their own.

#include <nlohmann/json.hpp>

namespace gpipe::bench {

/// The cost of Note [Random streams of concurrent cells] per cell: the
/// shared lease with two generator snapshots (a cell that draws nothing),
/// and the exclusive, seeded run (a cell that draws). Prints a table and
/// returns the numbers.
nlohmann::json random_section();

}  // namespace gpipe::bench
