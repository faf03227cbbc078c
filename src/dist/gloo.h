#pragma once

// The Gloo process groups of a job: made in one place, with one transport
// device per process, so that a World's sub-groups (World::split) talk over
// the same interface as the World itself.

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace gpipe::dist::detail {

/// Makes the group of `size` ranks meeting in `store`, this one `rank`.
using GroupFactory = std::function<c10::intrusive_ptr<c10d::ProcessGroup>(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank, int64_t size)>;

/// Gloo groups over the interface GLOO_SOCKET_IFNAME names; when it is not
/// set, loopback when `master_addr` is this host's loopback, else the
/// interface of this host's own name (as c10d picks it). Every group waits
/// at most `timeout` for a peer. A group that cannot be made is a c10::Error
/// naming the rank and the timeout.
GroupFactory gloo_groups(
    const std::string& master_addr, std::chrono::milliseconds timeout);

}  // namespace gpipe::dist::detail
