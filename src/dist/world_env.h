#pragma once

// The variables of a job's environment (world_env.cpp).

#include <cstdint>
#include <optional>

namespace gpipe::dist::detail {

/// Variable `name`'s value, or nullptr when it is unset or empty.
const char* env(const char* name);

/// The integer in variable `name`, in [low, high]; `fallback` when unset
/// and a fallback is given. Throws c10::ValueError naming the variable
/// when it is missing (without a fallback), set to nothing, not a plain
/// number, or out of range.
int64_t env_int(
    const char* name,
    int64_t low,
    int64_t high,
    std::optional<int64_t> fallback = std::nullopt);

}  // namespace gpipe::dist::detail
