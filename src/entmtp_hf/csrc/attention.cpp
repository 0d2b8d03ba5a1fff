// Attention of a few query tokens over a key/value cache, grouped key/value heads read in place
// (query head h reads key/value head h / (H / kvH), as transformers' repeat_kv pairs them), float32
// or bfloat16 tensors (bfloat16 widened in registers), float32 scores, softmax and sums.
//
// A decode step's attention is a few hundred key rows per head: PyTorch's CPU flash kernel spends
// most of its time around that little work (one layer of the demo model, one query over 512 slots,
// on a Zen 2 EPYC: 59 us in float32 and 332 us in bfloat16, against 23 and 32 us here).
//
// Invariants: each output row depends only on its own query row and mask row, in a fixed order over
// the keys, never on how many queries share the call (a tree's attention equals the one-token
// attention row for row, bit for bit); a key whose additive mask is at or below kMasked (transformers'
// float masks hold the dtype's lowest value, a boolean mask's False becomes -inf) adds exactly what
// computing it would add, nothing: exp of its score minus the row's maximum is 0 in float32. A row
// whose every key is masked is computed over all its keys, as the formula says.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kMasked = -1e38f;

// A mask entry read as it is stored: additive float32, or boolean (True attends; False adds -inf).
inline bool attends(float m) { return m > kMasked; }
inline bool attends(bool m) { return m; }
inline float added(float m) { return m; }
inline float added(bool m) { return m ? 0.f : -std::numeric_limits<float>::infinity(); }

using entmtp_simd::horizontal_sum;
using entmtp_simd::load8;

// exp(x) for 8 lanes (Cephes' range reduction and polynomial; x < -88 gives 0): a scalar exp per key
// cost as much as the key's dot product. The tests hold the attention to float32 sdpa within 2e-6.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-88.0f), hi = _mm256_set1_ps(88.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The dot products of q with four keys (rows k0..k3), summed in one fixed order whichever keys they
// are: 8-lane partial sums over d, then a fixed reduction across lanes (a key at the end of the cache
// is summed in a group that repeats it, the same way).
template <typename T>
inline __m128 dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, load8(k0 + d), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k1 + d), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k2 + d), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k3 + d), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One query row: out[D] = softmax(q . k[s] * scale + mask[s]) @ v, over S keys at strides ks, vs
// (D a multiple of 8).
template <typename T, typename M>
void one_row(const float* q, const T* k, const T* v, int64_t ks, int64_t vs, const M* mask, int64_t S,
             int64_t D, float scale, float* scores, float* out) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (int64_t s = 0; s < S && !any; ++s) any = attends(mask[s]);
  float top = ninf;
  for (int64_t s = 0; s < S; s += 4) {
    bool needed = !any;
    for (int64_t j = s; j < std::min(S, s + 4); ++j) needed = needed || attends(mask[j]);
    if (!needed) {
      for (int64_t j = s; j < std::min(S, s + 4); ++j) scores[j] = ninf;
      continue;
    }
    const T* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = k + std::min(S - 1, s + j) * ks;
    float four[4];
    _mm_storeu_ps(four, dot4(q, kr[0], kr[1], kr[2], kr[3], D));
    for (int64_t j = s; j < std::min(S, s + 4); ++j) {
      scores[j] = any && !attends(mask[j]) ? ninf : four[j - s] * scale + added(mask[j]);
      top = std::max(top, scores[j]);
    }
  }
  // exp(score - top), 0 for a masked key; the total summed in 8 lanes, then reduced in a fixed order
  const __m256 topv = _mm256_set1_ps(top);
  __m256 totalv = _mm256_setzero_ps();
  const int64_t S8 = S - S % 8;
  for (int64_t s = 0; s < S8; s += 8) {
    const __m256 x = _mm256_loadu_ps(scores + s);
    const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(ninf), _CMP_EQ_OQ), exp8(_mm256_sub_ps(x, topv)));
    _mm256_storeu_ps(scores + s, e);
    totalv = _mm256_add_ps(totalv, e);
  }
  float total = horizontal_sum(totalv);
  for (int64_t s = S8; s < S; ++s) {
    scores[s] = scores[s] == ninf ? 0.f : std::exp(scores[s] - top);
    total += scores[s];
  }
  // the weighted sum of the values, 64 columns at a time in registers
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, D - d0) / 8;
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const float p = scores[s];
      if (p == 0.f) continue;
      const T* vr = v + s * vs + d0;
      const __m256 pv = _mm256_set1_ps(p);
      if (width == 8) {
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pv, load8(vr + 8 * j), acc[j]);
      } else {
        for (int j = 0; j < width; ++j) acc[j] = _mm256_fmadd_ps(pv, load8(vr + 8 * j), acc[j]);
      }
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (int j = 0; j < width; ++j) _mm256_storeu_ps(out + d0 + 8 * j, _mm256_mul_ps(acc[j], inv));
  }
}

// Every query row of q [B, H, T, D] (contiguous; bfloat16 rows widened one at a time) into out
// [B, T, H, D] in q's dtype, the rows split over torch's threads.
template <typename T, typename M>
void all_rows(const T* q, const T* k, const T* v, const M* mask, T* out, int64_t B, int64_t H, int64_t kvH,
              int64_t T_, int64_t S, int64_t D, const int64_t* kst, const int64_t* vst, const int64_t* mst,
              float scale) {
  const int64_t groups = H / kvH;
  at::parallel_for(0, B * H * T_, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(S), row(std::is_same<T, float>::value ? 0 : 2 * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * T_), h = (i / T_) % H, t = i % T_, kv = h / groups;
      T* o = out + ((b * T_ + t) * H + h) * D;
      const float* qf;
      float* of;
      if constexpr (std::is_same<T, float>::value) {
        qf = q + i * D;
        of = o;
      } else {
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(q[i * D + d]);
        qf = row.data();
        of = row.data() + D;
      }
      one_row(qf, k + b * kst[0] + kv * kst[1], v + b * vst[0] + kv * vst[1], kst[2], vst[2],
              mask + b * mst[0] + h * mst[1] + t * mst[2], S, D, scale, scores.data(), of);
      if constexpr (!std::is_same<T, float>::value)
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(of[d]);
    }
  });
}

}  // namespace

// query [B, H, T, D]; key, value [B, kvH, S, D] with unit stride over D; mask [B or 1, H or 1, T, S],
// float (additive) or bool (True: attend) -> [B, T, H, D] in the query's dtype (transformers' layout
// after attention).
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const torch::Tensor& mask, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "decode_attention: CPU tensors only");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_attention: float32 or bfloat16 only");
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, "decode_attention: one dtype for q, k, v");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && mask.dim() == 4, "decode_attention: 4-d tensors");
  const int64_t B = query.size(0), H = query.size(1), T_ = query.size(2), D = query.size(3);
  const int64_t kvH = key.size(1), S = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.sizes() == key.sizes() && key.size(3) == D, "decode_attention: k, v must be [B, kvH, S, D]");
  TORCH_CHECK(kvH > 0 && H % kvH == 0, "decode_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1, "decode_attention: k, v need unit stride over D");
  TORCH_CHECK(D % 8 == 0, "decode_attention: the head size must be a multiple of 8");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat || mask.scalar_type() == dtype,
              "decode_attention: a boolean, float32 or the query's dtype mask");
  TORCH_CHECK(mask.size(3) == S && mask.size(2) == T_ && (mask.size(0) == 1 || mask.size(0) == B) &&
                  (mask.size(1) == 1 || mask.size(1) == H),
              "decode_attention: the mask must be [B or 1, H or 1, T, S]");
  const auto q = query.contiguous();
  // a boolean or float32 mask read as stored (no copy); another float dtype widened once
  auto m = mask.scalar_type() == at::kBool ? mask : mask.to(at::kFloat);
  if (m.stride(3) != 1) m = m.contiguous();
  auto out = torch::empty({B, T_, H, D}, q.options());
  const int64_t kst[3] = {key.stride(0), key.stride(1), key.stride(2)};
  const int64_t vst[3] = {value.stride(0), value.stride(1), value.stride(2)};
  // a size-1 batch or head dimension of the mask is shared: stride 0
  const int64_t mst[3] = {m.size(0) == 1 ? 0 : m.stride(0), m.size(1) == 1 ? 0 : m.stride(1), m.stride(2)};
  const float sc = static_cast<float>(scale);
  const auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    if (m.scalar_type() == at::kBool)
      all_rows(qp, kp, vp, m.data_ptr<bool>(), op, B, H, kvH, T_, S, D, kst, vst, mst, sc);
    else
      all_rows(qp, kp, vp, m.data_ptr<float>(), op, B, H, kvH, T_, S, D, kst, vst, mst, sc);
  };
  if (dtype == at::kFloat)
    run(q.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(), out.data_ptr<float>());
  else
    run(q.data_ptr<c10::BFloat16>(), key.data_ptr<c10::BFloat16>(), value.data_ptr<c10::BFloat16>(),
        out.data_ptr<c10::BFloat16>());
  return out;
}
