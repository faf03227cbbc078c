// gpipe-train: trains a small CNN, ResNet or U-Net on Fashion-MNIST through a
// GPipe pipeline and reports progress, test accuracy and time.
//
//   gpipe-train [--model cnn] [--partitions 2] [--chunks 4] ...

#include <gpipe/gpipe.h>
#include <gpipe/models/resnet.h>
#include <gpipe/models/unet.h>
#include <torch/torch.h>
#include <zlib.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
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

struct Model {
  torch::nn::Sequential net;
  // The balance for 2 partitions: it puts skips across the boundary.
  std::vector<int64_t> two_way_balance;
};

Model make_model(const std::string& name) {
  if (name == "resnet") {
    // 39 layers: stem 0-2, bottlenecks 3-13, 14-24, 25-35, head 36-38. The
    // cut after the second bottleneck's relu2 splits the work about in two
    // and carries that block's identity across.
    return {gpipe::models::resnet_small(10), {21, 18}};
  }
  if (name == "unet") {
    // 69 layers: pad, encoder levels 0-4 of 6 layers (1-30), the
    // bottleneck (31-34), decoder levels 4-0 of 6 layers (35-64), segment
    // and head (65-68). The cut after decoder level 4 splits the
    // multiply-adds about in two and carries the skips of levels 0-3 across.
    return {make_unet(), {41, 28}};
  }
  return {make_cnn(), {}};
}

std::vector<int64_t> even_balance(int64_t layers, int64_t partitions) {
  TORCH_CHECK_VALUE(
      partitions >= 1 && partitions <= layers,
      "--partitions must be between 1 and ",
      layers,
      ", but got ",
      partitions);
  std::vector<int64_t> balance(partitions, layers / partitions);
  for (int64_t k = 0; k < layers % partitions; ++k) {
    balance[partitions - 1 - k] += 1;
  }
  return balance;
}

std::vector<int64_t> parse_balance(const std::string& text) {
  std::vector<int64_t> balance;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    balance.push_back(std::stoll(item));
  }
  return balance;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Train a CNN, ResNet or U-Net on Fashion-MNIST with GPipe pipeline "
      "parallelism"};
  std::string model_name = "cnn";
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
  app.add_option(
         "--model",
         model_name,
         "cnn: conv-BN-ReLU blocks; resnet: a small ResNet of bottlenecks; "
         "unet: a U-Net with a pooling classifier (skips cross partitions)")
      ->check(CLI::IsMember({"cnn", "resnet", "unet"}));
  app.add_option("--data-dir", data_dir, "Folder with the gzipped IDX files");
  app.add_option("--partitions", partitions, "Number of pipeline partitions");
  app.add_option(
      "--balance",
      balance_text,
      "Layers per partition, e.g. 6,7 (default: even, or one that puts "
      "skips across 2 partitions for resnet and unet)");
  app.add_option("--chunks", chunks, "Micro-batches per mini-batch");
  app.add_option("--checkpoint", checkpoint, "always | except_last | never");
  app.add_option("--epochs", epochs, "Training epochs");
  app.add_option("--batch-size", batch_size, "Mini-batch size");
  app.add_option("--lr", lr, "SGD learning rate (momentum 0.9)");
  app.add_option(
      "--threads-per-lane",
      threads_per_lane,
      "Intra-op threads per CPU lane (0: automatic)");
  app.add_option(
      "--limit", limit, "Use only the first N training images (0: all)");
  app.add_option("--log-every", log_every, "Print progress every N steps");
  app.add_option("--seed", seed, "Random seed");
  app.add_flag("--json", json, "Print one final JSON summary line");
  app.add_option(
         "--schedule",
         schedule,
         "autograd: forward, then loss.backward(); fill_drain | 1f1b: "
         "train_step with the loss inside the pipeline")
      ->check(CLI::IsMember({"autograd", "fill_drain", "1f1b"}));
  app.add_option(
      "--trace", trace_path, "Write a Chrome trace JSON of a few steps here");
  app.add_option(
      "--timeline", timeline_path, "Write an SVG timeline of a few steps here");
  app.add_option(
      "--trace-steps",
      trace_steps,
      "Steps to record for --trace/--timeline (from the second step)");
  CLI11_PARSE(app, argc, argv);

  try {
    torch::manual_seed(seed);
    auto train_x = read_idx(data_dir + "/train-images-idx3-ubyte.gz", true);
    auto train_y = read_idx(data_dir + "/train-labels-idx1-ubyte.gz", false);
    auto test_x = read_idx(data_dir + "/t10k-images-idx3-ubyte.gz", true);
    auto test_y = read_idx(data_dir + "/t10k-labels-idx1-ubyte.gz", false);
    if (limit > 0 && limit < train_x.size(0)) {
      train_x = train_x.narrow(0, 0, limit);
      train_y = train_y.narrow(0, 0, limit);
    }

    auto [net, two_way_balance] = make_model(model_name);
    const auto layers = static_cast<int64_t>(net->size());
    std::vector<int64_t> balance;
    if (!balance_text.empty()) {
      balance = parse_balance(balance_text);
    } else if (partitions == 2 && !two_way_balance.empty()) {
      balance = two_way_balance;
    } else {
      balance = even_balance(layers, partitions);
    }
    gpipe::GPipe model(
        net,
        gpipe::GPipeOptions(balance)
            .chunks(chunks)
            .checkpoint(gpipe::checkpoint_from_string(checkpoint))
            .threads_per_lane(threads_per_lane));
    torch::optim::SGD optimizer(
        model->parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
    const auto out_device = model->devices().back();
    std::cout << *model << " threads_per_lane=" << model->threads_per_lane()
              << " train=" << train_x.size(0) << " test=" << test_x.size(0)
              << std::endl;

    // Record steps 2 .. trace_steps + 1 (the first one warms up).
    std::shared_ptr<gpipe::Trace> trace;
    if (!trace_path.empty() || !timeline_path.empty()) {
      trace = std::make_shared<gpipe::Trace>();
    }
    auto loss_fn = [](torch::Tensor out, torch::Tensor target) {
      return torch::nn::functional::cross_entropy(out, target);
    };

    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const int64_t n = train_x.size(0);
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
        if (schedule == "autograd") {
          loss = loss_fn(model->forward(x), y);
          loss.backward();
        } else {
          loss = model->train_step(
              x, y, loss_fn, gpipe::schedule_from_string(schedule));
        }
        optimizer.step();
        ++step;
        if (trace && step == 1 + trace_steps) {
          model->set_trace(nullptr);
          if (!trace_path.empty()) {
            trace->write_chrome_json(trace_path);
          }
          if (!timeline_path.empty()) {
            trace->write_svg(timeline_path);
          }
          std::printf(
              "wrote %zu traced intervals of steps 2-%lld%s%s%s%s\n",
              trace->events().size(),
              static_cast<long long>(step),
              trace_path.empty() ? "" : " to ",
              trace_path.c_str(),
              timeline_path.empty() ? "" : " and ",
              timeline_path.c_str());
          trace.reset();
        }
        window_samples += idx.size(0);
        last_loss = loss.item<double>();
        if (step % log_every == 0) {
          const double secs =
              std::chrono::duration<double>(Clock::now() - window_start)
                  .count();
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
      train_seconds =
          std::chrono::duration<double>(Clock::now() - start).count();

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
        if (json) {
          nlohmann::json summary = {
              {"model", model_name},
              {"balance", balance},
              {"chunks", chunks},
              {"checkpoint", checkpoint},
              {"schedule", schedule},
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
  } catch (const c10::Error& e) {
    std::cerr << "gpipe-train: " << e.what_without_backtrace() << std::endl;
    return 1;
  }
  return 0;
}
