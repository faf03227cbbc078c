// Random numbers in the pipeline: cells whose layers start (or stop)
// drawing random numbers between steps replay the same numbers in
// recomputation, on several lanes at once, so checkpointing never changes a
// gradient. See Note [Random streams of concurrent cells].

#include "random.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "cell_generator.h"
#include "common.h"

namespace {

using gpipe::Checkpoint;
using gpipe::testing::SeededTest;

class RandomTest : public SeededTest {};

// Dropout whose probability is set from outside between steps, as a
// schedule that raises it from 0 would. At p = 0 it draws nothing.
struct ScheduledDropoutImpl : torch::nn::Cloneable<ScheduledDropoutImpl> {
  explicit ScheduledDropoutImpl(std::shared_ptr<std::atomic<double>> p)
      : p(std::move(p)) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    return torch::dropout(x, p->load(), is_training());
  }
  std::shared_ptr<std::atomic<double>> p;
};
TORCH_MODULE(ScheduledDropout);

// DropPath: drops whole samples, drawing one number per sample, but only on
// steps where it is switched on.
struct DropPathImpl : torch::nn::Cloneable<DropPathImpl> {
  explicit DropPathImpl(std::shared_ptr<std::atomic<bool>> on)
      : on(std::move(on)) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    if (!is_training() || !on->load()) {
      return x;
    }
    auto keep = (torch::rand({x.size(0), 1}, x.options()) < 0.7).to(x.dtype());
    return x * keep / 0.7;
  }
  std::shared_ptr<std::atomic<bool>> on;
};
TORCH_MODULE(DropPath);

struct Knobs {
  std::shared_ptr<std::atomic<double>> p =
      std::make_shared<std::atomic<double>>(0.0);
  std::shared_ptr<std::atomic<bool>> path =
      std::make_shared<std::atomic<bool>>(false);
};

// Three partitions, each with a layer whose randomness is switched between
// steps.
torch::nn::Sequential model_of(const Knobs& knobs) {
  torch::nn::Sequential net(
      torch::nn::Linear(6, 8),
      ScheduledDropout(knobs.p),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      DropPath(knobs.path),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      ScheduledDropout(knobs.p),
      torch::nn::Linear(8, 3));
  net->to(torch::kFloat64);
  return net;
}

// Runs the same steps through a model checkpointed `Always` and one that is
// not, with the same seed before every step, and expects the same
// gradients: a recomputation that drew other numbers than its forward would
// show up as a difference.
void expect_checkpointing_changes_nothing(bool train_step) {
  Knobs knobs;
  auto net = model_of(knobs);
  auto always_net = gpipe::testing::copy_of(net);
  auto never_net = gpipe::testing::copy_of(net);
  gpipe::GPipe always(
      always_net,
      gpipe::GPipeOptions({3, 3, 3}).chunks(4).checkpoint(Checkpoint::Always));
  gpipe::GPipe never(
      never_net,
      gpipe::GPipeOptions({3, 3, 3}).chunks(4).checkpoint(Checkpoint::Never));
  auto x = torch::randn({8, 6}, torch::kFloat64);
  auto y = torch::randn({8, 3}, torch::kFloat64);
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::mse_loss(out, target);
  };
  // Off, on, off again, on again: each switch is a change between steps.
  const double ps[] = {0.0, 0.0, 0.5, 0.5, 0.0, 0.3, 0.3, 0.0, 0.5};
  const bool paths[] = {
      false, false, false, true, true, false, true, true, false};
  for (int step = 0; step < 9; ++step) {
    knobs.p->store(ps[step]);
    knobs.path->store(paths[step]);
    for (auto* model : {&always, &never}) {
      (*model)->zero_grad();
      torch::manual_seed(1000 + step);
      if (train_step) {
        (*model)->train_step(x, y, loss_fn);
      } else {
        loss_fn((*model)->forward(x), y).backward();
      }
    }
    auto a = gpipe::testing::grads_of(*always);
    auto b = gpipe::testing::grads_of(*never);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_TRUE(a[k].defined() && b[k].defined());
      EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-12, 1e-12))
          << "step " << step << " (p " << ps[step] << ", drop path "
          << paths[step] << "), parameter " << k;
    }
  }
}

TEST_F(RandomTest, RandomnessThatStartsLateReplaysInRecomputation) {
  // Many times: lanes interleave differently on every run.
  for (int run = 0; run < 15; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    expect_checkpointing_changes_nothing(/*train_step=*/false);
  }
}

TEST_F(RandomTest, RandomnessThatStartsLateReplaysInTrainStep) {
  for (int run = 0; run < 15; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    expect_checkpointing_changes_nothing(/*train_step=*/true);
  }
}

TEST_F(RandomTest, DropoutMasksDependOnTheSeedAlone) {
  // The same seed gives the same outputs however the lanes interleave.
  Knobs knobs;
  knobs.p->store(0.5);
  gpipe::GPipe model(model_of(knobs), gpipe::GPipeOptions({3, 3, 3}).chunks(4));
  auto x = torch::randn({8, 6}, torch::kFloat64);
  torch::manual_seed(7);
  auto first = model->forward(x).detach();
  for (int run = 0; run < 10; ++run) {
    torch::manual_seed(7);
    EXPECT_TRUE(torch::equal(model->forward(x).detach(), first));
  }
}

TEST_F(RandomTest, SampledLossDrawsTheSameNumbersInRecomputation) {
  // A loss that samples (here: a random weight per element) must see the
  // same samples when a checkpointed micro-batch is recomputed, or the
  // gradient belongs to another loss.
  auto net = torch::nn::Sequential(
      torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
  net->to(torch::kFloat64);
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return ((out - target).pow(2) * torch::rand_like(out)).mean();
  };
  auto x = torch::randn({8, 4}, torch::kFloat64);
  auto y = torch::randn({8, 2}, torch::kFloat64);
  std::vector<std::vector<torch::Tensor>> grads;
  for (auto mode : {Checkpoint::Always, Checkpoint::Never}) {
    gpipe::GPipe model(
        gpipe::testing::copy_of(net),
        gpipe::GPipeOptions({2, 1}).chunks(4).checkpoint(mode));
    torch::manual_seed(3);
    model->train_step(x, y, loss_fn);
    grads.push_back(gpipe::testing::grads_of(*model));
  }
  for (size_t k = 0; k < grads[0].size(); ++k) {
    EXPECT_TRUE(torch::allclose(grads[0][k], grads[1][k], 1e-12, 1e-12))
        << "parameter " << k;
  }
}

TEST_F(RandomTest, LossRunsOncePerMicroBatchOutsideRecomputation) {
  auto net =
      torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Linear(6, 2));
  for (auto mode :
       {Checkpoint::Always, Checkpoint::ExceptLast, Checkpoint::Never}) {
    std::atomic<int> counted{0};
    std::atomic<int> recomputed{0};
    auto loss_fn = [&](torch::Tensor out, torch::Tensor target) {
      (gpipe::is_recomputing() ? recomputed : counted)++;
      return torch::mse_loss(out, target);
    };
    gpipe::GPipe model(
        gpipe::testing::copy_of(net),
        gpipe::GPipeOptions({1, 1}).chunks(4).checkpoint(mode));
    for (auto schedule :
         {gpipe::Schedule::FillDrain,
          gpipe::Schedule::OneFOneB,
          gpipe::Schedule::ZeroBubble}) {
      counted = 0;
      recomputed = 0;
      model->train_step(
          torch::randn({8, 4}), torch::randn({8, 2}), loss_fn, schedule);
      // The loss gives the gradient of the output when it runs, so a
      // checkpointed last stage recomputes its layers, not its loss: a
      // loss with side effects has them once per micro-batch.
      EXPECT_EQ(counted.load(), 4) << gpipe::to_string(mode);
      EXPECT_EQ(recomputed.load(), 0) << gpipe::to_string(mode);
    }
  }
}

}  // namespace

namespace {

// A layer that sleeps `ms` and multiplies by uniform noise, drawn through
// the random operators (a cell's own generator on CPU lanes) or, with
// `by_name`, from the default generator given by name.
struct SleepyNoiseImpl : torch::nn::Cloneable<SleepyNoiseImpl> {
  SleepyNoiseImpl(int ms, bool by_name) : ms(ms), by_name(by_name) {}
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    auto noise =
        by_name
            ? torch::rand(
                  x.sizes(), at::detail::getDefaultCPUGenerator(), x.options())
            : torch::rand_like(x);
    return x * (0.5 + noise);
  }
  int ms;
  bool by_name;
};
TORCH_MODULE(SleepyNoise);

// Cells that draw random numbers through the random operators on CPU lanes
// take generators of their own (src/cell_generator.h), so they run at
// once, and still replay their numbers in recomputation and depend on the
// seed alone. A layer that draws from the default generator by name is
// run in turn, as before.
TEST_F(RandomTest, CellsThatDrawRunAtOnceOnTheirOwnGenerators) {
  for (const bool by_name : {false, true}) {
    SCOPED_TRACE(by_name ? "by name" : "through the operators");
    auto make = [&] {
      torch::manual_seed(0);
      torch::nn::Sequential net(
          torch::nn::Linear(4, 4),
          SleepyNoise(20, by_name),
          torch::nn::Linear(4, 4),
          SleepyNoise(20, by_name));
      net->to(torch::kFloat64);
      return net;
    };
    auto x = torch::randn({4, 4}, torch::kFloat64);
    auto always_net = make();
    auto never_net = make();
    gpipe::GPipe always(
        always_net,
        gpipe::GPipeOptions({2, 2})
            .chunks(4)
            .checkpoint(Checkpoint::Always)
            .threads_per_lane(1));
    gpipe::GPipe never(
        never_net,
        gpipe::GPipeOptions({2, 2})
            .chunks(4)
            .checkpoint(Checkpoint::Never)
            .threads_per_lane(1));
    for (int step = 0; step < 3; ++step) {
      auto trace = std::make_shared<gpipe::Trace>();
      never->set_trace(trace);
      torch::manual_seed(10 + step);
      auto out = never->forward(x);
      never->set_trace(nullptr);
      out.sum().backward();
      torch::manual_seed(10 + step);
      always->forward(x).sum().backward();
      // Four micro-batches through two stages of one 20 ms cell each: 5
      // cells' time when the lanes work at once, 8 when they take turns.
      const double span = trace->summary().span;
      if (!by_name) {
        EXPECT_LT(span, 0.14) << "step " << step;
      } else if (step > 0) {
        // Once a stage is seen to draw by name, its cells take turns.
        EXPECT_GE(span, 0.155) << "step " << step;
      }
      // The same seed, the same numbers, whichever lane ran first.
      torch::manual_seed(10 + step);
      EXPECT_TRUE(torch::equal(never->forward(x).detach(), out.detach()));
    }
    auto a = gpipe::testing::grads_of(*always);
    auto b = gpipe::testing::grads_of(*never);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) {
      EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-12, 1e-12)) << k;
    }
  }
}

}  // namespace

namespace {

// The scope gives the random operators called without a generator the
// cell's: the default generator stays where it was, an operator given a
// generator keeps it, scopes nest, and a generator seeded with s draws what
// the default one reseeded with s draws (so both ways of running a cell
// that draws give the same numbers).
TEST_F(RandomTest, CellGeneratorScopeGivesTheOperatorsTheCellsGenerator) {
  ASSERT_TRUE(gpipe::detail::cell_generators_available());
  torch::manual_seed(123);
  const auto uniform = torch::rand({5});
  const auto normal = torch::randn({3});
  const auto mask = torch::dropout(torch::ones({64}), 0.5, true);
  torch::manual_seed(5);
  const auto before = torch::rand({4});
  torch::manual_seed(5);
  {
    gpipe::detail::CellGeneratorScope scope(
        at::make_generator<at::CPUGeneratorImpl>(123));
    EXPECT_TRUE(torch::equal(torch::rand({5}), uniform));
    EXPECT_TRUE(torch::equal(torch::randn({3}), normal));
    EXPECT_TRUE(
        torch::equal(torch::dropout(torch::ones({64}), 0.5, true), mask));
    {
      gpipe::detail::CellGeneratorScope inner(
          at::make_generator<at::CPUGeneratorImpl>(123));
      EXPECT_TRUE(torch::equal(torch::rand({5}), uniform));
    }
    // Given a generator, an operator keeps it.
    auto given = at::make_generator<at::CPUGeneratorImpl>(123);
    EXPECT_TRUE(torch::equal(torch::rand({5}, given), uniform));
  }
  // The default generator did not move.
  EXPECT_TRUE(torch::equal(torch::rand({4}), before));
}

}  // namespace

namespace {

// A recomputation during which another thread drew from the default
// generator (a user's thread, here made to from inside the layer on the
// recomputation's first run) runs again on a generator of its own, and the
// gradients are the plain model's. It was an error: 'drew random numbers
// although its forward drew none'.
TEST_F(RandomTest, AnotherThreadsDrawDuringARecomputationIsNotTheCells) {
  std::atomic<int64_t> runs{0};
  auto sometimes_elsewhere = gpipe::testing::lambda([&](torch::Tensor x) {
    if (gpipe::is_recomputing() && runs++ % 2 == 0) {
      std::thread other([] { torch::rand({1}); });
      other.join();
    }
    return x;
  });
  // The same layers twice (the lambda does not clone).
  auto layers = [](torch::nn::AnyModule middle) {
    torch::manual_seed(3);
    torch::nn::Sequential net(torch::nn::Linear(4, 4));
    net->push_back(std::move(middle));
    net->push_back(torch::nn::Tanh());
    net->push_back(torch::nn::Linear(4, 2));
    net->to(torch::kFloat64);
    return net;
  };
  auto net = layers(torch::nn::AnyModule(sometimes_elsewhere));
  auto plain = layers(torch::nn::AnyModule(torch::nn::Identity()));
  gpipe::GPipe model(
      net, gpipe::GPipeOptions({4}).chunks(2).checkpoint(Checkpoint::Always));
  const auto x = torch::randn({4, 4}, torch::kFloat64);
  const auto y = torch::randn({4, 2}, torch::kFloat64);
  torch::mse_loss(model->forward(x), y).backward();
  torch::mse_loss(plain->forward(x), y).backward();
  EXPECT_EQ(runs.load(), 4);  // two recomputations, each run twice
  const auto a = gpipe::testing::grads_of(*model);
  const auto b = gpipe::testing::grads_of(*plain);
  ASSERT_EQ(a.size(), b.size());
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-12, 1e-12)) << k;
  }
}

// The same for cells that draw (dropout): one draw on another thread during
// a recomputation failed the step ('drew other random numbers than its
// forward'); one during a forward had the cell taken for one that draws
// from the default generator by name, which then ran in turn on it, where
// the next draw of another thread failed its recomputation. Each runs again
// on a generator of its own, and the gradients are those of the same
// pipeline without checkpoints (whose masks are the same).
TEST_F(RandomTest, AnotherThreadsDrawBesideADrawingCellIsNotTheCells) {
  for (const bool in_forward : {false, true}) {
    // Draws on another thread left to make, in a forward's first run and in
    // a recomputation (a forward's second run is one, to its layers).
    std::atomic<int> forward_draws{0};
    std::atomic<int> recompute_draws{0};
    auto sometimes_elsewhere = gpipe::testing::lambda([&](torch::Tensor x) {
      auto& left = gpipe::is_recomputing() ? recompute_draws : forward_draws;
      if (left.load() > 0) {
        --left;
        std::thread other([] { torch::rand({1}); });
        other.join();
      }
      return x;
    });
    auto layers = [](torch::nn::AnyModule middle) {
      torch::manual_seed(3);
      torch::nn::Sequential net(torch::nn::Linear(4, 8));
      net->push_back(torch::nn::Dropout(0.5));
      net->push_back(std::move(middle));
      net->push_back(torch::nn::Tanh());
      net->push_back(torch::nn::Linear(8, 2));
      net->to(torch::kFloat64);
      return net;
    };
    auto net = layers(torch::nn::AnyModule(sometimes_elsewhere));
    auto reference = layers(torch::nn::AnyModule(torch::nn::Identity()));
    gpipe::GPipe model(
        net, gpipe::GPipeOptions({5}).chunks(2).checkpoint(Checkpoint::Always));
    gpipe::GPipe uncheckpointed(
        reference,
        gpipe::GPipeOptions({5}).chunks(2).checkpoint(Checkpoint::Never));
    const auto x = torch::randn({4, 4}, torch::kFloat64);
    const auto y = torch::randn({4, 2}, torch::kFloat64);
    for (int step = 0; step < 2; ++step) {
      model->zero_grad();
      uncheckpointed->zero_grad();
      const bool disturbed = step == 1 || !in_forward;
      forward_draws = disturbed && in_forward ? 1 : 0;
      torch::manual_seed(11 + step);
      auto loss = torch::mse_loss(model->forward(x), y);
      recompute_draws = disturbed ? 1 : 0;
      loss.backward();
      EXPECT_EQ(forward_draws.load() + recompute_draws.load(), 0);
      torch::manual_seed(11 + step);
      torch::mse_loss(uncheckpointed->forward(x), y).backward();
      if (!disturbed) {
        continue;
      }
      const auto a = gpipe::testing::grads_of(*model);
      const auto b = gpipe::testing::grads_of(*uncheckpointed);
      ASSERT_EQ(a.size(), b.size());
      for (size_t k = 0; k < a.size(); ++k) {
        EXPECT_TRUE(torch::allclose(a[k], b[k], 1e-12, 1e-12))
            << k << " " << in_forward;
      }
      if (!in_forward) {
        break;
      }
    }
  }
}

// A layer that draws only when recomputed: an error, on a generator of its
// own as on the default one.
TEST_F(RandomTest, ALayerThatDrawsOnlyInRecomputationIsAnError) {
  auto drawing_late = gpipe::testing::lambda([](torch::Tensor x) {
    return gpipe::is_recomputing() ? x + 0 * torch::rand_like(x) : x;
  });
  torch::nn::Sequential net(torch::nn::Linear(4, 4), drawing_late);
  gpipe::GPipe model(
      net, gpipe::GPipeOptions({2}).chunks(2).checkpoint(Checkpoint::Always));
  const auto out = model->forward(torch::randn({4, 4}));
  try {
    out.sum().backward();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "drew random numbers although its forward drew none"),
        std::string::npos)
        << e.what();
  }
}

// A stage seen drawing by name takes turns for a while, then tries its own
// generator again: a move of the default generator by another stage's
// first unseeded draw does not hold it back for good.
TEST_F(RandomTest, DrawingByNameIsRetriedAfterAWhile) {
  gpipe::detail::RandomUse use;
  EXPECT_FALSE(use.draws_by_name(true));
  use.observe_by_name(true);
  EXPECT_TRUE(use.draws_by_name(true));
  EXPECT_FALSE(use.draws_by_name(false));
  for (int k = 0; k < gpipe::detail::RandomUse::kByNamePatience; ++k) {
    EXPECT_TRUE(use.draws_by_name(true)) << k;
    use.ran_in_turn(true);
  }
  EXPECT_FALSE(use.draws_by_name(true));
}

}  // namespace

namespace {

// A thread of the user's draws from the default generator while eval
// passes run (made to from inside a layer, so that it always does): no
// pass puts the generator back, so nothing is drawn twice. Passes used to
// put it back where it was once their step seed was drawn, so the numbers
// drawn after the first pass repeated what the other thread drew in it.
TEST_F(RandomTest, WhatAnotherThreadDrawsDuringAPassStaysDrawn) {
  std::mutex mutex;
  std::vector<double> drawn;
  const auto draw_elsewhere = [&](torch::Tensor x) {
    std::thread other([&] {
      const auto v = torch::rand({1}, torch::kFloat64).item<double>();
      std::lock_guard<std::mutex> lock(mutex);
      drawn.push_back(v);
    });
    other.join();
    return x;
  };
  torch::nn::Sequential net(
      gpipe::testing::lambda(draw_elsewhere),
      torch::nn::Linear(4, 4),
      gpipe::testing::lambda(draw_elsewhere));
  gpipe::GPipe model(net, gpipe::GPipeOptions({2, 1}).chunks(2));
  model->eval();
  for (int pass = 0; pass < 3; ++pass) {
    {
      torch::NoGradGuard no_grad;
      model->forward(torch::ones({4, 4}));
    }
    const auto after = torch::rand({4}, torch::kFloat64);
    for (const auto k : c10::irange(after.size(0))) {
      drawn.push_back(after[k].item<double>());
    }
  }
  std::vector<double> sorted = drawn;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end())
      << "a number was drawn twice among " << drawn.size();
}

}  // namespace
