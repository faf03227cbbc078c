#pragma once

// The U-Net of the speed tables, shared by the single-process section
// (unet.cpp) and the one across ranks (unet_dist.cpp), so that both time
// the same model on the same batch.

#include <gpipe/gpipe.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

namespace gpipe::bench {

/// U-Net(2, 16) on a batch of 64 images of 3x64x64 against a 1x64x64
/// target, trained with the mean squared error.
struct UNetSpeedCase {
  static constexpr int64_t B = 2;
  static constexpr int64_t C = 16;
  static constexpr int64_t batch = 64;
  static constexpr int64_t image = 64;
  torch::Tensor x;
  torch::Tensor y;

  /// One intra-op thread; the batch from seed 0. Builds a GPipe once: its
  /// lanes set malloc up for the whole process (Note [Lanes and glibc's
  /// malloc]), so that every row, the plain model's included, runs with the
  /// same malloc.
  UNetSpeedCase() {
    at::set_num_threads(1);
    torch::manual_seed(0);
    x = torch::randn({batch, 3, image, image});
    y = torch::randn({batch, 1, image, image});
    GPipe first(make(), GPipeOptions({static_cast<int64_t>(make()->size())}));
  }

  /// The model, with the same initial weights at every call (seed 0).
  static torch::nn::Sequential make() {
    torch::manual_seed(0);
    return models::unet(B, C, 3, 1);
  }

  static torch::Tensor loss(torch::Tensor out, torch::Tensor target) {
    return torch::mse_loss(out, target);
  }

  static nlohmann::json model_json() {
    return {{"B", B}, {"C", C}, {"batch", batch}, {"image", image}};
  }
};

}  // namespace gpipe::bench
