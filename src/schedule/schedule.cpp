// The functions of gpipe/schedule.h over cells and schedules: names,
// spelling, each schedule's lane order and in-flight counts.

#include <c10/util/Exception.h>
#include <gpipe/plan.h>
#include <gpipe/schedule.h>

#include <algorithm>
#include <string>
#include <vector>

#include "schedule/actions.h"
#include "schedule/plan_builders.h"

namespace gpipe {

std::vector<Cell> cells_of_partition(const Steps& steps, int64_t partition) {
  std::vector<Cell> cells;
  for (const auto& step : steps) {
    for (const auto& cell : step) {
      if (cell.partition == partition) {
        cells.push_back(cell);
      }
    }
  }
  return cells;
}

std::string to_string(const Cell& cell) {
  return std::string(detail::action_info(cell.phase).short_name) + "(" +
         std::to_string(cell.micro_batch) + "," +
         std::to_string(cell.partition) + ")";
}

namespace detail {

const std::vector<ScheduleEntry>& schedule_table() {
  static const std::vector<ScheduleEntry> table{
#define GPIPE_SCHEDULE(value, name, rows, placement) \
  {Schedule::value, name, &rows, &placement},
#include "schedule/schedules.def"
#undef GPIPE_SCHEDULE
  };
  return table;
}

const ScheduleEntry& schedule_entry(Schedule schedule) {
  for (const auto& entry : schedule_table()) {
    if (entry.schedule == schedule) {
      return entry;
    }
  }
  TORCH_CHECK_VALUE(
      false, "schedule: unknown schedule ", static_cast<int>(schedule));
}

}  // namespace detail

const std::vector<Schedule>& schedules() {
  static const std::vector<Schedule> all = [] {
    std::vector<Schedule> out;
    for (const auto& entry : detail::schedule_table()) {
      out.push_back(entry.schedule);
    }
    return out;
  }();
  return all;
}

std::string to_string(Schedule schedule) {
  for (const auto& entry : detail::schedule_table()) {
    if (entry.schedule == schedule) {
      return entry.name;
    }
  }
  return "unknown";
}

Schedule schedule_from_string(const std::string& name) {
  std::string names;
  const auto& table = detail::schedule_table();
  for (size_t k = 0; k < table.size(); ++k) {
    if (name == table[k].name) {
      return table[k].schedule;
    }
    names += std::string(
                 k == 0                  ? "'"
                 : k + 1 == table.size() ? " or '"
                                         : ", '") +
             table[k].name + "'";
  }
  TORCH_CHECK_VALUE(
      false, "schedule must be ", names, ", but got '", name, "'");
}

std::vector<Cell> lane_order(
    Schedule schedule, int64_t m, int64_t n, int64_t j) {
  detail::check_sizes(m, n);
  TORCH_CHECK_INDEX(
      j >= 0 && j < n, "schedule: partition ", j, " is not in [0, ", n, ")");
  // One stage per lane, stage j on lane j.
  return detail::schedule_entry(schedule)
      .rows(m, Placement::modulo(n))
      .at(static_cast<size_t>(j));
}

int64_t max_in_flight(const std::vector<Cell>& cells) {
  int64_t in_flight = 0;
  int64_t most = 0;
  for (const auto& c : cells) {
    if (c.phase == Phase::Forward) {
      ++in_flight;
    } else if (detail::action_info(c.phase).frees) {
      --in_flight;
    }
    most = std::max(most, in_flight);
  }
  return most;
}

}  // namespace gpipe
