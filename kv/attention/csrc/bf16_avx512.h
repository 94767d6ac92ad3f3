/* fp32 math on AVX-512 (F and BW), 16 lanes at a time: bf16 <-> fp32 rounding as c10::BFloat16
 * does; SLEEF's expf_u10 (PyTorch's vectorized exp on x86: the same reduction, polynomial and FMAs
 * as the scalar code of workers/models/csrc/layer_ops.c, so the same bits); and a faster exp for
 * softmax. Included by layer_ops.c (-ffp-contract=off), prefill_bf16.c and paged_decode.c. Each
 * function is TPSERVE_AVX512_FN: static inline, or what the includer defines it as before (the
 * decode kernel, built for a lower -march, gives them its AVX-512 target attribute). */
#ifndef TPSERVE_BF16_AVX512_H
#define TPSERVE_BF16_AVX512_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifndef TPSERVE_AVX512_FN
#define TPSERVE_AVX512_FN static inline
#endif

TPSERVE_AVX512_FN __m512 v_load(const uint16_t *p) { /* 16 bf16 -> fp32 */
  const __m256i h = _mm256_loadu_si256((const __m256i *)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* to_bf16's bits, still in the high half of each 32-bit lane (the low half zero). */
TPSERVE_AVX512_FN __m512i v_round_bits(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
      _mm512_set1_epi32((int)0xffff0000u));
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7fc00000));
}

TPSERVE_AVX512_FN __m512 v_round_bf16(__m512 f) { return _mm512_castsi512_ps(v_round_bits(f)); }

TPSERVE_AVX512_FN void v_store(uint16_t *p, __m512 f) {
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(v_round_bits(f), 16)));
}

TPSERVE_AVX512_FN __m512 v_negate(__m512 f) { /* -f: the sign bit flipped, exactly */
  return _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(f), _mm512_set1_epi32((int)0x80000000u)));
}

TPSERVE_AVX512_FN __m512 v_pow2i(__m512i q) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(0x7f)), 23));
}

TPSERVE_AVX512_FN __m512 v_sleef_expf(__m512 d) { /* sleef_expf, 16 at a time */
  const __m512 q = _mm512_roundscale_ps(
      _mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 s = _mm512_fmadd_ps(q, _mm512_set1_ps(-0.693145751953125f), d);
  s = _mm512_fmadd_ps(q, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  const __m512i e = _mm512_cvttps_epi32(q), half_e = _mm512_srai_epi32(e, 1);
  u = _mm512_mul_ps(_mm512_mul_ps(u, v_pow2i(half_e)), v_pow2i(_mm512_sub_epi32(e, half_e)));
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ),
                         _mm512_setzero_ps());
  return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, _mm512_set1_ps(104.f), _CMP_GT_OQ),
                            _mm512_set1_ps(INFINITY));
}

/* exp(x) for x >= -87 (lower lanes give exp(-87)): n = round(x / ln 2), r = x - n ln 2 in two
 * parts, exp(r) by its Taylor polynomial to r^6 (|r| <= ln 2 / 2), scaled by 2^n; within 2 ulp
 * of expf. */
TPSERVE_AVX512_FN __m512 v_exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

#endif
