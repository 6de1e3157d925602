/* block_product.c's 256-bit x86 paths: avx2, avx-vnni (and its AVX2 stand-in); the 512-bit ones and AMX
   are in block_product_lanes.h. See the top of block_product.c for the arithmetic and the instruction
   counts. */

#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2,fma")))
/* Features ahead whose codes the 256-bit paths prefetch: the hardware's prefetcher left a product waiting on
   memory at each feature's start (Ouro-1.4B's layer stack on AVX2, 2 threads, AMX Xeon: one row 58.9 -> 45 ms,
   four rows 118 -> 66 ms; 1 to 3 features ahead alike, into L2 no better). */
#define FEATURE_PREFETCH 2

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

/* ---------------------------------------------------------------- avx512-vnni (block_product_lanes.h) */
#define AVX512_TARGET "avx2,fma,avx512f,avx512bw,avx512vnni"
#define INLINE_AVX512 static inline __attribute__((always_inline, target(AVX512_TARGET)))
#endif

/* Whether this process may use AMX tiles: Linux hands out the tile data state only on request. */
static int amx_permitted(void) {
#if defined(SPEEDC_AMX) && defined(__linux__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

/* The x86 paths this CPU runs (a bit per PATH_*). */
static unsigned x86_paths(void) {
    __builtin_cpu_init();
    unsigned paths = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        paths |= 1u << PATH_AVX2 | 1u << PATH_VNNI_STANDIN | 1u << PATH_AMX_STANDIN;
#ifdef SPEEDC_VNNI
        if (__builtin_cpu_supports("avxvnni")) paths |= 1u << PATH_AVX_VNNI;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")) {
            paths |= 1u << PATH_AVX512_VNNI;
            if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted())
                paths |= 1u << PATH_AMX;
        }
#endif
    }
    return paths;
}
