// gpipe-train: trains a small CNN, ResNet or U-Net on Fashion-MNIST through a
// GPipe pipeline and reports progress, test accuracy and time.
//
//   gpipe-train [--model cnn] [--partitions 2] [--chunks 4] ...

#include <gpipe/gpipe.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace {

// Reads a gzipped IDX file (the MNIST format): big-endian magic, dims, data.
std::vector<uint8_t> read_gzip(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  TORCH_CHECK_VALUE(
      file != nullptr,
      "cannot open ",
      path,
      "; install Debian's dataset-fashion-mnist or pass --data-dir");
  std::vector<uint8_t> bytes;
  std::vector<uint8_t> buffer(1 << 20);
  int got = 0;
  while ((got = gzread(file, buffer.data(), buffer.size())) > 0) {
    bytes.insert(bytes.end(), buffer.begin(), buffer.begin() + got);
  }
  gzclose(file);
  TORCH_CHECK_VALUE(got == 0, "cannot decompress ", path);
  return bytes;
}

uint32_t big_endian(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t(b[at]) << 24) | (uint32_t(b[at + 1]) << 16) |
         (uint32_t(b[at + 2]) << 8) | uint32_t(b[at + 3]);
}

torch::Tensor read_idx(const std::string& path, bool images) {
  auto bytes = read_gzip(path);
  TORCH_CHECK_VALUE(bytes.size() >= 8, path, " is too short for IDX");
  const uint32_t magic = big_endian(bytes, 0);
  const uint32_t expected = images ? 0x803 : 0x801;
  TORCH_CHECK_VALUE(
      magic == expected,
      path,
      ": expected IDX magic ",
      expected,
      ", got ",
      magic);
  const int64_t count = big_endian(bytes, 4);
  std::vector<int64_t> shape{count};
  size_t header = 8;
  if (images) {
    shape = {
        count,
        1,
        int64_t(big_endian(bytes, 8)),
        int64_t(big_endian(bytes, 12))};
    header = 16;
  }
  int64_t numel = 1;
  for (auto s : shape) {
    numel *= s;
  }
  TORCH_CHECK_VALUE(
      int64_t(bytes.size() - header) == numel, path, ": truncated IDX payload");
  auto t =
      torch::from_blob(bytes.data() + header, shape, torch::kUInt8).clone();
  if (images) {
    // Scale to [0, 1] and standardise with the training set's statistics.
    return (t.to(torch::kFloat) / 255.0 - 0.2860) / 0.3530;
  }
  return t.to(torch::kLong);
}

// Conv-BN-ReLU blocks and a classifier, flattened into one Sequential.
torch::nn::Sequential make_cnn() {
  namespace nn = torch::nn;
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)),
      nn::BatchNorm2d(32),
      nn::ReLU(),
      nn::MaxPool2d(2),
      nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)),
      nn::BatchNorm2d(64),
      nn::ReLU(),
      nn::MaxPool2d(2),
      nn::Flatten(),
      nn::Linear(64 * 7 * 7, 128),
      nn::ReLU(),
      nn::Dropout(0.25),
      nn::Linear(128, 10));
}

// A U-Net classifier: the 28x28 images padded to 32x32 (the depth-5 U-Net
// halves them 5 times), a U-Net(B=1, C=8) producing 16 maps at full
// resolution, average-pooled to 8x8 and classified by a Linear layer. (A
// global average would see next to nothing: every map comes out of
// InstanceNorm with zero mean and unit variance.)
torch::nn::Sequential make_unet() {
  namespace nn = torch::nn;
  auto body = gpipe::models::unet(
      /*B=*/1, /*C=*/8, /*in_channels=*/1, /*out_channels=*/16);
  nn::Sequential net;
  net->push_back("pad", nn::ZeroPad2d(2));
  const auto names = body->named_children();
  size_t k = 0;
  for (const auto& layer : *body) {
    net->push_back(std::string(names[k++].key()), layer);
  }
  net->push_back("avgpool", nn::AvgPool2d(4));
  net->push_back("flat", nn::Flatten());
  net->push_back("fc", nn::Linear(16 * 8 * 8, 10));
  return net;
}

namespace fs = std::filesystem;

// A bad command line: printed on one line, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws a UsageError made of `args` unless `condition` holds. Every message
// starts with the flag it is about.
template <typename... Args>
void usage_check(bool condition, const Args&... args) {
  if (!condition) {
    throw UsageError(c10::str(args...));
  }
}

// The exit status of a bad command line, as for most Unix tools.
constexpr int kUsageExit = 2;

// Intra-op threads are per lane, so the total is this times the partitions;
// beyond the cores it only oversubscribes, and far beyond them OpenMP runs
// out of memory creating the team (--threads-per-lane 99999999999 did).
// 1024 keeps room for large machines while refusing typos.
constexpr int64_t kMaxThreadsPerLane = 1024;

// The gzipped IDX files that --data-dir must hold.
constexpr const char* kDataFiles[] = {
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz"};

// One entry per --model. The layer counts are known here so that
// --partitions and --balance are checked before anything is built
// (make_model asserts them).
struct ModelSpec {
  std::string name;
  int64_t layers = 0;
  // The balance for 2 partitions: it puts skips across the boundary. Empty:
  // the even split.
  std::vector<int64_t> two_way_balance;
};

const std::vector<ModelSpec>& model_specs() {
  static const std::vector<ModelSpec> specs{
      {"cnn", 13, {}},
      // 39 layers: stem 0-2, bottlenecks 3-13, 14-24, 25-35, head 36-38. The
      // cut after the second bottleneck's relu2 splits the work about in two
      // and carries that block's identity across.
      {"resnet", 39, {21, 18}},
      // 69 layers: pad, encoder levels 0-4 of 6 layers (1-30), the
      // bottleneck (31-34), decoder levels 4-0 of 6 layers (35-64), segment
      // and head (65-68). The cut after decoder level 4 splits the
      // multiply-adds about in two and carries the skips of levels 0-3
      // across.
      {"unet", 69, {41, 28}}};
  return specs;
}

const ModelSpec& model_spec(const std::string& name) {
  const auto& specs = model_specs();
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const auto& s) {
    return s.name == name;
  });
  TORCH_INTERNAL_ASSERT(it != specs.end(), "no model named ", name);
  return *it;
}

torch::nn::Sequential make_model(const ModelSpec& spec) {
  torch::nn::Sequential net;
  if (spec.name == "resnet") {
    net = gpipe::models::resnet_small(10);
  } else if (spec.name == "unet") {
    net = make_unet();
  } else {
    net = make_cnn();
  }
  TORCH_INTERNAL_ASSERT(
      static_cast<int64_t>(net->size()) == spec.layers,
      "model_specs() says --model ",
      spec.name,
      " has ",
      spec.layers,
      " layers, but it has ",
      net->size());
  return net;
}

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

// CLI11 reads integers with strtoll's base 0 and saturates, so "010" would
// be 8, "0x10" 16 and "99999999999999999999" INT64_MAX; it also wraps "-1"
// into an unsigned. Accept plain decimals that fit in T only.
template <typename T>
CLI::Validator decimal() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        T value{};
        const char* end = text.data() + text.size();
        const auto [rest, error] = std::from_chars(text.data(), end, value);
        if (error == std::errc::result_out_of_range) {
          return c10::str("'", text, "' is out of range");
        }
        if (text.empty() || error != std::errc() || rest != end) {
          return c10::str(
              "expected a ",
              std::is_signed<T>::value ? "" : "non-negative ",
              "decimal integer, but got '",
              text,
              "'");
        }
        return std::string();
      },
      /*validator_desc=*/"");
}

// A file that a few steps' trace goes to: its folder must exist now, rather
// than the write failing after the training it recorded.
void verify_output_path(const std::string& flag, const std::string& path) {
  usage_check(!path.empty(), flag, " needs a file name");
  std::error_code ignored;
  usage_check(
      !fs::is_directory(path, ignored),
      flag,
      " '",
      path,
      "' is a folder; name a file in it");
  auto folder = fs::path(path).parent_path();
  if (folder.empty()) {
    folder = ".";
  }
  usage_check(
      fs::is_directory(folder, ignored),
      flag,
      " '",
      path,
      "': the folder '",
      folder.string(),
      "' does not exist");
  usage_check(
      ::access(folder.c_str(), W_OK) == 0,
      flag,
      " '",
      path,
      "': the folder '",
      folder.string(),
      "' is not writable");
}

void verify_data_dir(const std::string& dir) {
  constexpr const char* kWayOut =
      "; install Debian's dataset-fashion-mnist or pass the folder of the "
      "Fashion-MNIST *-ubyte.gz files";
  std::error_code ignored;
  usage_check(
      fs::is_directory(dir, ignored),
      "--data-dir '",
      dir,
      "' is not a folder",
      kWayOut);
  for (const char* file : kDataFiles) {
    usage_check(
        fs::is_regular_file(fs::path(dir) / file, ignored),
        "--data-dir '",
        dir,
        "' has no ",
        file,
        kWayOut);
  }
}

// gpipe-train's flags, with their defaults.
struct Args {
  std::string model = "cnn";
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t partitions = 2;
  std::string balance_text;
  int64_t chunks = 4;
  std::string checkpoint = "except_last";
  int64_t epochs = 1;
  int64_t batch_size = 64;
  double lr = 0.05;
  int64_t threads_per_lane = 0;
  int64_t limit = 0;
  int64_t log_every = 100;
  uint64_t seed = 0;
  bool json = false;
  std::string schedule = "autograd";
  std::string trace_path;
  std::string timeline_path;
  int64_t trace_steps = 3;
  // Layers per partition: --balance, or chosen by verify_args.
  std::vector<int64_t> balance;
};

void add_options(CLI::App& app, Args& args) {
  std::vector<std::string> models;
  for (const auto& spec : model_specs()) {
    models.push_back(spec.name);
  }
  const auto int64 = decimal<int64_t>();
  app.add_option(
         "--model",
         args.model,
         "cnn: conv-BN-ReLU blocks; resnet: a small ResNet of bottlenecks; "
         "unet: a U-Net with a pooling classifier (skips cross partitions)")
      ->check(CLI::IsMember(models));
  app.add_option(
      "--data-dir", args.data_dir, "Folder with the gzipped IDX files");
  app.add_option(
         "--partitions",
         args.partitions,
         "Number of pipeline partitions, 1 to the model's layers (with "
         "--balance: its length)")
      ->check(int64);
  app.add_option(
      "--balance",
      args.balance_text,
      "Layers per partition, e.g. 6,7, summing to the model's layers "
      "(default: even, or one that puts skips across 2 partitions for "
      "resnet and unet)");
  app.add_option(
         "--chunks",
         args.chunks,
         "Micro-batches per mini-batch, 1 to --batch-size")
      ->check(int64);
  app.add_option(
         "--checkpoint",
         args.checkpoint,
         "Which micro-batches keep only their input and recompute it in "
         "backward")
      ->check(CLI::IsMember({"always", "except_last", "never"}));
  app.add_option("--epochs", args.epochs, "Training epochs (at least 1)")
      ->check(int64);
  app.add_option(
         "--batch-size", args.batch_size, "Mini-batch size (at least 1)")
      ->check(int64);
  app.add_option(
      "--lr", args.lr, "SGD learning rate, positive and finite (momentum 0.9)");
  app.add_option(
         "--threads-per-lane",
         args.threads_per_lane,
         c10::str(
             "Intra-op threads per CPU lane: 0 (automatic) or 1 to ",
             kMaxThreadsPerLane))
      ->check(int64);
  app.add_option(
         "--limit", args.limit, "Use only the first N training images (0: all)")
      ->check(int64);
  app.add_option(
         "--log-every",
         args.log_every,
         "Print progress every N steps (at least 1)")
      ->check(int64);
  app.add_option("--seed", args.seed, "Random seed")
      ->check(decimal<uint64_t>());
  app.add_flag("--json", args.json, "Print one final JSON summary line");
  app.add_option(
         "--schedule",
         args.schedule,
         "autograd: forward, then loss.backward(); fill_drain | 1f1b: "
         "train_step with the loss inside the pipeline")
      ->check(CLI::IsMember({"autograd", "fill_drain", "1f1b"}));
  app.add_option(
      "--trace",
      args.trace_path,
      "Write a Chrome trace JSON of a few steps here");
  app.add_option(
      "--timeline",
      args.timeline_path,
      "Write an SVG timeline of a few steps here");
  app.add_option(
         "--trace-steps",
         args.trace_steps,
         "Steps to record for --trace/--timeline (from the second step; at "
         "least 1)")
      ->check(int64);
}

// Checks every flag and their agreement, and fills in args.balance; throws
// UsageError. Runs before the data is read or the model built. (Only that
// the run has enough steps for --trace-steps waits for the data.)
void verify_args(const CLI::App& app, Args& args) {
  const auto& spec = model_spec(args.model);
  usage_check(
      args.epochs >= 1, "--epochs must be at least 1, but got ", args.epochs);
  usage_check(
      args.batch_size >= 1,
      "--batch-size must be at least 1, but got ",
      args.batch_size);
  usage_check(
      args.chunks >= 1, "--chunks must be at least 1, but got ", args.chunks);
  usage_check(
      args.chunks <= args.batch_size,
      "--chunks ",
      args.chunks,
      " is more than --batch-size ",
      args.batch_size,
      "; every micro-batch needs at least one sample");
  usage_check(
      std::isfinite(args.lr) && args.lr > 0,
      "--lr must be positive and finite, but got ",
      args.lr);
  usage_check(
      args.threads_per_lane >= 0 && args.threads_per_lane <= kMaxThreadsPerLane,
      "--threads-per-lane must be 0 (automatic) or 1 to ",
      kMaxThreadsPerLane,
      ", but got ",
      args.threads_per_lane);
  usage_check(
      args.limit >= 0,
      "--limit must be 0 (all images) or positive, but got ",
      args.limit);
  usage_check(
      args.log_every >= 1,
      "--log-every must be at least 1, but got ",
      args.log_every);

  usage_check(
      args.partitions >= 1 && args.partitions <= spec.layers,
      "--partitions must be between 1 and ",
      spec.layers,
      " (the layers of --model ",
      spec.name,
      "), but got ",
      args.partitions);
  if (app.count("--balance") > 0) {
    args.balance = parse_balance(args.balance_text);
    const auto n = static_cast<int64_t>(args.balance.size());
    usage_check(
        app.count("--partitions") == 0 || args.partitions == n,
        "--balance '",
        args.balance_text,
        "' has ",
        n,
        " entries, but --partitions is ",
        args.partitions,
        "; give one entry per partition or leave out --partitions");
    int64_t sum = 0;
    for (const auto b : args.balance) {
      // Also keeps the sum from overflowing.
      usage_check(
          b <= spec.layers,
          "--balance '",
          args.balance_text,
          "' has an entry of ",
          b,
          ", but --model ",
          spec.name,
          " has only ",
          spec.layers,
          " layers");
      sum += b;
    }
    usage_check(
        sum == spec.layers,
        "--balance '",
        args.balance_text,
        "' sums to ",
        sum,
        ", but --model ",
        spec.name,
        " has ",
        spec.layers,
        " layers");
    args.partitions = n;
  } else if (args.partitions == 2 && !spec.two_way_balance.empty()) {
    args.balance = spec.two_way_balance;
  } else {
    args.balance = even_balance(spec.layers, args.partitions);
  }

  usage_check(
      args.trace_steps >= 1,
      "--trace-steps must be at least 1, but got ",
      args.trace_steps);
  const bool trace = app.count("--trace") > 0;
  const bool timeline = app.count("--timeline") > 0;
  usage_check(
      trace || timeline || app.count("--trace-steps") == 0,
      "--trace-steps has no effect without --trace or --timeline");
  if (trace) {
    verify_output_path("--trace", args.trace_path);
  }
  if (timeline) {
    verify_output_path("--timeline", args.timeline_path);
  }
  if (trace && timeline) {
    std::error_code ignored;
    usage_check(
        fs::weakly_canonical(args.trace_path, ignored) !=
            fs::weakly_canonical(args.timeline_path, ignored),
        "--trace and --timeline both name '",
        args.trace_path,
        "'; give them different files");
  }

  // Last, so that an uninstalled data set does not hide other mistakes.
  verify_data_dir(args.data_dir);
}

// c10::Error messages may carry context on further lines; print one.
std::string one_line(const std::string& text) {
  std::string line;
  bool space = false;
  for (const char c : text) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      space = true;
      continue;
    }
    if (space && !line.empty()) {
      line += ' ';
    }
    space = false;
    line += c;
  }
  return line;
}

int train(const Args& args) {
  torch::manual_seed(args.seed);
  auto train_x = read_idx(args.data_dir + "/" + kDataFiles[0], true);
  auto train_y = read_idx(args.data_dir + "/" + kDataFiles[1], false);
  auto test_x = read_idx(args.data_dir + "/" + kDataFiles[2], true);
  auto test_y = read_idx(args.data_dir + "/" + kDataFiles[3], false);
  TORCH_CHECK_VALUE(
      train_x.size(0) == train_y.size(0) && test_x.size(0) == test_y.size(0),
      args.data_dir,
      ": the image and label files do not have as many entries");
  TORCH_CHECK_VALUE(
      train_x.size(0) > 0 && test_x.size(0) > 0,
      args.data_dir,
      ": no training or no test images");
  if (args.limit > 0 && args.limit < train_x.size(0)) {
    train_x = train_x.narrow(0, 0, args.limit);
    train_y = train_y.narrow(0, 0, args.limit);
  }
  const int64_t n = train_x.size(0);
  const int64_t batch_size = args.batch_size;
  const int64_t epochs = args.epochs;

  // Record steps 2 .. trace_steps + 1 (the first one warms up); a run with
  // fewer steps would write nothing. epochs * steps_per_epoch > trace_steps,
  // written so that it cannot overflow.
  const bool tracing = !args.trace_path.empty() || !args.timeline_path.empty();
  const int64_t steps_per_epoch = (n - 1) / batch_size + 1;
  if (tracing && epochs <= args.trace_steps / steps_per_epoch) {
    throw UsageError(c10::str(
        "--trace-steps ",
        args.trace_steps,
        " needs more than ",
        args.trace_steps,
        " steps (the first one is not recorded), but --epochs ",
        epochs,
        " of ",
        n,
        " images in batches of ",
        batch_size,
        " makes ",
        epochs * steps_per_epoch,
        "; lower --trace-steps or raise --epochs or --limit"));
  }

  const auto& spec = model_spec(args.model);
  auto net = make_model(spec);
  gpipe::GPipe model(
      net,
      gpipe::GPipeOptions(args.balance)
          .chunks(args.chunks)
          .checkpoint(gpipe::checkpoint_from_string(args.checkpoint))
          .threads_per_lane(args.threads_per_lane));
  torch::optim::SGD optimizer(
      model->parameters(), torch::optim::SGDOptions(args.lr).momentum(0.9));
  const auto out_device = model->devices().back();
  std::cout << *model << " threads_per_lane=" << model->threads_per_lane()
            << " train=" << n << " test=" << test_x.size(0) << std::endl;

  std::shared_ptr<gpipe::Trace> trace;
  if (tracing) {
    trace = std::make_shared<gpipe::Trace>();
  }
  auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
    return torch::nn::functional::cross_entropy(out, target);
  };

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int64_t step = 0;
  double last_loss = 0;
  double train_seconds = 0;
  for (int64_t epoch = 0; epoch < epochs; ++epoch) {
    model->train();
    auto order = torch::randperm(n);
    auto window_start = Clock::now();
    int64_t window_samples = 0;
    for (int64_t begin = 0; begin < n; begin += batch_size) {
      auto idx = order.narrow(0, begin, std::min(batch_size, n - begin));
      auto x = train_x.index_select(0, idx);
      auto y = train_y.index_select(0, idx).to(out_device);
      if (trace && step == 1) {
        trace->clear();
        model->set_trace(trace);
      }
      optimizer.zero_grad();
      torch::Tensor loss;
      if (args.schedule == "autograd") {
        loss = loss_fn(model->forward(x), y);
        loss.backward();
      } else {
        loss = model->train_step(
            x, y, loss_fn, gpipe::schedule_from_string(args.schedule));
      }
      optimizer.step();
      ++step;
      if (trace && step == 1 + args.trace_steps) {
        model->set_trace(nullptr);
        if (!args.trace_path.empty()) {
          trace->write_chrome_json(args.trace_path);
        }
        if (!args.timeline_path.empty()) {
          trace->write_svg(args.timeline_path);
        }
        std::printf(
            "wrote %zu traced intervals of steps 2-%lld%s%s%s%s\n",
            trace->events().size(),
            static_cast<long long>(step),
            args.trace_path.empty() ? "" : " to ",
            args.trace_path.c_str(),
            args.timeline_path.empty() ? "" : " and ",
            args.timeline_path.c_str());
        trace.reset();
      }
      window_samples += idx.size(0);
      last_loss = loss.item<double>();
      if (step % args.log_every == 0) {
        const double secs =
            std::chrono::duration<double>(Clock::now() - window_start).count();
        std::printf(
            "epoch %lld step %lld loss %.4f samples/s %.1f\n",
            static_cast<long long>(epoch + 1),
            static_cast<long long>(step),
            last_loss,
            window_samples / secs);
        std::fflush(stdout);
        window_start = Clock::now();
        window_samples = 0;
      }
    }
    train_seconds = std::chrono::duration<double>(Clock::now() - start).count();

    model->eval();
    torch::NoGradGuard no_grad;
    int64_t correct = 0;
    for (int64_t begin = 0; begin < test_x.size(0); begin += 500) {
      const auto len = std::min<int64_t>(500, test_x.size(0) - begin);
      auto out = model->forward(test_x.narrow(0, begin, len));
      correct += out.argmax(1)
                     .eq(test_y.narrow(0, begin, len).to(out.device()))
                     .sum()
                     .item<int64_t>();
    }
    const double accuracy = double(correct) / test_x.size(0);
    const double total =
        std::chrono::duration<double>(Clock::now() - start).count();
    std::printf(
        "epoch %lld done: test accuracy %.4f, elapsed %.1f s\n",
        static_cast<long long>(epoch + 1),
        accuracy,
        total);
    if (epoch + 1 == epochs) {
      std::printf("total time %.1f s\n", total);
      if (args.json) {
        nlohmann::json summary = {
            {"model", args.model},
            {"balance", args.balance},
            {"chunks", args.chunks},
            {"checkpoint", args.checkpoint},
            {"schedule", args.schedule},
            {"threads_per_lane", model->threads_per_lane()},
            {"epochs", epochs},
            {"batch_size", batch_size},
            {"steps", step},
            {"train_samples", n},
            {"final_loss", last_loss},
            {"test_accuracy", accuracy},
            {"train_seconds", train_seconds},
            {"train_samples_per_second", double(n * epochs) / train_seconds},
            {"total_seconds", total}};
        std::cout << summary.dump() << std::endl;
      }
    }
  }
  return 0;
}

}  // namespace

// Exit status: 0 after training (or --help), 2 for a bad command line (one
// line on stderr naming the flag), 1 when the run itself fails.
int main(int argc, char** argv) {
  CLI::App app{
      "Train a CNN, ResNet or U-Net on Fashion-MNIST with GPipe pipeline "
      "parallelism"};
  Args args;
  add_options(app, args);
  const auto usage_error = [](const std::string& message) {
    std::cerr << "gpipe-train: " << one_line(message) << std::endl;
    return kUsageExit;
  };
  try {
    app.parse(argc, argv);
    verify_args(app, args);
  } catch (const CLI::ParseError& e) {
    // --help is a ParseError too, with exit code 0: let CLI11 print it. The
    // others get exit status 2 rather than CLI11's codes (above 100), and
    // one line rather than CLI11's two.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(e);
    }
    return usage_error(c10::str(e.what(), " (see gpipe-train --help)"));
  } catch (const UsageError& e) {
    return usage_error(e.what());
  }
  try {
    return train(args);
  } catch (const UsageError& e) {
    return usage_error(e.what());
  } catch (const c10::Error& e) {
    std::cerr << "gpipe-train: " << one_line(e.what_without_backtrace())
              << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "gpipe-train: " << one_line(e.what()) << std::endl;
  }
  return 1;
}
