#include "plot.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "text.h"

namespace gpipe::bench {

namespace {

constexpr double kWidth = 780;
constexpr double kHeight = 420;
constexpr double kLeft = 70;
constexpr double kRight = 500;
constexpr double kTop = 40;
constexpr double kBottom = 360;

// Colours that stay apart for readers with the common colour blindnesses.
const char* const kPalette[] = {
    "#0072b2",
    "#d55e00",
    "#009e73",
    "#cc79a7",
    "#e69f00",
    "#56b4e9",
    "#000000",
    "#999999"};
constexpr int kColours = sizeof(kPalette) / sizeof(kPalette[0]);

// A tick step of 1, 2 or 5 times a power of ten that cuts `span` into
// about five parts.
double tick_step(double span) {
  const double raw = span / 5;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= raw) {
      return m * power;
    }
  }
  return 10 * power;
}

std::string number(double v) {
  std::ostringstream s;
  s.precision(4);
  s << v;
  return s.str();
}

}  // namespace

void write_line_plot(
    const std::string& path,
    const PlotOptions& options,
    const std::vector<Series>& series) {
  double x_min = std::numeric_limits<double>::infinity();
  double x_max = -x_min;
  double y_min = x_min;
  double y_max = -x_min;
  std::set<double> xs;
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      TORCH_CHECK_VALUE(
          !options.log_x || x > 0,
          "write_line_plot: a logarithmic x axis needs positive x, but '",
          s.label,
          "' has ",
          x);
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
      xs.insert(x);
    }
  }
  TORCH_CHECK_VALUE(
      std::isfinite(x_min), "write_line_plot: no series has a point");
  if (options.y_from_zero) {
    y_min = std::min(0.0, y_min);
  }
  const double y_step = tick_step(std::max(y_max - y_min, 1e-12));
  y_min = std::floor(y_min / y_step) * y_step;
  y_max = std::ceil(y_max * 1.02 / y_step) * y_step;
  auto fx = [&](double x) {
    const double a = options.log_x ? std::log2(x) : x;
    const double lo = options.log_x ? std::log2(x_min) : x_min;
    const double hi = options.log_x ? std::log2(x_max) : x_max;
    const double t = hi > lo ? (a - lo) / (hi - lo) : 0.5;
    return kLeft + 10 + t * (kRight - kLeft - 20);
  };
  auto fy = [&](double y) {
    return kBottom - (y - y_min) / (y_max - y_min) * (kBottom - kTop);
  };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kWidth
      << "\" height=\"" << kHeight << "\" viewBox=\"0 0 " << kWidth << " "
      << kHeight << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << kWidth / 2 << "\" y=\"22\" text-anchor=\"middle\" "
      << "font-size=\"14\">" << gpipe::detail::xml_escaped(options.title)
      << "</text>\n";
  // Grid and y ticks.
  for (double y = y_min; y <= y_max + y_step / 2; y += y_step) {
    svg << "<line x1=\"" << kLeft << "\" x2=\"" << kRight << "\" y1=\"" << fy(y)
        << "\" y2=\"" << fy(y) << "\" stroke=\"#e0e0e0\"/>\n"
        << "<text x=\"" << kLeft - 6 << "\" y=\"" << fy(y) + 4
        << "\" text-anchor=\"end\">" << number(y) << "</text>\n";
  }
  // X ticks: the data's x values on a log axis, round steps otherwise.
  std::vector<double> x_ticks;
  if (options.log_x || xs.size() <= 8) {
    x_ticks.assign(xs.begin(), xs.end());
  } else {
    const double step = tick_step(x_max - x_min);
    for (double x = std::ceil(x_min / step) * step; x <= x_max; x += step) {
      x_ticks.push_back(x);
    }
  }
  for (double x : x_ticks) {
    svg << "<line x1=\"" << fx(x) << "\" x2=\"" << fx(x) << "\" y1=\""
        << kBottom << "\" y2=\"" << kBottom + 5 << "\" stroke=\"black\"/>\n"
        << "<text x=\"" << fx(x) << "\" y=\"" << kBottom + 18
        << "\" text-anchor=\"middle\">" << number(x) << "</text>\n";
  }
  svg << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\""
      << kRight - kLeft << "\" height=\"" << kBottom - kTop
      << "\" fill=\"none\" stroke=\"black\"/>\n"
      << "<text x=\"" << (kLeft + kRight) / 2 << "\" y=\"" << kBottom + 38
      << "\" text-anchor=\"middle\">"
      << gpipe::detail::xml_escaped(options.x_label) << "</text>\n"
      << "<text transform=\"translate(18," << (kTop + kBottom) / 2
      << ") rotate(-90)\" text-anchor=\"middle\">"
      << gpipe::detail::xml_escaped(options.y_label) << "</text>\n";

  // The lines, then the legend beside the plot.
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& s = series[k];
    const char* colour =
        kPalette[(s.color >= 0 ? s.color : static_cast<int>(k)) % kColours];
    const char* dash = s.stroke == Series::Stroke::Dashed   ? "7 4"
                       : s.stroke == Series::Stroke::Dotted ? "2 3"
                                                            : "";
    if (s.points.size() > 1) {
      svg << "<polyline fill=\"none\" stroke=\"" << colour
          << "\" stroke-width=\"2\"";
      if (*dash != '\0') {
        svg << " stroke-dasharray=\"" << dash << "\"";
      }
      svg << " points=\"";
      for (const auto& [x, y] : s.points) {
        svg << fx(x) << "," << fy(y) << " ";
      }
      svg << "\"/>\n";
    }
    if (s.markers) {
      for (const auto& [x, y] : s.points) {
        svg << "<circle cx=\"" << fx(x) << "\" cy=\"" << fy(y)
            << "\" r=\"3\" fill=\"" << colour << "\"/>\n";
      }
    }
    const double ly = kTop + 8 + 18 * static_cast<double>(k);
    svg << "<line x1=\"" << kRight + 12 << "\" x2=\"" << kRight + 40
        << "\" y1=\"" << ly << "\" y2=\"" << ly << "\" stroke=\"" << colour
        << "\" stroke-width=\"2\"";
    if (*dash != '\0') {
      svg << " stroke-dasharray=\"" << dash << "\"";
    }
    svg << "/>\n<text x=\"" << kRight + 46 << "\" y=\"" << ly + 4 << "\">"
        << gpipe::detail::xml_escaped(s.label) << "</text>\n";
  }
  svg << "</svg>\n";
  std::ofstream file(path);
  file << svg.str();
  file.close();
  TORCH_CHECK_VALUE(file.good(), "write_line_plot: cannot write ", path);
}

}  // namespace gpipe::bench
