// NCCL process groups: the one file that knows how an NCCL group is made
// (see Note [Backends] in dist/backend.h). gpipe's messages travel over
// NCCL groups of two through the ordered channel (Note [Tags over an
// ordered backend] in dist/ordered_channel.cpp). Compiled only where
// LibTorch 2.x has NCCL.

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "dist/backend.h"
#include "dist/ordered_channel.h"
#include "dist/process_group.h"

namespace gpipe::dist::detail {

namespace {

using Nccl = c10d::ProcessGroupNCCL;

c10::intrusive_ptr<Nccl> make_nccl(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& prefix,
    int64_t rank,
    int64_t size,
    c10::Device device,
    std::chrono::milliseconds timeout) {
  auto options = Nccl::Options::create();
  // gpipe gives up on a peer after `timeout`, counted from when it waits,
  // and ends the group itself. c10d's watchdog counts from when a work is
  // posted, and a send posted early may wait for its receive as long as a
  // pass lasts: it must never fire first.
  options->timeout = timeout * 2 + std::chrono::hours(24);
  auto group = c10::make_intrusive<Nccl>(
      c10::make_intrusive<c10d::PrefixStore>(prefix, store),
      static_cast<int>(rank),
      static_cast<int>(size),
      options);
  // Its communicators on this rank's GPU, not one NCCL guesses from the rank.
  group->setBoundDeviceId(device);
  return group;
}

}  // namespace

GroupFactory nccl_groups(
    int64_t local_rank, std::chrono::milliseconds timeout) {
  const auto gpus = static_cast<int64_t>(torch::cuda::device_count());
  TORCH_CHECK_VALUE(
      gpus > 0,
      "gpipe::dist's NCCL backend (GPIPE_DIST_BACKEND=nccl) needs a GPU, but "
      "this process sees none");
  const c10::Device device(
      c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus));
  // c10d's watchdog ends the process (SIGABRT) when an NCCL operation fails,
  // by default: a rank whose peer died would never say so. gpipe sees the
  // error itself (a failed work is completed, with NCCL's message) and fails
  // the pass on every rank, so c10d only records it; a value the user set
  // stays. Read when a group is made.
  ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", /*overwrite=*/0);
  // Nor does its heartbeat monitor end it after a failed work's dump.
  ::setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", /*overwrite=*/0);
  ::setenv("TORCH_NCCL_ENABLE_MONITORING", "0", /*overwrite=*/0);
  return [device, timeout](
             const c10::intrusive_ptr<c10d::Store>& store,
             int64_t rank,
             int64_t size) {
    c10::intrusive_ptr<Nccl> whole;
    try {
      whole = make_nccl(store, "nccl/", rank, size, device, timeout);
    } catch (const c10::Error& e) {
      TORCH_CHECK(
          false,
          "gpipe::dist: rank ",
          rank,
          " of ",
          size,
          " could not make its NCCL group on ",
          device,
          " [c10d: ",
          std::string(e.what_without_backtrace()).substr(0, 300),
          "]");
    }
    Groups groups;
    groups.channel = ordered_channel(
        store,
        rank,
        size,
        device,
        [device, timeout](
            const c10::intrusive_ptr<c10d::Store>& pair_store,
            int64_t pair_rank) -> c10::intrusive_ptr<PairGroup> {
          return make_nccl(pair_store, "nccl/", pair_rank, 2, device, timeout);
        },
        [](PairGroup& group) { group.abort(); },
        /*poll=*/true);
    groups.group = as_process_group(
        whole,
        store,
        rank,
        size,
        c10::kCUDA,
        c10d::ProcessGroup::BackendType::NCCL,
        "nccl");
    // (setBackend gave the backend the wrapper's bound device: none.)
    groups.group->setBoundDeviceId(device);
    whole->setBoundDeviceId(device);
    groups.device = device;
    return groups;
  };
}

}  // namespace gpipe::dist::detail
