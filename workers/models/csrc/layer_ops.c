/* A decoder layer's elementwise work on CPU in bf16, one call each instead of a handful of
 * PyTorch ops: residual add + RMSNorm, SiLU-and-multiply, RoPE of q and k with the paged K/V
 * cache write. Each rounds to bf16 exactly where the PyTorch expressions of
 * workers/models/layer_ops.py round (every op computes in fp32 and rounds its result to bf16,
 * to nearest even; SiLU's exp is SLEEF's and RMSNorm's sum of squares adds in the order of
 * PyTorch's, as theirs do), so the results equal theirs bit for bit. Small calls run on the
 * calling thread (no OpenMP fork: on 2 cores a forked op waits for the other core, which the
 * step's matmuls or another process may hold); calls of at least PARALLEL_MIN elements split
 * their rows over num_threads threads.
 *
 * The compiler vectorizes RMSNorm itself. SiLU-and-multiply, and RoPE for heads whose halves are
 * whole 16-value vectors, have AVX-512 paths (F and BW) doing the scalar code's operations in its
 * order (the same roundings and FMAs), so both paths give the same bits. The greedy pick
 * (first_max) keeps a running maximum per vector lane.
 *
 * Called through ctypes by workers/models/cpu_layer_kernels.py, which compiles it at first use
 * (-O3 -march=native -fopenmp -ffp-contract=off: IEEE fp32 ops, vectorized) and checks it against
 * the PyTorch expressions before the model uses it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN (1 << 14)
#define MAX_HIDDEN 16384 /* RMSNorm's row (the caller checks) */

static inline float from_bf16(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* Round to nearest even, as c10::BFloat16 does (NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if (f != f) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

/* 2^q for q in [-126, 127]. */
static inline float pow2i(int32_t q) {
  const uint32_t bits = (uint32_t)(q + 0x7f) << 23;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* exp(d) as SLEEF's expf_u10 computes it (PyTorch's vectorized exp on x86, which its SiLU calls):
 * the same reduction, polynomial and FMAs, so the same bits. */
static inline float sleef_expf(float d) {
  const float q = rintf(d * 1.442695040888963407359924681001892137f);
  float s = fmaf(q, -0.693145751953125f, d);
  s = fmaf(q, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = fmaf(u, s, 0.00139304355252534151077271f);
  u = fmaf(u, s, 0.00833336077630519866943359f);
  u = fmaf(u, s, 0.0416664853692054748535156f);
  u = fmaf(u, s, 0.166666671633720397949219f);
  u = fmaf(u, s, 0.5f);
  u = 1.f + fmaf(s * s, u, s);
  const int32_t e = (int32_t)q;
  u = u * pow2i(e >> 1) * pow2i(e - (e >> 1));
  if (d < -104.f) u = 0.f;
  if (d > 104.f) u = INFINITY;
  return u;
}

/* The sum of x[0..n) in the order of PyTorch's vectorized CPU sum (aten's SumKernel: vectors of
 * SUM_LANES floats, lanes = 8 for its AVX2 kernels, 16 for AVX-512; 4 accumulators, cascaded in
 * levels, then the accumulators and the lanes in turn), so that RMSNorm's mean equals the
 * expression's bit for bit. */
#define MAX_LANES 16
static float torch_order_sum(const float *x, int64_t n, int SUM_LANES) {
  enum { ILP = 4, LEVELS = 4 };
  const int64_t vectors = n / SUM_LANES, rows = vectors / ILP;
  int64_t log2 = 0;
  while (((int64_t)1 << log2) < rows) log2++;
  const int64_t power = log2 / LEVELS > 4 ? log2 / LEVELS : 4, step = (int64_t)1 << power;
  float acc[LEVELS][ILP][MAX_LANES];
  memset(acc, 0, sizeof acc);
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; j++, i++)
      for (int k = 0; k < ILP; k++)
        for (int l = 0; l < SUM_LANES; l++) acc[0][k][l] += x[(i * ILP + k) * SUM_LANES + l];
    for (int level = 1; level < LEVELS; level++) {
      for (int k = 0; k < ILP; k++)
        for (int l = 0; l < SUM_LANES; l++) {
          acc[level][k][l] += acc[level - 1][k][l];
          acc[level - 1][k][l] = 0.f;
        }
      if ((i & ((step - 1) << (level * power))) != 0) break;
    }
  }
  for (; i < rows; i++)
    for (int k = 0; k < ILP; k++)
      for (int l = 0; l < SUM_LANES; l++) acc[0][k][l] += x[(i * ILP + k) * SUM_LANES + l];
  for (int level = 1; level < LEVELS; level++)
    for (int k = 0; k < ILP; k++)
      for (int l = 0; l < SUM_LANES; l++) acc[0][k][l] += acc[level][k][l];
  for (int64_t v = rows * ILP; v < vectors; v++)
    for (int l = 0; l < SUM_LANES; l++) acc[0][0][l] += x[v * SUM_LANES + l];
  for (int k = 1; k < ILP; k++)
    for (int l = 0; l < SUM_LANES; l++) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t t = vectors * SUM_LANES; t < n; t++) total += x[t];
  for (int l = 0; l < SUM_LANES; l++) total += acc[0][0][l];
  return total;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "bf16_avx512.h" /* kv/attention/csrc */
#define VECTOR_LANES 16
#else
#define VECTOR_LANES 0
#endif

/* sum = x + residual (bf16; residual NULL: sum = x, not written), norm = weight * bf16(sum *
 * rsqrt(mean(sum^2) + eps)): T rows of H <= MAX_HIDDEN; sum_lanes 8 or 16 (torch_order_sum). */
void tpserve_add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual,
                               const uint16_t *weight, float eps, int64_t T, int64_t H,
                               uint16_t *sum, uint16_t *norm, int sum_lanes, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_MIN) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const uint16_t *xr = x + t * H;
    uint16_t *sr = residual ? sum + t * H : (uint16_t *)xr;
    float squares[MAX_HIDDEN];
    if (residual) {
      const uint16_t *rr = residual + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; i++) sr[i] = to_bf16(from_bf16(xr[i]) + from_bf16(rr[i]));
    }
#pragma omp simd
    for (int64_t i = 0; i < H; i++) squares[i] = from_bf16(sr[i]) * from_bf16(sr[i]);
    const float inv = 1.f / sqrtf(torch_order_sum(squares, H, sum_lanes) / (float)H + eps);
    uint16_t *nr = norm + t * H;
#pragma omp simd
    for (int64_t i = 0; i < H; i++)
      nr[i] = to_bf16(from_bf16(weight[i]) * round_bf16(from_bf16(sr[i]) * inv));
  }
}

/* out [T, I] = bf16(silu(gate)) * up, gate_up [T, 2 I] holding gate then up. */
void tpserve_silu_mul_bf16(const uint16_t *gate_up, int64_t T, int64_t I, uint16_t *out,
                           int num_threads) {
  const int64_t vector_end = VECTOR_LANES ? I / 16 * 16 : 0;
#pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_MIN) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const uint16_t *gate = gate_up + t * 2 * I, *up = gate + I;
    uint16_t *o = out + t * I;
#if VECTOR_LANES
    for (int64_t i = 0; i < vector_end; i += 16) {
      const __m512 g = v_load(gate + i);
      const __m512 minus_g = v_negate(g);
      const __m512 silu =
          v_round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), v_sleef_expf(minus_g))));
      v_store(o + i, _mm512_mul_ps(silu, v_load(up + i)));
    }
#endif
#pragma omp simd
    for (int64_t i = vector_end; i < I; i++) {
      const float g = from_bf16(gate[i]);
      const float silu = round_bf16(g / (1.f + sleef_expf(-g)));
      o[i] = to_bf16(silu * from_bf16(up[i]));
    }
  }
}

/* q and k heads of qkv [T, (Hq + 2 Hkv) * D] rotated in place: x * cos + rotate_half(x) * sin,
 * each product and the sum rounded to bf16, cos/sin [T, D] (bf16); then k and v of token t
 * copied to slot slots[t] of k_cache/v_cache [S, Hkv, D]. Returns 0, or -1 for a slot outside
 * [0, S) (nothing of that token stored). */
int tpserve_rope_write_kv_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin,
                               const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache,
                               int64_t S, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                               int num_threads) {
  const int64_t row = (Hq + 2 * Hkv) * D, half = D / 2;
  int status = 0;
#pragma omp parallel for num_threads(num_threads) if (T * row >= PARALLEL_MIN) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    uint16_t *r = qkv + t * row;
    const uint16_t *c = cos + t * D, *s = sin + t * D;
    for (int64_t head = 0; head < Hq + Hkv; head++) {
      uint16_t *x = r + head * D;
#if VECTOR_LANES
      if (half % 16 == 0) { /* each 16 of the first half with their 16 of the second */
        for (int64_t j = 0; j < half; j += 16) {
          const __m512 a = v_load(x + j), b = v_load(x + j + half);
          const __m512 minus_b = v_negate(b);
          v_store(x + j, _mm512_add_ps(v_round_bf16(_mm512_mul_ps(a, v_load(c + j))),
                                       v_round_bf16(_mm512_mul_ps(minus_b, v_load(s + j)))));
          v_store(x + j + half,
                  _mm512_add_ps(v_round_bf16(_mm512_mul_ps(b, v_load(c + j + half))),
                                v_round_bf16(_mm512_mul_ps(a, v_load(s + j + half)))));
        }
        continue;
      }
#endif
      float rotated[512];
#pragma omp simd
      for (int64_t i = 0; i < D; i++) {
        const float xi = from_bf16(x[i]);
        const float other = i < half ? -from_bf16(x[i + half]) : from_bf16(x[i - half]);
        rotated[i] = round_bf16(round_bf16(xi * from_bf16(c[i])) +
                                round_bf16(other * from_bf16(s[i])));
      }
      for (int64_t i = 0; i < D; i++) x[i] = to_bf16(rotated[i]);
    }
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= S) {
#pragma omp atomic write
      status = -1;
      continue;
    }
    memcpy(k_cache + slot * Hkv * D, r + Hq * D, sizeof(uint16_t) * Hkv * D);
    memcpy(v_cache + slot * Hkv * D, r + (Hq + Hkv) * D, sizeof(uint16_t) * Hkv * D);
  }
  return status;
}

/* The index of the first maximum of r[0..V) (bf16), as torch.max(dim=-1) gives it: the first
 * NaN where there is one. */
static int64_t first_max_row(const uint16_t *r, int64_t V) {
  int64_t i = 1, best = 0;
  float best_value = from_bf16(r[0]);
#if VECTOR_LANES
  if (V >= 32) { /* per lane the first of its maxima, then the lowest index among the lanes' */
    __m512 lane_max = v_load(r);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i lane_index = at;
    __mmask16 nan = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= V; i += 16) {
      const __m512 x = v_load(r + i);
      at = _mm512_add_epi32(at, sixteen);
      const __mmask16 greater = _mm512_cmp_ps_mask(x, lane_max, _CMP_GT_OQ);
      lane_max = _mm512_mask_mov_ps(lane_max, greater, x);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, at);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
    if (!nan) {
      float values[16];
      int32_t indices[16];
      _mm512_storeu_ps(values, lane_max);
      _mm512_storeu_si512(indices, lane_index);
      best_value = values[0], best = indices[0];
      for (int l = 1; l < 16; l++)
        if (values[l] > best_value || (values[l] == best_value && indices[l] < best))
          best_value = values[l], best = indices[l];
    } else {
      i = 1, best = 0, best_value = from_bf16(r[0]); /* the scalar loop finds the first NaN */
    }
  }
#endif
  if (best_value != best_value) return best;
  for (; i < V; i++) {
    const float x = from_bf16(r[i]);
    if (x != x) return i;
    if (x > best_value) best_value = x, best = i;
  }
  return best;
}

/* index[t] = the first maximum of row t of rows [T, V] (bf16). */
void tpserve_first_max_bf16(const uint16_t *rows, int64_t T, int64_t V, int64_t *index,
                            int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (T * V >= PARALLEL_MIN) schedule(static)
  for (int64_t t = 0; t < T; t++) index[t] = first_max_row(rows + t * V, V);
}
