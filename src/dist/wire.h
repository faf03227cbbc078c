#pragma once

// The wire format of gpipe's messages between ranks: what a message is
// (kind, micro-batch, index: its c10d tag), its header, and the layout of
// its tensors. See Note [Messages between ranks] in dist/connection.h for
// how they travel.

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe::dist::detail {

/// What a message carries; part of its tag and header.
enum class MessageKind : int64_t {
  Control = 0,   // (none now: failures travel through the store)
  Begin = 1,     // rank 0 starts a pass: its kind, seed and micro-batches
  Forward = 2,   // activations at a boundary
  Backward = 3,  // gradients at a boundary
  ForwardSkip = 4,
  BackwardSkip = 5,
  Loss = 6,   // the last rank's loss, to every rank
  Trace = 7,  // a rank's trace events, to rank 0
};

std::string to_string(MessageKind kind);

/// Which message: tag and header fields.
struct MessageId {
  MessageKind kind = MessageKind::Control;
  int64_t micro_batch = 0;
  int64_t index = 0;  // boundary, skip number, or 0

  /// Fits 4 bits of kind, 14 of micro-batch, 12 of index.
  int tag() const;
  std::string describe() const;
};

/// A pass number carries its stage's number above kPassBits, so that
/// passes of two PipelineStages on one World are told apart.
constexpr int64_t kPassBits = 40;
/// "pass 3 of stage 0".
std::string describe_pass(int64_t pass);

constexpr int64_t kMaxMicroBatches = (int64_t{1} << 14) - 1;
constexpr int64_t kMaxIndex = (int64_t{1} << 12) - 1;

/// A message's tensors (undefined ones travel as such) and whether they came
/// as one tensor.
struct Message {
  std::vector<torch::Tensor> tensors;
  bool atomic = true;
};

// "gpipe" and a wire version, so that another program's bytes are told
// apart from ours.
constexpr int64_t kMagic = 0x6770697065000001;
constexpr int64_t kHeaderWords = 8;
constexpr int64_t kHeaderBytes = kHeaderWords * 8;

enum Mode : int64_t {
  kHeaderOnly = 0,  // layout and payload follow in a second message
  kCombined = 1,    // payload follows the header, in the agreed layout
  kRelayout = 2,    // agreed size, to be ignored; as kHeaderOnly then
};

/// Header words.
enum Word {
  kMagicWord = 0,
  kPassWord,
  kKindWord,
  kMicroWord,
  kIndexWord,
  kLayoutWord,   // layout length, in words
  kPayloadWord,  // payload size, in bytes
  kModeWord,
};

/// One tensor of a layout.
struct TensorSpec {
  bool defined = false;
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool requires_grad = false;
  std::vector<int64_t> sizes;
  int64_t bytes() const;
};

/// [atomic, count, per tensor: defined, dtype, requires_grad, dim, sizes...]
std::vector<int64_t> layout_of(const Message& message);
/// Parses a layout; false if it is malformed.
bool parse_layout(
    const std::vector<int64_t>& layout,
    bool& atomic,
    std::vector<TensorSpec>& specs);
/// Bytes of the payload of `specs` (each tensor padded to 8 bytes).
int64_t payload_bytes(const std::vector<TensorSpec>& specs);
/// Copies the defined tensors' bytes (through host memory) into `out` from
/// byte `offset` on.
void write_payload(const Message& message, torch::Tensor& out, int64_t offset);
/// Tensors over the bytes of `buffer` from `offset` on (no copy: each keeps
/// the buffer alive).
Message read_payload(
    const torch::Tensor& buffer,
    int64_t offset,
    bool atomic,
    const std::vector<TensorSpec>& specs);
/// An uninitialised byte buffer of `n` bytes, and its words.
torch::Tensor bytes(int64_t n);
int64_t* words(torch::Tensor& t);

}  // namespace gpipe::dist::detail
