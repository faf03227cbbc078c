// The ordered channel (src/dist/ordered_channel.cpp, Note [Tags over an
// ordered backend]), which carries gpipe's tagged messages over NCCL, run
// here over two-rank Gloo groups with its sends and receives in order only
// (every one on c10d tag 0), the ranks threads of this process.

#include "dist/ordered_channel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "dist/ranks.h"

namespace {

using gpipe::dist::detail::Channel;
using gpipe::dist::detail::PairGroup;
constexpr auto kWait = std::chrono::seconds(30);
constexpr auto kStoreWait = std::chrono::milliseconds(10000);

std::shared_ptr<Channel> gloo_channel(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t size) {
  auto device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return gpipe::dist::detail::ordered_channel(
      store,
      rank,
      size,
      c10::Device(c10::kCPU),
      [device](const c10::intrusive_ptr<c10d::Store>& pair_store, int64_t r)
          -> c10::intrusive_ptr<PairGroup> {
        auto options = c10d::ProcessGroupGloo::Options::create(kWait);
        options->devices.push_back(device);
        return c10::make_intrusive<c10d::ProcessGroupGloo>(
            pair_store, static_cast<int>(r), 2, options);
      },
      [](PairGroup&) {},
      /*poll=*/false);
}

// Runs `fn(rank, channel)` on `n` threads; rethrows the first error. With
// `tcp`, each rank has a TCPStore client of its own, as a process has
// (whose operations take turns), with `store_wait` as the stores' timeout;
// else they share a HashStore.
void run(
    int64_t n,
    const std::function<void(int64_t, const std::shared_ptr<Channel>&)>& fn,
    bool tcp = false,
    std::chrono::milliseconds store_wait = kStoreWait) {
  c10::intrusive_ptr<c10d::Store> shared =
      c10::make_intrusive<c10d::HashStore>();
  std::vector<c10::intrusive_ptr<c10d::Store>> stores(n, shared);
  if (tcp) {
    c10d::TCPStoreOptions server;
    server.port = 0;  // any free one
    server.isServer = true;
    server.waitWorkers = false;
    server.timeout = store_wait;
    auto master = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", server);
    stores[0] = master;
    for (int64_t r = 1; r < n; ++r) {
      c10d::TCPStoreOptions client;
      client.port = master->getPort();
      client.timeout = store_wait;
      stores[r] = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", client);
    }
  }
  gpipe::dist::testing::run_threads(
      n, [&](int64_t r) { fn(r, gloo_channel(stores[r], r, n)); });
}

torch::Tensor filled(int64_t bytes, int value) {
  return torch::full({bytes}, value, torch::kByte);
}

std::string message_of(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait(kWait);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(OrderedChannelTest, ReceivesPostedOutOfOrderGetTheirOwnMessages) {
  run(3, [](int64_t rank, const std::shared_ptr<Channel>& channel) {
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    if (rank == 0) {
      // To rank 1, in this order: tag 5, tag 7, tag 5 again; to rank 2, 1.
      sends.push_back(channel->send(filled(10, 51), 1, 5));
      sends.push_back(channel->send(filled(20, 71), 1, 7));
      sends.push_back(channel->send(filled(30, 52), 1, 5));
      sends.push_back(channel->send(filled(8, 11), 2, 1));
    } else if (rank == 2) {
      sends.push_back(channel->send(filled(12, 91), 1, 9));
      auto from0 = torch::empty({8}, torch::kByte);
      channel->recv(from0, 0, 1)->wait(kWait);
      EXPECT_TRUE(from0.equal(filled(8, 11)));
    } else {
      // Rank 1 asks for the last tag first, then the other peer's, then
      // tag 5 twice: each gets its own bytes, tag 5's in the order sent.
      auto seven = torch::empty({20}, torch::kByte);
      auto nine = torch::empty({12}, torch::kByte);
      auto five_a = torch::empty({10}, torch::kByte);
      auto five_b = torch::empty({30}, torch::kByte);
      auto w7 = channel->recv(seven, 0, 7);
      auto w9 = channel->recv(nine, 2, 9);
      w7->wait(kWait);
      w9->wait(kWait);
      channel->recv(five_a, 0, 5)->wait(kWait);
      channel->recv(five_b, 0, 5)->wait(kWait);
      EXPECT_TRUE(seven.equal(filled(20, 71)));
      EXPECT_TRUE(nine.equal(filled(12, 91)));
      EXPECT_TRUE(five_a.equal(filled(10, 51)));
      EXPECT_TRUE(five_b.equal(filled(30, 52)));
    }
    for (auto& w : sends) {
      w->wait(kWait);
    }
  });
}

TEST(OrderedChannelTest, AMessageOfAnotherSizeFailsItsReceive) {
  run(2, [](int64_t rank, const std::shared_ptr<Channel>& channel) {
    if (rank == 0) {
      channel->send(filled(16, 1), 1, 3)->wait(kWait);
    } else {
      auto small = torch::empty({8}, torch::kByte);
      const auto what = message_of(channel->recv(small, 0, 3));
      EXPECT_NE(
          what.find("rank 0 sent 16 bytes on tag 3 where 8 were expected"),
          std::string::npos)
          << what;
    }
  });
}

TEST(OrderedChannelTest, AnAbortEndsWhatIsPostedAndRefusesWhatComes) {
  // Rank 1's channel is kept for good: its reader left a Gloo receive
  // posted, as a failed connection does (Connection keeps its channel).
  static std::vector<std::shared_ptr<Channel>> kept;
  std::atomic<bool> checked{false};
  run(2, [&checked](int64_t rank, const std::shared_ptr<Channel>& channel) {
    auto one = torch::empty({4}, torch::kByte);
    if (rank == 0) {
      channel->send(filled(4, 7), 1, 2)->wait(kWait);
      // Alive until rank 1 is done: its receives would fail on their own
      // once this rank's groups close.
      while (!checked) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      return;
    }
    channel->recv(one, 0, 2)->wait(kWait);
    EXPECT_TRUE(one.equal(filled(4, 7)));
    // A receive nobody will send: the abort ends it, and what comes after
    // fails at once.
    auto never = channel->recv(torch::empty({4}, torch::kByte), 0, 6);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(never->isCompleted());
    const auto start = std::chrono::steady_clock::now();
    channel->abort();
    EXPECT_NE(message_of(never).find("aborted"), std::string::npos);
    EXPECT_NE(
        message_of(channel->recv(torch::empty({4}, torch::kByte), 0, 2))
            .find("aborted"),
        std::string::npos);
    EXPECT_NE(
        message_of(channel->send(filled(4, 1), 0, 2)).find("aborted"),
        std::string::npos);
    EXPECT_LT(
        std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    kept.push_back(channel);
    checked = true;
  });
}

// Rank 0 posts the receive of a message rank 2 sends last, then talks to
// rank 1, which talks to rank 2: making the pair group for rank 2's message
// waits on the store for rank 2's side, which comes only at the end. With
// a TCPStore client per rank that wait must not hold up rank 0's other
// store operations (Note [Waiting on the store while others use it]):
// before, rank 0's group with rank 1 waited behind it until the store's
// timeout.
TEST(OrderedChannelTest, AGroupWaitingForItsPeerHoldsUpNoOtherGroup) {
  const auto start = std::chrono::steady_clock::now();
  run(
      3,
      [](int64_t rank, const std::shared_ptr<Channel>& channel) {
        auto got = torch::empty({4}, torch::kByte);
        if (rank == 0) {
          auto last = channel->recv(got, 2, 1);
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          channel->send(filled(4, 10), 1, 2)->wait(kWait);
          last->wait(kWait);
          EXPECT_TRUE(got.equal(filled(4, 12)));
        } else if (rank == 1) {
          channel->recv(got, 0, 2)->wait(kWait);
          channel->send(got + 1, 2, 3)->wait(kWait);
        } else {
          channel->recv(got, 1, 3)->wait(kWait);
          channel->send(got + 1, 0, 1)->wait(kWait);
        }
      },
      /*tcp=*/true);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

// gpipe's timeout counts from when a lane waits, not from when it posted
// the receive: a message whose pair group comes later than the store's
// timeout (rank 0 sends after 2.5 s, the stores give up after 1 s) still
// arrives. Before, the group's wait on the store gave up with the store.
TEST(OrderedChannelTest, APairThatTalksLateStillMeets) {
  run(
      2,
      [](int64_t rank, const std::shared_ptr<Channel>& channel) {
        if (rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
          channel->send(filled(4, 5), 1, 1)->wait(kWait);
        } else {
          auto got = torch::empty({4}, torch::kByte);
          channel->recv(got, 0, 1)->wait(kWait);
          EXPECT_TRUE(got.equal(filled(4, 5)));
        }
      },
      /*tcp=*/true,
      /*store_wait=*/std::chrono::milliseconds(1000));
}

// A receive from a rank that never talks: its pair group waits for the
// other side on the store. An abort ends the receive and that wait, so the
// channel closes at once (before, it waited out Gloo's 30 s).
TEST(OrderedChannelTest, AnAbortEndsAGroupStillWaitingForItsPeer) {
  const auto start = std::chrono::steady_clock::now();
  run(2, [](int64_t rank, const std::shared_ptr<Channel>& channel) {
    if (rank == 0) {
      return;
    }
    auto never = channel->recv(torch::empty({4}, torch::kByte), 0, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    channel->abort();
    EXPECT_NE(message_of(never).find("aborted"), std::string::npos);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
