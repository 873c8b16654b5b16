// ---- one vector's encode, for the kernels that write a step's codes (CUDA): rvq_encode_coord by a threadgroup of
// D threads (the append kernel, rvq_append.inc), rvq_encode_warp by one warp (the split kernel with the append folded
// in, rvq_attend_mma.inc, RVQ_ATTEND_FOLD): the same operations in the same order, so the same bits (checked at each
// configuration's first use, rvqstore.attention.fold, and by tests/test_decode_step_gpu.py). The codec's reference steps (rvqstore.codec.RVQCodec._rotate_reference, then
// quantize), thread i of the vector's D holding coordinate x:
//   norm = sqrt(sum x^2) (float32); s = bfloat16(norm); finite = float(s) <= lim[0];
//   y = H((finite ? x : 0) * signs) * (finite and s > 0 ? 1 / s : 0), H the Sylvester transform in the order
//   mx.hadamard_transform takes (strides 1, 2, 4, ...); the code pair = quantize(y) (stage 1 | stage 2 << 8).
// Every thread of the threadgroup calls it at once (it has barriers). xs: the vector's D floats of shared scratch
// (left holding H(..)), red: its D / 32 floats; sbits: the norm's bfloat16 bits (NaN past the limit), s32 its float.
// A vector's scale from its sum of squares: the norm rounded to bfloat16 (sbits; NaN past the limit lim[0], which a
// NaN norm is too), its float s32 and the factor inv that takes the rotated vector to unit norm (0 for a zero or
// non-finite one). Returns whether the vector is finite (its coordinates kept).
RVQ_FN bool rvq_norm_scale(float tot, const float* lim, uint& sbits, float& s32, float& inv) {
  const float norm = RVQ_SQRT(tot);
  const uint sb = RVQ_F2BF16_BITS(norm);
  const bool fin = RVQ_BF16(sb) <= lim[0];  // NaN compares false
  sbits = fin ? sb : RVQ_F2BF16_BITS(RVQ_NAN);
  s32 = RVQ_BF16(sbits);
  inv = (fin && s32 > 0.0f) ? RVQ_DIV(1.0f, s32) : 0.0f;
  return fin;
}

template <int D, int B1, int B2, int MODE, int SEARCH, typename TT>
RVQ_FN uint rvq_encode_coord(float x, uint i, const float* sg, const float* lim, TT tab, float* xs, float* red,
                             uint& sbits, float& s32) {
  constexpr int NWARP = D / 32;
  float ss = x * x;
  RVQ_UNROLL
  for (uint o = 16u; o > 0u; o >>= 1) ss += RVQ_SHFL_XOR(ss, o);
  if ((i & 31u) == 0u) red[i >> 5] = ss;
  RVQ_BARRIER();
  float tot = red[0];
  RVQ_UNROLL
  for (int w = 1; w < NWARP; ++w) tot += red[w];
  float inv;
  const bool fin = rvq_norm_scale(tot, lim, sbits, s32, inv);
  xs[i] = (fin ? x : 0.0f) * sg[i];
  RVQ_BARRIER();
  for (uint h = 1u; h < uint(D); h <<= 1) {
    const float nx = ((i & h) == 0u) ? xs[i] + xs[i + h] : xs[i - h] - xs[i];
    RVQ_BARRIER();
    xs[i] = nx;
    RVQ_BARRIER();
  }
  return rvq_quantize<B1, B2, MODE, SEARCH>(xs[i] * inv, tab);
}

// word w of a stage's packed codes from the vector's code pairs qc (shared): stage 1's codes are the pairs' low
// bytes, stage 2's (STAGE2) their high ones; LSB first, B bits a code
template <int B, bool STAGE2>
RVQ_FN uint rvq_pack_word(const uint* qc, uint w) {
  constexpr int P = 32 / B;
  uint x = 0u;
  RVQ_UNROLL
  for (int e = 0; e < P; ++e) x |= (STAGE2 ? (qc[w * uint(P) + uint(e)] >> 8) : (qc[w * uint(P) + uint(e)] & 0xffu)) << uint(e * B);
  return x;
}

// The same encode by one warp, with no barriers (the split kernel with the append folded in: a threadgroup's other
// warps go on meanwhile). Lane l holds coordinates 32 e + l (e < D / 32): each e's xor tree is warp e's in
// rvq_encode_coord and the norm the sum of those in their order; the butterflies' strides below 32 go by shuffles,
// the others through the lane's registers, in the same order and with the same operands: the same bits.
// xrow: the vector's D inputs; tab: the encode table (this warp's copy, in shared memory); qc: the vector's D code
// pairs (shared; the warp is synchronized after writing them); sbits as rvq_encode_coord's.
template <int D, int B1, int B2, int MODE, int SEARCH, typename TX, typename TT>
RVQ_FN void rvq_encode_warp(TX xrow, uint lane, const float* sg, const float* lim, TT tab, uint* qc, uint& sbits) {
  constexpr int E = D / 32;
  float x[E];
  RVQ_UNROLL
  for (int e = 0; e < E; ++e) x[e] = float(xrow[32u * uint(e) + lane]);
  float tot = 0.0f;
  RVQ_UNROLL
  for (int e = 0; e < E; ++e) {
    float ss = x[e] * x[e];
    RVQ_UNROLL
    for (uint o = 16u; o > 0u; o >>= 1) ss += RVQ_SHFL_XOR(ss, o);
    tot = (e == 0) ? ss : tot + ss;
  }
  float s32, inv;
  const bool fin = rvq_norm_scale(tot, lim, sbits, s32, inv);
  float v[E];
  RVQ_UNROLL
  for (int e = 0; e < E; ++e) v[e] = (fin ? x[e] : 0.0f) * sg[32u * uint(e) + lane];
  RVQ_UNROLL
  for (uint h = 1u; h < 32u; h <<= 1) {  // lower: own + partner's; upper: partner's - own (rvq_encode_coord's nx)
    const bool upper = (lane & h) != 0u;
    RVQ_UNROLL
    for (int e = 0; e < E; ++e) {
      const float o2 = RVQ_SHFL_XOR(v[e], h);
      v[e] = upper ? o2 - v[e] : v[e] + o2;
    }
  }
  RVQ_UNROLL
  for (int h = 1; h < E; h <<= 1) {
    RVQ_UNROLL
    for (int e = 0; e < E; ++e) {
      if ((e & h) == 0) {
        const float a = v[e], b = v[e + h];
        v[e] = a + b;
        v[e + h] = a - b;
      }
    }
  }
  RVQ_UNROLL
  for (int e = 0; e < E; ++e) qc[32u * uint(e) + lane] = rvq_quantize<B1, B2, MODE, SEARCH>(v[e] * inv, tab);
  __syncwarp();
}
