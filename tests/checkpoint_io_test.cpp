// Training checkpoints in one process: saved by one layout and loaded into
// another they go on exactly as a run that never stopped; a write that
// dies leaves the previous checkpoint whole; damage and mismatches are
// refused by name before anything changes.

#include "checkpoint_io.h"

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "error_of.h"

namespace gpipe {
namespace {

namespace fs = std::filesystem;

// A fresh directory for one test, removed afterwards.
struct TempDir {
  TempDir() {
    path = (fs::temp_directory_path() /
            ("gpipe-ckpt-" + std::to_string(::getpid()) + "-" +
             std::to_string(counter()++)))
               .string();
    detail::remove_tree(path);
  }
  ~TempDir() {
    detail::remove_tree(path);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string path;
};

std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Six layers with a buffer (BatchNorm's statistics), in float64.
torch::nn::Sequential make_net() {
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(6, 8),
      torch::nn::Tanh(),
      torch::nn::BatchNorm1d(8),
      torch::nn::Linear(8, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 3));
  net->to(torch::kFloat64);
  return net;
}

enum class Opt { SGDMomentum, Adam };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    Opt kind, std::vector<torch::Tensor> params) {
  if (kind == Opt::SGDMomentum) {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<torch::optim::Adam>(
      params, torch::optim::AdamOptions(0.01));
}

struct Layout {
  const char* name;
  std::vector<int64_t> balance;
  int64_t stages_per_lane;
};

GPipe make_model(const Layout& layout) {
  return GPipe(
      make_net(),
      GPipeOptions(layout.balance)
          .chunks(2)
          .stages_per_lane(layout.stages_per_lane)
          .devices(std::vector<torch::Device>(
              layout.balance.size() / layout.stages_per_lane, torch::kCPU)));
}

// Step s's batch, the same whatever the layout.
std::pair<torch::Tensor, torch::Tensor> batch(int64_t s) {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(100 + s);
  auto x = torch::randn({8, 6}, g, torch::kFloat64);
  auto y = torch::randint(0, 3, {8}, g, torch::kLong);
  return {x, y};
}

double train(GPipe& model, torch::optim::Optimizer& opt, int64_t s) {
  auto [x, y] = batch(s);
  opt.zero_grad();
  auto loss = model->train_step(x, y, [](auto out, auto target) {
    return torch::nn::functional::cross_entropy(out, target);
  });
  opt.step();
  return loss.item<double>();
}

void expect_same_state(
    const torch::nn::Module& a, const torch::nn::Module& b, double tol) {
  auto pa = a.named_parameters();
  auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t k = 0; k < pa.size(); ++k) {
    EXPECT_TRUE(torch::allclose(pa[k].value(), pb[k].value(), tol, tol))
        << pa[k].key();
  }
  auto ba = a.named_buffers();
  auto bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (size_t k = 0; k < ba.size(); ++k) {
    EXPECT_TRUE(torch::allclose(
        ba[k].value().to(torch::kFloat64),
        bb[k].value().to(torch::kFloat64),
        tol,
        tol))
        << ba[k].key();
  }
}

const std::vector<Layout> kLayouts{
    {"one stage", {6}, 1},
    {"two stages", {3, 3}, 1},
    {"four stages", {2, 1, 2, 1}, 1},
    {"four stages on two lanes", {1, 2, 1, 2}, 2},
};

TEST(CheckpointIoTest, AnyLayoutGoesOnFromAnyOthersCheckpoint) {
  for (const auto kind : {Opt::SGDMomentum, Opt::Adam}) {
    // Eight steps without a stop.
    auto whole = make_model(kLayouts[0]);
    auto whole_opt = make_optimizer(kind, whole->parameters());
    std::vector<double> losses;
    for (int64_t s = 0; s < 8; ++s) {
      losses.push_back(train(whole, *whole_opt, s));
    }
    for (const auto& a : kLayouts) {
      for (const auto& b : kLayouts) {
        SCOPED_TRACE(
            std::string(kind == Opt::Adam ? "Adam" : "SGD") + ": " + a.name +
            " -> " + b.name);
        TempDir dir;
        {
          auto model = make_model(a);
          auto opt = make_optimizer(kind, model->parameters());
          for (int64_t s = 0; s < 4; ++s) {
            EXPECT_NEAR(train(model, *opt, s), losses[s], 1e-10);
          }
          TrainingState state;
          state.step = 4;
          state.epoch = 1;
          state.position = 4;
          state.user["note"] = "halfway";
          save_checkpoint(dir.path, model, *opt, state);
        }
        auto model = make_model(b);
        auto opt = make_optimizer(kind, model->parameters());
        const auto state = load_checkpoint(dir.path, model, *opt);
        EXPECT_EQ(state.step, 4);
        EXPECT_EQ(state.epoch, 1);
        EXPECT_EQ(state.position, 4);
        EXPECT_EQ(state.user.at("note"), "halfway");
        for (int64_t s = 4; s < 8; ++s) {
          EXPECT_NEAR(train(model, *opt, s), losses[s], 1e-10) << "step " << s;
        }
        expect_same_state(*model, *whole, 1e-10);
      }
    }
  }
}

TEST(CheckpointIoTest, ThePlainSequentialReadsACheckpoint) {
  TempDir dir;
  auto model = make_model(kLayouts[2]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  train(model, *opt, 0);
  save_checkpoint(dir.path, model, *opt, TrainingState{});
  auto net = make_net();
  load_into_sequential(net, dir.path);
  expect_same_state(*net, *model->partitions(), 0);
}

TEST(CheckpointIoTest, TheRandomGeneratorGoesOnWhereItWas) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  torch::manual_seed(7);
  save_checkpoint(dir.path, model, *opt, TrainingState{});
  const auto expected = torch::rand({4});
  torch::manual_seed(8);
  const auto state = load_checkpoint(dir.path, model, *opt);
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
  EXPECT_TRUE(state.cpu_generator.defined());
}

// Saves `state` with the writer made to die after `after` of its steps;
// whether it died.
bool save_dies(
    int64_t after,
    const std::string& dir,
    GPipe& model,
    torch::optim::Optimizer& opt,
    const TrainingState& state) {
  detail::fail_checkpoint_after(after);
  bool died = false;
  try {
    save_checkpoint(dir, model, opt, state);
  } catch (const c10::Error& e) {
    died = std::string(e.what()).find("simulated crash") != std::string::npos;
    EXPECT_TRUE(died) << e.what();
  }
  detail::fail_checkpoint_after(-1);
  return died;
}

// Step 4's checkpoint, then a write of step 8 that dies after each of its
// steps in turn: every time, loading gives step 4's weights and state.
TEST(CheckpointIoTest, AWriteThatDiesLeavesThePreviousCheckpointWhole) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::Adam, model->parameters());
  for (int64_t s = 0; s < 4; ++s) {
    train(model, *opt, s);
  }
  TrainingState state;
  state.step = 4;
  save_checkpoint(dir.path, model, *opt, state);
  auto saved = make_model(kLayouts[0]);
  auto saved_opt = make_optimizer(Opt::Adam, saved->parameters());
  load_checkpoint(dir.path, saved, *saved_opt);
  for (int64_t s = 4; s < 8; ++s) {
    train(model, *opt, s);
  }
  state.step = 8;
  int64_t crashes = 0;
  for (int64_t after = 0;; ++after) {
    const bool died = save_dies(after, dir.path, model, *opt, state);
    if (!died) {
      break;  // the write got through
    }
    ++crashes;
    auto loaded = make_model(kLayouts[0]);
    auto loaded_opt = make_optimizer(Opt::Adam, loaded->parameters());
    EXPECT_EQ(load_checkpoint(dir.path, loaded, *loaded_opt).step, 4);
    expect_same_state(*loaded, *saved, 0);
  }
  EXPECT_GE(crashes, 4);  // made, written, manifest, flushed, renamed
  auto loaded = make_model(kLayouts[0]);
  auto loaded_opt = make_optimizer(Opt::Adam, loaded->parameters());
  EXPECT_EQ(load_checkpoint(dir.path, loaded, *loaded_opt).step, 8);
  expect_same_state(*loaded, *model, 0);

  // Step 8 written again (other weights), dying at each point: step 8's
  // first checkpoint stays loadable, also once moved aside.
  auto first8 = make_model(kLayouts[0]);
  auto first8_opt = make_optimizer(Opt::Adam, first8->parameters());
  load_checkpoint(dir.path, first8, *first8_opt);
  train(model, *opt, 8);
  for (int64_t after = 0;; ++after) {
    const bool died = save_dies(after, dir.path, model, *opt, state);
    if (!died) {
      break;
    }
    auto again = make_model(kLayouts[0]);
    auto again_opt = make_optimizer(Opt::Adam, again->parameters());
    EXPECT_EQ(load_checkpoint(dir.path, again, *again_opt).step, 8);
    expect_same_state(*again, *first8, 0);
  }
  load_checkpoint(dir.path, loaded, *loaded_opt);
  expect_same_state(*loaded, *model, 0);
  // The two newest are kept, the leftovers of the dead writes are gone.
  state.step = 12;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(
      entries_of(dir.path),
      (std::vector<std::string>{"step-00000008", "step-00000012"}));
}

// Runs `load` and expects a c10::ValueError whose message holds every one
// of `parts`; the model's parameters must not have changed.
void expect_refused(
    GPipe& model,
    const std::function<void()>& load,
    const std::vector<std::string>& parts) {
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) {
    before.push_back(p.clone());
  }
  try {
    load();
    ADD_FAILURE() << "accepted";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    for (const auto& part : parts) {
      EXPECT_NE(what.find(part), std::string::npos) << what;
    }
  }
  const auto after = model->parameters();
  for (size_t k = 0; k < before.size(); ++k) {
    EXPECT_TRUE(torch::equal(before[k], after[k]));
  }
}

TEST(CheckpointIoTest, DamagedFilesAreRefusedByName) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  train(model, *opt, 0);
  TrainingState state;
  state.step = 1;
  save_checkpoint(dir.path, model, *opt, state);
  const auto ckpt = latest_checkpoint(dir.path);
  ASSERT_EQ(fs::path(ckpt).filename().string(), "step-00000001");
  const auto file = (fs::path(ckpt) / "rank-0.bin").string();
  const auto size = fs::file_size(file);

  auto other = make_model(kLayouts[2]);
  auto other_opt = make_optimizer(Opt::SGDMomentum, other->parameters());
  auto load = [&] { load_checkpoint(dir.path, other, *other_opt); };
  // A manifest edited after it was written: a tensor's dtype (its bytes
  // would be read as another type, and its checksum still holds).
  const auto manifest_path = (fs::path(ckpt) / "manifest.json").string();
  std::string written;
  {
    std::ifstream in(manifest_path);
    written.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = written.find("\"Double\"");
  ASSERT_NE(at, std::string::npos) << written;
  std::ofstream(manifest_path)
      << written.substr(0, at) << "\"Float\"" << written.substr(at + 8);
  expect_refused(
      other, load, {manifest_path, "does not match the checksum", "damaged"});
  std::ofstream(manifest_path) << written;
  EXPECT_NO_THROW(load());
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size / 2));
    f.put('\x5a');
  }
  expect_refused(other, load, {file, "corrupt", "checksum"});
  fs::resize_file(file, size / 3);
  expect_refused(other, load, {file, "truncated"});
  // A directory in its place is called one (it was "missing").
  fs::rename(file, file + ".aside");
  fs::create_directory(file);
  expect_refused(other, load, {file, "cannot be read (it is a directory)"});
  fs::remove(file);
  expect_refused(other, load, {file, "is missing"});
  fs::rename(file + ".aside", file);
  {
    std::ofstream manifest(fs::path(ckpt) / "manifest.json");
    manifest << "{\"format\": \"gpipe-checkpoint\", ";
  }
  expect_refused(other, load, {"manifest.json", "damaged"});
  ASSERT_EQ(detail::remove_tree(ckpt), "");
  expect_refused(other, load, {"no checkpoint", dir.path});
}

TEST(CheckpointIoTest, AnotherModelOrOptimizerIsRefusedBeforeAnythingChanges) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  train(model, *opt, 0);
  save_checkpoint(dir.path, model, *opt, TrainingState{});

  // A wider layer 3.
  torch::manual_seed(0);
  torch::nn::Sequential wider(
      torch::nn::Linear(6, 8),
      torch::nn::Tanh(),
      torch::nn::BatchNorm1d(8),
      torch::nn::Linear(8, 9),
      torch::nn::Tanh(),
      torch::nn::Linear(9, 3));
  wider->to(torch::kFloat64);
  GPipe other(
      wider,
      GPipeOptions({3, 3}).chunks(2).devices({torch::kCPU, torch::kCPU}));
  auto other_opt = make_optimizer(Opt::SGDMomentum, other->parameters());
  expect_refused(
      other,
      [&] { load_checkpoint(dir.path, other, *other_opt); },
      {"layers.3.weight", "[8, 8]", "[9, 8]"});

  // Fewer layers.
  torch::nn::Sequential shorter(torch::nn::Linear(6, 3));
  shorter->to(torch::kFloat64);
  GPipe short_model(shorter, GPipeOptions({1}).devices({torch::kCPU}));
  auto short_opt = make_optimizer(Opt::SGDMomentum, short_model->parameters());
  expect_refused(
      short_model,
      [&] { load_checkpoint(dir.path, short_model, *short_opt); },
      {"6 layers", "the model has 1"});

  // Adam's state is not SGD's.
  auto same = make_model(kLayouts[0]);
  auto adam = make_optimizer(Opt::Adam, same->parameters());
  expect_refused(
      same,
      [&] { load_checkpoint(dir.path, same, *adam); },
      {"holds the state of SGD", "the optimizer is Adam"});

  // An optimizer of another model's parameters.
  torch::optim::SGD foreign(
      make_net()->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_THROW(
      save_checkpoint(dir.path, model, foreign, TrainingState{}),
      c10::ValueError);
}

// A checkpoint of a step below the newest is a run that went back to an
// older one: the later ones go (a resume would take them), the newest
// earlier one stays.
// A newest `step-<n>` without its manifest was skipped: loading took the
// one before, or found nothing and the run began again, unsaid. And a save
// into a checkpoint itself went inside it, where no load looks.
TEST(CheckpointIoTest, ABrokenNewestCheckpointAndASaveIntoOneAreRefused) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  TrainingState state;
  state.step = 4;
  save_checkpoint(dir.path, model, *opt, state);
  const auto ckpt = latest_checkpoint(dir.path);
  try {
    state.step = 5;
    save_checkpoint(ckpt, model, *opt, state);
    ADD_FAILURE() << "a save into " << ckpt << " was taken";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "is a checkpoint itself (it holds manifest.json); save into the "
            "directory that holds it ('" +
            dir.path + "')"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(entries_of(ckpt).size(), 3u);  // manifest, rank-0, random
  const auto broken = (fs::path(dir.path) / "step-00000009").string();
  fs::create_directory(broken);
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { latest_checkpoint(dir.path); },
           [&] { read_training_state(dir.path); },
           [&] { load_checkpoint(dir.path, model, *opt); }}) {
    try {
      call();
      ADD_FAILURE() << "a step-00000009 without a manifest was passed over";
    } catch (const c10::ValueError& e) {
      EXPECT_NE(
          std::string(e.what()).find(
              "'" + broken +
              "' is not a whole checkpoint (it has no manifest.json): it was "
              "damaged after it was written; remove it to go on from '" +
              ckpt + "'"),
          std::string::npos)
          << e.what();
    }
  }
  // A file of that name is no damaged checkpoint: it is said to be a file.
  ASSERT_EQ(detail::remove_tree(broken), "");
  std::ofstream(broken) << "stray";
  EXPECT_NE(
      testing::error_of([&] { latest_checkpoint(dir.path); })
          .find(
              "'" + broken +
              "' is a file, not a checkpoint (a directory, with a "
              "manifest.json); remove it to go on from '" +
              ckpt + "'"),
      std::string::npos)
      << testing::error_of([&] { latest_checkpoint(dir.path); });
  // Older ones broken do not matter while a newer one is whole.
  ASSERT_EQ(detail::remove_tree(broken), "");
  fs::create_directory(fs::path(dir.path) / "step-00000001");
  EXPECT_EQ(latest_checkpoint(dir.path), ckpt);
}

TEST(CheckpointIoTest, SavingAnEarlierStepDropsTheLaterOnes) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  TrainingState state;
  for (const int64_t step : {4, 8, 12}) {
    state.step = step;
    save_checkpoint(dir.path, model, *opt, state);
  }
  EXPECT_EQ(
      entries_of(dir.path),
      (std::vector<std::string>{"step-00000008", "step-00000012"}));
  state.step = 6;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(entries_of(dir.path), (std::vector<std::string>{"step-00000006"}));
  EXPECT_EQ(read_training_state(dir.path).step, 6);
  state.step = 7;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(
      entries_of(dir.path),
      (std::vector<std::string>{"step-00000006", "step-00000007"}));
}

// A `step-<n>` without its manifest (a removal or a disk that failed
// after it was written) was never removed: a later one survived a save of
// an earlier step and stopped every load ("not a whole checkpoint"), and
// older ones stayed forever.
TEST(CheckpointIoTest, CheckpointsWithoutTheirManifestGoWithTheNextSave) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  TrainingState state;
  state.step = 5;
  save_checkpoint(dir.path, model, *opt, state);
  for (const auto* name : {"step-00000009", "step-00000000", "step-00000003"}) {
    fs::create_directory(fs::path(dir.path) / name);
    std::ofstream(fs::path(dir.path) / name / "rank-0.bin") << "x";
  }
  EXPECT_THROW(read_training_state(dir.path), c10::ValueError);
  state.step = 6;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(
      entries_of(dir.path),
      (std::vector<std::string>{"step-00000005", "step-00000006"}));
  EXPECT_EQ(read_training_state(dir.path).step, 6);
}

// A reader beside the writer (an evaluator loading the newest checkpoint
// while training saves): a checkpoint being removed was half there, and
// the reader was told it was damaged and to remove it, or that a file was
// missing (52 loads of 6,376 over 300 saves); one written again in its
// place was read with the old manifest and the new files.
TEST(CheckpointIoTest, AReaderBesideTheWriterAlwaysReadsAWholeCheckpoint) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  auto reader_model = make_model(kLayouts[2]);
  auto reader_opt =
      make_optimizer(Opt::SGDMomentum, reader_model->parameters());
  TrainingState state;
  state.step = 1;
  save_checkpoint(dir.path, model, *opt, state);
  std::atomic<bool> writing{true};
  std::vector<std::string> failures;
  int64_t loads = 0;
  std::thread reader([&] {
    while (writing.load()) {
      try {
        const auto loaded =
            load_checkpoint(dir.path, reader_model, *reader_opt);
        EXPECT_GE(read_training_state(dir.path).step, loaded.step);
        ++loads;
      } catch (const c10::Error& e) {
        failures.push_back(e.what_without_backtrace());
      }
    }
  });
  for (int64_t step = 2; step <= 60; ++step) {
    state.step = step;
    save_checkpoint(dir.path, model, *opt, state);
  }
  // A step written again (a run resumed from it) replaces the checkpoint
  // in its place: a reader of the old manifest met the new files.
  for (int k = 0; k < 20; ++k) {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        p.add_(0.01);
      }
    }
    save_checkpoint(dir.path, model, *opt, state);
  }
  writing = false;
  reader.join();
  EXPECT_TRUE(failures.empty())
      << failures.size() << " of " << loads + failures.size()
      << " loads failed, the first: " << failures.front();
  EXPECT_GT(loads, 0);
}

// A later checkpoint the save could not remove: the save said nothing, and
// the next load took the given-up run.
TEST(CheckpointIoTest, ALaterCheckpointThatCannotGoIsAnError) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  TrainingState state;
  for (const int64_t step : {2, 8}) {
    state.step = step;
    save_checkpoint(dir.path, model, *opt, state);
  }
  state.step = 3;
  detail::fail_checkpoint_removals(true);
  std::string message;
  try {
    save_checkpoint(dir.path, model, *opt, state);
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  }
  detail::fail_checkpoint_removals(false);
  EXPECT_NE(
      message.find(
          "the checkpoint of step 3 was written to '" + dir.path +
          "/step-00000003', but a checkpoint of a later step"),
      std::string::npos)
      << message;
  EXPECT_NE(message.find("step-00000008"), std::string::npos) << message;
  // The next save removes it.
  state.step = 4;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(
      entries_of(dir.path),
      (std::vector<std::string>{"step-00000003", "step-00000004"}));
}

// An older checkpoint the save could not remove was left without a word:
// the save succeeds (a load takes the newest) and warns, naming it.
TEST(CheckpointIoTest, AnOlderCheckpointThatCannotGoIsAWarning) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  TrainingState state;
  for (const int64_t step : {2, 4}) {
    state.step = step;
    save_checkpoint(dir.path, model, *opt, state);
  }
  state.step = 6;
  detail::fail_checkpoint_removals(true);
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(save_checkpoint(dir.path, model, *opt, state));
  const auto said = ::testing::internal::GetCapturedStderr();
  detail::fail_checkpoint_removals(false);
  EXPECT_NE(
      said.find(
          "the checkpoint of step 6 was written to '" + dir.path +
          "/step-00000006', but an older checkpoint"),
      std::string::npos)
      << said;
  EXPECT_NE(said.find("step-00000002"), std::string::npos) << said;
  EXPECT_EQ(read_training_state(dir.path).step, 6);
  // The next save removes it.
  state.step = 7;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(
      entries_of(dir.path),
      (std::vector<std::string>{"step-00000006", "step-00000007"}));
}

// What a checkpoint's manifest cannot hold is refused before anything is
// written: a user string that is not UTF-8 (nlohmann's type_error, not a
// c10::Error, and a temporary directory left), a negative epoch or
// position, a step of more digits than a directory name is read with
// (saved, then never found).
TEST(CheckpointIoTest, StatesItCannotKeepAreRefusedBeforeWriting) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  auto opt = make_optimizer(Opt::SGDMomentum, model->parameters());
  TrainingState state;
  state.user["loader"] = std::string("\xff\x00\x80", 3);
  try {
    save_checkpoint(dir.path, model, *opt, state);
    ADD_FAILURE() << "bytes that are not UTF-8 were saved";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("TrainingState::user['loader']: its value "
                                   "is not valid UTF-8 text"),
        std::string::npos)
        << e.what();
  }
  // Nothing was made: not the directory, nor a temporary one in it.
  EXPECT_TRUE(!fs::exists(dir.path) || entries_of(dir.path).empty());
  // A negative epoch or position (an unset -1) was saved and read back as
  // where to go on from.
  state.user.clear();
  state.epoch = -1;
  try {
    save_checkpoint(dir.path, model, *opt, state);
    ADD_FAILURE() << "epoch -1 was saved";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("TrainingState expects epoch and position "
                                   ">= 0"),
        std::string::npos)
        << e.what();
  }
  state.epoch = 0;
  state.position = -2;
  EXPECT_THROW(save_checkpoint(dir.path, model, *opt, state), c10::ValueError);
  state.position = 0;
  EXPECT_TRUE(!fs::exists(dir.path) || entries_of(dir.path).empty());
  state.user = {{"loader", std::string("a\0b\n\"q\" \xc3\xa9", 10)}};
  state.step = 999999999999999999;
  save_checkpoint(dir.path, model, *opt, state);
  EXPECT_EQ(read_training_state(dir.path).step, 999999999999999999);
  EXPECT_EQ(read_training_state(dir.path).user, state.user);
  state.step = 1000000000000000000;
  try {
    save_checkpoint(dir.path, model, *opt, state);
    ADD_FAILURE() << "step 10^18 was saved";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "a checkpoint's step must be from 0 to 999999999999999999, but "
            "got 1000000000000000000"),
        std::string::npos)
        << e.what();
  }
  // A manifest whose checksum entry is gone (one damaged byte of its key)
  // was read without the check.
  const auto manifest_path =
      (fs::path(latest_checkpoint(dir.path)) / "manifest.json").string();
  std::string written;
  {
    std::ifstream in(manifest_path);
    written.assign(std::istreambuf_iterator<char>(in), {});
  }
  const auto at = written.find("manifest_fnv1a64_words");
  ASSERT_NE(at, std::string::npos);
  written[at] = 'M';
  std::ofstream(manifest_path) << written;
  auto other = make_model(kLayouts[1]);
  auto other_opt = make_optimizer(Opt::SGDMomentum, other->parameters());
  expect_refused(
      other,
      [&] { load_checkpoint(dir.path, other, *other_opt); },
      {manifest_path, "has no checksum of itself", "damaged"});
}

// What the optimizer's options need must be in the checkpoint (Adam with
// amsgrad keeps a third moment), and a generator state must be one.
TEST(CheckpointIoTest, OptionsAndGeneratorStatesAreChecked) {
  TempDir dir;
  auto model = make_model(kLayouts[1]);
  torch::optim::Adam plain(
      model->parameters(), torch::optim::AdamOptions(0.01));
  train(model, plain, 0);
  save_checkpoint(dir.path, model, plain, TrainingState{});
  auto other = make_model(kLayouts[1]);
  torch::optim::Adam amsgrad(
      other->parameters(), torch::optim::AdamOptions(0.01).amsgrad(true));
  expect_refused(
      other,
      [&] { load_checkpoint(dir.path, other, amsgrad); },
      {"max_exp_avg_sq", "which Adam needs with the optimizer's options"});

  TrainingState bad;
  bad.step = 1;
  bad.cpu_generator = torch::zeros({7}, torch::kFloat);
  try {
    save_checkpoint(dir.path, model, plain, bad);
    ADD_FAILURE() << "a float tensor was saved as a generator state";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(
        std::string(e.what()).find("TrainingState::cpu_generator is not a CPU "
                                   "generator's state"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(latest_checkpoint(dir.path), dir.path + "/step-00000000");
}

// Removing old checkpoints goes through detail::remove_tree (Note [Removing
// a directory tree]): whole trees go, what a link points to stays.
TEST(CheckpointIoTest, RemoveTreeRemovesTreesButNotWhatLinksPointTo) {
  TempDir dir;
  const fs::path root(dir.path);
  fs::create_directories(root / "tree" / "a" / "b");
  fs::create_directories(root / "kept");
  std::ofstream(root / "tree" / "top.bin") << "x";
  std::ofstream(root / "tree" / "a" / "b" / "deep.bin") << "y";
  std::ofstream(root / "kept" / "file.bin") << "z";
  fs::create_directory_symlink(root / "kept", root / "tree" / "a" / "link");
  std::ofstream(root / "lone.bin") << "w";

  EXPECT_EQ(detail::remove_tree((root / "tree").string()), "");
  EXPECT_FALSE(fs::exists(root / "tree"));
  EXPECT_TRUE(fs::exists(root / "kept" / "file.bin"));
  EXPECT_EQ(detail::remove_tree((root / "lone.bin").string()), "");
  EXPECT_FALSE(fs::exists(root / "lone.bin"));
  EXPECT_EQ(detail::remove_tree((root / "never-was").string()), "");
  EXPECT_EQ(entries_of(dir.path), std::vector<std::string>{"kept"});
}

}  // namespace
}  // namespace gpipe
