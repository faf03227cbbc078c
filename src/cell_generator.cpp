// Cells' own generators: one boxed kernel for every operator that takes a
// `Generator?` argument, at DispatchKey::CustomRNGKeyId, which the scope
// adds to its thread's dispatch keys. The kernel fills the argument with the
// cell's generator when the caller gave none, and dispatches on. Every
// other operator falls through the key (a fallback, and for operators with
// a CompositeExplicitAutograd kernel, which would otherwise answer at this
// key as at every backend's, a kernel that passes the call on). Registered
// once, from the dispatcher's own list of operators, so random operators
// LibTorch adds are covered without a list here.

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
  op.redispatchBoxed(keys.remove(c10::DispatchKey::CustomRNGKeyId), stack);
}

void pass_on(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  op.redispatchBoxed(keys.remove(c10::DispatchKey::CustomRNGKeyId), stack);
}

bool register_kernels() {
  // Kept for the life of the process, as TORCH_LIBRARY_IMPL's are.
  static std::unique_ptr<torch::Library> fallthrough;
  static std::unique_ptr<torch::Library> kernels;
  try {
    fallthrough = std::make_unique<torch::Library>(
        torch::Library::IMPL,
        "_",
        c10::DispatchKey::CustomRNGKeyId,
        __FILE__,
        __LINE__);
    fallthrough->fallback(torch::CppFunction::makeFallthrough());
    kernels = std::make_unique<torch::Library>(
        torch::Library::IMPL,
        "aten",
        c10::DispatchKey::CustomRNGKeyId,
        __FILE__,
        __LINE__);
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
      } else if (
          op->hasKernelForDispatchKey(
              c10::DispatchKey::CompositeExplicitAutograd) ||
          op->hasKernelForDispatchKey(
              c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
        // A CompositeExplicitAutograd kernel answers for every backend key,
        // this one too, and would run in place of the CPU kernel: on past it
        // (a kernel, not a fallthrough, which redispatch would not skip).
        kernels->impl(
            full.c_str(),
            torch::CppFunction::makeFromBoxedFunction<&pass_on>());
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
      included_before_(c10::impl::tls_is_dispatch_key_included(
          c10::DispatchKey::CustomRNGKeyId)) {
  cell_generator = &generator_;
  c10::impl::tls_set_dispatch_key_included(
      c10::DispatchKey::CustomRNGKeyId, true);
}

CellGeneratorScope::~CellGeneratorScope() {
  c10::impl::tls_set_dispatch_key_included(
      c10::DispatchKey::CustomRNGKeyId, included_before_);
  cell_generator = previous_;
}

}  // namespace gpipe::detail
