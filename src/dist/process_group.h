#pragma once

// A backend's c10d group as a c10d::ProcessGroup, on every LibTorch: in 1.x
// a backend's group (ProcessGroupGloo, ProcessGroupNCCL) is a ProcessGroup
// itself; from 2.0 on it is a c10d::Backend, which a ProcessGroup holds and
// dispatches to by the tensors' device type. Included by the backends'
// files only (it pulls in c10d's ProcessGroup).

#include <torch/version.h>

#include <cstdint>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <type_traits>

namespace gpipe::dist::detail {

#if TORCH_VERSION_MAJOR >= 2

// ProcessGroup's constructor took options (the backend's name) up to 2.5
// or so, and (store, rank, size) since.
template <class PG = c10d::ProcessGroup>
c10::intrusive_ptr<c10d::ProcessGroup> empty_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int64_t rank,
    int64_t size,
    const char* name) {
  if constexpr (
      std::is_constructible_v<PG, c10::intrusive_ptr<c10d::Store>, int, int>) {
    (void)name;
    return c10::make_intrusive<PG>(
        store, static_cast<int>(rank), static_cast<int>(size));
  } else {
    return c10::make_intrusive<PG>(
        store,
        static_cast<int>(rank),
        static_cast<int>(size),
        c10::make_intrusive<typename PG::Options>(name));
  }
}

/// `backend`, for tensors of `device_type`, as the group's default backend.
template <class Backend>
c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(
    c10::intrusive_ptr<Backend> backend,
    const c10::intrusive_ptr<c10d::Store>& store,
    int64_t rank,
    int64_t size,
    c10::DeviceType device_type,
    c10d::ProcessGroup::BackendType type,
    const char* name) {
  auto group = empty_process_group(store, rank, size, name);
  c10::intrusive_ptr<c10d::Backend> base = std::move(backend);
  group->setBackend(device_type, type, base);
  group->setDefaultBackend(type);
  return group;
}

#else

template <class Backend>
c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(
    c10::intrusive_ptr<Backend> backend,
    const c10::intrusive_ptr<c10d::Store>&,
    int64_t,
    int64_t,
    c10::DeviceType,
    int,
    const char*) {
  return backend;
}

#endif

}  // namespace gpipe::dist::detail
