// gpipe-bench's distributed section, run as `gpipe-run -n 2 -- gpipe-bench
// --only dist`: a training step of PipelineStage on 2 ranks against the
// single-process GPipe with a lane per rank on the same model and batch (timed
// in alternation, one intra-op thread per lane or rank), the cost of one gpipe
// message against a bare c10d send/recv of the same tensor, and a timeline of
// one distributed step.

#include <gpipe/dist.h>
#include <gpipe/gpipe.h>
#include <gpipe/trace.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "dist/connection.h"
#include "harness.h"
#include "sections.h"

namespace gpipe::bench {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// In a gathered trace of a pipeline with one stage per rank (lane = rank =
// stage): for each receive that began before its message's producer
// ended, the microseconds from the end of the producing cell (the previous
// rank's forward, or the next rank's backward, of the same micro-batch) to
// the end of the receive. That is what one message adds to the critical
// path: the sender's packing and send, the transport, and the wake-ups of
// the receiving rank's threads.
std::vector<double> hop_latencies_us(const gpipe::Trace& merged) {
  using gpipe::TraceKind;
  std::map<int64_t, std::vector<gpipe::TraceEvent>> by_rank;
  for (const auto& e : merged.events()) {
    by_rank[e.lane].push_back(e);
  }
  for (auto& [rank, events] : by_rank) {
    std::sort(events.begin(), events.end(), [](const auto& a, const auto& b) {
      return a.start_us < b.start_us;
    });
  }
  // The latest end of a cell of `kind` for micro-batch `i` on `rank` no
  // later than `by` (a little slack for the clocks' alignment), or none.
  auto produced = [&](int64_t rank, TraceKind kind, int64_t i, double by) {
    std::optional<double> end;
    auto it = by_rank.find(rank);
    if (it == by_rank.end()) {
      return end;
    }
    for (const auto& e : it->second) {
      if (e.kind == kind && e.micro_batch == i && e.end_us <= by + 50 &&
          (!end || e.end_us > *end)) {
        end = e.end_us;
      }
    }
    return end;
  };
  std::vector<double> hops;
  for (const auto& [rank, events] : by_rank) {
    for (size_t k = 0; k < events.size(); ++k) {
      const auto& r = events[k];
      if (r.kind != TraceKind::Receive) {
        continue;
      }
      // The cell that waited for it: the next forward or backward.
      const gpipe::TraceEvent* cell = nullptr;
      for (size_t c = k + 1; c < events.size() && cell == nullptr; ++c) {
        if (events[c].kind == TraceKind::Forward ||
            events[c].kind == TraceKind::Backward ||
            events[c].kind == TraceKind::Recompute) {
          cell = &events[c];
        }
      }
      if (cell == nullptr) {
        continue;
      }
      const bool forward = cell->kind == TraceKind::Forward;
      const auto end = produced(
          forward ? rank - 1 : rank + 1,
          forward ? TraceKind::Forward : TraceKind::Backward,
          cell->micro_batch,
          r.end_us);
      if (end && r.start_us < *end) {
        hops.push_back(r.end_us - *end);
      }
    }
  }
  return hops;
}

}  // namespace

nlohmann::json dist_section(
    const gpipe::dist::World& world,
    int64_t blocks,
    int64_t width,
    int64_t batch,
    int iters,
    const std::string& trace_prefix) {
  const auto rank = world.rank();
  const auto n = world.size();
  const bool lead = rank == 0;
  nlohmann::json out;
  at::set_num_threads(1);

  // Throughput: the same balanced model, batch and chunks, in one process
  // (rank 0 alone, a lane per rank) and across the ranks.
  const int64_t chunks = 8;
  std::vector<int64_t> balance(n, 2 * blocks / n);
  balance.back() += 2 * blocks - (2 * blocks / n) * n;
  torch::manual_seed(0);
  auto x = torch::randn({batch, width});
  auto y = torch::randn({batch, width});
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::mse_loss(out, target);
  };
  torch::manual_seed(0);
  auto net = mlp(blocks, width);
  gpipe::dist::PipelineStage stage(
      net,
      gpipe::GPipeOptions(balance).chunks(chunks).threads_per_lane(1),
      world);
  std::unique_ptr<gpipe::GPipe> single;
  if (lead) {
    torch::manual_seed(0);
    single = std::make_unique<gpipe::GPipe>(
        mlp(blocks, width),
        gpipe::GPipeOptions(balance).chunks(chunks).threads_per_lane(1));
  }
  auto dist_step = [&] {
    stage->zero_grad();
    stage->train_step(
        rank == 0 ? x : torch::Tensor(),
        rank == n - 1 ? y : torch::Tensor(),
        loss_fn);
  };
  // The same step with the receives posted only when the cell that needs
  // them starts (a plan without transfers), against the default, which
  // posts each a cell early (make_plan(...).with_transfers()).
  const auto late_plan =
      gpipe::make_plan(gpipe::Schedule::FillDrain, chunks, n);
  auto late_step = [&] {
    stage->zero_grad();
    stage->train_step(
        rank == 0 ? x : torch::Tensor(),
        rank == n - 1 ? y : torch::Tensor(),
        loss_fn,
        late_plan);
  };
  auto single_step = [&] {
    if (lead) {
      (*single)->zero_grad();
      (*single)->train_step(x, y, loss_fn);
    }
  };
  std::vector<double> t_single;
  std::vector<double> t_dist;
  std::vector<double> t_late;
  for (int k = 0; k < iters + 2; ++k) {
    world.barrier();
    auto start = Clock::now();
    single_step();
    const double a = seconds_since(start);
    world.barrier();
    start = Clock::now();
    dist_step();
    const double b = seconds_since(start);
    world.barrier();
    start = Clock::now();
    late_step();
    const double c = seconds_since(start);
    if (k >= 2) {  // two rounds of warm-up
      t_single.push_back(a);
      t_dist.push_back(b);
      t_late.push_back(c);
    }
  }
  const double single_s = median(t_single);
  const double dist_s = median(t_dist);
  const double late_s = median(t_late);
  out["throughput"] = {
      {"model",
       std::to_string(blocks) + " x Linear(" + std::to_string(width) +
           ")+ReLU"},
      {"batch", batch},
      {"chunks", chunks},
      {"ranks", n},
      {"single_process_seconds", single_s},
      {"distributed_seconds", dist_s},
      {"ratio", single_s / dist_s},
      {"receives_at_cell_seconds", late_s},
      {"receives_at_cell_ratio", single_s / late_s},
      {"target_ratio", 0.9},
      {"single_process_each", t_single},
      {"distributed_each", t_dist}};

  // One message: gpipe's (header and payload in one c10d message once the
  // layout is agreed) against a bare c10d send/recv of the same tensor,
  // ping-pong between ranks 0 and 1, timed in alternation.
  if (n >= 2 && rank <= 1) {
    auto& connection = *world.connection();
    auto& group = *world.group();
    const int peer = 1 - static_cast<int>(rank);
    auto tensor = torch::randn({256});  // 1 KiB
    const int round_trips = 500;
    const int bare_tag = (15 << 26) + 1;
    const gpipe::dist::detail::MessageId id{
        gpipe::dist::detail::MessageKind::Forward, 0, 0};
    int64_t pass = 1 << 20;  // apart from the stage's passes
    auto bare = [&] {
      std::vector<at::Tensor> t{tensor};
      for (int k = 0; k < round_trips; ++k) {
        if (rank == 0) {
          group.send(t, peer, bare_tag)->wait();
          group.recv(t, peer, bare_tag)->wait();
        } else {
          group.recv(t, peer, bare_tag)->wait();
          group.send(t, peer, bare_tag)->wait();
        }
      }
    };
    auto ours = [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> sends;
      for (int k = 0; k < round_trips; ++k) {
        ++pass;
        if (rank == 0) {
          connection.send(peer, pass, id, {{tensor}, true}, sends);
          connection.wait_sends(sends);
          (void)connection.recv(peer, pass, id);
        } else {
          (void)connection.recv(peer, pass, id);
          connection.send(peer, pass, id, {{tensor}, true}, sends);
          connection.wait_sends(sends);
        }
      }
    };
    std::vector<double> t_bare;
    std::vector<double> t_ours;
    for (int k = 0; k < 7; ++k) {
      auto start = Clock::now();
      bare();
      t_bare.push_back(seconds_since(start) / round_trips / 2);
      start = Clock::now();
      ours();
      t_ours.push_back(seconds_since(start) / round_trips / 2);
    }
    const double bare_s = median(t_bare);
    const double ours_s = median(t_ours);
    out["message"] = {
        {"bytes", 1024},
        {"bare_c10d_one_way_us", bare_s * 1e6},
        {"gpipe_one_way_us", ours_s * 1e6},
        {"ratio", ours_s / bare_s},
        {"target_us", 100},
        {"target_ratio", 1.3}};
  }
  world.barrier();

  // Every schedule at 32 micro-batches: the same pipeline across the ranks
  // and as lanes of one process (rank 0), timed in alternation, with the
  // time a rank's lane waits for others (its trace's receive and send
  // intervals) and its messages per step.
  {
    const int64_t m = 32;
    json rows = json::array();
    for (const auto schedule :
         {gpipe::Schedule::FillDrain,
          gpipe::Schedule::OneFOneB,
          gpipe::Schedule::Interleaved1F1B,
          gpipe::Schedule::ZeroBubble}) {
      const int64_t v = schedule == gpipe::Schedule::Interleaved1F1B ? 2 : 1;
      const int64_t parts = n * v;
      std::vector<int64_t> b(parts, 2 * blocks / parts);
      b.back() += 2 * blocks - (2 * blocks / parts) * parts;
      const auto options =
          gpipe::GPipeOptions(b).chunks(m).stages_per_lane(v).threads_per_lane(
              1);
      torch::manual_seed(0);
      gpipe::dist::PipelineStage s_stage(mlp(blocks, width), options, world);
      std::unique_ptr<gpipe::GPipe> s_single;
      if (lead) {
        torch::manual_seed(0);
        s_single = std::make_unique<gpipe::GPipe>(mlp(blocks, width), options);
      }
      auto d_step = [&] {
        s_stage->zero_grad();
        s_stage->train_step(
            rank == 0 ? x : torch::Tensor(),
            rank == n - 1 ? y : torch::Tensor(),
            loss_fn,
            schedule);
      };
      auto s_step = [&] {
        if (lead) {
          (*s_single)->zero_grad();
          (*s_single)->train_step(x, y, loss_fn, schedule);
        }
      };
      std::vector<double> ts;
      std::vector<double> td;
      std::vector<double> hops;
      // CPU seconds over the timed steps: rank 0's process for the single
      // process, this rank's for the distributed steps (summed over the
      // ranks below).
      double single_cpu = 0;
      double dist_cpu = 0;
      auto trace = std::make_shared<gpipe::Trace>();
      for (int k = 0; k < iters + 1; ++k) {
        world.barrier();
        double cpu = process_cpu_seconds();
        auto start = Clock::now();
        s_step();
        const double a = seconds_since(start);
        if (k >= 1) {
          single_cpu += process_cpu_seconds() - cpu;
        }
        world.barrier();
        if (k == 1) {
          trace->clear();
          s_stage->set_trace(trace);
        }
        cpu = process_cpu_seconds();
        start = Clock::now();
        d_step();
        const double c = seconds_since(start);
        if (k >= 1) {
          dist_cpu += process_cpu_seconds() - cpu;
        }
        if (k == 1) {
          if (v == 1) {
            // Every rank takes part; rank 0 gets every rank's events.
            if (auto merged = gpipe::dist::gather_trace(s_stage)) {
              hops = hop_latencies_us(*merged);
            }
          }
          s_stage->set_trace(nullptr);
        }
        if (k >= 1) {
          ts.push_back(a);
          td.push_back(c);
        }
      }
      double waits = 0;
      int64_t messages = 0;
      for (const auto& e : trace->events()) {
        if (e.kind == gpipe::TraceKind::Receive ||
            e.kind == gpipe::TraceKind::Send) {
          waits += (e.end_us - e.start_us) * 1e-6;
          ++messages;
        }
      }
      auto cpu_sum = torch::tensor({dist_cpu}, torch::kFloat64);
      world.all_reduce(cpu_sum);
      const double timed = static_cast<double>(ts.size());
      const double single = median(ts);
      const double dist = median(td);
      rows.push_back(
          {{"schedule", gpipe::to_string(schedule)},
           {"micro_batches", m},
           {"ranks", n},
           {"single_process_seconds", single},
           {"distributed_seconds", dist},
           {"ratio", single / dist},
           {"target_ratio", 0.9},
           // CPU time a step takes (every thread of every process) over
           // its wall time: below the cores' count, they stood idle.
           {"single_process_cpu_seconds", single_cpu / timed},
           {"distributed_cpu_seconds", cpu_sum.item<double>() / timed},
           {"rank0_wait_seconds", waits},
           {"rank0_waits", messages},
           // Interleaved (two stages a rank) is left out: its trace does
           // not say which of a rank's stages a cell ran.
           {"hops_waited", hops.size()},
           {"hop_median_us",
            hops.empty() ? json(nullptr) : json(quantile(hops, 0.5))},
           {"hop_p90_us",
            hops.empty() ? json(nullptr) : json(quantile(hops, 0.9))}});
    }
    out["schedules_m32"] = rows;
    if (lead) {
      std::printf(
          "\n## every schedule at 32 micro-batches, %lld ranks against %lld "
          "lanes of one process (rank 0's waits for others in one step)\n",
          static_cast<long long>(n),
          static_cast<long long>(n));
      std::printf(
          "%-14s %12s %12s %8s %10s %10s %12s %8s %8s %10s %10s\n",
          "schedule",
          "single_s",
          "dist_s",
          "ratio",
          "single_cpu",
          "dist_cpu",
          "r0_wait_s",
          "waits",
          "hops",
          "hop_med_us",
          "hop_p90_us");
      // (No hops measured: "-".)
      auto us = [](const json& v) {
        return v.is_null() ? std::string("-")
                           : c10::str(std::lround(v.get<double>()));
      };
      for (const auto& r : rows) {
        std::printf(
            "%-14s %12.4f %12.4f %8.3f %10.4f %10.4f %12.4f %8lld %8lld "
            "%10s %10s\n",
            r["schedule"].get<std::string>().c_str(),
            r["single_process_seconds"].get<double>(),
            r["distributed_seconds"].get<double>(),
            r["ratio"].get<double>(),
            r["single_process_cpu_seconds"].get<double>(),
            r["distributed_cpu_seconds"].get<double>(),
            r["rank0_wait_seconds"].get<double>(),
            static_cast<long long>(r["rank0_waits"].get<int64_t>()),
            static_cast<long long>(r["hops_waited"].get<int64_t>()),
            us(r["hop_median_us"]).c_str(),
            us(r["hop_p90_us"]).c_str());
      }
    }
  }

  // A timeline of one step: a row per rank, with the waits for other
  // ranks beside the cells.
  auto trace = std::make_shared<gpipe::Trace>();
  stage->set_trace(trace);
  dist_step();
  stage->set_trace(nullptr);
  stage->set_trace(trace);  // gather_trace reads the stage's trace
  auto merged = gpipe::dist::gather_trace(stage);
  stage->set_trace(nullptr);
  if (lead && merged) {
    merged->write_svg(trace_prefix + ".svg");
    merged->write_chrome_json(trace_prefix + ".json");
    out["trace"] = {
        {"svg", trace_prefix + ".svg"},
        {"chrome_json", trace_prefix + ".json"}};
  }

  if (lead) {
    std::printf(
        "\n## distributed: %lld ranks on loopback, %s, batch %lld, chunks "
        "%lld, one thread each\n",
        static_cast<long long>(n),
        out["throughput"]["model"].get<std::string>().c_str(),
        static_cast<long long>(batch),
        static_cast<long long>(chunks));
    std::printf("%-34s %12s\n", "", "seconds/step");
    const auto lanes = "GPipe, one process, " + std::to_string(n) + " lanes";
    const auto processes = "PipelineStage, " + std::to_string(n) + " processes";
    std::printf("%-34s %12.4f\n", lanes.c_str(), single_s);
    std::printf("%-34s %12.4f\n", processes.c_str(), dist_s);
    std::printf(
        "%-34s %12.4f   (receives posted at the cell)\n",
        "  the same, plan without transfers",
        late_s);
    std::printf(
        "%-34s %12.3f   (target >= 0.9)\n",
        "throughput ratio (dist / single)",
        single_s / dist_s);
    if (out.contains("message")) {
      const auto& m = out["message"];
      std::printf("\n%-34s %12s\n", "1 KiB message, one way", "microseconds");
      std::printf(
          "%-34s %12.1f\n",
          "bare c10d send/recv",
          m["bare_c10d_one_way_us"].get<double>());
      std::printf(
          "%-34s %12.1f   (target < 100)\n",
          "gpipe message (header + payload)",
          m["gpipe_one_way_us"].get<double>());
      std::printf(
          "%-34s %12.3f   (target <= 1.3)\n",
          "ratio",
          m["ratio"].get<double>());
    }
    if (out.contains("trace")) {
      std::printf(
          "\ntimeline of one step: %s (and .json)\n",
          (trace_prefix + ".svg").c_str());
    }
  }
  return out;
}

}  // namespace gpipe::bench
