// The vector code of train.cpp (and decode.cpp's RMSNorm): rows of float32 or bfloat16 read and written through vec.h's `ld` / `st` (bf16
// widened by a 16-bit shift; narrowed with round-to-nearest-even, NaN kept a NaN, as PyTorch's cast does), the
// arithmetic in float32. Compiled per instruction set (isa_regions.h), on top of decode_body.h.

#include "decode_body.h"

// One row of RMSNorm:  y_j = (x_j r) w_j,  r = (Σ_k x_k² / n + ε)^(-1/2);  returns r (the training backward's)
template <class T>
inline float rms_norm_row(const T* x, const float* w, int64_t n, float eps, T* y) {
  VF acc = splat(0.f);
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const VF v = ld(x + j);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; j < n; ++j) ss += ld1(x + j) * ld1(x + j);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (j = 0; j + L <= n; j += L) st(y + j, (ld(x + j) * splat(r)) * load(w + j));
  for (; j < n; ++j) st1(y + j, (ld1(x + j) * r) * w[j]);
  return r;
}

// Its backward, x̂ = x r recomputed, h = dy ⊙ w:  dx = r (h − x̂ · mean(h ⊙ x̂)),  dw += dy ⊙ x̂ (dw: its block's)
template <class T>
inline void rms_norm_grad_row(const T* dy, const T* x, const float* w, float r, int64_t n, T* dx, float* dw) {
  VF acc = splat(0.f);
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const VF xh = ld(x + j) * splat(r), g = ld(dy + j);
    acc += (g * load(w + j)) * xh;
    store(dw + j, load(dw + j) + g * xh);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    const float xh = ld1(x + j) * r, g = ld1(dy + j);
    sum += (g * w[j]) * xh;
    dw[j] += g * xh;
  }
  const float c = sum / static_cast<float>(n);
  for (j = 0; j + L <= n; j += L) {
    const VF xh = ld(x + j) * splat(r);
    st(dx + j, splat(r) * (ld(dy + j) * load(w + j) - xh * splat(c)));
  }
  for (; j < n; ++j) st1(dx + j, r * (ld1(dy + j) * w[j] - (ld1(x + j) * r) * c));
}

// One row of rotary embedding, half-split pairs (i, i + h):  y_i = x_i cos_i − σ x_{i+h} sin_i,
// y_{i+h} = x_{i+h} cos_i + σ x_i sin_i;  σ = 1 rotates by +φ (the forward), σ = −1 by −φ (its backward: Rᵀ = R(−φ)).
template <class T>
inline void rope_row(const T* x, const float* c, const float* s, int64_t h, float sigma, T* y) {
  int64_t i = 0;
  for (; i + L <= h; i += L) {
    const VF a = ld(x + i), b = ld(x + h + i), cv = load(c + i), sv = load(s + i) * splat(sigma);
    st(y + i, a * cv - b * sv);
    st(y + h + i, b * cv + a * sv);
  }
  for (; i < h; ++i) {
    const float a = ld1(x + i), b = ld1(x + h + i), sv = s[i] * sigma;
    st1(y + i, a * c[i] - b * sv);
    st1(y + h + i, b * c[i] + a * sv);
  }
}

// n elements of a (gated) activation in training:  h = act(g) ⊙ u  (u null: 1); ACT a compile-time code
template <int64_t ACT, class T>
inline void act_span(const T* g, const T* u, int64_t n, T* h) {
  const auto one = [&](VF a, VF uv) __attribute__((always_inline)) { return act_vec(ACT, a) * uv; };
  int64_t i = 0;
  for (; i + L <= n; i += L) st(h + i, one(ld(g + i), u ? ld(u + i) : splat(1.f)));
  if (i < n) st_part(h + i, one(ld_part(g + i, n - i, 0.f), u ? ld_part(u + i, n - i, 0.f) : splat(1.f)), n - i);
}

// A plain activation's forward keeping its derivative:  h = act(g),  d = act'(g)  (the backward is then dh ⊙ d)
template <int64_t ACT, class T>
inline void act_keep(const T* g, int64_t n, T* h, T* d) {
  const auto one = [&](int64_t i, VF a) __attribute__((always_inline)) {
    VF f, df;
    act_and_grad(ACT, a, f, df);
    if (i + L <= n) {
      st(h + i, f), st(d + i, df);
    } else {
      st_part(h + i, f, n - i), st_part(d + i, df, n - i);
    }
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) one(i, ld(g + i));
  if (i < n) one(i, ld_part(g + i, n - i, 0.f));
}

// Its backward:  dg = dh ⊙ u ⊙ act'(g),  du = dh ⊙ act(g)  (u, du null: the plain activation)
template <int64_t ACT, class T>
inline void act_grad(const T* dh, const T* g, const T* u, int64_t n, T* dg, T* du) {
  const auto one = [&](int64_t i, VF d, VF a, VF uv) __attribute__((always_inline)) {
    VF f, df;
    act_and_grad(ACT, a, f, df);
    if (i + L <= n) {
      st(dg + i, d * uv * df);
      if (du) st(du + i, d * f);
    } else {
      st_part(dg + i, d * uv * df, n - i);
      if (du) st_part(du + i, d * f, n - i);
    }
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) one(i, ld(dh + i), ld(g + i), u ? ld(u + i) : splat(1.f));
  if (i < n) {
    one(i, ld_part(dh + i, n - i, 0.f), ld_part(g + i, n - i, 0.f), u ? ld_part(u + i, n - i, 0.f) : splat(1.f));
  }
}

// the two above for a code known at run time: one branch per call, none per element
#define ATTNLAB_ACT_CASES(fn, ...)                 \
  switch (act) {                                  \
    case 0: return fn<0, T>(__VA_ARGS__);         \
    case 1: return fn<1, T>(__VA_ARGS__);         \
    case 2: return fn<2, T>(__VA_ARGS__);         \
    case 3: return fn<3, T>(__VA_ARGS__);         \
    case 4: return fn<4, T>(__VA_ARGS__);         \
    case 6: return fn<6, T>(__VA_ARGS__);         \
    default: return fn<5, T>(__VA_ARGS__);        \
  }
template <class T>
inline void act_train_span(int64_t act, const T* g, const T* u, int64_t n, T* h) {
  ATTNLAB_ACT_CASES(act_span, g, u, n, h)
}
template <class T>
inline void act_keep_span(int64_t act, const T* g, int64_t n, T* h, T* d) {
  ATTNLAB_ACT_CASES(act_keep, g, n, h, d)
}
template <class T>
inline void act_grad_span(int64_t act, const T* dh, const T* g, const T* u, int64_t n, T* dg, T* du) {
  ATTNLAB_ACT_CASES(act_grad, dh, g, u, n, dg, du)
}
#undef ATTNLAB_ACT_CASES

// ---- gradient clipping (the trainer's): Σ x² of a span, four float32 accumulators of L lanes, summed in double ----
inline double sum_squares(const float* x, int64_t n) {
  VF a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    const VF v0 = load(x + i), v1 = load(x + i + L), v2 = load(x + i + 2 * L), v3 = load(x + i + 3 * L);
    a0 += v0 * v0, a1 += v1 * v1, a2 += v2 * v2, a3 += v3 * v3;
  }
  for (; i + L <= n; i += L) {
    const VF v = load(x + i);
    a0 += v * v;
  }
  double s = 0.0;
  for (int k = 0; k < L; ++k) s += double(a0[k]) + double(a1[k]) + double(a2[k]) + double(a3[k]);
  for (; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

// true when no x_j is NaN or ±inf: Σ (x_j − x_j) stays 0, where an infinity or a NaN makes it NaN (four running sums)
template <class T>
inline bool finite_span(const T* x, int64_t n) {
  VF z0 = splat(0.f), z1 = z0, z2 = z0, z3 = z0;
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) {
    const VF a = ld(x + j), b = ld(x + j + L), c = ld(x + j + 2 * L), d = ld(x + j + 3 * L);
    z0 += a - a, z1 += b - b, z2 += c - c, z3 += d - d;
  }
  for (; j + L <= n; j += L) {
    const VF a = ld(x + j);
    z0 += a - a;
  }
  float r = 0.f;
  for (; j < n; ++j) {
    const float a = ld1(x + j);
    r += a - a;
  }
  return !any_nan((z0 + z1) + (z2 + z3)) && r == r;
}
