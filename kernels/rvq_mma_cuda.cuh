// rvqstore: device helpers of the tensor-core attention kernel (rvq_attend_mma.inc; CUDA, sm_80 and later).
// Included after rvq_prelude_cuda.cuh by that kernel only.
#define RVQ_EXP2(x) rvq_ex2(x)
#define RVQ_PRMT(a, b, s) __byte_perm((a), (b), (s))
#define RVQ_NOUNROLL _Pragma("unroll 1")
RVQ_FN float rvq_ex2(float x) {  // 2^x (ex2.approx: 2 ulp; 2^-inf = +0)
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// (lo, hi) -> one f16x2 word, lo in the low half (cvt puts its first source in the high half)
RVQ_FN uint rvq_h2(float lo, float hi) {
  uint r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// c (16x8 f32) += a (16x16 f16, row) . b (16x8 f16, col): the PTX fragment layouts (lane = 4 g + j)
RVQ_FN void rvq_mma(float* c, const uint* a, uint b0, uint b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// four neighbouring coordinates (codes at the bottom of f1 / f2) -> (y0, y1), (y2, y3) as f16x2. lut: the
// conflict-free table seen from this lane (entry e at lut[32 e]): pairs of coordinates where B1 + B2 <= 4,
// else single coordinates stored as (y, y)
template <int B1, int B2>
RVQ_FN void rvq_dec4(const uint* lut, uint f1, uint f2, uint& b0, uint& b1) {
  if (B1 + B2 <= 4) {
    const uint m1 = (1u << (2 * B1)) - 1u;
    const uint m2 = (1u << (2 * B2)) - 1u;
    b0 = lut[(((f1 & m1) << (2 * B2)) | (f2 & m2)) * 32u];
    b1 = lut[((((f1 >> (2 * B1)) & m1) << (2 * B2)) | ((f2 >> (2 * B2)) & m2)) * 32u];
  } else {
    const uint m1 = (1u << B1) - 1u;
    const uint m2 = (1u << B2) - 1u;
    uint h[4];
    RVQ_UNROLL
    for (int e = 0; e < 4; ++e) h[e] = lut[((((f1 >> (e * B1)) & m1) << B2) | ((f2 >> (e * B2)) & m2)) * 32u];
    b0 = __byte_perm(h[0], h[1], 0x5410u);
    b1 = __byte_perm(h[2], h[3], 0x5410u);
  }
}
// two neighbouring coordinates -> u0 with y0 in its low half, u1 with y1 in its high half
template <int B1, int B2>
RVQ_FN void rvq_dec2(const uint* lut, uint f1, uint f2, uint& u0, uint& u1) {
  if (B1 + B2 <= 4) {
    u0 = lut[(((f1 & ((1u << (2 * B1)) - 1u)) << (2 * B2)) | (f2 & ((1u << (2 * B2)) - 1u))) * 32u];
    u1 = u0;
  } else {
    const uint m1 = (1u << B1) - 1u;
    const uint m2 = (1u << B2) - 1u;
    u0 = lut[(((f1 & m1) << B2) | (f2 & m2)) * 32u];
    u1 = lut[((((f1 >> B1) & m1) << B2) | ((f2 >> B2) & m2)) * 32u];
  }
}
// the same where rows 8..15 of a and c are zero and unused (up to 8 query rows): their accumulators are
// outputs nobody reads, so they take no registers
RVQ_FN void rvq_mma_lo(float* c, const uint* a, uint b0, uint b1) {
  float d2, d3;
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%10,%10};\n"
      : "+f"(c[0]), "+f"(c[1]), "=f"(d2), "=f"(d3)
      : "r"(a[0]), "r"(0u), "r"(a[2]), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f));
}
template <bool HI>
RVQ_FN void rvq_mma_rows(float* c, const uint* a, uint b0, uint b1) {
  if (HI) {
    rvq_mma(c, a, b0, b1);
  } else {
    rvq_mma_lo(c, a, b0, b1);
  }
}
// N consecutive code words (N = 1, 2 or 4; p aligned to 4 N bytes) as one load
template <int N>
RVQ_FN void rvq_ld_words(const uint* p, uint* w) {
  if (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  } else {
    RVQ_UNROLL
    for (int n = 0; n < N; ++n) w[n] = p[n];
  }
}
// N (2 or 4) consecutive bfloat16 (p aligned to 2 N bytes) as floats into f[0, N), one load
template <int N>
RVQ_FN void rvq_ld_bf16xn(const unsigned short* p, float (&f)[4]) {
  if (N == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xFFFF0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xFFFF0000u);
  } else {
    const uint v = *reinterpret_cast<const uint*>(p);
    f[0] = __uint_as_float(v << 16);
    f[1] = __uint_as_float(v & 0xFFFF0000u);
  }
}
// N (2 or 4) consecutive bfloat16 (p aligned to 2 N bytes) as their raw words into w[0, N / 2), one load: the
// conversion waits for the load, so a prefetch keeps the words and converts them when the tile is computed
template <int N>
RVQ_FN void rvq_ld_bf16w(const unsigned short* p, uint (&w)[2]) {
  if (N == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint*>(p);
  }
}
// the floats of N bfloat16 words loaded by rvq_ld_bf16w (element i in half i % 2 of word i / 2, low half first)
template <int N>
RVQ_FN void rvq_bf16w_floats(const uint (&w)[2], float (&f)[4]) {
  RVQ_UNROLL
  for (int i = 0; i < N; ++i) f[i] = __uint_as_float((i & 1) ? (w[i >> 1] & 0xFFFF0000u) : (w[i >> 1] << 16));
}
// 2+2 codes: the table indices of the 8 coordinate pairs of a stage-1 word w1 and its stage-2 word w2 (pair p:
// nibble p of w1 above nibble p of w2), as bytes: pair 2k in byte k of lo, pair 2k + 1 in byte k of hi
RVQ_FN void rvq_idx22(uint w1, uint w2, uint& lo, uint& hi) {
  lo = (w2 & 0x0F0F0F0Fu) | ((w1 << 4) & 0xF0F0F0F0u);
  hi = ((w2 >> 4) & 0x0F0F0F0Fu) | (w1 & 0xF0F0F0F0u);
}
// 4+2 codes: the table indices (stage-1 code above its stage-2 code, as rvq_dec4's) of the 16 coordinates of two
// stage-1 words a, b (coordinates 0-7, 8-15) and their stage-2 word c, as bytes: coordinate 4k + e in byte k of
// gi[e]. Two byte permutes gather the nibbles of coordinates (0,1), (4,5), (8,9), (12,13) and of (2,3), (6,7), ..;
// the crumbs of coordinates 4k + e sit at bits 8k + 2e of c
RVQ_FN void rvq_idx42(uint a, uint b, uint c, uint (&gi)[4]) {
  const uint lo = __byte_perm(a, b, 0x6420u);
  const uint hi = __byte_perm(a, b, 0x7531u);
  gi[0] = ((lo << 2) & 0x3C3C3C3Cu) | (c & 0x03030303u);
  gi[1] = ((lo >> 2) & 0x3C3C3C3Cu) | ((c >> 2) & 0x03030303u);
  gi[2] = ((hi << 2) & 0x3C3C3C3Cu) | ((c >> 4) & 0x03030303u);
  gi[3] = ((hi >> 2) & 0x3C3C3C3Cu) | ((c >> 6) & 0x03030303u);
}
// the table word at byte offset `off` from a 32-bit shared address `base`. Through the generic pointer the compiler
// built each table read's address from the index as (e * 32 | lane) * 4 + base, two instructions more per read (64
// of them a tile at 2+2). Volatile with a memory clobber, so the read stays after the barrier that publishes the table
RVQ_FN uint rvq_lut_off(uint base, uint off) {
  uint v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(base + off) : "memory");
  return v;
}
// a hint: the 128-byte line holding `p` into L2 (no register, nothing waits for it; rvq_attend_mma's T_L2PF)
RVQ_FN void rvq_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" : : "l"(p)); }
// cp.async (sm_80 on): BYTES (4, 8 or 16) from global memory to the shared address `dst`, no register in between;
// a thread's own copies are visible to it after rvq_cp_wait (rvq_attend_mma's T_STAGES)
template <int BYTES>
RVQ_FN void rvq_cp_async(uint dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" : : "r"(dst), "l"(src), "n"(BYTES) : "memory");
}
RVQ_FN uint rvq_smem_addr(const void* p) { return uint(__cvta_generic_to_shared(p)); }
RVQ_FN void rvq_cp_commit() { asm volatile("cp.async.commit_group;" : : : "memory"); }
// until at most N of this thread's committed groups are still in flight
template <int N>
RVQ_FN void rvq_cp_wait() {
  asm volatile("cp.async.wait_group %0;" : : "n"(N) : "memory");
}
// the GPU's global nanosecond timer (timing probes)
RVQ_FN unsigned long long rvq_clock() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// a const input the kernel writes (the fused merge's counters: MLX passes every input as const)
template <typename T>
RVQ_FN T* rvq_mut(const T* p) {
  return const_cast<T*>(p);
}
// x (R rows of D floats, shared) <- each row times H (Sylvester; D a power of two), by all 128 threads; one copy
// of the loop (the binary stays small), shifts for the butterflies' indices
template <int R, int D>
RVQ_FN void rvq_hadamard_rows(float* x, uint lid) {
  RVQ_NOUNROLL
  for (uint lg = 0u; (1u << lg) < uint(D); ++lg) {
    const uint h = 1u << lg;
    RVQ_NOUNROLL
    for (uint i = lid; i < uint(R * D / 2); i += 128u) {
      const uint r = i / uint(D / 2);
      const uint k = i - r * uint(D / 2);
      const uint a = r * uint(D) + ((k >> lg) << (lg + 1u)) + (k & (h - 1u));
      const float u = x[a];
      const float v = x[a + h];
      x[a] = u + v;
      x[a + h] = u - v;
    }
    RVQ_BARRIER();
  }
}
