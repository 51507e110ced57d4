// Fused low-rank QK^T + per-group top-k (megatron_dsv.ops.topk_estimation).
// Host-side declarations only: no CUDA or torch headers, so bindings.cpp builds
// with the plain host compiler.
#pragma once
#include <cstdint>

namespace dsv {

enum TopkDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct TopkArgs {
  const void* q;          // [B, H, S, r] contiguous, dtype
  const void* k;          // [B, H, S, r] contiguous, dtype
  const int32_t* counts;  // [B, H] clipped budgets (0 <= count <= n_items)
  int32_t* out;           // [B, H, NG, kmax]
  uint32_t* bits;         // [B, H, NG, nw] scratch: selection bitmask, nw = ceil(n_items / 32)
  int B, H, S, r, G;
  int block_size;         // 0 (tokens), 64 or 128
  int NG, n_items, kmax, nw;
  int proxy;              // 0 mean, 1 middle
  int block_score;        // 0 max, 1 log-sum-exp
  int dtype;              // TopkDType
  int sample_stride;      // 0: chosen per (batch, head) from its budget; >= 1: forced (tests)
  int flags;              // bit 0: every row takes the exact fallback (tests); bits 1, 2: stop after
                          // the main pass / before the compaction (timing only: lists incomplete)
};

// Launches on `stream` (a cudaStream_t). Returns 0 or a cudaError_t code.
int topk_estimation_launch(const TopkArgs& a, void* stream);
const char* topk_error_string(int code);
// Dynamic shared memory of the main kernel, in bytes (for documentation/tests).
int topk_smem_bytes();

}  // namespace dsv
