#pragma once
// Autocast (apex O1, torch.autocast): inside an AutocastGuard, each op casts its floating inputs by the
// precision rule of its category before running. The rules are the table kCastRules below; each op applies
// its rule with one macro on its first line:
//
//   Tensor matmul(const Tensor& a, const Tensor& b) {
//     HG_AUTOCAST(matmul, a, b);   // rule looked up in kCastRules at compile time
//     ...
//
// Under autocast the macro casts the inputs and calls the op again with autocast out of the way (ops the op
// calls internally, and backward passes, are not autocast again).
#include <string_view>
#include <type_traits>
#include <utility>

#include "core/tensor.h"

namespace halfgrad::amp {

enum class CastRule {
  LowerPrecision,  // run in the autocast dtype (float16/bfloat16): tensor-core ops
  Float32,         // run in float32: ops whose range or accuracy float16 cannot hold
  Float32Math,     // as Float32, without the float32 copy: the op takes float16/bfloat16 inputs as they are, widens
                   // each element as it reads it, and returns float32 (it asks amp::result_dtype)
  Promote,         // run in the widest floating dtype among the inputs (a 0-d one counts where no floating input has
                   // dims): mixed binary ops
  Unchanged,       // run in whatever dtype arrives
};
const char* rule_name(CastRule rule);

// kCastRules as a Markdown table, one row per category in the order above ("| lower precision | matmul, linear, ...
// |"): the table docs/mixed_precision.md carries between its "cast-table" markers (a test compares the two), and what
// `halfgrad info --cast-table` prints.
std::string cast_table_markdown();

// ---- The casting table: every op that autocast knows, and its category.
struct OpRule {
  std::string_view op;
  CastRule rule;
};
inline constexpr OpRule kCastRules[] = {
    // lower precision: the matrix products that tensor cores run
    {"matmul", CastRule::LowerPrecision}, {"linear", CastRule::LowerPrecision}, {"bmm", CastRule::LowerPrecision},
    {"conv2d", CastRule::LowerPrecision}, {"rnn", CastRule::LowerPrecision},
    // float32: exponentials, powers, softmax, losses and sum-like reductions
    {"exp", CastRule::Float32}, {"log", CastRule::Float32}, {"pow", CastRule::Float32}, {"rsqrt", CastRule::Float32},
    {"softmax", CastRule::Float32}, {"log_softmax", CastRule::Float32},
    {"mse_loss", CastRule::Float32}, {"cross_entropy", CastRule::Float32Math}, {"nll_loss", CastRule::Float32},
    {"binary_cross_entropy_with_logits", CastRule::Float32},
    {"sum", CastRule::Float32}, {"mean", CastRule::Float32}, {"var", CastRule::Float32},
    {"std", CastRule::Float32}, {"layer_norm", CastRule::Float32}, {"cumsum", CastRule::Float32},
    // promote: mixed inputs run in the widest of them (a 0-d one beside tensors with dims counts as a number)
    {"add", CastRule::Promote}, {"sub", CastRule::Promote}, {"mul", CastRule::Promote}, {"div", CastRule::Promote},
    {"maximum", CastRule::Promote}, {"minimum", CastRule::Promote}, {"where", CastRule::Promote},
    {"cat", CastRule::Promote}, {"stack", CastRule::Promote}, {"scatter_add", CastRule::Promote},
    // unchanged (listed so the trace can name them): activations, pooling, views and the rest
    {"relu", CastRule::Unchanged}, {"tanh", CastRule::Unchanged}, {"sigmoid", CastRule::Unchanged},
    {"gelu", CastRule::Unchanged}, {"silu", CastRule::Unchanged}, {"erf", CastRule::Unchanged},
    {"neg", CastRule::Unchanged}, {"abs", CastRule::Unchanged}, {"sqrt", CastRule::Unchanged},
    {"clamp", CastRule::Unchanged}, {"max_pool2d", CastRule::Unchanged},
    {"avg_pool2d", CastRule::Unchanged}, {"adaptive_avg_pool2d", CastRule::Unchanged},
    {"dropout", CastRule::Unchanged}, {"embedding", CastRule::Unchanged}, {"max", CastRule::Unchanged},
    {"min", CastRule::Unchanged}, {"amax", CastRule::Unchanged}, {"amin", CastRule::Unchanged},
    {"argmax", CastRule::Unchanged}, {"gather", CastRule::Unchanged}, {"scatter", CastRule::Unchanged},
    {"pad", CastRule::Unchanged},
    // BatchNorm: half activations with float32 parameters and statistics (the op handles the mix itself)
    {"batch_norm", CastRule::Unchanged}, {"batch_norm_relu", CastRule::Unchanged},
};

consteval CastRule cast_rule(std::string_view op) {
  for (const OpRule& r : kCastRules)
    if (r.op == op) return r.rule;
  throw "op missing from halfgrad::amp::kCastRules";  // a compile error: every op must have a category
}

// ---- The guard
// Thread-local and nestable: an inner guard may switch autocast off (enabled = false) or change the dtype.
// Casts of float32 leaf parameters are cached until the outermost guard ends (one cast per weight per forward), and
// their values kept beyond it (below).
class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype = kFloat16, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
};

bool is_autocast_enabled();
DType autocast_dtype();
// The result dtype of a Float32Math op given inputs of dtype `input`: float32 when autocast handed the call to the op
// and `input` is float16 or bfloat16, else `input` (outside autocast the op keeps its inputs' dtype, as PyTorch's).
DType result_dtype(DType input);
size_t autocast_cache_size();  // cached parameter casts held now

// ---- Parameter casts kept across regions
// A float32 parameter's cast is kept after its region ends (the values, held by the parameter), and a later region
// takes it instead of casting again while the parameter's version counter is unchanged. The fused optimizer steps
// write the cast of each new value beside the value (Optimizer::step_items, optim/fused.cpp and fused.cu), so a
// training step's forward casts no weight: ResNet-18 launches 22 cast kernels fewer a step. Any other write, or a
// step that cannot write the cast (it is laid out otherwise than the parameter, or held elsewhere as well), leaves it
// stale, and the next region casts afresh; so does each replay of a CUDA graph that writes the parameter, unless the
// graph writes the cast too. Regions of several threads may cast one model's weights at once. On by default; the casts
// then stay in memory between steps (2 bytes a parameter). Off, every region casts again, and each parameter's kept
// cast goes at its next cast.
void set_keep_parameter_casts(bool keep);
bool keep_parameter_casts();
// For an optimizer about to write `param` in place: its kept cast if that is current and held by the parameter alone,
// else undefined.
Tensor kept_cast(const Tensor& param);
// After bumping param's version for a step that writes `cast` (what kept_cast(param) gave) too: the cast is current
// again, unless the parameter holds another one by now; inside a CUDA graph capture, after each replay too.
void keep_cast_current(const Tensor& param, const Tensor& cast);

// ---- The trace (teaching aid): logs each op with its input and output dtypes and the rule that decided them.
// On inside a TraceGuard, or for the whole run with HALFGRAD_AMP_TRACE=1.
class TraceGuard {
 public:
  TraceGuard();
  ~TraceGuard();

 private:
  bool prev_;
};
bool is_tracing();
// Receives each trace line as well as the log (for tests and tools); empty function to remove.
void set_trace_sink(std::function<void(const std::string&)> sink);

namespace detail {
bool should_apply(CastRule rule);  // autocast (or tracing) is on and this op is not already being handled

class ApplyingGuard {  // marks the inner call of an op that autocast handled; `float32_math`: under Float32Math
 public:
  explicit ApplyingGuard(bool float32_math = false);
  ~ApplyingGuard();

 private:
  bool prev_, prev_float32_math_;
};

DType target_dtype(CastRule rule, DType widest_floating);  // the dtype inputs are cast to under autocast
Tensor cast(const Tensor& t, DType target);  // floating, non-float64 tensors only; parameter casts cached
void trace(const char* op, CastRule rule, const std::vector<DType>& inputs, const std::vector<DType>& outputs);

// The widest floating dtype among the inputs with dims, or among the 0-d ones where there are none: a 0-d tensor
// beside a tensor with dims is read as a number is (promote_types with zero_dim flags): float16 * 0-d float32 stays
// float16.
struct Widest {
  DType with_dims = kFloat32, zero_dim = kFloat32;
  bool any_with_dims = false, any_zero_dim = false;
  DType get() const { return any_with_dims ? with_dims : zero_dim; }
};
template <typename T> void widest(const T& arg, Widest& w) {
  if constexpr (std::is_same_v<T, Tensor>) {
    if (arg.defined() && arg.is_floating_point()) {
      DType& acc = arg.dim() == 0 ? w.zero_dim : w.with_dims;
      bool& any = arg.dim() == 0 ? w.any_zero_dim : w.any_with_dims;
      acc = any ? promote_types(acc, arg.dtype()) : arg.dtype();
      any = true;
    }
  } else if constexpr (std::is_same_v<T, TensorList>) {
    for (const Tensor& t : arg) widest(t, w);
  }
}

template <typename T> void collect_dtypes(const T& arg, std::vector<DType>& out) {
  if constexpr (std::is_same_v<T, Tensor>) {
    if (arg.defined()) out.push_back(arg.dtype());
  } else if constexpr (std::is_same_v<T, TensorList>) {
    for (const Tensor& t : arg) collect_dtypes(t, out);
  } else if constexpr (requires { arg.first; arg.second; }) {
    collect_dtypes(arg.first, out);
    collect_dtypes(arg.second, out);
  } else if constexpr (requires { arg.tensors(); }) {  // a result struct of several tensors (RnnResult)
    collect_dtypes(arg.tensors(), out);
  }
}

template <typename T> T cast_arg(const T& arg, CastRule rule, DType target) {
  if (rule == CastRule::Unchanged || rule == CastRule::Float32Math) return arg;
  if constexpr (std::is_same_v<T, Tensor>) {
    return cast(arg, target);
  } else if constexpr (std::is_same_v<T, TensorList>) {
    TensorList out;
    for (const Tensor& t : arg) out.push_back(cast(t, target));
    return out;
  } else {
    return arg;
  }
}

template <typename F, typename... Args> auto apply(CastRule rule, const char* op, F&& f, const Args&... args) {
  // With only the trace on, nothing is cast: tracing must not change what runs.
  CastRule effective = is_autocast_enabled() ? rule : CastRule::Unchanged;
  ApplyingGuard applying(effective == CastRule::Float32Math);
  Widest wide;
  (widest(args, wide), ...);
  DType target = target_dtype(rule, wide.get());
  auto result = f(cast_arg(args, effective, target)...);
  if (is_tracing()) {
    std::vector<DType> in, out;
    (collect_dtypes(args, in), ...);
    collect_dtypes(result, out);
    trace(op, rule, in, out);
  }
  return result;
}
}  // namespace detail

}  // namespace halfgrad::amp

// The first line of every op that has a precision rule. OP is the op's name in kCastRules and the function
// to call again with the cast arguments.
#define HG_AUTOCAST(OP, ...)                                                                        \
  do {                                                                                              \
    constexpr ::halfgrad::amp::CastRule hg_rule = ::halfgrad::amp::cast_rule(#OP);                  \
    if (::halfgrad::amp::detail::should_apply(hg_rule))                                             \
      return ::halfgrad::amp::detail::apply(                                                        \
          hg_rule, #OP, [&](const auto&... hg_args) { return OP(hg_args...); }, __VA_ARGS__);       \
  } while (0)
