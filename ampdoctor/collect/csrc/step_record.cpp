// The sentinel's every-step reads in C++ (compiled.py builds and loads this file): what a Python hook would pay
// a few microseconds of torch attribute calls for, per gradient and per step, inside a training loop.
//
// Grads(params).figures(): the global L2 norm and the largest |g| over the parameters' gradients, read from their
//   memory in one pass (float32, bfloat16, float16 on the CPU): no Python object per gradient.
// call_state(x): at a root forward's start on the CPU, the state the step's record and the replay's capture read
//   there, in one call where Python makes seven (grad mode, backward recomputation, autocast, the batch's rows and
//   version counter, the CPU generator's state).
// keep_seed(output, max_numel): the gradient that will reach a root output in the backward (the replay's seed), kept
//   by a hook in C++: the backward runs no Python for it.
// HeldSteps: the lane's held steps (lane.py), clean sentinel-only CPU steps, recorded here from one let-go to the next:
//   the step's counts, its root calls kept for the replay, its figures and verdict, its row, the next step. Python's
//   objects (the StepState, the cadence's running means, the capture's Calls) are written only when the general path
//   takes the step back (release, sync); on a clean step only the StepState's index is.

// (not torch/extension.h, which includes all of torch's C++ API: the build takes a third of the time)
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/DynamicTypes.h>

#include <Python.h>
#include <structmember.h>
#include <torch/csrc/autograd/python_variable.h>

#include <chrono>
#include <ctime>
#include <mutex>
#include <optional>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

// Declared as torch's own headers declare them (ATen/autocast_mode.h and torch/csrc/autograd/graph_task.h pull in
// most of ATen and autograd: 14 s more of every build, for two functions). A torch that no longer exports them fails
// to load this extension, and the Python path serves (compiled.py).
namespace at::autocast {
TORCH_API bool is_autocast_enabled(at::DeviceType device_type);
TORCH_API at::ScalarType get_autocast_dtype(at::DeviceType device_type);
}  // namespace at::autocast
namespace torch::autograd {
TORCH_API int get_current_graph_task_id();
}  // namespace torch::autograd

namespace {

// One binary for x86-64 CPUs of every generation: the loops are compiled for AVX-512, AVX2 and the baseline, and the
// loader picks one per CPU (a cache shared between machines never runs an instruction a CPU lacks).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define AMPDOCTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define AMPDOCTOR_CLONES
#endif

constexpr uint32_t kAbs = 0x7FFFFFFFu;
constexpr int64_t kChunk = 16384;  // float32 values per chunk: the peak's loop reads what the squares' loop brought in

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Sum of squares in float64 (each square of a float32 is exact); the simd reduction lets it vectorize. NaN and Inf
// propagate.
AMPDOCTOR_CLONES double sum_squares(const float* x, int64_t n) {
  double q = 0.0;
#pragma omp simd reduction(+ : q)
  for (int64_t i = 0; i < n; ++i) {
    const double f = x[i];
    q += f * f;
  }
  return q;
}

// The largest |x| as a float32 bit pattern: a NaN's pattern is above Inf's, so a NaN anywhere makes the peak NaN.
AMPDOCTOR_CLONES uint32_t peak_bits(const uint32_t* b, int64_t n) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = b[i] & kAbs;
    m = a > m ? a : m;
  }
  return m;
}

AMPDOCTOR_CLONES void read_bf16(const uint16_t* h, int64_t n, double& q, uint32_t& m) {
  double s = 0.0;
  uint32_t p = 0;
#pragma omp simd reduction(+ : s) reduction(max : p)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(h[i]) << 16;  // bf16 is float32's top half
    const double f = float_of(u);
    s += f * f;
    const uint32_t a = u & kAbs;
    p = a > p ? a : p;
  }
  q += s;
  m = p > m ? p : m;
}

void read_fp16(const c10::Half* h, int64_t n, double& q, uint32_t& m) {
  double s = 0.0;
  uint32_t p = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float f = static_cast<float>(h[i]);  // as torch's .float() (Inf and NaN kept)
    s += static_cast<double>(f) * f;
    const uint32_t a = bits_of(f) & kAbs;
    p = a > p ? a : p;
  }
  q += s;
  m = p > m ? p : m;
}

// A gradient whose memory this file can read: a dense CPU tensor of plain storage (not a tensor subclass such as
// DTensor or a fake tensor, whose values are not in its own memory).
bool readable(const at::Tensor& g) {
  return g.layout() == at::kStrided && g.device().is_cpu() && g.has_storage() &&
         !g.key_set().has(c10::DispatchKey::Python) &&
         (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kHalf);
}

// The parameters of one run, held once (a Python list would be converted at every call).
struct Grads {
  explicit Grads(std::vector<at::Tensor> params) : params_(std::move(params)) {}

  // (L2 norm, largest |g|, gradients read); read is -1 where a gradient is one this file does not read (on another
  // device, sparse, a subclass, float64): the caller reads them its own way. NaN anywhere gives (NaN, NaN).
  std::tuple<double, double, int64_t> figures() const {
    double q = 0.0;
    uint32_t m = 0;
    int64_t read = 0;
    for (const auto& p : params_) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined()) continue;
      if (!readable(grad)) return {NAN, NAN, -1};
      // Norm and peak do not depend on the order of the values: a dense gradient in any order of its dimensions
      // (transposed, channels-last) fills numel slots from its data pointer and is read in place; one with gaps (a
      // slice) is read from a dense copy.
      const at::Tensor g = grad.is_non_overlapping_and_dense() ? grad : grad.contiguous();
      const int64_t n = g.numel();
      switch (g.scalar_type()) {
        case at::kFloat: {
          const float* x = g.const_data_ptr<float>();
          for (int64_t lo = 0; lo < n; lo += kChunk) {
            const int64_t k = std::min(kChunk, n - lo);
            q += sum_squares(x + lo, k);
            const uint32_t p = peak_bits(reinterpret_cast<const uint32_t*>(x + lo), k);
            m = p > m ? p : m;
          }
          break;
        }
        case at::kBFloat16:
          read_bf16(reinterpret_cast<const uint16_t*>(g.const_data_ptr<c10::BFloat16>()), n, q, m);
          break;
        default:
          read_fp16(g.const_data_ptr<c10::Half>(), n, q, m);
      }
      ++read;
    }
    const float peak = float_of(m);
    if (std::isnan(peak)) return {NAN, NAN, read};
    return {std::sqrt(q), static_cast<double>(peak), read};
  }

 private:
  std::vector<at::Tensor> params_;
};

// What a root forward's start reads on the CPU: training is grad mode on outside a backward's recomputation (a
// checkpoint's forward); the autocast dtype is the CPU's (none when autocast is off there); rows and version are x's
// first dimension and version counter (-1 without x, or for a 0-d x: rows; a sparse floating x is not kept: version).
struct CallRead {
  bool training = false;
  std::optional<at::ScalarType> autocast;
  int64_t rows = -1, version = -1;
};

CallRead read_call(const at::Tensor* x) {
  CallRead r;
  if (!c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() != -1) return r;
  r.training = true;
  if (at::autocast::is_autocast_enabled(at::kCPU)) r.autocast = at::autocast::get_autocast_dtype(at::kCPU);
  if (x != nullptr && x->defined()) {
    if (x->dim() > 0) r.rows = x->size(0);
    if (x->layout() == at::kStrided || !x->is_floating_point()) r.version = static_cast<int64_t>(x->_version());
  }
  return r;
}

// The CPU generator's state, as torch.default_generator.get_state() gives it.
at::Tensor rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());  // (as torch's own get_state binding)
  return gen.get_state();
}

// The CPU generator's state for a kept call: the tensor of the last call again while the generator has not moved
// since (a model without CPU randomness, the eval forwards of a step), else a new one. The generator's state is
// compared field by field (the Mersenne Twister's words, its position, the cached normal samples): a state tensor is
// 5 KB made and filled at every root call otherwise.
class RngStates {
 public:
  at::Tensor get() {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = gen.get<at::CPUGeneratorImpl>();
    const at::mt19937_data_pod pod = impl->engine().data();
    const std::optional<float> f = impl->next_float_normal_sample();
    const std::optional<double> d = impl->next_double_normal_sample();
    if (!last_.defined() || pod.seed_ != pod_.seed_ || pod.left_ != pod_.left_ || pod.seeded_ != pod_.seeded_ ||
        pod.next_ != pod_.next_ || pod.state_ != pod_.state_ || f != f_ || d != d_) {
      last_ = gen.get_state();
      pod_ = pod;
      f_ = f;
      d_ = d;
    }
    return last_;
  }

 private:
  at::Tensor last_;
  at::mt19937_data_pod pod_{};
  std::optional<float> f_;
  std::optional<double> d_;
};

py::object dtype_object(const std::optional<at::ScalarType>& dtype) {
  if (!dtype) return py::none();
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(*dtype)));
}

// (training, autocast dtype or None, rows, version, generator state or None) at a root forward's start (read_call);
// the generator's state only where ``rng``. Nothing else is read when not training.
py::tuple call_state(const std::optional<at::Tensor>& x, bool rng) {
  const CallRead r = read_call(x.has_value() ? &*x : nullptr);
  if (!r.training) return py::make_tuple(false, py::none(), -1, -1, py::none());
  py::object state = rng ? py::cast(rng_state()) : py::none();
  return py::make_tuple(true, dtype_object(r.autocast), r.rows, r.version, state);
}

// The gradient that reached a root output (summed where the output was used twice), held for the step's replay.
struct Seed {
  at::Tensor grad;
  std::optional<at::Tensor> get() const {
    if (!grad.defined()) return std::nullopt;
    return grad;
  }
};

// A Seed for ``output``'s gradient, or None where it is not kept: an output that does not require grad, is not
// strided, or holds more than ``max_numel`` values (the anomaly replay's SEED_KEEP_MAX). The hook holds the Seed weakly:
// the Seed lives as long as the capture's call keeps it, the hook as long as the graph.
std::shared_ptr<Seed> seed_for(const at::Tensor& output, int64_t max_numel) {
  if (!output.requires_grad() || output.layout() != at::kStrided || output.numel() > max_numel) return nullptr;
  auto seed = std::make_shared<Seed>();
  std::weak_ptr<Seed> held = seed;
  output.register_hook([held](const at::TensorBase& g) {
    if (auto s = held.lock()) {
      const at::Tensor grad(g);
      s->grad = s->grad.defined() ? s->grad.add(grad) : grad;
    }
  });
  return seed;
}

std::optional<std::shared_ptr<Seed>> keep_seed(const at::Tensor& output, int64_t max_numel) {
  auto seed = seed_for(output, max_numel);
  if (!seed) return std::nullopt;
  return seed;
}

// -- the lane's held steps --------------------------------------------------------------------------------------------

// The limits and constants of lane.py, cadence.py and anomaly.py, handed in once (named, so that a constant changed
// in Python is the one used here).
struct Limits {
  int64_t seed_max, calls_max, rows_max, losses_max;
  double flush_s;
  int64_t spike_warmup, loss_warmup;
  double spike_factor, spike_alpha, loss_sigmas, loss_factor, loss_alpha;
  bool compensated_sum;  // Python's sum() of floats is compensated (3.12 on): the step's loss is summed as it sums
};

// A root call kept as read: made into the replay's Call only where the general path takes the step.
struct Kept {
  py::object args, kwargs, x;
  int64_t version;
  py::object versions;  // (a call of another form: its tensors' versions, read by lane.py; else x's)
  at::Tensor rng;
  std::optional<at::ScalarType> autocast;
  std::vector<std::pair<int64_t, std::shared_ptr<Seed>>> seeds;  // output index -> its gradient's Seed
};

// A clean step's row, fields as lane.py sends them.
struct Row {
  int64_t step;
  double wall, data_time;
  int64_t samples;
  std::vector<double> lr;
  int64_t micro;
  double gmax, norm;
  bool has_loss;
  double loss;
  bool nonfinite;
  double step_time, observer_time;
};

// The clock of Python's time.perf_counter (the general path's step times are on it), and time.time's.
double monotonic() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double wall_time() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

class HeldSteps {
 public:
  // What each call returns to lane.py.
  enum Code : int {
    kDone = 0,       // the call is recorded; nothing for Python to do
    kLetGo = 1,      // the general path takes the step from here (lane.let_go, then its own hook)
    kStart = 2,      // (call) recorded; the rows, or the general path's finished steps, go to the writer now
    kAutocast = 4,   // (call) recorded; the autocast state changed: Collector.record_autocast
    kNext = 8,       // (end) the step ended; the next one is not the lane's: StepLoop.begin_step
    kLate = 16,      // (loss) joined the last clean step's row as its late loss
    kSpike = 32,     // (loss) ... and it is a loss spike: the event goes into the trace
    kOther = 64,     // (call) not one plain tensor: lane.py reads the call's tensors and hands them to call_with
    kPending = 128,  // (loss) before the step's first call, no clean step open: the general path's last step may
                     // take it (lane.py asks); else add_loss
    kWindow = 256,   // (end) the overhead budget's window is full: lane.py closes it (Budget.close_window)
    kBudget = 512,   // (call) the step's first: the budget's window as it stands now, to hand in (set_budget; the
                     // general path's last step added its share after this object began)
  };

  HeldSteps(std::vector<at::Tensor> params, at::Tensor anchor, py::list groups, py::dict limits, double clock_offset)
      : grads_(std::move(params)), anchor_(std::move(anchor)), groups_(std::move(groups)), offset_(clock_offset) {
    auto get = [&](const char* k) { return limits[k]; };
    lim_ = Limits{get("seed_max").cast<int64_t>(),      get("calls_max").cast<int64_t>(),
                  get("rows_max").cast<int64_t>(),      get("losses_max").cast<int64_t>(),
                  get("flush_s").cast<double>(),        get("spike_warmup").cast<int64_t>(),
                  get("loss_warmup").cast<int64_t>(),   get("spike_factor").cast<double>(),
                  get("spike_alpha").cast<double>(),    get("loss_sigmas").cast<double>(),
                  get("loss_factor").cast<double>(),    get("loss_alpha").cast<double>(),
                  get("compensated_sum").cast<bool>()};
  }

  // Step ``index`` (its StepState ``state``) is the lane's from its start. ``until``: the first step after it that is
  // not (the cadence observes it, or it reads the weights); ``means``: the cadence's spike state; ``room``: calls the
  // capture may still keep (0: no capture, or paused); ``start``: the general path's finished steps wait for this
  // step's start; ``budget``: the run has an overhead budget (its window is asked for at the step's first call).
  void begin(py::object state, int64_t index, int64_t until, double t_prev_end, py::tuple means, int64_t room,
             bool start, bool budget) {
    state_ = std::move(state);
    index_ = index;
    until_ = until;
    t_prev_ = t_prev_end;
    set_means(means);
    room_ = room;
    start_ = start;
    called_ = false;
    budget_ = false;
    want_budget_ = budget;
    reset_step();
  }

  // The overhead budget's window so far (Budget.state: shares, steps, sentinel-only shares and steps, its length), or
  // None without a budget: a held step's share is added as Budget.update adds it.
  void set_budget(py::object window) {
    want_budget_ = false;
    budget_ = !window.is_none();
    if (!budget_) return;
    py::tuple w = window.cast<py::tuple>();
    b_shares_ = w[0].cast<double>();
    b_steps_ = w[1].cast<int64_t>();
    b_floor_shares_ = w[2].cast<double>();
    b_floor_steps_ = w[3].cast<int64_t>();
    b_window_ = w[4].cast<int64_t>();
  }

  py::object budget() const {
    if (!budget_) return py::none();
    return py::make_tuple(b_shares_, b_steps_, b_floor_shares_, b_floor_steps_, b_window_);
  }

  // The cadence's spike state (Cadence.spike_state), where Python judged a step meanwhile (a finished step's late loss).
  void set_means(py::tuple means) {
    norm_mean_ = means[0].is_none() ? std::nullopt : std::optional<double>(means[0].cast<double>());
    norm_seen_ = means[1].cast<int64_t>();
    loss_mean_ = means[2].is_none() ? std::nullopt : std::optional<double>(means[2].cast<double>());
    loss_var_ = means[3].cast<double>();
    loss_seen_ = means[4].cast<int64_t>();
  }

  // The root's forward pre-hook: Collector.on_root_pre and start_micro for a plain call (one tensor), the replay's
  // capture of it (Capture.on_call).
  int call(py::tuple args, py::dict kwargs) {
    const double t0 = now();
    int code = kOther;
    if (PyDict_GET_SIZE(kwargs.ptr()) == 0 && PyTuple_GET_SIZE(args.ptr()) == 1) {
      PyObject* a = PyTuple_GET_ITEM(args.ptr(), 0);
      if (THPVariable_CheckExact(a)) code = record(args, kwargs, a, py::object(), t0);
    }
    spent_ += now() - t0;
    return code;
  }

  // A call of another form (keywords, several arguments, a structure): ``first`` its first tensor (the batch's rows),
  // ``versions`` its tensors' (tensor, version) as Capture.on_call reads them.
  int call_with(py::tuple args, py::dict kwargs, py::object first, py::list versions) {
    const double t0 = now();
    PyObject* x = THPVariable_Check(first.ptr()) ? first.ptr() : nullptr;
    const int code = record(args, kwargs, x, versions, t0);
    spent_ += now() - t0;
    return code;
  }

  // The root's forward hook: the backward's seed of a single output tensor, kept for the last kept call (False: the
  // output is not a plain tensor; lane.py finds its tensors and hands each to seed_at).
  bool seed(py::handle output) {
    if (!THPVariable_CheckExact(output.ptr())) return false;
    const double t0 = now();
    if (!kept_.empty()) {
      auto s = seed_for(THPVariable_Unpack(output.ptr()), lim_.seed_max);
      // (None: no gradient will reach it, e.g. an evaluation forward inside the step: the last call's seed stays)
      if (s) kept_.back().seeds.assign(1, {0, std::move(s)});
    }
    spent_ += now() - t0;
    return true;
  }

  void seed_at(int64_t i, const at::Tensor& t) {
    if (kept_.empty()) return;
    auto s = seed_for(t, lim_.seed_max);
    if (!s) return;
    auto& seeds = kept_.back().seeds;
    for (auto& kv : seeds) {
      if (kv.first == i) {
        kv.second = std::move(s);
        return;
      }
    }
    seeds.emplace_back(i, std::move(s));
  }

  // A loss logged while the step is held (a float): the step's, or the last clean step's late loss (Collector.log_loss's
  // rule), judged for a spike as StepEnd.late_loss judges one.
  int loss(double value) {
    if (std::isnan(t_first_) && !open_) return kPending;
    return add_loss(value);
  }

  // (timed by lane.py, with the loss's read)
  int add_loss(double value) {
    int code = kDone;
    if (std::isnan(t_first_) && open_ && !rows_.back().has_loss) {
      code = kLate | (join_late(value) ? kSpike : 0);
      late_step_ = rows_.back().step;
      if (code & kSpike) late_mean_ = loss_mean_.value_or(NAN);
      else late_mean_ = NAN;
      // (judged here: the running mean is this object's while it holds the steps)
      if (!(code & kSpike) && std::isfinite(value)) commit_loss(value);
    } else {
      if (static_cast<int64_t>(losses_.size()) >= lim_.losses_max) {
        const double total = sum(losses_);
        losses_.assign(1, total);
      }
      losses_.push_back(value);
    }
    return code;
  }

  // The last clean step's late loss while the general path holds the step in progress (the running means are its):
  // the row only. Returns the row's step.
  int64_t late_loss(double value) {
    if (!open_ || rows_.empty()) throw py::value_error("no clean step's row is open for a late loss");
    Row& row = rows_.back();
    row.has_loss = true;
    row.loss = value;
    if (!std::isfinite(value)) row.nonfinite = true;
    return row.step;
  }

  // The optimizer's pre-hook: the sentinel's figures and verdict (StepEnd.early_verdict, _judge). False: the step is
  // let go, nothing judged (the general path judges it from the same running means and reaches the same verdict).
  bool verdict() {
    const double t0 = now();
    const bool clean = verdict_();
    spent_ += now() - t0;
    return clean;
  }

  // The optimizer's post-hook: the clean step's row, the next step begun (its StepState's index). ``extra``: seconds
  // ampdoctor spent on this step outside this object. kLetGo: not a step this object can end (no forward, not judged).
  int end(double extra) {
    const double t0 = now();
    if (std::isnan(t_first_) || !judged_) {
      spent_ += now() - t0;
      return kLetGo;
    }
    ++updates_;
    Row row;
    row.step = index_;
    row.wall = wall_time();
    row.data_time = std::max(t_first_ - t_prev_, 0.0);
    row.samples = samples_;
    const Py_ssize_t n = PyList_GET_SIZE(groups_.ptr());
    row.lr.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* lr = PyDict_GetItemWithError(PyList_GET_ITEM(groups_.ptr(), i), lr_key_.ptr());  // (borrowed)
      if (lr == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        throw py::key_error("lr");
      }
      const double v = PyFloat_Check(lr) ? PyFloat_AS_DOUBLE(lr) : py::reinterpret_borrow<py::object>(lr).cast<double>();
      row.lr.push_back(v);
    }
    row.micro = micro_;
    row.norm = norm_;
    row.gmax = gmax_;
    row.has_loss = !losses_.empty();
    row.loss = row.has_loss ? sum(losses_) : 0.0;
    row.nonfinite = false;
    kept_.clear();  // (a clean step's calls are let go unmade: Capture.take)
    ++ended_;
    ++carried_;
    ++index_;
    if (PyObject_SetAttr(state_.ptr(), index_key_.ptr(), py::int_(index_).ptr()) != 0) throw py::error_already_set();
    const double t_end = now();
    row.step_time = t_end - t_prev_;
    row.observer_time = spent_ + extra + (t_end - t0);
    t_prev_ = t_end;
    if (rows_.empty()) oldest_ = t_end;
    int code = index_ < until_ ? kDone : kNext;
    if (budget_ && row.step_time > 0) {  // (Budget.update for a sentinel step)
      const double share = std::min(row.observer_time / row.step_time, 1.0);
      b_shares_ += share;
      ++b_steps_;
      b_floor_shares_ += share;
      ++b_floor_steps_;
      if (b_steps_ >= b_window_) code |= kWindow;
    }
    rows_.push_back(std::move(row));
    open_ = true;
    reset_step();
    return code;
  }

  // The step in progress to the general path: (t_first or None, micro, samples, losses, figures or None, whether a
  // training call was seen since begin, the last one's autocast, the kept calls as (args, kwargs, versions, rng,
  // autocast, {index: Seed}), seconds spent on it).
  py::tuple release() {
    py::list losses;
    for (double v : losses_) losses.append(v);
    py::list calls;
    for (auto& k : kept_) {
      py::object versions = k.versions;
      if (!versions) {
        py::list own;
        if (k.version >= 0) own.append(py::make_tuple(k.x, k.version));
        versions = own;
      }
      py::dict seeds;
      for (auto& kv : k.seeds) seeds[py::int_(kv.first)] = py::cast(kv.second);
      py::object rng = py::make_tuple(py::cast(k.rng), py::none(), py::none());
      calls.append(py::make_tuple(k.args, k.kwargs, versions, rng, autocast_tuple(k.autocast), seeds));
    }
    py::object figures = has_figures_ ? py::object(py::make_tuple(norm_, gmax_)) : py::object(py::none());
    py::object t_first = std::isnan(t_first_) ? py::object(py::none()) : py::object(py::float_(t_first_));
    py::tuple out = py::make_tuple(t_first, micro_, samples_, losses, figures, called_, autocast_tuple(autocast_now_),
                                   calls, spent_);
    reset_step();
    state_ = py::none();
    return out;
  }

  // The counts and state the general path reads, as of now: (micro-batch starts, updates, steps ended since the last
  // sync, the last step end's time, the cadence's spike state); the counts start again from 0.
  py::tuple sync() {
    py::object nm = norm_mean_ ? py::object(py::float_(*norm_mean_)) : py::object(py::none());
    py::object lm = loss_mean_ ? py::object(py::float_(*loss_mean_)) : py::object(py::none());
    py::tuple out = py::make_tuple(step_starts_, updates_, ended_, t_prev_,
                                   py::make_tuple(nm, norm_seen_, lm, loss_var_, loss_seen_));
    step_starts_ = updates_ = ended_ = 0;
    return out;
  }

  // The clean steps' rows, oldest first, as tuples (lane.flush makes the packets); ``keep_open``: the newest stays
  // while a late loss may join it.
  py::list rows(bool keep_open) {
    py::list out;
    size_t n = rows_.size();
    if (keep_open && open_ && n > 0) --n;
    for (size_t i = 0; i < n; ++i) {
      const Row& r = rows_[i];
      py::list lr;
      for (double v : r.lr) lr.append(v);
      py::object samples = r.samples ? py::object(py::int_(r.samples)) : py::object(py::none());
      py::object loss = r.has_loss ? py::object(py::float_(r.loss)) : py::object(py::none());
      out.append(py::make_tuple(r.step, r.wall, r.data_time, samples, lr, r.micro, r.gmax, r.norm, loss, r.nonfinite,
                                r.step_time, r.observer_time));
    }
    rows_.erase(rows_.begin(), rows_.begin() + static_cast<std::ptrdiff_t>(n));
    if (n > 0 && !rows_.empty()) oldest_ = now();
    if (rows_.empty()) open_ = false;
    return out;
  }

  void close_open() { open_ = false; }
  bool rows_due() const {
    return !rows_.empty() && (static_cast<int64_t>(rows_.size()) >= lim_.rows_max || now() - oldest_ >= lim_.flush_s);
  }

  bool open() const { return open_; }
  bool open_has_loss() const { return open_ && rows_.back().has_loss; }
  int64_t carried() const { return carried_; }
  int64_t index() const { return index_; }
  int64_t kept() const { return static_cast<int64_t>(kept_.size()); }
  int64_t until() const { return until_; }
  void set_until(int64_t until) { until_ = until; }
  py::object autocast_now() const { return autocast_tuple(autocast_now_); }
  int64_t late_step() const { return late_step_; }
  double late_mean() const { return late_mean_; }

 private:
  double now() const { return monotonic() + offset_; }

  static py::object autocast_tuple(const std::optional<at::ScalarType>& dtype) {
    if (!dtype) return py::none();
    return py::make_tuple("cpu", dtype_object(dtype));
  }

  void reset_step() {
    t_first_ = NAN;
    micro_ = samples_ = 0;
    losses_.clear();
    kept_.clear();
    has_figures_ = judged_ = false;
    spent_ = 0.0;
  }

  // A training call's record (``x``: its first tensor or null; ``versions``: its tensors' versions, or none for x's).
  int record(const py::tuple& args, const py::dict& kwargs, PyObject* x, const py::object& versions, double t0) {
    const CallRead r = x != nullptr ? read_call(&THPVariable_Unpack(x)) : read_call(nullptr);
    if (!r.training) return kDone;  // (an evaluation forward, a checkpoint's recomputation)
    int code = kDone;
    if (std::isnan(t_first_)) {
      if (!anchor_.device().is_cpu()) return kLetGo;  // the model moved: the general path reads its new device
      t_first_ = t0;
      open_ = false;  // (no loss joins the last clean step any more)
      if (start_ || rows_due()) code |= kStart;
      start_ = false;
      if (want_budget_) code |= kBudget;
      if (!autocast_seen_ || *autocast_seen_ != r.autocast) {  // (recording the same state again changes nothing)
        code |= kAutocast;
        autocast_seen_ = r.autocast;
      }
    }
    autocast_now_ = r.autocast;
    called_ = true;
    ++step_starts_;
    ++micro_;
    if (r.rows > 0) samples_ += r.rows;
    if (static_cast<int64_t>(kept_.size()) < room_) {
      Kept k;
      k.args = args;
      k.kwargs = kwargs;
      if (versions) {
        k.versions = versions;
      } else {
        k.x = py::reinterpret_borrow<py::object>(x);
        k.version = r.version;
      }
      k.rng = rng_.get();
      k.autocast = r.autocast;
      kept_.push_back(std::move(k));
    }
    return code;
  }

  bool verdict_() {
    const auto [norm, gmax, read] = grads_.figures();
    if (read <= 0 || !std::isfinite(norm + gmax)) return false;  // (a gradient read another way, none, a NaN/Inf)
    norm_ = norm;
    gmax_ = gmax;
    has_figures_ = true;
    std::optional<double> loss;
    if (!losses_.empty()) {
      const double total = sum(losses_);
      if (!std::isfinite(total)) return false;
      loss = total;
    }
    if (grad_spike(norm) || (loss && loss_spike(*loss))) return false;
    commit_norm(norm);
    if (loss) commit_loss(*loss);
    judged_ = true;
    return true;
  }

  // Cadence.spike and Cadence.loss_spike, the judgement and the update apart (a spike leaves the means as they are)
  bool grad_spike(double g) const {
    return norm_mean_ && norm_seen_ >= lim_.spike_warmup && g > lim_.spike_factor * *norm_mean_ &&
           lim_.spike_factor * *norm_mean_ > 0;
  }
  void commit_norm(double g) {
    norm_mean_ = norm_mean_ ? *norm_mean_ + lim_.spike_alpha * (g - *norm_mean_) : g;
    ++norm_seen_;
  }
  bool loss_spike(double v) const {
    return loss_mean_ && loss_seen_ >= lim_.loss_warmup && v - *loss_mean_ > lim_.loss_sigmas * std::sqrt(loss_var_) &&
           v > lim_.loss_factor * *loss_mean_ && lim_.loss_factor * *loss_mean_ > 0;
  }
  void commit_loss(double v) {
    if (!loss_mean_) {
      loss_mean_ = v;
    } else {
      const double delta = v - *loss_mean_;
      loss_mean_ = *loss_mean_ + lim_.loss_alpha * delta;
      loss_var_ = (1 - lim_.loss_alpha) * (loss_var_ + lim_.loss_alpha * delta * delta);
    }
    ++loss_seen_;
  }

  // The late loss into the newest row; true when it is a loss spike (finite, judged against the running mean).
  bool join_late(double value) {
    late_loss(value);
    return std::isfinite(value) && loss_spike(value);
  }

  // buffers.sum_losses: Python's sum() of the floats, from 0 (compensated from Python 3.12 on, as CPython does it)
  double sum(const std::vector<double>& v) const {
    if (v.size() == 1) return v[0];
    if (!lim_.compensated_sum) {
      double s = 0.0;
      for (double x : v) s += x;
      return s;
    }
    double s = 0.0, c = 0.0;
    for (double x : v) {
      const double t = s + x;
      if (std::fabs(s) >= std::fabs(x)) c += (s - t) + x;
      else c += (x - t) + s;
      s = t;
    }
    if (c != 0.0 && std::isfinite(c)) s += c;
    return s;
  }

  Grads grads_;
  RngStates rng_;
  at::Tensor anchor_;
  py::list groups_;
  double offset_;
  py::str lr_key_ = py::str("lr"), index_key_ = py::str("index");  // (made once: a C string is made into one per use)
  Limits lim_{};
  py::object state_ = py::none();
  int64_t index_ = 0, until_ = 0, room_ = 0;
  bool start_ = false;
  double t_prev_ = 0.0;
  // the cadence's spike state, while this object holds the steps
  std::optional<double> norm_mean_, loss_mean_;
  int64_t norm_seen_ = 0, loss_seen_ = 0;
  double loss_var_ = 0.0;
  // the step in progress
  double t_first_ = NAN;
  int64_t micro_ = 0, samples_ = 0;
  std::vector<double> losses_;
  std::vector<Kept> kept_;
  double norm_ = 0.0, gmax_ = 0.0;
  bool has_figures_ = false, judged_ = false;
  double spent_ = 0.0;
  std::optional<at::ScalarType> autocast_now_;
  bool called_ = false;  // a training call was seen since begin (autocast_now_ is of this hold)
  std::optional<std::optional<at::ScalarType>> autocast_seen_;  // (empty: none recorded yet)
  // across steps, until the next sync
  int64_t step_starts_ = 0, updates_ = 0, ended_ = 0, carried_ = 0;
  // the clean steps' rows not sent yet
  std::vector<Row> rows_;
  bool open_ = false;
  double oldest_ = 0.0;
  int64_t late_step_ = -1;
  double late_mean_ = NAN;
  // the overhead budget's window, while this object holds the steps (asked for at the first call after begin)
  bool budget_ = false, want_budget_ = false;
  double b_shares_ = 0.0, b_floor_shares_ = 0.0;
  int64_t b_steps_ = 0, b_floor_steps_ = 0, b_window_ = 0;
};

// -- hooks.eager in C ------------------------------------------------------------------------------------------------
// EagerHook(fn, disabled, flags, callback): a module hook that calls ``fn`` in eager training, else ``disabled``
// (torch.compiler.disable(fn)): while torch.compile compiles (torch.compiler's _is_compiling_flag, read from the
// module's dict ``flags``: what torch.compiler.is_compiling() returns outside TorchScript), and while dynamo's frame
// callback is set (``callback()`` is not None: the hook is called from a compiled region, whose frames dynamo would
// otherwise compile, ours among them). hooks.eager's Python wrapper made three Python frames a call (the wrapper,
// is_compiling, torch.jit.is_scripting); dynamo does not trace into this object: a compiled model's call of it
// breaks the graph and runs it eagerly, as the disabled copy.
struct EagerHook {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* fn;
  PyObject* disabled;
  PyObject* flags;
  PyObject* callback;
  PyObject* key;
};

PyObject* eager_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* e = reinterpret_cast<EagerHook*>(self);
  PyObject* flag = PyDict_GetItemWithError(e->flags, e->key);  // (borrowed)
  if (flag == nullptr && PyErr_Occurred()) return nullptr;
  int compiling = 0;
  if (flag != nullptr && flag != Py_False) {
    compiling = PyObject_IsTrue(flag);
    if (compiling < 0) return nullptr;
  }
  if (!compiling) {
    PyObject* set = PyObject_CallNoArgs(e->callback);
    if (set == nullptr) return nullptr;
    compiling = set != Py_None;
    Py_DECREF(set);
  }
  return PyObject_Vectorcall(compiling ? e->disabled : e->fn, args, nargsf, kwnames);
}

PyObject* eager_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *fn, *disabled, *flags, *callback;
  if (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "EagerHook takes no keyword arguments");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "OOO!O", &fn, &disabled, &PyDict_Type, &flags, &callback)) return nullptr;
  PyObject* key = PyUnicode_InternFromString("_is_compiling_flag");
  if (key == nullptr) return nullptr;
  auto* e = reinterpret_cast<EagerHook*>(type->tp_alloc(type, 0));
  if (e == nullptr) {
    Py_DECREF(key);
    return nullptr;
  }
  e->vectorcall = eager_call;
  Py_INCREF(fn);
  Py_INCREF(disabled);
  Py_INCREF(flags);
  Py_INCREF(callback);
  e->fn = fn;
  e->disabled = disabled;
  e->flags = flags;
  e->callback = callback;
  e->key = key;
  return reinterpret_cast<PyObject*>(e);
}

int eager_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* e = reinterpret_cast<EagerHook*>(self);
  Py_VISIT(Py_TYPE(self));  // (a heap type: its instances keep it alive)
  Py_VISIT(e->fn);
  Py_VISIT(e->disabled);
  Py_VISIT(e->flags);
  Py_VISIT(e->callback);
  return 0;
}

int eager_clear(PyObject* self) {
  auto* e = reinterpret_cast<EagerHook*>(self);
  Py_CLEAR(e->fn);
  Py_CLEAR(e->disabled);
  Py_CLEAR(e->flags);
  Py_CLEAR(e->callback);
  Py_CLEAR(e->key);
  return 0;
}

void eager_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  eager_clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

PyMemberDef eager_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(EagerHook, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot eager_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(eager_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(eager_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(eager_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(eager_clear)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_members, eager_members},
    {0, nullptr},
};

PyType_Spec eager_spec = {
    "ampdoctor_step_record.EagerHook",
    sizeof(EagerHook),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    eager_slots,
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Grads>(m, "Grads")
      .def(py::init<std::vector<at::Tensor>>())
      .def("figures", &Grads::figures, py::call_guard<py::gil_scoped_release>());
  m.def("call_state", &call_state);
  py::class_<Seed, std::shared_ptr<Seed>>(m, "Seed").def("get", &Seed::get);
  m.def("keep_seed", &keep_seed);
  PyObject* eager = PyType_FromSpec(&eager_spec);
  if (eager == nullptr) throw py::error_already_set();
  m.add_object("EagerHook", py::reinterpret_steal<py::object>(eager));
  py::class_<HeldSteps>(m, "HeldSteps")
      .def(py::init<std::vector<at::Tensor>, at::Tensor, py::list, py::dict, double>())
      .def("begin", &HeldSteps::begin)
      .def("set_means", &HeldSteps::set_means)
      .def("set_budget", &HeldSteps::set_budget)
      .def("budget", &HeldSteps::budget)
      .def("call", &HeldSteps::call)
      .def("call_with", &HeldSteps::call_with)
      .def("seed", &HeldSteps::seed)
      .def("seed_at", &HeldSteps::seed_at)
      .def("loss", &HeldSteps::loss)
      .def("add_loss", &HeldSteps::add_loss)
      .def("late_loss", &HeldSteps::late_loss)
      .def("verdict", &HeldSteps::verdict)
      .def("end", &HeldSteps::end)
      .def("release", &HeldSteps::release)
      .def("sync", &HeldSteps::sync)
      .def("rows", &HeldSteps::rows)
      .def("close_open", &HeldSteps::close_open)
      .def_property_readonly("rows_due", &HeldSteps::rows_due)
      .def_property_readonly("open", &HeldSteps::open)
      .def_property_readonly("open_has_loss", &HeldSteps::open_has_loss)
      .def_property_readonly("carried", &HeldSteps::carried)
      .def_property_readonly("index", &HeldSteps::index)
      .def_property_readonly("kept", &HeldSteps::kept)
      .def_property("until", &HeldSteps::until, &HeldSteps::set_until)
      .def_property_readonly("autocast_now", &HeldSteps::autocast_now)
      .def_property_readonly("late_step", &HeldSteps::late_step)
      .def_property_readonly("late_mean", &HeldSteps::late_mean);
}
