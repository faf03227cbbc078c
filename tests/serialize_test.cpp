// Weights between a GPipe and the plain Sequential, through files: either
// archive into either model, any balance, parameters and BatchNorm buffers.

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <utility>

#include "common.h"

namespace gpipe {
namespace {

class SerializeTest : public testing::SeededTest {
 protected:
  void TearDown() override {
    for (const auto& p : paths_) {
      std::remove(p.c_str());
    }
  }
  std::string path(const std::string& name) {
    paths_.push_back(
        ::testing::TempDir() + "gpipe_serialize_" + std::to_string(::getpid()) +
        "_" + name);
    return paths_.back();
  }

 private:
  std::vector<std::string> paths_;
};

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(
      torch::nn::Linear(5, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::ReLU(),
      torch::nn::Linear(8, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::Linear(torch::nn::LinearOptions(8, 3).bias(false)));
}

// Trains a little so that weights and running statistics are not the
// initial ones.
void train(
    torch::nn::Module& module,
    const std::function<torch::Tensor(torch::Tensor)>& f) {
  torch::optim::SGD opt(module.parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    f(torch::randn({16, 5})).pow(2).mean().backward();
    opt.step();
  }
}

void expect_same_state(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t k = 0; k < pa.size(); ++k) {
    EXPECT_TRUE(torch::equal(pa[k].value(), pb[k].value())) << pa[k].key();
  }
  auto ba = a.buffers();
  auto bb = b.buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (size_t k = 0; k < ba.size(); ++k) {
    EXPECT_TRUE(torch::equal(ba[k], bb[k])) << "buffer " << k;
  }
}

TEST_F(SerializeTest, GPipeArchiveLoadsIntoThePlainSequential) {
  auto net = make_net();
  GPipe model(net, GPipeOptions({2, 2, 2}).chunks(2));
  train(*model, [&](torch::Tensor x) { return model->forward(x); });
  const auto file = path("gpipe.pt");
  torch::save(model, file);

  auto plain = make_net();
  // What users try first does not work: the names differ.
  EXPECT_THROW(torch::load(plain, file), c10::Error);
  load_into_sequential(plain, file);
  expect_same_state(*net, *plain);  // net is the GPipe's layers
  net->eval();
  plain->eval();
  auto x = torch::randn({4, 5});
  EXPECT_TRUE(torch::equal(plain->forward(x), net->forward(x)));
}

TEST_F(SerializeTest, PlainArchiveLoadsIntoAGPipeOfAnyBalance) {
  auto net = make_net();
  train(*net, [&](torch::Tensor x) { return net->forward(x); });
  const auto file = path("plain.pt");
  torch::save(net, file);
  for (const auto& balance :
       {std::vector<int64_t>{6},
        std::vector<int64_t>{1, 5},
        std::vector<int64_t>{2, 2, 1, 1}}) {
    GPipe model(make_net(), GPipeOptions(balance).chunks(2));
    load_into_gpipe(model, file);
    expect_same_state(*net, *model);
  }
}

TEST_F(SerializeTest, GPipeArchiveLoadsIntoAnotherBalance) {
  auto net = make_net();
  GPipe four(net, GPipeOptions({1, 2, 2, 1}).chunks(4));
  train(*four, [&](torch::Tensor x) { return four->forward(x); });
  const auto file = path("four.pt");
  torch::save(four, file);
  GPipe two(make_net(), GPipeOptions({3, 3}).chunks(2));
  load_into_gpipe(two, file);
  expect_same_state(*four, *two);
}

// A Functional layer (the guide's advice for a functional step) is not
// serializable: Module::save leaves it out of the archive, and
// Module::load does not look for it. The loaders required an entry for
// every layer ("has no layer '1'") and every child ("has no module
// '0.act'") and refused every archive of such a model.
struct WithActivationImpl : torch::nn::Module {
  WithActivationImpl() {
    linear = register_module("linear", torch::nn::Linear(5, 5));
    act = register_module("act", torch::nn::Functional(torch::relu));
  }
  torch::Tensor forward(torch::Tensor x) {
    return act(linear(x));
  }
  torch::nn::Linear linear{nullptr};
  torch::nn::Functional act{nullptr};
};
TORCH_MODULE(WithActivation);

torch::nn::Sequential net_with_functionals() {
  return torch::nn::Sequential(
      WithActivation(),
      torch::nn::Functional(torch::tanh),
      torch::nn::Linear(5, 3));
}

TEST_F(SerializeTest, ArchivesOfModelsWithFunctionalLayersLoad) {
  auto net = net_with_functionals();
  GPipe model(net, GPipeOptions({2, 1}).chunks(2));
  train(*model, [&](torch::Tensor x) { return model->forward(x); });
  const auto of_gpipe = path("functional_gpipe.pt");
  const auto of_plain = path("functional_plain.pt");
  torch::save(model, of_gpipe);
  torch::save(net, of_plain);
  for (const auto& file : {of_gpipe, of_plain}) {
    auto plain = net_with_functionals();
    load_into_sequential(plain, file);
    expect_same_state(*net, *plain);
    GPipe other(net_with_functionals(), GPipeOptions({1, 2}).chunks(2));
    load_into_gpipe(other, file);
    expect_same_state(*net, *other);
  }
}

TEST_F(SerializeTest, SaveAsSequentialLoadsWithTorchLoad) {
  auto net = make_net();
  GPipe model(net, GPipeOptions({3, 3}).chunks(2));
  train(*model, [&](torch::Tensor x) { return model->forward(x); });
  const auto file = path("as_plain.pt");
  save_as_sequential(model, file);
  auto plain = make_net();
  torch::load(plain, file);  // no gpipe involved
  expect_same_state(*net, *plain);
}

TEST_F(SerializeTest, AnotherModelIsRefusedAndLeftUnchanged) {
  auto net = make_net();
  const auto file = path("small.pt");
  torch::save(net, file);
  auto error_of = [&](torch::nn::Sequential other) -> std::string {
    auto before = other->parameters()[0].clone();
    try {
      load_into_sequential(other, file);
    } catch (const c10::ValueError& e) {
      EXPECT_TRUE(torch::equal(other->parameters()[0], before));
      return e.what_without_backtrace();
    }
    return "no error";
  };
  // A wider layer 3: shapes differ.
  auto wider = torch::nn::Sequential(
      torch::nn::Linear(5, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::ReLU(),
      torch::nn::Linear(8, 9),
      torch::nn::BatchNorm1d(9),
      torch::nn::Linear(torch::nn::LinearOptions(9, 3).bias(false)));
  auto message = error_of(wider);
  EXPECT_NE(
      message.find("'3.weight' of shape [8, 8], but the model's is [9, 8]"),
      std::string::npos)
      << message;
  // One layer more.
  auto longer = make_net();
  longer->push_back(torch::nn::Linear(3, 3));
  message = error_of(longer);
  EXPECT_NE(message.find("has no layer '6'"), std::string::npos) << message;
  // One layer less.
  auto shorter = torch::nn::Sequential(
      torch::nn::Linear(5, 8), torch::nn::BatchNorm1d(8), torch::nn::ReLU());
  message = error_of(shorter);
  EXPECT_NE(
      message.find("has layer '3', which the model does not have"),
      std::string::npos)
      << message;
  // A bias where the archive has none.
  auto with_bias = torch::nn::Sequential(
      torch::nn::Linear(5, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::ReLU(),
      torch::nn::Linear(8, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::Linear(8, 3));
  message = error_of(with_bias);
  EXPECT_NE(message.find("no tensor '5.bias'"), std::string::npos) << message;
  EXPECT_THROW(load_into_sequential(net, path("missing.pt")), c10::Error);
}

TEST_F(SerializeTest, AnUnreadableFileIsNamedWithWhatWasExpected) {
  auto net = make_net();
  const auto saved = path("whole.pt");
  torch::save(net, saved);
  std::string bytes;
  {
    std::ifstream in(saved, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto empty = path("empty.pt");
  std::ofstream(empty).close();
  const auto truncated = path("truncated.pt");
  std::ofstream(truncated, std::ios::binary)
      << bytes.substr(0, bytes.size() / 2);
  const auto text = path("text.pt");
  std::ofstream(text) << "not an archive\n";
  const auto missing = path("missing.pt");
  const std::pair<std::string, std::string> cases[] = {
      {missing, "there is no such file"},
      {empty, "the file is empty"},
      {truncated, "it is truncated or not such an archive"},
      {text, "it is truncated or not such an archive"},
      {::testing::TempDir(), "it is not a regular file"}};
  for (const auto& [file, why] : cases) {
    for (const bool into_gpipe : {false, true}) {
      std::string msg = "no error";
      auto before = net->parameters()[0].clone();
      try {
        if (into_gpipe) {
          GPipe model(make_net(), GPipeOptions({3, 3}));
          load_into_gpipe(model, file);
        } else {
          load_into_sequential(net, file);
        }
      } catch (const c10::ValueError& e) {
        msg = e.what_without_backtrace();
      }
      EXPECT_NE(msg.find("cannot read '" + file + "'"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
      EXPECT_NE(
          msg.find("expected an archive written by torch::save"),
          std::string::npos)
          << msg;
      EXPECT_TRUE(torch::equal(net->parameters()[0], before));
    }
  }
}

}  // namespace
}  // namespace gpipe
