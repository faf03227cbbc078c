#pragma once

// The message of the c10::Error a call throws, for tests that check what an
// error says.

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace gpipe::testing {

/// What `f` throws as a c10::Error, without LibTorch's backtrace; "no
/// error" if it returns.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

}  // namespace gpipe::testing
