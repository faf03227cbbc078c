#include "fashion_mnist.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace gpipe_data {

namespace {

// An open gzip file, closed when it goes.
struct Gzip {
  explicit Gzip(const std::string& path) : file(gzopen(path.c_str(), "rb")) {
    TORCH_CHECK_VALUE(
        file != nullptr,
        "cannot open ",
        path,
        "; install Debian's dataset-fashion-mnist or pass --data-dir");
  }
  ~Gzip() {
    gzclose(file);
  }
  Gzip(const Gzip&) = delete;
  Gzip& operator=(const Gzip&) = delete;

  // Up to `n` bytes into `out`: how many there were.
  size_t read(uint8_t* out, size_t n, const std::string& path) {
    size_t got = 0;
    while (got < n) {
      // gzread takes an unsigned count: at most 1 GiB at a time.
      const auto want =
          static_cast<unsigned>(std::min<size_t>(n - got, size_t(1) << 30));
      const int r = gzread(file, out + got, want);
      TORCH_CHECK_VALUE(r >= 0, "cannot decompress ", path);
      if (r == 0) {
        break;
      }
      got += static_cast<size_t>(r);
    }
    return got;
  }

  gzFile file;
};

uint32_t big_endian(const uint8_t* b) {
  return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) |
         (uint32_t(b[2]) << 8) | uint32_t(b[3]);
}

}  // namespace

Idx read_idx(const std::string& path, bool images, int64_t limit) {
  Gzip file(path);
  uint8_t header[16];
  const size_t header_bytes = images ? 16 : 8;
  TORCH_CHECK_VALUE(
      file.read(header, header_bytes, path) == header_bytes,
      path,
      " is too short for IDX");
  const uint32_t magic = big_endian(header);
  const uint32_t expected = images ? 0x803 : 0x801;
  TORCH_CHECK_VALUE(
      magic == expected,
      path,
      ": expected IDX magic ",
      expected,
      ", got ",
      magic);
  Idx idx;
  idx.count = big_endian(header + 4);
  const int64_t rows = limit > 0 ? std::min(idx.count, limit) : idx.count;
  std::vector<int64_t> shape{rows};
  if (images) {
    const int64_t height = big_endian(header + 8);
    const int64_t width = big_endian(header + 12);
    TORCH_CHECK_VALUE(
        height >= 1 && width >= 1 && height <= 4096 && width <= 4096,
        path,
        ": expected images of 1 x 1 to 4096 x 4096 pixels in its header, "
        "but got ",
        height,
        " x ",
        width);
    shape = {rows, 1, height, width};
  }
  // Read in pieces rather than allocated from the header's count at once:
  // a header that promises more than the file holds is said, not allocated.
  size_t want = 1;
  for (const auto d : shape) {
    want *= static_cast<size_t>(d);
  }
  std::vector<uint8_t> bytes;
  while (bytes.size() < want) {
    const size_t before = bytes.size();
    const size_t piece = std::min(want - before, size_t(1) << 24);
    bytes.resize(before + piece);
    const size_t got = file.read(bytes.data() + before, piece, path);
    if (got < piece) {
      bytes.resize(before + got);
      break;
    }
  }
  TORCH_CHECK_VALUE(bytes.size() == want, path, ": truncated IDX payload");
  if (rows == idx.count) {
    uint8_t extra = 0;
    TORCH_CHECK_VALUE(
        file.read(&extra, 1, path) == 0,
        path,
        ": more bytes than its header's ",
        idx.count,
        " entries");
  }
  // (`to` copies out of `bytes`.)
  const auto t = torch::from_blob(bytes.data(), shape, torch::kUInt8);
  if (images) {
    // Scale to [0, 1] and standardise with the training set's statistics
    // (in place: the whole training set is 188 MB of floats).
    idx.data = t.to(torch::kFloat).div_(255.0).sub_(0.2860).div_(0.3530);
  } else {
    idx.data = t.to(torch::kLong);
  }
  return idx;
}

FashionMnist read_fashion_mnist(
    const std::string& dir, int64_t train_limit, int64_t test_limit) {
  const auto train_x =
      read_idx(dir + "/" + kFashionMnistFiles[0], true, train_limit);
  const auto train_y =
      read_idx(dir + "/" + kFashionMnistFiles[1], false, train_limit);
  const auto test_x =
      read_idx(dir + "/" + kFashionMnistFiles[2], true, test_limit);
  const auto test_y =
      read_idx(dir + "/" + kFashionMnistFiles[3], false, test_limit);
  for (const auto& [x, y, images, labels] :
       {std::tuple<const Idx&, const Idx&, const char*, const char*>{
            train_x, train_y, kFashionMnistFiles[0], kFashionMnistFiles[1]},
        {test_x, test_y, kFashionMnistFiles[2], kFashionMnistFiles[3]}}) {
    TORCH_CHECK_VALUE(
        x.count == y.count,
        dir,
        ": ",
        images,
        " has ",
        x.count,
        " images but ",
        labels,
        " has ",
        y.count,
        " labels; expected one label per image");
  }
  TORCH_CHECK_VALUE(
      train_x.count > 0 && test_x.count > 0,
      dir,
      ": no training or no test images");
  return {train_x.data, train_y.data, test_x.data, test_y.data};
}

}  // namespace gpipe_data
