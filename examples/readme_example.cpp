#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(784, 512),
      torch::nn::ReLU(),
      torch::nn::Linear(512, 512),
      torch::nn::ReLU(),
      torch::nn::Linear(512, 10));
  gpipe::GPipe model(
      net,
      gpipe::GPipeOptions({3, 2})  // layers per partition
          .chunks(8)               // micro-batches per mini-batch
          .checkpoint(gpipe::Checkpoint::ExceptLast));
  torch::optim::SGD opt(model->parameters(), 0.1);

  auto x = torch::randn({64, 784});
  auto y = torch::randint(0, 10, {64});
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    auto out = model->forward(x);  // net->forward(x)'s values
    auto loss = torch::nn::functional::cross_entropy(
        out, y.to(model->devices().back()));
    loss.backward();  // the pipelined backward
    opt.step();
    std::cout << "step " << step << " loss " << loss.item<double>() << "\n";
  }

  // The same step with the loss inside the pipeline, under 1F1B.
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  opt.zero_grad();
  auto loss = model->train_step(x, y, loss_fn, gpipe::Schedule::OneFOneB);
  opt.step();
  std::cout << "train_step loss " << loss.item<double>() << "\n";
}
