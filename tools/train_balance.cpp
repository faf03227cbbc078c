// gpipe-train's balance: --balance parsed, and when it is not given,
// balance_by_time on one micro-batch of training images, chosen on rank 0
// and sent to the others under a launcher, printed with the per-layer times
// it came from.

#include <ATen/CPUGeneratorImpl.h>
#include <gpipe/balance.h>
#include <gpipe/dist.h>
#include <torch/torch.h>

#include <charconv>
#include <cstdio>
#include <sstream>

#include "train_args.h"

namespace gpipe_train {

std::vector<int64_t> even_balance(int64_t layers, int64_t partitions) {
  std::vector<int64_t> balance(partitions, layers / partitions);
  for (int64_t k = 0; k < layers % partitions; ++k) {
    balance[partitions - 1 - k] += 1;
  }
  return balance;
}

// Parses --balance: positive decimal integers separated by commas, e.g. 6,7.
// Unlike std::getline, keeps a trailing empty entry ("6,7,") to refuse it.
std::vector<int64_t> parse_balance(const std::string& text) {
  constexpr const char* kExpected =
      "; expected layers per partition as positive integers separated by "
      "commas, e.g. 6,7";
  usage_check(!text.empty(), "--balance is empty", kExpected);
  std::vector<int64_t> balance;
  size_t begin = 0;
  while (true) {
    const auto end = std::min(text.find(',', begin), text.size());
    const auto item = text.substr(begin, end - begin);
    const auto entry = balance.size() + 1;
    usage_check(
        !item.empty(),
        "--balance '",
        text,
        "': entry ",
        entry,
        " is empty",
        kExpected);
    int64_t value = 0;
    const auto [rest, error] =
        std::from_chars(item.data(), item.data() + item.size(), value);
    usage_check(
        error == std::errc() && rest == item.data() + item.size(),
        "--balance '",
        text,
        "': entry ",
        entry,
        " ('",
        item,
        "') is not a 64-bit integer",
        kExpected);
    usage_check(
        value >= 1,
        "--balance '",
        text,
        "': entry ",
        entry,
        " is ",
        value,
        ", but every partition needs at least one layer");
    balance.push_back(value);
    if (end == text.size()) {
      return balance;
    }
    begin = end + 1;
  }
}

std::vector<int64_t> choose_balance(
    const Args& args,
    const torch::nn::Sequential& net,
    const torch::Tensor& images,
    const gpipe::dist::World* world) {
  const auto partitions = static_cast<int64_t>(args.balance.size());
  std::vector<int64_t> balance(partitions, 0);
  std::vector<double> costs;
  // What each cell runs: a micro-batch of a replica's shard of a batch (of
  // a batch no larger than the training set: --limit 10 makes
  // micro-batches of 3).
  const int64_t replicas =
      world == nullptr ? 1 : world->size() / args.pipeline_size;
  const auto batch = std::min<int64_t>(images.size(0), args.batch_size);
  const auto shard = std::max<int64_t>(1, batch / replicas);
  const auto rows = (shard + args.chunks - 1) / args.chunks;
  if (world == nullptr || world->rank() == 0) {
    // Profiling must not move the random stream: a run with --balance
    // given draws the same batches and masks.
    auto generator = at::detail::getDefaultCPUGenerator();
    const auto state = generator.get_state();
    costs = gpipe::profile_times(net, images.narrow(0, 0, rows), 0.5);
    generator.set_state(state);
    balance = gpipe::balance_cost(costs, partitions);
  }
  if (world != nullptr) {
    auto shared = torch::tensor(balance, torch::kLong);
    world->broadcast(shared, 0);
    const auto* b = shared.data_ptr<int64_t>();
    balance.assign(b, b + partitions);
  }
  if (!costs.empty()) {
    std::ostringstream text;
    text << "balance_by_time chose " << c10::IntArrayRef(balance)
         << " from per-layer ms (forward + backward of " << rows << " images):";
    for (const auto c : costs) {
      text << ' ' << std::fixed;
      text.precision(2);
      text << c * 1000.0;
    }
    std::fprintf(text_out(args), "%s\n", text.str().c_str());
    std::fflush(text_out(args));
  }
  return balance;
}

}  // namespace gpipe_train
