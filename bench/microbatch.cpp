// gpipe-bench --only microbatch: why m micro-batches cost more than one
// mini-batch on this CPU, with no engine involved. The speed model's
// training step, done as m micro-batches one after the other on one
// thread (what one lane does), split into its matrix products, the
// gradient accumulation between micro-batches, and the rest (elementwise
// layers, per-operation costs); then the two cheap changes within reach:
// micro-batch rows aligned to the GEMM kernel's blocking, and the weight
// gradients of all micro-batches as one product instead of m.

#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <vector>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using nlohmann::json;

double ms(double seconds) {
  return seconds * 1e3;
}

// Seconds of one forward and backward of `net` on `rows` x width.
double step_seconds(
    torch::nn::Sequential& net, const torch::Tensor& x, int64_t m, int iters) {
  const auto pieces = x.chunk(m);
  return time_median(
      [&] {
        net->zero_grad();
        for (const auto& piece : pieces) {
          net->forward(piece).pow(2).mean().backward();
        }
      },
      1,
      iters);
}

}  // namespace

json microbatch_section(
    int64_t blocks, int64_t width, int64_t batch, int iters) {
  at::set_num_threads(1);
  torch::manual_seed(0);
  auto net = mlp(blocks, width);
  auto x = torch::randn({batch, width});
  // One weight per layer, as in the model: a product reads its weight
  // from memory as the layer's does, not from a cache one weight fills.
  std::vector<torch::Tensor> ws;
  for (int64_t k = 0; k < blocks; ++k) {
    ws.push_back(torch::randn({width, width}));
  }
  auto grad = torch::randn({width, width});
  const double layer_flops = 2.0 * width * width;  // per row, per product
  std::printf(
      "\n# microbatch: %lld x (Linear(%lld,%lld)+ReLU), batch %lld, one "
      "thread, the plain model's training step as m micro-batches in turn; "
      "the three products of each Linear (forward, input gradient, weight "
      "gradient) timed alone, and the gradient accumulation (m - 1 adds per "
      "weight)\n",
      (long long)blocks,
      (long long)width,
      (long long)width,
      (long long)batch);
  std::printf(
      "%6s %6s %9s %8s %9s %9s %9s %8s %8s %8s\n",
      "chunks",
      "rows",
      "step_ms",
      "vs_m1",
      "gemm_ms",
      "accum_ms",
      "rest_ms",
      "fwd_GF",
      "dx_GF",
      "dw_GF");
  json rows = json::array();
  double step1 = 0;
  const double add_s = time_median([&] { grad.add_(ws[0]); }, 3, 3 * iters);
  // Seconds of `product` of every layer's weight, once each.
  auto per_layer =
      [&](const std::function<void(const torch::Tensor&)>& product) {
        return time_median(
                   [&] {
                     for (const auto& w : ws) {
                       product(w);
                     }
                   },
                   2,
                   3 * iters) /
               double(blocks);
      };
  for (int64_t m : {1, 2, 4, 8, 16, 32}) {
    // The products are timed on micro-batches of batch / m rows: a count
    // that does not cut the batch evenly would time others than the step.
    if (batch % m != 0) {
      std::printf(
          "# chunks %lld left out: %lld rows do not cut into %lld equal "
          "micro-batches\n",
          (long long)m,
          (long long)batch,
          (long long)m);
      continue;
    }
    const int64_t r = batch / m;
    auto xr = torch::randn({r, width});
    auto gr = torch::randn({r, width});
    const double fwd =
        per_layer([&](const torch::Tensor& w) { torch::mm(xr, w.t()); });
    const double dx =
        per_layer([&](const torch::Tensor& w) { torch::mm(gr, w); });
    // The weight's gradient reads no weight; its inputs stay in cache.
    const double dw =
        per_layer([&](const torch::Tensor&) { torch::mm(gr.t(), xr); });
    const double step = step_seconds(net, x, m, iters);
    if (m == 1) {
      step1 = step;
    }
    // The first Linear's input needs no gradient: blocks - 1 input
    // gradients per micro-batch.
    const double gemm =
        (fwd + dw) * double(m * blocks) + dx * double(m * (blocks - 1));
    const double accumulate = add_s * double((m - 1) * blocks);
    const double flops = layer_flops * double(r) / 1e9;
    const double rest = step - gemm - accumulate;
    std::printf(
        "%6lld %6lld %9.1f %8.3f %9.1f %9.1f %9.1f %8.1f %8.1f %8.1f\n",
        (long long)m,
        (long long)r,
        ms(step),
        step1 / step,
        ms(gemm),
        ms(accumulate),
        ms(rest),
        flops / fwd,
        flops / dx,
        flops / dw);
    rows.push_back(
        {{"chunks", m},
         {"rows", r},
         {"step_ms", ms(step)},
         {"speed_vs_chunks_1", step1 / step},
         {"gemm_ms", ms(gemm)},
         {"accumulate_ms", ms(accumulate)},
         {"rest_ms", ms(rest)},
         {"forward_gflops", flops / fwd},
         {"input_grad_gflops", flops / dx},
         {"weight_grad_gflops", flops / dw}});
  }

  // Aligned rows: the time per sample of a whole step at one micro-batch of
  // `r` rows, for r around multiples of the kernel's blocking.
  std::printf(
      "\n# microbatch rows: the training step's time per sample at one "
      "micro-batch of r rows (does a multiple of 8 or 16 rows help?)\n");
  std::printf("%6s %12s %12s\n", "rows", "us_per_row", "vs_32_rows");
  json aligned = json::array();
  double per_row_32 = 0;
  for (int64_t r : {32, 24, 31, 33, 40, 48, 63, 64, 65}) {
    auto xr = torch::randn({r, width});
    const double per_row = step_seconds(net, xr, 1, 3 * iters) / double(r);
    if (r == 32) {
      per_row_32 = per_row;
    }
    std::printf(
        "%6lld %12.1f %12.3f\n",
        (long long)r,
        per_row * 1e6,
        per_row_32 / per_row);
    aligned.push_back(
        {{"rows", r},
         {"us_per_row", per_row * 1e6},
         {"speed_vs_32_rows", per_row_32 / per_row}});
  }

  // One weight gradient for all micro-batches: m products of K = rows plus
  // m - 1 adds, against gathering the m inputs and output gradients and one
  // product of K = batch (as a deferred weight-gradient pass could).
  std::printf(
      "\n# microbatch weight gradients: one Linear's weight gradient over "
      "m micro-batches, m products + (m - 1) adds against one product over "
      "the gathered batch (gathering included)\n");
  std::printf(
      "%6s %14s %14s %9s\n", "chunks", "per_micro_us", "gathered_us", "gain");
  json gathered = json::array();
  for (int64_t m : {4, 8, 16, 32}) {
    if (batch % m != 0) {
      continue;  // (as above)
    }
    const int64_t r = batch / m;
    std::vector<torch::Tensor> xs;
    std::vector<torch::Tensor> gs;
    for (int64_t k = 0; k < m; ++k) {
      xs.push_back(torch::randn({r, width}));
      gs.push_back(torch::randn({r, width}));
    }
    auto [separate, together] = time_paired(
        [&] {
          auto acc = torch::mm(gs[0].t(), xs[0]);
          for (int64_t k = 1; k < m; ++k) {
            acc.add_(torch::mm(gs[k].t(), xs[k]));
          }
        },
        [&] { torch::mm(torch::cat(gs).t(), torch::cat(xs)); },
        2,
        3 * iters);
    std::printf(
        "%6lld %14.1f %14.1f %9.3f\n",
        (long long)m,
        separate * 1e6,
        together * 1e6,
        separate / together);
    gathered.push_back(
        {{"chunks", m},
         {"per_micro_batch_us", separate * 1e6},
         {"gathered_us", together * 1e6},
         {"speed_up", separate / together}});
  }
  return {
      {"model",
       {{"blocks", blocks},
        {"width", width},
        {"batch", batch},
        {"add_us", add_s * 1e6}}},
      {"rows", rows},
      {"aligned_rows", aligned},
      {"gathered_weight_gradients", gathered}};
}

}  // namespace gpipe::bench
