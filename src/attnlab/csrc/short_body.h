// The vector code of short_attention.cpp: one (batch, head) of the short backend's fused attention, forward and
// backward — the block products of gemm_body.h and the softmax rows below — compiled per instruction set
// (isa_regions.h), on top of train_body.h.

#include "train_body.h"
#include "gemm_body.h"

using attnlab_native::SHORT_ROWS;

// the lanes of the vector at j whose keys j + i lie in [c0, c1)
inline VI seen(VI lane, int64_t j, int64_t c0, int64_t c1) {
  return (lane + static_cast<int32_t>(j) >= static_cast<int32_t>(c0)) &
         (lane + static_cast<int32_t>(j) < static_cast<int32_t>(c1));
}

// One row of the softmax of masked, scaled scores, in place:  p_j = e^(κ s_j − m) / Σ_k e^(κ s_k − m) for j in the
// visible keys [c0, c1), m = max_k κ s_k, and p_j = 0 outside (a row that sees nothing is all 0). A NaN score makes
// the row's visible keys NaN; an infinite one too (∞ − ∞), as softmax. Whole vectors throughout, the mask a lane
// test (a causal row's length varies by one each row: scalar loops over its edges cost more than its exponentials);
// vectors with no visible key skip the exponential.
inline void softmax_row(float* p, int64_t n, int64_t c0, int64_t c1, float scale) {
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
  for (; j < full; j += L) store(p + j, scaled(j, load(p + j)));
  if (j < n) st_part(p + j, scaled(j, ld_part(p + j, n - j, 0.f)), n - j);
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
  for (j = 0; j < full; j += L) store(p + j, normed(j, load(p + j)));
  if (j < n) st_part(p + j, normed(j, ld_part(p + j, n - j, 0.f)), n - j);
}

// One row of the softmax's backward pass, scaled:  ds_j = κ p_j (dp_j − Σ_k dp_k p_k)  (ds may be dp)
inline void softmax_grad_row(const float* dp, const float* p, int64_t n, float scale, float* ds) {
  VF acc = splat(0.f);
  int64_t j = 0;
  for (; j + L <= n; j += L) acc += load(dp + j) * load(p + j);
  float dot = hsum(acc);
  for (; j < n; ++j) dot += dp[j] * p[j];
  for (j = 0; j + L <= n; j += L) store(ds + j, splat(scale) * load(p + j) * (load(dp + j) - splat(dot)));
  for (; j < n; ++j) ds[j] = scale * p[j] * (dp[j] - dot);
}

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
        softmax_row(row, n, seen.lo(i0 + r) - b0, seen.hi(i0 + r) - b0, scale);
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
      for (int64_t r = 0; r < m; ++r) softmax_grad_row(dP + r * Lk, P + r * Lk, n, scale, dP + r * Lk);
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

