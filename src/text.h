#pragma once

// Small pieces of the library's messages.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

// Note [Errors without LibTorch's backtrace]
// A c10::Error made by TORCH_CHECK carries LibTorch's backtrace ("Exception
// raised from ...", then "frame #0: ..."), which its what() prints after
// the message: a program that prints what(), or dies of the error, shows
// dozens of frames of gpipe's and LibTorch's insides for an error about
// the user's job (a rank that never came, a rank that died). The errors of
// joining a job and of a failed connection between ranks are thrown
// without it; what_without_backtrace() reads the same either way. The
// backtrace argument is `{}`: LibTorch 1.13 takes it as a string, 2.x as a
// lazily computed value, and an empty one of either prints nothing.

/// Throws a c10::Error of `message` alone (Note [Errors without LibTorch's
/// backtrace]).
[[noreturn]] inline void fail_without_backtrace(std::string message) {
  throw c10::Error(std::move(message), {});
}

/// Another process's failure, met here (a receive or a collective it
/// ended): `origin()` is its message as that process gave it, naming where
/// it happened ("rank 3: ..."), and what() adds how it reached this one.
/// A pass that ends because of it passes the origin on as it came, so that
/// every rank names the rank where the failure happened, once.
class RelayedFailure : public c10::Error {
 public:
  RelayedFailure(std::string origin, std::string message)
      : c10::Error(std::move(message), {}), origin_(std::move(origin)) {}
  const std::string& origin() const {
    return origin_;
  }

 private:
  std::string origin_;
};

/// Throws `error` again as the same kind of c10::Error (ValueError,
/// TypeError, IndexError or Error), its message and context kept, without
/// its backtrace.
[[noreturn]] inline void rethrow_without_backtrace(const c10::Error& error) {
  std::string message = error.what_without_backtrace();
  if (dynamic_cast<const c10::ValueError*>(&error) != nullptr) {
    throw c10::ValueError(std::move(message), {});
  }
  if (dynamic_cast<const c10::TypeError*>(&error) != nullptr) {
    throw c10::TypeError(std::move(message), {});
  }
  if (dynamic_cast<const c10::IndexError*>(&error) != nullptr) {
    throw c10::IndexError(std::move(message), {});
  }
  throw c10::Error(std::move(message), {});
}

/// "1 lane", "3 lanes": `n` and the noun that agrees with it.
inline std::string count_of(int64_t n, const char* one, const char* many) {
  return c10::str(n, ' ', n == 1 ? one : many);
}

/// "a", "a and b", "a, b and c".
inline std::string listed(const std::vector<std::string>& items) {
  std::string out;
  for (size_t k = 0; k < items.size(); ++k) {
    out += (k == 0 ? "" : k + 1 == items.size() ? " and " : ", ") + items[k];
  }
  return out;
}

// `text` as XML character data or an attribute's value.
inline std::string xml_escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        // Control characters other than tab and newline are not XML.
        out += static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n'
                   ? ' '
                   : c;
    }
  }
  return out;
}

}  // namespace gpipe::detail
