// Cells' own generators: one boxed kernel for every operator that takes a
// `Generator?` argument, at a dispatch key that the scope adds to its
// thread's dispatch keys. The kernel fills the argument with the cell's
// generator when the caller gave none, and dispatches on. Every other
// operator falls through the key. Registered once, from the dispatcher's
// own list of operators, so random operators LibTorch adds are covered
// without a list here.
//
// The key is a mode key above autograd that LibTorch registers nothing at
// (TESTING_ONLY_GenericMode: "generic mode", which is what the scope is;
// DispatchKey.h has no other free one in both 1.13 and 2.x). The key meant
// for custom generators, CustomRNGKeyId, is a backend key: the
// CompositeExplicitAutograd kernels of many operators answer at it, and a
// thread with it included paid about 0.8 us per operator (mm + add + relu
// on 16x16: 8.4 us against 6.2), where this one costs nothing measurable.

#include "cell_generator.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace gpipe::detail {

namespace {

constexpr auto kKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

thread_local at::Generator* cell_generator = nullptr;

bool is_generator(const c10::Argument& a) {
  const auto& type = a.type();
  return type->kind() == c10::TypeKind::OptionalType &&
         type->castRaw<c10::OptionalType>()->getElementType()->kind() ==
             c10::TypeKind::GeneratorType;
}

void draw_from_the_cell(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  if (cell_generator != nullptr) {
    const auto base = stack->size() - args.size();
    for (size_t k = 0; k < args.size(); ++k) {
      auto& value = (*stack)[base + k];
      if (value.isNone() && is_generator(args[k])) {
        value = c10::IValue(*cell_generator);
      }
    }
  }
  op.redispatchBoxed(keys.remove(kKey), stack);
}

bool register_kernels() {
  // Kept for the life of the process, and never destroyed: at exit the
  // dispatcher may go first.
  static torch::Library* fallthrough = nullptr;
  static torch::Library* kernels = nullptr;
  try {
    fallthrough =
        new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    fallthrough->fallback(torch::CppFunction::makeFallthrough());
    kernels = new torch::Library(
        torch::Library::IMPL, "aten", kKey, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("aten::", 0) != 0) {
        continue;
      }
      const auto op = dispatcher.findSchema(name);
      if (!op) {
        continue;
      }
      const auto& args = op->schema().arguments();
      const auto full =
          name.name.substr(6) +
          (name.overload_name.empty() ? "" : "." + name.overload_name);
      if (std::any_of(args.begin(), args.end(), is_generator)) {
        kernels->impl(
            full.c_str(),
            torch::CppFunction::makeFromBoxedFunction<&draw_from_the_cell>());
      }
    }
  } catch (const c10::Error&) {
    // Another library's fallback or kernels at this key.
    return false;
  }
  return true;
}

}  // namespace

bool cell_generators_available() {
  static const bool available = register_kernels();
  return available;
}

CellGeneratorScope::CellGeneratorScope(at::Generator cpu)
    : previous_(cell_generator),
      generator_(std::move(cpu)),
      included_before_(c10::impl::tls_is_dispatch_key_included(kKey)) {
  cell_generator = &generator_;
  c10::impl::tls_set_dispatch_key_included(kKey, true);
}

CellGeneratorScope::~CellGeneratorScope() {
  c10::impl::tls_set_dispatch_key_included(kKey, included_before_);
  cell_generator = previous_;
}

}  // namespace gpipe::detail
