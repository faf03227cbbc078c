// Gloo process groups: the one file that knows how a group is made.

#include "dist/gloo.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace gpipe::dist::detail {

GroupFactory gloo_groups(
    const std::string& master_addr, std::chrono::milliseconds timeout) {
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
  return [device, timeout](
             const c10::intrusive_ptr<c10d::Store>& store,
             int64_t rank,
             int64_t size) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(device);
    try {
      return c10::make_intrusive<c10d::ProcessGroupGloo>(
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
  };
}

}  // namespace gpipe::dist::detail
