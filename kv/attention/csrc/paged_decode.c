/* Paged decode attention on CPU: one query token per sequence attends to its keys and values
 * where they lie in the paged cache, read through each sequence's slot list. No gather into
 * padded dense tensors: each slot's key and value rows (all its KV heads) are read once, from the
 * cache, for every query head. Caches in fp32 (tpserve_paged_decode_f32) or bf16
 * (tpserve_paged_decode_bf16: each tile's rows widened to fp32 in a scratch that stays in L1/L2,
 * a shift per element, no bf16 instructions needed); queries, sums and outputs are fp32.
 *
 * Work is split into tasks of (sequence, a part of PART keys), run on OpenMP threads (the
 * process's OpenMP runtime: torch's, which loaded it first), each an online softmax of every
 * query head over tiles of TILE keys, whose cache rows (all KV heads of a slot) are read whole,
 * in order; the parts of a sequence are then merged by their maxima and sums (flash decoding).
 * A masked key is skipped; a row must have at least one key it sees. The rows of the next two
 * tiles are prefetched while a tile is attended, and once a task's own tiles are all asked for,
 * the first tile of the task its thread likely takes next: a sequence's slots jump from block
 * to block, which the hardware prefetchers do not follow (docs/benchmarks/cpu-decode.md).
 *
 * On x86-64 CPUs with AVX-512 (and AVX-512 BF16 for bf16 caches) a tile's keys are attended by
 * the AVX-512 path below instead, compiled for those instructions whatever the build's -march and
 * chosen at run time. tpserve_paged_decode_rows reads the queries and writes the outputs of a
 * flat batch's decodes where they lie (fp32 or bf16, like the caches).
 *
 * Called through ctypes by kv/attention/cpu_decode.py. setup.py compiles it with the package
 * (-O3 -march=x86-64-v3 -fopenmp -ffast-math), or the loader at first use with -march=native where
 * that library cannot run. -ffast-math vectorizes expf through glibc's libmvec (and assumes
 * finite values, so maxima start at -FLT_MAX, not -inf). It links without -ffast-math: linked
 * with it, GCC 12 adds code that sets flush-to-zero for the whole process when the library loads.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 32
#define PART 512
#define MAX_HEADS 256

typedef struct {
  const float *q;        /* [B, Hkv, G, D] */
  const void *k_cache;   /* [S, Hkv, D], fp32 or bf16 */
  const void *v_cache;   /* [S, Hkv, D], fp32 or bf16 */
  const int64_t *slots;  /* [B, K], each in [0, S) */
  const uint8_t *valid;  /* [B, K], nonzero where the key is seen; NULL: all */
  int64_t S, K, Hkv, G, D;
  float scale;
  int64_t elem_bytes; /* 4: fp32 caches; 2: bf16 */
  int avx512;         /* the AVX-512 path below (use_avx512) */
} Inputs;

/* out[i] = the n bf16 values at in[i] as fp32 (a bf16 is the top half of an fp32). */
static void widen_bf16(const uint16_t *in, int64_t n, float *out) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    const uint32_t bits = (uint32_t)in[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    out[i] = value;
  }
}

/* scores[i] = scale * (q . key i) for the n keys at keys + rows[i], four keys at a time (four
 * independent sums keep the vector units busy while the rows load). */
static void tile_scores(const float *q, const float *keys, const int64_t *rows, int64_t n,
                        int64_t D, float scale, float *scores) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float *k0 = keys + rows[i], *k1 = keys + rows[i + 1];
    const float *k2 = keys + rows[i + 2], *k3 = keys + rows[i + 3];
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < D; d++) {
      s0 += q[d] * k0[d];
      s1 += q[d] * k1[d];
      s2 += q[d] * k2[d];
      s3 += q[d] * k3[d];
    }
    scores[i] = s0 * scale;
    scores[i + 1] = s1 * scale;
    scores[i + 2] = s2 * scale;
    scores[i + 3] = s3 * scale;
  }
  for (; i < n; i++) {
    const float *key = keys + rows[i];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < D; d++) sum += q[d] * key[d];
    scores[i] = sum * scale;
  }
}

/* Scores of the tile's keys (row offsets in rows[] into keys and values, fp32) for every query
 * head, their running maxima, sums and weighted values updated in place (acc [H, D], m [H],
 * l [H]). A row holds all KV heads of its slot, so a tile reads whole rows, one after another. */
static void attend_tile(const Inputs *in, const float *q, const float *keys, const float *values,
                        const int64_t *rows, int64_t n, float *acc, float *m, float *l) {
  const int64_t G = in->G, D = in->D, H = in->Hkv * in->G;
  float p[MAX_HEADS][TILE];
  for (int64_t head = 0; head < H; head++) {
    const float *qh = q + head * D;
    const int64_t kv_offset = head / G * D;
    tile_scores(qh, keys + kv_offset, rows, n, D, in->scale, p[head]);
    float tile_max = m[head];
    for (int64_t i = 0; i < n; i++)
      if (p[head][i] > tile_max) tile_max = p[head][i];
    const float rescale = expf(m[head] - tile_max); /* 0 for the first tile */
    float sum = l[head] * rescale;
    for (int64_t i = 0; i < n; i++) {
      p[head][i] = expf(p[head][i] - tile_max);
      sum += p[head][i];
    }
    if (rescale != 1.f) {
      float *ah = acc + head * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) ah[d] *= rescale;
    }
    m[head] = tile_max;
    l[head] = sum;
  }
  for (int64_t i = 0; i < n; i++) {
    for (int64_t head = 0; head < H; head++) {
      const float *value = values + rows[i] + head / G * D;
      const float w = p[head][i];
      float *ah = acc + head * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) ah[d] += w * value[d];
    }
  }
}

/* ---- AVX-512 path (x86-64 CPUs with AVX-512F; dot products with AVX-512 BF16 over bf16
 * caches): compiled for those instructions whatever the build's -march, chosen at run time
 * (`use_avx512`). Same results as the portable path up to the order of fp32 sums: scores of 16
 * keys at once (each key's D products summed in vector lanes, then 16 keys' lanes reduced
 * together), exp by a degree-6 polynomial (within 2 ulp of expf), values accumulated per key.
 * bf16 scores: VDPBF16PS over the bf16 query (exact: it came from bf16) and keys, products exact,
 * sums in fp32 (its denormals flushed to zero). Head sizes: multiples of 32 up to 256. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KEYS 16
#define MAX_CHUNKS 16 /* D / 16 */
#define ACC_REGS 16  /* value sums kept in registers: ACC_REGS / (D / 16) heads at once */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define AVX512_INLINE static inline __attribute__((always_inline)) AVX512
#define TPSERVE_AVX512_FN AVX512_INLINE
#include "bf16_avx512.h" /* v_exp */

/* The sums of each of a[0..15], lane j of the result holding a[j]'s. */
AVX512_INLINE __m512 reduce16(__m512 a[KEYS]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; i++)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; i++)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* 16 bf16 at p widened to fp32. */
AVX512_INLINE __m512 load_bf16(const uint16_t *p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Scores (times scale) of query q [D] against the keys at rows[0..15] (element offsets of
 * their head's D values): fp32 keys by FMA, bf16 keys by VDPBF16PS. */
AVX512_INLINE __m512 scores16(const Inputs *in, const float *q, const int64_t *rows, int D) {
  __m512 sums[KEYS];
  if (in->elem_bytes == 4) {
    const float *keys = in->k_cache;
    __m512 qv[MAX_CHUNKS];
    for (int c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int j = 0; j < KEYS; j++) {
      __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys + rows[j]));
      for (int c = 1; c < D / 16; c++)
        s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys + rows[j] + 16 * c), s);
      sums[j] = s;
    }
  } else {
    const uint16_t *keys = in->k_cache;
    __m512bh qv[MAX_CHUNKS / 2];
    for (int c = 0; c < D / 32; c++)
      qv[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c));
    for (int j = 0; j < KEYS; j++) {
      __m512 s = _mm512_setzero_ps();
      for (int c = 0; c < D / 32; c++)
        s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(keys + rows[j] + 32 * c));
      sums[j] = s;
    }
  }
  return _mm512_mul_ps(reduce16(sums), _mm512_set1_ps(in->scale));
}

/* acc[g] += sum over keys j < n of p[g][j] * value j, for the query heads g0.. of a KV head
 * (ACC_REGS / (D / 16) of them, those below G), whose values lie at at[j]: the sums stay
 * in registers over the n keys, each value row loaded once for every head of the block. The
 * same fused multiply-adds in the same order as one key at a time through memory. */
AVX512_INLINE void accumulate_values(const Inputs *in, const int64_t *at, int n,
                                     float p[][KEYS], int64_t g0, int64_t G, float *acc, int D) {
  const int chunks = D / 16, heads = ACC_REGS / chunks;
  __m512 sums[ACC_REGS];
  for (int g = 0; g < heads; g++)
    for (int c = 0; c < chunks; c++)
      sums[g * chunks + c] = g0 + g < G ? _mm512_loadu_ps(acc + (g0 + g) * D + 16 * c)
                                        : _mm512_setzero_ps();
  for (int j = 0; j < n; j++) {
    __m512 v[MAX_CHUNKS];
    for (int c = 0; c < chunks; c++)
      v[c] = in->elem_bytes == 4 ? _mm512_loadu_ps((const float *)in->v_cache + at[j] + 16 * c)
                                 : load_bf16((const uint16_t *)in->v_cache + at[j] + 16 * c);
    for (int g = 0; g < heads; g++)
      if (g0 + g < G) {
        const __m512 w = _mm512_set1_ps(p[g0 + g][j]);
        for (int c = 0; c < chunks; c++)
          sums[g * chunks + c] = _mm512_fmadd_ps(w, v[c], sums[g * chunks + c]);
      }
  }
  for (int g = 0; g < heads; g++)
    if (g0 + g < G)
      for (int c = 0; c < chunks; c++)
        _mm512_storeu_ps(acc + (g0 + g) * D + 16 * c, sums[g * chunks + c]);
}

/* Query heads whose softmax steps attend16 interleaves: each head's steps are a chain (scores,
 * maximum, exponentials, sum), and the chains of SOFTMAX_BATCH heads side by side keep the core
 * busy where one head's would wait on its own latencies. Each head's arithmetic is unchanged. */
#define SOFTMAX_BATCH 4

/* Every query head's online softmax over n <= 16 seen keys (rows: their slot row offsets,
 * padded to 16 with the first), acc [H, D], m [H], l [H] updated in place. */
AVX512_INLINE void attend16(const Inputs *in, const float *q, const int64_t *rows, int n,
                            float *acc, float *m, float *l, int D) {
  const int64_t G = in->G;
  const __mmask16 seen = (__mmask16)((1u << n) - 1);
  for (int64_t h = 0; h < in->Hkv; h++) {
    int64_t at[KEYS];
    for (int j = 0; j < KEYS; j++) at[j] = rows[j] + h * D;
    float p[MAX_HEADS][KEYS];
    for (int64_t g0 = 0; g0 < G; g0 += SOFTMAX_BATCH) {
      const int heads = G - g0 < SOFTMAX_BATCH ? (int)(G - g0) : SOFTMAX_BATCH;
      const int64_t first = h * G + g0;
      __m512 s[SOFTMAX_BATCH];
      float top[SOFTMAX_BATCH];
      for (int g = 0; g < heads; g++)
        s[g] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(-FLT_MAX),
                                    scores16(in, q + (first + g) * D, at, D));
      for (int g = 0; g < heads; g++) top[g] = fmaxf(m[first + g], _mm512_reduce_max_ps(s[g]));
      for (int g = 0; g < heads; g++) {
        const int64_t head = first + g;
        const __m512 e =
            _mm512_maskz_mov_ps(seen, v_exp(_mm512_sub_ps(s[g], _mm512_set1_ps(top[g]))));
        _mm512_storeu_ps(p[g0 + g], e);
        /* 0 for the first keys; exactly 1 (expf(0)) while the maximum stays */
        const float rescale = top[g] == m[head] ? 1.f : expf(m[head] - top[g]);
        l[head] = l[head] * rescale + _mm512_reduce_add_ps(e);
        m[head] = top[g];
        if (rescale != 1.f)
          for (int c = 0; c < D / 16; c++)
            _mm512_storeu_ps(acc + head * D + 16 * c,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + head * D + 16 * c),
                                           _mm512_set1_ps(rescale)));
      }
    }
    for (int64_t g0 = 0; g0 < G; g0 += ACC_REGS / (D / 16))
      accumulate_values(in, at, n, p, g0, G, acc + h * G * D, D);
  }
}

/* attend_rows on this path: the n seen keys in groups of 16. */
static AVX512 void attend_rows_avx512(const Inputs *in, const float *q, const int64_t *rows,
                                      int64_t n, float *acc, float *m, float *l) {
  for (int64_t start = 0; start < n; start += KEYS) {
    const int count = n - start < KEYS ? (int)(n - start) : KEYS;
    int64_t group[KEYS];
    for (int j = 0; j < KEYS; j++) group[j] = rows[start + (j < count ? j : 0)];
    if (in->D == 64)
      attend16(in, q, group, count, acc, m, l, 64); /* constant head sizes: unrolled */
    else if (in->D == 128)
      attend16(in, q, group, count, acc, m, l, 128);
    else
      attend16(in, q, group, count, acc, m, l, (int)in->D);
  }
}

static int avx512_allowed = 1; /* tpserve_paged_decode_set_avx512 */

static int use_avx512(const Inputs *in) {
  __builtin_cpu_init();
  return avx512_allowed && __builtin_cpu_supports("avx512f") &&
         (in->elem_bytes == 4 || __builtin_cpu_supports("avx512bf16")) && in->D % 32 == 0 &&
         in->D <= 16 * MAX_CHUNKS;
}
#else
static int avx512_allowed = 0;
static int use_avx512(const Inputs *in) { return 0; }
#endif

/* Whether later calls may take the AVX-512 path where the CPU has it (1, the default) or must
 * take the portable one (0: for comparing the two). Returns the previous setting. */
int tpserve_paged_decode_set_avx512(int allowed) {
  const int previous = avx512_allowed;
  avx512_allowed = allowed;
  return previous;
}

/* The cache row offsets of the seen keys among k..min(k + TILE, k1) into rows[]; their count,
 * or -1 for a slot outside the cache. */
static int64_t tile_rows(const Inputs *in, const int64_t *slots, const uint8_t *valid, int64_t k,
                         int64_t k1, int64_t *rows) {
  const int64_t end = k + TILE < k1 ? k + TILE : k1, row = in->Hkv * in->D;
  int64_t n = 0;
  for (; k < end; k++) {
    if (valid && !valid[k]) continue;
    if (slots[k] < 0 || slots[k] >= in->S) return -1;
    rows[n++] = slots[k] * row;
  }
  return n;
}

/* Asks for the key and value rows (every KV head of a slot) of n keys, a cache line at a time. */
static void prefetch_rows(const Inputs *in, const int64_t *rows, int64_t n, int64_t row) {
  const char *k = in->k_cache, *v = in->v_cache;
  const int64_t bytes = row * in->elem_bytes;
  for (int64_t i = 0; i < n; i++)
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      __builtin_prefetch(k + rows[i] * in->elem_bytes + offset);
      __builtin_prefetch(v + rows[i] * in->elem_bytes + offset);
    }
}

/* The tile attended: fp32 caches where they lie; bf16 ones widened into scratch (2 * TILE rows)
 * first, then read there. */
static void attend_rows(const Inputs *in, const float *q, const int64_t *rows, int64_t n,
                        int64_t row, float *scratch, float *acc, float *m, float *l) {
  if (in->elem_bytes == 4) {
    attend_tile(in, q, in->k_cache, in->v_cache, rows, n, acc, m, l);
    return;
  }
  float *keys = scratch, *values = scratch + TILE * row;
  int64_t local[TILE];
  for (int64_t i = 0; i < n; i++) {
    widen_bf16((const uint16_t *)in->k_cache + rows[i], row, keys + i * row);
    widen_bf16((const uint16_t *)in->v_cache + rows[i], row, values + i * row);
    local[i] = i * row;
  }
  attend_tile(in, q, keys, values, local, n, acc, m, l);
}

/* Task t: keys k0..k1 (a part of PART keys) of sequence b. */
typedef struct {
  int64_t b, k0, k1;
} Task;

static Task task_of(const Inputs *in, int64_t t, int64_t parts) {
  const int64_t k0 = t % parts * PART;
  return (Task){t / parts, k0, k0 + PART < in->K ? k0 + PART : in->K};
}

/* Asks for the rows of task's first tile. A task's first keys have no tile before them to hide
 * their loads behind: they are asked for while the task before them on the same thread runs. */
static void prefetch_first_tile(const Inputs *in, Task task) {
  int64_t rows[TILE];
  const int64_t n = tile_rows(in, in->slots + task.b * in->K,
                              in->valid ? in->valid + task.b * in->K : NULL, task.k0, task.k1,
                              rows);
  if (n > 0) prefetch_rows(in, rows, n, in->Hkv * in->D);
}

/* Keys k0..k1 of sequence b: unnormalized acc [H, D], maxima m [H], sums l [H]. Once its own
 * tiles are all asked for, the first tile of ``ahead`` (the task this thread likely runs next;
 * NULL: none) is. Returns 0, or -2 for a slot outside the cache (nothing read there). */
static int attend_part(const Inputs *in, Task task, const Task *ahead, float *scratch,
                       float *acc, float *m, float *l) {
  const int64_t b = task.b, k0 = task.k0, k1 = task.k1;
  const int64_t H = in->Hkv * in->G, D = in->D, row = in->Hkv * in->D;
  const float *q = in->q + b * H * D;
  const int64_t *slots = in->slots + b * in->K;
  const uint8_t *valid = in->valid ? in->valid + b * in->K : NULL;
  int64_t rows[TILE];
  for (int64_t head = 0; head < H; head++) {
    m[head] = -FLT_MAX;
    l[head] = 0.f;
  }
  memset(acc, 0, sizeof(float) * H * D);
  /* two tiles in flight: this one and the next, prefetched; the one after asked for now */
  int64_t n = tile_rows(in, slots, valid, k0, k1, rows);
  if (n > 0) prefetch_rows(in, rows, n, row);
  int64_t next_rows[TILE], next_n = 0;
  if (k0 + TILE < k1) {
    next_n = tile_rows(in, slots, valid, k0 + TILE, k1, next_rows);
    if (next_n > 0) prefetch_rows(in, next_rows, next_n, row);
  }
  for (int64_t start = k0; start < k1; start += TILE) {
    if (n < 0) return -2;
    const int64_t after = start + 2 * TILE;
    int64_t after_rows[TILE], after_n = 0;
    if (after < k1) {
      after_n = tile_rows(in, slots, valid, after, k1, after_rows);
      if (after_n > 0) prefetch_rows(in, after_rows, after_n, row);
    } else if (ahead) {
      prefetch_first_tile(in, *ahead);
      ahead = NULL;
    }
    if (n && in->avx512) {
#if defined(__x86_64__) && defined(__GNUC__)
      attend_rows_avx512(in, q, rows, n, acc, m, l);
#endif
    } else if (n) {
      attend_rows(in, q, rows, n, row, scratch, acc, m, l);
    }
    memcpy(rows, next_rows, sizeof(int64_t) * (next_n > 0 ? next_n : 0));
    n = next_n;
    memcpy(next_rows, after_rows, sizeof(int64_t) * (after_n > 0 ? after_n : 0));
    next_n = after_n;
  }
  return 0;
}

/* Merges the parts of one sequence into out [G, D] (G: here every query head). */
static void merge_parts(const float *acc, const float *m, const float *l, int64_t parts,
                        int64_t G, int64_t D, float *out) {
  for (int64_t g = 0; g < G; g++) {
    float top = -FLT_MAX;
    for (int64_t p = 0; p < parts; p++)
      if (m[p * G + g] > top) top = m[p * G + g];
    float *o = out + g * D;
    float total = 0.f;
    memset(o, 0, sizeof(float) * D);
    for (int64_t p = 0; p < parts; p++) {
      if (l[p * G + g] == 0.f) continue; /* a part with every key masked */
      const float w = expf(m[p * G + g] - top);
      const float *a = acc + (p * G + g) * D;
      total += w * l[p * G + g];
#pragma omp simd
      for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
  }
}

/* out [B, Hkv, G, D] over caches of S slots of elem_bytes each. Returns 0; -1 for arguments it
 * cannot run, -2 for a seen key's slot outside [0, S) (out is then not written). */
static int paged_decode(const Inputs *in, int64_t B, int num_threads, float *out) {
  const int64_t H = in->Hkv * in->G, D = in->D, K = in->K;
  if (B < 0 || K < 1 || in->Hkv < 1 || in->G < 1 || H > MAX_HEADS || D < 1 || num_threads < 1)
    return -1;
  int status = 0;
  const int64_t parts = (K + PART - 1) / PART, tasks = B * parts;
  const int64_t scratch_size = in->elem_bytes == 4 ? 0 : 2 * TILE * in->Hkv * D;
  float *acc = malloc(sizeof(float) * (tasks * H * D + 2 * tasks * H + 1));
  float *scratch = malloc(sizeof(float) * (num_threads * scratch_size + 1));
  if (!acc || !scratch) {
    free(acc);
    free(scratch);
    return -1;
  }
  float *m = acc + tasks * H * D, *l = m + tasks * H;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
  for (int64_t t = 0; t < tasks; t++) {
    /* tasks are taken in order, one at a time: a thread's next is about num_threads later */
    const Task ahead = task_of(in, t + num_threads, parts);
    float *own = scratch + omp_get_thread_num() * scratch_size;
    if (attend_part(in, task_of(in, t, parts), t + num_threads < tasks ? &ahead : NULL, own,
                    acc + t * H * D, m + t * H, l + t * H)) {
#pragma omp atomic write
      status = -2;
    }
  }
  if (status == 0) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < B; b++)
      merge_parts(acc + b * parts * H * D, m + b * parts * H, l + b * parts * H, parts, H, D,
                  out + b * H * D);
  }
  free(scratch);
  free(acc);
  return status;
}

int tpserve_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                             const int64_t *slots, const uint8_t *valid, int64_t S, int64_t B,
                             int64_t K, int64_t Hkv, int64_t G, int64_t D, float scale,
                             int num_threads, float *out) {
  Inputs in = {q, k_cache, v_cache, slots, valid, S, K, Hkv, G, D, scale, 4, 0};
  in.avx512 = use_avx512(&in);
  return paged_decode(&in, B, num_threads, out);
}

/* As tpserve_paged_decode_f32, over bf16 caches (their raw 16-bit patterns). */
int tpserve_paged_decode_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *slots, const uint8_t *valid, int64_t S, int64_t B,
                              int64_t K, int64_t Hkv, int64_t G, int64_t D, float scale,
                              int num_threads, float *out) {
  Inputs in = {q, k_cache, v_cache, slots, valid, S, K, Hkv, G, D, scale, 2, 0};
  in.avx512 = use_avx512(&in);
  return paged_decode(&in, B, num_threads, out);
}

/* The decodes of a flat batch in place: query row rows[b] (H * D values from query +
 * rows[b] * query_stride elements, heads side by side) attends as sequence b, and its output
 * is written to out + rows[b] * out_stride; query and out hold elem_bytes-sized values (4: fp32,
 * 2: bf16, rounded to nearest even), like the caches. Returns paged_decode's codes, and -1 for
 * a row outside [0, T). */
static int decode_rows(const void *query, int64_t query_stride, const int64_t *rows, int64_t T,
                       const void *k_cache, const void *v_cache, const int64_t *slots,
                       const uint8_t *valid, int64_t S, int64_t B, int64_t K, int64_t Hkv,
                       int64_t G, int64_t D, float scale, int num_threads, void *out,
                       int64_t out_stride, int64_t elem_bytes) {
  const int64_t width = Hkv * G * D;
  for (int64_t b = 0; b < B; b++)
    if (rows[b] < 0 || rows[b] >= T) return -1;
  float *q = malloc(sizeof(float) * (2 * B * width + 1));
  if (!q) return -1;
  float *result = q + B * width;
  for (int64_t b = 0; b < B; b++) {
    if (elem_bytes == 4)
      memcpy(q + b * width, (const float *)query + rows[b] * query_stride, sizeof(float) * width);
    else
      widen_bf16((const uint16_t *)query + rows[b] * query_stride, width, q + b * width);
  }
  Inputs in = {q, k_cache, v_cache, slots, valid, S, K, Hkv, G, D, scale, elem_bytes, 0};
  in.avx512 = use_avx512(&in);
  const int status = paged_decode(&in, B, num_threads, result);
  for (int64_t b = 0; status == 0 && b < B; b++) {
    const float *r = result + b * width;
    if (elem_bytes == 4) {
      memcpy((float *)out + rows[b] * out_stride, r, sizeof(float) * width);
      continue;
    }
    uint16_t *o = (uint16_t *)out + rows[b] * out_stride;
    for (int64_t i = 0; i < width; i++) {
      uint32_t bits;
      memcpy(&bits, &r[i], sizeof bits);
      o[i] = r[i] != r[i] ? 0x7fc0 : (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
  }
  free(q);
  return status;
}

int tpserve_paged_decode_rows(const void *query, int64_t query_stride, const int64_t *rows,
                              int64_t T, const void *k_cache, const void *v_cache,
                              const int64_t *slots, const uint8_t *valid, int64_t S, int64_t B,
                              int64_t K, int64_t Hkv, int64_t G, int64_t D, float scale,
                              int num_threads, void *out, int64_t out_stride,
                              int64_t elem_bytes) {
  if (elem_bytes != 4 && elem_bytes != 2) return -1;
  return decode_rows(query, query_stride, rows, T, k_cache, v_cache, slots, valid, S, B, K, Hkv,
                     G, D, scale, num_threads, out, out_stride, elem_bytes);
}
