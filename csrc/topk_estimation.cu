// Host entry points of the top-k estimation kernel: dtype dispatch (the kernels are
// instantiated per dtype in topk_estimation_{f32,f16,bf16}.cu).
#include <cuda_runtime.h>

#include "topk_estimation_common.cuh"

namespace dsv {

int topk_launch_f32(const TopkArgs& a, void* stream);
int topk_launch_f16(const TopkArgs& a, void* stream);
int topk_launch_bf16(const TopkArgs& a, void* stream);

int topk_estimation_launch(const TopkArgs& a, void* stream) {
  switch (a.dtype) {
    case kFloat32: return topk_launch_f32(a, stream);
    case kFloat16: return topk_launch_f16(a, stream);
    case kBFloat16: return topk_launch_bf16(a, stream);
    default: return (int)cudaErrorInvalidValue;
  }
}

const char* topk_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int topk_smem_bytes() { return (int)sizeof(Shared); }

}  // namespace dsv
