// The wire format of gpipe's messages between ranks (src/dist/wire.h) and
// what ranks compare when they build their stages (src/dist/agreement.h):
// round trips, and malformed input refused rather than read.

#include "dist/wire.h"

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <set>
#include <string>
#include <vector>

#include "dist/agreement.h"

namespace gpipe::dist::detail {
namespace {

Message sample() {
  Message m;
  m.atomic = false;
  m.tensors.push_back(torch::randn({3, 5}));
  m.tensors.emplace_back();  // undefined
  m.tensors.push_back(torch::arange(7, torch::kLong).requires_grad_(false));
  m.tensors.push_back(torch::randn({2, 2}, torch::kDouble).requires_grad_());
  m.tensors.push_back(torch::tensor(true));                 // 0-dim bool
  m.tensors.push_back(torch::empty({0, 4}));                // no rows
  m.tensors.push_back(torch::randn({3}).to(torch::kHalf));  // 6 bytes, padded
  return m;
}

TEST(WireTest, AMessageRoundTripsThroughItsLayoutAndPayload) {
  const auto m = sample();
  const auto layout = layout_of(m);
  bool atomic = true;
  std::vector<TensorSpec> specs;
  ASSERT_TRUE(parse_layout(layout, atomic, specs));
  EXPECT_FALSE(atomic);
  ASSERT_EQ(specs.size(), m.tensors.size());
  const auto payload = payload_bytes(specs);
  EXPECT_EQ(payload % 8, 0);
  auto buffer = bytes(16 + payload);
  write_payload(m, buffer, 16);
  const auto back = read_payload(buffer, 16, atomic, specs);
  ASSERT_EQ(back.tensors.size(), m.tensors.size());
  for (size_t k = 0; k < m.tensors.size(); ++k) {
    const auto& a = m.tensors[k];
    const auto& b = back.tensors[k];
    ASSERT_EQ(a.defined(), b.defined()) << k;
    if (a.defined()) {
      EXPECT_EQ(a.scalar_type(), b.scalar_type()) << k;
      EXPECT_EQ(a.requires_grad(), b.requires_grad()) << k;
      EXPECT_TRUE(torch::equal(a.detach(), b.detach())) << k;
    }
  }
}

TEST(WireTest, MalformedLayoutsAreRefused) {
  const auto good = layout_of(sample());
  const auto refused = [](std::vector<int64_t> layout) {
    bool atomic = false;
    std::vector<TensorSpec> specs;
    return !parse_layout(layout, atomic, specs);
  };
  EXPECT_TRUE(refused({}));
  EXPECT_TRUE(refused({1}));
  EXPECT_TRUE(refused({1, -1}));    // a negative count
  EXPECT_TRUE(refused({1, 5000}));  // past the most tensors a message has
  auto truncated = good;
  truncated.pop_back();
  EXPECT_TRUE(refused(truncated));
  auto trailing = good;
  trailing.push_back(0);
  EXPECT_TRUE(refused(trailing));
  // One float tensor: [atomic, count, defined, dtype, grad, dim, sizes...].
  const int64_t f = static_cast<int64_t>(c10::ScalarType::Float);
  EXPECT_FALSE(refused({1, 1, 1, f, 0, 2, 3, 4}));
  EXPECT_TRUE(refused({1, 1, 1, -1, 0, 1, 3}));  // no such dtype
  EXPECT_TRUE(refused(
      {1, 1, 1, static_cast<int64_t>(c10::ScalarType::NumOptions), 0, 1, 3}));
  EXPECT_TRUE(refused({1, 1, 1, f, 0, -1}));        // a negative dim
  EXPECT_TRUE(refused({1, 1, 1, f, 0, 65}));        // too many dims
  EXPECT_TRUE(refused({1, 1, 1, f, 0, 2, 3, -4}));  // a negative size
  // Sizes whose bytes overflow 64 bits would read far past the buffer that
  // the payload's size (which the product wraps around to) allows.
  const int64_t big = int64_t{1} << 32;
  EXPECT_TRUE(refused({1, 1, 1, f, 0, 2, big, big}));
  EXPECT_TRUE(
      refused({1, 1, 1, f, 0, 1, std::numeric_limits<int64_t>::max() / 2}));
}

TEST(WireTest, TagsTellMessagesApartAndStayBelowUserTags) {
  std::set<int> tags;
  int count = 0;
  for (auto kind :
       {MessageKind::Control,
        MessageKind::Begin,
        MessageKind::Forward,
        MessageKind::Backward,
        MessageKind::ForwardSkip,
        MessageKind::BackwardSkip,
        MessageKind::Loss,
        MessageKind::Trace}) {
    for (int64_t i : {int64_t{0}, int64_t{1}, kMaxMicroBatches}) {
      for (int64_t j : {int64_t{0}, int64_t{1}, kMaxIndex}) {
        const MessageId id{kind, i, j};
        EXPECT_GE(id.tag(), 0);
        EXPECT_LT(id.tag(), 1 << 30);  // users' own tags start at 2^30
        tags.insert(id.tag());
        ++count;
      }
    }
  }
  EXPECT_EQ(static_cast<int>(tags.size()), count);
  EXPECT_EQ(describe_pass((int64_t{3} << kPassBits) | 7), "pass 7 of stage 3");
}

torch::nn::Sequential model(int64_t width) {
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(4, width));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(width, 2));
  return net;
}

// The field of `fields` named `name`.
std::string field(
    const std::vector<std::pair<std::string, std::string>>& fields,
    const std::string& name) {
  for (const auto& f : fields) {
    if (f.first == name) {
      return f.second;
    }
  }
  return "(none)";
}

TEST(AgreementTest, TheFingerprintTellsWhatDiffers) {
  const auto options = GPipeOptions({2, 1}).chunks(4);
  const auto a = fingerprint(model(8), options, 2);
  EXPECT_EQ(a, fingerprint(model(8), options, 2));  // new weights, same model
  const auto differs =
      [&](const std::vector<std::pair<std::string, std::string>>& b) {
        std::vector<std::string> names;
        for (size_t k = 0; k < a.size(); ++k) {
          if (a[k] != b[k]) {
            names.push_back(a[k].first);
          }
        }
        return names;
      };
  EXPECT_EQ(
      differs(fingerprint(model(8), GPipeOptions({1, 2}).chunks(4), 2)),
      std::vector<std::string>{"balance"});
  EXPECT_EQ(
      differs(fingerprint(model(8), GPipeOptions({2, 1}).chunks(2), 2)),
      std::vector<std::string>{"chunks"});
  EXPECT_EQ(
      differs(fingerprint(model(9), options, 2)),
      std::vector<std::string>{"parameters and buffers"});
  EXPECT_EQ(field(a, "skips"), "none");
}

TEST(AgreementTest, TheFirstDifferenceOfTwoListsIsQuotedWithItsPlace) {
  using Pair = std::pair<std::string, std::string>;
  EXPECT_EQ(
      first_difference("a; b; c", "a; x; c"),
      Pair("'b' (entry 2 of 3)", "'x' (entry 2 of 3)"));
  EXPECT_EQ(
      first_difference("a; b", "a; b; c"),
      Pair("nothing at entry 3 (2 entries)", "'c' (entry 3 of 3)"));
  EXPECT_EQ(
      first_difference("", "a"),
      Pair("nothing at entry 1 (0 entries)", "'a' (entry 1 of 1)"));
  // Equal lists (the hashes differed for another reason): the lists.
  EXPECT_EQ(first_difference("a; b", "a; b"), Pair("a; b", "a; b"));
}

TEST(AgreementTest, TwoPlansAreToldApartWhereTheyFirstDiffer) {
  auto text = [](const std::string& csv) {
    return plan_identity(Plan::from_csv(csv));
  };
  auto differ = [&](const std::string& a, const std::string& b) {
    return plan_difference(text(a), text(b), "rank 1", "rank 0");
  };
  const std::string fill = "0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0\n";
  EXPECT_EQ(differ(fill, fill), "");
  // The first action of the first lane that differs, numbered from 1.
  EXPECT_EQ(
      differ(fill, "0F0,0F1,0B1,0B0\n1F0,1B0,1F1,1B1\n"),
      "the plans first differ at lane 1, action 2: rank 1's is 1F1, "
      "rank 0's is 1B0");
  // A lane cut short.
  EXPECT_EQ(
      differ("0F0,0B0\n1F0\n", "0F0,0B0\n1F0,1B0\n"),
      "the plans first differ at lane 1, action 2: rank 1's lane has only "
      "1 action, rank 0's is 1B0");
  // Sizes before actions.
  EXPECT_EQ(
      differ(fill, "0F0,0B0\n1F0,1B0\n"),
      "the plans differ in size: rank 1's has 2 micro-batches, 2 stages, "
      "rank 0's 1 micro-batch, 2 stages");
  // A placement line on one side only (stages 0 and 2 on lane 0 is
  // modulo's, written as no line; stages 0 and 3 is a V's).
  EXPECT_EQ(
      differ(
          "0F0,2F0,2B0,0B0\n1F0,3F0,3B0,1B0\n",
          "# placement: 0 1 1 0\n0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n"),
      "the plans place their stages differently: rank 1's has no placement "
      "line, rank 0's '# placement: 0 1 1 0'");
}

}  // namespace
}  // namespace gpipe::dist::detail
