#pragma once

// Automatic balancing: how many layers each partition should get, from a cost
// per layer measured by running the layers once or more.
//
// ```
// torch::nn::Sequential net(/* layers */);
// auto balance = gpipe::balance_by_time(
//     /*partitions=*/2, net, torch::rand({32, 3, 32, 32}), /*timeout=*/1.0);
// gpipe::GPipe model(net, gpipe::GPipeOptions(balance).chunks(8));
// ```
//
// The profilers run every layer in training mode on a copy of it (a layer
// that cannot be cloned runs itself, and its parameters, gradients, buffers
// and modes are put back afterwards), one layer after another, each layer's
// output feeding the next. Layers that stash and pop skip tensors work: the
// skips go through a table of the profiler's own, detached, so that each
// layer's backward stays inside that layer.

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe {

/// Splits `sequence` into `partitions` contiguous, non-empty blocks with the
/// algorithm of Bárány and Grinberg, "Block Partitions of Sequences" (as
/// torchgpipe's `blockpartition.solve`): the values are scaled to [0, 1],
/// the blocks start as an even split, and boundary elements move from larger
/// to smaller blocks until the largest block exceeds the smallest by at most
/// one (scaled) element. The result need not minimise the largest block sum;
/// `balance_cost` does. Unlike torchgpipe's code, the minimal block that
/// receives an element is the one closest to the maximal block, as the paper
/// says, so no block runs empty and the loop always ends (torchgpipe's takes
/// the leftmost and can loop forever).
///
/// Throws `c10::ValueError` when `partitions` is below 1, the sequence is
/// shorter than `partitions`, or a value is not finite.
std::vector<std::vector<double>> solve_block_partition(
    const std::vector<double>& sequence, int64_t partitions);

/// Layers per partition for the per-layer `costs`: the blocks of
/// `solve_block_partition`, unless a split with a smaller largest block sum
/// exists, in which case the split with the smallest largest block sum (ties
/// broken by the smallest sum of squared block sums). So the result always
/// minimises the cost of the most expensive partition, and equals
/// torchgpipe's whenever torchgpipe's does.
///
/// Throws `c10::ValueError` as `solve_block_partition`.
std::vector<int64_t> balance_cost(
    const std::vector<double>& costs, int64_t partitions);

/// Seconds per layer of `module` for one forward and backward of `sample`:
/// every layer in turn (the output of layer k is the input of layer k + 1,
/// detached), passes over the whole module repeated until `timeout` seconds
/// have gone, each pass restarting from `sample`, and the mean over the
/// passes returned (so the values do not grow with `timeout`). The first
/// pass warms up and is not counted when more passes follow. For a balance,
/// give a micro-batch's rows (batch / chunks): that is what each cell runs,
/// and layers do not all scale alike with rows. Backward runs from the layer's
/// outputs that require grad (and from the tensors it stashed), with the
/// outputs' values as gradient. `device` is where the layers (copied there) and
/// the sample run. Existing `.grad`s are allowed and left as they are.
std::vector<double> profile_times(
    torch::nn::Sequential module,
    torch::Tensor sample,
    double timeout = 1.0,
    torch::Device device = torch::kCPU);

/// `profile_times` for layers taking a tuple (`std::vector<torch::Tensor>`).
std::vector<double> profile_times(
    torch::nn::Sequential module,
    std::vector<torch::Tensor> sample,
    double timeout = 1.0,
    torch::Device device = torch::kCPU);

/// Bytes per layer of `module` when trained with mini-batches like `input`
/// cut into `chunks` micro-batches: the CPU memory that the layer's forward
/// allocates and keeps (its output and what it saves for backward), measured
/// on one micro-batch (the first ceil(batch / chunks) rows of `input`) and
/// scaled to batch / chunks rows, plus the bytes of its parameters times
/// `param_scale` (2 for plain SGD: the value and its gradient; see
/// torchgpipe's table: Adam 4-5, RMSprop 3-5, Adagrad 3).
///
/// Sizes are measured on CPU only, by wrapping LibTorch's CPU allocator while
/// profiling (allocations of the calling thread are counted; other threads
/// are not disturbed). Not reentrant: concurrent calls run one at a time.
std::vector<double> profile_sizes(
    torch::nn::Sequential module,
    torch::Tensor input,
    int64_t chunks = 1,
    double param_scale = 2.0,
    torch::Device device = torch::kCPU);

/// `profile_sizes` for layers taking a tuple (`std::vector<torch::Tensor>`).
std::vector<double> profile_sizes(
    torch::nn::Sequential module,
    std::vector<torch::Tensor> input,
    int64_t chunks = 1,
    double param_scale = 2.0,
    torch::Device device = torch::kCPU);

/// A balance (layers per partition) for `partitions` partitions of `module`,
/// from the time each layer takes (`profile_times` of `sample`: give it a
/// micro-batch, batch / chunks rows), split by `balance_cost`. Pass it to
/// `gpipe::GPipeOptions`.
///
/// Throws `c10::ValueError` when `partitions` is below 1 or above the
/// number of layers, `module` is empty, `sample` is undefined or empty, or
/// `timeout` is negative.
std::vector<int64_t> balance_by_time(
    int64_t partitions,
    torch::nn::Sequential module,
    torch::Tensor sample,
    double timeout = 1.0,
    torch::Device device = torch::kCPU);

/// `balance_by_time` for layers taking a tuple (`std::vector<torch::Tensor>`).
std::vector<int64_t> balance_by_time(
    int64_t partitions,
    torch::nn::Sequential module,
    std::vector<torch::Tensor> sample,
    double timeout = 1.0,
    torch::Device device = torch::kCPU);

/// A balance for `partitions` partitions of `module`, from the memory each
/// layer needs in training (`profile_sizes`: kept activations for a
/// mini-batch like `input` in `chunks` micro-batches, plus parameters times
/// `param_scale`), split by `balance_cost`. Sizes are profiled on CPU; any
/// other `device` is refused with `c10::ValueError`.
///
/// Throws `c10::ValueError` as `balance_by_time`, and when `chunks` is below
/// 1, `param_scale` is negative or `input` has no batch dimension.
std::vector<int64_t> balance_by_size(
    int64_t partitions,
    torch::nn::Sequential module,
    torch::Tensor input,
    int64_t chunks = 1,
    double param_scale = 2.0,
    torch::Device device = torch::kCPU);

/// `balance_by_size` for layers taking a tuple (`std::vector<torch::Tensor>`).
std::vector<int64_t> balance_by_size(
    int64_t partitions,
    torch::nn::Sequential module,
    std::vector<torch::Tensor> input,
    int64_t chunks = 1,
    double param_scale = 2.0,
    torch::Device device = torch::kCPU);

}  // namespace gpipe
