// The vector code of flash_forward.cpp and flash_backward.cpp: the element-wise passes over one row of a score
// block, written once with GCC's vector extensions and compiled per instruction set (isa_regions.h), on top of
// decode_body.h's `exp_any`.
// A row's visible keys are one interval [c0, c1) of the block's n columns (causal and sliding-window masks are
// intervals); the columns outside it get probability 0.

#include "decode_body.h"
#include "gemm_body.h"

inline void zero_outside(float* s, int64_t n, int64_t c0, int64_t c1) {
  if (c1 <= c0) c0 = c1 = n;
  std::memset(s, 0, sizeof(float) * c0);
  std::memset(s + c1, 0, sizeof(float) * (n - c1));
}

// The forward pass's online softmax on one row of scores s (n columns, visible [c0, c1)), with the row's running
// max m and sum l:  m' = max(m, max_j s_j);  s_j ← e^(s_j − m');  l ← e^(m − m') l + Σ_j s_j;  m ← m'.
// Returns α = e^(m − m'), the factor for the row's accumulated output (1 when the row sees nothing here).
// A NaN score makes the row's sum NaN; an overflowed (+inf) one gives inf − inf = NaN: never a silent number.
inline float online_softmax_row(float* s, int64_t n, int64_t c0, int64_t c1, float& m, float& l) {
  zero_outside(s, n, c0, c1);
  if (c1 <= c0) return 1.f;
  VF vmax = splat(-INFINITY);
  int64_t j = c0;
  for (; j + L <= c1; j += L) {
    const VF v = load(s + j);
    vmax = v > vmax ? v : vmax;
  }
  float mx = -INFINITY;
  for (int i = 0; i < L; ++i) mx = std::max(mx, vmax[i]);
  for (; j < c1; ++j) mx = std::max(mx, s[j]);
  const float m_new = std::max(m, mx);
  const float alpha = m == -INFINITY ? 0.f : std::exp(m - m_new);
  const float sum = exp_shifted(s, c0, c1, m_new);
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// The backward pass's probabilities of one row, P_j = e^(s_j − LSE) on [c0, c1), 0 elsewhere, in place
inline void probs_row(float* s, int64_t n, int64_t c0, int64_t c1, float lse) {
  zero_outside(s, n, c0, c1);
  if (c1 > c0) exp_shifted(s, c0, c1, lse);
}

// dS = P ∘ (dP − Δ) in place in dp (one row of n columns; Δ = rowsum(dO ∘ O))
inline void dscores_row(const float* p, float* dp, int64_t n, float delta) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(dp + j, load(p + j) * (load(dp + j) - splat(delta)));
  for (; j < n; ++j) dp[j] = p[j] * (dp[j] - delta);
}

// y[0..n) *= a
inline void scale_row(float* y, int64_t n, float a) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(y + j, load(y + j) * splat(a));
  for (; j < n; ++j) y[j] *= a;
}

// tanh x lane by lane within a few ulp for every x (NaN stays NaN, ±inf gives ±1): where |x| < 0.625 an odd
// polynomial (Cephes' tanhf), since there 1 − 2 / (e^{2x} + 1) would lose a small x's digits to the cancellation
// (all of them once e^{2x} rounds to 1); elsewhere that formula on |x|, with x's sign
[[gnu::always_inline]] inline VF tanh_any(VF x) {
  const VF ax = x < splat(0.f) ? -x : x;
  const VF z = x * x;
  VF p = splat(-5.70498872745e-3f);
  p = p * z + splat(2.06390887954e-2f);
  p = p * z + splat(-5.37397155531e-2f);
  p = p * z + splat(1.33314422036e-1f);
  p = p * z + splat(-3.33332819422e-1f);
  const VF big = splat(1.f) - splat(2.f) / (splat(1.f) + exp_any(splat(2.f) * ax));
  return ax < splat(0.625f) ? p * z * x + x : (x < splat(0.f) ? -big : big);
}

// The score_mods the kernel computes itself (codes of flash.h's Mod), on the columns [c0, c1) of one row whose
// column 0 is the key at distance d0 = (key position − query position):
//   ALiBi        s_j += m · (d0 + j)        symmetric ALiBi  s_j −= m · |d0 + j|        softcap  s_j = c · tanh(s_j / c)
inline void mod_row(int64_t mod, float* s, int64_t c0, int64_t c1, float param, int64_t d0) {
  if (mod == 0 || c1 <= c0) return;
  VF ramp;
  for (int i = 0; i < L; ++i) ramp[i] = static_cast<float>(i);
  int64_t j = c0;
  for (; j < c1; j += L) {
    const int64_t n = std::min<int64_t>(L, c1 - j);
    VF v = splat(0.f);
    std::memcpy(&v, s + j, sizeof(float) * n);
    if (mod == 3) {
      v = splat(param) * tanh_any(v / splat(param));  // c · tanh(s / c): s itself, to round-off, where s ≪ c
    } else {
      VF d = ramp + static_cast<float>(d0 + j);  // exact: |distance| < 2²⁴
      if (mod == 2) d = d < splat(0.f) ? -d : d;
      v += (mod == 1 ? splat(param) : splat(-param)) * d;
    }
    std::memcpy(s + j, &v, sizeof(float) * n);
  }
}

// softcap's derivative written in its output y = c · tanh(s / c): g_j = 1 − (y_j / c)², over [0, n)
inline void softcap_grad_row(const float* y, float* g, int64_t n, float cap) {
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const VF t = load(y + j) * splat(1.f / cap);
    store(g + j, splat(1.f) - t * t);
  }
  for (; j < n; ++j) g[j] = 1.f - (y[j] / cap) * (y[j] / cap);
}

// y[0..n) *= g[0..n)
inline void mul_row(float* y, const float* g, int64_t n) {
  int64_t j = 0;
  for (; j + L <= n; j += L) store(y + j, load(y + j) * load(g + j));
  for (; j < n; ++j) y[j] *= g[j];
}
