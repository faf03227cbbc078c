#include "fashion_mnist.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cstdint>
#include <vector>

namespace gpipe_data {

namespace {

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

}  // namespace

at::Tensor read_idx(const std::string& path, bool images) {
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
    TORCH_CHECK_VALUE(bytes.size() >= 16, path, " is too short for IDX");
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

FashionMnist read_fashion_mnist(const std::string& dir) {
  FashionMnist data;
  data.train_x = read_idx(dir + "/" + kFashionMnistFiles[0], true);
  data.train_y = read_idx(dir + "/" + kFashionMnistFiles[1], false);
  data.test_x = read_idx(dir + "/" + kFashionMnistFiles[2], true);
  data.test_y = read_idx(dir + "/" + kFashionMnistFiles[3], false);
  TORCH_CHECK_VALUE(
      data.train_x.size(0) == data.train_y.size(0) &&
          data.test_x.size(0) == data.test_y.size(0),
      dir,
      ": the image and label files do not have as many entries");
  TORCH_CHECK_VALUE(
      data.train_x.size(0) > 0 && data.test_x.size(0) > 0,
      dir,
      ": no training or no test images");
  return data;
}

}  // namespace gpipe_data
