#pragma once

// The backend seam of gpipe::dist: what a c10d backend makes for a set of
// ranks (a process group for collectives, a channel for gpipe's messages,
// the device their tensors live on), and which backend a job uses.
//
// Note [Backends]
// A backend is one file: src/dist/gloo.cpp (CPU tensors; messages on
// c10d's tags) and src/dist/nccl.cpp (CUDA tensors; compiled only where
// LibTorch has NCCL). Everything above this seam (Connection, World, Mesh,
// the gradient buckets) talks to a Groups and never names a backend:
// - collectives go to `group`, with tensors on `device` (a CPU tensor of a
//   World collective on NCCL travels through the rank's GPU and back);
// - gpipe's messages go through `channel`, which sends and receives host
//   bytes on a tag, as c10d's Gloo does natively. NCCL has no tags and
//   matches a pair's sends and receives in order, so the tags are built on
//   top (Note [Tags over an ordered backend] in dist/ordered_channel.cpp,
//   tested over Gloo);
// - failure notices never use either: they travel through the store (Note
//   [Failure notices] in dist/connection.h).

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}  // namespace c10d

namespace gpipe::dist::detail {

/// Point-to-point bytes between the ranks of a group.
class Channel {
 public:
  virtual ~Channel() = default;
  /// Sends the host bytes `bytes` to `peer` on `tag`; the work ends when the
  /// peer has taken them. `bytes` stays untouched until then.
  virtual c10::intrusive_ptr<c10d::Work> send(
      torch::Tensor bytes, int64_t peer, int tag) = 0;
  /// Receives into the host bytes `bytes` the message `peer` sends on
  /// `tag`, which must be exactly as long. The work can be aborted.
  virtual c10::intrusive_ptr<c10d::Work> recv(
      torch::Tensor bytes, int64_t peer, int tag) = 0;
  /// After a failure: ends every transfer in progress, for good.
  virtual void abort() {}
};

/// What a backend makes for `size` ranks meeting in a store. A group of one
/// rank has no group and no channel.
struct Groups {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::shared_ptr<Channel> channel;
  /// Where the group's collectives take their tensors.
  c10::Device device = c10::Device(c10::kCPU);
};

/// Makes the groups of `size` ranks meeting in `store`, this one `rank`.
using GroupFactory = std::function<Groups(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t size)>;

/// How gpipe's messages travel on Gloo: on c10d's tags (Gloo's own), or
/// through the ordered channel NCCL uses, over Gloo groups of two (so that
/// its logic runs whole jobs on a CPU: the tests do).
enum class GlooChannel { Tagged, Ordered };

/// Gloo groups over the interface GLOO_SOCKET_IFNAME names; when it is not
/// set, loopback when `master_addr` is this host's loopback, else the
/// interface of this host's own name (as c10d picks it). Every group waits
/// at most `timeout` for a peer. A group that cannot be made is a c10::Error
/// naming the rank and the timeout. (src/dist/gloo.cpp)
///
/// `local_ranks` is how many ranks share this host (LOCAL_WORLD_SIZE): with
/// more of them than CPUs, Gloo's event-loop thread runs at nice 19 (Note
/// [Gloo's event loop on shared cores]).
GroupFactory gloo_groups(
    const std::string& master_addr,
    std::chrono::milliseconds timeout,
    GlooChannel channel = GlooChannel::Tagged,
    int64_t local_ranks = 1);

/// The nice value of Gloo's event-loop thread: `setting`
/// (GPIPE_GLOO_LOOP_NICE) when given, a whole number from 0 to 19 (anything
/// else is a c10::ValueError); else 19 when `local_ranks` outnumber `cpus`,
/// 0 otherwise. (src/dist/gloo.cpp)
int gloo_loop_nice(int64_t local_ranks, int64_t cpus, const char* setting);

/// The CPUs this process may run on (its affinity mask).
int64_t usable_cpus();

/// NCCL groups on cuda:<local_rank modulo the GPUs this process sees>.
/// (src/dist/nccl.cpp)
GroupFactory nccl_groups(int64_t local_rank, std::chrono::milliseconds timeout);

/// The backends this build has, in order of preference: "gloo" and "nccl".
std::vector<std::string> compiled_backends();

/// The factory of the backend GPIPE_DIST_BACKEND names ("gloo", the
/// default, or "nccl"); an unknown name, or one this build lacks, is a
/// c10::ValueError naming what there is. GPIPE_DIST_CHANNEL=ordered sends
/// Gloo's messages through the ordered channel (NCCL's only one); "tagged"
/// (Gloo's default) is refused on NCCL, and any other value everywhere.
/// `local_size` is how many ranks share this host.
GroupFactory backend_from_env(
    const std::string& master_addr,
    int64_t local_rank,
    int64_t local_size,
    std::chrono::milliseconds timeout);

/// A Channel over c10d's own tagged send and receive (Gloo's).
std::shared_ptr<Channel> tagged_channel(
    c10::intrusive_ptr<c10d::ProcessGroup> group);

/// The message of an exception (c10::Error without its backtrace), for the
/// errors that quote c10d's.
std::string message_of(std::exception_ptr error);

/// `tensor` where `groups`' collectives take it (itself when it is there).
torch::Tensor on_group_device(
    const Groups& groups, const torch::Tensor& tensor);

/// `tensor` on the group's device, in a dtype its sums take: neither Gloo
/// nor NCCL sums int16, and Gloo (LibTorch 1.13's) no bfloat16, so those
/// are summed as int32 and float32 (a copy, rounded back once).
torch::Tensor summable_on_group_device(
    const Groups& groups, const torch::Tensor& tensor);

/// A contiguous `tensor`'s bytes (a view, one dimension): what a broadcast
/// copies, whatever the dtype (Gloo broadcasts no bool, int16 or bfloat16).
torch::Tensor byte_view(const torch::Tensor& tensor);

}  // namespace gpipe::dist::detail
