#pragma once

// Small pieces of the library's messages.

#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>

namespace gpipe::detail {

/// "1 lane", "3 lanes": `n` and the noun that agrees with it.
inline std::string count_of(int64_t n, const char* one, const char* many) {
  return c10::str(n, ' ', n == 1 ? one : many);
}

}  // namespace gpipe::detail
