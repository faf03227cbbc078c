#include "engine/partitions.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

namespace gpipe::detail {

std::vector<torch::nn::Sequential> split_partitions(
    const torch::nn::Sequential& module, const std::vector<int64_t>& balance) {
  const auto named = module->named_children();
  std::vector<torch::nn::Sequential> parts;
  size_t layer = 0;
  for (const auto size : balance) {
    torch::nn::Sequential part;
    for (const auto k : c10::irange(size)) {
      (void)k;
      TORCH_INTERNAL_ASSERT(layer < named.size());
      part->push_back(named[layer].key(), *(module->begin() + layer));
      ++layer;
    }
    parts.push_back(part);
  }
  TORCH_INTERNAL_ASSERT(layer == named.size());
  return parts;
}

}  // namespace gpipe::detail
