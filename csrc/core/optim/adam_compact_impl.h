// The compact-state Adam body (adam_compact.h) over the same vector interface V as adam_impl.h,
// plus a few 32-bit integer lane operations for the v code. Included only by the per-ISA files
// (adam_scalar.cc, adam_avx2.cc, adam_avx512.cc), after adam_impl.h.
//
// Work goes block by block: pass 1 steps every element of a block, writing p, the copy and bf16
// m, and keeps the new fp32 v in a stack buffer while tracking the block's max; pass 2 encodes
// the buffer against that max. Blocks are independent, so threads split work by whole blocks.
#pragma once

#include <algorithm>
#include <limits>

#include "core/optim/adam_compact.h"
#include "core/optim/adam_impl.h"

namespace tierlift {
namespace adam_detail {
namespace {

template <class V>
inline typename V::R decode_v_lanes(typename V::I code, typename V::R block_max) {
  const typename V::R r =
      V::as_float(V::template slli<kVCodeShift>(V::add_i(code, V::set1_i(kVCodeBase))));
  return V::zero_where_code_zero(code, V::mul(r, block_max));
}

// encode_v (adam_compact.h) on V::kWidth lanes; every lane's v is finite and <= block_max.
template <class V>
inline typename V::I encode_v_lanes(typename V::R v, typename V::R block_max) {
  using I = typename V::I;
  const I u = V::as_int(V::div(v, block_max));
  const I odd = V::and_i(V::template srli<kVCodeShift>(u), V::set1_i(1));
  I q = V::template srli<kVCodeShift>(V::add_i(u, V::add_i(odd, V::set1_i(0x7ffff))));
  q = V::add_i(q, V::set1_i(-kVCodeBase));
  q = V::max_i(V::min_i(q, V::set1_i(255)), V::set1_i(1));
  return V::zero_code_where_zero(v, q);
}

// Pass 1 for V::kWidth elements at i: the step, with the new v stored at vout. `t` has its
// sources resolved (with_sources): loads from the *_from pointers, stores to the state pointers.
template <class V, DType kGrad, DType kCopy, bool kUnscale>
inline void compact_update(const AdamScalars& s, const Consts<V>& c, const CompactAdamTensor& t,
                           int64_t i, typename V::R old_max, float* vout, typename V::R& vmax,
                           typename V::R& bad) {
  using R = typename V::R;
  R p = V::load(t.param_from + i);
  R m = V::load_bf16(t.exp_avg_from + i);
  R v = decode_v_lanes<V>(V::load_u8(t.exp_avg_sq_from + i), old_max);
  decay_and_moments<V>(s, c, load_grad<V, kGrad, kUnscale>(c, t.grad, i), p, m, v);
  V::store_bf16(t.exp_avg + i, m);
  V::store(vout, v);
  vmax = V::max(vmax, v);
  bad = V::add(bad, V::sub(v, v));  // stays 0 unless some v is NaN or infinite
  p = apply_update<V>(c, p, m, v);
  V::store(t.param + i, p);
  if constexpr (kCopy != DType::kNone) store_from_f32<V, kCopy>(t.param_copy, i, p);
}

// One block [b0, b1), b1 - b0 <= kCompactBlock; S (scalar lanes) takes the tail of a short block.
template <class V, class S, DType kGrad, DType kCopy, bool kUnscale>
void compact_block(const AdamScalars& s, const Consts<V>& c, const Consts<S>& cs,
                   const CompactAdamTensor& t, int64_t b0, int64_t b1) {
  alignas(64) float vnew[kCompactBlock];
  alignas(64) float lanes_max[V::kWidth], lanes_bad[V::kWidth];
  float* scale = t.exp_avg_sq_scale + b0 / kCompactBlock;
  const float old_max = t.exp_avg_sq_scale_from[b0 / kCompactBlock];
  typename V::R vmax = V::set1(0.0f), bad = V::set1(0.0f);
  int64_t i = b0;
  for (; i + V::kWidth <= b1; i += V::kWidth) {
    compact_update<V, kGrad, kCopy, kUnscale>(s, c, t, i, V::set1(old_max), vnew + (i - b0), vmax,
                                              bad);
  }
  V::store(lanes_max, vmax);
  V::store(lanes_bad, bad);
  float vmax_s = 0.0f, bad_s = 0.0f;
  for (int k = 0; k < V::kWidth; ++k) {
    vmax_s = S::max(vmax_s, lanes_max[k]);
    bad_s = S::add(bad_s, lanes_bad[k]);
  }
  for (; i < b1; ++i)
    compact_update<S, kGrad, kCopy, kUnscale>(s, cs, t, i, old_max, vnew + (i - b0), vmax_s, bad_s);
  uint8_t* codes = t.exp_avg_sq + b0;
  const int64_t n = b1 - b0;
  if (bad_s != bad_s) {  // NaN: some v is not finite; the whole block reads back NaN
    *scale = std::numeric_limits<float>::quiet_NaN();
    for (int64_t j = 0; j < n; ++j) codes[j] = 255;
    return;
  }
  *scale = vmax_s;
  const typename V::R vmax_all = V::set1(vmax_s);
  int64_t j = 0;
  for (; j + V::kWidth <= n; j += V::kWidth) {
    V::store_u8(codes + j, encode_v_lanes<V>(V::load(vnew + j), vmax_all));
  }
  for (; j < n; ++j) S::store_u8(codes + j, encode_v_lanes<S>(vnew[j], vmax_s));
}

template <class V, class S, DType kGrad, DType kCopy, bool kUnscale>
void compact_blocks(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin, int64_t end) {
  const Consts<V> c(s);
  const Consts<S> cs(s);
  for (int64_t b = begin; b < end; b += kCompactBlock) {
    compact_block<V, S, kGrad, kCopy, kUnscale>(s, c, cs, t, b, std::min(end, b + kCompactBlock));
  }
}

template <class V, class S, DType kGrad, DType kCopy>
void compact_range(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin, int64_t end) {
  if (s.unscale) return compact_blocks<V, S, kGrad, kCopy, true>(s, t, begin, end);
  compact_blocks<V, S, kGrad, kCopy, false>(s, t, begin, end);
}

template <class V, class S, DType kGrad>
void compact_dispatch_copy(const AdamScalars& s, const CompactAdamTensor& t, int64_t begin,
                           int64_t end) {
  switch (t.copy_type) {
    case DType::kFloat32:
      return compact_range<V, S, kGrad, DType::kFloat32>(s, t, begin, end);
    case DType::kBFloat16:
      return compact_range<V, S, kGrad, DType::kBFloat16>(s, t, begin, end);
    case DType::kFloat16:
      return compact_range<V, S, kGrad, DType::kFloat16>(s, t, begin, end);
    default:
      return compact_range<V, S, kGrad, DType::kNone>(s, t, begin, end);
  }
}

template <class V, class S>
void compact_dispatch(const AdamScalars& s, const CompactAdamTensor& in, int64_t begin,
                      int64_t end) {
  const CompactAdamTensor t = with_sources(in);
  switch (t.grad_type) {
    case DType::kBFloat16:
      return compact_dispatch_copy<V, S, DType::kBFloat16>(s, t, begin, end);
    case DType::kFloat16:
      return compact_dispatch_copy<V, S, DType::kFloat16>(s, t, begin, end);
    default:
      return compact_dispatch_copy<V, S, DType::kFloat32>(s, t, begin, end);
  }
}

}  // namespace
}  // namespace adam_detail
}  // namespace tierlift
