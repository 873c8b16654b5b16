// ---- one vector's encode, shared by the kernels that write a step's codes (CUDA): the append kernel
// (rvq_append.inc) and the split kernel with the append folded in (rvq_attend_mma.inc, RVQ_ATTEND_FOLD). One body,
// so the two write the same bits. The codec's reference steps (rvqstore.codec.RVQCodec._rotate_reference, then
// quantize), thread i of the vector's D holding coordinate x:
//   norm = sqrt(sum x^2) (float32); s = bfloat16(norm); finite = float(s) <= lim[0];
//   y = H((finite ? x : 0) * signs) * (finite and s > 0 ? 1 / s : 0), H the Sylvester transform in the order
//   mx.hadamard_transform takes (strides 1, 2, 4, ...); the code pair = quantize(y) (stage 1 | stage 2 << 8).
// Every thread of the threadgroup calls it at once (it has barriers). xs: the vector's D floats of shared scratch
// (left holding H(..)), red: its D / 32 floats; sbits: the norm's bfloat16 bits (NaN past the limit), s32 its float.
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
  const float norm = RVQ_SQRT(tot);
  const uint sb = RVQ_F2BF16_BITS(norm);
  const bool fin = RVQ_BF16(sb) <= lim[0];  // NaN compares false
  sbits = fin ? sb : RVQ_F2BF16_BITS(RVQ_NAN);
  s32 = RVQ_BF16(sbits);
  const float inv = (fin && s32 > 0.0f) ? RVQ_DIV(1.0f, s32) : 0.0f;
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
