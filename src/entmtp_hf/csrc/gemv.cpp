// y = x @ W.T (+ b) for a few rows of x, AVX2 + FMA, float32 or bfloat16 weights (bfloat16 widened
// to float32 in registers: a bfloat16 is a float32's upper half), float32 sums: each weight row is
// read from memory once and multiplied into every row of x while it is in registers (or L1), so a
// product of a few rows costs about what reading W costs (a decode step is bound by reading the
// weights). Two layouts, each the faster for its dtype on a Zen 2 EPYC: float32 multiplies four
// weight rows at a time into up to four rows of x (tiles_range); bfloat16 reads each thread's share
// of W as one sequential stream, a row at a time (stream_range).
//
// Invariant: an output element's value depends only on its own row of x, the weight row and the
// bias, summed in one fixed order per dtype (float32: 8-lane partial sums over k in order, a fixed
// horizontal sum, the tail; bfloat16: four 8-lane partial sums over k in steps of 32, the rest of k
// in eights into the first, a fixed combination and horizontal sum, the tail), never on how many
// rows share the call: a tree's verification product equals the one-token product row for row, bit
// for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
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

// The frame both products share: x [..., K] widened to float32 rows once (a few rows), the bias as
// float32, y [M, N] in x's dtype, the columns split over torch's threads in contiguous ranges of
// blocks of four (float32's tiles; 64 columns at least per task); `range(xp, bp, y, M, n0, n1)`
// fills columns [n0, n1) of every row. Returns y shaped [..., N].
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
  const auto xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  std::vector<float> widened;
  const float* xp = xs.scalar_type() == at::kFloat ? xs.data_ptr<float>() : nullptr;
  if (!xp) {
    widened.resize(xs.numel());
    const c10::BFloat16* xb = xs.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < xs.numel(); ++i) widened[i] = static_cast<float>(xb[i]);
    xp = widened.data();
  }
  auto y = torch::empty({M, N}, xs.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    range(xp, bp, y, M, begin * 4, std::min(N, end * 4));
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
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
                  [&](const float* xp, const float* bp, torch::Tensor& y, int64_t M, int64_t n0, int64_t n1) {
                    const int64_t N = y.size(1), K = weight.size(1);
                    if (f32)
                      tiles_range(xp, weight.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, n0, n1);
                    else
                      stream_range(xp, weight.data_ptr<c10::BFloat16>(), static_cast<const float*>(nullptr), bp,
                                   y.data_ptr<c10::BFloat16>(), M, K, N, n0, n1);
                  });
}

// x [..., K] float32 or bfloat16, qdata [N, K] int8 (contiguous), scale [N] (one per row, any float
// dtype), bias [N] of x's dtype or None -> [..., N] of x's dtype: x @ (qdata * scale).T + bias, as an
// int8 weight-only quantization (torchao's Int8Tensor, per row) defines it, float32 sums.
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& qdata, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && qdata.device().is_cpu() && scale.device().is_cpu(), "gemv_int8: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gemv_int8: x must be float32 or bfloat16");
  TORCH_CHECK(qdata.scalar_type() == at::kChar && qdata.dim() == 2 && qdata.is_contiguous(),
              "gemv_int8: qdata must be a contiguous [N, K] int8 matrix");
  const int64_t N = qdata.size(0), K = qdata.size(1);
  TORCH_CHECK(scale.numel() == N && at::isFloatingType(scale.scalar_type()), "gemv_int8: scale must hold one float per row");
  // the scales read in their own dtype where it is float32 or bfloat16 (a bfloat16 widens exactly):
  // no conversion allocated per call
  const bool own = scale.is_contiguous() && (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16);
  const auto sc = own ? scale : scale.reshape({N}).to(at::kFloat).contiguous();
  const int8_t* wp = qdata.data_ptr<int8_t>();
  const auto run = [&](auto* sp) {
    return few_rows("gemv_int8", x, N, K, bias,
                    [&](const float* xp, const float* bp, torch::Tensor& y, int64_t M, int64_t n0, int64_t n1) {
                      if (y.scalar_type() == at::kFloat)
                        stream_range(xp, wp, sp, bp, y.data_ptr<float>(), M, K, N, n0, n1);
                      else
                        stream_range(xp, wp, sp, bp, y.data_ptr<c10::BFloat16>(), M, K, N, n0, n1);
                    });
  };
  if (sc.scalar_type() == at::kBFloat16) return run(static_cast<const c10::BFloat16*>(sc.data_ptr<c10::BFloat16>()));
  return run(static_cast<const float*>(sc.data_ptr<float>()));
}
