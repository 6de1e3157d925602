/* speedc's attention over the runtime's KV-cache pool (runtimes/kernels/ort_op.py, SpeedcAttention): one call
   a layer for every row of a prefill or of a SPEED step, each row at its own position over its own cache
   rows, the cache read and written in place as float16 (or float32, or int8 codes in blocks of 32 with a
   float scale each). Included by block_product.c (its thread pool and path checks).

   For row r and token i < len[r] of its chunk, at position p = pos[r] + i, over cache row row_of[r]:
       k, v   the token's kv heads (the packed q|k|v input); k rotated at p (half-split rope, the cos / sin
              tables given); both written at position p, rounded to the cache's type, before any token reads
              (int8: per block of 32 values scale = max |x| / 127, code = rint(x * (127 / max |x|)); read code * scale)
       out    per query head h (its kv head h / (heads / kv_heads)), q rotated at p:
              softmax over t = 0..p of scale * q . K[t], times V[t]
   Tokens past len[r] (a right-padded chunk) are neither written nor read: their output is 0.

   Why our own: a SPEED step reads as much cache as a whole plain token (each slot attends over its own loop's
   cache) while it reads the weights once, so at 512 positions attention over an fp32 cache was the largest
   part of what a step adds (docs/benchmarks.md); a float16 cache halves those bytes, and ONNX Runtime's CPU
   GroupQueryAttention is no faster on one. Here each row also reads only its own positions, not the pool's length.

   One order of operations for a token whatever the rows beside it, its chunk or the thread count (work is
   split over (row, kv head)), and the same on the portable, AVX2 and AVX-512 paths (explicit fused multiply-
   adds, an exp of our own), so a token attends bitwise the same in plain decoding and in a step:
       q . k   16 lanes, lane l += q[d] * k[d] for d = l, l + 16, ... (fma); the halves added, lane l + lane
               l + 8, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (two horizontal adds)
       exp     exp_approx: a degree-6 polynomial and 2^n, the same fmas on every path
       sum     of e_t: lane t % 16 in order of t, then reduced as the dot
       out[d]  fma of e_t * v_t[d] in order of t, divided by the sum
   AVX-512 holds the 16 lanes in one register, AVX2 in two (values d with d / 8 even, and odd). A prefill's
   tokens go four at a time (attend_*_four), each in that same order, every cached value converted once for the four. */

#define ATTN_LANES 8   /* an AVX2 register's floats */
#define ATTN_FOLD 16   /* the lanes of a dot or a sum (the order above) */
#define ATTN_MAX_HEAD_DIM 512
#define ATTN_TOKENS 4  /* a prefill chunk's tokens attended together (attend_*_four) */
#define ATTN_PREFETCH 1024  /* bytes of the cache read ahead of the position attended */
#define KV_BLOCK 32  /* int8 cache: values per scale */
enum { KV_FP32 = 0, KV_FP16 = 1, KV_INT8 = 2 };
enum { ATTN_PORTABLE = 0, ATTN_AVX2 = 1, ATTN_AVX512 = 2 };

typedef struct {
    const float *qkv;               /* [rows, chunk, (heads + 2 kv_heads) * hd] */
    int64_t rows, chunk;
    int heads, kv_heads, hd, kv_dtype, wide;  /* wide: ATTN_PORTABLE, ATTN_AVX2 or ATTN_AVX512 */
    int64_t kv_row_bytes;           /* kv_row_bytes(hd, kv_dtype) */
    const int64_t *row_of, *pos, *len;  /* [rows] each */
    char *k_cache, *v_cache;        /* position t of (row, g) at byte row * row_stride + g * head_stride + t * kv_row_bytes */
    int64_t row_stride, head_stride;  /* bytes */
    const float *cos, *sin;         /* [positions, hd / 2] */
    float scale;
    float *out;                     /* [rows, chunk, heads * hd] */
    atomic_int failed;              /* a part could not allocate its scores */
} attention_t;

/* float32 -> float16, rounded to nearest even (what F16C's vcvtps2ph does with _MM_FROUND_TO_NEAREST_INT) */
static inline uint16_t float_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00 | (uint16_t)((a >> 13) & 0x3FF);  /* NaN, quieted */
    if (a >= 0x477FF000u) return sign | 0x7C00;  /* 65520 and above round to infinity */
    if (a >= 0x38800000u) return sign | (uint16_t)((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1)) >> 13);  /* normal */
    float m;  /* below 2^-14: a multiple of 2^-24; a * 2^24 is exact, then rounded to an integer (even on ties) */
    memcpy(&m, &a, sizeof m);
    return sign | (uint16_t)nearbyintf(m * 16777216.0f);
}

/* Bytes of one position's head of hd values: float32, float16, or int8 [hd / 32 float scales | hd codes]. */
static inline int64_t kv_row_bytes(int hd, int dtype) {
    return dtype == KV_FP32 ? 4 * (int64_t)hd : dtype == KV_FP16 ? 2 * (int64_t)hd : hd + 4 * (int64_t)(hd / KV_BLOCK);
}

/* An int8 row's parts: its codes (after the hd / 32 scales) and the scale of value d's block. */
static inline const int8_t *kv_int8_codes(const char *row, int hd) { return (const int8_t *)(row + 4 * (hd / KV_BLOCK)); }
static inline float kv_int8_scale(const char *row, int d) {
    float scale;
    memcpy(&scale, row + 4 * (d / KV_BLOCK), sizeof scale);
    return scale;
}

/* Value d of a position's head ROW (hd values). */
static inline float kv_load(const char *row, int d, int hd, int dtype) {
    if (dtype == KV_FP16) return fp16_to_float(((const uint16_t *)row)[d]);
    if (dtype == KV_FP32) return ((const float *)row)[d];
    return (float)kv_int8_codes(row, hd)[d] * kv_int8_scale(row, d);
}

/* A position's head ROW from VALUES [hd], rounded to the cache's type. */
static inline void kv_store(char *row, const float *values, int hd, int dtype) {
    if (dtype == KV_FP16) { for (int d = 0; d < hd; d++) ((uint16_t *)row)[d] = float_to_fp16(values[d]); return; }
    if (dtype == KV_FP32) { memcpy(row, values, sizeof(float) * hd); return; }
    int8_t *codes = (int8_t *)kv_int8_codes(row, hd);
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        float top = 0.0f;
        for (int d = b * KV_BLOCK; d < (b + 1) * KV_BLOCK; d++) top = fabsf(values[d]) > top ? fabsf(values[d]) : top;
        const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
        memcpy(row + 4 * b, &scale, sizeof scale);  /* kv_int8_scale's place for block b */
        for (int d = b * KV_BLOCK; d < (b + 1) * KV_BLOCK; d++) {
            const float code = nearbyintf(values[d] * inverse);
            codes[d] = (int8_t)(code > 127.0f ? 127.0f : code < -127.0f ? -127.0f : code);
        }
    }
}

/* e^x for x <= 0 (scores minus their maximum), to about 1 ulp: n = rint(x log2 e), r = x - n ln 2 (in two
   parts), e^r by its degree-6 polynomial, times 2^n. Every operation is IEEE-exact or one fma, so the
   scalar and vector forms give the same bits. */
#define EXP_LOW (-87.0f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
static const float exp_poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                  1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_approx(float x) {
    x = x < EXP_LOW ? EXP_LOW : x;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float p = exp_poly[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, exp_poly[i]);
    const float y = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two;
    memcpy(&two, &bits, sizeof two);
    return y * two;
}

/* The 16 lanes' sum in the order of a fold and two horizontal adds (reduce8x4 below): lane l + lane l + 8,
   then adjacent pairs, pairs of pairs, halves. */
static inline float lanes_reduce(const float *lane) {
    float f[ATTN_LANES];
    for (int l = 0; l < ATTN_LANES; l++) f[l] = lane[l] + lane[l + ATTN_LANES];
    return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
}

/* v[0..hd) rotated at table row COS / SIN (hd / 2 each): the first half x1 cos - x2 sin, the second x2 cos + x1 sin */
static inline void rope(const float *v, const float *cos, const float *sin, int hd, float *out) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        out[i] = v[i] * cos[i] - v[i + half] * sin[i];
        out[i + half] = v[i + half] * cos[i] + v[i] * sin[i];
    }
}

/* ---- the portable path: the order above, one value at a time */
static void attend_portable(const attention_t *a, const float *q, const char *k, const char *v, int64_t count,
                            float *scores, float *out) {
    const int hd = a->hd;
    float m = -INFINITY;
    for (int64_t t = 0; t < count; t++) {
        float lane[ATTN_FOLD] = {0};
        const char *row = k + t * a->kv_row_bytes;
        for (int d = 0; d < hd; d++) lane[d % ATTN_FOLD] = fmaf(q[d], kv_load(row, d, hd, a->kv_dtype), lane[d % ATTN_FOLD]);
        scores[t] = lanes_reduce(lane) * a->scale;
        m = scores[t] > m ? scores[t] : m;
    }
    float lane[ATTN_FOLD] = {0};
    for (int64_t t = 0; t < count; t++) {
        scores[t] = exp_approx(scores[t] - m);
        lane[t % ATTN_FOLD] += scores[t];
    }
    const float sum = lanes_reduce(lane);
    float acc[ATTN_MAX_HEAD_DIM];
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    for (int64_t t = 0; t < count; t++)
        for (int d = 0; d < hd; d++) acc[d] = fmaf(scores[t], kv_load(v + t * a->kv_row_bytes, d, hd, a->kv_dtype), acc[d]);
    for (int d = 0; d < hd; d++) out[d] = acc[d] / sum;
}

#ifdef SPEEDC_X86
/* ---- the AVX2 path (with FMA and F16C): the same operations, 8 lanes a register, the 16 of a dot or a sum in
   two (LO: values d with d / 8 even, HI: odd) */
#define ATTN256_TARGET "avx2,fma,f16c"
#define INLINE_ATTN256 static inline __attribute__((always_inline, target(ATTN256_TARGET)))

/* Values d .. d + 7 of a position's head ROW (kv_load's, 8 at a time: an int8 block's 32 share one scale). */
INLINE_ATTN256 __m256 kv8(const char *row, int d, int hd, int dtype) {
    if (dtype == KV_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
    if (dtype == KV_FP32) return _mm256_loadu_ps((const float *)row + d);
    const __m128i codes = _mm_loadl_epi64((const __m128i *)(kv_int8_codes(row, hd) + d));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_set1_ps(kv_int8_scale(row, d)));
}

/* Four folded registers' lane sums [a, b, c, d] at once, each in lanes_reduce's order. */
INLINE_ATTN256 __m128 reduce8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  /* [a_lo b_lo c_lo d_lo | a_hi ...] */
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

/* lanes_reduce of the 16 lanes LO and HI */
INLINE_ATTN256 float reduce16(__m256 lo, __m256 hi) {
    const __m256 folded = _mm256_add_ps(lo, hi);
    return _mm_cvtss_f32(reduce8x4(folded, folded, folded, folded));
}

INLINE_ATTN256 __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LOW));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(exp_poly[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_poly[i]));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* Scores [count] to their softmax weights e_t = exp(s_t - max) in place; returns their sum (lane t % 16). */
INLINE_ATTN256 float softmax8(float *scores, int64_t count) {
    float m = -INFINITY;
    for (int64_t t = 0; t < count; t++) m = scores[t] > m ? scores[t] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    int64_t t = 0;
    for (; t + ATTN_FOLD <= count; t += ATTN_FOLD) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
        const __m256 f = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t + ATTN_LANES), mv));
        _mm256_storeu_ps(scores + t, e);
        _mm256_storeu_ps(scores + t + ATTN_LANES, f);
        lo = _mm256_add_ps(lo, e);
        hi = _mm256_add_ps(hi, f);
    }
    float lane[ATTN_FOLD];
    _mm256_storeu_ps(lane, lo);
    _mm256_storeu_ps(lane + ATTN_LANES, hi);
    for (; t < count; t++) {
        scores[t] = exp_approx(scores[t] - m);
        lane[t % ATTN_FOLD] += scores[t];
    }
    return lanes_reduce(lane);
}

/* One position's q . k, the 16 lanes reduced (not yet scaled). */
INLINE_ATTN256 float dot8(const float *q, const char *row, int hd, int dtype) {
    __m256 lo = _mm256_setzero_ps(), hi = lo;
    int d = 0;
    for (; d + ATTN_FOLD <= hd; d += ATTN_FOLD) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv8(row, d, hd, dtype), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + ATTN_LANES), kv8(row, d + ATTN_LANES, hd, dtype), hi);
    }
    if (d < hd) lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv8(row, d, hd, dtype), lo);
    return reduce16(lo, hi);
}

/* out[d0 .. d0 + 64) (WIDTH of them) = sum over t of scores[t] v_t[d], in order of t, divided by SUM */
INLINE_ATTN256 void values8(const char *v, int64_t stride, int64_t count, const float *scores, float sum, int d0, int width,
                            int hd, int dtype, float *out) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; t++) {
        const __m256 e = _mm256_set1_ps(scores[t]);
        if (d0 == 0)
            for (int64_t b = 0; b < stride; b += 64) _mm_prefetch(v + t * stride + ATTN_PREFETCH + b, _MM_HINT_T0);
        for (int c = 0; c * ATTN_LANES < width; c++) acc[c] = _mm256_fmadd_ps(e, kv8(v + t * stride, d0 + c * ATTN_LANES, hd, dtype), acc[c]);
    }
    const __m256 s = _mm256_set1_ps(sum);
    for (int c = 0; c * ATTN_LANES < width; c++) _mm256_storeu_ps(out + d0 + c * ATTN_LANES, _mm256_div_ps(acc[c], s));
}

static __attribute__((target(ATTN256_TARGET))) void attend_avx2(const attention_t *a, const float *q, const char *k,
                                                                const char *v, int64_t count, float *scores, float *out) {
    const int hd = a->hd, dtype = a->kv_dtype;
    const int64_t stride = a->kv_row_bytes;
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {  /* four positions at once: eight independent chains */
        __m256 lo[4], hi[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < 4 * stride; b += 64) _mm_prefetch(k + t * stride + ATTN_PREFETCH + b, _MM_HINT_T0);
        int d = 0;
        for (; d + ATTN_FOLD <= hd; d += ATTN_FOLD) {
            const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + ATTN_LANES);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                lo[j] = _mm256_fmadd_ps(q0, kv8(k + (t + j) * stride, d, hd, dtype), lo[j]);
                hi[j] = _mm256_fmadd_ps(q1, kv8(k + (t + j) * stride, d + ATTN_LANES, hd, dtype), hi[j]);
            }
        }
        if (d < hd) {
            const __m256 q0 = _mm256_loadu_ps(q + d);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) lo[j] = _mm256_fmadd_ps(q0, kv8(k + (t + j) * stride, d, hd, dtype), lo[j]);
        }
        const __m128 four = reduce8x4(_mm256_add_ps(lo[0], hi[0]), _mm256_add_ps(lo[1], hi[1]), _mm256_add_ps(lo[2], hi[2]),
                                      _mm256_add_ps(lo[3], hi[3]));
        _mm_storeu_ps(scores + t, _mm_mul_ps(four, _mm_set1_ps(a->scale)));
    }
    for (; t < count; t++) scores[t] = dot8(q, k + t * stride, hd, dtype) * a->scale;
    const float sum = softmax8(scores, count);
    for (int d0 = 0; d0 < hd; d0 += 64) values8(v, stride, count, scores, sum, d0, hd - d0 < 64 ? hd - d0 : 64, hd, dtype, out);
}

/* Four consecutive tokens of a prefill chunk (query rows Q [4][hd], each attending COUNT[j] = COUNT[0] + j
   positions; hd a multiple of 16), each computed exactly as attend_avx2 computes it alone (per token: the same
   fmas in the same order), but every cached value is loaded and converted once for the four: a prefill's
   attention reads each key and value once per four tokens instead of once per token. SCORES [4][capacity],
   OUT [4] rows. */
static __attribute__((target(ATTN256_TARGET))) void attend_avx2_four(const attention_t *a, const float *q, const char *k,
                                                                     const char *v, int64_t count, float *scores,
                                                                     int64_t capacity, float *out, int64_t out_stride) {
    const int hd = a->hd, dtype = a->kv_dtype;
    const int64_t stride = a->kv_row_bytes;
    const __m128 scale = _mm_set1_ps(a->scale);
    float four[4];
    for (int64_t t = 0; t < count; t++) {  /* the positions all four read: eight independent chains */
        __m256 lo[4], hi[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += ATTN_FOLD) {
            const __m256 k0 = kv8(k + t * stride, d, hd, dtype), k1 = kv8(k + t * stride, d + ATTN_LANES, hd, dtype);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                lo[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * hd + d), k0, lo[j]);
                hi[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * hd + d + ATTN_LANES), k1, hi[j]);
            }
        }
        _mm_storeu_ps(four, _mm_mul_ps(reduce8x4(_mm256_add_ps(lo[0], hi[0]), _mm256_add_ps(lo[1], hi[1]),
                                                 _mm256_add_ps(lo[2], hi[2]), _mm256_add_ps(lo[3], hi[3])), scale));
        for (int j = 0; j < 4; j++) scores[j * capacity + t] = four[j];
    }
    for (int j = 1; j < 4; j++)  /* token j's own last j positions */
        for (int64_t t = count; t < count + j; t++) scores[j * capacity + t] = dot8(q + j * hd, k + t * stride, hd, dtype) * a->scale;
    float sum[4];
    for (int j = 0; j < 4; j++) sum[j] = softmax8(scores + j * capacity, count + j);
    for (int d0 = 0; d0 < hd; d0 += 2 * ATTN_LANES) {  /* 16 values of each token's out in 2 registers */
        __m256 acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < count; t++) {
            const __m256 v0 = kv8(v + t * stride, d0, hd, dtype), v1 = kv8(v + t * stride, d0 + ATTN_LANES, hd, dtype);
            for (int j = 0; j < 4; j++) {
                const __m256 e = _mm256_set1_ps(scores[j * capacity + t]);
                acc[j][0] = _mm256_fmadd_ps(e, v0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(e, v1, acc[j][1]);
            }
        }
        for (int j = 1; j < 4; j++)
            for (int64_t t = count; t < count + j; t++) {
                const __m256 e = _mm256_set1_ps(scores[j * capacity + t]);
                acc[j][0] = _mm256_fmadd_ps(e, kv8(v + t * stride, d0, hd, dtype), acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(e, kv8(v + t * stride, d0 + ATTN_LANES, hd, dtype), acc[j][1]);
            }
        for (int j = 0; j < 4; j++) {
            const __m256 s = _mm256_set1_ps(sum[j]);
            _mm256_storeu_ps(out + j * out_stride + d0, _mm256_div_ps(acc[j][0], s));
            _mm256_storeu_ps(out + j * out_stride + d0 + ATTN_LANES, _mm256_div_ps(acc[j][1], s));
        }
    }
}

#ifdef SPEEDC_VNNI
/* ---- the AVX-512 path (hd a multiple of 16): the same operations, the 16 lanes in one register, folded into
   the AVX2 path's two halves' sum before the same horizontal adds */
#define ATTN512_TARGET "avx2,fma,f16c,avx512f"
#define INLINE_ATTN512 static inline __attribute__((always_inline, target(ATTN512_TARGET)))

/* Values d .. d + 15 of a position's head ROW (kv_load's; an int8 block's 32 share one scale). */
INLINE_ATTN512 __m512 kv16(const char *row, int d, int hd, int dtype) {
    if (dtype == KV_FP16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d)));
    if (dtype == KV_FP32) return _mm512_loadu_ps((const float *)row + d);
    const __m128i codes = _mm_loadu_si128((const __m128i *)(kv_int8_codes(row, hd) + d));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), _mm512_set1_ps(kv_int8_scale(row, d)));
}

/* lane l + lane l + 8 */
INLINE_ATTN512 __m256 fold16(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

INLINE_ATTN512 float dot16(const float *q, const char *row, int hd, int dtype) {
    __m512 s = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += ATTN_FOLD) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), kv16(row, d, hd, dtype), s);
    const __m256 folded = fold16(s);
    return _mm_cvtss_f32(reduce8x4(folded, folded, folded, folded));
}

static __attribute__((target(ATTN512_TARGET))) void attend_avx512(const attention_t *a, const float *q, const char *k,
                                                                  const char *v, int64_t count, float *scores, float *out) {
    const int hd = a->hd, dtype = a->kv_dtype;
    const int64_t stride = a->kv_row_bytes;
    const __m128 scale = _mm_set1_ps(a->scale);
    int64_t t = 0;
    for (; t + 8 <= count; t += 8) {  /* eight positions at once: eight independent chains */
        __m512 s[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < 8 * stride; b += 64) _mm_prefetch(k + t * stride + ATTN_PREFETCH + b, _MM_HINT_T0);
        for (int d = 0; d < hd; d += ATTN_FOLD) {
            const __m512 qd = _mm512_loadu_ps(q + d);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) s[j] = _mm512_fmadd_ps(qd, kv16(k + (t + j) * stride, d, hd, dtype), s[j]);
        }
        _mm_storeu_ps(scores + t, _mm_mul_ps(reduce8x4(fold16(s[0]), fold16(s[1]), fold16(s[2]), fold16(s[3])), scale));
        _mm_storeu_ps(scores + t + 4, _mm_mul_ps(reduce8x4(fold16(s[4]), fold16(s[5]), fold16(s[6]), fold16(s[7])), scale));
    }
    for (; t < count; t++) scores[t] = dot16(q, k + t * stride, hd, dtype) * a->scale;
    const float sum = softmax8(scores, count);  /* two exps a position: AVX2's, the same bits */
    const __m512 total = _mm512_set1_ps(sum);
    for (int d0 = 0; d0 < hd; d0 += 8 * ATTN_FOLD) {  /* 128 values of out in 8 registers, all positions in order */
        const int width = hd - d0 < 8 * ATTN_FOLD ? hd - d0 : 8 * ATTN_FOLD;
        __m512 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm512_setzero_ps();
        if (width == 8 * ATTN_FOLD)
            for (int64_t i = 0; i < count; i++) {
                const __m512 e = _mm512_set1_ps(scores[i]);
                for (int64_t b = 0; b < stride; b += 64) _mm_prefetch(v + i * stride + ATTN_PREFETCH + b, _MM_HINT_T0);
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) acc[c] = _mm512_fmadd_ps(e, kv16(v + i * stride, d0 + c * ATTN_FOLD, hd, dtype), acc[c]);
            }
        else
            for (int64_t i = 0; i < count; i++) {
                const __m512 e = _mm512_set1_ps(scores[i]);
                for (int c = 0; c * ATTN_FOLD < width; c++) acc[c] = _mm512_fmadd_ps(e, kv16(v + i * stride, d0 + c * ATTN_FOLD, hd, dtype), acc[c]);
            }
        for (int c = 0; c * ATTN_FOLD < width; c++) _mm512_storeu_ps(out + d0 + c * ATTN_FOLD, _mm512_div_ps(acc[c], total));
    }
}

/* attend_avx2_four's work on the AVX-512 path: four tokens of a prefill chunk, each as attend_avx512 computes it alone. */
static __attribute__((target(ATTN512_TARGET))) void attend_avx512_four(const attention_t *a, const float *q, const char *k,
                                                                       const char *v, int64_t count, float *scores,
                                                                       int64_t capacity, float *out, int64_t out_stride) {
    const int hd = a->hd, dtype = a->kv_dtype;
    const int64_t stride = a->kv_row_bytes;
    const __m128 scale = _mm_set1_ps(a->scale);
    float four[4];
    int64_t t = 0;
    for (; t + 2 <= count; t += 2) {  /* the positions all four read, two at a time: eight independent chains */
        __m512 s[4], u[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) s[j] = u[j] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d += ATTN_FOLD) {
            const __m512 kd = kv16(k + t * stride, d, hd, dtype), ke = kv16(k + (t + 1) * stride, d, hd, dtype);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512 qj = _mm512_loadu_ps(q + j * hd + d);
                s[j] = _mm512_fmadd_ps(qj, kd, s[j]);
                u[j] = _mm512_fmadd_ps(qj, ke, u[j]);
            }
        }
        _mm_storeu_ps(four, _mm_mul_ps(reduce8x4(fold16(s[0]), fold16(s[1]), fold16(s[2]), fold16(s[3])), scale));
        for (int j = 0; j < 4; j++) scores[j * capacity + t] = four[j];
        _mm_storeu_ps(four, _mm_mul_ps(reduce8x4(fold16(u[0]), fold16(u[1]), fold16(u[2]), fold16(u[3])), scale));
        for (int j = 0; j < 4; j++) scores[j * capacity + t + 1] = four[j];
    }
    for (; t < count; t++)
        for (int j = 0; j < 4; j++) scores[j * capacity + t] = dot16(q + j * hd, k + t * stride, hd, dtype) * a->scale;
    for (int j = 1; j < 4; j++)  /* token j's own last j positions */
        for (t = count; t < count + j; t++) scores[j * capacity + t] = dot16(q + j * hd, k + t * stride, hd, dtype) * a->scale;
    float sum[4];
    for (int j = 0; j < 4; j++) sum[j] = softmax8(scores + j * capacity, count + j);
    for (int d0 = 0; d0 < hd; d0 += 2 * ATTN_FOLD) {  /* 32 values of each token's out in 2 registers (16 at the end of an odd hd / 16) */
        const int halves = hd - d0 >= 2 * ATTN_FOLD ? 2 : 1;
        __m512 acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
        for (t = 0; t < count; t++) {
            const __m512 v0 = kv16(v + t * stride, d0, hd, dtype);
            const __m512 v1 = halves == 2 ? kv16(v + t * stride, d0 + ATTN_FOLD, hd, dtype) : v0;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512 e = _mm512_set1_ps(scores[j * capacity + t]);
                acc[j][0] = _mm512_fmadd_ps(e, v0, acc[j][0]);
                acc[j][1] = _mm512_fmadd_ps(e, v1, acc[j][1]);
            }
        }
        for (int j = 1; j < 4; j++)
            for (t = count; t < count + j; t++) {
                const __m512 e = _mm512_set1_ps(scores[j * capacity + t]);
                acc[j][0] = _mm512_fmadd_ps(e, kv16(v + t * stride, d0, hd, dtype), acc[j][0]);
                if (halves == 2) acc[j][1] = _mm512_fmadd_ps(e, kv16(v + t * stride, d0 + ATTN_FOLD, hd, dtype), acc[j][1]);
            }
        for (int j = 0; j < 4; j++) {
            const __m512 s = _mm512_set1_ps(sum[j]);
            _mm512_storeu_ps(out + j * out_stride + d0, _mm512_div_ps(acc[j][0], s));
            if (halves == 2) _mm512_storeu_ps(out + j * out_stride + d0 + ATTN_FOLD, _mm512_div_ps(acc[j][1], s));
        }
    }
}
#endif
#endif

/* One token's attention on the call's path. */
static void attend_one(const attention_t *a, const float *q, const char *k, const char *v, int64_t count, float *scores, float *out) {
#ifdef SPEEDC_X86
#ifdef SPEEDC_VNNI
    if (a->wide == ATTN_AVX512) { attend_avx512(a, q, k, v, count, scores, out); return; }
#endif
    if (a->wide == ATTN_AVX2) { attend_avx2(a, q, k, v, count, scores, out); return; }
#endif
    attend_portable(a, q, k, v, count, scores, out);
}

/* Four consecutive tokens of a chunk on the call's vector path (hd a multiple of 16; attend_avx2_four). */
static void attend_four(const attention_t *a, const float *q, const char *k, const char *v, int64_t count, float *scores,
                        int64_t capacity, float *out, int64_t out_stride) {
#ifdef SPEEDC_X86
#ifdef SPEEDC_VNNI
    if (a->wide == ATTN_AVX512) { attend_avx512_four(a, q, k, v, count, scores, capacity, out, out_stride); return; }
#endif
    attend_avx2_four(a, q, k, v, count, scores, capacity, out, out_stride);
#else
    (void)a; (void)q; (void)k; (void)v; (void)count; (void)scores; (void)capacity; (void)out; (void)out_stride;
#endif
}

/* Units (row, kv head) of the part's share: the row's tokens' K and V of that head written, then each token's
   attention for every query head of the group. A token reads only its own row's cache at that head, so the
   units are independent: one parallel region, no barrier between the writes and the reads. */
static void attention_part(const void *job, int part, int parts) {
    const attention_t *a = job;
    const int hd = a->hd, width = (a->heads + 2 * a->kv_heads) * hd, group = a->heads / a->kv_heads;
    const int64_t units = a->rows * a->kv_heads, u0 = units * part / parts, u1 = units * (part + 1) / parts;
    static __thread float *scores = NULL;
    static __thread int64_t capacity = 0;
    float rotated[ATTN_TOKENS * ATTN_MAX_HEAD_DIM];
    for (int64_t u = u0; u < u1; u++) {
        const int64_t r = u / a->kv_heads;
        const int g = (int)(u % a->kv_heads);
        const int64_t at = a->row_of[r] * a->row_stride + g * a->head_stride, tokens = a->len[r] < a->chunk ? a->len[r] : a->chunk;
        for (int64_t i = 0; i < tokens; i++) {  /* the writes: rotated key and value at p */
            const int64_t p = a->pos[r] + i;
            const float *token = a->qkv + (r * a->chunk + i) * width;
            rope(token + (a->heads + g) * hd, a->cos + p * (hd / 2), a->sin + p * (hd / 2), hd, rotated);
            kv_store(a->k_cache + at + p * a->kv_row_bytes, rotated, hd, a->kv_dtype);
            kv_store(a->v_cache + at + p * a->kv_row_bytes, token + (a->heads + a->kv_heads + g) * hd, hd, a->kv_dtype);
        }
        const char *k = a->k_cache + at, *v = a->v_cache + at;
        const int64_t need = ATTN_TOKENS * (a->pos[r] + a->chunk);  /* scores of up to ATTN_TOKENS tokens at once */
        if (need > capacity) {
            free(scores);
            capacity = need < 4 * 4096 ? 4 * 4096 : need;
            scores = malloc(sizeof(float) * capacity);
            if (!scores) { capacity = 0; atomic_store(&((attention_t *)job)->failed, 1); return; }
        }
        const int64_t room = capacity / ATTN_TOKENS;  /* each token's scores */
        const int64_t out_stride = (int64_t)a->heads * hd;
        float *out0 = a->out + r * a->chunk * out_stride + g * group * hd;
        for (int64_t i = tokens; i < a->chunk; i++) memset(out0 + i * out_stride, 0, sizeof(float) * group * hd);  /* padding */
        for (int h = 0; h < group; h++) {
            const int head = g * group + h;
            int64_t i = 0;
            if (a->wide != ATTN_PORTABLE && hd % ATTN_FOLD == 0)
                for (; i + ATTN_TOKENS <= tokens; i += ATTN_TOKENS) {
                    const int64_t p = a->pos[r] + i;
                    for (int j = 0; j < ATTN_TOKENS; j++)
                        rope(a->qkv + (r * a->chunk + i + j) * width + head * hd, a->cos + (p + j) * (hd / 2),
                             a->sin + (p + j) * (hd / 2), hd, rotated + j * hd);
                    attend_four(a, rotated, k, v, p + 1, scores, room, out0 + i * out_stride + h * hd, out_stride);
                }
            for (; i < tokens; i++) {
                const int64_t p = a->pos[r] + i;
                rope(a->qkv + (r * a->chunk + i) * width + head * hd, a->cos + p * (hd / 2), a->sin + p * (hd / 2), hd, rotated);
                attend_one(a, rotated, k, v, p + 1, scores, out0 + i * out_stride + h * hd);
            }
        }
    }
}

/* The attention's path for block-product PATH and head size HD: AVX-512 beside the avx512-vnni and amx products
   (hd a multiple of 16), AVX2 (with FMA and F16C) beside any other vector path, else portable. All give the same bits. */
static int attention_wide(int path, int hd) {
#ifdef SPEEDC_X86
    __builtin_cpu_init();
    if (path == PATH_PORTABLE || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return ATTN_PORTABLE;
#ifdef SPEEDC_VNNI
    if ((path == PATH_AVX512_VNNI || path == PATH_AMX) && hd % ATTN_FOLD == 0 && __builtin_cpu_supports("avx512f")) return ATTN_AVX512;
#endif
    return ATTN_AVX2;
#else
    (void)path; (void)hd;
    return ATTN_PORTABLE;
#endif
}
