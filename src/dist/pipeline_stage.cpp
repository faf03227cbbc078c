// PipelineStage: one rank's partition of a pipeline whose stages live in
// several processes. The passes run the single-process engine's plans, of
// which each rank runs its own lane; rank 0 starts each pass with a message
// that carries what every rank must agree on (the pass's kind, schedule,
// micro-batch sizes and step seed).

#include <c10/util/irange.h>
#include <gpipe/batchnorm.h>
#include <gpipe/dist.h>
#include <gpipe/microbatch.h>
#include <gpipe/module.h>
#include <gpipe/plan.h>
#include <gpipe/skip.h>
#include <gpipe/trace.h>
#include <gpipe/verify.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstring>
#include <functional>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "device.h"
#include "dist/c10d_transport.h"
#include "dist/connection.h"
#include "engine/autograd_node.h"
#include "engine/pipeline.h"
#include "random.h"

namespace gpipe::dist {

using detail::C10dTransport;
using detail::Message;
using detail::MessageId;
using detail::MessageKind;

namespace {

enum class PassKind : int64_t { Forward = 0, Train = 1 };

// What rank 0 tells the others when it starts a pass.
struct Begin {
  PassKind kind = PassKind::Forward;
  int64_t schedule = 0;
  int64_t checkpoint_stop = 0;
  bool training = false;
  uint64_t seed = 0;
  std::vector<int64_t> sizes;  // rows of each micro-batch

  torch::Tensor encode() const {
    std::vector<int64_t> words{
        static_cast<int64_t>(kind),
        schedule,
        checkpoint_stop,
        training ? 1 : 0,
        0};
    std::memcpy(&words[4], &seed, sizeof(seed));
    words.insert(words.end(), sizes.begin(), sizes.end());
    return torch::tensor(words, torch::kLong);
  }
  static Begin decode(const torch::Tensor& t) {
    TORCH_CHECK(
        t.defined() && t.scalar_type() == torch::kLong && t.dim() == 1 &&
            t.numel() >= 6,
        "gpipe::dist: a malformed begin message came from rank 0");
    auto w = t.contiguous();
    const auto* p = w.data_ptr<int64_t>();
    Begin b;
    b.kind = static_cast<PassKind>(p[0]);
    b.schedule = p[1];
    b.checkpoint_stop = p[2];
    b.training = p[3] != 0;
    std::memcpy(&b.seed, &p[4], sizeof(b.seed));
    b.sizes.assign(p + 5, p + w.numel());
    return b;
  }
};

const char* kind_name(PassKind kind) {
  return kind == PassKind::Train ? "train_step" : "forward";
}

std::string schedule_name(int64_t s) {
  return s == static_cast<int64_t>(Schedule::OneFOneB) ? "OneFOneB"
                                                       : "FillDrain";
}

int64_t checkpoint_stop(const GPipeOptions& options, bool training) {
  if (!training) {
    return 0;
  }
  switch (options.checkpoint()) {
    case Checkpoint::Always:
      return options.chunks();
    case Checkpoint::ExceptLast:
      return options.chunks() - 1;
    case Checkpoint::Never:
      return 0;
  }
  return 0;
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

// What every rank must agree on at construction, field by field.
std::vector<std::pair<std::string, std::string>> fingerprint(
    const torch::nn::Sequential& module,
    const GPipeOptions& options,
    int64_t world_size) {
  std::vector<std::pair<std::string, std::string>> fields;
  auto str = [](const auto& v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  fields.emplace_back("world size", str(world_size));
  fields.emplace_back("balance", str(c10::IntArrayRef(options.balance())));
  fields.emplace_back("chunks", str(options.chunks()));
  fields.emplace_back("checkpoint", to_string(options.checkpoint()));
  fields.emplace_back(
      "deferred_batch_norm", options.deferred_batch_norm() ? "true" : "false");
  std::ostringstream layers;
  std::ostringstream tensors;
  for (const auto& named : module->named_children()) {
    layers << named.key() << ":" << named.value()->name() << ";";
  }
  for (const auto& p : module->named_parameters()) {
    tensors << p.key() << p.value().sizes() << p.value().scalar_type() << ";";
  }
  for (const auto& b : module->named_buffers()) {
    tensors << b.key() << b.value().sizes() << b.value().scalar_type() << ";";
  }
  fields.emplace_back(
      "layers",
      str(module->size()) + " layers, names and types hashed to " +
          str(std::hash<std::string>{}(layers.str())));
  fields.emplace_back(
      "parameters and buffers",
      "hashed to " + str(std::hash<std::string>{}(tensors.str())));
  return fields;
}

std::string join_fields(
    const std::vector<std::pair<std::string, std::string>>& fields) {
  std::string out;
  for (const auto& f : fields) {
    out += f.first + "=" + f.second + "\n";
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> split_fields(
    const std::string& text) {
  std::vector<std::pair<std::string, std::string>> fields;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) {
      fields.emplace_back(line.substr(0, eq), line.substr(eq + 1));
    }
  }
  return fields;
}

}  // namespace

struct PipelineStageImpl::Engine {
  std::shared_ptr<detail::Connection> connection;
  std::shared_ptr<gpipe::detail::Pipeline> pipeline;
  detail::Placement placement;
  int64_t stage_id = 0;
  int64_t passes = 0;   // passes started, the same count on every rank
  int64_t current = 0;  // the pass whose transport is being made
  mutable std::mutex trace_mutex;
  std::shared_ptr<Trace> trace;  // guarded by trace_mutex

  // A pass number that also names the stage (see describe_pass).
  int64_t next_pass() {
    return (stage_id << detail::kPassBits) | ++passes;
  }

  std::shared_ptr<Trace> current_trace() const {
    std::lock_guard<std::mutex> lock(trace_mutex);
    return trace;
  }
};

PipelineStageImpl::PipelineStageImpl(
    torch::nn::Sequential module, GPipeOptions options_, World world)
    : options(std::move(options_)), world_(std::move(world)) {
  const auto rank = world_.rank();
  const auto size = world_.size();
  auto& connection = world_.connection();
  // Each rank publishes what it built (or why it could not) under this
  // prefix, and reads the others'.
  const auto stage_id = connection->next_stage_id();
  const auto prefix = "stage" + std::to_string(stage_id) + "/";
  auto& store = connection->store;
  const auto n = static_cast<int64_t>(options.balance().size());
  try {
    verify_module(module);
    for (const auto& named :
         module->named_modules("", /*include_self=*/false)) {
      TORCH_CHECK_VALUE(
          named.value()->as<gpipe::GPipeImpl>() == nullptr,
          "gpipe::dist::PipelineStage cannot hold a gpipe::GPipe (layer '",
          named.key(),
          "' is one): pass the inner model's Sequential instead");
    }
    verify_skippables(module);
    verify_chunks(options.chunks());
    verify_balance(options.balance(), static_cast<int64_t>(module->size()));
    TORCH_CHECK_VALUE(
        n == size,
        "gpipe::dist::PipelineStage expects one partition per rank: balance "
        "has ",
        n,
        " partitions but the world has ",
        size,
        " ranks");
    TORCH_CHECK_VALUE(
        options.chunks() <= detail::kMaxMicroBatches,
        "gpipe::dist::PipelineStage supports at most ",
        detail::kMaxMicroBatches,
        " chunks, but got ",
        options.chunks());
    TORCH_CHECK_VALUE(
        n <= detail::kMaxIndex,
        "gpipe::dist::PipelineStage supports at most ",
        detail::kMaxIndex,
        " ranks, but got ",
        n);
    TORCH_CHECK_VALUE(
        options.threads_per_lane() >= 0,
        "threads_per_lane must be 0 (automatic) or positive, but got ",
        options.threads_per_lane());
    if (!options.devices().empty()) {
      verify_devices(options.devices(), n);
      device_ = gpipe::detail::normalize_device(options.devices()[rank]);
    } else if (torch::cuda::is_available()) {
      device_ = torch::Device(torch::kCUDA, world_.local_rank());
    }
    if (options.deferred_batch_norm()) {
      module = convert_deferred_batch_norm(module, options.chunks());
    }
  } catch (...) {
    // Tell the others at once, rather than leaving them waiting.
    const auto text = "error=" + message_of(std::current_exception());
    store->set(
        prefix + std::to_string(rank),
        std::vector<uint8_t>(text.begin(), text.end()));
    throw;
  }

  // Every rank must have built the same thing: compare before any pass.
  const auto mine = fingerprint(module, options, size);
  engine_ = std::make_shared<Engine>();
  engine_->connection = connection;
  engine_->stage_id = stage_id;
  {
    const auto text = join_fields(mine);
    store->set(
        prefix + std::to_string(rank),
        std::vector<uint8_t>(text.begin(), text.end()));
    for (const auto r : c10::irange(size)) {
      if (r == rank) {
        continue;
      }
      std::vector<uint8_t> value;
      try {
        value = store->get(prefix + std::to_string(r));
      } catch (const std::exception& e) {
        TORCH_CHECK(
            false,
            "gpipe::dist::PipelineStage: rank ",
            rank,
            " waited ",
            world_.timeout().count() / 1000.0,
            " s for rank ",
            r,
            " to build its stage [c10d: ",
            std::string(e.what()).substr(0, 300),
            "]");
      }
      const std::string published(value.begin(), value.end());
      TORCH_CHECK_VALUE(
          published.rfind("error=", 0) != 0,
          "gpipe::dist::PipelineStage: rank ",
          r,
          " could not build its stage: ",
          published.substr(6));
      const auto theirs = split_fields(published);
      for (const auto k : c10::irange(mine.size())) {
        const std::string other =
            k < theirs.size() ? theirs[k].second : std::string("(missing)");
        TORCH_CHECK_VALUE(
            mine[k].second == other,
            "gpipe::dist::PipelineStage: rank ",
            rank,
            " has ",
            mine[k].first,
            " ",
            mine[k].second,
            " but rank ",
            r,
            " has ",
            other,
            ": every rank must build the same Sequential with the same "
            "GPipeOptions");
      }
    }
  }

  // Split the layers; each keeps its name. Only this rank's partition moves
  // to its device and becomes this module's.
  std::vector<torch::nn::Sequential> parts;
  const auto named = module->named_children();
  int64_t layer = 0;
  for (const auto j : c10::irange(n)) {
    torch::nn::Sequential part;
    for (const auto k : c10::irange(options.balance()[j])) {
      (void)k;
      part->push_back(named[layer].key(), *(module->begin() + layer));
      ++layer;
    }
    parts.push_back(part);
  }
  partition_ = parts[rank];
  partition_->to(device_);
  auto holder =
      register_module("partitions", std::make_shared<torch::nn::Module>());
  holder->register_module(std::to_string(rank), partition_);

  std::vector<torch::Device> devices(n, torch::kCPU);
  devices[rank] = device_;
  std::vector<bool> local(n, false);
  local[rank] = true;
  const auto threads =
      options.threads_per_lane() > 0
          ? options.threads_per_lane()
          : std::max<int64_t>(
                1,
                static_cast<int64_t>(std::thread::hardware_concurrency()) /
                    std::max<int64_t>(1, world_.local_size()));
  engine_->pipeline =
      std::make_shared<gpipe::detail::Pipeline>(parts, devices, threads, local);

  auto& placement = engine_->placement;
  for (const auto j : c10::irange(n)) {
    placement.rank_of_stage.push_back(j);  // one stage per rank
  }
  const auto& skips = engine_->pipeline->skip_layout();
  int64_t index = 0;
  for (const auto j : c10::irange(n)) {
    for (const auto& entry : skips.copy_policy(j)) {
      placement.skip_index[entry.second] = index++;
      placement.skip_route[entry.second] = skips.route(entry.second);
    }
  }
  TORCH_CHECK_VALUE(
      index <= detail::kMaxIndex,
      "gpipe::dist::PipelineStage supports at most ",
      detail::kMaxIndex,
      " skips between partitions, but got ",
      index);
  Engine* engine = engine_.get();
  engine_->pipeline->set_transport_factory([engine](int64_t m, int64_t stages) {
    return std::make_unique<C10dTransport>(
        engine->connection,
        engine->current,
        m,
        stages,
        engine->placement,
        engine->current_trace());
  });
}

PipelineStageImpl::~PipelineStageImpl() = default;

namespace {

// Rank 0 starts a pass; the others learn what it is and check it against
// what they were asked to run.
// Rank 0's sends go into `sends`, to be waited for at the end of the pass
// (a send completes only when its receiver takes it).
Begin begin_pass(
    detail::Connection& connection,
    int64_t pass,
    Begin local,
    const std::vector<int64_t>& sizes,
    std::vector<c10::intrusive_ptr<c10d::Work>>& sends) {
  const auto rank = connection.rank;
  if (rank == 0) {
    local.sizes = sizes;
    for (const auto r : c10::irange(int64_t{1}, connection.size)) {
      connection.send(
          r,
          pass,
          MessageId{MessageKind::Begin, 0, 0},
          Message{{local.encode()}, true},
          sends);
    }
    return local;
  }
  auto m = connection.recv(0, pass, MessageId{MessageKind::Begin, 0, 0});
  TORCH_CHECK(m.tensors.size() == 1, "gpipe::dist: malformed begin message");
  auto theirs = Begin::decode(m.tensors[0]);
  auto differ = [&](const std::string& what,
                    const std::string& here,
                    const std::string& there) {
    TORCH_CHECK_VALUE(
        here == there,
        "gpipe::dist: rank ",
        rank,
        " runs ",
        what,
        " ",
        here,
        " but rank 0 runs ",
        there,
        " (",
        detail::describe_pass(pass),
        "): every rank must run the same passes in the same order");
  };
  differ("pass", kind_name(local.kind), kind_name(theirs.kind));
  if (local.kind == PassKind::Train) {
    differ(
        "schedule",
        schedule_name(local.schedule),
        schedule_name(theirs.schedule));
  }
  differ(
      "in mode",
      local.training ? "train()" : "eval()",
      theirs.training ? "train()" : "eval()");
  differ(
      "with checkpointed micro-batches below",
      std::to_string(local.checkpoint_stop),
      std::to_string(theirs.checkpoint_stop));
  TORCH_CHECK(
      !theirs.sizes.empty(),
      "gpipe::dist: rank 0 started a pass without micro-batches");
  return theirs;
}

}  // namespace

torch::Tensor PipelineStageImpl::train_step(
    torch::Tensor input,
    torch::Tensor target,
    const LossFunction& loss_fn,
    Schedule schedule) {
  auto& connection = *engine_->connection;
  auto& pipeline = *engine_->pipeline;
  const auto rank = world_.rank();
  const auto n = world_.size();
  const bool first = rank == 0;
  const bool last = rank == n - 1;
  // One pass at a time on the whole connection (stages share its tags).
  std::lock_guard<std::mutex> passes(connection.passes_mutex);
  auto held = pipeline.begin_pass();
  connection.check();
  const auto pass_id = engine_->next_pass();
  std::vector<c10::intrusive_ptr<c10d::Work>> begin_sends;
  try {
    // A mistake on one rank fails the pass on every rank (below), rather
    // than leaving the others waiting.
    TORCH_CHECK_VALUE(
        static_cast<bool>(loss_fn),
        "train_step expects a loss_fn, but got none");
    TORCH_CHECK(
        torch::GradMode::is_enabled(),
        "train_step needs grad mode on, but it is off (torch::NoGradGuard or "
        "InferenceMode)");
    Begin local;
    local.kind = PassKind::Train;
    local.schedule = static_cast<int64_t>(schedule);
    local.training = is_training();
    local.checkpoint_stop = checkpoint_stop(options, is_training());
    std::vector<Batch> micro;
    std::vector<int64_t> sizes;
    if (first) {
      TORCH_CHECK_TYPE(
          input.defined(),
          "train_step expects the input on rank 0, but got an undefined "
          "tensor");
      verify_batch({input});
      micro = scatter({input}, options.chunks());
      for (const auto& b : micro) {
        sizes.push_back(b[0].size(0));
      }
    }
    gpipe::detail::StepSeed seeds({device_}, /*draw=*/true);
    local.seed = seeds.seed();
    const auto begin =
        begin_pass(connection, pass_id, local, sizes, begin_sends);
    sizes = begin.sizes;
    const auto m = static_cast<int64_t>(sizes.size());
    int64_t total = 0;
    for (auto s : sizes) {
      total += s;
    }

    std::vector<torch::Tensor> targets;
    if (last) {
      TORCH_CHECK_TYPE(
          target.defined(),
          "train_step expects the target on the last rank (",
          rank,
          "), but got an undefined tensor");
      TORCH_CHECK_VALUE(
          target.dim() > 0 && target.size(0) == total,
          "train_step expects a target with the input's batch size ",
          total,
          " (rank 0's) in dimension 0, but got shape ",
          target.sizes());
      for (auto& piece : scatter({target.to(device_)}, options.chunks())) {
        targets.push_back(piece[0]);
      }
      TORCH_CHECK_VALUE(
          static_cast<int64_t>(targets.size()) == m,
          "train_step: the target splits into ",
          targets.size(),
          " micro-batches but the input into ",
          m);
    }

    gpipe::detail::PassOptions pass_options;
    pass_options.training = begin.training;
    pass_options.checkpoint_stop = begin.checkpoint_stop;
    engine_->current = pass_id;
    const Batch originals = first ? Batch{input} : Batch{};
    auto pass = pipeline.start_pass(m, originals, pass_options);
    pass->grad = true;
    pass->step_seed = begin.seed;
    auto& transport = dynamic_cast<C10dTransport&>(pass->transport());
    if (last) {
      pass->loss_fn = &loss_fn;
      pass->targets = std::move(targets);
      pass->losses.resize(m);
      for (const auto i : c10::irange(m)) {
        pass->loss_scales.push_back(
            static_cast<double>(sizes[i]) / static_cast<double>(total));
      }
    }
    if (first) {
      for (const auto i : c10::irange(m)) {
        transport.send(
            Phase::Forward,
            i,
            0,
            gpipe::detail::Packet{std::move(micro[i]), true});
      }
    }
    pipeline.run_and_commit(
        pass, training_plan(static_cast<Schedule>(begin.schedule), m, n));
    connection.check();

    torch::Tensor loss;
    const MessageId loss_id{MessageKind::Loss, 0, 0};
    if (last) {
      loss = torch::stack(pass->losses).sum();
      for (const auto r : c10::irange(n - 1)) {
        transport.send_message(r, loss_id, Message{{loss}, true});
      }
    } else {
      auto m = transport.recv_message(n - 1, loss_id);
      TORCH_CHECK(m.tensors.size() == 1, "gpipe::dist: malformed loss message");
      loss = m.tensors[0].clone();
    }
    std::vector<gpipe::detail::Packet> dx;
    if (first && input.requires_grad()) {
      for (const auto i : c10::irange(m)) {
        dx.push_back(transport.recv(Phase::Backward, i, 0));
      }
    }
    transport.finish();
    connection.wait_sends(begin_sends);
    held.unlock();
    if (!dx.empty()) {
      auto g = gpipe::detail::join_input_grad(
          dx, 0, sizes, input.sizes().vec(), input.options());
      if (g.defined()) {
        torch::autograd::backward({input}, {g});
      }
    }
    return loss;
  } catch (...) {
    for (auto& work : begin_sends) {
      detail::keep_forever(std::move(work));  // may still be posted
    }
    connection.fail(
        "rank " + std::to_string(rank) + ": " +
        message_of(std::current_exception()));
    throw;
  }
}

torch::Tensor PipelineStageImpl::forward(torch::Tensor input) {
  auto& connection = *engine_->connection;
  auto& pipeline = *engine_->pipeline;
  const auto rank = world_.rank();
  const auto n = world_.size();
  const bool first = rank == 0;
  const bool last = rank == n - 1;
  torch::NoGradGuard no_grad;
  std::lock_guard<std::mutex> passes(connection.passes_mutex);
  auto held = pipeline.begin_pass();
  connection.check();
  const auto pass_id = engine_->next_pass();
  std::vector<c10::intrusive_ptr<c10d::Work>> begin_sends;
  try {
    Begin local;
    local.kind = PassKind::Forward;
    local.training = is_training();
    std::vector<Batch> micro;
    std::vector<int64_t> sizes;
    if (first) {
      TORCH_CHECK_TYPE(
          input.defined(),
          "forward expects the input on rank 0, but got an undefined tensor");
      verify_batch({input});
      micro = scatter({input}, options.chunks());
      for (const auto& b : micro) {
        sizes.push_back(b[0].size(0));
      }
    }
    gpipe::detail::StepSeed seeds({device_}, /*draw=*/true);
    local.seed = seeds.seed();
    const auto begin =
        begin_pass(connection, pass_id, local, sizes, begin_sends);
    const auto m = static_cast<int64_t>(begin.sizes.size());
    gpipe::detail::PassOptions pass_options;
    pass_options.training = begin.training;
    engine_->current = pass_id;
    auto pass = pipeline.start_pass(m, {}, pass_options);
    pass->step_seed = begin.seed;
    auto& transport = dynamic_cast<C10dTransport&>(pass->transport());
    if (first) {
      for (const auto i : c10::irange(m)) {
        transport.send(
            Phase::Forward,
            i,
            0,
            gpipe::detail::Packet{std::move(micro[i]), true});
      }
    }
    pipeline.run_and_commit(pass, forward_plan(m, n));
    connection.check();
    torch::Tensor output;
    if (last) {
      std::vector<Batch> outputs;
      for (const auto i : c10::irange(m)) {
        auto packet = transport.recv(Phase::Forward, i, n);
        TORCH_CHECK_TYPE(
            packet.atomic && packet.tensors.size() == 1,
            "the last layer returned ",
            packet.tensors.size(),
            " tensors; gpipe::dist::PipelineStage::forward returns one");
        outputs.push_back(std::move(packet.tensors));
      }
      output = gather(outputs)[0];
    }
    transport.finish();
    connection.wait_sends(begin_sends);
    return output;
  } catch (...) {
    for (auto& work : begin_sends) {
      detail::keep_forever(std::move(work));  // may still be posted
    }
    connection.fail(
        "rank " + std::to_string(rank) + ": " +
        message_of(std::current_exception()));
    throw;
  }
}

void PipelineStageImpl::to(
    torch::Device device, torch::Dtype dtype, bool non_blocking) {
  TORCH_CHECK_TYPE(
      false,
      "gpipe::dist::PipelineStage refuses to move to ",
      device,
      ": its device is fixed at construction; cast the dtype alone with "
      "to(dtype)");
}

void PipelineStageImpl::to(torch::Dtype dtype, bool non_blocking) {
  partition_->to(device_, dtype, non_blocking);
}

void PipelineStageImpl::to(torch::Device device, bool non_blocking) {
  TORCH_CHECK_TYPE(
      false,
      "gpipe::dist::PipelineStage refuses to move to ",
      device,
      ": its device is fixed at construction");
}

void PipelineStageImpl::set_trace(std::shared_ptr<Trace> trace) {
  engine_->pipeline->set_trace(trace);
  std::lock_guard<std::mutex> lock(engine_->trace_mutex);
  engine_->trace = std::move(trace);
}

std::shared_ptr<Trace> PipelineStageImpl::trace() const {
  return engine_->current_trace();
}

void PipelineStageImpl::pretty_print(std::ostream& stream) const {
  stream << "gpipe::dist::PipelineStage(rank=" << world_.rank() << "/"
         << world_.size() << ", balance=" << c10::IntArrayRef(options.balance())
         << ", chunks=" << options.chunks()
         << ", checkpoint=" << to_string(options.checkpoint())
         << ", device=" << device_ << ")";
}

}  // namespace gpipe::dist

namespace gpipe::dist {

namespace {

// When `trace` began, in microseconds of the system clock (steady clocks
// of different hosts do not share an epoch).
double system_origin_us(const Trace& trace) {
  using us = std::chrono::duration<double, std::micro>;
  const auto age = std::chrono::steady_clock::now() - trace.origin();
  return us((std::chrono::system_clock::now() - age).time_since_epoch())
      .count();
}

}  // namespace

std::shared_ptr<Trace> gather_trace(const PipelineStage& stage) {
  const auto& impl = *stage;
  auto& connection = *impl.world().connection();
  auto* engine = impl.engine_.get();
  // A pass of its own, so that its messages cannot meet a step's.
  std::lock_guard<std::mutex> passes(connection.passes_mutex);
  auto held = engine->pipeline->begin_pass();
  connection.check();
  const auto pass = engine->next_pass();
  const MessageId id{MessageKind::Trace, 0, 0};
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  try {
    auto trace = impl.trace();
    TORCH_CHECK_VALUE(
        trace != nullptr,
        "gather_trace expects a stage with a trace set (set_trace) on every "
        "rank, but rank ",
        connection.rank,
        " has none");
    const double origin = system_origin_us(*trace);
    if (connection.rank != 0) {
      std::vector<double> values;
      for (const auto& e : trace->events()) {
        values.insert(
            values.end(),
            {static_cast<double>(e.lane),
             static_cast<double>(e.micro_batch),
             static_cast<double>(static_cast<int>(e.kind)),
             e.start_us + origin,
             e.end_us + origin});
      }
      connection.send(
          0,
          pass,
          id,
          Message{{torch::tensor(values, torch::kDouble)}, true},
          sends);
      connection.wait_sends(sends);
      return nullptr;
    }
    auto merged = std::make_shared<Trace>();
    const double base = system_origin_us(*merged);
    auto add = [&](const std::vector<TraceEvent>& events, double from) {
      for (auto e : events) {
        e.start_us += from - base;
        e.end_us += from - base;
        merged->add(e);
      }
    };
    add(trace->events(), origin);
    for (const auto r : c10::irange(int64_t{1}, connection.size)) {
      auto m = connection.recv(r, pass, id);
      TORCH_CHECK(
          m.tensors.size() == 1 && m.tensors[0].defined() &&
              m.tensors[0].scalar_type() == torch::kDouble,
          "gpipe::dist: a malformed trace message came from rank ",
          r);
      auto t = m.tensors[0].contiguous();
      const auto* p = t.data_ptr<double>();
      std::vector<TraceEvent> events;
      for (int64_t k = 0; k + 5 <= t.numel(); k += 5) {
        TraceEvent e;
        e.lane = static_cast<int64_t>(p[k]);
        e.micro_batch = static_cast<int64_t>(p[k + 1]);
        e.kind = static_cast<TraceKind>(static_cast<int>(p[k + 2]));
        e.start_us = p[k + 3];
        e.end_us = p[k + 4];
        events.push_back(e);
      }
      add(events, 0.0);
    }
    return merged;
  } catch (...) {
    for (auto& work : sends) {
      detail::keep_forever(std::move(work));
    }
    connection.fail(
        "rank " + std::to_string(connection.rank) + ": " +
        message_of(std::current_exception()));
    throw;
  }
}

}  // namespace gpipe::dist
