// The vector code of train.cpp: rows of float32 or bfloat16 read and written through vec.h's `ld` / `st` (bf16
// widened by a 16-bit shift; narrowed with round-to-nearest-even, NaN kept a NaN, as PyTorch's cast does), the
// arithmetic in float32. Compiled per instruction set (isa_regions.h), on top of decode_body.h.

#include "decode_body.h"
#include "gemm_body.h"

// the lanes of the vector at j whose keys j + i lie in [c0, c1)
inline VI seen(VI lane, int64_t j, int64_t c0, int64_t c1) {
  return (lane + static_cast<int32_t>(j) >= static_cast<int32_t>(c0)) &
         (lane + static_cast<int32_t>(j) < static_cast<int32_t>(c1));
}

// One row of the softmax of masked, scaled scores:  p_j = e^(κ s_j − m) / Σ_k e^(κ s_k − m) for j in the visible
// keys [c0, c1), m = max_k κ s_k, and p_j = 0 outside (a row that sees nothing is all 0). Writes p (float32) and,
// when pc is not null, p again in pc's type. A NaN score makes the row's visible keys NaN; an infinite one too (∞ −
// ∞), as softmax. Whole vectors throughout, the mask a lane test (a causal row's length varies by one each row:
// scalar loops over its edges cost more than its exponentials); vectors with no visible key skip the exponential.
template <class T>
inline void softmax_row(const T* s, int64_t n, int64_t c0, int64_t c1, float scale, float* p, T* pc) {
  VI lane;
  for (int i = 0; i < L; ++i) lane[i] = i;
  const int64_t full = n - n % L;  // [full, n): the last, partial vector (read and written through ld_part/st_part)
  VF vmax = splat(-INFINITY);
  VI nans = VI{};  // (a NaN compares false: the max would skip it)
  const auto scaled = [&](int64_t j, VF x) {  // κ s, −∞ where masked
    x *= splat(scale);
    if (!(j >= c0 && j + L <= c1)) x = seen(lane, j, c0, c1) ? x : splat(-INFINITY);
    nans |= x != x;
    vmax = x > vmax ? x : vmax;
    return x;
  };
  int64_t j = 0;
  for (; j < full; j += L) store(p + j, scaled(j, ld(s + j)));
  if (j < n) st_part(p + j, scaled(j, ld_part(s + j, n - j, 0.f)), n - j);
  float m = -INFINITY;
  bool nan = false;
  for (int i = 0; i < L; ++i) m = std::max(m, vmax[i]), nan = nan || nans[i] != 0;
  if (nan) m = NAN;
  VF total = splat(0.f);
  const auto exps = [&](int64_t j, VF x) {  // e^(x − m), 0 where masked (a NaN m: the visible lanes NaN)
    if (j >= c1 || j + L <= c0) return splat(0.f);
    VF e = exp_nonpositive(x - splat(m));  // x ≤ m: no overflow clamp needed
    if (!(j >= c0 && j + L <= c1)) e = seen(lane, j, c0, c1) ? e : splat(0.f);
    total += e;
    return e;
  };
  for (j = 0; j < full; j += L) store(p + j, exps(j, load(p + j)));
  if (j < n) st_part(p + j, exps(j, ld_part(p + j, n - j, -INFINITY)), n - j);
  const VF inv = splat(c1 > c0 ? 1.f / hsum(total) : 0.f);
  const auto normed = [&](int64_t j, VF e) {  // e / Σ, 0 where masked (also when Σ is NaN)
    if (j >= c1 || j + L <= c0) return splat(0.f);
    e *= inv;
    return j >= c0 && j + L <= c1 ? e : (seen(lane, j, c0, c1) ? e : splat(0.f));
  };
  for (j = 0; j < full; j += L) {  // p ← p / Σ, and its copy in pc's type
    const VF v = normed(j, load(p + j));
    store(p + j, v);
    if (pc != nullptr) st(pc + j, v);
  }
  if (j < n) {
    const VF v = normed(j, ld_part(p + j, n - j, 0.f));
    st_part(p + j, v, n - j);
    if (pc != nullptr) st_part(pc + j, v, n - j);
  }
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

// ---- the short backend's fused attention (one (batch, head) a task; train.cpp's short_attention) ----
using attnlab_native::SHORT_ROWS;

template <class T>
inline void row_to_f32(const T* x, int64_t n, float* y) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(y + j, ld(x + j));
  for (; j < n; ++j) y[j] = ld1(x + j);
}
template <class T>
inline void row_from_f32(const float* x, int64_t n, T* y) {
  int64_t j = 0;
  for (; j + L <= n; j += L) st(y + j, load(x + j));
  for (; j < n; ++j) st1(y + j, x[j]);
}

// One (batch, head): P = softmax(κ Q Kᵀ) on the visible keys, O = P V. q, k, v, o: rows of D elements with row
// strides sq, sk, sv, so; p (Lq, Lk) float32 receives P for the backward (only the blocks of keys computed: those
// the backward reads). float32 operands are read and written in place by the block products (only Kᵀ is copied,
// transposed); bfloat16 ones are converted into `buf` first. `buf` holds Lq·D + 2·Lk·D + SHORT_ROWS·D floats.
template <class T>
void short_attention_task(const T* q, int64_t sq, const T* k, int64_t sk, const T* v, int64_t sv, T* o, int64_t so,
                          float* p, int64_t D, const attnlab_native::Seen& seen, float scale, float* buf) {
  constexpr bool direct = std::is_same_v<T, float>;
  const int64_t Lq = seen.Lq, Lk = seen.Lk;
  float *Q = buf, *Kt = Q + Lq * D, *V = Kt + D * Lk, *O = V + Lk * D;
  int64_t lq = D, lv = D;  // the row strides of the Q and V the products read
  if constexpr (direct) {
    transpose_rows(k, sk, D, 0, Lk, Kt, Lk);
    Q = const_cast<float*>(q), V = const_cast<float*>(v), lq = sq, lv = sv;
  } else {
    for (int64_t i = 0; i < Lq; ++i) row_to_f32(q + i * sq, D, Q + i * D);
    for (int64_t j = 0; j < Lk; ++j) row_to_f32(k + j * sk, D, V + j * D);  // K's rows, for a moment
    transpose_rows(V, D, D, 0, Lk, Kt, Lk);
    for (int64_t j = 0; j < Lk; ++j) row_to_f32(v + j * sv, D, V + j * D);
  }
  for (int64_t i0 = 0; i0 < Lq; i0 += SHORT_ROWS) {
    const int64_t i1 = std::min(Lq, i0 + SHORT_ROWS), m = i1 - i0;
    const auto [b0, b1] = seen.cols(i0, i1);
    const int64_t n = b1 - b0;
    float* P = p + i0 * Lk + b0;
    float* out = O;
    int64_t lo = D;
    if constexpr (direct) out = o + i0 * so, lo = so;
    if (n > 0) {
      gemm_own(m, n, D, 1.f, Q + i0 * lq, lq, 1, Kt + b0, Lk, false, P, Lk, false);
      for (int64_t r = 0; r < m; ++r) {
        float* row = P + r * Lk;
        softmax_row<float>(row, n, seen.lo(i0 + r) - b0, seen.hi(i0 + r) - b0, scale, row, nullptr);
      }
      gemm_own(m, D, n, 1.f, P, Lk, 1, V + b0 * lv, lv, false, out, lo, false);
    } else {
      for (int64_t r = 0; r < m; ++r) std::fill(out + r * lo, out + r * lo + D, 0.f);
    }
    if constexpr (!direct) {
      for (int64_t r = 0; r < m; ++r) row_from_f32(O + r * D, D, o + (i0 + r) * so);
    }
  }
}

// Its gradients from the forward's P, κ dS = κ P ∘ (dP − rowsum(dP ∘ P)):
//   dP = dO Vᵀ,  dQ = (κ dS) K,  dK = (κ dS)ᵀ Q,  dV = Pᵀ dO        (dK, dV summed over the blocks of queries)
// float32 operands and gradients are read and written in place by the block products (only Vᵀ is copied,
// transposed; dK and dV zeroed, then summed into); bfloat16 ones go through `buf` in float32. `buf` holds
// 2·Lq·D + 4·Lk·D + SHORT_ROWS·(Lk + D) floats.
template <class T>
void short_attention_grad_task(const T* q, int64_t sq, const T* k, int64_t sk, const T* v, int64_t sv,
                               const float* p, const T* go, int64_t sgo, T* dq, int64_t sdq, T* dk, int64_t sdk,
                               T* dv, int64_t sdv, int64_t D, const attnlab_native::Seen& seen, float scale,
                               float* buf) {
  constexpr bool direct = std::is_same_v<T, float>;
  const int64_t Lq = seen.Lq, Lk = seen.Lk;
  float *Q = buf, *G = Q + Lq * D, *Kf = G + Lq * D, *Vt = Kf + Lk * D, *dK = Vt + D * Lk, *dV = dK + Lk * D;
  float *dP = dV + Lk * D, *dQ = dP + SHORT_ROWS * Lk;
  int64_t lq = D, lg = D, lk = D, ldk = D, ldv = D, ldq = D;  // the row strides the products read and write
  if constexpr (direct) {
    transpose_rows(v, sv, D, 0, Lk, Vt, Lk);
    Q = const_cast<float*>(q), G = const_cast<float*>(go), Kf = const_cast<float*>(k), dK = dk, dV = dv;
    lq = sq, lg = sgo, lk = sk, ldk = sdk, ldv = sdv, ldq = sdq;
    for (int64_t j = 0; j < Lk; ++j) {
      std::fill(dk + j * sdk, dk + j * sdk + D, 0.f), std::fill(dv + j * sdv, dv + j * sdv + D, 0.f);
    }
  } else {
    for (int64_t i = 0; i < Lq; ++i) row_to_f32(q + i * sq, D, Q + i * D), row_to_f32(go + i * sgo, D, G + i * D);
    for (int64_t j = 0; j < Lk; ++j) row_to_f32(v + j * sv, D, dK + j * D), row_to_f32(k + j * sk, D, Kf + j * D);
    transpose_rows(dK, D, D, 0, Lk, Vt, Lk);  // (V's rows in dK's room until it is zeroed)
    std::fill(dK, dK + 2 * Lk * D, 0.f);  // dK and dV
  }
  for (int64_t i0 = 0; i0 < Lq; i0 += SHORT_ROWS) {
    const int64_t i1 = std::min(Lq, i0 + SHORT_ROWS), m = i1 - i0;
    const auto [b0, b1] = seen.cols(i0, i1);
    const int64_t n = b1 - b0;
    const float* P = p + i0 * Lk + b0;
    float* gq = dQ;
    if constexpr (direct) gq = dq + i0 * sdq;
    if (n > 0) {
      gemm_own(m, n, D, 1.f, G + i0 * lg, lg, 1, Vt + b0, Lk, false, dP, Lk, false);
      for (int64_t r = 0; r < m; ++r) softmax_grad_row<float>(dP + r * Lk, P + r * Lk, n, scale, dP + r * Lk);
      gemm_own(m, D, n, 1.f, dP, Lk, 1, Kf + b0 * lk, lk, false, gq, ldq, false);
      gemm_own(n, D, m, 1.f, dP, 1, Lk, Q + i0 * lq, lq, true, dK + b0 * ldk, ldk, false);
      gemm_own(n, D, m, 1.f, P, 1, Lk, G + i0 * lg, lg, true, dV + b0 * ldv, ldv, false);
    } else {
      for (int64_t r = 0; r < m; ++r) std::fill(gq + r * ldq, gq + r * ldq + D, 0.f);
    }
    if constexpr (!direct) {
      for (int64_t r = 0; r < m; ++r) row_from_f32(dQ + r * D, D, dq + (i0 + r) * sdq);
    }
  }
  if constexpr (!direct) {
    for (int64_t j = 0; j < Lk; ++j) {
      row_from_f32(dK + j * D, D, dk + j * sdk), row_from_f32(dV + j * D, D, dv + j * sdv);
    }
  }
}

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

// ---- int8 products (attnlab.adapt.int8_training): symmetric quantisation with one scale per row or column ----

// round(a s) half to even for |a s| < 2²²: a s + 1.5·2²³ rounded once (fmadd: the exact product, as the tests'
// reference; one rule on every lane and tail, spelt out: left to GCC's contraction, which register of a row was fused
// changed with the loop's shape, and the scalar tails were not)
inline VF rounded(VF a, VF s) { return fmadd(a, s, splat(12582912.f)) - splat(12582912.f); }
inline int8_t round_q(float a, float s) {
  return static_cast<int8_t>(static_cast<int32_t>(fmadd1(a, s, 12582912.f) - 12582912.f));
}
// integers in [−127, 127] to int8: L lanes (st_q), or four registers' (st_q4)
inline void st_q(int8_t* q, VF r) { store_i8(q, __builtin_convertvector(r, VI)); }
inline void st_q4(int8_t* q, VF r0, VF r1, VF r2, VF r3) {
  store_i8x4(q, __builtin_convertvector(r0, VI), __builtin_convertvector(r1, VI), __builtin_convertvector(r2, VI),
             __builtin_convertvector(r3, VI));
}

// m = max_j |x_j c_j| over a row (c null: 1); NaN if the row holds a NaN. Four accumulators: the max is a chain
template <class T>
inline float absmax_row(const T* x, const float* c, int64_t n) {
  const auto at = [&](int64_t j) { return vabs(c ? ld(x + j) * load(c + j) : ld(x + j)); };
  VF m0 = splat(0.f), m1 = m0, m2 = m0, m3 = m0, s = m0;
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) {
    const VF a0 = at(j), a1 = at(j + L), a2 = at(j + 2 * L), a3 = at(j + 3 * L);
    m0 = vmax(m0, a0), m1 = vmax(m1, a1), m2 = vmax(m2, a2), m3 = vmax(m3, a3);
    s += (a0 + a1) + (a2 + a3);
  }
  for (; j + L <= n; j += L) {
    const VF a = at(j);
    m0 = vmax(m0, a), s += a;
  }
  float r = tree_max(vmax(vmax(m0, m1), vmax(m2, m3)));
  bool nan = any_nan(s);
  for (; j < n; ++j) {
    const float a = std::fabs(c ? ld1(x + j) * c[j] : ld1(x + j));
    r = a > r ? a : r, nan |= std::isnan(a);
  }
  return nan ? NAN : r;
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

// q_j = round(x_j c_j inv) (c null: 1)
template <class T>
inline void quantize_row(const T* x, const float* c, int64_t n, float inv, int8_t* q) {
  const VF s = splat(inv);
  const auto at = [&](int64_t j) { return rounded(c ? ld(x + j) * load(c + j) : ld(x + j), s); };
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) st_q4(q + j, at(j), at(j + L), at(j + 2 * L), at(j + 3 * L));
  for (; j + L <= n; j += L) st_q(q + j, at(j));
  for (; j < n; ++j) q[j] = round_q(c ? ld1(x + j) * c[j] : ld1(x + j), inv);
}

// One row's part of both quantisations: returns max_j |x_j c_j| (c null: 1; NaN if the row holds a NaN) and folds
// the row into its block's column partials: m_j = max(m_j, |x_j|), sum_j += x_j (NaN kept in sum_j)
template <class T>
inline float row_col_stats(const T* x, const float* c, int64_t n, float* m, float* sum) {
  VF rm0 = splat(0.f), rm1 = rm0, rs = rm0;
  int64_t j = 0;
  for (; j + 2 * L <= n; j += 2 * L) {
    const VF a0 = ld(x + j), a1 = ld(x + j + L);
    const VF b0 = vabs(a0), b1 = vabs(a1);
    const VF r0 = c ? vabs(a0 * load(c + j)) : b0, r1 = c ? vabs(a1 * load(c + j + L)) : b1;
    rm0 = vmax(rm0, r0), rm1 = vmax(rm1, r1), rs += r0 + r1;
    store(m + j, vmax(load(m + j), b0)), store(m + j + L, vmax(load(m + j + L), b1));
    store(sum + j, load(sum + j) + a0), store(sum + j + L, load(sum + j + L) + a1);
  }
  for (; j + L <= n; j += L) {
    const VF a = ld(x + j), b = vabs(a), r = c ? vabs(a * load(c + j)) : b;
    rm0 = vmax(rm0, r), rs += r;
    store(m + j, vmax(load(m + j), b)), store(sum + j, load(sum + j) + a);
  }
  float r = tree_max(vmax(rm0, rm1));
  bool nan = any_nan(rs);
  for (; j < n; ++j) {
    const float a = ld1(x + j), b = std::fabs(a), rc = c ? std::fabs(a * c[j]) : b;
    r = rc > r ? rc : r, nan |= std::isnan(rc);
    m[j] = b > m[j] ? b : m[j], sum[j] += a;
  }
  return nan ? NAN : r;
}

// q_j = round(x_j c_j inv) and qc_j = round(x_j cinv_j): a row of both quantisations in one read
template <class T>
inline void quantize_row_col(const T* x, const float* c, int64_t n, float inv, const float* cinv, int8_t* q,
                             int8_t* qc) {
  const VF s = splat(inv);
  const auto row = [&](VF a, int64_t j) { return rounded(c ? a * load(c + j) : a, s); };
  const auto col = [&](VF a, int64_t j) { return rounded(a, load(cinv + j)); };
  int64_t j = 0;
  for (; j + 4 * L <= n; j += 4 * L) {
    const VF a0 = ld(x + j), a1 = ld(x + j + L), a2 = ld(x + j + 2 * L), a3 = ld(x + j + 3 * L);
    st_q4(q + j, row(a0, j), row(a1, j + L), row(a2, j + 2 * L), row(a3, j + 3 * L));
    st_q4(qc + j, col(a0, j), col(a1, j + L), col(a2, j + 2 * L), col(a3, j + 3 * L));
  }
  for (; j + L <= n; j += L) {
    const VF a = ld(x + j);
    st_q(q + j, row(a, j)), st_q(qc + j, col(a, j));
  }
  for (; j < n; ++j) {
    const float a = ld1(x + j);
    q[j] = round_q(c ? a * c[j] : a, inv);
    qc[j] = round_q(a, cinv[j]);
  }
}

// dst[c · ds + r] = src[r · ss + c] for r < rows, c < cols: a block of bytes transposed by 16 × 16 tiles (four
// rounds of byte interleaves of rows i and i + 8: each round rotates the 8 bits of (row, column) by one), a column of
// tiles at a time so each row of dst receives its bytes of the block in one run
inline void transpose_bytes(const int8_t* src, int64_t ss, int64_t rows, int64_t cols, int8_t* dst, int64_t ds) {
  int64_t c0 = 0, whole = rows - rows % 16;
  for (; whole && c0 + 16 <= cols; c0 += 16) {
    for (int64_t r0 = 0; r0 < whole; r0 += 16) {
      X16 a[16], b[16];
      for (int i = 0; i < 16; ++i) a[i] = loadu<X16>(src + (r0 + i) * ss + c0);
      for (int round = 0; round < 4; ++round) {
        for (int i = 0; i < 8; ++i) b[2 * i] = zip_lo<1>(a[i], a[i + 8]), b[2 * i + 1] = zip_hi<1>(a[i], a[i + 8]);
        for (int i = 0; i < 16; ++i) a[i] = b[i];
      }
      for (int i = 0; i < 16; ++i) storeu(dst + (c0 + i) * ds + r0, a[i]);
    }
    for (int64_t c = c0; c < c0 + 16; ++c) {  // the rows past the whole tiles
      for (int64_t r = whole; r < rows; ++r) dst[c * ds + r] = src[r * ss + c];
    }
  }
  for (int64_t c = c0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) dst[c * ds + r] = src[r * ss + c];
  }
}

// y_j = acc_j (rs cs_j) + b_j  (cs null: 1, b null: 0; the add fused, see fmadd): a row of an int32 product back to
// float
// L lanes of it (cs, b at the lanes' columns, or null); int8_gemm.h rescales its tiles' registers with it
inline VF dequant_vec(VI a, float rs, const float* cs, const float* b) {
  const VF s = cs ? splat(rs) * load(cs) : splat(rs), v = __builtin_convertvector(a, VF);
  return b ? fmadd(v, s, load(b)) : v * s;
}
template <class T>
inline void dequant_row(const int32_t* acc, float rs, const float* cs, const float* b, int64_t n, T* y) {
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    VI a;
    std::memcpy(&a, acc + j, sizeof a);
    st(y + j, dequant_vec(a, rs, cs ? cs + j : nullptr, b ? b + j : nullptr));
  }
  for (; j < n; ++j) {
    const float s = cs ? rs * cs[j] : rs, v = static_cast<float>(acc[j]);
    st1(y + j, b ? fmadd1(v, s, b[j]) : v * s);
  }
}
