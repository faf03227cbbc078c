// Block partitions of a sequence of costs: the math behind balance_cost, with
// no tensors.

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/balance.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

namespace gpipe {

namespace {

void check_finite(const std::vector<double>& sequence) {
  for (const auto i : c10::irange(sequence.size())) {
    TORCH_CHECK_VALUE(
        std::isfinite(sequence[i]),
        "every cost must be a finite number, but element ",
        i,
        " is ",
        sequence[i]);
  }
}

// Note [Block partition]
// Bárány and Grinberg's procedure, on values scaled to [0, 1]:
//   (1) let p be a maximal block (torchgpipe: the last of equal ones);
//   (2) stop when max <= min + 1;
//   (3) else let q be the minimal block closest to p, h the block next to q
//       towards p; move the element of h nearest q into q; go to (1) if
//       h == p, else to (2).
// torchgpipe's code takes the leftmost minimal block as q instead of the
// closest. Then h may be empty, the boundaries cross and the loop can run
// forever: solve([2, 1, 0, 0, 5, 0, 0, 4, 3], 8) never returns, and about 2%
// of random short sequences come back with blocks that do not cover the
// sequence. With the closest q, h is never empty (an empty block has size 0,
// the minimum, and would be closer). The stop test allows for rounding: with
// max == min + 1 exactly, a rounding error would otherwise move one element
// back and forth for ever.
constexpr double kStopSlack = 1e-9;

// End (exclusive) of each block.
std::vector<int64_t> block_partition_splits(
    const std::vector<double>& sequence, int64_t partitions) {
  TORCH_CHECK_VALUE(
      partitions >= 1,
      "partitions must be a positive integer (",
      partitions,
      " < 1)");
  const auto n = static_cast<int64_t>(sequence.size());
  TORCH_CHECK_VALUE(
      n >= partitions,
      "sequence is shorter than intended partitions (",
      n,
      " < ",
      partitions,
      ")");
  check_finite(sequence);

  const auto [lowest, highest] =
      std::minmax_element(sequence.begin(), sequence.end());
  const double minimum = *lowest;
  const double range = *highest - minimum;
  std::vector<double> normal(sequence.size(), 0.0);
  if (range != 0) {
    for (const auto i : c10::irange(sequence.size())) {
      normal[i] = (sequence[i] - minimum) / range;
    }
  }

  std::vector<int64_t> splits(partitions, n);
  for (const auto i : c10::irange(partitions - 1)) {
    splits[i] = n / partitions * (i + 1);
  }
  // Sums in order from the block's start, as Python's sum() over a slice, so
  // that equal blocks compare equal as they do in torchgpipe.
  auto block_size = [&](int64_t i) {
    double size = 0;
    for (int64_t j = i == 0 ? 0 : splits[i - 1]; j < splits[i]; ++j) {
      size += normal[j];
    }
    return size;
  };

  // The procedure ends after O(k n^2) moves in practice (7824 moves for
  // n = 300, k = 64); the cap only turns a bug into an error.
  const int64_t max_moves = partitions * n * n + 1000;
  int64_t moves = 0;
  std::vector<double> sizes(partitions);
  while (true) {
    int64_t p = 0;
    double max_size = block_size(0);
    for (const auto i : c10::irange(int64_t{1}, partitions)) {
      const double size = block_size(i);
      if (size >= max_size) {
        max_size = size;
        p = i;
      }
    }
    while (true) {
      for (const auto i : c10::irange(partitions)) {
        sizes[i] = block_size(i);
      }
      const double min_size = *std::min_element(sizes.begin(), sizes.end());
      if (max_size <= min_size + 1 + kStopSlack) {
        return splits;
      }
      int64_t q = -1;
      for (const auto i : c10::irange(partitions)) {
        if (sizes[i] == min_size &&
            (q < 0 || std::abs(i - p) < std::abs(q - p))) {
          q = i;
        }
      }
      int64_t h = 0;
      if (p < q) {
        h = q - 1;
        splits[h] -= 1;
      } else {
        h = q + 1;
        splits[q] += 1;
      }
      TORCH_INTERNAL_ASSERT(
          ++moves <= max_moves,
          "block partition did not converge after ",
          moves,
          " moves");
      if (p == h) {
        break;
      }
    }
  }
}

// The blocks of `splits` that minimise the largest block sum, ties broken by
// the smallest sum of squared block sums, by dynamic programming over prefix
// sums: O(k n^2).
std::vector<int64_t> min_max_splits(
    const std::vector<double>& prefix, int64_t partitions) {
  const auto n = static_cast<int64_t>(prefix.size()) - 1;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  auto sum = [&](int64_t begin, int64_t end) {
    return prefix[end] - prefix[begin];
  };
  // largest[i]: the smallest largest block sum of the first i values in j
  // blocks, for the current j.
  std::vector<double> largest(n + 1, kInf);
  for (const auto i : c10::irange(int64_t{1}, n + 1)) {
    largest[i] = sum(0, i);
  }
  for (const auto j : c10::irange(int64_t{2}, partitions + 1)) {
    std::vector<double> next(n + 1, kInf);
    for (int64_t i = j; i <= n; ++i) {
      for (int64_t t = j - 1; t < i; ++t) {
        next[i] = std::min(next[i], std::max(largest[t], sum(t, i)));
      }
    }
    largest = std::move(next);
  }
  const double bound = largest[n];

  // Among the splits whose blocks all stay within `bound` (the optimal one
  // does, its sums being the same floating-point differences), the one with
  // the smallest sum of squares.
  std::vector<std::vector<int64_t>> from(
      partitions + 1, std::vector<int64_t>(n + 1, -1));
  std::vector<double> squares(n + 1, kInf);
  for (const auto i : c10::irange(int64_t{1}, n + 1)) {
    if (sum(0, i) <= bound) {
      squares[i] = sum(0, i) * sum(0, i);
      from[1][i] = 0;
    }
  }
  for (const auto j : c10::irange(int64_t{2}, partitions + 1)) {
    std::vector<double> next(n + 1, kInf);
    for (int64_t i = j; i <= n; ++i) {
      for (int64_t t = j - 1; t < i; ++t) {
        const double block = sum(t, i);
        if (squares[t] == kInf || block > bound) {
          continue;
        }
        const double total = squares[t] + block * block;
        if (total < next[i]) {
          next[i] = total;
          from[j][i] = t;
        }
      }
    }
    squares = std::move(next);
  }
  std::vector<int64_t> splits(partitions);
  int64_t end = n;
  for (int64_t j = partitions; j >= 1; --j) {
    TORCH_INTERNAL_ASSERT(from[j][end] >= 0, "no split within the bound");
    splits[j - 1] = end;
    end = from[j][end];
  }
  TORCH_INTERNAL_ASSERT(end == 0);
  return splits;
}

double largest_block(
    const std::vector<double>& prefix, const std::vector<int64_t>& splits) {
  double largest = -std::numeric_limits<double>::infinity();
  int64_t begin = 0;
  for (const auto end : splits) {
    largest = std::max(largest, prefix[end] - prefix[begin]);
    begin = end;
  }
  return largest;
}

bool has_empty_block(const std::vector<int64_t>& splits) {
  int64_t begin = 0;
  for (const auto end : splits) {
    if (end <= begin) {
      return true;
    }
    begin = end;
  }
  return false;
}

}  // namespace

std::vector<std::vector<double>> solve_block_partition(
    const std::vector<double>& sequence, int64_t partitions) {
  const auto splits = block_partition_splits(sequence, partitions);
  TORCH_INTERNAL_ASSERT(!has_empty_block(splits), "empty block");
  std::vector<std::vector<double>> blocks;
  int64_t begin = 0;
  for (const auto end : splits) {
    blocks.emplace_back(sequence.begin() + begin, sequence.begin() + end);
    begin = end;
  }
  return blocks;
}

std::vector<int64_t> balance_cost(
    const std::vector<double>& given, int64_t partitions) {
  check_finite(given);
  // The partition depends on the costs' ratios alone: scaled so that the
  // largest is 1, costs of 1e160 (whose squares overflow) split as 1s do.
  double largest = 0;
  for (const auto c : given) {
    largest = std::max(largest, std::abs(c));
  }
  std::vector<double> costs = given;
  if (largest > 0) {
    for (auto& c : costs) {
      c /= largest;
    }
  }
  auto splits = block_partition_splits(costs, partitions);
  std::vector<double> prefix(costs.size() + 1, 0.0);
  for (const auto i : c10::irange(costs.size())) {
    prefix[i + 1] = prefix[i] + costs[i];
  }
  // See Note [Block partition]: Bárány's blocks may be far from the best
  // (2.3 times the smallest possible largest block for [1, 3, 1, 1, 1, 1, 2,
  // 1, 1, 2] in 6 blocks), and never single out one dominant layer.
  const auto best = min_max_splits(prefix, partitions);
  const double ours = largest_block(prefix, splits);
  const double theirs = largest_block(prefix, best);
  if (has_empty_block(splits) ||
      ours - theirs > 1e-9 * std::max(std::abs(ours), std::abs(theirs))) {
    splits = best;
  }
  std::vector<int64_t> balance;
  int64_t begin = 0;
  for (const auto end : splits) {
    balance.push_back(end - begin);
    begin = end;
  }
  return balance;
}

}  // namespace gpipe
