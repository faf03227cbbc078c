#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/microbatch.h>
#include <gpipe/verify.h>
#include <torch/torch.h>

#include "text.h"

namespace gpipe {

std::vector<Batch> scatter(const Batch& inputs, int64_t chunks) {
  verify_chunks(chunks);
  verify_batch(inputs);
  std::vector<Batch> micro_batches;
  for (const auto k : c10::irange(inputs.size())) {
    auto pieces = inputs[k].chunk(chunks, /*dim=*/0);
    if (micro_batches.empty()) {
      micro_batches.resize(pieces.size());
    }
    // Same batch size everywhere, so chunk() cuts every tensor alike.
    TORCH_INTERNAL_ASSERT(pieces.size() == micro_batches.size());
    for (const auto i : c10::irange(pieces.size())) {
      micro_batches[i].push_back(std::move(pieces[i]));
    }
  }
  return micro_batches;
}

Batch gather(const std::vector<Batch>& micro_batches) {
  TORCH_CHECK_VALUE(
      !micro_batches.empty(), "gather: expected at least one micro-batch");
  const auto width = micro_batches[0].size();
  Batch out;
  out.reserve(width);
  for (const auto k : c10::irange(width)) {
    std::vector<torch::Tensor> pieces;
    pieces.reserve(micro_batches.size());
    for (const auto i : c10::irange(micro_batches.size())) {
      TORCH_CHECK_VALUE(
          micro_batches[i].size() == width,
          "gather: micro-batch ",
          i,
          " has ",
          detail::count_of(
              static_cast<int64_t>(micro_batches[i].size()),
              "tensor",
              "tensors"),
          ", but micro-batch 0 has ",
          width);
      pieces.push_back(micro_batches[i][k]);
    }
    out.push_back(torch::cat(pieces, /*dim=*/0));
  }
  return out;
}

}  // namespace gpipe
