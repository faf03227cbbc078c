#include "skip.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <sstream>

namespace gpipe {

namespace {

std::atomic<uint64_t>& next_namespace_id() {
  static std::atomic<uint64_t> next{1};  // 0 is the global namespace
  return next;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) {
    out += (out.empty() ? "'" : ", '") + name + "'";
  }
  return out;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

Namespace::Namespace() : id_(next_namespace_id().fetch_add(1)) {}

Namespace Namespace::global() {
  return Namespace(0);
}

std::ostream& operator<<(std::ostream& stream, const SkipKey& key) {
  stream << "'" << key.name << "'";
  if (key.ns != Namespace::global()) {
    stream << " in namespace " << key.ns.id();
  }
  return stream;
}

Skippable::Skippable(
    std::vector<std::string> stash, std::vector<std::string> pop)
    : stash_names_(std::move(stash)), pop_names_(std::move(pop)) {
  // A name twice in one list, or an empty one, is a mistake the layer's
  // author makes once: said here, not when a GPipe verifies the model.
  for (const auto* names : {&stash_names_, &pop_names_}) {
    const char* what = names == &stash_names_ ? "stash" : "pop";
    for (size_t i = 0; i < names->size(); ++i) {
      TORCH_CHECK_VALUE(
          !(*names)[i].empty(),
          "Skippable expects non-empty skip names, but the ",
          what,
          " names ",
          quoted_list(*names),
          " have an empty one");
      TORCH_CHECK_VALUE(
          std::find(names->begin(), names->begin() + i, (*names)[i]) ==
              names->begin() + i,
          "Skippable expects each ",
          what,
          " name once, but got '",
          (*names)[i],
          "' twice in ",
          quoted_list(*names));
    }
  }
}

Skippable::~Skippable() = default;

Skippable& Skippable::isolate(
    const Namespace& ns, const std::vector<std::string>& only) {
  if (only.empty()) {
    for (const auto& name : stash_names_) {
      namespaces_.insert_or_assign(name, ns);
    }
    for (const auto& name : pop_names_) {
      namespaces_.insert_or_assign(name, ns);
    }
  } else {
    for (const auto& name : only) {
      TORCH_CHECK_VALUE(
          contains(stash_names_, name) || contains(pop_names_, name),
          "cannot isolate '",
          name,
          "': it is declared neither as stashable nor as poppable");
      namespaces_.insert_or_assign(name, ns);
    }
  }
  return *this;
}

SkipKey Skippable::key(const std::string& name) const {
  const auto it = namespaces_.find(name);
  return SkipKey{
      it == namespaces_.end() ? Namespace::global() : it->second, name};
}

std::vector<SkipKey> Skippable::stashable() const {
  std::vector<SkipKey> keys;
  for (const auto& name : stash_names_) {
    keys.push_back(key(name));
  }
  return keys;
}

std::vector<SkipKey> Skippable::poppable() const {
  std::vector<SkipKey> keys;
  for (const auto& name : pop_names_) {
    keys.push_back(key(name));
  }
  return keys;
}

void Skippable::stash(const std::string& name, torch::Tensor tensor) {
  TORCH_CHECK(
      contains(stash_names_, name),
      "'",
      name,
      "' has not been declared as stashable");
  detail::note_skip_use(this, name, /*stash=*/true);
  detail::current_skip_tracker().stash(key(name), std::move(tensor));
}

torch::Tensor Skippable::pop(const std::string& name) {
  TORCH_CHECK(
      contains(pop_names_, name),
      "'",
      name,
      "' has not been declared as poppable");
  detail::note_skip_use(this, name, /*stash=*/false);
  return detail::current_skip_tracker().pop(key(name));
}

const Skippable* as_skippable(const torch::nn::Module& module) {
  return dynamic_cast<const Skippable*>(&module);
}

void verify_skippables(const torch::nn::Sequential& module) {
  std::set<SkipKey> stashed;
  std::map<SkipKey, std::string> stashed_by;  // the first layer to declare it
  std::set<SkipKey> popped;
  std::vector<std::string> problems;
  for (const auto& child : module->named_children()) {
    const auto* layer = as_skippable(*child.value());
    if (layer == nullptr) {
      continue;
    }
    const auto& layer_name = child.key();
    for (const auto& name : layer->stashable_names()) {
      if (contains(layer->poppable_names(), name)) {
        problems.push_back(
            "'" + layer_name + "' declared '" + name +
            "' both as stashable and as poppable");
      }
    }
    for (const auto& key : layer->stashable()) {
      if (contains(layer->poppable_names(), key.name)) {
        continue;
      }
      stashed_by.emplace(key, layer_name);
      if (!stashed.insert(key).second) {
        problems.push_back(
            "'" + layer_name + "' redeclared '" + key.name +
            "' as stashable but not isolated by namespace");
      }
    }
    for (const auto& key : layer->poppable()) {
      if (contains(layer->stashable_names(), key.name)) {
        continue;
      }
      if (popped.count(key)) {
        problems.push_back(
            "'" + layer_name + "' redeclared '" + key.name +
            "' as poppable but not isolated by namespace");
        continue;
      }
      if (!stashed.count(key)) {
        problems.push_back(
            "'" + layer_name + "' declared '" + key.name +
            "' as poppable but it was not stashed");
        continue;
      }
      popped.insert(key);
    }
  }
  for (const auto& key : stashed) {
    if (!popped.count(key)) {
      problems.push_back(
          "no module declared '" + key.name +
          "' as poppable but stashed (declared stashable by '" +
          stashed_by.at(key) + "')");
    }
  }
  if (!problems.empty()) {
    std::string message = "one or more pairs of stash and pop do not match:\n";
    for (const auto& p : problems) {
      message += "\n* " + p;
    }
    TORCH_CHECK_TYPE(false, message);
  }
}

namespace detail {

namespace {

thread_local SkipTracker* installed_tracker = nullptr;

thread_local SkipUsage* current_usage = nullptr;

}  // namespace

void PlainSkipTracker::stash(const SkipKey& key, torch::Tensor tensor) {
  tensors_.insert_or_assign(key, std::move(tensor));
}

torch::Tensor PlainSkipTracker::pop(const SkipKey& key) {
  auto it = tensors_.find(key);
  TORCH_CHECK(it != tensors_.end(), "'", key.name, "' has not been stashed");
  auto tensor = std::move(it->second);
  tensors_.erase(it);
  return tensor;
}

PlainSkipTracker& plain_skip_tracker() {
  thread_local PlainSkipTracker plain;
  return plain;
}

SkipTracker& current_skip_tracker() {
  if (installed_tracker != nullptr) {
    return *installed_tracker;
  }
  return plain_skip_tracker();
}

SkipTrackerGuard::SkipTrackerGuard(SkipTracker* tracker)
    : previous_(installed_tracker) {
  installed_tracker = tracker;
}

SkipTrackerGuard::~SkipTrackerGuard() {
  installed_tracker = previous_;
}

void CellSkipTracker::stash(const SkipKey& key, torch::Tensor tensor) {
  if (routed_out_.count(key)) {
    outgoing_.insert_or_assign(key, std::move(tensor));
  } else {
    local_.insert_or_assign(key, std::move(tensor));
  }
}

torch::Tensor CellSkipTracker::pop(const SkipKey& key) {
  for (auto* table : {&local_, &incoming_}) {
    auto it = table->find(key);
    if (it != table->end()) {
      auto tensor = std::move(it->second);
      table->erase(it);
      return tensor;
    }
  }
  TORCH_CHECK(false, "'", key.name, "' has not been stashed");
}

SkipUsageGuard::SkipUsageGuard(const Skippable* layer)
    : usage_{layer, {}, {}}, previous_(current_usage) {
  current_usage = &usage_;
}

SkipUsageGuard::~SkipUsageGuard() {
  current_usage = previous_;
}

void SkipUsageGuard::check() const {
  const auto& usage = usage_;
  std::vector<std::string> not_stashed;
  for (const auto& name : usage.layer->stashable_names()) {
    if (!contains(usage.stashed, name)) {
      not_stashed.push_back(name);
    }
  }
  TORCH_CHECK(
      not_stashed.empty(),
      quoted_list(not_stashed),
      " must be stashed but have not");
  std::vector<std::string> not_popped;
  for (const auto& name : usage.layer->poppable_names()) {
    if (!contains(usage.popped, name)) {
      not_popped.push_back(name);
    }
  }
  TORCH_CHECK(
      not_popped.empty(),
      quoted_list(not_popped),
      " must be popped but have not");
}

void note_skip_use(
    const Skippable* layer, const std::string& name, bool stash) {
  if (current_usage != nullptr && current_usage->layer == layer) {
    (stash ? current_usage->stashed : current_usage->popped).push_back(name);
  }
}

SkipLayout::SkipLayout(const std::vector<torch::nn::Sequential>& partitions)
    : copy_policy_(partitions.size()), routed_out_(partitions.size()) {
  std::map<SkipKey, int64_t> stashed_in;
  for (const auto j : c10::irange(partitions.size())) {
    for (const auto& child : partitions[j]->children()) {
      const auto* layer = as_skippable(*child);
      if (layer == nullptr) {
        continue;
      }
      for (const auto& key : layer->stashable()) {
        stashed_in[key] = static_cast<int64_t>(j);
      }
      for (const auto& key : layer->poppable()) {
        const auto it = stashed_in.find(key);
        TORCH_INTERNAL_ASSERT(it != stashed_in.end(), "unverified skips");
        routes_[key] = {it->second, static_cast<int64_t>(j)};
      }
    }
  }
  for (const auto& [key, route] : routes_) {
    if (route.first != route.second) {
      copy_policy_[route.second].emplace_back(route.first, key);
      routed_out_[route.first].insert(key);
    }
  }
  for (auto& policy : copy_policy_) {
    std::sort(policy.begin(), policy.end());
  }
}

const std::vector<std::pair<int64_t, SkipKey>>& SkipLayout::copy_policy(
    int64_t j) const {
  return copy_policy_.at(j);
}

const std::set<SkipKey>& SkipLayout::routed_out(int64_t j) const {
  return routed_out_.at(j);
}

bool SkipLayout::requires_copy(const SkipKey& key) const {
  const auto it = routes_.find(key);
  return it != routes_.end() && it->second.first != it->second.second;
}

std::pair<int64_t, int64_t> SkipLayout::route(const SkipKey& key) const {
  const auto it = routes_.find(key);
  TORCH_CHECK_INDEX(it != routes_.end(), "no skip ", key, " in this model");
  return it->second;
}

bool SkipLayout::any_copy() const {
  for (const auto& policy : copy_policy_) {
    if (!policy.empty()) {
      return true;
    }
  }
  return false;
}

}  // namespace detail

int64_t clear_stashed_skips() {
  auto& plain = detail::plain_skip_tracker();
  const auto dropped = static_cast<int64_t>(plain.size());
  plain.clear();
  return dropped;
}

}  // namespace gpipe
