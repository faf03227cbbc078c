#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/microbatch.h>
#include <gpipe/verify.h>
#include <torch/torch.h>

#include <algorithm>

#include "text.h"

namespace gpipe {

namespace {

// Tensor::chunk's pieces along the batch. A tensor without history is cut
// by slices of chunk()'s sizes: the same views, without the split and
// narrow calls around each (a cost per micro-batch of every step).
std::vector<torch::Tensor> pieces_of(const torch::Tensor& t, int64_t chunks) {
  const int64_t rows = t.dim() > 0 ? t.size(0) : 0;
  // More chunks than rows cut one row a piece (and rows + chunks - 1 below
  // would overflow for chunks near INT64_MAX).
  if (rows > 0) {
    chunks = std::min(chunks, rows);
  }
  if (t.requires_grad() || rows == 0) {
    return t.chunk(chunks, /*dim=*/0);
  }
  const int64_t size = (rows + chunks - 1) / chunks;
  std::vector<torch::Tensor> pieces;
  pieces.reserve(static_cast<size_t>((rows + size - 1) / size));
  for (int64_t start = 0; start < rows; start += size) {
    pieces.push_back(t.slice(0, start, std::min(start + size, rows)));
  }
  return pieces;
}

}  // namespace

std::vector<Batch> scatter(const Batch& inputs, int64_t chunks) {
  verify_chunks(chunks);
  verify_batch(inputs);
  std::vector<Batch> micro_batches;
  for (const auto k : c10::irange(inputs.size())) {
    auto pieces = pieces_of(inputs[k], chunks);
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
    // An output a layer leaves undefined (an optional one) stays so; it
    // must be undefined in every micro-batch or in none.
    const auto defined = static_cast<size_t>(
        std::count_if(pieces.begin(), pieces.end(), [](const torch::Tensor& t) {
          return t.defined();
        }));
    if (defined == 0) {
      out.emplace_back();
      continue;
    }
    if (defined < pieces.size()) {
      const auto undefined = std::find_if(
          pieces.begin(), pieces.end(), [](const torch::Tensor& t) {
            return !t.defined();
          });
      TORCH_CHECK_VALUE(
          false,
          "gather: tensor ",
          k,
          " is undefined in micro-batch ",
          undefined - pieces.begin(),
          " but defined in others; it must be undefined in every "
          "micro-batch or in none");
    }
    // What cat would promote or refuse without saying which micro-batch.
    const auto& first = pieces[0];
    for (const auto i : c10::irange(pieces.size())) {
      const auto& t = pieces[i];
      TORCH_CHECK_VALUE(
          t.dim() > 0,
          "gather: tensor ",
          k,
          " of micro-batch ",
          i,
          " has no dimensions; micro-batches are joined along dim 0 (the "
          "batch)");
      TORCH_CHECK_VALUE(
          t.scalar_type() == first.scalar_type(),
          "gather: tensor ",
          k,
          " of micro-batch ",
          i,
          " is ",
          t.scalar_type(),
          ", but micro-batch 0's is ",
          first.scalar_type());
      TORCH_CHECK_VALUE(
          t.dim() == first.dim() &&
              t.sizes().slice(1) == first.sizes().slice(1),
          "gather: tensor ",
          k,
          " of micro-batch ",
          i,
          " has shape ",
          t.sizes(),
          ", but micro-batch 0's has ",
          first.sizes(),
          "; they may differ only in dim 0 (the rows)");
    }
    out.push_back(torch::cat(pieces, /*dim=*/0));
  }
  return out;
}

}  // namespace gpipe
