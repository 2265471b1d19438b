// The torch ops of lmoe (TORCH_LIBRARY(lmoe)): a registry of LatentTails held by integer handles,
// the tail's forward on the caller's tensors and stream, and the library's reference for tests.
// Errors of the library leave as std::runtime_error whose text starts with kErrorMarker, which the
// Python package turns into lmoe.Error.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "c10d_communicator.hpp"
#include "device_support.hpp"
#include "lmoe/comm_group.hpp"
#include "lmoe/error.hpp"
#include "lmoe/latent_tail.hpp"
#include "lmoe/reference.hpp"
#include "lmoe/settings.hpp"
#include "lmoe/threads_communicator.hpp"
#include "lmoe/tier_policy.hpp"
#include "runtime/rank_agreement.hpp"

namespace lmoe::python {
namespace {

constexpr const char* kErrorMarker = "lmoe::Error: ";

template <typename Body>
auto translated(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const Error& error) {
    throw std::runtime_error(kErrorMarker + error.message());
  }
}

std::string torch_dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    case at::kDouble: return "f64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return c10::toString(type);
  }
}

std::optional<DType> lmoe_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::f32;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    default: return std::nullopt;
  }
}

std::string shape_of(const at::Tensor& tensor) {
  std::string text = "[";
  for (std::int64_t i = 0; i < tensor.dim(); ++i)
    text += (i ? ", " : "") + std::to_string(tensor.size(i));
  return text + "]";
}

std::string device_of(const c10::Device& device) { return device.str(); }

// The view of a 2-D tensor of the tail's dtype and device with unit stride along its rows, or why
// not; the library checks shapes, row strides and overlaps.
std::optional<std::string> to_view(const char* name, const at::Tensor& tensor, DType dtype,
                                   const c10::Device& device, MatrixView& view) {
  const std::string who(name);
  if (!tensor.defined()) return who + ": expected a tensor, got None";
  if (lmoe_dtype(tensor.scalar_type()) != dtype) {
    return who + ": expected dtype " + std::string(dtype_name(dtype)) + ", got " +
           torch_dtype_name(tensor.scalar_type());
  }
  if (tensor.device() != device) {
    return who + ": expected a tensor on " + device_of(device) +
           " (where the tail was built), got " + device_of(tensor.device());
  }
  if (tensor.dim() != 2) {
    return who + ": expected a 2-D tensor, got " + std::to_string(tensor.dim()) + "-D " +
           shape_of(tensor);
  }
  if (tensor.size(1) > 1 && tensor.size(0) > 0 && tensor.stride(1) != 1) {
    return who + ": expected unit stride along the last dimension, got strides [" +
           std::to_string(tensor.stride(0)) + ", " + std::to_string(tensor.stride(1)) + "]";
  }
  view.data = tensor.data_ptr();
  view.dtype = dtype;
  view.rows = tensor.size(0);
  view.cols = tensor.size(1);
  view.ld = tensor.size(0) > 1 ? tensor.stride(0) : tensor.size(1);
  view.space = tensor.is_cuda() ? MemorySpace::device : MemorySpace::host;
  return std::nullopt;
}

// Whether `tensor` is the one the tail copied at construction (same memory, shape and dtype).
struct BoundWeight {
  const void* data = nullptr;
  std::vector<std::int64_t> shape;
  at::ScalarType type = at::kFloat;

  static BoundWeight of(const at::Tensor& tensor) {
    return {tensor.data_ptr(), tensor.sizes().vec(), tensor.scalar_type()};
  }
  bool matches(const at::Tensor& tensor) const {
    return tensor.defined() && tensor.data_ptr() == data && tensor.sizes().vec() == shape &&
           tensor.scalar_type() == type;
  }
};

struct TailState {
  std::shared_ptr<Communicator> host_comm;  // the group's ranks (c10d), or one rank
  std::shared_ptr<Communicator> comm;       // what the tail runs over (host_comm on CPU)
  std::unique_ptr<LatentTail> tail;
  DType dtype = DType::bf16;
  c10::Device device{c10::kCPU};
  BoundWeight norm_weight, up_proj_weight;
};

std::mutex registry_mutex;
std::map<std::int64_t, std::shared_ptr<TailState>> registry;
std::int64_t next_handle = 1;

std::shared_ptr<TailState> find_tail(std::int64_t handle) {
  std::lock_guard lock(registry_mutex);
  const auto found = registry.find(handle);
  LMOE_CHECK(found != registry.end(),
             "tail: no lmoe tail has handle " + std::to_string(handle) + " (destroyed?)");
  return found->second;
}

// Raises `error` on every rank: the ranks that found nothing wrong are in the same exchange
// (LatentTail's agreement on a configuration or a call), so all of them raise it too.
[[noreturn]] void fail_on_every_rank(Communicator& comm, const std::string& error) {
  if (comm.size() > 1) {
    RankRecord mine;
    mine.ok = 0;
    set_text(mine, error);
    throw_if_ranks_disagree(exchange(comm, mine), "configuration");
  }
  throw Error(error);
}

// The agreement of the group's ranks on what only the binding checks, before the library's own.
void agree_on_binding(Communicator& comm, const std::optional<std::string>& error) {
  if (comm.size() == 1) {
    if (error) throw Error(*error);
    return;
  }
  RankRecord mine;
  mine.ok = error ? 0 : 1;
  set_text(mine, error.value_or("binding checks passed"));
  const std::vector<RankRecord> all = exchange(comm, mine);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].ok) throw Error("rank " + std::to_string(r) + ": " + all[r].text);
}

std::int64_t tail_create(const std::string& group_name, std::int64_t d_model, std::int64_t d_latent,
                         const std::string& dtype_text, double eps, bool latent_norm,
                         std::int64_t max_tokens, const std::optional<std::string>& tier_table,
                         const at::Tensor& norm_weight, const at::Tensor& up_proj_weight,
                         const std::string& comm_name) {
  return translated([&] {
    auto state = std::make_shared<TailState>();
    state->host_comm = group_name.empty() ? make_thread_communicators(1).front()
                                          : make_c10d_communicator(group_name);
    std::optional<std::string> error;
    try {
      state->dtype = parse_dtype(dtype_text);
    } catch (const Error& bad) {
      error = "dtype: " + bad.message();
    }
    if (!error && !norm_weight.defined()) error = "norm_weight: expected a tensor, got None";
    if (!error && !up_proj_weight.defined()) error = "up_proj_weight: expected a tensor, got None";
    if (!error) {
      state->device = up_proj_weight.device();
      if (!state->device.is_cpu() && !state->device.is_cuda())
        error = "up_proj_weight: expected a cpu or cuda tensor, got " + device_of(state->device);
    }
    at::Tensor norm_host, up_host;
    MatrixView norm_view, up_view;
    if (!error) {
      // The library copies host weights; a 1-D gamma is one row.
      norm_host = norm_weight.reshape({1, -1}).to(at::kCPU).contiguous();
      up_host = up_proj_weight.to(at::kCPU).contiguous();
      error = to_view("norm_weight", norm_host, state->dtype, c10::Device(c10::kCPU), norm_view);
    }
    if (!error)
      error = to_view("up_proj_weight", up_host, state->dtype, c10::Device(c10::kCPU), up_view);
    if (!error && norm_weight.device() != state->device) {
      error = "norm_weight: expected a tensor on " + device_of(state->device) +
              " (where up_proj_weight is), got " + device_of(norm_weight.device());
    }
    PolicyConfig policy;
    if (!error) {
      try {
        policy = load_policy_config(process_environment(), tier_table);
      } catch (const Error& bad) {
        error = bad.message();
      }
    }
    agree_on_binding(*state->host_comm, error);

    TailOptions options;
    options.dims = {d_model, d_latent};
    options.rms_norm_eps = static_cast<float>(eps);
    options.latent_norm = latent_norm;
    options.dtype = state->dtype;
    options.backend = state->device.is_cuda() ? Backend::cuda : Backend::cpu;
    options.policy = std::move(policy);
    options.max_tokens = max_tokens;
    state->comm = state->device.is_cuda() ? make_device_communicator(
                                                *state->host_comm, state->device.index(), comm_name)
                                          : state->host_comm;
    state->tail = std::make_unique<LatentTail>(options, *state->comm, norm_view, up_view);
    state->norm_weight = BoundWeight::of(norm_weight);
    state->up_proj_weight = BoundWeight::of(up_proj_weight);
    std::lock_guard lock(registry_mutex);
    const std::int64_t handle = next_handle++;
    registry[handle] = std::move(state);
    return handle;
  });
}

void tail_destroy(std::int64_t handle) {
  std::lock_guard lock(registry_mutex);
  registry.erase(handle);
}

std::string tail_explain(std::int64_t handle, std::int64_t num_tokens) {
  return translated([&] { return find_tail(handle)->tail->explain(num_tokens); });
}

// The tier the policy picks for T (empty when none can run).
std::string tail_decide(std::int64_t handle, std::int64_t num_tokens) {
  return translated([&] {
    const TierDecision decision = find_tail(handle)->tail->decide(num_tokens);
    return decision.tier ? std::string(tier_name(*decision.tier)) : std::string();
  });
}

std::vector<std::int64_t> tail_info(std::int64_t handle) {
  return translated([&] {
    const std::shared_ptr<TailState> state = find_tail(handle);
    return std::vector<std::int64_t>{state->tail->tp_rank(), state->tail->tp_size()};
  });
}

void tail_forward(std::int64_t handle, const at::Tensor& routed, const at::Tensor& shared,
                  const at::Tensor& norm_weight, const at::Tensor& up_proj_weight,
                  const at::Tensor& out, const std::string& tier_text) {
  translated([&] {
    const std::shared_ptr<TailState> state = find_tail(handle);
    std::optional<std::string> error;
    std::optional<TailTier> tier;
    try {
      tier = parse_tier_or_auto(tier_text);
    } catch (const Error& bad) {
      error = "tier: " + bad.message();
    }
    MatrixView routed_view, shared_view, out_view;
    if (!error) error = to_view("routed", routed, state->dtype, state->device, routed_view);
    if (!error) error = to_view("shared", shared, state->dtype, state->device, shared_view);
    if (!error) error = to_view("out", out, state->dtype, state->device, out_view);
    if (!error && !state->norm_weight.matches(norm_weight)) {
      error =
          "norm_weight: expected the tensor this tail was built with (it holds a copy; "
          "rebuild the tail with load_weights() for other weights)";
    }
    if (!error && !state->up_proj_weight.matches(up_proj_weight)) {
      error =
          "up_proj_weight: expected the tensor this tail was built with (it holds a copy; "
          "rebuild the tail with load_weights() for other weights)";
    }
    if (error) fail_on_every_rank(*state->comm, *error);
    state->tail->forward(routed_view, shared_view, out_view, tier, current_stream(routed));
  });
}

// Every rank's inputs as one TailCase: routed [tp, T, l], shared [tp, T, d], host tensors of
// one dtype; `op` names the caller in errors.
TailCase tail_case_of(const char* op, const at::Tensor& routed, const at::Tensor& shared,
                      const at::Tensor& norm_weight, const at::Tensor& up_proj_weight, double eps,
                      bool latent_norm, const at::Tensor& out) {
  const std::string name = op;
  LMOE_CHECK(routed.dim() == 3 && shared.dim() == 3 && out.dim() == 2,
             name + ": expected routed [tp, T, l], shared [tp, T, d] and out [T, d]");
  const auto dtype = lmoe_dtype(routed.scalar_type());
  LMOE_CHECK(dtype, name + ": expected f32, f16 or bf16 tensors");
  LMOE_CHECK(out.is_cpu() && out.is_contiguous() && out.scalar_type() == routed.scalar_type() &&
                 out.size(0) == routed.size(1) && out.size(1) == shared.size(2),
             name + ": out must be a contiguous cpu tensor [T, d] of routed's dtype");
  TailCase c;
  c.dims = {shared.size(2), routed.size(2)};
  c.eps = static_cast<float>(eps);
  c.latent_norm = latent_norm;
  c.dtype = *dtype;
  c.tp = static_cast<int>(routed.size(0));
  c.num_tokens = routed.size(1);
  const auto fill = [&](HostTensor& target, const at::Tensor& source) {
    const at::Tensor host = source.to(at::kCPU).contiguous();
    LMOE_CHECK(host.scalar_type() == routed.scalar_type(),
               name + ": every tensor must have routed's dtype");
    target = HostTensor(*dtype, host.sizes().vec());
    LMOE_CHECK(target.nbytes() == host.nbytes(), name + ": sizes disagree");
    std::memcpy(target.data(), host.data_ptr(), target.nbytes());
  };
  fill(c.routed, routed);
  fill(c.shared, shared);
  fill(c.norm_weight, norm_weight.reshape({-1}));
  fill(c.up_proj_weight, up_proj_weight);
  return c;
}

// The library's reference (lmoe/reference.hpp) from every rank's inputs; contract
// "reduce_then_add" (fused, overlap, token) or "column".
void reference_tail_op(const at::Tensor& routed, const at::Tensor& shared,
                       const at::Tensor& norm_weight, const at::Tensor& up_proj_weight, double eps,
                       bool latent_norm, const std::string& contract, const at::Tensor& out) {
  translated([&] {
    const TailCase c = tail_case_of("reference_tail", routed, shared, norm_weight, up_proj_weight,
                                    eps, latent_norm, out);
    const Contract which = contract == "column" ? Contract::column : Contract::reduce_then_add;
    const ContractReference reference = reference_tail(c, which);
    std::memcpy(out.data_ptr(), reference.y.data(), reference.y.nbytes());
  });
}

// The C++ library's own result for `tier` from every rank's inputs: its cpu backend on tp threads
// (the `threads` communicator), rank 0's output. What the ops must equal bit for bit over any
// exact communicator, whatever the host GEMM's summation order.
void library_tail_op(const at::Tensor& routed, const at::Tensor& shared,
                     const at::Tensor& norm_weight, const at::Tensor& up_proj_weight, double eps,
                     bool latent_norm, const std::string& tier_text, const at::Tensor& out) {
  translated([&] {
    // The column tier accumulates into each rank's shared slice: c is this call's own copy.
    TailCase c = tail_case_of("library_tail", routed, shared, norm_weight, up_proj_weight, eps,
                              latent_norm, out);
    const std::optional<TailTier> tier = parse_tier_or_auto(tier_text);
    TailOptions options;
    options.dims = c.dims;
    options.rms_norm_eps = c.eps;
    options.latent_norm = c.latent_norm;
    options.dtype = c.dtype;
    std::vector<HostTensor> outs(static_cast<std::size_t>(c.tp));
    run_comm_group("threads", c.tp, [&](int rank, Communicator& comm) {
      LatentTail tail(options, comm, c.norm_weight.matrix(), c.up_proj_weight.matrix());
      HostTensor& mine = outs[static_cast<std::size_t>(rank)];
      mine = HostTensor(c.dtype, {c.num_tokens, c.dims.d_model});
      tail.forward(c.routed.slice_matrix(rank), c.shared.slice_matrix(rank), mine.matrix(), tier);
    });
    std::memcpy(out.data_ptr(), outs[0].data(), outs[0].nbytes());
  });
}

}  // namespace
}  // namespace lmoe::python

TORCH_LIBRARY(lmoe, m) {
  using namespace lmoe::python;
  m.def(
      "tail_create(str group_name, int d_model, int d_latent, str dtype, float eps, "
      "bool latent_norm, int max_tokens, str? tier_table, Tensor norm_weight, "
      "Tensor up_proj_weight, str comm) -> int",
      &tail_create);
  m.def("tail_destroy(int tail) -> ()", &tail_destroy);
  m.def("tail_explain(int tail, int num_tokens) -> str", &tail_explain);
  m.def("tail_decide(int tail, int num_tokens) -> str", &tail_decide);
  m.def("tail_info(int tail) -> int[]", &tail_info);
  // shared: the column tier accumulates into it; out: the caller allocates it ([T, d]).
  m.def(
      "tail_forward(int tail, Tensor routed, Tensor(a!) shared, Tensor norm_weight, "
      "Tensor up_proj_weight, Tensor(b!) out, str tier=\"auto\") -> ()");
  m.def(
      "reference_tail(Tensor routed, Tensor shared, Tensor norm_weight, Tensor up_proj_weight, "
      "float eps, bool latent_norm, str contract, Tensor(a!) out) -> ()");
  m.def(
      "library_tail(Tensor routed, Tensor shared, Tensor norm_weight, Tensor up_proj_weight, "
      "float eps, bool latent_norm, str tier, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lmoe, CPU, m) {
  m.impl("tail_forward", &lmoe::python::tail_forward);
  m.impl("reference_tail", &lmoe::python::reference_tail_op);
  m.impl("library_tail", &lmoe::python::library_tail_op);
}

TORCH_LIBRARY_IMPL(lmoe, CUDA, m) { m.impl("tail_forward", &lmoe::python::tail_forward); }
