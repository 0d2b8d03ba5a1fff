// y = x @ W.T (+ b) for a few rows of x, AVX2 + FMA, float32 or bfloat16 weights (bfloat16 widened
// to float32 in registers: a bfloat16 is a float32's upper half), float32 sums: each weight row is
// read from memory once and multiplied into every row of x while it is in registers, so a product
// of a few rows costs about what reading W costs (a decode step is bound by reading the weights).
//
// Invariant: an output element's value depends only on its own row of x, the weight row and the
// bias (8-lane partial sums over k in order, then a fixed horizontal sum, then the tail), never on
// how many rows share the call: a tree's verification product equals the one-token product row
// for row, bit for bit.
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

// Weight rows fetched ahead of the four being multiplied: each row is a short stream (a few KB), and
// the hardware prefetcher loses it at every row's end; fetching the rows eight ahead (non-temporal:
// they are read once) kept bfloat16 weights at 20-22 GB/s against 14-18 without, and three float32
// rows at 25-27 against 22-24. One float32 row keeps up without it (and ran ~10% slower with it).
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

// Columns [n0, n1) for all M rows, four rows of x at a time. Over four rows the columns go in tiles
// of about 128 KB of weights, which stay in the core's L2 cache while each group of rows passes
// over them: the weights are read from memory once whatever M is.
template <typename W>
void rows_range(const float* x, const W* w, const float* b, W* y, int64_t M, int64_t K, int64_t N,
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

// x [..., K] and weight [N, K] (contiguous) both float32 or both bfloat16, bias [N] of that dtype
// or None -> [..., N] of that dtype.
torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "gemv: CPU tensors only");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "gemv: float32 or bfloat16 weights only");
  TORCH_CHECK(x.scalar_type() == dtype, "gemv: x must have the weight's dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "gemv: weight must be a contiguous [N, K] matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "gemv: x's last dimension must be the weight's K");
  torch::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->numel() == N, "gemv: bias must be a [N] vector of the weight's dtype");
    b32 = bias->to(at::kFloat).contiguous();
  }
  // x widened to float32 once (a few rows); the output written in the weight's dtype by the kernel
  const auto xs = x.reshape({-1, K}).contiguous();
  const int64_t M = xs.size(0);
  std::vector<float> widened;
  const float* xp;
  if (dtype == at::kFloat) {
    xp = xs.data_ptr<float>();
  } else {
    widened.resize(M * K);
    const c10::BFloat16* xb = xs.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(xb[i]);
    xp = widened.data();
  }
  auto y = torch::empty({M, N}, xs.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  // the columns in blocks of four across torch's threads; 16 blocks at least per task
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * 4, n1 = std::min(N, end * 4);
    if (dtype == at::kFloat) {
      rows_range(xp, weight.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, n0, n1);
    } else {
      rows_range(xp, weight.data_ptr<c10::BFloat16>(), bp, y.data_ptr<c10::BFloat16>(), M, K, N, n0, n1);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.view(shape);
}
