#pragma once

// gpipe's tagged messages over a backend whose point-to-point sends and
// receives match in order, without tags (NCCL's): see Note [Tags over an
// ordered backend] in ordered_channel.cpp. The backend gives one group of
// two per ordered pair of ranks; the tests run it over Gloo.

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dist/backend.h"

namespace c10d {
class Backend;
class ProcessGroup;
class Store;
}  // namespace c10d

namespace gpipe::dist::detail {

/// A backend's group of two ranks: a c10d::Backend from LibTorch 2.0 on, a
/// c10d::ProcessGroup before.
#if TORCH_VERSION_MAJOR >= 2
using PairGroup = c10d::Backend;
#else
using PairGroup = c10d::ProcessGroup;
#endif

/// Makes the group of two that meets under `store` (already prefixed for
/// the pair), this rank being `rank` (0: the sender, 1: the receiver).
using PairFactory = std::function<c10::intrusive_ptr<PairGroup>(
    const c10::intrusive_ptr<c10d::Store>& store, int64_t rank)>;
/// Ends what is posted on a pair's group, after a failure.
using PairAbort = std::function<void(PairGroup& group)>;

/// The channel of rank `rank` of `size`, meeting in `store`: messages
/// travel as `device` tensors over the groups `make_pair` makes. `poll`:
/// the backend's works say when they have ended (isCompleted: NCCL's,
/// whose wait only orders the GPU); else they end when waited for (Gloo's)
/// and a reader blocks in wait, ended by the work's abort.
std::shared_ptr<Channel> ordered_channel(
    c10::intrusive_ptr<c10d::Store> store,
    int64_t rank,
    int64_t size,
    c10::Device device,
    PairFactory make_pair,
    PairAbort abort_pair,
    bool poll);

}  // namespace gpipe::dist::detail
