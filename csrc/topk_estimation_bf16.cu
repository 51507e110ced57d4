// Instantiations of the top-k estimation kernel for __nv_bfloat16 inputs.
#include "topk_estimation_kernel.cuh"

namespace dsv {
int topk_launch_bf16(const TopkArgs& a, void* stream) {
  return (int)launch_r<__nv_bfloat16>(a, static_cast<cudaStream_t>(stream));
}
}  // namespace dsv
