/* 16-bit weight products: y [M, N] = x [M, K] . W^T with W [N, K] bfloat16 or float16, read in place
   (weights.bin mapped: never copied or widened in memory), each weight converted to float32 exactly in
   registers. Included by block_product.c (its thread pool and paths).

   One summation order, the same on every path, so every path gives the portable path's bits and a row
   sums the same alone or among any rows, on any thread count (work is split over output features):

       64 lanes; lane l adds x[m, k] * w[n, k] for k = l, l + 64, l + 128, ... in order, each a fused
       multiply-add in float32; then lane l += lane l + 32, += l + 16, ... += l + 1; y is lane 0.

   64 lanes, not 16: a lane's multiply-adds form one dependency chain, and 4 registers of 16 keep 4
   chains in flight where one register waited out each multiply-add's latency (measured: one row at
   0.72 of the weights' read with 16 lanes).

   Paths (half_width): 512-bit (four registers of 16 lanes) where the CPU has AVX-512, 256-bit (eight
   registers of 8) with AVX2, FMA and F16C, NEON (sixteen of 4) on the Arm paths, and the portable C
   loop elsewhere. AVX-512 BF16's vdpbf16ps and AMX-BF16 are not used: both multiply bfloat16
   activations, so a row's sums would change by the activations' rounding to 8 bits of mantissa. */

#define HALF_LANES 64
#define HALF_PREFETCH 1024  /* bytes ahead of a row's weights (measured: one row at 0.73 -> 0.82-0.85 of the read) */

enum { HALF_BF16 = 0, HALF_FP16 = 1 };

typedef struct {
    int64_t m, n, k;
    int dtype;
    const float *x;
    const uint16_t *w;
    float *y;
} half_t;

/* float16 -> float32, exactly (subnormals, infinities and NaNs included) */
static inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits;
    if (exponent == 31) bits = sign | 0x7F800000u | (mantissa << 13);
    else if (exponent) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa) bits = sign;
    else {  /* subnormal: normalise */
        int e = -1;
        uint32_t m = mantissa;
        do { m <<= 1; e++; } while (!(m & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float half_to_float(uint16_t h, int dtype) {
    if (dtype == HALF_FP16) return fp16_to_float(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float half_reduce(float *lane) {
    for (int width = HALF_LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lane[l] += lane[l + width];
    return lane[0];
}

/* The last K - WHOLE values (fewer than HALF_LANES) into their lanes, as every path ends a row. */
static inline void half_tail(const float *x, const uint16_t *w, int64_t whole, int64_t k, int dtype, float *lane) {
    for (int64_t i = whole; i < k; i++) lane[i - whole] = fmaf(x[i], half_to_float(w[i], dtype), lane[i - whole]);
}

static void half_portable(const half_t *h, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *w = h->w + n * h->k;
        for (int64_t r = 0; r < h->m; r++) {
            const float *x = h->x + r * h->k;
            float lane[HALF_LANES] = {0};
            const int64_t whole = h->k / HALF_LANES * HALF_LANES;
            for (int64_t k = 0; k < whole; k += HALF_LANES)
                for (int l = 0; l < HALF_LANES; l++) lane[l] = fmaf(x[k + l], half_to_float(w[k + l], h->dtype), lane[l]);
            half_tail(x, w, whole, h->k, h->dtype, lane);
            h->y[r * h->n + n] = half_reduce(lane);
        }
    }
}

#ifdef SPEEDC_X86
/* 256-bit: the 64 lanes in 8 registers, a row at a time (the weights' row stays in L1 for the next;
   widening a block once for all rows instead measured slower at 1 row and no faster at 4) */
#define HALF256_TARGET "avx2,fma,f16c"
static inline __attribute__((always_inline, target(HALF256_TARGET))) __m256 half8(const uint16_t *w, int dtype) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)w);
    return dtype == HALF_FP16 ? _mm256_cvtph_ps(raw) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

static __attribute__((target(HALF256_TARGET))) void half_avx2(const half_t *h, int64_t n0, int64_t n1) {
    const int64_t whole = h->k / HALF_LANES * HALF_LANES;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *w = h->w + n * h->k;
        for (int64_t r = 0; r < h->m; r++) {
            const float *x = h->x + r * h->k;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t k = 0; k < whole; k += HALF_LANES) {
                if (r == 0) {  /* the next rows read the weights from the cache */
                    _mm_prefetch((const char *)(w + k) + HALF_PREFETCH, _MM_HINT_T0);
                    _mm_prefetch((const char *)(w + k) + HALF_PREFETCH + 64, _MM_HINT_T0);
                }
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * j), half8(w + k + 8 * j, h->dtype), acc[j]);
            }
            float lane[HALF_LANES];
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(lane + 8 * j, acc[j]);
            half_tail(x, w, whole, h->k, h->dtype, lane);
            h->y[r * h->n + n] = half_reduce(lane);
        }
    }
}

#ifdef SPEEDC_VNNI
/* 512-bit: the 64 lanes in 4 registers a row, rows R0 .. R0 + ROWS - 1 of feature N (ROWS <= 4, a
   constant after inlining: the weights' conversion is shared by the rows) */
#define HALF512_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl"
static inline __attribute__((always_inline, target(HALF512_TARGET))) __m512 half16(const uint16_t *w, int dtype) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    return dtype == HALF_FP16 ? _mm512_cvtph_ps(raw) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

static inline __attribute__((always_inline, target(HALF512_TARGET))) void half_rows512(const half_t *h, int64_t n, int64_t r0, const int rows) {
    const uint16_t *w = h->w + n * h->k;
    const int64_t whole = h->k / HALF_LANES * HALF_LANES;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < whole; k += HALF_LANES) {
        _mm_prefetch((const char *)(w + k) + HALF_PREFETCH, _MM_HINT_T0);  /* rows ahead run on into the next feature's */
        _mm_prefetch((const char *)(w + k) + HALF_PREFETCH + 64, _MM_HINT_T0);
        __m512 wk[4];
        for (int j = 0; j < 4; j++) wk[j] = half16(w + k + 16 * j, h->dtype);
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(h->x + (r0 + i) * h->k + k + 16 * j), wk[j], acc[i][j]);
    }
    for (int i = 0; i < rows; i++) {
        float lane[HALF_LANES];
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(lane + 16 * j, acc[i][j]);
        half_tail(h->x + (r0 + i) * h->k, w, whole, h->k, h->dtype, lane);
        h->y[(r0 + i) * h->n + n] = half_reduce(lane);
    }
}

static __attribute__((target(HALF512_TARGET))) void half_avx512(const half_t *h, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < h->m; r += 4) {
            switch (h->m - r < 4 ? (int)(h->m - r) : 4) {  /* each case its own unrolled copy */
                case 4: half_rows512(h, n, r, 4); break;
                case 3: half_rows512(h, n, r, 3); break;
                case 2: half_rows512(h, n, r, 2); break;
                default: half_rows512(h, n, r, 1); break;
            }
        }
    }
}
#endif
#endif

#ifdef SPEEDC_ARM
/* NEON: the 64 lanes in sixteen registers, each weight widened exactly (bf16: shifted; fp16: fcvtl) */
static inline float32x4_t half4(const uint16_t *w, int dtype) {
    const uint16x4_t raw = vld1_u16(w);
    return dtype == HALF_FP16 ? vcvt_f32_f16(vreinterpret_f16_u16(raw)) : vreinterpretq_f32_u32(vshll_n_u16(raw, 16));
}

static void half_neon(const half_t *h, int64_t n0, int64_t n1) {
    const int64_t whole = h->k / HALF_LANES * HALF_LANES;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *w = h->w + n * h->k;
        for (int64_t r = 0; r < h->m; r++) {
            const float *x = h->x + r * h->k;
            float32x4_t acc[16];
            for (int j = 0; j < 16; j++) acc[j] = vdupq_n_f32(0.0f);
            for (int64_t k = 0; k < whole; k += HALF_LANES)
                for (int j = 0; j < 16; j++) acc[j] = vfmaq_f32(acc[j], vld1q_f32(x + k + 4 * j), half4(w + k + 4 * j, h->dtype));
            float lane[HALF_LANES];
            for (int j = 0; j < 16; j++) vst1q_f32(lane + 4 * j, acc[j]);
            half_tail(x, w, whole, h->k, h->dtype, lane);
            h->y[r * h->n + n] = half_reduce(lane);
        }
    }
}
#endif

/* The width a block-product path runs 16-bit products at: 512 on the AVX-512 paths, 256 on the AVX2
   ones (with F16C), 128 (NEON) on the Arm ones, else the portable loop. */
static int half_width(int path) {
#ifdef SPEEDC_X86
    __builtin_cpu_init();
    if ((path == PATH_AVX512_VNNI || path == PATH_AMX) && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) return 512;
    if (path != PATH_PORTABLE && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 256;
#endif
#ifdef SPEEDC_ARM
    if (path == PATH_DOTPROD || path == PATH_I8MM) return 128;
#endif
    (void)path;
    return 0;
}

typedef struct { const half_t *h; int width; } half_job_t;

static void half_part(const void *job, int part, int parts) {
    const half_job_t *j = job;
    const int64_t n0 = j->h->n * part / parts, n1 = j->h->n * (part + 1) / parts;
#ifdef SPEEDC_X86
#ifdef SPEEDC_VNNI
    if (j->width == 512) { half_avx512(j->h, n0, n1); return; }
#endif
    if (j->width == 256) { half_avx2(j->h, n0, n1); return; }
#endif
#ifdef SPEEDC_ARM
    if (j->width == 128) { half_neon(j->h, n0, n1); return; }
#endif
    half_portable(j->h, n0, n1);
}
