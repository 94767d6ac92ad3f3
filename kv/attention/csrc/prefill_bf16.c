/* Causal prefill attention of one sequence in bf16, reading its keys and values where they lie in
 * the paged cache. Its two products run on AMX tiles (Intel Sapphire Rapids on) where the build's
 * target has them, else on AVX-512 BF16 dot products (Intel Cooper Lake, AMD Zen 4 on); defining
 * TPSERVE_PREFILL_AVX512 picks the latter on any target that has them. Both read the same packed
 * operands and sum in fp32.
 *
 * The chunk's num_q query rows follow num_prefix cached keys that all of them see; query row r
 * sees keys 0 .. num_prefix + r (its own key last). Steps:
 *   1. Each KV head's keys and values are packed once per call into the layout both products take
 *      as their second operand (pairs of bf16 along the summed dimension), zero-padded to CHUNK
 *      keys.
 *   2. Per query head and ROWS query rows (one task; tasks go to threads a KV head at a time,
 *      longest first):
 *      scores = q . k (bf16 products, fp32 sums), only up to the block's last visible key; then
 *      per row, in fp32: scaled, less the maximum over its visible keys, exp'd (v_exp, within 2
 *      ulp of expf), summed in fp32 and rounded to bf16 as the probabilities (as torch's CPU
 *      flash kernel rounds them for its second product); masked keys get 0.
 *   3. out = probabilities . v (fp32 sums), divided by the row's sum in fp32 and rounded to bf16
 *      once.
 * The results are fp32 sums in another order than torch's flash kernel: within bf16 rounding of
 * it, not bitwise equal.
 *
 * Head dims 64 and 128. Returns 0, -1 for a head dim it does not take, -2 when its scratch memory
 * could not be allocated, -3 for a key's slot outside [0, num_slots) (nothing read there, out not
 * written). The process must have called tpserve_prefill_setup (once, 0 returned) before the
 * first call: on AMX it asks Linux for the tile state.
 *
 * Called through ctypes by kv/attention/cpu_prefill.py, which compiles it at first use on CPUs
 * with AMX or AVX-512 BF16 (-O3 -march=native -fopenmp -ffp-contract=off) and checks it against
 * PyTorch's SDPA.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_avx512.h"

#define ROWS 16  /* query rows per task, and keys per block of scores */
#define CHUNK 32 /* keys per probabilities . v step (bf16 pairs of a tile row) */
#define MAX_HEAD_DIM 128

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(TPSERVE_PREFILL_AVX512)
#define PRODUCTS_AMX 1
#elif defined(__AVX512BF16__)
#define PRODUCTS_AMX 0
#else
#error "prefill_bf16.c needs a target with AMX (amx-tile, amx-bf16) or AVX-512 BF16"
#endif

/* One KV head's keys as the scores' second operand: per ROWS keys, D/2 rows of (ROWS keys x 2
 * dims); keys from nk on are zeros. */
static void pack_keys(const uint16_t *cache, const int64_t *slots, int64_t nk, int64_t nk_pad,
                      int64_t slot_stride, int64_t D, uint32_t *packed) {
  for (int64_t key = 0; key < nk_pad; key++) {
    uint32_t *tile = packed + key / ROWS * ROWS * (D / 2);
    const uint32_t *pairs = key < nk ? (const uint32_t *)(cache + slots[key] * slot_stride) : NULL;
    for (int64_t p = 0; p < D / 2; p++) tile[p * ROWS + key % ROWS] = pairs ? pairs[p] : 0;
  }
}

/* One KV head's values as the second product's second operand: per CHUNK keys and 16 dims,
 * CHUNK/2 rows of (16 dims x 2 keys); keys from nk on are zeros. */
static void pack_values(const uint16_t *cache, const int64_t *slots, int64_t nk, int64_t nk_pad,
                        int64_t slot_stride, int64_t D, uint16_t *packed) {
  /* lane 2n takes dim n of the first key (low half), lane 2n + 1 dim n of the second */
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t key = 0; key < nk_pad; key += 2) {
    const uint16_t *first = key < nk ? cache + slots[key] * slot_stride : NULL;
    const uint16_t *second = key + 1 < nk ? cache + slots[key + 1] * slot_stride : NULL;
    uint16_t *row = packed + key / CHUNK * (D / 16) * 512 + key % CHUNK / 2 * 32;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i zero = _mm256_setzero_si256();
      const __m256i a = first ? _mm256_loadu_si256((const __m256i *)(first + d)) : zero;
      const __m256i b = second ? _mm256_loadu_si256((const __m256i *)(second + d)) : zero;
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_storeu_si512(row + d / 16 * 512, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

/* Row `s` of unscaled scores: exp(scale * score - max) over its `visible` keys, rounded to bf16
 * into `p` (zeros from `visible` up to `width`); returns the fp32 sum of the exps. */
static float softmax_row(const float *s, int64_t visible, int64_t width, float scale,
                         uint16_t *p) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < visible; j += 16) {
    const __mmask16 m = visible - j >= 16 ? 0xffff : (__mmask16)((1u << (visible - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + j));
  }
  /* scale > 0 and rounding is monotonic: the maximum of the scaled scores */
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 max = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(vmax)), vscale);
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < visible; j += 16) {
    const __mmask16 m = visible - j >= 16 ? 0xffff : (__mmask16)((1u << (visible - j)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), vscale), max);
    const __m512 e = _mm512_maskz_mov_ps(m, v_exp(x));
    vsum = _mm512_add_ps(vsum, e);
    v_store(p + j, e);
  }
  for (; j < width; j += 16) _mm256_storeu_si256((__m256i *)(p + j), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(vsum);
}

#if PRODUCTS_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

/* Asks Linux for the AMX tile state for this process: 0 on success. */
int tpserve_prefill_setup(void) {
  return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

const char *tpserve_prefill_products(void) { return "amx"; }

static void products_begin(void) { /* every tile 16 rows of 64 bytes */
  TileConfig config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = ROWS;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

static void products_end(void) { _tile_release(); }

/* Scores of the query block q (ROWS x D, zero rows past the chunk's) against `width` packed keys,
 * into s (ROWS x width). The block stays in tiles 4.. for the call. */
static void scores(const uint16_t *q, const uint16_t *keys, int64_t width, int64_t D, float *s) {
  _tile_loadd(4, q, D * 2);
  _tile_loadd(5, q + 32, D * 2);
  if (D == 128) {
    _tile_loadd(6, q + 64, D * 2);
    _tile_loadd(7, q + 96, D * 2);
  }
  for (int64_t t = 0; t < width / ROWS; t++) {
    const uint16_t *tile = keys + t * ROWS * D;
    _tile_zero(0);
    _tile_loadd(2, tile, 64);
    _tile_dpbf16ps(0, 4, 2);
    _tile_loadd(3, tile + 512, 64);
    _tile_dpbf16ps(0, 5, 3);
    if (D == 128) {
      _tile_loadd(2, tile + 1024, 64);
      _tile_dpbf16ps(0, 6, 2);
      _tile_loadd(3, tile + 1536, 64);
      _tile_dpbf16ps(0, 7, 3);
    }
    _tile_stored(0, s + t * ROWS, width * 4);
  }
}

/* Dims [64 * pass, 64 * pass + 64) of probabilities (ROWS x width) . packed values, into o
 * (ROWS x 64 fp32). */
static void weighted_values(const uint16_t *p, const uint16_t *values, int64_t width, int64_t D,
                            int64_t pass, float *o) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t c = 0; c < width / CHUNK; c++) {
    const uint16_t *tiles = values + (c * (D / 16) + pass * 4) * 512;
    _tile_loadd(0, p + c * CHUNK, width * 2);
    _tile_loadd(2, tiles, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, tiles + 512, 64);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(2, tiles + 1024, 64);
    _tile_dpbf16ps(6, 0, 2);
    _tile_loadd(3, tiles + 1536, 64);
    _tile_dpbf16ps(7, 0, 3);
  }
  _tile_stored(4, o, 64 * 4);
  _tile_stored(5, o + 16, 64 * 4);
  _tile_stored(6, o + 32, 64 * 4);
  _tile_stored(7, o + 48, 64 * 4);
}

#else /* AVX-512 BF16: each dot product pairs a broadcast bf16 pair with one packed row */

int tpserve_prefill_setup(void) { return 0; }

const char *tpserve_prefill_products(void) { return "avx512_bf16"; }

static void products_begin(void) {}

static void products_end(void) {}

static inline __m512bh pair_of(const uint16_t *two) { /* two bf16 in every 32-bit lane */
  uint32_t bits;
  memcpy(&bits, two, 4);
  return (__m512bh)_mm512_set1_epi32((int)bits);
}

/* As the AMX scores: per ROWS packed keys, lane n of row i's sum is key n's score. */
static void scores(const uint16_t *q, const uint16_t *keys, int64_t width, int64_t D, float *s) {
  for (int64_t t = 0; t < width / ROWS; t++) {
    const uint16_t *tile = keys + t * ROWS * D; /* D/2 rows of ROWS keys' dim pairs */
    __m512 sum[ROWS];
    for (int i = 0; i < ROWS; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < D / 2; pair++) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + pair * 2 * ROWS);
      for (int i = 0; i < ROWS; i++)
        sum[i] = _mm512_dpbf16_ps(sum[i], pair_of(q + i * D + 2 * pair), k);
    }
    for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(s + i * width + t * ROWS, sum[i]);
  }
}

/* As the AMX weighted_values: per 16 dims, lane n of row i's sum is dim n's. */
static void weighted_values(const uint16_t *p, const uint16_t *values, int64_t width, int64_t D,
                            int64_t pass, float *o) {
  for (int64_t dims = 0; dims < 4; dims++) {
    __m512 sum[ROWS];
    for (int i = 0; i < ROWS; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < width / CHUNK; c++) {
      const uint16_t *tile = values + (c * (D / 16) + pass * 4 + dims) * 512;
      for (int64_t pair = 0; pair < CHUNK / 2; pair++) { /* keys 2 pair, 2 pair + 1 */
        const __m512bh v = (__m512bh)_mm512_loadu_si512(tile + pair * 32);
        const uint16_t *probs = p + c * CHUNK + 2 * pair;
        for (int i = 0; i < ROWS; i++)
          sum[i] = _mm512_dpbf16_ps(sum[i], pair_of(probs + i * width), v);
      }
    }
    for (int i = 0; i < ROWS; i++) _mm512_storeu_ps(o + i * 64 + dims * 16, sum[i]);
  }
}
#endif

typedef struct {
  const uint16_t *q;
  int64_t q_stride, num_q, num_prefix, D;
  float scale;
  uint16_t *out;
  int64_t out_stride;
} Prefill;

typedef struct { /* one thread's scratch */
  float *s, *o, *sums;
  uint16_t *p, *qbuf;
} Scratch;

/* Query rows [r0, r0 + ROWS) of head h, over its KV head's packed keys and values. */
static void attend_block(const Prefill *a, int64_t h, int64_t r0, const uint16_t *keys,
                         const uint16_t *values, const Scratch *w) {
  const int64_t D = a->D, nrows = a->num_q - r0 < ROWS ? a->num_q - r0 : ROWS;
  const int64_t width = (a->num_prefix + r0 + nrows + CHUNK - 1) / CHUNK * CHUNK;
  memset(w->qbuf, 0, ROWS * D * 2);
  for (int64_t i = 0; i < nrows; i++)
    memcpy(w->qbuf + i * D, a->q + (r0 + i) * a->q_stride + h * D, D * 2);
  scores(w->qbuf, keys, width, D, w->s);
  for (int64_t i = 0; i < ROWS; i++) {
    if (i < nrows)
      w->sums[i] = softmax_row(w->s + i * width, a->num_prefix + r0 + i + 1, width, a->scale,
                               w->p + i * width);
    else
      memset(w->p + i * width, 0, width * 2);
  }
  for (int64_t pass = 0; pass < D / 64; pass++) {
    weighted_values(w->p, values, width, D, pass, w->o);
    for (int64_t i = 0; i < nrows; i++) {
      const __m512 inverse = _mm512_set1_ps(1.f / w->sums[i]);
      uint16_t *row = a->out + (r0 + i) * a->out_stride + h * D + pass * 64;
      for (int64_t d = 0; d < 64; d += 16)
        v_store(row + d, _mm512_mul_ps(_mm512_loadu_ps(w->o + i * 64 + d), inverse));
    }
  }
}

/* q: num_q rows of H heads of D (row stride q_stride); caches [num_slots, Hkv, D]; slots: the
 * num_prefix + num_q keys in position order; out: num_q rows (row stride out_stride). */
int tpserve_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                   const uint16_t *v_cache, int64_t num_slots,
                                   const int64_t *slots, int64_t num_q, int64_t num_prefix,
                                   int64_t H, int64_t Hkv, int64_t D, float scale, uint16_t *out,
                                   int64_t out_stride, int num_threads) {
  if (D != 64 && D != 128) return -1;
  for (int64_t key = 0; key < num_prefix + num_q; key++)
    if (slots[key] < 0 || slots[key] >= num_slots) return -3;
  const Prefill a = {q, q_stride, num_q, num_prefix, D, scale, out, out_stride};
  const int64_t nk = num_prefix + num_q, nk_pad = (nk + CHUNK - 1) / CHUNK * CHUNK;
  const int64_t group = H / Hkv, blocks = (num_q + ROWS - 1) / ROWS;
  uint16_t *keys = aligned_alloc(64, (size_t)(2 * Hkv * nk_pad * D) * 2);
  if (!keys) return -2;
  uint16_t *values = keys + Hkv * nk_pad * D;
  int status = 0;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < 2 * Hkv; i++) {
      const int64_t hk = i % Hkv;
      if (i < Hkv)
        pack_keys(k_cache + hk * D, slots, nk, nk_pad, Hkv * D, D,
                  (uint32_t *)(keys + hk * nk_pad * D));
      else
        pack_values(v_cache + hk * D, slots, nk, nk_pad, Hkv * D, D, values + hk * nk_pad * D);
    }
    Scratch w = {aligned_alloc(64, (size_t)(ROWS * (nk_pad + MAX_HEAD_DIM + 1)) * 4), NULL, NULL,
                 aligned_alloc(64, (size_t)(ROWS * (nk_pad + MAX_HEAD_DIM)) * 2), NULL};
    if (w.s && w.p) {
      w.o = w.s + ROWS * nk_pad;
      w.sums = w.o + ROWS * MAX_HEAD_DIM;
      w.qbuf = w.p + ROWS * nk_pad;
      products_begin();
    } else {
#pragma omp atomic write
      status = -2;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * blocks; task++) {
      /* a KV head's tasks in a row, so its packed keys and values stay in cache; its longest
       * blocks first */
      const int64_t hk = task / (group * blocks), rest = task % (group * blocks);
      const int64_t block = blocks - 1 - rest / group, h = hk * group + rest % group;
      if (w.qbuf)
        attend_block(&a, h, block * ROWS, keys + hk * nk_pad * D, values + hk * nk_pad * D, &w);
    }
    if (w.qbuf) products_end();
    free(w.s);
    free(w.p);
  }
  free(keys);
  return status;
}
