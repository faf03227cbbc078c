#pragma once

// gpipe-train's command line: its flags, their checks (a bad flag is one
// line on stderr and exit status 2), and the models it can train.

#include <c10/util/StringUtil.h>
#include <gpipe/plan.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist.h"

namespace gpipe {
class GPipe;
class Trace;
struct TrainingState;
}  // namespace gpipe

namespace gpipe::dist {
class World;
class PipelineStage;
}  // namespace gpipe::dist

namespace gpipe_train {

namespace fs = std::filesystem;

// A bad command line: printed on one line, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws a UsageError made of `args` unless `condition` holds. Every message
// starts with the flag it is about.
template <typename... Args>
void usage_check(bool condition, const Args&... args) {
  if (!condition) {
    throw UsageError(c10::str(args...));
  }
}

/// "1 lane", "3 lanes": `n` and the noun that agrees with it.
inline std::string count_of(int64_t n, const char* one, const char* many) {
  return c10::str(n, ' ', n == 1 ? one : many);
}

// The exit status of a bad command line, as for most Unix tools.
constexpr int kUsageExit = 2;

// Intra-op threads are per lane, so the total is this times the partitions;
// beyond the cores it only oversubscribes, and far beyond them OpenMP runs
// out of memory creating the team (--threads-per-lane 99999999999 did).
// 1024 keeps room for large machines while refusing typos.
constexpr int64_t kMaxThreadsPerLane = 1024;

// The gzipped IDX files that --data-dir must hold.
using gpipe_data::kFashionMnistFiles;

// One entry per --model. The layer counts are known here so that
// --partitions and --balance are checked before anything is built
// (make_model asserts them).
struct ModelSpec {
  std::string name;
  int64_t layers = 0;
  // The balance for 2 partitions: it puts skips across the boundary. Empty:
  // the even split.
  std::vector<int64_t> two_way_balance;
};

struct Args {
  std::string model = "cnn";
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int64_t partitions = 2;
  std::string balance_text;
  int64_t chunks = 4;
  std::string checkpoint = "except_last";
  int64_t epochs = 1;
  int64_t batch_size = 64;
  double lr = 0.05;
  // --lr-schedule: constant, cosine (to 0 over the run) or step (x0.1 at
  // half and at three quarters of the steps).
  std::string lr_schedule = "constant";
  bool deferred_batch_norm = false;
  int64_t threads_per_lane = 0;
  // --threads-per-lane as given, before --autotune chose (-1: not yet).
  int64_t threads_per_lane_asked = -1;
  int64_t limit = 0;
  // --test-limit: evaluate on the first N test images only (0: all).
  int64_t test_limit = 0;
  int64_t log_every = 100;
  uint64_t seed = 0;
  bool json = false;
  std::string schedule = "autograd";
  // Partitions per lane (stage j on lane j % lanes): --stages-per-lane, or
  // for --schedule interleaved 2 when the partitions allow it.
  int64_t stages_per_lane = 1;
  // --plan: a CSV plan run as written instead of a schedule, read and
  // checked by verify_args.
  std::string plan_path;
  gpipe::Plan plan;
  // --chunks was left out and taken from --plan's micro-batches.
  bool chunks_from_plan = false;
  std::string trace_path;
  std::string timeline_path;
  int64_t trace_steps = 3;
  // Layers per partition: --balance, or chosen by verify_args.
  std::vector<int64_t> balance;
  // Ranks of the job when started by gpipe-run or torchrun (WORLD_SIZE),
  // else 1. With more than one, rank r runs partitions r, r + ranks, ...
  // (stages_per_lane of them).
  int64_t world_size = 1;
  // --pipeline-size: ranks per pipeline under a launcher (0: all of them);
  // the world_size / pipeline_size replicas each train on their own shard
  // of every batch. Set to the pipeline's ranks by verify_args.
  int64_t pipeline_size = 0;
  // --balance was given; else train() replaces `balance` (the even split)
  // by choose_balance's.
  bool balance_given = false;
  // --devices as given, and the device of each lane (given or default).
  std::string devices_text;
  std::vector<torch::Device> devices;
  // --save: the checkpoints' directory; --load: weights read before
  // training.
  std::string save_path;
  std::string load_path;
  // --save-every-steps: a checkpoint every this many steps too (0: none).
  int64_t save_every_steps = 0;
  // --resume: go on from the newest checkpoint in --save.
  bool resume = false;
  // --autotune, and --memory-limit as given and in bytes (0: none).
  bool autotune = false;
  std::string memory_limit_text;
  int64_t memory_limit = 0;
};

/// Where the run's text goes: standard output, or with --json standard
/// error, so that standard output holds only the JSON lines.
inline std::FILE* text_out(const Args& args) {
  return args.json ? stderr : stdout;
}

/// The run of a checked command line (tools/train.cpp): joins the job
/// under a launcher, trains, and returns the exit status.
int train(const Args& args);

/// Prints the run's error `error` on one line and returns its exit status
/// (a UsageError: 2, else 1).
int report_error(std::exception_ptr error);

/// WORLD_SIZE from the environment (1 when unset); a malformed value, or a
/// RANK other than 0 beside a WORLD_SIZE of 1, is a UsageError.
int64_t world_size_from_env();

/// Writes `summary` as one line to standard output; a line that cannot be
/// written (a full disk, a closed pipe) is an error (exit 1), not a run
/// that looks done.
void write_json_line(const nlohmann::json& summary);

/// The flags of `args`, with their defaults, on `app`.
void add_options(CLI::App& app, Args& args);
/// Checks every flag (throws UsageError) and fills `args.balance`.
void verify_args(const CLI::App& app, Args& args);
/// --plan (train_plan.cpp): reads the file, checks it against
/// args.partitions, args.stages_per_lane and --chunks (which, left out,
/// becomes the plan's micro-batches) (throws UsageError), and sets args.plan
/// and args.schedule "plan". Nothing without --plan.
void read_plan(const CLI::App& app, Args& args);
/// The names --schedule takes: "autograd", then every train_step schedule
/// gpipe has (gpipe::schedules(), train_plan.cpp).
std::vector<std::string> schedule_names();
/// "fill_drain, 1f1b, ... or looped_bfs": the train_step schedules.
std::string train_step_schedules();
/// How many partitions the named train_step schedule runs on each lane when
/// --stages-per-lane is left out (2 for interleaved, looped_bfs and
/// zero_bubble_v); 1 for "autograd" and "plan".
int64_t own_stages_per_lane(const std::string& schedule);

/// The layout flags (--pipeline-size, --partitions, --balance,
/// --stages-per-lane, `per_lane`: given) against the launcher's ranks and
/// the model; fills in args.partitions and args.balance. Throws UsageError.
void verify_layout(const CLI::App& app, Args& args, bool per_lane);
/// "" when `rows` cut into `chunks` micro-batches as GPipe cuts them
/// (Tensor::chunk: pieces of ceil(rows / chunks) rows, the last shorter,
/// so 9 rows asked for 4 give 3); else what they cut into, and the nearest
/// counts that they do cut into, as "cut into ..." (train_layout.cpp).
std::string uneven_cut(int64_t rows, int64_t chunks);
/// "the 8 rows of a batch", or of each replica's shard, for messages.
std::string rows_of_a_batch(const Args& args, int64_t replicas);
/// Whether the named schedule runs its partitions in a V (zero_bubble_v).
bool runs_in_a_v(const std::string& schedule);
/// --devices (train_devices.cpp): the flag, and its check, which fills
/// args.devices (throws UsageError); after verify_args.
void add_devices_option(CLI::App& app, Args& args);
void verify_devices_option(const CLI::App& app, Args& args);
/// --save, --save-every-steps, --load and --resume (train_save.cpp): their
/// flags, and their checks (throws UsageError): a --save directory that is
/// one or can be made, an existing --load.
void add_save_options(CLI::App& app, Args& args);
void verify_save_options(const CLI::App& app, const Args& args);
/// --resume's checks that need the model (after verify_save_options):
/// the newest checkpoint in --save was written with this run's settings,
/// is whole and fits `net` (throws UsageError); nothing is loaded.
void verify_resume(const Args& args, const torch::nn::Sequential& net);
/// Writes a checkpoint of `state` (its step, epochs done, batches done in
/// the epoch) into args.save_path: of `stage` on every rank when it is not
/// null, else of `model`. The run's settings go with it.
void save_training(
    const Args& args,
    const gpipe::GPipe& model,
    const gpipe::dist::PipelineStage& stage,
    const torch::optim::Optimizer& optimizer,
    gpipe::TrainingState state);
/// --resume: loads the newest checkpoint in args.save_path (of any layout)
/// into `stage` (when not null, on every rank) or `model`, with the
/// optimizer and random state, and returns where the run stood; a
/// default TrainingState when nothing was saved yet. Throws c10::Error
/// when it was written by a run with other settings (naming the flag).
/// `lead`: this process says when there is nothing to resume.
gpipe::TrainingState resume_training(
    const Args& args,
    gpipe::GPipe& model,
    gpipe::dist::PipelineStage& stage,
    torch::optim::Optimizer& optimizer,
    bool lead);
/// The learning rate of step `step` (from 0) of `steps`, by
/// args.lr_schedule.
double lr_at(const Args& args, int64_t step, int64_t steps);
/// --balance's entries (train_balance.cpp); throws UsageError naming the
/// first bad entry.
std::vector<int64_t> parse_balance(const std::string& text);
/// `layers` split into `partitions` as evenly as can be, the larger
/// partitions last.
std::vector<int64_t> even_balance(int64_t layers, int64_t partitions);
/// The balance of `net` without --balance (train_balance.cpp):
/// balance_by_time on one micro-batch of `images`, chosen on rank 0 and
/// broadcast over `world` (null: one process); printed with the per-layer
/// times on rank 0.
std::vector<int64_t> choose_balance(
    const Args& args,
    const torch::nn::Sequential& net,
    const torch::Tensor& images,
    const gpipe::dist::World* world);
/// Which lane (under a launcher, pipeline rank) runs each partition
/// (train_plan.cpp): --plan's own placement, or the schedule's
/// (gpipe::placement_for).
gpipe::Placement pipeline_placement(const Args& args);
/// --trace-steps against the run (train_save.cpp): throws UsageError
/// when --epochs of `n` images in --batch-size batches make too few steps
/// (the first one is not recorded).
void verify_trace_steps(const Args& args, int64_t n);
/// Writes `trace`, of steps `first` to `last`, to --trace and --timeline
/// and says so on `out` (train_save.cpp); `epoch_ended`: the epoch's end
/// ended the recording before --trace-steps steps.
void write_trace(
    const Args& args,
    const gpipe::Trace& trace,
    int64_t first,
    int64_t last,
    bool epoch_ended,
    std::FILE* out);
/// --resume (train_save.cpp), before the data is read and the balance
/// measured: true when the newest checkpoint in --save has done --epochs
/// already, which the lead rank says on `out` (and as JSON with --json,
/// with the balance and results the run ended with). Rank 0's reading
/// decides for every rank of `world` (null: one process).
bool resume_is_finished(
    const Args& args,
    const gpipe::dist::World* world,
    bool lead,
    std::FILE* out);
/// --resume (train_save.cpp), once loaded: throws UsageError when the
/// resumed run leaves too few steps for --trace-steps; the lead rank says
/// where it resumed from.
void verify_resumed_steps(
    const Args& args,
    const gpipe::TrainingState& resumed,
    int64_t steps_per_epoch,
    bool lead,
    std::FILE* out);
/// --autotune and --memory-limit (train_autotune.cpp): their flags and
/// checks (throws UsageError: --autotune with a flag it chooses, a
/// malformed size, a limit without --autotune).
void add_autotune_options(CLI::App& app, Args& args);
void verify_autotune_options(const CLI::App& app, Args& args);
/// --autotune's choice as saved in a checkpoint ("chunks=8 schedule=1f1b
/// checkpoint=except_last threads=1 balance=4,9"), and into `user` (a
/// checkpoint's user settings) when args.autotune: a resumed --autotune
/// run takes it instead of tuning again.
std::string autotune_choice_text(const Args& args);
void save_autotune_choice(
    const Args& args, std::map<std::string, std::string>& user);
/// --autotune: gpipe::autotune on the first batch of `images` and
/// `labels` on rank 0 (or in the one process), its choice printed on
/// `out` and broadcast over `world` (null: one process); sets
/// args.balance, chunks, schedule, checkpoint, partitions and
/// stages_per_lane.
void autotune_args(
    Args& args,
    const torch::nn::Sequential& net,
    const torch::Tensor& images,
    const torch::Tensor& labels,
    const gpipe::dist::World* world,
    std::FILE* out);

/// Throws UsageError unless `path` names a file that can be written
/// (`flag` starts the message).
void verify_output_path(const std::string& flag, const std::string& path);
/// TrainingState::user's keys of a run's results so far: the last step's
/// loss and the last epoch's test accuracy, as exact_text writes them.
inline constexpr const char* kFinalLossKey = "final_loss";
inline constexpr const char* kTestAccuracyKey = "test_accuracy";
// The balance the run trained with, as "6,7".
inline constexpr const char* kBalanceKey = "balance";
/// `value` as text that reads back (std::strtod) as the same double.
std::string exact_text(double value);
/// A CLI11 check that takes plain decimal integers that fit in int64_t
/// only (CLI11 itself reads "0x10" as 16 and "" as 0).
CLI::Validator decimal_int64();
/// Refuses a switch (a flag without a value) given more than once, as a
/// flag with a value is refused.
void refuse_repeated_switches(const CLI::App& app);
/// Every --model entry.
const std::vector<ModelSpec>& model_specs();
/// The --model entry called `name` (verify_args checked it exists).
const ModelSpec& model_spec(const std::string& name);
/// A new model for `spec`.
torch::nn::Sequential make_model(const ModelSpec& spec);
/// `text` on one line (c10::Error messages may span several).
std::string one_line(const std::string& text);

}  // namespace gpipe_train
