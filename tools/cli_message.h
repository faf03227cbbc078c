// CLI11's parse errors in the tools' own words: what the flag expected and
// what it got, on one line. Shared by gpipe-train, gpipe-run and
// gpipe-bench; header-only, so that gpipe-run stays free of LibTorch.
#pragma once

#include <CLI/App.hpp>
#include <CLI/Error.hpp>
#include <algorithm>
#include <cctype>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace gpipe::tools {

namespace cli_detail {

/// Edits (insertions, deletions, substitutions) from `a` to `b`.
inline size_t edits(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) {
    row[j] = j;
  }
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min(
          {row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = above;
    }
  }
  return row[b.size()];
}

/// " (did you mean --epochs?)" for `--epoch` when `app` has a flag that
/// starts with the word or is at most two edits from it; else "".
inline std::string suggestion(const CLI::App* app, const std::string& word) {
  if (app == nullptr) {
    return "";
  }
  const auto flag = word.substr(0, word.find('='));
  std::string best;
  size_t best_edits = 3;
  for (const auto* option : app->get_options()) {
    for (const auto& name : option->get_lnames()) {
      const auto candidate = "--" + name;
      const bool prefix = flag.size() >= 4 && candidate.rfind(flag, 0) == 0;
      const auto d = prefix ? 1 : edits(flag, candidate);
      if (d < best_edits) {
        best = candidate;
        best_edits = d;
      }
    }
  }
  return best.empty() ? "" : " (did you mean " + best + "?)";
}

}  // namespace cli_detail

/// The first switch of `app` given as `--name=` with nothing after the `=`
/// before `--`: a message that says so, or "" (CLI11 reads an empty value
/// as true).
inline std::string empty_switch_value(
    const CLI::App& app, int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--") {
      break;
    }
    if (word.size() < 4 || word.rfind("--", 0) != 0 || word.back() != '=') {
      continue;
    }
    const auto name = word.substr(0, word.size() - 1);
    const auto* option = app.get_option_no_throw(name);
    if (option != nullptr && option->get_expected_max() == 0) {
      return name + " is a switch: give it alone (or =true, =false), " +
             "but got ''";
    }
  }
  return "";
}

/// The message of `e` (not --help's), reworded where CLI11's own says
/// little: a flag given twice, a flag without its value, a value that is
/// not a number or out of a flag's range, an unknown flag. Other messages
/// are returned as CLI11 wrote them. With `app`, a switch given a value
/// that is not true or false is told as a switch.
inline std::string cli_message(
    const CLI::ParseError& e, const CLI::App* app = nullptr) {
  const std::string m = e.what();
  std::smatch g;
  static const std::regex at_most(
      R"(^(\S+): At Most ([0-9]+) required but received ([0-9]+)$)");
  static const std::regex missing(R"(^(\S+): [0-9]+ required .* missing$)");
  static const std::regex convert(R"(^Could not convert: (\S+) = (.*)$)");
  static const std::regex range(
      R"(^(\S+): Value (.*) not in range (\S+) to (\S+)$)");
  static const std::regex extra(
      R"(^The following arguments? (?:was|were) not expected: (.*)$)");
  if (std::regex_match(m, g, at_most)) {
    return g[2] == "1" ? g[1].str() + " was given " + g[3].str() +
                             " times; give it once"
                       : g[1].str() + " takes at most " + g[2].str() +
                             " values, but got " + g[3].str();
  }
  if (std::regex_match(m, g, missing)) {
    return g[1].str() + " expects a value after it, but none was given";
  }
  if (std::regex_match(m, g, convert)) {
    const auto* option =
        app != nullptr ? app->get_option_no_throw(g[1].str()) : nullptr;
    if (option != nullptr && option->get_expected_max() == 0) {
      return g[1].str() + " is a switch: give it alone (or =true, =false), " +
             "but got '" + g[2].str() + "'";
    }
    return g[1].str() + " expects a number, but got '" + g[2].str() + "'";
  }
  if (std::regex_match(m, g, range)) {
    return g[1].str() + " expects a number from " + g[3].str() + " to " +
           g[4].str() + ", but got '" + g[2].str() + "'";
  }
  if (std::regex_match(m, g, extra)) {
    // The first word left over, in the order given (CLI11's message joins
    // them last first).
    std::vector<std::string> words;
    if (app != nullptr) {
      words = app->remaining();
    }
    if (words.empty()) {
      std::istringstream joined(g[1].str());
      for (std::string w; joined >> w;) {
        words.insert(words.begin(), w);
      }
    }
    if (words.empty()) {
      return m;
    }
    const auto& w = words.front();
    const bool flag = w.size() > 1 && w != "--" && w[0] == '-' &&
                      !std::isdigit(static_cast<unsigned char>(w[1])) &&
                      w[1] != '.';
    return flag ? "unknown flag '" + w + "'" + cli_detail::suggestion(app, w)
                : "unexpected argument '" + w + "'";
  }
  return m;
}

}  // namespace gpipe::tools
