// CLI11's parse errors in the tools' own words: what the flag expected and
// what it got, on one line. Shared by gpipe-train, gpipe-run and
// gpipe-bench; header-only, so that gpipe-run stays free of LibTorch.
#pragma once

#include <CLI/App.hpp>
#include <CLI/Error.hpp>
#include <regex>
#include <string>

namespace gpipe::tools {

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
    const auto what = g[1].str();
    return (!what.empty() && what[0] == '-' ? "unknown flag '"
                                            : "unexpected argument '") +
           what + "'";
  }
  return m;
}

}  // namespace gpipe::tools
