// What the training kernels' files (train.cpp, int8_quantize.cpp, int8_product.cpp, int8_train.cpp,
// short_attention.cpp, gpt_block.cpp) share, and the functions one calls in another (gpt_block.cpp's layer is made
// of the others' passes, int8_train.cpp's of the int8 roundings and products).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "native.h"

namespace attnlab_native {

// contiguous float32 or bfloat16 on the CPU
inline void check_fb(const at::Tensor& t, const char* op, const char* name) {
  ATTNLAB_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.is_contiguous(),
                "attnlab::", op, ": ", name, " must be a contiguous float32 or bfloat16 CPU tensor, got ",
                t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

template <class T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// train.cpp
std::tuple<at::Tensor, at::Tensor> act_train(const at::Tensor& g, const std::optional<at::Tensor>& u, int64_t act,
                                             bool keep);
bool all_finite(at::TensorList ts);

// int8_quantize.cpp: the int8 roundings (levels in [1, 127], else check_levels raises); quantize_rows_cols_laid
// with `transposed` false writes the columns' rounding as x lies and returns its (n, R) view
void check_levels(int64_t levels, const char* op);
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, const std::optional<at::Tensor>& c,
                                                 int64_t levels);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows_cols_laid(
    const at::Tensor& x, const std::optional<at::Tensor>& c, int64_t levels, int64_t col_levels, bool transposed);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_rows_cols(
    const at::Tensor& x, const std::optional<at::Tensor>& c, int64_t levels, int64_t col_levels);

// int8_product.cpp: the int8 products; whether int8_gemm.h's product takes a sum of K terms (own_int8_takes) or a
// (M, K) times b (K, N) (own_int8_for); int8_product_plus adds res (float32 (M, N), or null) to the result
bool own_int8_takes(int64_t K, int64_t max_inner);
bool own_int8_for(const at::Tensor& a, const at::Tensor& b, int64_t max_inner);
at::Tensor int8_product_plus(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rs,
                             const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& bias, bool bf16,
                             int64_t max_inner, const at::Tensor* res);
at::Tensor int8_product(const at::Tensor& a, const at::Tensor& b, const at::Tensor& rs,
                        const std::optional<at::Tensor>& cs, const std::optional<at::Tensor>& bias, bool bf16,
                        int64_t max_inner);

// int8_train.cpp: the int8 linear layer
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_linear_bounded(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t left, int64_t right,
    bool cols, bool bf16, double* bound, const at::Tensor* res = nullptr);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_linear(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t left, int64_t right,
    bool cols, bool bf16);
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_linear_backward(
    const at::Tensor& g, const at::Tensor& qw, const at::Tensor& sw, const at::Tensor& qxt, const at::Tensor& sxc,
    int64_t left, int64_t right, bool dx, bool dw, bool db, bool dx_bf16);

// short_attention.cpp
std::array<at::Tensor, 3> unpacked(const at::Tensor& qkv, int64_t H);
std::tuple<at::Tensor, at::Tensor> short_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   double scale, bool causal, int64_t window);
void short_attention_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& p,
                                   const at::Tensor& d_out, const at::Tensor& dq, const at::Tensor& dk,
                                   const at::Tensor& dv, double scale, bool causal, int64_t window);

}  // namespace attnlab_native
