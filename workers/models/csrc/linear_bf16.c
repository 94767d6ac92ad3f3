/* A bf16 linear on AVX-512 BF16: y[r] = x[r] . W^T (+ bias), fp32 sums, each output rounded to
 * bf16 once (round to nearest even).
 *
 * The weight is packed once (workers/models/bf16_linear.py, `pack`): its output columns in
 * panels of 32, each panel's K/2 input pairs in order, per pair the 32 columns' two bf16 values
 * side by side: [ceil(N/32)][K/2][32][2], the last panel's missing columns zero. A panel is one
 * sequential stream of K * 64 bytes, read once per call for each 8 rows of x.
 *
 * Per panel and per 8 rows of x: 16 zmm accumulators (8 rows x 2 halves of 16 columns); per
 * input pair, the panel's 128 bytes are loaded once and `vdpbf16ps` adds each row's pair
 * (broadcast) times them. The stream is prefetched PREFETCH_PAIRS pairs ahead into L2.
 *
 * Guarantees: every output is the same sum in the same order (input pairs ascending) whatever
 * the number of rows, the other rows and the thread count: a row's result depends on that row
 * alone. Threads (OpenMP, `num_threads`) take whole panels.
 *
 * Called through ctypes by workers/models/bf16_linear.py, which compiles it at first use on CPUs
 * with AVX-512 BF16 (-march=native) and checks it against an fp32 product before use.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 32          /* output columns a panel holds */
#define ROWS 8            /* rows of x a pass over a panel takes */
#define PREFETCH_PAIRS 64 /* how far ahead in the stream (64 pairs: 8 KiB) */

static inline __m512 bias_half(const uint16_t *bias, int64_t column, int64_t n) {
    if (bias == NULL) return _mm512_setzero_ps();
    int64_t left = n - column;
    __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + column);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline void store_half(uint16_t *y, __m512 sums, int64_t column, int64_t n) {
    int64_t left = n - column;
    if (left <= 0) return;
    __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    _mm256_mask_storeu_epi16(y + column, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}

/* Rows [0, MR) of x over one panel; columns [column, column + 32) of y, those below n. */
#define PANEL_PASS(MR)                                                                        \
    static void pass_##MR(const uint16_t *x, int64_t x_stride, const uint16_t *panel,        \
                          int64_t pairs, const uint16_t *bias, uint16_t *y, int64_t y_stride, \
                          int64_t column, int64_t n) {                                        \
        __m512 lo[MR], hi[MR];                                                                \
        __m512 bias_lo = bias_half(bias, column, n), bias_hi = bias_half(bias, column + 16, n); \
        for (int r = 0; r < MR; r++) { lo[r] = bias_lo; hi[r] = bias_hi; }                   \
        for (int64_t p = 0; p < pairs; p++) {                                                 \
            const uint16_t *at = panel + p * 2 * PANEL;                                       \
            _mm_prefetch((const char *)(at + PREFETCH_PAIRS * 2 * PANEL), _MM_HINT_T1);       \
            _mm_prefetch((const char *)(at + PREFETCH_PAIRS * 2 * PANEL + 32), _MM_HINT_T1);  \
            __m512bh w_lo = (__m512bh)_mm512_loadu_si512(at);                                 \
            __m512bh w_hi = (__m512bh)_mm512_loadu_si512(at + 32);                            \
            for (int r = 0; r < MR; r++) {                                                    \
                int32_t pair;                                                                 \
                memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);                         \
                __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);                              \
                lo[r] = _mm512_dpbf16_ps(lo[r], w_lo, xs);                                    \
                hi[r] = _mm512_dpbf16_ps(hi[r], w_hi, xs);                                    \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < MR; r++) {                                                        \
            store_half(y + r * y_stride, lo[r], column, n);                                   \
            store_half(y + r * y_stride, hi[r], column + 16, n);                              \
        }                                                                                     \
    }

PANEL_PASS(1) PANEL_PASS(2) PANEL_PASS(3) PANEL_PASS(4)
PANEL_PASS(5) PANEL_PASS(6) PANEL_PASS(7) PANEL_PASS(8)

typedef void (*pass_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, const uint16_t *,
                        uint16_t *, int64_t, int64_t, int64_t);
static const pass_fn PASSES[ROWS + 1] = {NULL,   pass_1, pass_2, pass_3, pass_4,
                                         pass_5, pass_6, pass_7, pass_8};

/* y [rows][y_stride] = x [rows][x_stride] . W^T (+ bias [n]), W packed as above for k inputs
 * (even) and n outputs. Returns 0, or -1 for arguments it does not take (nothing is written). */
int tpserve_linear_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *packed,
                        int64_t k, int64_t n, const uint16_t *bias, uint16_t *y,
                        int64_t y_stride, int num_threads) {
    if (rows < 0 || k <= 0 || k % 2 != 0 || n <= 0 || x_stride < k || y_stride < n ||
        num_threads < 1)
        return -1;
    int64_t pairs = k / 2, panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t index = 0; index < panels; index++) {
        const uint16_t *panel = packed + index * pairs * 2 * PANEL;
        for (int64_t row = 0; row < rows; row += ROWS) {
            int64_t take = rows - row < ROWS ? rows - row : ROWS;
            PASSES[take](x + row * x_stride, x_stride, panel, pairs, bias, y + row * y_stride,
                         y_stride, index * PANEL, n);
        }
    }
    return 0;
}

/* The library's contract version: workers/models/bf16_linear.py refuses a library that differs. */
int tpserve_linear_bf16_version(void) { return 1; }
