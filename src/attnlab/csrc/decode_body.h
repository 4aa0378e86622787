// The vector code of decode.cpp, written once with GCC's vector extensions (`VF`: L floats) and included in each
// instruction set's `#pragma GCC target` region and namespace, where `L` is that set's width (16 AVX-512, 8 AVX2,
// 4 SSE / portable): the compiler emits that set's instructions for the same source.

using VF = float __attribute__((vector_size(4 * L)));
using VI = int32_t __attribute__((vector_size(4 * L)));

inline VF load(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}
inline void store(float* p, VF v) { std::memcpy(p, &v, sizeof v); }
inline VF splat(float a) { return VF{} + a; }
inline float hsum(VF v) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += v[i];
  return s;
}

// e^x = 2ⁿ · e^r with n = round(x log₂e), r = x − n ln 2 (ln 2 in two parts, exact products), e^r ≈ 1 + r + r² p(r)
// on |r| ≤ ln2/2 (Cephes expf's polynomial: relative error ~1e-7, about an ulp of float32), 2ⁿ built in the exponent
// bits; for x in [−87.3, 88.7] (NaN stays NaN): the callers below clamp or select outside it
[[gnu::always_inline]] inline VF exp_in_range(VF x) {
  const VF magic = splat(12582912.f);
  const VF n = (x * splat(1.44269504088896341f) + magic) - magic;
  const VF r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  VF p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const VF er = p * (r * r) + r + splat(1.f);
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  VF two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return er * two_n;
}

// e^x, lane by lane (NaN stays NaN): x < −87.3 → 0, x > 88.7 → +inf
[[gnu::always_inline]] inline VF exp_any(VF x) {
  const VF lo = splat(-87.3f), hi = splat(88.7f);
  const VF e = exp_in_range(x > hi ? hi : (x < lo ? lo : x));
  return x < lo ? splat(0.f) : (x > hi ? splat(INFINITY) : e);
}

// e^x for x ≤ 0 (NaN stays NaN): without the upper clamp a non-positive argument never needs; x < −87.3 → 0 (there
// n < −126 builds garbage bits, never kept)
[[gnu::always_inline]] inline VF exp_nonpositive(VF x) {
  return x < splat(-87.3f) ? splat(0.f) : exp_in_range(x);
}

// 1 / d lane by lane: the hardware's estimate (AVX-512 14 bits, AVX2 12) and one Newton step r (2 − d r), ~1 ulp
// (AVX-512) / ~2 ulp (AVX2) where a vdivps costs several times the two FMAs; the exact quotient elsewhere
template <int W>
[[gnu::always_inline]] inline VF recip(VF d) {
#if defined(__x86_64__) || defined(_M_X64)
  if constexpr (W == 16 || W == 8) {
    using R = std::conditional_t<W == 16, __m512, __m256>;
    R v;
    std::memcpy(&v, &d, sizeof v);
    if constexpr (W == 16) v = _mm512_rcp14_ps(v); else v = _mm256_rcp_ps(v);
    VF r;
    std::memcpy(&r, &v, sizeof r);
    return r * (splat(2.f) - d * r);
  }
#endif
  return splat(1.f) / d;
}

[[gnu::always_inline]] inline VF sigmoid(VF a) { return splat(1.f) / (splat(1.f) + exp_any(-a)); }

// erf(x) = sign(x) (1 − t e^{−x²} P(t)), t = 1 / (1 + 0.3275911 |x|): Abramowitz & Stegun 7.1.26, |error| ≤ 1.5e-7;
// `e` = e^{−x²} (the caller computes it: GELU's derivative reuses it)
[[gnu::always_inline]] inline VF erf_with(VF x, VF e) {
  const VF ax = x < splat(0.f) ? -x : x;
  const VF t = recip<L>(splat(1.f) + splat(0.3275911f) * ax);
  VF p = splat(1.061405429f);
  p = p * t + splat(-1.453152027f);
  p = p * t + splat(1.421413741f);
  p = p * t + splat(-0.284496736f);
  p = p * t + splat(0.254829592f);
  const VF y = splat(1.f) - p * t * e;
  return x < splat(0.f) ? -y : y;
}

// act(a) and act'(a) lane by lane, the codes of native.h's Act (NaN in, NaN out, except ReLU's derivative: 0); where
// only act(a) is used (act_vec) the compiler drops act'
[[gnu::always_inline]] inline void act_and_grad(int64_t act, VF a, VF& f, VF& df) {
  switch (act) {
    case 0: {  // σ(a): σ (1 − σ)
      f = sigmoid(a);
      df = f * (splat(1.f) - f);
      return;
    }
    case 1: {  // a Φ(a), Φ(a) = ½ (1 + erf(a/√2)): Φ(a) + a φ(a), φ(a) = e^(−a²/2) / √(2π)
      const VF z = a * splat(0.70710678118654752f);
      const VF g = exp_nonpositive(-z * z);  // e^(−a²/2), within an ulp of z's rounding
      const VF e = splat(1.f) + erf_with(z, g);
      f = splat(0.5f) * a * e;
      df = splat(0.5f) * e + a * splat(0.39894228040143268f) * g;
      return;
    }
    case 2: {  // ½ a (1 + tanh u), u = √(2/π)(a + 0.044715 a³): ½ (1 + tanh u) + ½ a (1 − tanh² u) u'
      const VF u = splat(0.79788456080286536f) * (a + splat(0.044715f) * a * a * a);
      const VF th = splat(1.f) - splat(2.f) / (splat(1.f) + exp_any(splat(2.f) * u));
      const VF du = splat(0.79788456080286536f) * (splat(1.f) + splat(3.f * 0.044715f) * a * a);
      f = splat(0.5f) * a * (splat(1.f) + th);
      df = splat(0.5f) * (splat(1.f) + th) + splat(0.5f) * a * (splat(1.f) - th * th) * du;
      return;
    }
    case 3: {  // a σ(a): σ (1 + a (1 − σ))
      const VF sg = sigmoid(a);
      f = a * sg;
      df = sg * (splat(1.f) + a * (splat(1.f) - sg));
      return;
    }
    case 4: {  // max(a, 0): [a > 0]
      f = a < splat(0.f) ? splat(0.f) : a;
      df = a > splat(0.f) ? splat(1.f) : splat(0.f);
      return;
    }
    case 6: {  // max(a, 0)²: 2 max(a, 0)
      const VF r = a < splat(0.f) ? splat(0.f) : a;
      f = r * r;
      df = splat(2.f) * r;
      return;
    }
    default: {  // a σ(1.702 a): σ + 1.702 a σ (1 − σ)
      const VF sg = sigmoid(splat(1.702f) * a);
      f = a * sg;
      df = sg + splat(1.702f) * a * sg * (splat(1.f) - sg);
      return;
    }
  }
}

// act(a), the codes of native.h's Act; NaN stays NaN
[[gnu::always_inline]] inline VF act_vec(int64_t act, VF a) {
  VF f, df;
  act_and_grad(act, a, f, df);
  return f;
}

inline void activate_row(int64_t act, float* y, const float* g, int64_t n) {
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    VF v = act_vec(act, load(y + i));
    if (g) v *= load(g + i);
    store(y + i, v);
  }
  for (; i < n; ++i) {
    VF one = splat(0.f);
    one[0] = y[i];
    y[i] = act_vec(act, one)[0] * (g ? g[i] : 1.f);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  VF acc = splat(0.f);
  int64_t i = 0;
  for (; i + L <= n; i += L) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] = (x[i] − μ) · r · w[i] + b[i], μ = Σ x / n, r = (Σ (x − μ)² / n + ε)^(-1/2) (torch's LayerNorm: biased
// variance; w, b may be null: 1 and 0)
inline void layer_norm_row(const float* x, const float* w, const float* b, float* y, int64_t n, float eps) {
  VF acc = splat(0.f);
  int64_t i = 0;
  for (; i + L <= n; i += L) acc += load(x + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i];
  const float mu = sum / static_cast<float>(n);
  acc = splat(0.f);
  for (i = 0; i + L <= n; i += L) {
    const VF d = load(x + i) - splat(mu);
    acc += d * d;
  }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += (x[i] - mu) * (x[i] - mu);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i) y[i] = (x[i] - mu) * r * (w ? w[i] : 1.f) + (b ? b[i] : 0.f);
}

// e^(s[j] − c) in place over [c0, c1), returning Σ of them
inline float exp_shifted(float* s, int64_t c0, int64_t c1, float c) {
  VF total = splat(0.f);
  int64_t j = c0;
  for (; j + L <= c1; j += L) {
    const VF p = exp_any(load(s + j) - splat(c));
    store(s + j, p);
    total += p;
  }
  if (j < c1) {  // the tail as one vector, padded with −∞ (e^−∞ = 0 adds nothing): one exponential, not c1 − j
    float t[L];
    const int64_t r = c1 - j;
    for (int64_t i = 0; i < L; ++i) t[i] = i < r ? s[j + i] - c : -INFINITY;
    const VF p = exp_any(load(t));
    store(t, p);
    for (int64_t i = 0; i < r; ++i) s[j + i] = t[i];
    total += p;
  }
  return hsum(total);
}

// out (D) = Σ_j softmax(scale · q·K_j)_j V_j over the S rows of K and V (row stride D); s: S floats of scratch
inline void attend_one(const float* q, const float* K, const float* Vv, int64_t S, int64_t D, float scale,
                       float* s, float* out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < S; ++j) {
    s[j] = dot(q, K + j * D, D) * scale;
    m = std::max(m, s[j]);
  }
  if (!std::isfinite(m)) {  // a NaN or an overflowed score: NaN out, as softmax's arithmetic gives (the caller checks)
    for (int64_t d = 0; d < D; ++d) out[d] = NAN;
    return;
  }
  const float sum = exp_shifted(s, 0, S, m);
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < S; ++j) {
    const float p = s[j];
    const float* v = Vv + j * D;
    int64_t d = 0;
    for (; d + L <= D; d += L) store(out + d, load(out + d) + splat(p) * load(v + d));
    for (; d < D; ++d) out[d] += p * v[d];
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}
