#pragma once

// Training checkpoints that move between layouts: a model's parameters and
// buffers, its optimizer's state and where the run stands, saved by a GPipe
// (or, with gpipe::dist::save_checkpoint, by the ranks of a PipelineStage)
// and loaded into any other layout: another balance, another number of
// stages or processes, another data-parallel size, or the plain Sequential
// (gpipe::load_into_sequential reads a checkpoint directory too).
//
// ```
// gpipe::TrainingState state;
// state.step = step;
// gpipe::save_checkpoint("ckpt", model, optimizer, state);
// ...
// auto resumed = gpipe::load_checkpoint("ckpt", model, optimizer);
// ```
//
// `dir` holds checkpoints, one directory each (`dir/step-<step>`, the step
// in at least 8 digits: `dir/step-00000003`): a manifest (`manifest.json`:
// the layers, the layout that wrote it, the training state, a checksum per
// file) and files of tensors keyed by global
// layer index and name (`layers.<i>.<name>`, the optimizer's
// `optimizer.layers.<i>.<name>.<field>`). A checkpoint is written into a
// temporary directory, every file flushed to disk, the manifest last, and
// then renamed into place: a crash at any moment leaves the previous
// checkpoint whole. Of the earlier checkpoints the newest is kept; later
// ones (of a run given up, this one having resumed from before them) go.
// Loading takes the newest (or
// `dir` itself when it holds a manifest), checks every file it reads
// against its checksum, and checks the model and optimizer against the
// manifest before anything changes (layer count, names and shapes, the
// optimizer's kind and the state it needs): a mismatch is a c10::ValueError
// naming the first difference. Values of another dtype are converted, as
// LibTorch's copy_ and PyTorch's load_state_dict do (a float64 checkpoint
// loads into a float32 model, rounded).
//
// The optimizer's state of SGD, Adam, AdamW, RMSprop and Adagrad is saved
// per parameter; its options (learning rate and so on) are the program's
// own, as when it was built (keep a scheduled rate in `TrainingState::user`).

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace gpipe {

class GPipe;

/// Where a training run stands, saved with its checkpoint.
struct TrainingState {
  /// Optimizer steps done.
  int64_t step = 0;
  /// Epochs done (0 or more).
  int64_t epoch = 0;
  /// Position in the data within the epoch (say, batches read; 0 or
  /// more), so that a resumed run reads the same next batch.
  int64_t position = 0;
  /// The default CPU generator's state (`torch::make_generator`-compatible
  /// byte tensor). save_checkpoint takes the generator's state now when
  /// this is undefined; load_checkpoint gives the saved one back and puts it
  /// into the generator.
  torch::Tensor cpu_generator;
  /// The program's own entries (a learning rate schedule's position, the
  /// data's shuffle seed, ...).
  std::map<std::string, std::string> user;
};

/// Saves `model`'s parameters and buffers, `optimizer`'s state (its
/// parameters must be the model's) and `state` as a new checkpoint in
/// `dir` (made when missing), named by `state.step` (0 to
/// 999999999999999999). A c10::Error says why it could not (a
/// c10::ValueError when `dir` is a checkpoint itself, `state.user` holds
/// text that is not UTF-8, or `state.epoch` or `state.position` is
/// negative); the previous checkpoints stay as they
/// were. Checkpoints of later steps go (a run resumed from an earlier one
/// gave them up): one that cannot go is an error naming it, after this
/// checkpoint was written; so do `step-<n>` directories without a
/// manifest. Of the earlier ones the newest whole one stays. One writer
/// per directory at a time; readers (load_checkpoint, read_training_state
/// in other threads or processes) may read beside it: they see each
/// checkpoint whole or not at all.
void save_checkpoint(
    const std::string& dir,
    const GPipe& model,
    const torch::optim::Optimizer& optimizer,
    const TrainingState& state);

/// Loads the newest checkpoint in `dir` (or `dir` itself, when it holds a
/// manifest) into `model` and `optimizer`, whatever layout wrote it, puts
/// the saved CPU generator state into the default generator, and returns
/// the saved TrainingState. Nothing changes when it throws.
TrainingState load_checkpoint(
    const std::string& dir, GPipe& model, torch::optim::Optimizer& optimizer);

/// The TrainingState of the checkpoint load_checkpoint would read in `dir`
/// (its generator state included), loading nothing: to check a run's
/// settings (kept in `user`) before loading. A c10::ValueError when there
/// is none or it is damaged.
TrainingState read_training_state(const std::string& dir);

/// The checkpoint directory load_checkpoint would read in `dir` (itself
/// when it holds a manifest, else its newest whole checkpoint), or an empty
/// string when there is none. A c10::ValueError when its newest
/// `step-<n>` is not whole (no manifest: damaged after it was written).
std::string latest_checkpoint(const std::string& dir);

}  // namespace gpipe
