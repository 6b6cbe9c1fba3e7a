#include "core/autocast.h"

#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "core/autograd.h"
#include "core/cuda.h"
#include "core/cuda_graph.h"
#include "core/log.h"
#include "ops/copy.h"

namespace halfgrad::amp {

namespace {
struct State {
  bool enabled = false;
  DType dtype = kFloat16;
  int depth = 0;        // guards alive: the cache lives until the outermost one ends
  bool applying = false;
  bool float32_math = false;  // inside an op that autocast called under CastRule::Float32Math
  bool tracing = false;
  // (parameter, target dtype) -> its cast. The cast keeps its autograd edge to the parameter.
  struct Cast {
    // The parameter, not kept alive. (Keyed by address alone, a freed parameter's cast went to the next parameter
    // made at that address; the weak_ptr also pins the allocation, so the address stays its own while the entry
    // lives.)
    std::weak_ptr<TensorImpl> source;
    uint64_t version;  // the parameter's when cast: an in-place write since makes the cast stale
    Tensor cast;
  };
  std::map<std::pair<TensorImpl*, DType>, Cast> cache;
  size_t sweep_at = 64;  // cache size at which the entries of freed parameters (and their casts) are dropped
};
thread_local State state;
std::atomic<bool> keep_casts{true};
bool trace_env = [] {
  const char* v = std::getenv("HALFGRAD_AMP_TRACE");
  return v && std::string_view(v) != "0" && std::string_view(v) != "";
}();
std::function<void(const std::string&)> trace_sink;
}  // namespace

const char* rule_name(CastRule rule) {
  switch (rule) {
    case CastRule::LowerPrecision: return "lower precision";
    case CastRule::Float32: return "float32";
    case CastRule::Float32Math: return "float32 math";
    case CastRule::Promote: return "promote";
    case CastRule::Unchanged: return "unchanged";
  }
  return "?";
}

std::string cast_table_markdown() {
  std::string table = "| category | ops |\n|---|---|\n";
  for (CastRule rule : {CastRule::LowerPrecision, CastRule::Float32, CastRule::Float32Math, CastRule::Promote,
                        CastRule::Unchanged}) {
    std::string ops;
    for (const OpRule& r : kCastRules)
      if (r.rule == rule) ops += fmt::format("{}{}", ops.empty() ? "" : ", ", r.op);
    table += fmt::format("| {} | {} |\n", rule_name(rule), ops);
  }
  return table;
}

AutocastGuard::AutocastGuard(DType dtype, bool enabled) : prev_enabled_(state.enabled), prev_dtype_(state.dtype) {
  HG_CHECK(dtype == kFloat16 || dtype == kBFloat16, "AutocastGuard: dtype must be float16 or bfloat16, got {}",
           dtype_name(dtype));
  state.enabled = enabled;
  state.dtype = dtype;
  ++state.depth;
}

AutocastGuard::~AutocastGuard() {
  state.enabled = prev_enabled_;
  state.dtype = prev_dtype_;
  if (--state.depth == 0) {
    state.cache.clear();
    state.sweep_at = 64;
  }
}

bool is_autocast_enabled() { return state.enabled; }
DType autocast_dtype() { return state.dtype; }
size_t autocast_cache_size() { return state.cache.size(); }
DType result_dtype(DType input) {
  return state.float32_math && (input == kFloat16 || input == kBFloat16) ? kFloat32 : input;
}

void set_keep_parameter_casts(bool keep) { keep_casts.store(keep); }
bool keep_parameter_casts() { return keep_casts.load(); }

namespace {
// Guards every parameter's kept_cast and kept_cast_version: regions of several threads may cast one model's weights.
std::mutex kept_mutex;

// The kept cast if it is current and `param` may take it, else undefined. Under kept_mutex.
Tensor current_kept_cast(const Tensor& param) {
  if (!keep_parameter_casts() || param.impl()->autograd == nullptr) return Tensor();
  const AutogradMeta& meta = *param.impl()->autograd;
  return meta.kept_cast.defined() && meta.kept_cast_version == param.version() ? meta.kept_cast : Tensor();
}

// Before each replay of the graph being captured, `update(param, its AutogradMeta)` under kept_mutex, while the
// parameter lives.
void before_each_replay_of(const Tensor& param, std::function<void(const Tensor&, AutogradMeta&)> update) {
  cuda::before_each_replay([weak = std::weak_ptr<TensorImpl>(param.impl_ptr()), update = std::move(update)] {
    const std::shared_ptr<TensorImpl> impl = weak.lock();
    if (impl == nullptr) return;
    std::lock_guard lock(kept_mutex);
    update(Tensor(impl), impl->autograd_meta());
  });
}

// Before each replay: `kept` becomes the parameter's current cast, the parameter cast into it first unless it was
// current `bumps` version bumps ago (the bumps of this replay's own writes of the parameter, registered before this).
// For a graph whose region took `kept` instead of casting (bumps 0: it reads that memory at every replay), and for a
// captured step that writes `kept` with the parameter (its kernel may write part of it or nothing: a skipped step,
// plain SGD's zero gradients). Stale there: a write that nothing followed (an edit or a load between replays), or an
// eager region's cast since.
void recast_before_replays_where_stale(const Tensor& param, const Tensor& kept, uint64_t bumps) {
  before_each_replay_of(param, [kept, bumps](const Tensor& p, AutogradMeta& meta) {
    const bool current = meta.kept_cast.defined() && meta.kept_cast.impl()->storage == kept.impl()->storage &&
                         meta.kept_cast_version + bumps == p.version();
    if (!current) {
      NoGradGuard no_grad;
      Tensor(kept).copy_(p);
    }
    meta.kept_cast = kept;
    meta.kept_cast_version = p.version();
  });
}
}  // namespace

Tensor kept_cast(const Tensor& param) {
  if (!param.defined()) return Tensor();
  std::lock_guard lock(kept_mutex);
  const Tensor kept = current_kept_cast(param);
  // Held elsewhere too (a graph kept for another backward saved it, or a region still open uses it): writing it would
  // change what that reads, so it is left to go stale and the next region casts afresh.
  return kept.defined() && kept.impl()->storage.use_count() == 1 ? kept : Tensor();
}

void keep_cast_current(const Tensor& param, const Tensor& cast) {
  HG_CHECK(param.defined() && cast.defined(),
           "amp::keep_cast_current: expected a parameter and the cast kept_cast() gave for it, got {} and {}",
           param.defined() ? param.meta() : "an undefined tensor", cast.defined() ? cast.meta() : "an undefined tensor");
  std::lock_guard lock(kept_mutex);
  AutogradMeta& meta = param.impl()->autograd_meta();
  if (!meta.kept_cast.defined() || meta.kept_cast.impl()->storage != cast.impl()->storage) {
    // Another thread's region cast the parameter since: after the step's bump, so from the values the step is about
    // to replace.
    if (meta.kept_cast_version == param.version()) meta.kept_cast = Tensor();
    return;
  }
  const uint64_t bumps = param.version() - meta.kept_cast_version;  // the step's own (1), since kept_cast() read it
  meta.kept_cast_version = param.version();
  if (cuda::capturing_graph(param.device())) recast_before_replays_where_stale(param, meta.kept_cast, bumps);
}

TraceGuard::TraceGuard() : prev_(state.tracing) { state.tracing = true; }
TraceGuard::~TraceGuard() { state.tracing = prev_; }
bool is_tracing() { return state.tracing || trace_env; }
void set_trace_sink(std::function<void(const std::string&)> sink) { trace_sink = std::move(sink); }

namespace detail {

bool should_apply(CastRule rule) {
  if (state.applying) return false;
  return (state.enabled && rule != CastRule::Unchanged) || is_tracing();
}

ApplyingGuard::ApplyingGuard(bool float32_math) : prev_(state.applying), prev_float32_math_(state.float32_math) {
  state.applying = true;
  state.float32_math = float32_math;
}
ApplyingGuard::~ApplyingGuard() {
  state.applying = prev_;
  state.float32_math = prev_float32_math_;
}

DType target_dtype(CastRule rule, DType widest_floating) {
  switch (rule) {
    case CastRule::LowerPrecision: return state.dtype;
    case CastRule::Float32:
    case CastRule::Float32Math: return kFloat32;
    case CastRule::Promote: return widest_floating;
    case CastRule::Unchanged: return widest_floating;
  }
  return widest_floating;
}

Tensor cast(const Tensor& t, DType target) {
  if (!t.defined() || !t.is_floating_point() || t.dtype() == kFloat64 || t.dtype() == target || target == kFloat64)
    return t;
  // Parameters (float32 leaves that require grad) are cast once per outermost guard, as PyTorch does. Unlike
  // PyTorch's, leaves that are views qualify (a channels_last weight is a view of its own storage here), as every reuse
  // checks the storage's version counter, which any write through any view bumps.
  bool cacheable = state.enabled && t.dtype() == kFloat32 && target == state.dtype && t.requires_grad() &&
                   t.is_leaf();
  if (!cacheable) return t.to(target);
  auto key = std::make_pair(t.impl(), target);
  auto it = state.cache.find(key);
  if (it != state.cache.end() && it->second.source.lock() == t.impl_ptr() && it->second.version == t.version())
    return it->second.cast;
  // The cast an earlier region kept, where the parameter has not been written since but by a step that wrote the cast.
  Tensor casted;
  {
    std::lock_guard lock(kept_mutex);
    AutogradMeta& meta = t.impl()->autograd_meta();
    const Tensor kept = current_kept_cast(t);
    if (kept.defined() && kept.dtype() == target) {
      casted = as_cast_of(t, kept);
      if (cuda::capturing_graph(t.device())) recast_before_replays_where_stale(t, kept, 0);
    } else {
      casted = t.to(target);
      // A cast made inside any capture of the stream holds nothing until a replay: not kept.
      meta.kept_cast = keep_parameter_casts() && !cuda::is_capturing(t.device()) ? casted.detach() : Tensor();
      meta.kept_cast_version = t.version();
    }
  }
  state.cache.insert_or_assign(key, State::Cast{t.impl_ptr(), t.version(), casted});
  if (state.cache.size() >= state.sweep_at) {  // a region that makes parameters as it goes (inference loops)
    std::erase_if(state.cache, [](const auto& entry) { return entry.second.source.expired(); });
    state.sweep_at = 2 * state.cache.size() + 64;
  }
  return casted;
}

void trace(const char* op, CastRule rule, const std::vector<DType>& inputs, const std::vector<DType>& outputs) {
  auto names = [](const std::vector<DType>& dts) {
    std::vector<std::string> n;
    for (DType d : dts) n.push_back(dtype_name(d));
    return fmt::format("{}", fmt::join(n, ", "));
  };
  std::string line = fmt::format("{} [{}] ({}) -> ({})", op, rule_name(rule), names(inputs), names(outputs));
  logger().info("amp: {}", line);
  if (trace_sink) trace_sink(line);
}

}  // namespace detail
}  // namespace halfgrad::amp
