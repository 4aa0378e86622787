// The vector code of train.cpp: rows of float32 or bfloat16 read and written through `ld` / `st` (bf16 widened by a
// 16-bit shift; narrowed with round-to-nearest-even, NaN kept a NaN, as PyTorch's cast does), the arithmetic in
// float32. Compiled per instruction set (isa_regions.h), on top of decode_body.h's `exp_any`.

#include "decode_body.h"

using VU = uint32_t __attribute__((vector_size(4 * L)));
using VH = uint16_t __attribute__((vector_size(2 * L)));

inline VF ld(const float* p) { return load(p); }
inline VF ld(const uint16_t* p) {
  VH h;
  std::memcpy(&h, p, sizeof h);
  const VU u = __builtin_convertvector(h, VU) << 16;
  VF f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void st(float* p, VF v) { store(p, v); }
inline void st(uint16_t* p, VF v) {
  VU u;
  std::memcpy(&u, &v, sizeof u);
  const VU rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
  const VU quiet = (u >> 16) | 0x40u;  // a NaN stays a (quiet) NaN: rounding could carry it into inf
  const VH h = __builtin_convertvector(v != v ? quiet : rounded, VH);
  std::memcpy(p, &h, sizeof h);
}
// one element (the tails of rows)
template <class T>
inline float ld1(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return *p;
  } else {
    const uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
}
template <class T>
inline void st1(T* p, float x) {
  if constexpr (sizeof(T) == 4) {
    *p = x;
  } else {
    VF v = splat(0.f);
    v[0] = x;
    T out[L];
    st(out, v);
    *p = out[0];
  }
}

// One row of the softmax of masked, scaled scores:  p_j = e^(κ s_j − m) / Σ_k e^(κ s_k − m) for j in the visible
// keys [c0, c1), m = max_k κ s_k, and p_j = 0 outside (a row that sees nothing is all 0). Writes p (float32) and,
// when pc is not null, p again in pc's type. A NaN score makes the row NaN; an infinite one too (∞ − ∞), as softmax.
template <class T>
inline void softmax_row(const T* s, int64_t n, int64_t c0, int64_t c1, float scale, float* p, T* pc) {
  for (int64_t j = 0; j < c0; ++j) p[j] = 0.f;
  for (int64_t j = c1; j < n; ++j) p[j] = 0.f;
  if (c1 > c0) {
    VF vmax = splat(-INFINITY);
    int64_t j = c0;
    VI nans = VI{};  // (a NaN compares false: the max would skip it)
    for (; j + L <= c1; j += L) {
      const VF x = ld(s + j) * splat(scale);
      nans |= x != x;
      vmax = x > vmax ? x : vmax;
      st(p + j, x);
    }
    float m = -INFINITY;
    bool nan = false;
    for (int i = 0; i < L; ++i) m = std::max(m, vmax[i]), nan = nan || nans[i] != 0;
    for (; j < c1; ++j) {
      p[j] = ld1(s + j) * scale;
      nan = nan || std::isnan(p[j]);
      m = std::max(m, p[j]);
    }
    if (nan) m = NAN;
    const float sum = exp_shifted(p, c0, c1, m);  // (decode_body.h)
    const float r = 1.f / sum;
    for (j = c0; j + L <= c1; j += L) store(p + j, load(p + j) * splat(r));
    for (; j < c1; ++j) p[j] *= r;
  }
  if (pc == nullptr) return;
  int64_t j = 0;
  for (; j + L <= n; j += L) st(pc + j, load(p + j));
  for (; j < n; ++j) st1(pc + j, p[j]);
}

// One row of the softmax's backward pass, scaled:  ds_j = κ p_j (dp_j − Σ_k dp_k p_k)
template <class T>
inline void softmax_grad_row(const T* dp, const float* p, int64_t n, float scale, T* ds) {
  VF acc = splat(0.f);
  int64_t j = 0;
  for (; j + L <= n; j += L) acc += ld(dp + j) * load(p + j);
  float dot = hsum(acc);
  for (; j < n; ++j) dot += ld1(dp + j) * p[j];
  for (j = 0; j + L <= n; j += L) st(ds + j, splat(scale) * load(p + j) * (ld(dp + j) - splat(dot)));
  for (; j < n; ++j) st1(ds + j, scale * p[j] * (ld1(dp + j) - dot));
}
