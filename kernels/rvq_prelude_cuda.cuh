// rvqstore fused RVQ kernels: CUDA dialect prelude (mx.fast.cuda_kernel).
// Everything that differs between Metal and CUDA lives in this file and in rvq_prelude_metal.h,
// plus the thread-index lines of rvq_body_prelude_*.inc; the device code (rvq_common.h) and the
// kernel bodies (rvq_encode.inc, rvq_decode.inc) are shared text.

typedef unsigned int uint;  // MLX's CUDA JIT prelude has no `uint`

#define RVQ_FN __device__ __forceinline__
typedef unsigned long long rvq_u64;
#define RVQ_U64 rvq_u64
#define RVQ_SHARED __shared__
#define RVQ_BARRIER() __syncthreads()
#define RVQ_UNROLL _Pragma("unroll")
// OR-combining code fragments across the lanes of a word: every lane of the warp takes part
#define RVQ_SHFL_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
// 16-byte vector loads/stores need an aligned base; an array with an odd offset takes scalar ones.
#define RVQ_ALIGNED16(p) ((reinterpret_cast<RVQ_U64>(p) & 15ull) == 0ull)

template <int VL>
struct rvq_vec;

template <>
struct rvq_vec<4> {
  static RVQ_FN void load(float* v, const float* p, RVQ_U64 off, bool al) {
    if (al) {
      const float4 q = *reinterpret_cast<const float4*>(p + off);
      v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
      v[0] = p[off]; v[1] = p[off + 1]; v[2] = p[off + 2]; v[3] = p[off + 3];
    }
  }
  static RVQ_FN void store(float* p, RVQ_U64 off, const float* v, bool al) {
    if (al) {
      *reinterpret_cast<float4*>(p + off) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      p[off] = v[0]; p[off + 1] = v[1]; p[off + 2] = v[2]; p[off + 3] = v[3];
    }
  }
};

template <>
struct rvq_vec<2> {
  static RVQ_FN void load(float* v, const float* p, RVQ_U64 off, bool al) {
    if (al) {
      const float2 q = *reinterpret_cast<const float2*>(p + off);
      v[0] = q.x; v[1] = q.y;
    } else {
      v[0] = p[off]; v[1] = p[off + 1];
    }
  }
  static RVQ_FN void store(float* p, RVQ_U64 off, const float* v, bool al) {
    if (al) {
      *reinterpret_cast<float2*>(p + off) = make_float2(v[0], v[1]);
    } else {
      p[off] = v[0]; p[off + 1] = v[1];
    }
  }
};

template <>
struct rvq_vec<1> {
  static RVQ_FN void load(float* v, const float* p, RVQ_U64 off, bool) { v[0] = p[off]; }
  static RVQ_FN void store(float* p, RVQ_U64 off, const float* v, bool) { p[off] = v[0]; }
};

// v: a local float[VL]; p: a float pointer; off: element offset (a multiple of VL)
#define RVQ_LOADV(v, p, off, VL, al) rvq_vec<VL>::load((v), (p), (off), (al))
#define RVQ_STOREV(p, off, v, VL, al) rvq_vec<VL>::store((p), (off), (v), (al))

// ---- attention on codes (rvq_attend.inc) ----
#define RVQ_EXP(x) __expf(x)
#define RVQ_NEG_INF __int_as_float(0xff800000)
#define RVQ_FMAX(a, b) fmaxf((a), (b))
// bfloat16 scale, passed as its uint16 bits: the float with those bits on top
#define RVQ_BF16(u) __uint_as_float(uint(u) << 16)

// ---- fused append (rvq_append.inc): IEEE-rounded sqrt and division, as MLX's float32 ops ----
#define RVQ_SQRT(x) __fsqrt_rn(x)
#define RVQ_DIV(a, b) __fdiv_rn((a), (b))
#define RVQ_NAN __int_as_float(0x7fc00000)
// float -> bfloat16 bits exactly as MLX's astype on CUDA (round to nearest even)
#define RVQ_F2BF16_BITS(x) uint(__bfloat16_as_ushort(__float2bfloat16_rn(x)))
#define RVQ_STORE_BF16(p, i, bits) (reinterpret_cast<unsigned short*>(p)[(i)] = (unsigned short)(bits))
// element i of a bfloat16 array as float (exact: the bits on top of a float)
#define RVQ_BF16_AT(p, i) __uint_as_float(uint(reinterpret_cast<const unsigned short*>(p)[(i)]) << 16)
// the 16 bits of element i of a bfloat16 array
#define RVQ_BF16_BITS_AT(p, i) uint(reinterpret_cast<const unsigned short*>(p)[(i)])
