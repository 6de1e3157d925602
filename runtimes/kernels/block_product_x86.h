/* block_product.c's x86 paths: avx2, avx-vnni (and its AVX2 stand-in), avx512-vnni. See the top of
   block_product.c for the arithmetic and the instruction counts. */

#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2,fma")))

/* The pointers of rows R0 .. R0 + ROWS - 1 (the unused ones of COUNT repeat the first). */
static inline void row_pointers(const product_t *p, int64_t r0, int rows, const uint8_t **q, const float **dx, int count) {
    const int64_t width = p->supers * SUB * super_of(p->bits);
    for (int i = 0; i < count; i++) {
        const int64_t r = r0 + (i < rows ? i : 0);
        q[i] = p->q + r * width;
        dx[i] = p->dx + r * p->supers;
    }
}

/* avx2, 4 bits: a pair of sub-blocks J, J + 1 of one row, added to the row's 8 int32 lanes: step *
   (code - zp) . q. One 32-byte load of their codes unpacks to LOW = [j's even values | j + 1's even] and
   HIGH (the odd ones), as signed code - zp in [-8, 7]; the activations are laid out the same way, as
   q + 128 unsigned, so maddubs pairs are at most 2 * 255 * 8 = 4080 and the two halves' sum fits int16;
   one multiply-add by STEPS = [j's step x 8 | j + 1's x 8] scales both (the 128 * (code - zp) that
   q + 128 adds is the prepared offset). 8 bits (every path): per sub-block |code - zp| x q with the
   code's sign, a pair at most 2 * 128 * 127 = 32512, times its step. |step| <= 2047 keeps 8 sub-blocks'
   lanes below 2^31. */
INLINE_AVX2 __m256i pair4_dot(__m256i lanes, __m256i low, __m256i high, __m256i steps, const uint8_t *q) {
    const __m256i evens = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)q), low);
    const __m256i odds = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(q + SUB)), high);
    return _mm256_add_epi32(lanes, _mm256_madd_epi16(_mm256_add_epi16(evens, odds), steps));
}

INLINE_AVX2 float sum_lanes(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

/* Exact AVX2 equivalents of AVX-VNNI's vpdpbusd (4 products of unsigned A and signed B bytes a lane,
   added to ACC in int32, no saturation) and vpdpwssd (2 products of int16 a lane): bytes widened to
   int16, whose products and pair sums madd holds exactly. */
INLINE_AVX2 __m256i dpbusd_standin(__m256i acc, __m256i a, __m256i b) {
    const __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0xFF)), a_odd = _mm256_srli_epi16(a, 8);
    const __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), b_odd = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even), _mm256_madd_epi16(a_odd, b_odd)));
}

INLINE_AVX2 __m256i dpwssd_standin(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

#define ROWS_NAME avx2
#define ROWS_TARGET "avx2,fma"
#define ROWS_VNNI 0
#include "block_product_rows256.h"

#define ROWS_NAME vnni_standin
#define ROWS_TARGET "avx2,fma"
#define ROWS_VNNI 1
#define DPBUSD dpbusd_standin
#define DPWSSD dpwssd_standin
#include "block_product_rows256.h"

#ifdef SPEEDC_VNNI
#define ROWS_NAME avx_vnni
#define ROWS_TARGET "avx2,fma,avxvnni"
#define ROWS_VNNI 1
#define DPBUSD _mm256_dpbusd_avx_epi32
#define DPWSSD _mm256_dpwssd_avx_epi32
#include "block_product_rows256.h"

/* ---------------------------------------------------------------- avx512-vnni */
#define AVX512_TARGET "avx2,fma,avx512f,avx512bw,avx512vnni"
#define INLINE_AVX512 static inline __attribute__((always_inline, target(AVX512_TARGET)))

/* Rows R0 .. R0 + ROWS - 1 of feature N, one superblock a step, 16 int32 lanes a row. 4 bits: two
   64-byte loads of codes unpack to [j even | .. | j + 3 even] and the odd ones for j = 0 and 4
   (activations in groups of 4, see product_t); dpbusd sums each sub-block's products in its own 128-bit
   lane (8 products of at most 255 x 8 a lane: int16 range), packs_epi32 puts all 8 sub-blocks in one
   register and one dpwssd scales them by their steps. 8 bits: the superblock's 64 codes in one load,
   |code - zp| x q with the code's sign (maddubs pairs at most 32512), scaled by dpwssd. */
INLINE_AVX512 void feature_rows_avx512_vnni(const product_t *p, int64_t n, int64_t r0, const int rows, const int bits) {
    const int super = super_of(bits);
    const uint8_t *q[8];
    const float *dx[8];
    row_pointers(p, r0, rows, q, dx, 8);
    const int16_t *steps = p->steps + n * p->supers * super;
    const float *units = p->units + n * p->supers;
    const int32_t *offsets = p->offsets + n * p->supers;
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    uint8_t tail[SUPER_MAX * SUB];
    const __m512i nibble = _mm512_set1_epi8(15), zp4 = _mm512_set1_epi8(8), flip = _mm512_set1_epi8((char)0x80);
    const __m512i zero = _mm512_setzero_si512();
    /* the 8 steps (16 bytes, in every 128-bit lane) as packs_epi32 lays the sums out: lane L = [L x 4, L + 4 x 4] */
    const __m512i spread = _mm512_set_epi32(0x0F0E0F0E, 0x0F0E0F0E, 0x07060706, 0x07060706,
                                            0x0D0C0D0C, 0x0D0C0D0C, 0x05040504, 0x05040504,
                                            0x0B0A0B0A, 0x0B0A0B0A, 0x03020302, 0x03020302,
                                            0x09080908, 0x09080908, 0x01000100, 0x01000100);
    for (int64_t s = 0; s < p->supers; s++) {
        const uint8_t *codes = superblock_codes(p, n, s, bits, tail);
        const int16_t *step = steps + s * super;
        const int64_t at = s * super * SUB;
        /* each row's lanes start at minus the offset q + 128 adds (lane 0) */
        const __m512i start = _mm512_zextsi128_si512(_mm_cvtsi32_si128(bits == 4 ? -offsets[s] : 0));
        const __m512 unit = _mm512_set1_ps(units[s]);
        __m512i lanes[8];
        if (bits == 4) {
            const __m512i c0 = _mm512_loadu_si512(codes), c1 = _mm512_loadu_si512(codes + 64);
            const __m512i low0 = _mm512_sub_epi8(_mm512_and_si512(c0, nibble), zp4);
            const __m512i high0 = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(c0, 4), nibble), zp4);
            const __m512i low1 = _mm512_sub_epi8(_mm512_and_si512(c1, nibble), zp4);
            const __m512i high1 = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(c1, 4), nibble), zp4);
            const __m512i eight_steps = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)step)), spread);
#pragma GCC unroll 8
            for (int i = 0; i < rows; i++) {
                const uint8_t *x = q[i] + at;
                const __m512i d0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(x), low0), _mm512_loadu_si512(x + 64), high0);
                const __m512i d1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(x + 128), low1), _mm512_loadu_si512(x + 192), high1);
                lanes[i] = _mm512_dpwssd_epi32(start, _mm512_packs_epi32(d0, d1), eight_steps);
            }
        } else {
            const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(codes), flip);
            const __m512i magnitude = _mm512_abs_epi8(w);
            const __mmask64 negative = _mm512_movepi8_mask(w);
            const __m512i two_steps = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(step[0])), _mm256_set1_epi16(step[1]), 1);
#pragma GCC unroll 8
            for (int i = 0; i < rows; i++) {
                const __m512i x = _mm512_loadu_si512(q[i] + at);
                const __m512i signed_q = _mm512_mask_sub_epi8(x, negative, zero, x);
                lanes[i] = _mm512_dpwssd_epi32(start, _mm512_maddubs_epi16(magnitude, signed_q), two_steps);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++) {
            const __m512 scale = _mm512_mul_ps(unit, _mm512_set1_ps(dx[i][s]));  /* unit x dx, as one float product */
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[i]), scale, acc[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < rows; i++) p->y[(r0 + i) * p->n + n] = _mm512_reduce_add_ps(acc[i]);
}

/* 8 rows a pass (32 registers hold their lanes and sums beside the unpacked weights). */
static __attribute__((target(AVX512_TARGET))) void features_avx512_vnni(const product_t *p, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < p->m; r += 8) {
            const int rows = p->m - r < 8 ? (int)(p->m - r) : 8;
#define ROWS_CASE(R) case R: if (p->bits == 4) feature_rows_avx512_vnni(p, n, r, R, 4); else feature_rows_avx512_vnni(p, n, r, R, 8); break;
            switch (rows) {  /* each case its own unrolled copy */
                ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5) ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) default: ROWS_CASE(1)
            }
#undef ROWS_CASE
        }
    }
}
#endif

/* The x86 paths this CPU runs (a bit per PATH_*). */
static unsigned x86_paths(void) {
    __builtin_cpu_init();
    unsigned paths = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        paths |= 1u << PATH_AVX2 | 1u << PATH_VNNI_STANDIN;
#ifdef SPEEDC_VNNI
        if (__builtin_cpu_supports("avxvnni")) paths |= 1u << PATH_AVX_VNNI;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
            paths |= 1u << PATH_AVX512_VNNI;
#endif
    }
    return paths;
}
