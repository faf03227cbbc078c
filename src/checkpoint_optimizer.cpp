// A training checkpoint's optimizer state: see checkpoint_optimizer.h.

#include "checkpoint_optimizer.h"

#include <c10/util/irange.h>
#include <torch/optim.h>

#include <map>
#include <set>
#include <sstream>
#include <type_traits>
#include <unordered_map>

namespace gpipe::detail {

namespace {

// The key of a parameter in Optimizer::state(): its TensorImpl, as a string
// in LibTorch 1.x and as a pointer in 2.x.
[[maybe_unused]] std::string state_key(const torch::Tensor& p, std::string*) {
  std::ostringstream out;
  out << p.unsafeGetTensorImpl();
  return out.str();
}
[[maybe_unused]] void* state_key(const torch::Tensor& p, void**) {
  return p.unsafeGetTensorImpl();
}
template <typename Map>
auto key_in(const Map& map, const torch::Tensor& p) {
  using Key = typename std::decay_t<Map>::key_type;
  return state_key(p, static_cast<Key*>(nullptr));
}

torch::Tensor step_tensor(int64_t step) {
  return torch::tensor(step, torch::kLong);
}

// The saved fields of one parameter's state.
using Fields = std::map<std::string, torch::Tensor>;

template <typename State>
void put_moments(const State& s, Fields& fields) {
  fields["step"] = step_tensor(s.step());
  fields["exp_avg"] = s.exp_avg();
  fields["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) {
    fields["max_exp_avg_sq"] = s.max_exp_avg_sq();
  }
}

Fields fields_of(
    const std::string& kind, const torch::optim::OptimizerParamState& state) {
  using namespace torch::optim;
  Fields fields;
  if (kind == "SGD") {
    const auto& s = static_cast<const SGDParamState&>(state);
    if (s.momentum_buffer().defined()) {
      fields["momentum_buffer"] = s.momentum_buffer();
    }
  } else if (kind == "Adam") {
    put_moments(static_cast<const AdamParamState&>(state), fields);
  } else if (kind == "AdamW") {
    put_moments(static_cast<const AdamWParamState&>(state), fields);
  } else if (kind == "RMSprop") {
    const auto& s = static_cast<const RMSpropParamState&>(state);
    fields["step"] = step_tensor(s.step());
    fields["square_avg"] = s.square_avg();
    if (s.momentum_buffer().defined()) {
      fields["momentum_buffer"] = s.momentum_buffer();
    }
    if (s.grad_avg().defined()) {
      fields["grad_avg"] = s.grad_avg();
    }
  } else if (kind == "Adagrad") {
    const auto& s = static_cast<const AdagradParamState&>(state);
    fields["step"] = step_tensor(s.step());
    fields["sum"] = s.sum();
  }
  return fields;
}

// The fields each kind saves: those it always has, and those it may.
struct Schema {
  std::set<std::string> required;
  std::set<std::string> optional;
};
const Schema& schema_of(const std::string& kind) {
  static const std::map<std::string, Schema> schemas{
      {"SGD", {{}, {"momentum_buffer"}}},
      {"Adam", {{"step", "exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"}}},
      {"AdamW", {{"step", "exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"}}},
      {"RMSprop", {{"step", "square_avg"}, {"momentum_buffer", "grad_avg"}}},
      {"Adagrad", {{"step", "sum"}, {}}},
  };
  return schemas.at(kind);
}

// The fields a parameter's state needs under its group's `options`: those
// the kind always keeps, and those its options make it use (Adam's
// amsgrad, RMSprop's momentum and centering).
std::set<std::string> needed_fields(
    const std::string& kind, const torch::optim::OptimizerOptions& options) {
  using namespace torch::optim;
  auto needed = schema_of(kind).required;
  if (kind == "Adam" && static_cast<const AdamOptions&>(options).amsgrad()) {
    needed.insert("max_exp_avg_sq");
  }
  if (kind == "AdamW" && static_cast<const AdamWOptions&>(options).amsgrad()) {
    needed.insert("max_exp_avg_sq");
  }
  if (kind == "RMSprop") {
    const auto& o = static_cast<const RMSpropOptions&>(options);
    if (o.momentum() > 0) {
      needed.insert("momentum_buffer");
    }
    if (o.centered()) {
      needed.insert("grad_avg");
    }
  }
  return needed;
}

template <typename State>
std::unique_ptr<State> moments_from(Fields& f) {
  auto s = std::make_unique<State>();
  s->step(f.at("step").item<int64_t>());
  s->exp_avg(f.at("exp_avg"));
  s->exp_avg_sq(f.at("exp_avg_sq"));
  if (f.count("max_exp_avg_sq") > 0) {
    s->max_exp_avg_sq(f.at("max_exp_avg_sq"));
  }
  return s;
}

// A parameter's state made from its saved fields (already on its device).
std::unique_ptr<torch::optim::OptimizerParamState> state_from(
    const std::string& kind, Fields f) {
  using namespace torch::optim;
  if (kind == "SGD") {
    auto s = std::make_unique<SGDParamState>();
    if (f.count("momentum_buffer") > 0) {
      s->momentum_buffer(f.at("momentum_buffer"));
    }
    return s;
  }
  if (kind == "Adam") {
    return moments_from<AdamParamState>(f);
  }
  if (kind == "AdamW") {
    return moments_from<AdamWParamState>(f);
  }
  if (kind == "RMSprop") {
    auto s = std::make_unique<RMSpropParamState>();
    s->step(f.at("step").item<int64_t>());
    s->square_avg(f.at("square_avg"));
    if (f.count("momentum_buffer") > 0) {
      s->momentum_buffer(f.at("momentum_buffer"));
    }
    if (f.count("grad_avg") > 0) {
      s->grad_avg(f.at("grad_avg"));
    }
    return s;
  }
  TORCH_INTERNAL_ASSERT(kind == "Adagrad");
  auto s = std::make_unique<AdagradParamState>();
  s->step(f.at("step").item<int64_t>());
  s->sum(f.at("sum"));
  return s;
}

// Each parameter of `layers` by its TensorImpl, with its key.
using ParameterKeys = std::unordered_map<const c10::TensorImpl*, std::string>;
ParameterKeys parameter_keys(const IndexedLayers& layers) {
  std::unordered_map<const c10::TensorImpl*, std::string> keys;
  for (const auto& layer : layers) {
    for (const auto& p : layer.module->named_parameters()) {
      keys.emplace(
          p.value().unsafeGetTensorImpl(),
          "layers." + std::to_string(layer.index) + "." + p.key());
    }
  }
  return keys;
}

// The key of the optimizer's parameter `p` among `keys`; `call` names the
// function for the error when it is none of the model's.
const std::string& key_of(
    const ParameterKeys& keys, const torch::Tensor& p, const char* call) {
  auto key = keys.find(p.unsafeGetTensorImpl());
  TORCH_CHECK_VALUE(
      key != keys.end(),
      "the optimizer holds a parameter of shape ",
      p.sizes(),
      " that is not one of the model's parameters (a PipelineStage's are its "
      "own partitions': build its optimizer from stage->parameters(), not "
      "from the whole Sequential's): give ",
      call,
      " the optimizer of the model's parameters");
  return key->second;
}

}  // namespace

std::string optimizer_kind(const torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  if (dynamic_cast<const SGD*>(&optimizer) != nullptr) {
    return "SGD";
  }
  if (dynamic_cast<const Adam*>(&optimizer) != nullptr) {
    return "Adam";
  }
  if (dynamic_cast<const AdamW*>(&optimizer) != nullptr) {
    return "AdamW";
  }
  if (dynamic_cast<const RMSprop*>(&optimizer) != nullptr) {
    return "RMSprop";
  }
  if (dynamic_cast<const Adagrad*>(&optimizer) != nullptr) {
    return "Adagrad";
  }
  TORCH_CHECK_VALUE(
      false,
      "a checkpoint holds the state of SGD, Adam, AdamW, RMSprop or Adagrad, "
      "but the optimizer is another kind");
}

NamedTensors optimizer_tensors(
    const IndexedLayers& layers, const torch::optim::Optimizer& optimizer) {
  NamedTensors tensors;
  const auto kind = optimizer_kind(optimizer);
  const auto keys = parameter_keys(layers);
  const auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto& key = key_of(keys, p, "save_checkpoint");
      auto state = states.find(key_in(states, p));
      if (state == states.end()) {
        continue;  // no step yet
      }
      for (auto& [field, value] : fields_of(kind, *state->second)) {
        tensors.emplace_back("optimizer." + key + "." + field, value);
      }
    }
  }
  return tensors;
}

std::function<void()> plan_optimizer_load(
    CheckpointReader& reader,
    const IndexedLayers& layers,
    torch::optim::Optimizer& optimizer) {
  const auto& manifest = reader.manifest();
  const auto& where = reader.path();
  // The optimizer's state of each of its parameters, made beforehand.
  struct Placed {
    torch::Tensor param;
    std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: none
  };
  auto placed = std::make_shared<std::vector<Placed>>();
  const auto kind = optimizer_kind(optimizer);
  const auto saved = manifest.value("optimizer", std::string());
  TORCH_CHECK_VALUE(
      saved == kind,
      "the checkpoint in '",
      where,
      "' holds the state of ",
      saved.empty() ? std::string("no optimizer") : saved,
      ", but the optimizer is ",
      kind);
  const auto keys = parameter_keys(layers);
  const auto& schema = schema_of(kind);
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto prefix =
          "optimizer." + key_of(keys, p, "load_checkpoint") + ".";
      Fields fields;
      for (const auto& name : reader.keys_with_prefix(prefix)) {
        const auto field = name.substr(prefix.size());
        TORCH_CHECK_VALUE(
            schema.required.count(field) + schema.optional.count(field) > 0,
            "the checkpoint in '",
            where,
            "' has '",
            name,
            "', which ",
            kind,
            " does not keep");
        auto from = reader.tensor(name);
        if (field != "step") {
          TORCH_CHECK_VALUE(
              from.sizes() == p.sizes(),
              "the checkpoint in '",
              where,
              "' has '",
              name,
              "' of shape ",
              from.sizes(),
              ", but the parameter's is ",
              p.sizes());
          from = from.to(p.device(), p.scalar_type(), false, true);
        } else {
          from = from.clone();
        }
        fields[field] = from;
      }
      // No state: no step was taken for it (Adagrad, which keeps one for
      // every parameter from the start, must have one).
      if (fields.empty() && kind != "Adagrad") {
        placed->push_back(Placed{p, nullptr});
        continue;
      }
      for (const auto& field : needed_fields(kind, group.options())) {
        TORCH_CHECK_VALUE(
            fields.count(field) > 0,
            "the checkpoint in '",
            where,
            "' has no '",
            prefix + field,
            "', which ",
            kind,
            " needs with the optimizer's options");
      }
      placed->push_back(Placed{p, state_from(kind, std::move(fields))});
    }
  }
  return [placed, &optimizer]() {
    auto& states = optimizer.state();
    for (auto& entry : *placed) {
      auto key = key_in(states, entry.param);
      if (entry.state) {
        states[key] = std::move(entry.state);
      } else {
        states.erase(key);
      }
    }
  };
}

}  // namespace gpipe::detail
