// rvqstore fused RVQ kernels: Metal dialect prelude (mx.fast.metal_kernel).
// See rvq_prelude_cuda.cuh for the CUDA counterpart; the device code and kernel bodies are shared.
#include <metal_stdlib>
using namespace metal;

#define RVQ_FN inline
typedef ulong rvq_u64;
#define RVQ_U64 rvq_u64
#define RVQ_SHARED threadgroup
#define RVQ_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define RVQ_UNROLL _Pragma("clang loop unroll(full)")
// OR-combining code fragments across the lanes of a word: every lane of the simdgroup takes part
#define RVQ_SHFL_XOR(v, m) simd_shuffle_xor((v), ushort(m))
// Metal: element-wise accesses (MLX hands small inputs over in the constant address space, so
// the pointers are not cast); the compiler merges neighbouring ones.
#define RVQ_ALIGNED16(p) true
#define RVQ_LOADV(v, p, off, VL, al) \
  for (int rvq_e_ = 0; rvq_e_ < (VL); ++rvq_e_) (v)[rvq_e_] = (p)[(off) + rvq_e_]
#define RVQ_STOREV(p, off, v, VL, al) \
  for (int rvq_e_ = 0; rvq_e_ < (VL); ++rvq_e_) (p)[(off) + rvq_e_] = (v)[rvq_e_]

// ---- attention on codes (rvq_attend.inc) ----
#define RVQ_EXP(x) metal::fast::exp(x)
#define RVQ_NEG_INF as_type<float>(0xff800000u)
#define RVQ_FMAX(a, b) metal::fmax((a), (b))
// bfloat16 scale, passed as its uint16 bits: the float with those bits on top
#define RVQ_BF16(u) as_type<float>(uint(u) << 16)
// element i of an array of bfloat16 bits (the launch passes Metal a uint16 view) as float
#define RVQ_BF16_AT(p, i) RVQ_BF16((p)[(i)])
