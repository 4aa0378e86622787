// What one of attnlab's C++ files calls in another (the ops themselves are registered as torch.ops.attnlab.*).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace attnlab_native {

// Error messages built with std::to_string, not iostreams: a compiler that links libstdc++ statically (a custom GCC
// as $CXX, seen on a GPU host) gives this library a private copy of it whose stream number formatting fails (the
// numbers vanish here; the process crashed there). A single std::string reaches TORCH_CHECK without a stream.
inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
inline std::string piece(double v) {
  char s[32];
  std::snprintf(s, sizeof s, "%g", v);
  return s;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string piece(T v) { return std::to_string(v); }
template <typename... A>
std::string message(const A&... a) { return (std::string() + ... + piece(a)); }
// TORCH_CHECK with the message above, from its parts (its parts are evaluated only when cond fails)
#define ATTNLAB_CHECK(cond, ...) TORCH_CHECK(cond, ::attnlab_native::message(__VA_ARGS__))

// The instruction set every kernel runs: 2 AVX-512 (F + BW), 1 AVX2 + FMA, 0 portable C++. The best one the CPU and
// its operating system support (__builtin_cpu_supports: cpuid, and xgetbv for the saved vector state), capped as ATen
// caps its own by ATEN_CPU_CAPABILITY ("avx512", "avx2", "default"; another value is ignored), resolved once per
// process. No argument of any op chooses it: an op cannot run an instruction the CPU lacks.
inline int64_t cpu_supported_isa() {
  static const int64_t best = [] {
    int64_t level = 0;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = 1;
    if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) level = 2;
#endif
    const char* env = std::getenv("ATEN_CPU_CAPABILITY");
    const std::string cap = env ? env : "";
    const int64_t asked = cap == "avx512" ? 2 : cap == "avx2" ? 1 : cap == "default" ? 0 : 2;
    return std::min(level, asked);
  }();
  return best;
}
// The limit attnlab::limit_isa sets (tests run each lower set's kernels in one process): it only lowers
inline std::atomic<int64_t>& isa_limit() {
  static std::atomic<int64_t> limit{2};
  return limit;
}
// The set the kernels use now: cpu_supported_isa() within isa_limit(); each op reads it once per call
inline int64_t cpu_isa() { return std::min(cpu_supported_isa(), isa_limit().load(std::memory_order_relaxed)); }

// activation codes, shared with attnlab._native.ACTIVATIONS: a gated FFN's gates (0-3), then plain ones
enum Act : int64_t { GLU = 0, GELU = 1, GELU_TANH = 2, SILU = 3, RELU = 4, QUICK_GELU = 5, RELU2 = 6 };
// whether code act is a gate (gated FFN) or a plain activation
inline bool is_gate(int64_t act) { return (GLU <= act && act <= SILU) || act == RELU2; }
inline bool is_plain(int64_t act) { return (GELU <= act && act <= QUICK_GELU && act != SILU) || act == RELU2; }

// y[i] = act(y[i]) ⊙ g[i] (g null: 1), vectorised (decode_body.h: e^x within ~1 ulp, erf within 1.5e-7)
void activate(int64_t act, float* y, const float* g, int64_t n);

// the checks of a kernel's tensor arguments: contiguous float32 on the CPU
inline void check_f32(const at::Tensor& t, const char* op, const char* name) {
  ATTNLAB_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), "attnlab::", op, ": ", name,
                " must be a contiguous float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes(),
                t.is_contiguous() ? "" : " (not contiguous)");
}

// the check of an argument whose elements must each have their own memory (no expanded view: a result as large as
// it would be as large as its sizes, not its storage)
inline void check_not_expanded(const at::Tensor& t, const char* op, const char* name) {
  for (int64_t d = 0; d < t.dim(); ++d)
    ATTNLAB_CHECK(t.size(d) <= 1 || t.stride(d) != 0, "attnlab::", op, ": ", name,
                  " must not be an expanded view (stride 0 in dimension ", d, "), got sizes ", t.sizes(),
                  " and strides ", t.strides());
}

// matvec.cpp: y = s ⊙ (x Wᵀ) + b, and act(x W₁ᵀ ⊙ s₁ + b₁) ⊙ (x W₃ᵀ ⊙ s₃ + b₃)
at::Tensor matvec(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias);
at::Tensor gated_matvec(const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& s1,
                        const std::optional<at::Tensor>& b1, const at::Tensor& w3, const std::optional<at::Tensor>& s3,
                        const std::optional<at::Tensor>& b3, int64_t act);

// short_attention.cpp takes SHORT_ROWS queries at a time: a causal block computes only the keys up to its
// last query's (16-aligned), so at 64 keys 10 of the 16 16 × 16 score tiles.
constexpr int64_t SHORT_ROWS = 16;

// A window w wider than any distance between a query and a key (< Lq + Lk) sees what w = Lq + Lk sees: clamped to
// it, so t ± w cannot overflow
inline int64_t clamp_window(int64_t window, int64_t Lq, int64_t Lk) { return window > Lq + Lk ? Lq + Lk : window; }

// The keys [lo, hi) query row i sees (at position t = i + Lk − Lq): causal j ≤ t, a window w: t − j < w (without
// causal |t − j| < w); both bounds non-decreasing in i
struct Seen {
  int64_t Lq, Lk, window;
  bool causal;
  int64_t lo(int64_t i) const { return std::clamp<int64_t>(window > 0 ? i + Lk - Lq - window + 1 : 0, 0, Lk); }
  int64_t hi(int64_t i) const {
    const int64_t t = i + Lk - Lq;
    return std::clamp<int64_t>(causal ? t + 1 : (window > 0 ? t + window : Lk), lo(i), Lk);
  }
  // a block of rows [i0, i1): the keys any of them sees, widened to multiples of 16 (within Lk)
  std::pair<int64_t, int64_t> cols(int64_t i0, int64_t i1) const {
    const int64_t b0 = lo(i0) / 16 * 16, b1 = std::min<int64_t>(Lk, (hi(i1 - 1) + 15) / 16 * 16);
    return {b0, std::max(b0, b1)};
  }
};

}  // namespace attnlab_native
