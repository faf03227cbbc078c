// gpipe-bench --markdown: the results as Markdown, for
// scripts/benchmarks.sh, which builds docs/benchmarks.md from them.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "sections.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;

// Columns that say what a row is come first, in this order; the others
// follow alphabetically.
const std::vector<std::string> kLeading{
    "config",
    "name",
    "model",
    "schedule",
    "lanes",
    "partitions",
    "stages_per_lane",
    "chunks",
    "checkpoint",
    "B",
    "C"};

std::string cell(const json& value) {
  if (value.is_number_float()) {
    const double v = value.get<double>();
    char text[32];
    // Three significant digits at least: a step of 1.6 ms kept in seconds
    // is 0.00163, not 0.002.
    if (v != 0 && (std::fabs(v) >= 1e6 || std::fabs(v) < 1)) {
      std::snprintf(text, sizeof text, "%.3g", v);
    } else if (std::fabs(v) >= 100) {
      std::snprintf(text, sizeof text, "%.1f", v);
    } else if (std::fabs(v) >= 10) {
      std::snprintf(text, sizeof text, "%.2f", v);
    } else {
      std::snprintf(text, sizeof text, "%.3f", v);
    }
    return text;
  }
  if (value.is_string()) {
    return value.get<std::string>();
  }
  if (value.is_array()) {
    std::string out;
    for (const auto& item : value) {
      out += (out.empty() ? "" : ", ") + cell(item);
    }
    return out;
  }
  if (value.is_null()) {
    return "-";  // a figure the row has none of
  }
  return value.dump();
}

bool is_table(const json& value) {
  return value.is_array() && !value.empty() &&
         std::all_of(value.begin(), value.end(), [](const json& row) {
           return row.is_object();
         });
}

std::string table(const json& rows) {
  std::vector<std::string> columns;
  for (const auto& name : kLeading) {
    for (const auto& row : rows) {
      if (row.contains(name)) {
        columns.push_back(name);
        break;
      }
    }
  }
  std::vector<std::string> rest;
  for (const auto& row : rows) {
    for (const auto& item : row.items()) {
      if (std::find(columns.begin(), columns.end(), item.key()) ==
              columns.end() &&
          std::find(rest.begin(), rest.end(), item.key()) == rest.end()) {
        rest.push_back(item.key());
      }
    }
  }
  std::sort(rest.begin(), rest.end());
  columns.insert(columns.end(), rest.begin(), rest.end());
  std::string out = "|";
  std::string rule = "|";
  for (const auto& c : columns) {
    out += " " + c + " |";
    rule += "---|";
  }
  out += "\n" + rule + "\n";
  for (const auto& row : rows) {
    out += "|";
    for (const auto& c : columns) {
      out += " " + (row.contains(c) ? cell(row[c]) : std::string()) + " |";
    }
    out += "\n";
  }
  return out;
}

void render(const json& value, int depth, std::string& out) {
  std::string items;
  std::vector<std::pair<std::string, const json*>> nested;
  for (const auto& item : value.items()) {
    if (is_table(item.value()) || item.value().is_object()) {
      nested.emplace_back(item.key(), &item.value());
    } else {
      items += "- " + item.key() + ": " + cell(item.value()) + "\n";
    }
  }
  if (!items.empty()) {
    out += items + "\n";
  }
  for (const auto& [key, child] : nested) {
    out += std::string(static_cast<size_t>(depth), '#') + " " + key + "\n\n";
    if (is_table(*child)) {
      out += table(*child) + "\n";
    } else {
      render(*child, depth + 1, out);
    }
  }
}

}  // namespace

std::string to_markdown(const json& results) {
  std::string out;
  // One section (as scripts/benchmarks.sh runs them): its content alone,
  // under the heading the script gives it.
  const json& body = results.is_object() && results.size() == 1
                         ? results.begin().value()
                         : results;
  if (is_table(body)) {
    return table(body);
  }
  if (body.is_object()) {
    render(body, 4, out);
  } else {
    out = cell(body) + "\n";
  }
  return out;
}

}  // namespace gpipe::bench
