// Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2022):
// each lane runs every micro-batch's forward through its first stage, then
// through its next, and so on; then the backwards, its last stage first,
// each stage's micro-batches in reverse (as fill-drain). A lane's stages
// run in stage order, which is an order of the whole step, so the plan
// runs on any placement. Holds every micro-batch, like fill-drain; a lane
// sends a whole stage's outputs at a time, so the next lane starts on them
// while it computes.

#include <gpipe/plan.h>

#include "schedule/plan_builders.h"

namespace gpipe::detail {

std::vector<std::vector<Cell>> looped_bfs_rows(
    int64_t m, const Placement& placement) {
  check_sizes(m, placement.stages());
  std::vector<std::vector<Cell>> rows;
  for (int64_t l = 0; l < placement.lanes(); ++l) {
    const auto stages = placement.stages_of(l);
    std::vector<Cell> cells;
    for (const auto j : stages) {
      for (int64_t i = 0; i < m; ++i) {
        cells.push_back(Cell{i, j, Phase::Forward});
      }
    }
    for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
      for (int64_t i = m - 1; i >= 0; --i) {
        cells.push_back(Cell{i, *it, Phase::Backward});
      }
    }
    rows.push_back(std::move(cells));
  }
  return rows;
}

}  // namespace gpipe::detail
