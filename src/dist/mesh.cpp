// World::split and Mesh: the sub-groups of a job. A split World has its own
// c10d group (made as its parent's was), its own store prefix and its own
// failure channel, so that a replica's pipeline and a stage's data-parallel
// group run side by side without sharing tags.

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <gpipe/dist.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <utility>
#include <vector>

#include "dist/connection.h"

namespace gpipe::dist {

namespace {

// A World of this rank alone has no group and no channel: nothing to make.
detail::Groups solo_groups(const detail::Connection& parent) {
  detail::Groups groups;
  groups.device = parent.groups.device;
  return groups;
}

// A World of this rank alone: no group and no peers, so nothing to make.
// Its keys (stage agreements, failure notices) live under a prefix of its
// own, apart from the parent's and from other ranks' solo Worlds.
World solo(detail::Connection& parent, int64_t id) {
  auto connection = std::make_shared<detail::Connection>(
      c10::make_intrusive<c10d::PrefixStore>(
          "split" + std::to_string(id) + "/solo" + std::to_string(parent.rank),
          parent.store),
      solo_groups(parent),
      0,
      1,
      parent.local_rank,
      parent.local_size,
      parent.timeout,
      parent.make_group,
      parent.job_store,
      std::vector<int64_t>{parent.global_rank(parent.rank)});
  return World(std::move(connection));
}

}  // namespace

World World::split(int64_t color, int64_t key) const {
  auto& parent = *connection_;
  // Note [A World's collectives from several threads] in
  // world_collectives.cpp.
  std::lock_guard<std::mutex> one_at_a_time(parent.world_collectives_mutex);
  parent.check();
  const auto id = parent.next_split_id();
  if (parent.size == 1) {
    TORCH_CHECK_VALUE(
        color >= 0,
        "gpipe::dist::World::split expects a color >= 0, but got ",
        color);
    return solo(parent, id);
  }
  // Every rank's (color, key), gathered through the parent's group (on its
  // device: NCCL's is a GPU).
  const auto on =
      torch::TensorOptions(torch::kLong).device(parent.groups.device);
  auto mine = torch::tensor({color, key}, torch::kLong).to(on.device());
  std::vector<std::vector<torch::Tensor>> all(1);
  for (const auto r : c10::irange(parent.size)) {
    (void)r;
    all[0].push_back(torch::empty({2}, on));
  }
  std::vector<torch::Tensor> input{mine};
  detail::first_collective(
      parent,
      detail::FirstCollective::Split,
      {0, 0, 0, 0},
      0,
      "World::split (its agreement)");
  parent.check();
  parent.closing_on_failure([&] {
    parent.wait_collective(
        parent.group->allgather(all, input),
        "World::split (learning the other ranks' colors)");
  });
  const auto gathered = torch::stack(all[0]).cpu();
  // Checked once every rank's color is known, so that all refuse alike (a
  // rank refusing alone left the others waiting for it until the timeout).
  for (const auto r : c10::irange(parent.size)) {
    const auto theirs = gathered[r][0].item<int64_t>();
    TORCH_CHECK_VALUE(
        theirs >= 0,
        "gpipe::dist::World::split expects a color >= 0 on every rank, but ",
        parent.rank_name(r),
        " gave ",
        theirs);
  }
  std::vector<std::tuple<int64_t, int64_t>> members;  // (key, parent rank)
  for (const auto r : c10::irange(parent.size)) {
    const auto* v = gathered[r].data_ptr<int64_t>();
    if (v[0] == color) {
      members.emplace_back(v[1], r);
    }
  }
  std::sort(members.begin(), members.end());
  int64_t rank = 0;
  while (std::get<1>(members[rank]) != parent.rank) {
    ++rank;
  }
  const auto size = static_cast<int64_t>(members.size());
  if (size == 1) {
    return solo(parent, id);
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "split" + std::to_string(id) + "/" + std::to_string(color), parent.store);
  auto groups = parent.make_group(store, rank, size);
  std::vector<int64_t> global_ranks;
  for (const auto& member : members) {
    global_ranks.push_back(parent.global_rank(std::get<1>(member)));
  }
  return World(std::make_shared<detail::Connection>(
      store,
      std::move(groups),
      rank,
      size,
      parent.local_rank,
      parent.local_size,
      parent.timeout,
      parent.make_group,
      parent.job_store,
      std::move(global_ranks)));
}

Mesh::Mesh(World world, int64_t pipeline_size)
    : world_(world), pipeline_(world), data_(world) {
  const auto size = world_.size();
  // Every rank's pipeline size, agreed first (the largest and the largest
  // negative, one collective of two numbers): ranks given others built
  // meshes of other layouts and met only in their next collective, at its
  // timeout; a rank refusing a size alone left the others waiting. Now
  // every rank refuses alike, naming the sizes.
  if (size > 1) {
    auto& connection = *world_.connection();
    connection.check();
    const auto words = detail::first_collective(
        connection,
        detail::FirstCollective::Mesh,
        {pipeline_size, 0, 0, 0},
        0,
        "Mesh (its agreement on the pipeline size, which "
        "PipelineStage(net, options, world) makes too)");
    // The largest size and the largest of their negatives.
    const std::array<int64_t, 2> w{words[1], words[5]};
    TORCH_CHECK_VALUE(
        w[0] == -w[1],
        "gpipe::dist::Mesh expects the same pipeline size on every rank, but "
        "the ranks passed sizes from ",
        -w[1],
        " to ",
        w[0],
        " (",
        connection.rank_name(connection.rank),
        ": ",
        pipeline_size,
        ")");
  }
  TORCH_CHECK_VALUE(
      pipeline_size >= 1,
      "gpipe::dist::Mesh expects a pipeline size of at least 1 (stages per "
      "replica), but got ",
      pipeline_size);
  TORCH_CHECK_VALUE(
      size % pipeline_size == 0,
      "gpipe::dist::Mesh expects the world size to be a multiple of the "
      "pipeline size, but the world has ",
      size,
      size == 1 ? " rank" : " ranks",
      " and the pipeline size is ",
      pipeline_size);
  const auto rank = world_.rank();
  // A replica's stages are neighbours: rank = data_rank * P + pipeline_rank.
  // A World of one rank needs no collective (solo), and one of them all is
  // `world` itself.
  auto& connection = *world_.connection();
  if (pipeline_size == 1) {
    pipeline_ = solo(connection, connection.next_split_id());
  } else if (pipeline_size < size) {
    pipeline_ = world_.split(rank / pipeline_size, rank % pipeline_size);
  }
  if (pipeline_size == size) {
    data_ = solo(connection, connection.next_split_id());
  } else if (pipeline_size > 1) {
    data_ = world_.split(rank % pipeline_size, rank / pipeline_size);
  }
}

int64_t Mesh::pipeline_rank() const {
  return pipeline_.rank();
}
int64_t Mesh::data_rank() const {
  return data_.rank();
}
int64_t Mesh::pipeline_size() const {
  return pipeline_.size();
}
int64_t Mesh::data_size() const {
  return data_.size();
}

}  // namespace gpipe::dist
