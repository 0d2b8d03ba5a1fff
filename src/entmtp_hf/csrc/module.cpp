// The package's CPU kernels as one extension (built by entmtp_hf.gemv): Python functions for eager
// calls, and operators (entmtp_hf_cpu::gemv, entmtp_hf_cpu::gemv_int8 and its group, entmtp_hf_cpu::decode_attention)
// that compiled graphs call through the dispatcher, with no Python between the graph and the kernel.
#include <torch/extension.h>
#include <torch/library.h>

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
const char* gemv_refusal(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);
torch::Tensor gemv_int8(const torch::Tensor& x, const torch::Tensor& qdata, const torch::Tensor& scale,
                        const c10::optional<torch::Tensor>& bias);
std::vector<torch::Tensor> gemv_int8_group(const torch::Tensor& x, const std::vector<torch::Tensor>& qdata,
                                           const std::vector<torch::Tensor>& scale,
                                           const c10::List<c10::optional<torch::Tensor>>& bias);
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                               const torch::Tensor& mask, double scale);

namespace {

// A graph's product: gemv where it takes the tensors it is given, at::linear otherwise (a graph
// traced for one weight may be called with another: it stays F.linear's product either way).
torch::Tensor graph_gemv(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  if (gemv_refusal(x, weight, bias) != nullptr) return at::linear(x, weight, bias);
  return gemv(x, weight, bias);
}

// x [..., K] times a weight of N rows -> [..., N] in x's dtype: both products' shape
torch::Tensor product_shape(const torch::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options());
}

torch::Tensor gemv_meta(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  return product_shape(x, weight.size(0));
}

torch::Tensor gemv_int8_meta(const torch::Tensor& x, const torch::Tensor& qdata, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& bias) {
  return product_shape(x, qdata.size(0));
}

std::vector<torch::Tensor> gemv_int8_group_meta(const torch::Tensor& x, const std::vector<torch::Tensor>& qdata,
                                                const std::vector<torch::Tensor>& scale,
                                                const c10::List<c10::optional<torch::Tensor>>& bias) {
  std::vector<torch::Tensor> out;
  for (const auto& q : qdata) out.push_back(product_shape(x, q.size(0)));
  return out;
}

torch::Tensor decode_attention_meta(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                    const torch::Tensor& mask, double scale) {
  return at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "x @ weight.T + bias for a few rows, float32 or bfloat16 weights, float32 sums");
  m.def("gemv_int8", &gemv_int8, "x @ (qdata * scale).T + bias for a few rows, int8 weights with a scale per row");
  m.def("decode_attention", &decode_attention,
        "attention of a few queries over a key/value cache, grouped heads in place, float32 sums");
}

TORCH_LIBRARY(entmtp_hf_cpu, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor qdata, Tensor scale, Tensor? bias) -> Tensor");
  // several int8 weights' products of one x (compiled graphs group a layer's products of one input)
  m.def("gemv_int8_group(Tensor x, Tensor[] qdata, Tensor[] scale, Tensor?[] bias) -> Tensor[]");
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(entmtp_hf_cpu, CPU, m) {
  m.impl("gemv", &graph_gemv);
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int8_group", &gemv_int8_group);
  m.impl("decode_attention", &decode_attention);
}

// shapes only: what tracing (fake tensors) runs
TORCH_LIBRARY_IMPL(entmtp_hf_cpu, Meta, m) {
  m.impl("gemv", &gemv_meta);
  m.impl("gemv_int8", &gemv_int8_meta);
  m.impl("gemv_int8_group", &gemv_int8_group_meta);
  m.impl("decode_attention", &decode_attention_meta);
}
