#include "dist/wire.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <memory>
#include <sstream>

namespace gpipe::dist::detail {

namespace {

int64_t padded(int64_t bytes) {
  return (bytes + 7) / 8 * 8;
}

}  // namespace

std::vector<int64_t> layout_of(const Message& message) {
  std::vector<int64_t> layout{
      message.atomic ? 1 : 0, static_cast<int64_t>(message.tensors.size())};
  for (const auto& t : message.tensors) {
    if (!t.defined()) {
      layout.push_back(0);
      continue;
    }
    layout.push_back(1);
    layout.push_back(static_cast<int64_t>(t.scalar_type()));
    layout.push_back(t.requires_grad() ? 1 : 0);
    layout.push_back(t.dim());
    for (const auto d : t.sizes()) {
      layout.push_back(d);
    }
  }
  return layout;
}

int64_t TensorSpec::bytes() const {
  int64_t n = 1;
  for (auto d : sizes) {
    n *= d;
  }
  return n * static_cast<int64_t>(c10::elementSize(dtype));
}

bool parse_layout(
    const std::vector<int64_t>& layout,
    bool& atomic,
    std::vector<TensorSpec>& specs) {
  size_t p = 0;
  auto next = [&](int64_t& v) {
    if (p >= layout.size()) {
      return false;
    }
    v = layout[p++];
    return true;
  };
  int64_t a = 0;
  int64_t count = 0;
  if (!next(a) || !next(count) || count < 0 || count > 4096) {
    return false;
  }
  atomic = a != 0;
  specs.assign(count, {});
  int64_t total = 0;
  for (auto& spec : specs) {
    int64_t defined = 0;
    if (!next(defined)) {
      return false;
    }
    spec.defined = defined != 0;
    if (!spec.defined) {
      continue;
    }
    int64_t dtype = 0;
    int64_t grad = 0;
    int64_t dim = 0;
    if (!next(dtype) || !next(grad) || !next(dim) || dtype < 0 ||
        dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) || dim < 0 ||
        dim > 64) {
      return false;
    }
    spec.dtype = static_cast<c10::ScalarType>(dtype);
    spec.requires_grad = grad != 0;
    spec.sizes.resize(dim);
    // The tensor's bytes must fit in 2^62 (so that no product of sizes
    // wraps around to a payload smaller than what would be read).
    const int64_t limit = int64_t{1} << 62;
    int64_t bytes = static_cast<int64_t>(c10::elementSize(spec.dtype));
    for (auto& d : spec.sizes) {
      if (!next(d) || d < 0 || (d > 0 && bytes > limit / d)) {
        return false;
      }
      bytes *= d;
    }
    total += bytes;
    if (total > limit) {
      return false;
    }
  }
  return p == layout.size();
}

int64_t payload_bytes(const std::vector<TensorSpec>& specs) {
  int64_t total = 0;
  for (const auto& spec : specs) {
    if (spec.defined) {
      total += padded(spec.bytes());
    }
  }
  return total;
}

void write_payload(const Message& message, torch::Tensor& out, int64_t offset) {
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  for (const auto& t : message.tensors) {
    if (!t.defined()) {
      continue;
    }
    // Gloo carries host memory: a CUDA tensor is copied here.
    auto c = t.detach().to(torch::kCPU).contiguous();
    const auto bytes = static_cast<int64_t>(c.nbytes());
    if (bytes > 0) {
      std::memcpy(base + offset, c.data_ptr(), bytes);
    }
    offset += padded(bytes);
  }
}

Message read_payload(
    const torch::Tensor& buffer,
    int64_t offset,
    bool atomic,
    const std::vector<TensorSpec>& specs) {
  Message message;
  message.atomic = atomic;
  auto holder = std::make_shared<torch::Tensor>(buffer);
  auto* base = static_cast<uint8_t*>(buffer.data_ptr());
  for (const auto& spec : specs) {
    if (!spec.defined) {
      message.tensors.emplace_back();
      continue;
    }
    auto t = torch::from_blob(
        base + offset,
        spec.sizes,
        [holder](void*) {},
        torch::TensorOptions().dtype(spec.dtype));
    if (spec.requires_grad) {
      t.requires_grad_(true);
    }
    message.tensors.push_back(std::move(t));
    offset += padded(spec.bytes());
  }
  return message;
}

torch::Tensor bytes(int64_t n) {
  return torch::empty({n}, torch::kByte);
}

int64_t* words(torch::Tensor& t) {
  return reinterpret_cast<int64_t*>(t.data_ptr());
}

namespace {

const char* kind_name(MessageKind kind) {
  switch (kind) {
    case MessageKind::Control:
      return "control";
    case MessageKind::Begin:
      return "begin";
    case MessageKind::Forward:
      return "activations";
    case MessageKind::Backward:
      return "gradients";
    case MessageKind::ForwardSkip:
      return "skip";
    case MessageKind::BackwardSkip:
      return "skip gradient";
    case MessageKind::Loss:
      return "loss";
    case MessageKind::Trace:
      return "trace";
  }
  return "unknown";
}

}  // namespace

std::string describe_pass(int64_t pass) {
  return "pass " + std::to_string(pass & ((int64_t{1} << kPassBits) - 1)) +
         " of stage " + std::to_string(pass >> kPassBits);
}

std::string to_string(MessageKind kind) {
  return kind_name(kind);
}

int MessageId::tag() const {
  TORCH_INTERNAL_ASSERT(micro_batch >= 0 && micro_batch <= kMaxMicroBatches);
  TORCH_INTERNAL_ASSERT(index >= 0 && index <= kMaxIndex);
  return static_cast<int>(
      (static_cast<int64_t>(kind) << 26) | (micro_batch << 12) | index);
}

std::string MessageId::describe() const {
  std::ostringstream out;
  out << kind_name(kind);
  switch (kind) {
    case MessageKind::Forward:
    case MessageKind::Backward:
      out << " of micro-batch " << micro_batch << " at boundary " << index;
      break;
    case MessageKind::ForwardSkip:
    case MessageKind::BackwardSkip:
      out << " " << index << " of micro-batch " << micro_batch;
      break;
    default:
      break;
  }
  return out.str();
}

}  // namespace gpipe::dist::detail
