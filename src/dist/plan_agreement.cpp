// Note [Telling two plans apart]
//
// Every rank of a pipeline must run the same plan in a step, and rank 0's
// begin message carries only its plan's hash: a plan can be thousands of
// actions, and the message goes out every step. A rank whose hash differs
// from rank 0's fails before anything runs, and would otherwise have
// nothing to say but the two hashes. So rank 0 leaves each plan it runs in
// the pipeline's store, once per plan (under `gpipe/plan/<hash>`), before
// it sends the begin message that names it (and takes the one before
// back); a rank whose plan differs reads it there and says where the two
// first differ: their micro-batches and stages, the placement line, or the
// first action of the first lane that differs. Reading it never waits: a
// plan not (or no longer) in the store leaves the hashes alone to tell.

#include <gpipe/plan.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "dist/agreement.h"
#include "text.h"

namespace gpipe::dist::detail {

namespace {

std::vector<std::string> split(const std::string& text, char by) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, by)) {
    parts.push_back(part);
  }
  return parts;
}

std::string plan_key(uint64_t hash) {
  return "gpipe/plan/" + std::to_string(hash);
}

}  // namespace

std::string plan_identity(const gpipe::Plan& plan) {
  using gpipe::detail::count_of;
  return count_of(plan.micro_batches, "micro-batch", "micro-batches") + ", " +
         count_of(plan.stages, "stage", "stages") + "\n" + plan.to_csv();
}

std::string plan_difference(
    const std::string& mine,
    const std::string& theirs,
    const std::string& here,
    const std::string& there) {
  if (mine == theirs) {
    return "";
  }
  auto a = split(mine, '\n');
  auto b = split(theirs, '\n');
  auto line = [](const std::vector<std::string>& lines, size_t k) {
    return k < lines.size() ? lines[k] : std::string();
  };
  // Line 0: the sizes.
  if (line(a, 0) != line(b, 0)) {
    return "the plans differ in size: " + here + "'s has " + line(a, 0) + ", " +
           there + "'s " + line(b, 0);
  }
  // The placement line, when either has one.
  auto placement = [](const std::vector<std::string>& lines) {
    return lines.size() > 1 && lines[1].rfind('#', 0) == 0 ? lines[1] : "";
  };
  const auto pa = placement(a);
  const auto pb = placement(b);
  if (pa != pb) {
    auto said = [](const std::string& p) {
      return p.empty() ? std::string("no placement line") : "'" + p + "'";
    };
    return "the plans place their stages differently: " + here + "'s has " +
           said(pa) + ", " + there + "'s " + said(pb);
  }
  const size_t first_lane = pa.empty() ? 1 : 2;
  a.erase(a.begin(), a.begin() + std::min(a.size(), first_lane));
  b.erase(b.begin(), b.begin() + std::min(b.size(), first_lane));
  for (size_t lane = 0; lane < std::max(a.size(), b.size()); ++lane) {
    const auto ra = split(line(a, lane), ',');
    const auto rb = split(line(b, lane), ',');
    for (size_t k = 0; k < std::max(ra.size(), rb.size()); ++k) {
      if (k < ra.size() && k < rb.size() && ra[k] == rb[k]) {
        continue;
      }
      auto action = [&](const std::vector<std::string>& row,
                        const std::string& who) {
        return k < row.size()
                   ? who + "'s is " + row[k]
                   : who + "'s lane has only " + std::to_string(row.size()) +
                         " action" + (row.size() == 1 ? "" : "s");
      };
      return "the plans first differ at lane " + std::to_string(lane) +
             ", action " + std::to_string(k + 1) + ": " + action(ra, here) +
             ", " + action(rb, there);
    }
  }
  // Only a lane's absence (an empty last row) differs.
  return "the plans differ in lanes: " + here + "'s has " +
         std::to_string(a.size()) + ", " + there + "'s " +
         std::to_string(b.size());
}

void publish_plan(
    Connection& connection, const Begin& local, uint64_t previous) {
  const auto& text = local.plan_text;
  connection.store->set(
      plan_key(local.plan_hash),
      std::vector<uint8_t>(text.begin(), text.end()));
  // The plan of an earlier pass is no longer compared with (every rank
  // began that pass, or the pipeline failed): a program that makes a new
  // plan every step leaves one in the store, not one a step.
  if (previous != 0 && previous != local.plan_hash) {
    connection.store->deleteKey(plan_key(previous));
  }
}

std::string plans_differ(
    Connection& connection, const Begin& local, const Begin& theirs) {
  try {
    const auto key = plan_key(theirs.plan_hash);
    if (local.plan_text.empty() || !connection.store->check({key})) {
      return "";
    }
    const auto value = connection.store->get(key);
    return plan_difference(
        local.plan_text,
        std::string(value.begin(), value.end()),
        connection.rank_name(connection.rank),
        connection.rank_name(0));
  } catch (const std::exception&) {
    // The store is gone or failing: the hashes tell it alone.
    return "";
  }
}

}  // namespace gpipe::dist::detail
