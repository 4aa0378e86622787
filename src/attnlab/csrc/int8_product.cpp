// The int8 products of attnlab.adapt.int8_training's layers (int8_quantize.cpp rounds their operands,
// int8_train.cpp is the layer) and their rescaling, each one call:
//
//   attnlab::dequantize(acc, rs, cs, b, bf16) -> y
//       acc (R, n) int32 (an int8 product): y_rj = acc_rj (rs_r cs_j) + b_j (cs absent: 1, b absent: 0), float32
//       or bfloat16
//   attnlab::int8_product(a, b, rs, cs, bias, bf16, max_inner) -> y
//       y = diag(rs) (a b) diag(cs) + bias for int8 a (M, K), b (K, N): torch._int_mm's exact int32 sums, in parts
//       of max_inner terms along K (each rescaled, the parts summed in float32) where an int32 could overflow
//   attnlab::int8_kernel(mode) -> previous mode
//       which product int8_product runs with AVX2 (-1 auto, 0 torch._int_mm, 1 int8_gemm.h's; -2 only asks)
//
// Rows are split over torch's threads; the vector code is the library's instruction set
// (native.h's cpu_isa(), isa_regions.h). A NaN stays a NaN through every pass (the pipeline reports it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "train.h"

namespace {

#define ATTNLAB_BODY "int8_rows.h"
#include "isa_regions.h"
#include "int8_gemm.h"

using namespace attnlab_native;

// the rescaling of an (R, n) int32 product: rs (R,), cs and b (n,) or absent, contiguous float32
void check_scales(const at::Tensor& rs, const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& b,
                  int64_t R, int64_t n, const char* op) {
  attnlab_native::check_f32(rs, op, "rs");
  ATTNLAB_CHECK(rs.dim() == 1 && rs.size(0) == R, "attnlab::", op, ": rs must be (", R, ",), got ", rs.sizes());
  for (const auto* t : {&cs, &b}) {
    if (*t) {
      attnlab_native::check_f32(**t, op, t == &cs ? "cs" : "b");
      ATTNLAB_CHECK((*t)->dim() == 1 && (*t)->size(0) == n, "attnlab::", op, ": ", t == &cs ? "cs" : "b",
                    " must be (", n, ",), got ", (*t)->sizes());
    }
  }
}

at::Tensor dequantize(const at::Tensor& acc, const at::Tensor& rs, const std::optional<at::Tensor>& cs,
                      const std::optional<at::Tensor>& b, bool bf16) {
  ATTNLAB_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(),
                "attnlab::dequantize: acc must be a contiguous int32 CPU tensor (rows, n), got ", acc.scalar_type(),
                " ", acc.sizes());
  const int64_t R = acc.size(0), n = acc.size(1);
  check_scales(rs, cs, b, R, n, "dequantize");
  at::Tensor y = at::empty({R, n}, acc.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const int32_t* A = acc.data_ptr<int32_t>();
    const float *RS = rs.data_ptr<float>(), *CS = cs ? cs->data_ptr<float>() : nullptr;
    const float* B = b ? b->data_ptr<float>() : nullptr;
    T* Y = data<T>(y);
    const auto row = ISA_FN(dequant_row<T>);
    at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) row(A + r * n, RS[r], CS, B, n, Y + r * n);
    });
  };
  bf16 ? run(uint16_t{}) : run(float{});
  return y;
}

// Which product int8_product takes with AVX2 (isa 1): kOneDnn torch._int_mm, kOurs int8_gemm.h's, kAuto (the
// default) ours where oneDNN has no VNNI instruction (vpdpbusd: 32 multiply-adds in one instruction, where ours takes
// two) — a CPU without AVX-VNNI or AVX512-VNNI, or oneDNN capped by ONEDNN_MAX_CPU_ISA to AVX2 or below
enum Int8Kernel : int64_t { kAuto = -1, kOneDnn = 0, kOurs = 1 };
std::atomic<int64_t> int8_kernel_mode{kAuto};

bool onednn_has_vnni() {
  static const bool has = [] {
#if defined(__x86_64__) || defined(_M_X64)
    if (!__builtin_cpu_supports("avx512vnni") && !__builtin_cpu_supports("avxvnni")) return false;
#else
    return true;  // (ours is x86 only)
#endif
    for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
      const char* cap = std::getenv(name);
      if (!cap) continue;
      std::string v(cap);
      for (auto& ch : v) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      if (v == "SSE41" || v == "AVX" || v == "AVX2") return false;
    }
    return true;
  }();
  return has;
}

// sets the mode (kAuto, kOneDnn, kOurs; −2 leaves it) and returns the one before
int64_t int8_kernel(int64_t mode) {
  ATTNLAB_CHECK(mode >= -2 && mode <= 1, "attnlab::int8_kernel: mode must be -2 (ask), -1 (auto), 0 (oneDNN) or 1 "
                "(ours), got ", mode);
  return mode == -2 ? int8_kernel_mode.load() : int8_kernel_mode.exchange(mode);
}

// torch._int_mm's sums. oneDNN's VNNI path (torch 2.13, AVX512-VNNI) reads memory it never wrote for an
// operand of one row or one column whose strides are not the plain ones ((33, 1).t(): sizes (1, 33), strides (1, 1),
// which torch calls contiguous: a known oneDNN-path bug, pytorch/pytorch#195066, open); such an operand is a vector,
// copied here with the plain strides first.
at::Tensor int_mm(const at::Tensor& a, const at::Tensor& b) {
  auto plain = [](const at::Tensor& t) {
    const bool vector = t.size(0) == 1 || t.size(1) == 1;
    return vector && (t.stride(0) != t.size(1) || t.stride(1) != 1) ? t.clone(at::MemoryFormat::Contiguous) : t;
  };
  return at::_int_mm(plain(a), plain(b));
}

}  // namespace

namespace attnlab_native {

// whether int8_product takes int8_gemm.h's product for K terms a sum: AVX2, the int8_kernel setting, K's size
bool own_int8_takes(int64_t K, int64_t max_inner) {
#ifdef ATTNLAB_ISAS
  const int64_t mode = int8_kernel_mode.load(std::memory_order_relaxed);
  return attnlab_native::cpu_isa() == 1 && (mode == kOurs || (mode == kAuto && !onednn_has_vnni())) &&
         K <= std::min(max_inner, u8s8::MAX_K);
#else
  return false;
#endif
}

// whether it takes it for int8 a (M, K) and b (K, N) (where b lies within ±63): own_int8_takes, and a's layout and size
bool own_int8_for(const at::Tensor& a, const at::Tensor& b, int64_t max_inner) {
  return own_int8_takes(a.size(1), max_inner) && a.stride(1) == 1 && a.size(0) > 0 && b.size(1) > 0;
}

// int8_product, with res (where given: float32 (M, N) contiguous, bf16 false) added to the result: res + y, each sum
// rounded once after y's (our product adds it in its rescaling; oneDNN's path in place after)
at::Tensor int8_product_plus(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rs,
                             const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& bias, bool bf16,
                             int64_t max_inner, const at::Tensor* res) {
  ATTNLAB_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kChar && a.dim() == 2 && b.dim() == 2 &&
                    a.size(1) == b.size(0),
                "attnlab::int8_product: a (M, K) and b (K, N) must be int8, got ", a.scalar_type(), " ", a.sizes(),
                " and ", b.scalar_type(), " ", b.sizes());
  ATTNLAB_CHECK(max_inner >= 1, "attnlab::int8_product: max_inner must be >= 1, got ", max_inner);
  attnlab_native::check_not_expanded(a, "int8_product", "a");
  attnlab_native::check_not_expanded(b, "int8_product", "b");
  ATTNLAB_CHECK(!res || (!bf16 && res->scalar_type() == at::kFloat && res->is_contiguous() && res->dim() == 2 &&
                         res->size(0) == a.size(0) && res->size(1) == b.size(1)),
                "attnlab::int8_product: a residual must be float32 (M, N) contiguous with a float32 result");
  const int64_t K = a.size(1);
#ifdef ATTNLAB_ISAS
  if (own_int8_for(a, b, max_inner)) {
    // AVX2 without VNNI: our product with the rescaling fused (int8_gemm.h), where b's entries lie within ±63
    const int64_t M = a.size(0), N = b.size(1);
    check_scales(rs, cs, bias, M, N, "int8_product");
    at::Tensor y = at::empty({M, N}, rs.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    const float *RS = rs.data_ptr<float>(), *CS = cs ? cs->data_ptr<float>() : nullptr;
    const float* BIAS = bias ? bias->data_ptr<float>() : nullptr;
    const int8_t *A = a.data_ptr<int8_t>(), *B = b.data_ptr<int8_t>();
    const bool done = bf16 ? u8s8::product(A, a.stride(0), M, K, B, b.stride(0), b.stride(1), N, RS, CS, BIAS,
                                           data<uint16_t>(y))
                           : u8s8::product(A, a.stride(0), M, K, B, b.stride(0), b.stride(1), N, RS, CS, BIAS,
                                           data<float>(y), res ? res->data_ptr<float>() : nullptr);
    if (done) return y;
  }
#endif
  if (res) return int8_product_plus(a, b, rs, cs, bias, bf16, max_inner, nullptr).add_(*res);
  if (K <= max_inner) return dequantize(int_mm(a, b), rs, cs, bias, bf16);
  at::Tensor out;
  for (int64_t k0 = 0; k0 < K; k0 += max_inner) {
    const int64_t k1 = std::min(K, k0 + max_inner);
    at::Tensor part = dequantize(int_mm(a.slice(1, k0, k1), b.slice(0, k0, k1)), rs, cs,
                                 k0 == 0 ? bias : std::nullopt, false);
    out = k0 == 0 ? part : out.add_(part);
  }
  return bf16 ? out.to(at::kBFloat16) : out;
}

at::Tensor int8_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rs,
                        const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& bias, bool bf16,
                        int64_t max_inner) {
  return int8_product_plus(a, b, rs, cs, bias, bf16, max_inner, nullptr);
}

}  // namespace attnlab_native

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("dequantize(Tensor acc, Tensor rs, Tensor? cs, Tensor? b, bool bf16) -> Tensor");
  m.def("int8_product(Tensor a, Tensor b, Tensor rs, Tensor? cs, Tensor? bias, bool bf16, int max_inner) "
        "-> Tensor");
  m.def("int8_kernel(int mode) -> int", &int8_kernel);  // (no tensors: one kernel for every dispatch key)
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("int8_product", &attnlab_native::int8_product);
}
