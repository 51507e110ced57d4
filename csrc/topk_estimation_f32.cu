// Instantiations of the top-k estimation kernel for float inputs.
#include "topk_estimation_kernel.cuh"

namespace dsv {
int topk_launch_f32(const TopkArgs& a, void* stream) {
  return (int)launch_r<float>(a, static_cast<cudaStream_t>(stream));
}
}  // namespace dsv
