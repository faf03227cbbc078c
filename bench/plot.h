#pragma once

// Line plots as standalone SVG files, for the pictures in
// docs/benchmarks.md: no plotting library, nothing but text.

#include <string>
#include <utility>
#include <vector>

namespace gpipe::bench {

/// One line of a plot: its points in x order, drawn solid, dashed or
/// dotted, with a marker at each point unless `markers` is false.
struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;
  enum class Stroke { Solid, Dashed, Dotted } stroke = Stroke::Solid;
  bool markers = true;
  /// Index into the plot's palette; -1 takes the series' own index.
  int color = -1;
};

struct PlotOptions {
  std::string title;
  std::string x_label;
  std::string y_label;
  /// Logarithmic x axis (base 2), ticks at the points' x values.
  bool log_x = false;
  /// The y axis starts at 0 unless false (then at the smallest y).
  bool y_from_zero = true;
};

/// Writes a line plot of `series` to `path` (780 x 420 pixels, legend on
/// the right). Throws c10::Error if the file cannot be written or no
/// series has a point.
void write_line_plot(
    const std::string& path,
    const PlotOptions& options,
    const std::vector<Series>& series);

}  // namespace gpipe::bench
