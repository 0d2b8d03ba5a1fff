// y = x @ W.T (+ b) for a few rows of x, AVX2 + FMA, float32 or bfloat16 weights (bfloat16 widened
// to float32 in registers: a bfloat16 is a float32's upper half), float32 sums: each weight row is
// read from memory once and multiplied into every row of x while it is in registers (or L1), so a
// product of a few rows costs about what reading W costs (a decode step is bound by reading the
// weights). Three layouts, each the faster for its dtype on a Zen 2 EPYC: float32 multiplies four
// weight rows at a time into up to four rows of x (tiles_range); bfloat16 weights, and int8 weights
// of float32 rows, read each thread's share of W as one sequential stream, a row at a time
// (stream_range); int8 weights of bfloat16 rows multiply in integers (fixed_range: the rows held as
// 16-bit integers per block, see to_fixed16), several weights of one x in one call where a compiled
// graph groups them (gemv_int8_group).
//
// Invariant: an output element's value depends only on its own row of x, the weight row and the
// bias, summed in one fixed order per dtype (float32: 8-lane partial sums over k in order, a fixed
// horizontal sum, the tail; bfloat16: four 8-lane partial sums over k in steps of 32, the rest of k
// in eights into the first, a fixed combination and horizontal sum, the tail; int8 of bfloat16 rows:
// exact integer sums per block, blocks in order), never on how many rows or weights share the call:
// a tree's verification product equals the one-token product row for row, bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using entmtp_simd::horizontal_sum;
using entmtp_simd::load8;
using entmtp_simd::scalar;

// How far ahead of a bfloat16 stream the weights are fetched (non-temporal: they are read once). A
// thread's rows are one sequential stream, but a decode step reads ~200 matrices of 0.1-3 MB, and the
// hardware prefetcher ramps up again on each: fetching 1 KB ahead took all of the demo model's
// bfloat16 products at one row from 13.8 to 10.5 ms on a Zen 2 EPYC (tiles_range's layout, float32's,
// had been used for both dtypes). In float32 the same stream was slower than the tiles at every row
// count (22.7 against 18.9 ms at one row, 28.6 against 21.5 at four).
constexpr int64_t kAheadBytes = 1024;

// The dot products of one weight row wn [K] with G rows of x (row stride K) into out[G], in the
// order the invariant states; `fetch`: fetch the stream ahead, up to `end`.
template <int G, typename W>
inline void row_dots(const float* x, const W* wn, int64_t K, bool fetch, const W* end, float* out) {
  constexpr int64_t ahead = kAheadBytes / static_cast<int64_t>(sizeof(W));
  constexpr int64_t per_line = 64 / static_cast<int64_t>(sizeof(W));  // weights per cache line
  __m256 a[G][4];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
  const int64_t K32 = K - K % 32, K8 = K - K % 8;
  for (int64_t k = 0; k < K32; k += 32) {
    if (fetch && wn + k + ahead < end)  // each line of the step once (an int8 line spans two steps)
      for (int64_t e = k; e < k + 32; e += per_line)
        if (e % per_line == 0) _mm_prefetch(reinterpret_cast<const char*>(wn + e + ahead), _MM_HINT_NTA);
    if constexpr (G <= 2) {
      const __m256 w0 = load8(wn + k), w1 = load8(wn + k + 8), w2 = load8(wn + k + 16), w3 = load8(wn + k + 24);
      for (int g = 0; g < G; ++g) {
        const float* xg = x + g * K + k;
        a[g][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), a[g][0]);
        a[g][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), a[g][1]);
        a[g][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), a[g][2]);
        a[g][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), a[g][3]);
      }
    } else {  // half the step's weights at a time: 4G accumulators and two weight registers fit the
      // sixteen (the same sums, in the same order per accumulator)
      const __m256 w0 = load8(wn + k), w1 = load8(wn + k + 8);
      for (int g = 0; g < G; ++g) {
        const float* xg = x + g * K + k;
        a[g][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xg), a[g][0]);
        a[g][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xg + 8), a[g][1]);
      }
      const __m256 w2 = load8(wn + k + 16), w3 = load8(wn + k + 24);
      for (int g = 0; g < G; ++g) {
        const float* xg = x + g * K + k;
        a[g][2] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xg + 16), a[g][2]);
        a[g][3] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xg + 24), a[g][3]);
      }
    }
  }
  for (int64_t k = K32; k < K8; k += 8) {
    const __m256 wv = load8(wn + k);
    for (int g = 0; g < G; ++g) a[g][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + g * K + k), a[g][0]);
  }
  for (int g = 0; g < G; ++g) {
    float s = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a[g][0], a[g][1]), _mm256_add_ps(a[g][2], a[g][3])));
    for (int64_t k = K8; k < K; ++k) s += scalar(wn[k]) * x[g * K + k];
    out[g] = s;
  }
}

// bfloat16 and int8: columns [n0, n1) for all M rows of x, a weight row at a time, multiplied into
// the rows of x three or two at a time (the row stays in L1 for the later groups: W is read from
// memory once whatever M is; widening it again per group measured faster than keeping a float32
// copy of it; three rows at once took the demo model's int8 products at three rows from ~11 to
// ~10 ms on a Zen 2 EPYC, where widening int8 is what bounds them). An int8 row's sums are
// multiplied by its scale; then the bias; the output rounded once to Y.
template <typename W, typename Y, typename S>
void stream_range(const float* x, const W* w, const S* scale, const float* b, Y* y, int64_t M, int64_t K,
                  int64_t N, int64_t n0, int64_t n1) {
  const W* end = w + n1 * K;
  float out[3];
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * K;
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m;
      const int g = left == 3 || left >= 5 ? 3 : (left >= 2 ? 2 : 1);  // four rows: two pairs
      if (g == 3)
        row_dots<3>(x + m * K, wn, K, m == 0, end, out);
      else if (g == 2)
        row_dots<2>(x + m * K, wn, K, m == 0, end, out);
      else
        row_dots<1>(x + m * K, wn, K, m == 0, end, out);
      for (int i = 0; i < g; ++i) {
        float v = scale ? out[i] * static_cast<float>(scale[n]) : out[i];
        y[(m + i) * N + n] = static_cast<Y>(b ? v + b[n] : v);
      }
      m += g;
    }
  }
}

// int8 weights times bfloat16 rows in integers. Widening every int8 weight to float32 (three
// instructions per eight weights) is what bounds a float32 product of int8 weights; a bfloat16 row
// of x fits 16-bit integers almost whole instead: per block of kBlock values, a power-of-two scale
// 2^(E-15) (E: the exponent of the block's largest magnitude) makes every value within 2^8 of that
// largest one an exact int16 (a bfloat16 has 8 significant bits), and rounds a smaller one by at
// most 2^(E-16) (nearest, ties to even). Then sixteen weights widen to int16 in one instruction and
// multiply-add into int32 pairs exactly (|sum| < 2^31 for a block: 64 x 127 x 32767); each
// block's eight int32 lanes, as float32, are multiplied by the block's scale into eight float32
// lanes in block order, then summed in the fixed horizontal order. An output element still depends
// only on its own row of x (its blocks' scales included) and the weight row.
constexpr int64_t kBlock = 64;

// x [M, K] bfloat16 as int16 values q [M, K] and a power-of-two scale per row and block s [M, blocks]
// (eight values at a time: |x| as the bits with the sign cleared, rounding by the current mode, i.e.
// to nearest even; the scalar tail alike)
void to_fixed16(const c10::BFloat16* x, int64_t M, int64_t K, int16_t* q, float* s) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const c10::BFloat16* xb = x + m * K;
      const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock), k8 = k1 - (k1 - k0) % 8;
      __m256 topv = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int64_t k = k0; k < k8; k += 8) {
        const __m256 ax = _mm256_and_ps(load8(xb + k), magnitude);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(ax, infinity, _CMP_NLT_UQ));  // inf or NaN
        topv = _mm256_max_ps(topv, ax);
      }
      float top = 0.f;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, topv);
      for (float v : lanes) top = std::max(top, v);
      for (int64_t k = k8; k < k1; ++k) top = std::max(top, std::fabs(static_cast<float>(xb[k])));
      bool finite = _mm256_movemask_ps(bad) == 0 && std::isfinite(top);
      for (int64_t k = k8; k < k1; ++k) finite = finite && std::isfinite(static_cast<float>(xb[k]));
      if (!finite) {  // the block's sums become NaN, as a float32 product's would (inf or NaN in x)
        std::fill(q + m * K + k0, q + m * K + k1, int16_t{0});
        s[m * blocks + b] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      int e = 0;
      std::frexp(top, &e);  // top = f 2^e, f in [0.5, 1) (top = 0: e = 0, every value 0)
      const float inv = std::ldexp(1.f, 15 - e);  // |x| * inv < 2^15: no clamp needed
      const __m256 invv = _mm256_set1_ps(inv);
      for (int64_t k = k0; k < k8; k += 8) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8(xb + k), invv));
        const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + k), packed);
      }
      for (int64_t k = k8; k < k1; ++k) q[m * K + k] = static_cast<int16_t>(std::nearbyint(static_cast<float>(xb[k]) * inv));
      s[m * blocks + b] = std::ldexp(1.f, e - 15);
    }
}

// The int32 sums of a last, partial block [k0, K) of one int8 weight row with G rows of q (kept out
// of fixed_dots' loop: a branch there took the accumulators out of registers, 40% slower at three rows)
template <int G>
__attribute__((noinline)) void partial_block(const int16_t* q, const int8_t* wn, int64_t k0, int64_t K, __m256i* p) {
  int64_t k = k0;
  for (; k + 16 <= K; k += 16) {
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k)));
    for (int g = 0; g < G; ++g)
      p[g] = _mm256_add_epi32(p[g], _mm256_madd_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * K + k))));
  }
  for (int g = 0; g < G; ++g) {  // the last K % 16 values, in integers too (exact: order is immaterial)
    int32_t tail = 0;
    for (int64_t t = k; t < K; ++t) tail += static_cast<int32_t>(wn[t]) * q[g * K + t];
    p[g] = _mm256_add_epi32(p[g], _mm256_setr_epi32(tail, 0, 0, 0, 0, 0, 0, 0));
  }
}

// The dot products of one int8 weight row wn [K] with G rows of q (row stride K, scales s at row
// stride `blocks`) into out[G]; `fetch`: fetch the stream ahead, up to `end`.
template <int G>
inline void fixed_dots(const int16_t* q, const float* s, int64_t blocks, const int8_t* wn, int64_t K, bool fetch,
                       const int8_t* end, float* out) {
  __m256 a[G];
  for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
  const int64_t whole = K / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock;
    __m256i p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm256_setzero_si256();
    if (b < whole) {
      if (fetch && wn + k0 + kAheadBytes < end)  // a block is one 64-byte line of weights
        _mm_prefetch(reinterpret_cast<const char*>(wn + k0 + kAheadBytes), _MM_HINT_NTA);
      for (int64_t k = k0; k < k0 + kBlock; k += 32) {
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k)));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k + 16)));
        for (int g = 0; g < G; ++g) {
          const int16_t* qg = q + g * K + k;
          p[g] = _mm256_add_epi32(
              p[g], _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg))),
                                     _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 16)))));
        }
      }
    } else {
      partial_block<G>(q, wn, k0, K, p);
    }
    for (int g = 0; g < G; ++g)
      a[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[g]), _mm256_set1_ps(s[g * blocks + b]), a[g]);
  }
  for (int g = 0; g < G; ++g) out[g] = horizontal_sum(a[g]);
}

// int8 weights, bfloat16 rows held as fixed16: columns [n0, n1) for all M rows, a weight row at a
// time multiplied into the rows four at a time (W read from memory once whatever M is); the sums
// multiplied by the row's scale, then the bias; the output rounded once to bfloat16.
template <typename S>
void fixed_range(const int16_t* q, const float* s, const int8_t* w, const S* scale, const float* b,
                 c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  const int8_t* end = w + n1 * K;
  float out[4];
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    for (int64_t m = 0; m < M;) {
      const int g = static_cast<int>(std::min<int64_t>(4, M - m));
      const int16_t* qm = q + m * K;
      const float* sm = s + m * blocks;
      if (g == 4)
        fixed_dots<4>(qm, sm, blocks, wn, K, m == 0, end, out);
      else if (g == 3)
        fixed_dots<3>(qm, sm, blocks, wn, K, m == 0, end, out);
      else if (g == 2)
        fixed_dots<2>(qm, sm, blocks, wn, K, m == 0, end, out);
      else
        fixed_dots<1>(qm, sm, blocks, wn, K, m == 0, end, out);
      for (int i = 0; i < g; ++i) {
        const float v = out[i] * static_cast<float>(scale[n]);
        y[(m + i) * N + n] = static_cast<c10::BFloat16>(b ? v + b[n] : v);
      }
      m += g;
    }
  }
}

// float32 weight rows fetched ahead of the four being multiplied: each row is a short stream (a few
// KB), and the hardware prefetcher loses it at every row's end; fetching the rows eight ahead
// (non-temporal: they are read once) kept three float32 rows at 25-27 GB/s against 22-24 without.
// One float32 row keeps up without it (and ran ~10% slower with it).
constexpr int64_t kAheadRows = 8;
template <typename W, int M>
constexpr bool fetches_ahead() {
  return !(std::is_same<W, float>::value && M == 1);
}

// Output columns [n0, n1) for M rows: four weight rows at a time (4 x M accumulators fit the
// sixteen registers for M <= 3; M = 4 spills a little and still streams W once). `ahead`: fetch
// the rows kAheadRows on (not when the columns go in tiles re-read from L2: a non-temporal line
// need not stay there).
template <int M, typename W>
void rows_block(const float* x, const W* w, const float* b, W* y, int64_t K, int64_t N, int64_t n0,
                int64_t n1, bool ahead) {
  const int64_t K8 = K - K % 8;
  constexpr int64_t line = 64 / sizeof(W);  // weights per cache line
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m256 acc[4][M];
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    const W* wn = w + n * K;
    const bool fetch = fetches_ahead<W, M>() && ahead && n + kAheadRows + 4 <= N;
    for (int64_t k = 0; k < K8; k += 8) {
      if (fetch && k % line == 0)
        for (int r = 0; r < 4; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(wn + (kAheadRows + r) * K + k), _MM_HINT_NTA);
      __m256 xv[M];
      for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < 4; ++r) {
        const __m256 wv = load8(wn + r * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < M; ++m) {
        float s = horizontal_sum(acc[r][m]);
        for (int64_t k = K8; k < K; ++k) s += scalar(wn[r * K + k]) * x[m * K + k];
        y[m * N + n + r] = static_cast<W>(b ? s + b[n + r] : s);  // bfloat16: rounded to nearest even, once
      }
  }
  for (; n < n1; ++n) {  // the last N % 4 columns, summed as above lane by lane
    const W* wn = w + n * K;
    for (int m = 0; m < M; ++m) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) acc = _mm256_fmadd_ps(load8(wn + k), _mm256_loadu_ps(x + m * K + k), acc);
      float s = horizontal_sum(acc);
      for (int64_t k = K8; k < K; ++k) s += scalar(wn[k]) * x[m * K + k];
      y[m * N + n] = static_cast<W>(b ? s + b[n] : s);
    }
  }
}

// float32: columns [n0, n1) for all M rows, four rows of x at a time. Over four rows the columns go in tiles
// of about 128 KB of weights, which stay in the core's L2 cache while each group of rows passes
// over them: the weights are read from memory once whatever M is.
template <typename W>
void tiles_range(const float* x, const W* w, const float* b, W* y, int64_t M, int64_t K, int64_t N,
                int64_t n0, int64_t n1) {
  const int64_t per_tile = 131072 / (static_cast<int64_t>(sizeof(W)) * std::max<int64_t>(K, 1));
  const int64_t tile = M <= 4 ? n1 - n0 : std::max<int64_t>(4, per_tile / 4 * 4);
  const bool ahead = M <= 4;  // one pass over the columns
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const float* xm = x + m0 * K;
      W* ym = y + m0 * N;
      if (left >= 4) {
        rows_block<4, W>(xm, w, b, ym, K, N, t0, t1, ahead);
        m0 += 4;
      } else if (left == 3) {
        rows_block<3, W>(xm, w, b, ym, K, N, t0, t1, ahead);
        m0 += 3;
      } else if (left == 2) {
        rows_block<2, W>(xm, w, b, ym, K, N, t0, t1, ahead);
        m0 += 2;
      } else {
        rows_block<1, W>(xm, w, b, ym, K, N, t0, t1, ahead);
        m0 += 1;
      }
    }
  }
}

}  // namespace

namespace {

// x's rows as float32: its own data, or a widened bfloat16 copy
struct Float32Rows {
  std::vector<float> widened;
  const float* p;
};
Float32Rows float32_rows(const torch::Tensor& xs) {
  Float32Rows rows;
  rows.p = xs.scalar_type() == at::kFloat ? xs.data_ptr<float>() : nullptr;
  if (!rows.p) {
    rows.widened.resize(xs.numel());
    const c10::BFloat16* xb = xs.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < xs.numel(); ++i) rows.widened[i] = static_cast<float>(xb[i]);
    rows.p = rows.widened.data();
  }
  return rows;
}

// The frame of gemv's products: x [..., K] as [M, K] rows, widened to float32 once where
// they are bfloat16 (float32_rows), the bias as float32, y [M, N] in x's dtype, the columns split over
// torch's threads in contiguous ranges of blocks of four (float32's tiles; 64 columns at least per
// task); `range(held, bp, y, M, n0, n1)` fills columns [n0, n1) of every row of y [..., N].
template <typename Range>
torch::Tensor few_rows(const char* name, const torch::Tensor& x, int64_t N, int64_t K,
                       const c10::optional<torch::Tensor>& bias, Range range) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, name, ": x's last dimension must be the weight's K");
  torch::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N, name,
                ": bias must be a [N] vector of x's dtype");
    b32 = bias->to(at::kFloat).contiguous();
  }
  // no reshape, view or copy where x is contiguous already (a decode step makes ~200 of these calls)
  const auto xs = x.is_contiguous() ? x : x.contiguous();
  const int64_t M = K > 0 ? xs.numel() / K : 0;
  const auto held = float32_rows(xs);
  auto shape = x.sizes().vec();
  shape.back() = N;
  auto y = torch::empty(shape, xs.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    range(held, bp, y, M, begin * 4, std::min(N, end * 4));
  });
  return y;
}

// bfloat16 rows of x as fixed16 (to_fixed16)
struct Fixed16Rows {
  std::vector<int16_t> q;
  std::vector<float> s;
};
Fixed16Rows fixed16_rows(const torch::Tensor& xs, int64_t M, int64_t K) {
  Fixed16Rows rows{std::vector<int16_t>(xs.numel()), std::vector<float>(M * ((K + kBlock - 1) / kBlock))};
  to_fixed16(xs.data_ptr<c10::BFloat16>(), M, K, rows.q.data(), rows.s.data());
  return rows;
}

}  // namespace

// Why gemv does not take these tensors, or null where it does: CPU tensors, x and a contiguous
// [N, K] weight both float32 or both bfloat16 (the graphs' operator asks it to fall back to
// at::linear; gemv itself refuses with the reason).
const char* gemv_refusal(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  const auto dtype = weight.scalar_type();
  if (!x.device().is_cpu() || !weight.device().is_cpu()) return "gemv: CPU tensors only";
  if (dtype != at::kFloat && dtype != at::kBFloat16) return "gemv: float32 or bfloat16 weights only";
  if (x.scalar_type() != dtype) return "gemv: x must have the weight's dtype";
  if (weight.dim() != 2 || !weight.is_contiguous()) return "gemv: weight must be a contiguous [N, K] matrix";
  if (x.dim() < 1 || x.size(-1) != weight.size(1)) return "gemv: x's last dimension must be the weight's K";
  if (bias.has_value() && bias->defined() &&
      (!bias->device().is_cpu() || bias->scalar_type() != dtype || bias->numel() != weight.size(0)))
    return "gemv: bias must be a [N] vector of the weight's dtype";
  return nullptr;
}

// x [..., K] and weight [N, K] (contiguous) both float32 or both bfloat16, bias [N] of that dtype
// or None -> [..., N] of that dtype.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  const char* why = gemv_refusal(x, weight, bias);
  TORCH_CHECK(why == nullptr, why);
  const bool f32 = weight.scalar_type() == at::kFloat;
  return few_rows("gemv", x, weight.size(0), weight.size(1), bias,
                  [&](const Float32Rows& rows, const float* bp, torch::Tensor& y, int64_t M, int64_t n0, int64_t n1) {
                    const int64_t N = weight.size(0), K = weight.size(1);
                    const float* xp = rows.p;
                    if (f32)
                      tiles_range(xp, weight.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, n0, n1);
                    else
                      stream_range(xp, weight.data_ptr<c10::BFloat16>(), static_cast<const float*>(nullptr), bp,
                                   y.data_ptr<c10::BFloat16>(), M, K, N, n0, n1);
                  });
}

namespace {

// One int8 weight of a group, checked, with what its product reads and writes
struct Int8Weight {
  const int8_t* w;
  torch::Tensor scale;  // float32 or bfloat16, [N], contiguous
  torch::Tensor bias;   // float32 [N] or undefined
  torch::Tensor y;      // [..., N] in x's dtype
  int64_t N, first;     // rows; the first of its blocks of four columns in the group's
};

template <typename S>
void int8_columns(const Int8Weight& p, const Fixed16Rows* fixed, const Float32Rows* wide, int64_t M, int64_t K,
                  int64_t n0, int64_t n1) {
  const S* sp = p.scale.data_ptr<S>();
  const float* bp = p.bias.defined() ? p.bias.data_ptr<float>() : nullptr;
  if (fixed)
    fixed_range(fixed->q.data(), fixed->s.data(), p.w, sp, bp, p.y.data_ptr<c10::BFloat16>(), M, K, p.N, n0, n1);
  else
    stream_range(wide->p, p.w, sp, bp, p.y.data_ptr<float>(), M, K, p.N, n0, n1);
}

}  // namespace

// x [..., K] float32 or bfloat16 times several int8 weight-only weights: qdata[i] [N_i, K] int8
// (contiguous), scale[i] [N_i] (one per row, any float dtype), bias[i] [N_i] of x's dtype or None ->
// [..., N_i] of x's dtype each: x @ (qdata * scale).T + bias, as an int8 weight-only quantization
// (torchao's Int8Tensor, per row) defines it. x is held once (bfloat16 as fixed16, float32 as it is)
// and the columns of all the weights are split over the threads together: a layer's products of one
// input (q, k and v; gate and up) in one call, each output exactly what its weight's call alone gives.
std::vector<torch::Tensor> gemv_int8_group(const torch::Tensor& x, const std::vector<torch::Tensor>& qdata,
                                           const std::vector<torch::Tensor>& scale,
                                           const c10::List<c10::optional<torch::Tensor>>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "gemv_int8: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gemv_int8: x must be float32 or bfloat16");
  TORCH_CHECK(!qdata.empty() && scale.size() == qdata.size() && bias.size() == qdata.size(),
              "gemv_int8: one scale and one bias (or None) per weight");
  TORCH_CHECK(x.dim() >= 1, "gemv_int8: x's last dimension must be the weight's K");
  const int64_t K = x.size(-1);
  // no reshape, view or copy where x is contiguous already (a decode step makes ~200 of these calls)
  const auto xs = x.is_contiguous() ? x : x.contiguous();
  const int64_t M = K > 0 ? xs.numel() / K : 0;
  std::vector<Int8Weight> parts;
  int64_t blocks = 0;
  for (size_t i = 0; i < qdata.size(); ++i) {
    const auto& q = qdata[i];
    const auto& sc = scale[i];
    TORCH_CHECK(q.device().is_cpu() && sc.device().is_cpu(), "gemv_int8: CPU tensors only");
    TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(),
                "gemv_int8: qdata must be a contiguous [N, K] int8 matrix");
    TORCH_CHECK(q.size(1) == K, "gemv_int8: x's last dimension must be the weight's K");
    const int64_t N = q.size(0);
    TORCH_CHECK(sc.numel() == N && at::isFloatingType(sc.scalar_type()), "gemv_int8: scale must hold one float per row");
    Int8Weight p;
    p.w = q.data_ptr<int8_t>();
    // the scales read in their own dtype where it is float32 or bfloat16 (a bfloat16 widens exactly):
    // no conversion allocated per call
    const bool own = sc.is_contiguous() && (sc.scalar_type() == at::kFloat || sc.scalar_type() == at::kBFloat16);
    p.scale = own ? sc : sc.reshape({N}).to(at::kFloat).contiguous();
    const c10::optional<torch::Tensor> b = bias.get(i);
    if (b.has_value() && b->defined()) {
      TORCH_CHECK(b->scalar_type() == x.scalar_type() && b->numel() == N, "gemv_int8: bias must be a [N] vector of x's dtype");
      p.bias = b->to(at::kFloat).contiguous();
    }
    auto shape = x.sizes().vec();
    shape.back() = N;
    p.y = torch::empty(shape, xs.options());
    p.N = N;
    p.first = blocks;
    blocks += (N + 3) / 4;
    parts.push_back(std::move(p));
  }
  const bool bf16 = xs.scalar_type() == at::kBFloat16;
  const Fixed16Rows fixed = bf16 ? fixed16_rows(xs, M, K) : Fixed16Rows{};
  const Float32Rows wide = bf16 ? Float32Rows{{}, nullptr} : float32_rows(xs);
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (const auto& p : parts) {
      const int64_t b0 = std::max(begin, p.first), b1 = std::min(end, p.first + (p.N + 3) / 4);
      if (b0 >= b1) continue;
      const int64_t n0 = (b0 - p.first) * 4, n1 = std::min(p.N, (b1 - p.first) * 4);
      if (p.scale.scalar_type() == at::kBFloat16)
        int8_columns<c10::BFloat16>(p, bf16 ? &fixed : nullptr, bf16 ? nullptr : &wide, M, K, n0, n1);
      else
        int8_columns<float>(p, bf16 ? &fixed : nullptr, bf16 ? nullptr : &wide, M, K, n0, n1);
    }
  });
  std::vector<torch::Tensor> out;
  for (auto& p : parts) out.push_back(std::move(p.y));
  return out;
}

// One int8 weight's product: the group of one (x [..., K], qdata [N, K], scale [N], bias [N] or None).
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& qdata, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias) {
  c10::List<c10::optional<torch::Tensor>> biases;
  biases.push_back(bias);
  return gemv_int8_group(x, {qdata}, {scale}, biases)[0];
}
