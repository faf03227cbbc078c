#pragma once

// Layers shared by the reference models (private to gpipe_models).

#include <gpipe/skip.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <ostream>
#include <string>

namespace gpipe::models::detail {

/// Stashes its input under `name` and passes it on unchanged.
class StashImpl : public torch::nn::Cloneable<StashImpl>, public Skippable {
 public:
  explicit StashImpl(const std::string& name)
      : Skippable(/*stash=*/{name}, /*pop=*/{}), name_(name) {}

  void reset() override {}

  torch::Tensor forward(torch::Tensor input) {
    stash(name_, input);
    return input;
  }

  void pretty_print(std::ostream& stream) const override {
    stream << "gpipe::models::Stash(" << name_ << ")";
  }

 private:
  std::string name_;
};
TORCH_MODULE(Stash);

}  // namespace gpipe::models::detail
