// The transport seam: the engine moves every activation, gradient and skip
// through a Transport, so another transport (as one over c10d will be)
// plugs in without touching stage or plan code.

#include <atomic>

#include "common.h"
#include "engine/in_process_transport.h"
#include "engine/pipeline.h"

namespace {

using gpipe::Phase;
using gpipe::detail::InProcessTransport;
using gpipe::detail::Packet;
using gpipe::detail::Transport;

// What a wire does: every tensor arrives as a copy, sharing nothing with
// the sender but the values and the requires_grad flag.
torch::Tensor over_the_wire(const torch::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  auto copy = t.detach().clone();
  if (t.requires_grad()) {
    copy.requires_grad_(true);
  }
  return copy;
}

class CopyingTransport final : public Transport {
 public:
  CopyingTransport(int64_t m, int64_t n, std::atomic<int>& messages)
      : inner_(m, n), messages_(messages) {}
  void send(Phase phase, int64_t i, int64_t k, Packet packet) override {
    ++messages_;
    for (auto& t : packet.tensors) {
      t = over_the_wire(t);
    }
    inner_.send(phase, i, k, std::move(packet));
  }
  Packet recv(Phase phase, int64_t i, int64_t k) override {
    return inner_.recv(phase, i, k);
  }
  void send_skip(
      Phase phase,
      int64_t i,
      const gpipe::SkipKey& key,
      torch::Tensor t) override {
    ++messages_;
    inner_.send_skip(phase, i, key, over_the_wire(t));
  }
  torch::Tensor recv_skip(
      Phase phase, int64_t i, const gpipe::SkipKey& key) override {
    return inner_.recv_skip(phase, i, key);
  }
  void abort() override {
    inner_.abort();
  }
  bool aborted() const override {
    return inner_.aborted();
  }

 private:
  InProcessTransport inner_;
  std::atomic<int>& messages_;
};

class TransportTest : public gpipe::testing::SeededTest {};

TEST_F(TransportTest, AnotherTransportGivesThePlainModelsGradients) {
  // The plain model and the partitions share the layers: the plain
  // model's gradients are taken first, then cleared.
  torch::nn::Linear l0(4, 6), l2(6, 6), l4(6, 2);
  torch::nn::Sequential plain(l0, torch::nn::Tanh(), l2, torch::nn::Tanh(), l4);
  plain->to(torch::kFloat64);
  auto x = torch::randn({6, 4}, torch::kFloat64);
  plain->forward(x).pow(2).sum().backward();
  auto a = gpipe::testing::grads_of(*plain);
  plain->zero_grad();

  std::vector<torch::nn::Sequential> parts{
      torch::nn::Sequential(l0, torch::nn::Tanh()),
      torch::nn::Sequential(l2, torch::nn::Tanh()),
      torch::nn::Sequential(l4)};
  auto pipeline = std::make_shared<gpipe::detail::Pipeline>(
      parts, std::vector<torch::Device>(3, torch::kCPU), 1);
  std::atomic<int> messages{0};
  pipeline->set_transport_factory([&](int64_t m, int64_t n) {
    return std::make_unique<CopyingTransport>(m, n, messages);
  });
  std::vector<Packet> inputs;
  for (auto& b : gpipe::scatter({x}, 3)) {
    inputs.push_back(Packet{b, true});
  }
  gpipe::detail::PassOptions options;
  options.checkpoint_stop = 2;  // except_last
  auto out = pipeline->forward(std::move(inputs), {x}, options);
  out.tensors.at(0).pow(2).sum().backward();
  // 3 micro-batches x 4 boundaries, each way.
  EXPECT_EQ(messages.load(), 2 * 3 * 4);
  auto b = gpipe::testing::grads_of(*plain);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-10, 1e-12)) << "parameter " << k;
  }
}

}  // namespace
