// One rank's ends of a pass: see dist/rank_endpoints.h.

#include "dist/rank_endpoints.h"

#include <c10/util/irange.h>
#include <gpipe/microbatch.h>
#include <gpipe/schedule.h>

#include "dist/c10d_transport.h"
#include "dist/connection.h"
#include "dist/data_parallel.h"
#include "engine/pipeline.h"
#include "random.h"

namespace gpipe::dist::detail {

RankEndpoints::RankEndpoints(
    Connection& connection,
    gpipe::detail::Pipeline& pipeline,
    int64_t& current,
    std::vector<std::unique_ptr<GradientBuckets>>& buckets,
    int64_t pass_id,
    Sends& begin_sends,
    Begin local,
    int64_t ranks)
    : connection_(connection),
      pipeline_(pipeline),
      current_(current),
      buckets_(buckets),
      pass_id_(pass_id),
      begin_sends_(begin_sends),
      local_(std::move(local)),
      ranks_(ranks) {}

bool RankEndpoints::last_here() const {
  return pipeline_.is_local(pipeline_.size() - 1);
}

int64_t RankEndpoints::last_rank() const {
  return pipeline_.placement().lane_of(pipeline_.size() - 1);
}

int64_t RankEndpoints::rows() const {
  int64_t rows = 0;
  for (const auto s : agreed_.sizes) {
    rows += s;
  }
  return rows;
}

bool RankEndpoints::seed_first() const {
  return connection_.rank == 0;
}

// Note [One draw a pass on every rank]
// Every cell runs on rank 0's step seed, but every rank's default generator
// moves by the one draw a pass makes, as a GPipe's does in one process, so
// that ranks seeded alike stay alike (the same shuffle of the data on every
// rank, the inputs on the first and the targets on the last). Rank 0 draws
// before it sends the seed; the others once they have read it, so that a
// pass rank 0 refused, which drew nothing there, draws nothing anywhere.
// (Ranks that are threads of one process share a generator, which then
// moves by one draw per rank, rank 0's first.)
void RankEndpoints::begin(gpipe::detail::PassStart& start) {
  local_.seed = start.seed;
  local_.training = start.options.training;
  local_.checkpoint_stop = start.options.checkpoint_stop;
  local_.chunks = chunks;
  local_.checkpoint = static_cast<int64_t>(checkpoint);
  agreed_ = begin_pass(connection_, pass_id_, local_, start.rows, begin_sends_);
  if (connection_.rank != 0) {
    gpipe::detail::draw_step_seed();
  }
  start.seed_agreed = true;
  start.rows = agreed_.sizes;
  start.seed = agreed_.seed;
  start.options.training = agreed_.training;
  start.options.checkpoint_stop = agreed_.checkpoint_stop;
  current_ = pass_id_;  // the transport the pass makes is this one's
}

// Every rank has the same plan (begin_pass compared them) and the same
// number of micro-batches: a plan that does not fit is refused alike
// everywhere.
const Plan& RankEndpoints::plan(const gpipe::detail::PassStart& start) {
  if (user_plan != nullptr) {
    return *user_plan;
  }
  const auto m = static_cast<int64_t>(start.rows.size());
  if (made_for_ != m) {  // (check_plan made it on the first stage)
    made_ = arrange(make_plan(
        static_cast<Schedule>(agreed_.schedule), m, pipeline_.placement()));
    made_for_ = m;
  }
  return made_;
}

void RankEndpoints::check_plan(int64_t micro_batches) {
  if (user_plan == nullptr) {
    // Rank 0's schedule is the one every rank agrees on.
    made_ = arrange(make_plan(
        static_cast<Schedule>(local_.schedule),
        micro_batches,
        pipeline_.placement()));
    made_for_ = micro_batches;
  }
  pipeline_.check_training_plan_once(
      user_plan != nullptr ? *user_plan : made_, micro_batches);
}

// Receives are posted a cell early, so that messages arrive while the rank
// computes.
Plan RankEndpoints::arrange(Plan plan) const {
  return plan.with_transfers();
}

void RankEndpoints::refuse(std::exception_ptr error) {
  throw AgreedRefusal{std::move(error)};
}

std::vector<torch::Tensor> RankEndpoints::targets(
    const gpipe::detail::PassStart& start) {
  if (!last_here()) {
    return {};
  }
  int64_t total = 0;
  for (auto s : start.rows) {
    total += s;
  }
  TORCH_CHECK_TYPE(
      target.defined(),
      "train_step expects the target on the last stage's rank (",
      connection_.rank_name(last_rank()),
      "), but got an undefined tensor");
  TORCH_CHECK_VALUE(
      target.dim() > 0 && target.size(0) == total,
      "train_step expects a target with the input's batch size ",
      total,
      " (",
      connection_.rank_name(0),
      "'s) in dimension 0, but got shape ",
      target.sizes());
  std::vector<torch::Tensor> pieces;
  for (auto& piece : scatter({target.to(device)}, chunks)) {
    pieces.push_back(piece[0]);
  }
  TORCH_CHECK_VALUE(
      pieces.size() == start.rows.size(),
      "train_step: the target splits into ",
      pieces.size(),
      " micro-batches but the input into ",
      start.rows.size());
  return pieces;
}

void RankEndpoints::prepare(gpipe::detail::Pass& pass) {
  pass.seed_offset = replica * pass.micro_batches();
  if (local_.kind != PassKind::Train) {
    return;
  }
  // A rank whose stages have nothing to train still passes gradients on.
  pass.grad = true;
  if (buckets_.empty()) {
    return;
  }
  // Partition j is this rank's k-th (its buckets are in partition
  // order). Buckets whose gradients are all accumulated during the stage's
  // last backward start before it ends; the rest when it has. See Note
  // [Gradient buckets].
  auto* buckets = &buckets_;
  std::vector<size_t> index(static_cast<size_t>(pipeline_.size()), 0);
  size_t k = 0;
  for (const auto j : c10::irange(pipeline_.size())) {
    index[j] = pipeline_.is_local(j) ? k++ : 0;
  }
  const auto agree = before_buckets;
  pass.before_final_gradients = [buckets, index, agree](int64_t j) {
    if (!agree || agree()) {
      buckets->at(index.at(j))->arm();
    }
  };
  pass.on_gradients_final = [buckets, index, agree](int64_t j) {
    if (!agree || agree()) {
      buckets->at(index.at(j))->start();
    }
  };
}

// The last rank's loss, on every rank.
torch::Tensor RankEndpoints::loss(gpipe::detail::Pass& pass) {
  connection_.check();
  auto& transport = dynamic_cast<C10dTransport&>(pass.transport());
  const MessageId loss_id{MessageKind::Loss, 0, 0};
  if (last_here()) {
    auto loss = Endpoints::loss(pass);
    for (const auto r : c10::irange(ranks_)) {
      if (r != last_rank()) {
        transport.send_message(r, loss_id, Message{{loss}, true});
      }
    }
    return loss;
  }
  auto message = transport.recv_message(last_rank(), loss_id);
  TORCH_CHECK(
      message.tensors.size() == 1, "gpipe::dist: malformed loss message");
  return message.tensors[0].clone();
}

void RankEndpoints::end(gpipe::detail::Pass& pass) {
  connection_.check();
  dynamic_cast<C10dTransport&>(pass.transport()).finish();
  connection_.wait_sends(begin_sends_);
}

}  // namespace gpipe::dist::detail
