// The operators as torch.ops.radixray.* (what a torch.compile'd graph calls) and as the pybind11
// module's functions (what eager code calls: a few microseconds less per call).
#include <torch/extension.h>
#include <torch/library.h>

#include "common.h"

// lora.cpp (declared here: its one operator is registered only in this file)
void lora_sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b,
               torch::Tensor seg_indptr, torch::Tensor weight_indices, torch::Tensor ranks, torch::Tensor scalings,
               torch::Tensor out_offsets);

TORCH_LIBRARY_FRAGMENT(radixray, m) {
  m.def("decode_attention_rope(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_buf, "
        "Tensor(b!) v_buf, Tensor out_loc, Tensor req_to_token, Tensor rows, Tensor seq_lens, int num_heads, "
        "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("argmax_rows(Tensor logits, Tensor(a!) ids, Tensor(b!) void_ids) -> ()");
  m.def("gemm(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("gemm_bf16(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("onednn_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("qgemm(Tensor x, Tensor qweight, Tensor scales, Tensor? biases, int bits, int group_size, int n) -> Tensor");
  m.def("lora_sgmv(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_indptr, Tensor weight_indices, "
        "Tensor ranks, Tensor scalings, Tensor out_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(radixray, CPU, m) {
  m.impl("decode_attention_rope", &decode_attention_rope);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("gemm", &gemm);
  m.impl("gemm_bf16", &gemm_bf16);
  m.impl("onednn_linear", &onednn_linear);
  m.impl("qgemm", &qgemm);
  m.impl("lora_sgmv", &lora_sgmv);
}

TORCH_LIBRARY_IMPL(radixray, MkldnnCPU, m) {  // oneDNN's packed weight is an MKLDNN-layout tensor
  m.impl("onednn_linear", &onednn_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels touch no Python object: they run without the GIL, so the scheduler thread keeps
  // going while the overlap forward thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, nogil, "paged decode attention (CPU, float32)");
  m.def("decode_attention_rope", &decode_attention_rope, nogil, "RoPE + KV store + paged decode attention");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm");
  m.def("add_rms_norm", &add_rms_norm, nogil, "residual += x; RMSNorm(residual)");
  m.def("argmax_rows", &argmax_rows, nogil, "greedy ids, -1 for non-finite rows");
  m.def("masked_argmax_rows", &masked_argmax_rows, nogil, "greedy ids over the tokens a bitmask allows");
  m.def("stream_sum", &stream_sum, "read a buffer with every thread");
  m.def("gemm_available", &gemm_available, "the AVX-512 GEMM is built");
  m.def("gemm_pack", &gemm_pack, "pack W [N, K] into 16-column panels");
  m.def("gemm", &gemm, nogil, "x @ W^T (+ bias) over packed W");
  m.def("gemm_bf16_available", &gemm_bf16_available, "the AVX512-BF16 GEMM is built");
  m.def("gemm_pack_bf16", &gemm_pack_bf16, "pack bf16 W [N, K] into 16-column panels of k pairs");
  m.def("gemm_bf16", &gemm_bf16, nogil, "x @ W^T (+ bias), bfloat16, over packed W");
  m.def("qgemm", &qgemm, nogil, "x @ dequantize(W)^T over quantized W (kernels/quant.py's format)");
  m.def("lora_sgmv", &lora_sgmv, nogil, "y += the segmented LoRA update (kernels/lora.py's layouts)");
}
