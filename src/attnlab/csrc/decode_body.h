// The vector code of decode.cpp — activations, dot products, norms, the attention over a cache — written once in
// vec.h's vocabulary (`VF`: L floats) and compiled per instruction set (isa_regions.h).

[[gnu::always_inline]] inline VF sigmoid(VF a) { return splat(1.f) / (splat(1.f) + exp_any(-a)); }

// erf(x) = sign(x) (1 − t e^{−x²} P(t)), t = 1 / (1 + 0.3275911 |x|): Abramowitz & Stegun 7.1.26, |error| ≤ 1.5e-7;
// `e` = e^{−x²} (the caller computes it: GELU's derivative reuses it)
[[gnu::always_inline]] inline VF erf_with(VF x, VF e) {
  const VF ax = x < splat(0.f) ? -x : x;
  const VF t = recip(splat(1.f) + splat(0.3275911f) * ax);
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
