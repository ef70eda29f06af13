// The Adam element update written once over a small vector interface V (see adam_scalar.cc,
// adam_avx2.cc, adam_avx512.cc for the three V's). Included only by those files, each compiled
// for its own instruction set.
//
// Per element, in torch's order of operations:
//   g = grad * inv_grad_scale                (AMP: GradScaler.unscale_, when s.unscale)
//   g = maximize ? -g : g;            g = fma(wd, p, g)  (Adam, L2 penalty)
//   p *= 1 - lr * wd                         (AdamW)
//   m = lerp(m, g, 1 - beta1)                (fused multiply-add, like torch's vectorized lerp)
//   v = v * beta2 + (1 - beta2) * g * g
//   vmax = max(vmax, v)                      (amsgrad; NaN where either is, as torch.maximum)
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(1 - beta2^t) + eps)
#pragma once

#include "core/optim/adam.h"

namespace tierlift {
namespace adam_detail {
// Anonymous: each ISA file gets its own copies, compiled for its own target (see dtype.h).
namespace {

template <class V>
struct Consts {
  typename V::R beta2, one_minus_beta1, one_minus_beta2, eps, wd, decay, neg_step_size, bc2_sqrt,
      inv_grad_scale;
  explicit Consts(const AdamScalars& s)
      : beta2(V::set1(s.beta2)),
        one_minus_beta1(V::set1(s.one_minus_beta1)),
        one_minus_beta2(V::set1(s.one_minus_beta2)),
        eps(V::set1(s.eps)),
        wd(V::set1(s.weight_decay)),
        decay(V::set1(s.decay)),
        neg_step_size(V::set1(s.neg_step_size)),
        bc2_sqrt(V::set1(s.bc2_sqrt)),
        inv_grad_scale(V::set1(s.inv_grad_scale)) {}
};

template <class V, DType kT>
inline typename V::R load_as_f32(const void* base, int64_t i) {
  if constexpr (kT == DType::kFloat32) return V::load(static_cast<const float*>(base) + i);
  if constexpr (kT == DType::kBFloat16) return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  if constexpr (kT == DType::kFloat16) return V::load_f16(static_cast<const uint16_t*>(base) + i);
}

// The gradient at i as fp32, unscaled (GradScaler's scale taken out) when kUnscale: a compile-time
// switch, so the path without a scale is the same code as before.
template <class V, DType kGrad, bool kUnscale>
inline typename V::R load_grad(const Consts<V>& c, const void* grad, int64_t i) {
  const typename V::R g = load_as_f32<V, kGrad>(grad, i);
  if constexpr (kUnscale) return V::mul(g, c.inv_grad_scale);
  return g;
}

template <class V, DType kT>
inline void store_from_f32(void* base, int64_t i, typename V::R x) {
  if constexpr (kT == DType::kFloat32) V::store(static_cast<float*>(base) + i, x);
  if constexpr (kT == DType::kBFloat16) V::store_bf16(static_cast<uint16_t*>(base) + i, x);
  if constexpr (kT == DType::kFloat16) V::store_f16(static_cast<uint16_t*>(base) + i, x);
}

// The register arithmetic of one step up to the new moments: weight decay on p (AdamW) or g
// (Adam), then m and v. Shared with the compact-state kernel (adam_compact_impl.h), which loads
// and stores m and v in other formats around the same operations.
template <class V>
inline void decay_and_moments(const AdamScalars& s, const Consts<V>& c, typename V::R g,
                              typename V::R& p, typename V::R& m, typename V::R& v) {
  if (s.maximize) g = V::neg(g);
  if (s.decoupled) {
    p = V::mul(p, c.decay);
  } else if (s.weight_decay != 0.0f) {
    g = V::fmadd(c.wd, p, g);  // torch's add(alpha=) is a fused multiply-add
  }
  m = V::fmadd(c.one_minus_beta1, V::sub(g, m), m);
  v = V::add(V::mul(v, c.beta2), V::mul(V::mul(c.one_minus_beta2, g), g));
}

// The weight after the step, from the decayed p, the new m and the v the step divides by.
template <class V>
inline typename V::R apply_update(const Consts<V>& c, typename V::R p, typename V::R m,
                                  typename V::R v) {
  const typename V::R denom = V::add(V::div(V::sqrt(v), c.bc2_sqrt), c.eps);
  return V::add(p, V::div(V::mul(c.neg_step_size, m), denom));
}

// A state store: non-temporal where kStream (out of place, into memory the step does not read:
// no read-for-ownership of the destination's lines), else an ordinary one. The same bits.
template <class V, bool kStream>
inline void put(float* p, typename V::R x) {
  if constexpr (kStream) {
    V::stream(p, x);
  } else {
    V::store(p, x);
  }
}

// `t` has its sources resolved (with_sources): loads come from the *_from pointers, stores go to
// the state pointers; in place they are the same.
template <class V, DType kGrad, DType kCopy, bool kUnscale, bool kStream = false>
inline void update(const AdamScalars& s, const Consts<V>& c, const AdamTensor& t, int64_t i) {
  using R = typename V::R;
  R p = V::load(t.param_from + i);
  R m = V::load(t.exp_avg_from + i);
  R v = V::load(t.exp_avg_sq_from + i);
  decay_and_moments<V>(s, c, load_grad<V, kGrad, kUnscale>(c, t.grad, i), p, m, v);
  put<V, kStream>(t.exp_avg + i, m);
  put<V, kStream>(t.exp_avg_sq + i, v);
  if (s.amsgrad) {
    v = V::max_nan(V::load(t.max_exp_avg_sq_from + i), v);
    put<V, kStream>(t.max_exp_avg_sq + i, v);
  }
  p = apply_update<V>(c, p, m, v);
  put<V, kStream>(t.param + i, p);
  if constexpr (kCopy != DType::kNone) store_from_f32<V, kCopy>(t.param_copy, i, p);
}

// adam_memory_pass: update()'s loads and stores with one add per stored stream in place of the
// arithmetic, so it moves exactly the step's bytes at no compute cost.
template <class V, DType kGrad, DType kCopy>
inline void touch(const AdamTensor& t, int64_t i) {
  using R = typename V::R;
  const R g = load_as_f32<V, kGrad>(t.grad, i);
  const R p = V::add(V::load(t.param_from + i), g);
  V::store(t.exp_avg + i, V::add(V::load(t.exp_avg_from + i), g));
  V::store(t.exp_avg_sq + i, V::add(V::load(t.exp_avg_sq_from + i), g));
  V::store(t.param + i, p);
  if constexpr (kCopy != DType::kNone) store_from_f32<V, kCopy>(t.param_copy, i, p);
}

// Whether the vector body may store the new state non-temporally: out of place (every state
// pointer apart from its source), each destination aligned to the vector at `begin`.
template <class V>
inline bool streams(const AdamScalars& s, const AdamTensor& t, int64_t begin) {
  if (V::kWidth == 1) return false;
  const auto apart = [&](const float* to, const float* from) {
    return to != from && reinterpret_cast<uintptr_t>(to + begin) % (V::kWidth * sizeof(float)) == 0;
  };
  return apart(t.param, t.param_from) && apart(t.exp_avg, t.exp_avg_from) &&
         apart(t.exp_avg_sq, t.exp_avg_sq_from) &&
         (!s.amsgrad || apart(t.max_exp_avg_sq, t.max_exp_avg_sq_from));
}

// Vector body plus a scalar tail (S is the scalar V, so tails round exactly like the body). Out
// of place into aligned memory the body's stores are non-temporal (fenced at the end).
template <class V, class S, DType kGrad, DType kCopy, bool kUnscale>
void update_range(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  const Consts<V> c(s);
  int64_t i = begin;
  if (streams<V>(s, t, begin)) {
    for (; i + V::kWidth <= end; i += V::kWidth) {
      update<V, kGrad, kCopy, kUnscale, true>(s, c, t, i);
    }
    V::fence();
  }
  for (; i + V::kWidth <= end; i += V::kWidth) update<V, kGrad, kCopy, kUnscale>(s, c, t, i);
  if (i < end) {
    const Consts<S> cs(s);
    for (; i < end; ++i) update<S, kGrad, kCopy, kUnscale>(s, cs, t, i);
  }
}

template <class V, class S, DType kGrad, DType kCopy>
void range(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  if (s.memory_only) {
    int64_t i = begin;
    for (; i + V::kWidth <= end; i += V::kWidth) touch<V, kGrad, kCopy>(t, i);
    for (; i < end; ++i) touch<S, kGrad, kCopy>(t, i);
    return;
  }
  if (s.unscale) return update_range<V, S, kGrad, kCopy, true>(s, t, begin, end);
  update_range<V, S, kGrad, kCopy, false>(s, t, begin, end);
}

template <class V, class S, DType kGrad>
void dispatch_copy(const AdamScalars& s, const AdamTensor& t, int64_t begin, int64_t end) {
  switch (t.copy_type) {
    case DType::kFloat32:
      return range<V, S, kGrad, DType::kFloat32>(s, t, begin, end);
    case DType::kBFloat16:
      return range<V, S, kGrad, DType::kBFloat16>(s, t, begin, end);
    case DType::kFloat16:
      return range<V, S, kGrad, DType::kFloat16>(s, t, begin, end);
    default:
      return range<V, S, kGrad, DType::kNone>(s, t, begin, end);
  }
}

template <class V, class S>
void dispatch(const AdamScalars& s, const AdamTensor& in, int64_t begin, int64_t end) {
  const AdamTensor t = with_sources(in);
  switch (t.grad_type) {
    case DType::kBFloat16:
      return dispatch_copy<V, S, DType::kBFloat16>(s, t, begin, end);
    case DType::kFloat16:
      return dispatch_copy<V, S, DType::kFloat16>(s, t, begin, end);
    default:
      return dispatch_copy<V, S, DType::kFloat32>(s, t, begin, end);
  }
}

// Plain C++ lanes of width 1; every ISA file uses it for its tails.
struct ScalarVec {
  using R = float;
  static constexpr int kWidth = 1;
  static R load(const float* p) { return *p; }
  static void store(float* p, R x) { *p = x; }
  static void stream(float* p, R x) { *p = x; }
  static void fence() {}
  static R load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static void store_bf16(uint16_t* p, R x) { *p = f32_to_bf16(x); }
  static R load_f16(const uint16_t* p) { return f16_to_f32(*p); }
  static void store_f16(uint16_t* p, R x) { *p = f32_to_f16(x); }
  static R set1(float x) { return x; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R mul(R a, R b) { return a * b; }
  static R div(R a, R b) { return a / b; }
  static R fmadd(R a, R b, R c) { return __builtin_fmaf(a, b, c); }
  static R sqrt(R a) { return __builtin_sqrtf(a); }
  static R max(R a, R b) { return a < b ? b : a; }
  // max, but NaN where b is NaN too (max already keeps a NaN a), as torch.maximum: amsgrad's
  // running max must not drop a NaN v.
  static R max_nan(R a, R b) { return b != b ? b : max(a, b); }
  static R neg(R a) { return -a; }
  // 32-bit integer lanes, for the compact-state v code (adam_compact_impl.h).
  using I = int32_t;
  static I load_u8(const uint8_t* p) { return *p; }
  static void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static I as_int(R x) { return static_cast<I>(f32_bits(x)); }
  static R as_float(I x) { return bits_f32(static_cast<uint32_t>(x)); }
  static I set1_i(int32_t x) { return x; }
  static I add_i(I a, I b) {
    return static_cast<I>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
  }
  static I and_i(I a, I b) { return a & b; }
  static I min_i(I a, I b) { return a < b ? a : b; }
  static I max_i(I a, I b) { return a < b ? b : a; }
  template <int k>
  static I slli(I a) {
    return static_cast<I>(static_cast<uint32_t>(a) << k);
  }
  template <int k>
  static I srli(I a) {
    return static_cast<I>(static_cast<uint32_t>(a) >> k);
  }
  static R zero_where_code_zero(I code, R x) { return code == 0 ? 0.0f : x; }
  static I zero_code_where_zero(R v, I code) { return v == 0.0f ? 0 : code; }
};

}  // namespace
}  // namespace adam_detail
}  // namespace tierlift
