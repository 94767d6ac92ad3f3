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
 * tiles are prefetched while a tile is attended: a sequence's slots jump from block to block,
 * which the hardware prefetchers do not follow (with the caches cold, as between engine steps,
 * 32 decodes of ~100 keys took 0.80x the time they took without prefetching, 0.88x with one
 * tile ahead: scripts/bench_cpu_decode.py, docs/benchmarks/cpu-decode.md).
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

/* Keys k0..k1 of sequence b: unnormalized acc [H, D], maxima m [H], sums l [H]. Returns 0, or
 * -2 for a slot outside the cache (nothing read there). */
static int attend_part(const Inputs *in, int64_t b, int64_t k0, int64_t k1, float *scratch,
                       float *acc, float *m, float *l) {
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
    }
    if (n) attend_rows(in, q, rows, n, row, scratch, acc, m, l);
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
    const int64_t part = t % parts, b = t / parts;
    const int64_t k0 = part * PART, k1 = k0 + PART < K ? k0 + PART : K;
    float *own = scratch + omp_get_thread_num() * scratch_size;
    if (attend_part(in, b, k0, k1, own, acc + t * H * D, m + t * H, l + t * H)) {
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
  const Inputs in = {q, k_cache, v_cache, slots, valid, S, K, Hkv, G, D, scale, 4};
  return paged_decode(&in, B, num_threads, out);
}

/* As tpserve_paged_decode_f32, over bf16 caches (their raw 16-bit patterns). */
int tpserve_paged_decode_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *slots, const uint8_t *valid, int64_t S, int64_t B,
                              int64_t K, int64_t Hkv, int64_t G, int64_t D, float scale,
                              int num_threads, float *out) {
  const Inputs in = {q, k_cache, v_cache, slots, valid, S, K, Hkv, G, D, scale, 2};
  return paged_decode(&in, B, num_threads, out);
}
