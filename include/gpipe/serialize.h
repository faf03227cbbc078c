#pragma once

// Moving weights between a GPipe and the plain Sequential it was built from,
// through files.
//
// `torch::save(model, path)` of a GPipe names each tensor
// `partitions.<j>.<layer>.<tensor>`, and of the plain Sequential
// `<layer>.<tensor>`, so neither archive loads into the other with
// `torch::load` ("No such serialized submodule"). The functions below read
// either kind of archive into either kind of model, by layer name, whatever
// the balance: a model trained through a pipeline of 4 partitions can be
// evaluated as a plain Sequential, fine-tuned through 2, or served by a
// program that does not link gpipe (`save_as_sequential`).
//
// ```
// torch::save(model, "gpipe.pt");             // a GPipe's archive
// torch::nn::Sequential net = make_net();     // the same layers
// gpipe::load_into_sequential(net, "gpipe.pt");
// ```
//
// Tensors are copied into the model's own parameters and buffers, which
// keep their devices, dtypes and `requires_grad`; parameters and buffers
// (BatchNorm's running statistics) alike. Note that a GPipe uses the user's
// layers in place: training the GPipe changes the Sequential it was built
// from, so within one program no copying is needed at all.

#include <torch/nn/modules/container/sequential.h>

#include <string>

namespace gpipe {

class GPipe;

/// Loads the archive at `path` into `net`: an archive of a GPipe (written
/// by `torch::save(model, path)`, any balance), of a plain Sequential, or a
/// training checkpoint's directory (gpipe/checkpoint_io.h: its newest
/// checkpoint's parameters and buffers, whatever layout wrote it).
/// Every parameter and buffer of `net` must be in the archive with its
/// shape; otherwise `c10::ValueError` names the first one that is not (and
/// `net` is left unchanged). Tensors in the archive that `net` lacks are an
/// error as well. Throws `c10::Error` when the file cannot be read.
void load_into_sequential(torch::nn::Sequential& net, const std::string& path);

/// The same for a GPipe: loads an archive of a plain Sequential or of a
/// GPipe with any balance into `model`'s partitions, each tensor copied to
/// its partition's device.
void load_into_gpipe(GPipe& model, const std::string& path);

/// Writes `model` as `torch::save` writes the plain Sequential of its
/// layers (`<layer>.<tensor>`), so that `torch::load(net, path)` reads it
/// into a plain Sequential without gpipe.
void save_as_sequential(const GPipe& model, const std::string& path);

}  // namespace gpipe
