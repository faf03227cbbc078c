// gpipe-bench --only trace: what recording a gpipe::Trace costs a training
// step, measured as step times with the trace on and off in alternation,
// and the cost of one recorded event alone.

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>

#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

nlohmann::json trace_section(
    int64_t blocks, int64_t width, int64_t batch, int iters) {
  using gpipe::Checkpoint;
  using nlohmann::json;
  json result;
  at::set_num_threads(1);
  json traces = json::array();
  std::printf(
      "\n# tracing cost: training step with a trace recording vs none, "
      "checkpoint never\n");
  std::printf(
      "%-34s %10s %10s %8s %8s\n",
      "model",
      "off_ms",
      "on_ms",
      "cost_%",
      "events");
  struct Case {
    std::string name;
    torch::nn::Sequential net;
    torch::Tensor x;
    int64_t chunks;
    int pairs;
  };
  // The most micro-batches up to 8 that the batch cuts into (Tensor::chunk
  // cuts 9 rows asked for 8 into 5): a count it does not would run fewer
  // under its label.
  int64_t m = std::min<int64_t>(8, batch);
  while (m > 1 && pieces_of(batch, m) != m) {
    --m;
  }
  std::vector<Case> cases{
      {c10::str(blocks, "x(Linear(", width, ")+ReLU) b", batch, " c", m),
       mlp(blocks, width),
       torch::randn({batch, width}),
       m,
       4 * iters + 1},
      {"16x(Linear(64)+ReLU) b128 c32",
       mlp(16, 64),
       torch::randn({128, 64}),
       32,
       201}};
  for (auto& c : cases) {
    const auto layers = static_cast<int64_t>(c.net->size());
    gpipe::GPipe model(
        c.net,
        gpipe::GPipeOptions({layers / 2, layers - layers / 2})
            .chunks(c.chunks)
            .checkpoint(Checkpoint::Never)
            .threads_per_lane(1));
    auto trace = std::make_shared<gpipe::Trace>();
    auto& x = c.x;
    auto off = [&] {
      model->zero_grad();
      model->forward(x).pow(2).mean().backward();
    };
    auto on = [&] {
      model->set_trace(trace);
      model->zero_grad();
      model->forward(x).pow(2).mean().backward();
      model->set_trace(nullptr);
    };
    const auto [t_off, t_on] = gpipe::bench::time_paired(off, on, 2, c.pairs);
    const auto per_step = trace->events().size() / (c.pairs + 2);
    std::printf(
        "%-34s %10.2f %10.2f %8.2f %8zu\n",
        c.name.c_str(),
        t_off * 1e3,
        t_on * 1e3,
        (t_on / t_off - 1) * 100,
        per_step);
    traces.push_back(
        {{"model", c.name},
         {"off_seconds", t_off},
         {"on_seconds", t_on},
         {"cost_fraction", t_on / t_off - 1},
         {"events_per_step", per_step}});
  }
  // The cost of one recorded event, measured alone: the step-time
  // differences above are within the machine's noise, this is not.
  {
    gpipe::Trace trace;
    const int events = 200000;
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < events; ++k) {
      // A cell's start and end, as the runner reads them.
      const auto begin = std::chrono::steady_clock::now();
      const auto end = std::chrono::steady_clock::now();
      trace.record(k % 2, k % 8, gpipe::TraceKind::Forward, begin, end);
    }
    const double per_event =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count() /
        events;
    const double step = traces[0]["off_seconds"].get<double>();
    const double per_step = traces[0]["events_per_step"].get<double>();
    std::printf(
        "# one recorded event (two clock reads and a locked append): %.0f "
        "ns; x %.0f events per step of the speed model = %.4f%% of its "
        "step\n",
        per_event * 1e9,
        per_step,
        per_event * per_step / step * 100);
    result["event_seconds"] = per_event;
  }
  result["trace"] = traces;
  return result;
}

}  // namespace gpipe::bench
