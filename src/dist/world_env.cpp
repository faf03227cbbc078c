// The variables of a job's environment that init_from_env reads: plain
// numbers, and a variable set to nothing refused by name.

#include "dist/world_env.h"

#include <c10/util/Exception.h>
#include <gpipe/dist.h>

#include <cerrno>
#include <cstdlib>

namespace gpipe::dist {

namespace detail {

namespace {

// Whether `text` is a plain number: digits, with one '.' among them when
// `decimal` (no sign, spaces or exponent, which strtoll and strtod would
// take at one end and not the other).
bool plain_number(const char* text, bool decimal) {
  bool digit = false;
  bool point = false;
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c >= '0' && *c <= '9') {
      digit = true;
    } else if (decimal && *c == '.' && !point) {
      point = true;
    } else {
      return false;
    }
  }
  return digit;
}

// A variable set to nothing is refused as set to nothing (it read as "not
// set", or as unset where a default applies).
void refuse_empty(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK_VALUE(
      value == nullptr || *value != '\0',
      "gpipe::dist::init_from_env: ",
      name,
      " is set but empty; give it a value or unset it");
}

}  // namespace

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// The integer in variable `name`, in [low, high]; `fallback` when unset and
// a fallback is given.
int64_t env_int(
    const char* name,
    int64_t low,
    int64_t high,
    std::optional<int64_t> fallback) {
  refuse_empty(name);
  const char* value = env(name);
  if (value == nullptr) {
    TORCH_CHECK_VALUE(
        fallback.has_value(),
        "gpipe::dist::init_from_env needs the environment variable ",
        name,
        " (set by torchrun or gpipe-run), but it is not set");
    return *fallback;
  }
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(value, &end, 10);
  TORCH_CHECK_VALUE(
      plain_number(value, false) && errno == 0 && end != value &&
          *end == '\0' && v >= low && v <= high,
      "gpipe::dist::init_from_env expects ",
      name,
      " to be an integer in [",
      low,
      ", ",
      high,
      "], but got '",
      value,
      "'");
  return v;
}

}  // namespace detail

std::chrono::milliseconds default_timeout() {
  detail::refuse_empty("GPIPE_DIST_TIMEOUT");
  const char* value = detail::env("GPIPE_DIST_TIMEOUT");
  if (value == nullptr) {
    return std::chrono::seconds(120);
  }
  errno = 0;
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  TORCH_CHECK_VALUE(
      detail::plain_number(value, true) && errno == 0 && end != value &&
          *end == '\0' && seconds >= 1 && seconds <= 7 * 24 * 3600,
      "GPIPE_DIST_TIMEOUT expects a number of seconds in [1, 604800], but got "
      "'",
      value,
      "' (digits, and a '.' for a fraction: 30, 2.5)");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace gpipe::dist
