// gpipe-bench's inference section: forward under InferenceMode of the speed
// model, plain on 1 and 2 threads and through 2 partitions at chunks 1, 4
// and 8, in samples per second.

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

nlohmann::json inference_section(
    int64_t blocks, int64_t width, int64_t batch, int iters) {
  using nlohmann::json;
  auto net = mlp(blocks, width);
  auto x = torch::randn({batch, width});
  json inference = json::array();
  std::printf(
      "\n# inference: %lld x (Linear(%lld,%lld)+ReLU), batch %lld, "
      "InferenceMode\n",
      (long long)blocks,
      (long long)width,
      (long long)width,
      (long long)batch);
  std::printf(
      "%-22s %10s %12s %10s\n", "config", "ms", "samples/s", "vs_plain1");
  double plain1 = 0;
  auto report = [&](const std::string& name, double t) {
    if (plain1 == 0) {
      plain1 = t;
    }
    std::printf(
        "%-22s %10.1f %12.1f %10.3f\n",
        name.c_str(),
        t * 1e3,
        batch / t,
        plain1 / t);
    inference.push_back(
        {{"config", name},
         {"seconds", t},
         {"samples_per_second", batch / t},
         {"speedup_vs_plain_1t", plain1 / t}});
  };
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    report(
        "plain-" + std::to_string(threads) + "t",
        time_median(
            [&] {
              c10::InferenceMode guard;
              net->forward(x);
            },
            2,
            iters));
  }
  at::set_num_threads(1);
  for (const int64_t chunks : chunk_counts_of(x.size(0), {1, 4, 8})) {
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions({blocks, blocks})
            .chunks(chunks)
            .threads_per_lane(1));
    report(
        "gpipe-2p-chunks" + std::to_string(chunks),
        time_median(
            [&] {
              c10::InferenceMode guard;
              model->forward(x);
            },
            2,
            iters));
  }
  return inference;
}

}  // namespace gpipe::bench
