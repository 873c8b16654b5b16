// rvqstore fused RVQ kernels: device code shared by the Metal and CUDA dialects.
//
// Needs from the prelude: uint, RVQ_FN, RVQ_U64, RVQ_UNROLL, RVQ_LOADV, RVQ_STOREV.
//
// Work split: a vector of D coordinates is cut into chunks of C = lcm(32/B1, 32/B2) coordinates
// (C = 32/B1 for a single stage), so a chunk holds whole words of both packed streams. One thread
// handles one chunk: it loads the chunk with VL-wide loads, quantizes every coordinate in
// registers and writes C/(32/B1) + C/(32/B2) complete words (decode: reads the words, writes the
// chunk). A vector's last chunk may be shorter (clen < C); then it also writes the partial last
// words. Nothing but the packed words (decode: the floats) touches device memory.
//
// MODE: 0 single stage, 1 conditional residual, 2 shared residual.
// Encode table (float, in threadgroup memory):
//   MODE 0: boundaries1                     (2^B1 - 1)
//   MODE 1: fine thresholds (boundaries1 and every cell's stage-2 thresholds, interleaved, sorted)
//           (2^(B1+B2) - 1): count = idx1 * 2^B2 + idx2
//   MODE 2: boundaries1 (2^B1 - 1) | centroids1 (2^B1) | boundaries2[0] (2^B2 - 1)
// Decode table:
//   MODE 0: centroids1 (2^B1); MODE 1: centroids2 flat (2^(B1+B2)); MODE 2: centroids1 | centroids2[0]

// Number of entries of the sorted table tab[OFF .. OFF + 2^L - 2] that are < y, i.e.
// sum_k [y > t_k] exactly as the reference counts it (NaN counts nothing).
// SEARCH 0: branch-free binary search (L probes); SEARCH 1: linear count (2^L - 1 compares).
template <int L, int OFF, int SEARCH, typename TT>
RVQ_FN uint rvq_count_below(float y, TT tab) {
  uint p = 0u;
  if (SEARCH == 0) {
    RVQ_UNROLL
    for (int s = L - 1; s >= 0; --s) {
      const uint st = 1u << s;
      p = (tab[OFF + p + st - 1u] < y) ? p + st : p;
    }
  } else {
    RVQ_UNROLL
    for (int k = 0; k < (1 << L) - 1; ++k) {
      p += (tab[OFF + k] < y) ? 1u : 0u;
    }
  }
  return p;
}

// Both stage indices of one coordinate: idx1 | idx2 << 8.
template <int B1, int B2, int MODE, int SEARCH, typename TT>
RVQ_FN uint rvq_quantize(float y, TT tab) {
  if (MODE == 1) {
    const uint p = rvq_count_below<B1 + B2, 0, SEARCH>(y, tab);
    return (p >> B2) | ((p & ((1u << B2) - 1u)) << 8);
  } else if (MODE == 2) {
    const uint i1 = rvq_count_below<B1, 0, SEARCH>(y, tab);
    const float r = y - tab[((1 << B1) - 1) + i1];  // float32 residual, as the reference
    const uint i2 = rvq_count_below<B2, ((1 << B1) - 1) + (1 << B1), SEARCH>(r, tab);
    return i1 | (i2 << 8);
  }
  return rvq_count_below<B1, 0, SEARCH>(y, tab);
}

// Encode one chunk: coordinates [yoff, yoff + clen) of y -> words o1.. of codes1, o2.. of codes2.
// FULL: clen == C (known at compile time); otherwise clen < C, a multiple of VL.
template <int C, int B1, int B2, int MODE, int SEARCH, int VL, bool FULL,
          typename TY, typename TT, typename TO1, typename TO2>
RVQ_FN void rvq_encode_chunk(TY y, RVQ_U64 yoff, bool al, int clen, TT tab,
                             TO1 codes1, RVQ_U64 o1, TO2 codes2, RVQ_U64 o2) {
  constexpr int P1 = 32 / B1;
  constexpr int P2 = (B2 > 0) ? 32 / B2 : 32;
  constexpr int NW1 = C / P1;
  constexpr int NW2 = (B2 > 0) ? C / P2 : 1;
  uint w1[NW1];
  uint w2[NW2];
  RVQ_UNROLL
  for (int k = 0; k < NW1; ++k) w1[k] = 0u;
  RVQ_UNROLL
  for (int k = 0; k < NW2; ++k) w2[k] = 0u;
  RVQ_UNROLL
  for (int j = 0; j < C; j += VL) {
    if (FULL || j < clen) {
      float v[VL];
      RVQ_LOADV(v, y, yoff + j, VL, al);
      RVQ_UNROLL
      for (int e = 0; e < VL; ++e) {
        const int jj = j + e;
        const uint q = rvq_quantize<B1, B2, MODE, SEARCH>(v[e], tab);
        w1[jj / P1] |= (q & 0xffu) << ((jj % P1) * B1);
        if (B2 > 0) w2[jj / P2] |= (q >> 8) << ((jj % P2) * B2);
      }
    }
  }
  // all stores after all loads: the compiler may keep every load of the chunk in flight
  RVQ_UNROLL
  for (int k = 0; k < NW1; ++k) {
    if (FULL || k * P1 < clen) codes1[o1 + k] = w1[k];
  }
  if (B2 > 0) {
    RVQ_UNROLL
    for (int k = 0; k < NW2; ++k) {
      if (FULL || k * P2 < clen) codes2[o2 + k] = w2[k];
    }
  }
}

// Decode one chunk: words o1.. of codes1 (and o2.. of codes2) -> out[ooff, ooff + clen).
template <int C, int B1, int B2, int MODE, int VL, bool FULL,
          typename TC1, typename TC2, typename TT, typename TO>
RVQ_FN void rvq_decode_chunk(TC1 codes1, RVQ_U64 o1, TC2 codes2, RVQ_U64 o2, int clen, TT tab,
                             TO out, RVQ_U64 ooff, bool al) {
  constexpr int P1 = 32 / B1;
  constexpr int P2 = (B2 > 0) ? 32 / B2 : 32;
  constexpr int NW1 = C / P1;
  constexpr int NW2 = (B2 > 0) ? C / P2 : 1;
  constexpr uint M1 = (1u << B1) - 1u;
  constexpr uint M2 = (1u << B2) - 1u;
  uint w1[NW1];
  uint w2[NW2];
  // all loads first (the words are tiny; the floats written below are the traffic)
  RVQ_UNROLL
  for (int k = 0; k < NW1; ++k) w1[k] = (FULL || k * P1 < clen) ? codes1[o1 + k] : 0u;
  RVQ_UNROLL
  for (int k = 0; k < NW2; ++k) w2[k] = (B2 > 0 && (FULL || k * P2 < clen)) ? codes2[o2 + k] : 0u;
  RVQ_UNROLL
  for (int j = 0; j < C; j += VL) {
    if (FULL || j < clen) {
      float v[VL];
      RVQ_UNROLL
      for (int e = 0; e < VL; ++e) {
        const int jj = j + e;
        const uint i1 = (w1[jj / P1] >> ((jj % P1) * B1)) & M1;
        const uint i2 = (B2 > 0) ? ((w2[jj / P2] >> ((jj % P2) * B2)) & M2) : 0u;
        if (MODE == 1) {
          v[e] = tab[(i1 << B2) | i2];
        } else if (MODE == 2) {
          v[e] = tab[i1] + tab[(1 << B1) + i2];  // float32 add, as the reference
        } else {
          v[e] = tab[i1];
        }
      }
      RVQ_STOREV(out, ooff + j, v, VL, al);
    }
  }
}

// ---- LAYOUT 1 ("lanes"): one thread per 4 coordinates, fully coalesced 16-byte accesses ----------
// For codes of 1, 2 or 4 bits (32/B a multiple of 4) and D a multiple of 4. Encode: a vector gets
// tpv = ceil(D / C) * (C / 4) threads (C as above), so the G = (32/B)/4 lanes that share a word are
// aligned neighbours inside one warp/simdgroup; each lane quantizes its float4, shifts its codes to
// their place in the word, and the word is OR-combined across its G lanes with log2(G) xor-shuffles
// (no shared memory, no serial packing loop); the word's first lane stores it. Lanes past D (a
// partial last chunk) or past the grid contribute nothing but still take part in the shuffles.
template <int B1, int B2, int MODE, int SEARCH, typename TY, typename TT, typename TO1, typename TO2>
RVQ_FN void rvq_encode_lanes(TY y, uint gid, uint total, uint dim, uint tpv, uint nw1, uint nw2, bool al,
                             TT tab, TO1 codes1, TO2 codes2) {
  constexpr int P1 = 32 / B1;
  constexpr int P2 = (B2 > 0) ? 32 / B2 : 32;
  constexpr uint G1 = uint(P1 / 4);
  constexpr uint G2 = uint(P2 / 4);
  const uint n = gid / tpv;
  const uint t = gid - n * tpv;
  const uint j0 = t * 4u;
  const bool active = gid < total && j0 < dim;
  uint f1 = 0u;
  uint f2 = 0u;
  if (active) {
    float v[4];
    RVQ_LOADV(v, y, RVQ_U64(n) * dim + j0, 4, al);
    const uint s1 = (t % G1) * uint(4 * B1);
    const uint s2 = (t % G2) * uint(4 * B2);
    RVQ_UNROLL
    for (int e = 0; e < 4; ++e) {
      const uint q = rvq_quantize<B1, B2, MODE, SEARCH>(v[e], tab);
      f1 |= (q & 0xffu) << (s1 + uint(e * B1));
      if (B2 > 0) f2 |= (q >> 8) << (s2 + uint(e * B2));
    }
  }
  RVQ_UNROLL
  for (uint m = 1u; m < G1; m <<= 1) f1 |= RVQ_SHFL_XOR(f1, m);
  if (B2 > 0) {
    RVQ_UNROLL
    for (uint m = 1u; m < G2; m <<= 1) f2 |= RVQ_SHFL_XOR(f2, m);
  }
  if (active) {
    if (t % G1 == 0u) codes1[RVQ_U64(n) * nw1 + j0 / uint(P1)] = f1;
    if (B2 > 0 && t % G2 == 0u) codes2[RVQ_U64(n) * nw2 + j0 / uint(P2)] = f2;
  }
}

// Decode, LAYOUT 1: one thread per 4 output coordinates (tpv = D / 4): it reads the one word of each
// stream holding its 4 codes (the G lanes sharing a word read the same address) and writes a float4.
template <int B1, int B2, int MODE, typename TC1, typename TC2, typename TT, typename TO>
RVQ_FN void rvq_decode_lanes(uint gid, uint total, uint dim, uint tpv, uint nw1, uint nw2,
                             TC1 codes1, TC2 codes2, TT tab, TO out, bool al) {
  constexpr int P1 = 32 / B1;
  constexpr int P2 = (B2 > 0) ? 32 / B2 : 32;
  constexpr uint M1 = (1u << B1) - 1u;
  constexpr uint M2 = (1u << B2) - 1u;
  if (gid >= total) return;
  const uint n = gid / tpv;
  const uint j0 = (gid - n * tpv) * 4u;
  const uint w1 = codes1[RVQ_U64(n) * nw1 + j0 / uint(P1)] >> ((j0 % uint(P1)) * uint(B1));
  const uint w2 = (B2 > 0) ? (codes2[RVQ_U64(n) * nw2 + j0 / uint(P2)] >> ((j0 % uint(P2)) * uint(B2))) : 0u;
  float v[4];
  RVQ_UNROLL
  for (int e = 0; e < 4; ++e) {
    const uint i1 = (w1 >> uint(e * B1)) & M1;
    const uint i2 = (B2 > 0) ? ((w2 >> uint(e * B2)) & M2) : 0u;
    if (MODE == 1) {
      v[e] = tab[(i1 << B2) | i2];
    } else if (MODE == 2) {
      v[e] = tab[i1] + tab[(1 << B1) + i2];  // float32 add, as the reference
    } else {
      v[e] = tab[i1];
    }
  }
  RVQ_STOREV(out, RVQ_U64(n) * dim + j0, v, 4, al);
}
