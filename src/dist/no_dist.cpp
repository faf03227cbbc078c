// gpipe::dist in a build without c10d (-DGPIPE_DIST=OFF, or a LibTorch
// built without distributed support): is_available() says so, and joining a
// job is a c10::Error that says why. No World can be made here, so the rest
// of the API is never reached; it is defined so that programs that use it
// still link (gpipe-train runs its one-process path).

#include <c10/util/Exception.h>
#include <gpipe/dist.h>
#include <gpipe/plan.h>
#include <gpipe/trace.h>

namespace gpipe::dist {

namespace {

[[noreturn]] void unavailable(const char* what) {
  TORCH_CHECK(
      false,
      "gpipe::dist::",
      what,
      " is not available: this gpipe was built without c10d (-DGPIPE_DIST=OFF, "
      "or a LibTorch without distributed support); rebuild with "
      "-DGPIPE_DIST=ON against a LibTorch that has it");
}

}  // namespace

bool is_available() {
  return false;
}

std::chrono::milliseconds default_timeout() {
  return std::chrono::seconds(120);
}

World init_from_env() {
  unavailable("init_from_env");
}

World init_from_env(std::chrono::milliseconds) {
  unavailable("init_from_env");
}

World init_from_store(
    c10::intrusive_ptr<c10d::Store>,
    int64_t,
    int64_t,
    std::chrono::milliseconds) {
  unavailable("init_from_store");
}

World::World(std::shared_ptr<detail::Connection>) {
  unavailable("World");
}
World::~World() = default;
int64_t World::rank() const {
  unavailable("World");
}
int64_t World::size() const {
  unavailable("World");
}
int64_t World::local_rank() const {
  unavailable("World");
}
int64_t World::local_size() const {
  unavailable("World");
}
std::chrono::milliseconds World::timeout() const {
  unavailable("World");
}
const c10::intrusive_ptr<c10d::ProcessGroup>& World::group() const {
  unavailable("World");
}
const c10::intrusive_ptr<c10d::Store>& World::store() const {
  unavailable("World");
}
World World::split(int64_t, int64_t) const {
  unavailable("World::split");
}
void World::all_reduce(torch::Tensor&) const {
  unavailable("World::all_reduce");
}
void World::broadcast(torch::Tensor&, int64_t) const {
  unavailable("World::broadcast");
}
void World::barrier() const {
  unavailable("World::barrier");
}

Mesh::Mesh(World world, int64_t)
    : world_(world), pipeline_(world), data_(world) {
  unavailable("Mesh");
}
int64_t Mesh::pipeline_rank() const {
  unavailable("Mesh");
}
int64_t Mesh::data_rank() const {
  unavailable("Mesh");
}
int64_t Mesh::pipeline_size() const {
  unavailable("Mesh");
}
int64_t Mesh::data_size() const {
  unavailable("Mesh");
}

PipelineStageImpl::PipelineStageImpl(
    torch::nn::Sequential, GPipeOptions options_, World world)
    : options(std::move(options_)),
      built_(options),
      mesh_(world, 1),
      world_(world) {
  unavailable("PipelineStage");
}
PipelineStageImpl::PipelineStageImpl(
    torch::nn::Sequential, GPipeOptions options_, Mesh mesh)
    : options(std::move(options_)),
      built_(options),
      mesh_(mesh),
      world_(mesh.world()) {
  unavailable("PipelineStage");
}
PipelineStageImpl::~PipelineStageImpl() = default;
torch::Tensor PipelineStageImpl::forward(torch::Tensor) {
  unavailable("PipelineStage");
}
torch::Tensor PipelineStageImpl::train_step(
    torch::Tensor, torch::Tensor, const LossFunction&, Schedule) {
  unavailable("PipelineStage");
}
torch::Tensor PipelineStageImpl::train_step(
    torch::Tensor, torch::Tensor, const LossFunction&, const Plan&) {
  unavailable("PipelineStage");
}
torch::Tensor PipelineStageImpl::run_train_step(
    torch::Tensor, torch::Tensor, const LossFunction&, Schedule, const Plan*) {
  unavailable("PipelineStage");
}
torch::Tensor PipelineStageImpl::run_pipeline_step(
    torch::Tensor, torch::Tensor, const LossFunction&, Schedule, const Plan*) {
  unavailable("PipelineStage");
}
void PipelineStageImpl::to(torch::Device, torch::Dtype, bool) {
  unavailable("PipelineStage");
}
void PipelineStageImpl::to(torch::Dtype, bool) {
  unavailable("PipelineStage");
}
void PipelineStageImpl::to(torch::Device, bool) {
  unavailable("PipelineStage");
}
void PipelineStageImpl::set_trace(std::shared_ptr<Trace>) {
  unavailable("PipelineStage");
}
std::shared_ptr<Trace> PipelineStageImpl::trace() const {
  unavailable("PipelineStage");
}
void PipelineStageImpl::pretty_print(std::ostream&) const {
  unavailable("PipelineStage");
}
void PipelineStageImpl::set_gradient_bucket_bytes(int64_t) {
  unavailable("PipelineStage");
}
std::vector<int64_t> PipelineStageImpl::partition_indices() const {
  unavailable("PipelineStage");
}
Placement PipelineStageImpl::placement() const {
  unavailable("PipelineStage");
}
int64_t PipelineStageImpl::gradient_bucket_bytes() const {
  unavailable("PipelineStage");
}

std::shared_ptr<Trace> gather_trace(const PipelineStage&) {
  unavailable("gather_trace");
}

void save_checkpoint(
    const std::string&,
    const PipelineStage&,
    const torch::optim::Optimizer&,
    const TrainingState&) {
  unavailable("save_checkpoint");
}

TrainingState load_checkpoint(
    const std::string&, PipelineStage&, torch::optim::Optimizer&) {
  unavailable("load_checkpoint");
}

}  // namespace gpipe::dist
