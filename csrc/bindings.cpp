// pybind11 module megatron_dsv._C: raw device pointers (tensor.data_ptr()) and a
// CUDA stream handle (torch.cuda.current_stream().cuda_stream), so the module
// links only against the CUDA runtime, never torch's C++ ABI.
// Bad arguments raise std::invalid_argument (ValueError in Python); CUDA
// failures raise std::runtime_error (RuntimeError).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "topk_estimation.h"

namespace py = pybind11;

namespace {

[[noreturn]] void bad(const std::string& name, const std::string& msg) {
  throw std::invalid_argument("topk_estimation: `" + name + "` " + msg);
}

void need_ptr(const char* name, std::uintptr_t p, std::uintptr_t align) {
  if (p == 0) bad(name, "is a null device pointer");
  if (p % align) bad(name, "must be aligned to " + std::to_string(align) + " bytes");
}

int parse_choice(const char* name, const std::string& v, std::initializer_list<const char*> allowed) {
  int i = 0;
  std::string all;
  for (const char* a : allowed) {
    if (v == a) return i;
    all += (i ? ", " : "") + std::string(a);
    ++i;
  }
  bad(name, "must be one of {" + all + "}, got '" + v + "'");
}

void topk_estimation(std::uintptr_t q, std::uintptr_t k, std::uintptr_t counts, std::uintptr_t out,
                     std::uintptr_t bits, int B, int H, int S, int r, int group_size, int block_size,
                     int kmax, const std::string& dtype, const std::string& proxy,
                     const std::string& block_score, std::uintptr_t stream, int sample_stride, int flags) {
  if (B < 1) bad("B", "must be >= 1, got " + std::to_string(B));
  if (H < 1) bad("H", "must be >= 1, got " + std::to_string(H));
  if (S < 1) bad("S", "must be >= 1, got " + std::to_string(S));
  if ((long long)B * H > 65535) bad("B*H", "must be <= 65535 (grid y), got " + std::to_string((long long)B * H));
  if (r != 8 && r != 16 && r != 32) bad("r", "must be one of {8, 16, 32}, got " + std::to_string(r));
  if (group_size < 1) bad("group_size", "must be >= 1, got " + std::to_string(group_size));
  if (block_size != 0 && block_size != 64 && block_size != 128)
    bad("block_size", "must be one of {0, 64, 128}, got " + std::to_string(block_size));
  const int dt = parse_choice("dtype", dtype, {"float32", "float16", "bfloat16"});
  const int px = parse_choice("proxy", proxy, {"mean", "middle"});
  const int bsc = parse_choice("block_score", block_score, {"max", "lse"});
  const long long n_items = block_size ? (S + (long long)block_size - 1) / block_size : S;
  if (kmax < 0 || kmax > n_items)
    bad("kmax", "must be in [0, " + std::to_string(n_items) + "], got " + std::to_string(kmax));
  const long long ng = (S + (long long)group_size - 1) / group_size;
  if ((long long)S * r * B * H > (1ll << 40)) bad("q", "is too large");
  const std::uintptr_t esz = dt == 0 ? 4 : 2;
  need_ptr("q", q, dt == 0 ? 16 : 4);
  need_ptr("k", k, dt == 0 ? 16 : 4);
  need_ptr("counts", counts, 4);
  if (sample_stride < 0 || sample_stride > 64)
    bad("sample_stride", "must be in [0, 64] (0 = automatic), got " + std::to_string(sample_stride));
  if (flags < 0 || flags > 7)
    bad("flags", "must be in [0, 7] (1: force the exact fallback; 2, 4: timing stops), got " + std::to_string(flags));
  if (kmax > 0) {
    need_ptr("out", out, 4);
    need_ptr("bits", bits, 4);
  }
  (void)esz;
  dsv::TopkArgs a{};
  a.q = reinterpret_cast<const void*>(q);
  a.k = reinterpret_cast<const void*>(k);
  a.counts = reinterpret_cast<const int32_t*>(counts);
  a.out = reinterpret_cast<int32_t*>(out);
  a.bits = reinterpret_cast<uint32_t*>(bits);
  a.B = B;
  a.H = H;
  a.S = S;
  a.r = r;
  a.G = group_size;
  a.block_size = block_size;
  a.NG = (int)ng;
  a.n_items = (int)n_items;
  a.kmax = kmax;
  a.nw = (int)((n_items + 31) / 32);
  a.sample_stride = sample_stride;
  a.flags = flags;
  a.proxy = px;
  a.block_score = bsc;
  a.dtype = dt;
  const int err = dsv::topk_estimation_launch(a, reinterpret_cast<void*>(stream));
  if (err != 0) throw std::runtime_error(std::string("topk_estimation: CUDA error: ") + dsv::topk_error_string(err));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "megatron_dsv CUDA kernels (pybind11 over raw device pointers and a CUDA stream)";
  m.def("topk_estimation", &topk_estimation, py::arg("q"), py::arg("k"), py::arg("counts"), py::arg("out"),
        py::arg("bits"), py::arg("B"), py::arg("H"), py::arg("S"), py::arg("r"), py::arg("group_size"),
        py::arg("block_size"), py::arg("kmax"), py::arg("dtype"), py::arg("proxy"), py::arg("block_score"),
        py::arg("stream"), py::arg("sample_stride") = 0, py::arg("flags") = 0,
        "Fused low-rank scores + per-group top-k. Pointers are tensor.data_ptr() of contiguous CUDA tensors:\n"
        "q, k [B, H, S, r] (dtype), counts int32 [B, H] (clipped budgets), out int32 [B, H, ceil(S/G), kmax],\n"
        "bits int32 [B, H, ceil(S/G), ceil(n_items/32)] scratch. Runs on `stream` (cudaStream_t as int).\n"
        "sample_stride: 0 = automatic, else every sample_stride-th tile feeds the threshold sample (tests);\n"
        "flags: 1 = every row takes the exact fallback path (tests); 2 / 4 stop after the main pass / before the\n"
        "compaction (timing of the kernel's stages only: the lists are then incomplete).");
  m.def("topk_smem_bytes", &dsv::topk_smem_bytes, "Dynamic shared memory of the selection kernel (bytes).");
}
