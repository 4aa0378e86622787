// What the training kernels' files (train.cpp, int8_train.cpp, short_attention.cpp, gpt_block.cpp) share, and the
// functions one calls in another (gpt_block.cpp's layer is made of the others' passes).
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

// int8_train.cpp
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
