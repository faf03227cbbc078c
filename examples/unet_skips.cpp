// A U-Net from gpipe::models (installed with gpipe) through a pipeline of 2
// partitions whose boundary its skip connections cross: the stashed tensors
// go straight from one partition to the other, and the loss matches the
// plain model's.

#include <gpipe/gpipe.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>

int main() {
  torch::manual_seed(0);
  auto net = gpipe::models::unet(
      /*B=*/1,
      /*C=*/4,
      /*in_channels=*/1,
      /*out_channels=*/2,
      gpipe::models::UNetOptions().dropout(0.0));
  net->to(torch::kFloat64);
  const auto layers = static_cast<int64_t>(net->size());
  const auto balance = gpipe::balance_by_time(
      2, net, torch::randn({2, 1, 32, 32}, torch::kFloat64), 0.2);
  std::cout << layers << " layers, balance [" << balance[0] << ", "
            << balance[1] << "]\n";

  auto x = torch::randn({8, 1, 32, 32}, torch::kFloat64);
  auto y = torch::randint(0, 2, {8, 32, 32});
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  const auto plain = loss_fn(net->forward(x), y).item<double>();

  gpipe::GPipe model(net, gpipe::GPipeOptions(balance).chunks(4));
  const auto piped = model->train_step(x, y, loss_fn, gpipe::Schedule::OneFOneB)
                         .item<double>();
  std::cout << "loss " << piped << " (plain model: " << plain << ")\n";
  return std::abs(piped - plain) < 1e-9 ? 0 : 1;
}
