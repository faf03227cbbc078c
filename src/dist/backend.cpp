// Which backend a job uses, and what every backend shares (see Note
// [Backends] in dist/backend.h).

#include "dist/backend.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace gpipe::dist::detail {

namespace {

// c10d's tags, as Gloo has them.
class TaggedChannel final : public Channel {
 public:
  explicit TaggedChannel(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)) {}

  c10::intrusive_ptr<c10d::Work> send(
      torch::Tensor bytes, int64_t peer, int tag) override {
    std::vector<at::Tensor> tensors{std::move(bytes)};
    return group_->send(tensors, static_cast<int>(peer), tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(
      torch::Tensor bytes, int64_t peer, int tag) override {
    std::vector<at::Tensor> tensors{std::move(bytes)};
    return group_->recv(tensors, static_cast<int>(peer), tag);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

std::string listed(const std::vector<std::string>& names) {
  std::string text;
  for (const auto& name : names) {
    text += (text.empty() ? "'" : ", '") + name + "'";
  }
  return text.empty() ? "none" : text;
}

}  // namespace

std::shared_ptr<Channel> tagged_channel(
    c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_shared<TaggedChannel>(std::move(group));
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names;
#ifdef GPIPE_HAS_GLOO
  names.emplace_back("gloo");
#endif
#ifdef GPIPE_HAS_NCCL
  names.emplace_back("nccl");
#endif
  return names;
}

GroupFactory backend_from_env(
    const std::string& master_addr,
    int64_t local_rank,
    int64_t local_size,
    std::chrono::milliseconds timeout) {
  const auto names = compiled_backends();
  const char* value = std::getenv("GPIPE_DIST_BACKEND");
  std::string name =
      value != nullptr && *value != '\0'
          ? std::string(value)
          : (names.empty() ? std::string("gloo") : names.front());
  bool have = false;
  for (const auto& n : names) {
    have = have || n == name;
  }
  TORCH_CHECK_VALUE(
      have,
      "gpipe::dist expects GPIPE_DIST_BACKEND to name a backend of this "
      "build (",
      listed(names),
      "), but got '",
      name,
      "'",
      name == "nccl" ? ": NCCL needs gpipe built against a CUDA LibTorch 2.x "
                       "with NCCL"
                     : "");
  const char* channel_value = std::getenv("GPIPE_DIST_CHANNEL");
  const std::string channel =
      channel_value != nullptr ? std::string(channel_value) : std::string();
  TORCH_CHECK_VALUE(
      channel.empty() || channel == "ordered" ||
          (channel == "tagged" && name == "gloo"),
      "gpipe::dist expects GPIPE_DIST_CHANNEL to be unset",
      name == "gloo" ? ", 'tagged' or 'ordered'" : " or 'ordered'",
      " on the ",
      name,
      " backend, but got '",
      channel,
      "'",
      channel == "tagged" ? ": NCCL has no tags" : "");
#ifdef GPIPE_HAS_NCCL
  if (name == "nccl") {
    return nccl_groups(local_rank, timeout);
  }
#endif
#ifdef GPIPE_HAS_GLOO
  return gloo_groups(
      master_addr,
      timeout,
      channel == "ordered" ? GlooChannel::Ordered : GlooChannel::Tagged,
      local_size);
#else
  (void)master_addr;
  (void)local_rank;
  (void)local_size;
  (void)timeout;
  TORCH_INTERNAL_ASSERT(false, "no backend for '", name, "'");
#endif
}

std::string message_of(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

torch::Tensor on_group_device(const Groups& groups, const torch::Tensor& t) {
  return t.device() == groups.device ? t : t.to(groups.device);
}

torch::Tensor summable_on_group_device(
    const Groups& groups, const torch::Tensor& t) {
  if (t.scalar_type() == torch::kShort) {
    return t.to(groups.device, torch::kInt);
  }
  if (t.scalar_type() == torch::kBFloat16 && !groups.device.is_cuda()) {
    return t.to(groups.device, torch::kFloat);
  }
  return on_group_device(groups, t);
}

torch::Tensor byte_view(const torch::Tensor& t) {
  // (reshape keeps a stride other than 1 where a contiguous tensor of one
  // element, or none, has one: view(dtype) refuses that.)
  return t.as_strided({t.numel()}, {1}).view(torch::kByte);
}

}  // namespace gpipe::dist::detail
