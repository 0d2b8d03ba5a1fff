// The package's CPU kernels as one Python extension (built by entmtp_hf.gemv).
#include <torch/extension.h>

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const torch::Tensor& mask, double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x @ weight.T + bias for a few rows, float32 or bfloat16 weights, float32 sums");
  m.def("decode_attention", &decode_attention,
        "attention of a few queries over a key/value cache, grouped heads in place, float32 sums");
}
