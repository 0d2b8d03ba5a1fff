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

#include <algorithm>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float scalar(float v) { return v; }
inline float scalar(c10::BFloat16 v) { return static_cast<float>(v); }

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output columns [n0, n1) for M rows: four weight rows at a time (4 x M accumulators fit the
// sixteen registers for M <= 3; M = 4 spills a little and still streams W once).
template <int M, typename W>
void rows_block(const float* x, const W* w, const float* b, float* y, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  const int64_t K8 = K - K % 8;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m256 acc[4][M];
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    const W* wn = w + n * K;
    for (int64_t k = 0; k < K8; k += 8) {
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
        y[m * N + n + r] = b ? s + b[n + r] : s;
      }
  }
  for (; n < n1; ++n) {  // the last N % 4 columns, summed as above lane by lane
    const W* wn = w + n * K;
    for (int m = 0; m < M; ++m) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) acc = _mm256_fmadd_ps(load8(wn + k), _mm256_loadu_ps(x + m * K + k), acc);
      float s = horizontal_sum(acc);
      for (int64_t k = K8; k < K; ++k) s += scalar(wn[k]) * x[m * K + k];
      y[m * N + n] = b ? s + b[n] : s;
    }
  }
}

// Columns [n0, n1) for all M rows, four rows of x at a time. Over four rows the columns go in tiles
// of about 128 KB of weights, which stay in the core's L2 cache while each group of rows passes
// over them: the weights are read from memory once whatever M is.
template <typename W>
void rows_range(const float* x, const W* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
                int64_t n0, int64_t n1) {
  const int64_t per_tile = 131072 / (static_cast<int64_t>(sizeof(W)) * std::max<int64_t>(K, 1));
  const int64_t tile = M <= 4 ? n1 - n0 : std::max<int64_t>(4, per_tile / 4 * 4);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      if (left >= 4) {
        rows_block<4, W>(xm, w, b, ym, K, N, t0, t1);
        m0 += 4;
      } else if (left == 3) {
        rows_block<3, W>(xm, w, b, ym, K, N, t0, t1);
        m0 += 3;
      } else if (left == 2) {
        rows_block<2, W>(xm, w, b, ym, K, N, t0, t1);
        m0 += 2;
      } else {
        rows_block<1, W>(xm, w, b, ym, K, N, t0, t1);
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
  const auto x32 = x.reshape({-1, K}).to(at::kFloat).contiguous();  // a few rows: widened once
  const int64_t M = x32.size(0);
  auto y = torch::empty({M, N}, x32.options());
  const float* xp = x32.data_ptr<float>();
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // the columns in blocks of four across torch's threads; 16 blocks at least per task
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * 4, n1 = std::min(N, end * 4);
    if (dtype == at::kFloat) {
      rows_range(xp, weight.data_ptr<float>(), bp, yp, M, K, N, n0, n1);
    } else {
      rows_range(xp, weight.data_ptr<c10::BFloat16>(), bp, yp, M, K, N, n0, n1);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = N;
  return y.to(dtype).view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x @ weight.T + bias for a few rows, float32 or bfloat16 weights, float32 sums");
}
