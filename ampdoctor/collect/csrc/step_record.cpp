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

// (not torch/extension.h, which includes all of torch's C++ API: the build takes a third of the time)
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/DynamicTypes.h>

#include <mutex>
#include <optional>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
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

// (training, autocast dtype or None, rows, version, generator state) at a root forward's start: training is grad mode on
// outside a backward's recomputation (a checkpoint's forward); the autocast dtype is the CPU's, None when autocast is
// off there; rows and version are x's first dimension and version counter (-1 without x, or for a 0-d x: rows; a
// sparse floating x is not kept: version), the generator's state as torch.default_generator.get_state() gives it
// (None unless ``rng``). Nothing else is read when not training.
py::tuple call_state(const std::optional<at::Tensor>& x, bool rng) {
  if (!c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() != -1) {
    return py::make_tuple(false, py::none(), -1, -1, py::none());
  }
  py::object dtype = py::none();
  if (at::autocast::is_autocast_enabled(at::kCPU)) {
    dtype = py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(at::autocast::get_autocast_dtype(at::kCPU))));
  }
  int64_t rows = -1, version = -1;
  if (x.has_value() && x->defined()) {
    const at::Tensor& t = *x;
    if (t.dim() > 0) rows = t.size(0);
    if (t.layout() == at::kStrided || !t.is_floating_point()) version = static_cast<int64_t>(t._version());
  }
  if (!rng) return py::make_tuple(true, dtype, rows, version, py::none());
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());  // (as torch's own get_state binding)
    state = gen.get_state();
  }
  return py::make_tuple(true, dtype, rows, version, state);
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
std::optional<std::shared_ptr<Seed>> keep_seed(const at::Tensor& output, int64_t max_numel) {
  if (!output.requires_grad() || output.layout() != at::kStrided || output.numel() > max_numel) return std::nullopt;
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Grads>(m, "Grads")
      .def(py::init<std::vector<at::Tensor>>())
      .def("figures", &Grads::figures, py::call_guard<py::gil_scoped_release>());
  m.def("call_state", &call_state);
  py::class_<Seed, std::shared_ptr<Seed>>(m, "Seed").def("get", &Seed::get);
  m.def("keep_seed", &keep_seed);
}
