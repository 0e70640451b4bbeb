// Host stand-ins for the device intrinsics flashgen's headers mention, so g++ parses them for layout checks
// (tests/host/layout_check.cpp); none of them is ever called there.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
inline int __dp4a(int, int, int) { return 0; }
inline unsigned __byte_perm(unsigned, unsigned, unsigned) { return 0; }
template <class T> T __hfma2(T a, T, T) { return a; }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __shfl_xor_sync(unsigned, float x, int) { return x; }
inline int __shfl_xor_sync(unsigned, int x, int) { return x; }
inline unsigned __shfl_xor_sync(unsigned, unsigned x, int) { return x; }
static uint3 threadIdx, blockIdx;
static dim3 gridDim, blockDim;
inline void __syncthreads() {}
inline void __syncwarp() {}
