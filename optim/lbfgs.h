#pragma once
// L-BFGS with PyTorch's algorithm (torch.optim.LBFGS, after minFunc): a step is up to max_iter iterations, each
// moving along a direction that the last history_size (step, gradient change) pairs shape from the gradient, either by
// lr (the first iteration of all by lr / |g|_1 at most) or by a strong-Wolfe line search (a first guess, then at most
// the evaluations max_eval leaves the step, as PyTorch 2.11's, so a step may evaluate max_eval + 1 times); it stops
// early once the gradient, the step or the loss's change falls below its tolerance. Each iteration evaluates the loss
// and its gradient again, so a step takes a closure that does (zero_grad, forward, backward) and returns the loss:
//
//   optim::LBFGS opt(model.parameters(), {.lr = 1, .history_size = 10, .strong_wolfe = true});
//   for (int i = 0; i < 50; ++i)
//     opt.step([&] {
//       opt.zero_grad();
//       Tensor loss = criterion(model.forward(x), y);
//       loss.backward();
//       return loss;
//     });
//
// As PyTorch's: one parameter group, every parameter on one device and of one dtype, held end to end in flat vectors
// (the history keeps 2 * history_size of them); a parameter without a gradient counts as a zero gradient. The host
// reads the loss and a few dot products every iteration, so a step synchronises with the GPU and cannot be captured
// in a CUDA graph; a loss scaler's step_unless and step_scaled are refused, as step() without a closure is. The scalar
// arithmetic (the coefficients of the two-loop recursion, the line search's interpolation) is in double on the host,
// where PyTorch's is partly in 0-d tensors of the parameters' dtype: the same for float64 parameters.
// Its checkpoint entries (state_tensors) are PyTorch's state of params[0] but for its scratch `al`: state.func_evals
// and state.n_iter (0-d int64) once a step ran; from the first iteration on also state.d and state.prev_flat_grad
// (flat), state.old_dirs and state.old_stps ([k, n], oldest first), state.ro ([k]), state.t, state.H_diag and
// state.prev_loss (0-d float64).
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace halfgrad::optim {

// PyTorch's defaults.
struct LBFGSOptions {
  double lr = 1;
  int64_t max_iter = 20;                // iterations per step
  std::optional<int64_t> max_eval{};    // evaluations after which a step stops; max_iter * 5 / 4 where unset
  double tolerance_grad = 1e-7;         // stop once the gradient's largest magnitude is at most this
  double tolerance_change = 1e-9;       // ... or the step's, or the loss's change, is below this
  int64_t history_size = 100;           // (step, gradient change) pairs kept
  // A strong-Wolfe line search along each direction (PyTorch's line_search_fn="strong_wolfe"), where a fixed step of
  // lr is taken otherwise.
  bool strong_wolfe = false;
};
inline double* momentum_of(LBFGSOptions&) { return nullptr; }
// The max_eval a step takes: the option's, or PyTorch's default max_iter * 5 / 4 (at most int64's largest).
int64_t max_eval_of(const LBFGSOptions& o);
std::vector<OptionField> other_options_of(LBFGSOptions& o);  // sets max_eval where unset

class LBFGS : public OptimizerWith<LBFGSOptions> {
 public:
  LBFGS(TensorList params, LBFGSOptions options = {});
  // Evaluates `closure` once or more (with grad mode on whatever the caller's, and autocast as the caller has it),
  // moves the parameters, and returns the loss of its first evaluation (before this step moved anything).
  Tensor step(const std::function<Tensor()>& closure);
  // Refused: an iteration needs the loss again (step(closure)), which a loss scaler's flag cannot give.
  void step() override;
  void step_unless(const Tensor& found_inf) override;
  void step_scaled(const Tensor& found_inf, const Tensor& grad_scale) override;

 protected:
  std::vector<std::string> state_names(size_t) const override { return {}; }
  bool counts_steps() const override { return false; }
  void check_group_options(const LBFGSOptions& options, size_t g) const override;
  NamedTensors own_state() const override;
  std::vector<std::string> own_state_errors(const NamedTensors& entries,
                                            const std::vector<std::map<std::string, double>>& options) const override;
  void load_own_state(const NamedTensors& entries) override;

 private:
  const TensorList& params() const { return groups_[0].params; }
  int64_t flat_numel() const;
  Tensor flat_grad() const;                        // every parameter's gradient end to end (zeros for none)
  void add_to_params(double step, const Tensor& direction);  // params += step * direction
  // Loss and flat gradient at params + t * direction, the parameters then put back to `at`.
  std::pair<double, Tensor> evaluate_along(const std::function<double()>& loss_of, const TensorList& at, double t,
                                           const Tensor& direction);

  // PyTorch's state (its state[params[0]]), kept across steps: loss evaluations and iterations so far, and from the
  // first iteration on, the last direction and step length, the history, the initial inverse Hessian's scale, the
  // last iteration's gradient and loss.
  int64_t func_evals_ = 0;
  int64_t n_iter_ = 0;
  Tensor d_;
  double t_ = 0;
  std::deque<Tensor> old_dirs_;  // gradient changes y
  std::deque<Tensor> old_stps_;  // steps s
  std::deque<double> ro_;        // 1 / (y . s)
  double h_diag_ = 1;
  Tensor prev_flat_grad_;
  double prev_loss_ = 0;
};

}  // namespace halfgrad::optim
