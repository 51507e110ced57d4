// Instantiations of the top-k estimation kernel for __half inputs.
#include "topk_estimation_kernel.cuh"

namespace dsv {
int topk_launch_f16(const TopkArgs& a, void* stream) {
  return (int)launch_r<__half>(a, static_cast<cudaStream_t>(stream));
}
}  // namespace dsv
