#include "common.h"

namespace {

using gpipe::testing::SeededTest;
class MicrobatchTest : public SeededTest {};

TEST_F(MicrobatchTest, ScatterTensorCutsDimZero) {
  auto x = torch::arange(10).view({10, 1});
  auto batches = gpipe::scatter({x}, 3);
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_EQ(batches[0][0].size(0), 4);
  EXPECT_EQ(batches[2][0].size(0), 2);
  EXPECT_TRUE(torch::equal(gpipe::gather(batches)[0], x));
}

TEST_F(MicrobatchTest, ScatterTupleCutsEveryTensor) {
  auto a = torch::zeros({4, 2});
  auto b = torch::ones({4});
  auto batches = gpipe::scatter({a, b}, 2);
  ASSERT_EQ(batches.size(), 2u);
  ASSERT_EQ(batches[0].size(), 2u);
  EXPECT_EQ(batches[1][0].sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(batches[1][1].sizes(), (std::vector<int64_t>{2}));
  auto back = gpipe::gather(batches);
  EXPECT_TRUE(torch::equal(back[0], a));
  EXPECT_TRUE(torch::equal(back[1], b));
}

// scatter cuts as Tensor::chunk does, whatever the rows and the strides
// (it slices tensors without history itself): the same pieces, the same
// storage and strides, for every batch size against every chunk count.
TEST_F(MicrobatchTest, ScatterCutsAsChunkDoes) {
  const std::vector<torch::Tensor> inputs = {
      torch::randn({17, 3}),
      torch::randn({3, 17}).t(),  // rows not contiguous
      torch::randn({17, 4}).slice(1, 1, 3),
      torch::randn({17, 2, 2}).permute({0, 2, 1}),
      torch::randn({1, 5}),
      torch::randn({6})};
  for (const auto& x : inputs) {
    for (const int64_t chunks : {1, 2, 3, 4, 5, 7, 16, 17, 20}) {
      const auto expected = x.chunk(chunks, 0);
      const auto got = gpipe::scatter({x}, chunks);
      ASSERT_EQ(got.size(), expected.size()) << x.sizes() << " in " << chunks;
      for (size_t i = 0; i < got.size(); ++i) {
        const auto& piece = got[i][0];
        EXPECT_EQ(piece.sizes(), expected[i].sizes());
        EXPECT_EQ(piece.strides(), expected[i].strides());
        EXPECT_EQ(piece.storage_offset(), expected[i].storage_offset());
        EXPECT_TRUE(piece.is_alias_of(x));
        EXPECT_TRUE(torch::equal(piece, expected[i]));
      }
    }
  }
}

TEST_F(MicrobatchTest, BatchSmallerThanChunksGivesFewerMicroBatches) {
  EXPECT_EQ(gpipe::scatter({torch::zeros({2, 3})}, 4).size(), 2u);
  EXPECT_EQ(gpipe::scatter({torch::zeros({7, 3})}, 4).size(), 4u);
}

TEST_F(MicrobatchTest, BadBatchesAreRefused) {
  EXPECT_THROW(gpipe::scatter({}, 2), c10::ValueError);
  EXPECT_THROW(gpipe::scatter({torch::zeros({0, 3})}, 2), c10::ValueError);
  EXPECT_THROW(gpipe::scatter({torch::zeros({3})}, 0), c10::ValueError);
  EXPECT_THROW(gpipe::scatter({torch::Tensor()}, 1), c10::TypeError);
  try {
    gpipe::scatter({torch::zeros({4}), torch::zeros({5})}, 2);
    FAIL() << "mismatched batch sizes were accepted";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("same batch size"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("has 5"), std::string::npos);
  }
}

// gather joined micro-batches of other dtypes by promoting them, and
// passed LibTorch's cat errors on without saying which micro-batch.
TEST_F(MicrobatchTest, GatherNamesTheMicroBatchThatDoesNotFit) {
  auto error_of = [](const std::vector<gpipe::Batch>& batches) {
    try {
      gpipe::gather(batches);
    } catch (const c10::ValueError& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no ValueError");
  };
  const auto x = torch::zeros({5, 3});
  EXPECT_NE(
      error_of({{x}, {torch::zeros({2, 3}, torch::kLong)}})
          .find("gather: tensor 0 of micro-batch 1 is Long, but micro-batch "
                "0's is Float"),
      std::string::npos);
  EXPECT_NE(
      error_of({{x}, {torch::zeros({2, 4})}})
          .find("gather: tensor 0 of micro-batch 1 has shape [2, 4], but "
                "micro-batch 0's has [5, 3]; they may differ only in dim 0"),
      std::string::npos);
  EXPECT_NE(
      error_of({{torch::tensor(1.0)}, {torch::tensor(2.0)}})
          .find("gather: tensor 0 of micro-batch 0 has no dimensions"),
      std::string::npos);
  EXPECT_EQ(gpipe::gather({{x}, {torch::ones({2, 3})}})[0].size(0), 7);
}

}  // namespace
