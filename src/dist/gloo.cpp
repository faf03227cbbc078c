// Gloo process groups: the one file that knows how a Gloo group is made
// (see Note [Backends] in dist/backend.h).

#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "dist/backend.h"
#include "dist/ordered_channel.h"
#include "dist/process_group.h"

namespace gpipe::dist::detail {

GroupFactory gloo_groups(
    const std::string& master_addr,
    std::chrono::milliseconds timeout,
    GlooChannel channel) {
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  std::shared_ptr<::gloo::transport::Device> device;
  if (iface != nullptr && *iface != '\0') {
    device = c10d::ProcessGroupGloo::createDeviceForInterface(iface);
  } else if (master_addr == "127.0.0.1" || master_addr == "localhost") {
    // Everyone is on this host.
    device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  } else {
    device = c10d::ProcessGroupGloo::createDefaultDevice();
  }
  return [device, timeout, channel](
             const c10::intrusive_ptr<c10d::Store>& store,
             int64_t rank,
             int64_t size) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(device);
    c10::intrusive_ptr<c10d::ProcessGroupGloo> backend;
    try {
      backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
          store, static_cast<int>(rank), static_cast<int>(size), options);
    } catch (const std::exception& e) {
      std::string what = e.what();
      // c10d's message, without LibTorch's backtrace.
      if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
        what = error->what_without_backtrace();
      }
      TORCH_CHECK(
          false,
          "gpipe::dist: rank ",
          rank,
          " of ",
          size,
          " could not connect to the other ranks within ",
          timeout.count() / 1000.0,
          " s [c10d: ",
          what.substr(0, 300),
          "]");
    }
#if TORCH_VERSION_MAJOR >= 2
    const auto type = c10d::ProcessGroup::BackendType::GLOO;
#else
    const int type = 0;
#endif
    Groups groups;
    groups.group = as_process_group(
        std::move(backend), store, rank, size, c10::kCPU, type, "gloo");
    if (channel == GlooChannel::Tagged) {
      groups.channel = tagged_channel(groups.group);
    } else {
      // A Gloo work ends when waited for, and its abort ends the wait: the
      // channel aborts the receive its reader waits in, and a send to a
      // rank that is gone fails by itself.
      groups.channel = ordered_channel(
          store,
          rank,
          size,
          c10::Device(c10::kCPU),
          [device, timeout](
              const c10::intrusive_ptr<c10d::Store>& pair_store,
              int64_t pair_rank) -> c10::intrusive_ptr<PairGroup> {
            auto pair_options =
                c10d::ProcessGroupGloo::Options::create(timeout);
            pair_options->devices.push_back(device);
            return c10::make_intrusive<c10d::ProcessGroupGloo>(
                pair_store, static_cast<int>(pair_rank), 2, pair_options);
          },
          [](PairGroup& /*group*/) {},
          /*poll=*/false);
    }
    groups.device = c10::Device(c10::kCPU);
    return groups;
  };
}

}  // namespace gpipe::dist::detail
