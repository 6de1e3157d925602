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
   split over (row, kv head)), and the same on the portable and AVX2 paths (explicit fused multiply-
   adds, an exp of our own), so a token attends bitwise the same in plain decoding and in a step:
       q . k   8 lanes, lane l += q[d] * k[d] for d = l, l + 8, ... (fma);
               then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (two horizontal adds)
       exp     exp_approx: a degree-6 polynomial and 2^n, the same fmas on every path
       sum     of e_t: lane t % 8 in order of t, then reduced as the dot
       out[d]  fma of e_t * v_t[d] in order of t, divided by the sum
   A prefill's tokens go four at a time on the AVX2 path (attend_avx2_four), each in that same order. */

#define ATTN_LANES 8
#define ATTN_MAX_HEAD_DIM 512
#define ATTN_TOKENS 4  /* a prefill chunk's tokens attended together (attend_avx2_four) */
#define KV_BLOCK 32  /* int8 cache: values per scale */
enum { KV_FP32 = 0, KV_FP16 = 1, KV_INT8 = 2 };

typedef struct {
    const float *qkv;               /* [rows, chunk, (heads + 2 kv_heads) * hd] */
    int64_t rows, chunk;
    int heads, kv_heads, hd, kv_dtype, wide;
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

/* Value d of a position's head ROW (hd values). */
static inline float kv_load(const char *row, int d, int hd, int dtype) {
    if (dtype == KV_FP16) return fp16_to_float(((const uint16_t *)row)[d]);
    if (dtype == KV_FP32) return ((const float *)row)[d];
    float scale;
    memcpy(&scale, row + 4 * (d / KV_BLOCK), sizeof scale);
    return (float)((const int8_t *)(row + 4 * (hd / KV_BLOCK)))[d] * scale;
}

/* A position's head ROW from VALUES [hd], rounded to the cache's type. */
static inline void kv_store(char *row, const float *values, int hd, int dtype) {
    if (dtype == KV_FP16) { for (int d = 0; d < hd; d++) ((uint16_t *)row)[d] = float_to_fp16(values[d]); return; }
    if (dtype == KV_FP32) { memcpy(row, values, sizeof(float) * hd); return; }
    int8_t *codes = (int8_t *)(row + 4 * (hd / KV_BLOCK));
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        float top = 0.0f;
        for (int d = b * KV_BLOCK; d < (b + 1) * KV_BLOCK; d++) top = fabsf(values[d]) > top ? fabsf(values[d]) : top;
        const float scale = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
        memcpy(row + 4 * b, &scale, sizeof scale);
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

/* The 8 lanes' sum in the order of two horizontal adds (hadd_reduce4 below): adjacent pairs, pairs of pairs, halves. */
static inline float lanes_reduce(const float *lane) {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
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
        float lane[ATTN_LANES] = {0};
        const char *row = k + t * a->kv_row_bytes;
        for (int d = 0; d < hd; d++) lane[d % ATTN_LANES] = fmaf(q[d], kv_load(row, d, hd, a->kv_dtype), lane[d % ATTN_LANES]);
        scores[t] = lanes_reduce(lane) * a->scale;
        m = scores[t] > m ? scores[t] : m;
    }
    float lane[ATTN_LANES] = {0};
    for (int64_t t = 0; t < count; t++) {
        scores[t] = exp_approx(scores[t] - m);
        lane[t % ATTN_LANES] += scores[t];
    }
    const float sum = lanes_reduce(lane);
    float acc[ATTN_MAX_HEAD_DIM];
    for (int d = 0; d < hd; d++) acc[d] = 0.0f;
    for (int64_t t = 0; t < count; t++)
        for (int d = 0; d < hd; d++) acc[d] = fmaf(scores[t], kv_load(v + t * a->kv_row_bytes, d, hd, a->kv_dtype), acc[d]);
    for (int d = 0; d < hd; d++) out[d] = acc[d] / sum;
}

#ifdef SPEEDC_X86
/* ---- the AVX2 path (with FMA and F16C): the same operations, 8 lanes a register */
#define ATTN256_TARGET "avx2,fma,f16c"

/* Values d .. d + 7 of a position's head ROW (kv_load's, 8 at a time: an int8 block's 32 share one scale). */
static inline __attribute__((always_inline, target(ATTN256_TARGET))) __m256 kv8(const char *row, int d, int hd, int dtype) {
    if (dtype == KV_FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
    if (dtype == KV_FP32) return _mm256_loadu_ps((const float *)row + d);
    const __m128i codes = _mm_loadl_epi64((const __m128i *)(row + 4 * (hd / KV_BLOCK) + d));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), _mm256_broadcast_ss((const float *)(row + 4 * (d / KV_BLOCK))));
}

/* Four registers' lane sums [a, b, c, d] at once, each in lanes_reduce's order. */
static inline __attribute__((always_inline, target(ATTN256_TARGET))) __m128 reduce8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  /* [a_lo b_lo c_lo d_lo | a_hi ...] */
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

static inline __attribute__((always_inline, target(ATTN256_TARGET))) float reduce8(__m256 x) {
    return _mm_cvtss_f32(reduce8x4(x, x, x, x));
}

static inline __attribute__((always_inline, target(ATTN256_TARGET))) __m256 exp8(__m256 x) {
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

/* Scores [count] to their softmax weights e_t = exp(s_t - max) in place; returns their sum (lane t % 8). */
static inline __attribute__((always_inline, target(ATTN256_TARGET))) float softmax8(float *scores, int64_t count) {
    float m = -INFINITY;
    for (int64_t t = 0; t < count; t++) m = scores[t] > m ? scores[t] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + ATTN_LANES <= count; t += ATTN_LANES) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), mv));
        _mm256_storeu_ps(scores + t, e);
        total = _mm256_add_ps(total, e);
    }
    float lane[ATTN_LANES];
    _mm256_storeu_ps(lane, total);
    for (; t < count; t++) {
        scores[t] = exp_approx(scores[t] - m);
        lane[t % ATTN_LANES] += scores[t];
    }
    return lanes_reduce(lane);
}

/* One position's q . k, the 8 lanes reduced (not yet scaled). */
static inline __attribute__((always_inline, target(ATTN256_TARGET))) float dot8(const float *q, const char *row, int hd, int dtype) {
    __m256 s = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += ATTN_LANES) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv8(row, d, hd, dtype), s);
    return reduce8(s);
}

static __attribute__((target(ATTN256_TARGET))) void attend_avx2(const attention_t *a, const float *q, const char *k,
                                                                const char *v, int64_t count, float *scores, float *out) {
    const int hd = a->hd, dtype = a->kv_dtype;
    const int64_t stride = a->kv_row_bytes;
    int64_t t = 0;
    for (; t + 4 <= count; t += 4) {  /* four positions at once: four independent chains */
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int d = 0; d < hd; d += ATTN_LANES) {
            const __m256 qd = _mm256_loadu_ps(q + d);
            s0 = _mm256_fmadd_ps(qd, kv8(k + t * stride, d, hd, dtype), s0);
            s1 = _mm256_fmadd_ps(qd, kv8(k + (t + 1) * stride, d, hd, dtype), s1);
            s2 = _mm256_fmadd_ps(qd, kv8(k + (t + 2) * stride, d, hd, dtype), s2);
            s3 = _mm256_fmadd_ps(qd, kv8(k + (t + 3) * stride, d, hd, dtype), s3);
        }
        _mm_storeu_ps(scores + t, _mm_mul_ps(reduce8x4(s0, s1, s2, s3), _mm_set1_ps(a->scale)));
    }
    for (; t < count; t++) scores[t] = dot8(q, k + t * stride, hd, dtype) * a->scale;
    const float sum = softmax8(scores, count);
    for (int d0 = 0; d0 < hd; d0 += 64) {  /* 64 values of out in 8 registers, all positions in order */
        const int width = hd - d0 < 64 ? hd - d0 : 64;
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        for (t = 0; t < count; t++) {
            const __m256 e = _mm256_set1_ps(scores[t]);
            for (int c = 0; c * ATTN_LANES < width; c++) acc[c] = _mm256_fmadd_ps(e, kv8(v + t * stride, d0 + c * ATTN_LANES, hd, dtype), acc[c]);
        }
        const __m256 s = _mm256_set1_ps(sum);
        for (int c = 0; c * ATTN_LANES < width; c++) _mm256_storeu_ps(out + d0 + c * ATTN_LANES, _mm256_div_ps(acc[c], s));
    }
}

/* Four consecutive tokens of a prefill chunk (query rows Q [4][hd], each attending COUNT[j] = COUNT[0] + j
   positions), each computed exactly as attend_avx2 computes it alone (per token: the same fmas in the same
   order), but every cached value is loaded and converted once for the four: a prefill's attention reads
   each key and value once per four tokens instead of once per token. SCORES [4][capacity], OUT [4] rows. */
static __attribute__((target(ATTN256_TARGET))) void attend_avx2_four(const attention_t *a, const float *q, const char *k,
                                                                     const char *v, int64_t count, float *scores,
                                                                     int64_t capacity, float *out, int64_t out_stride) {
    const int hd = a->hd, dtype = a->kv_dtype;
    const int64_t stride = a->kv_row_bytes;
    const __m128 scale = _mm_set1_ps(a->scale);
    float four[4];
    int64_t t = 0;
    for (; t + 2 <= count; t += 2) {  /* the positions all four read, two at a time: eight independent chains */
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, u0 = s0, u1 = s0, u2 = s0, u3 = s0;
        for (int d = 0; d < hd; d += ATTN_LANES) {
            const __m256 kd = kv8(k + t * stride, d, hd, dtype), ke = kv8(k + (t + 1) * stride, d, hd, dtype);
            const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + hd + d);
            const __m256 q2 = _mm256_loadu_ps(q + 2 * hd + d), q3 = _mm256_loadu_ps(q + 3 * hd + d);
            s0 = _mm256_fmadd_ps(q0, kd, s0);
            s1 = _mm256_fmadd_ps(q1, kd, s1);
            s2 = _mm256_fmadd_ps(q2, kd, s2);
            s3 = _mm256_fmadd_ps(q3, kd, s3);
            u0 = _mm256_fmadd_ps(q0, ke, u0);
            u1 = _mm256_fmadd_ps(q1, ke, u1);
            u2 = _mm256_fmadd_ps(q2, ke, u2);
            u3 = _mm256_fmadd_ps(q3, ke, u3);
        }
        _mm_storeu_ps(four, _mm_mul_ps(reduce8x4(s0, s1, s2, s3), scale));
        for (int j = 0; j < 4; j++) scores[j * capacity + t] = four[j];
        _mm_storeu_ps(four, _mm_mul_ps(reduce8x4(u0, u1, u2, u3), scale));
        for (int j = 0; j < 4; j++) scores[j * capacity + t + 1] = four[j];
    }
    for (; t < count; t++) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int d = 0; d < hd; d += ATTN_LANES) {
            const __m256 kd = kv8(k + t * stride, d, hd, dtype);
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kd, s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + hd + d), kd, s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * hd + d), kd, s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * hd + d), kd, s3);
        }
        _mm_storeu_ps(four, _mm_mul_ps(reduce8x4(s0, s1, s2, s3), scale));
        for (int j = 0; j < 4; j++) scores[j * capacity + t] = four[j];
    }
    for (int j = 1; j < 4; j++)  /* token j's own last j positions */
        for (t = count; t < count + j; t++) scores[j * capacity + t] = dot8(q + j * hd, k + t * stride, hd, dtype) * a->scale;
    float sum[4];
    for (int j = 0; j < 4; j++) sum[j] = softmax8(scores + j * capacity, count + j);
    for (int d0 = 0; d0 < hd; d0 += 2 * ATTN_LANES) {  /* 16 values of each token's out in 2 registers */
        __m256 acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (t = 0; t < count; t++) {
            const __m256 v0 = kv8(v + t * stride, d0, hd, dtype), v1 = kv8(v + t * stride, d0 + ATTN_LANES, hd, dtype);
            for (int j = 0; j < 4; j++) {
                const __m256 e = _mm256_set1_ps(scores[j * capacity + t]);
                acc[j][0] = _mm256_fmadd_ps(e, v0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(e, v1, acc[j][1]);
            }
        }
        for (int j = 1; j < 4; j++)
            for (t = count; t < count + j; t++) {
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
#endif

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
#ifdef SPEEDC_X86
            if (a->wide && hd % (2 * ATTN_LANES) == 0)
                for (; i + ATTN_TOKENS <= tokens; i += ATTN_TOKENS) {
                    const int64_t p = a->pos[r] + i;
                    for (int j = 0; j < ATTN_TOKENS; j++)
                        rope(a->qkv + (r * a->chunk + i + j) * width + head * hd, a->cos + (p + j) * (hd / 2),
                             a->sin + (p + j) * (hd / 2), hd, rotated + j * hd);
                    attend_avx2_four(a, rotated, k, v, p + 1, scores, room, out0 + i * out_stride + h * hd, out_stride);
                }
#endif
            for (; i < tokens; i++) {
                const int64_t p = a->pos[r] + i;
                rope(a->qkv + (r * a->chunk + i) * width + head * hd, a->cos + p * (hd / 2), a->sin + p * (hd / 2), hd, rotated);
#ifdef SPEEDC_X86
                if (a->wide) { attend_avx2(a, rotated, k, v, p + 1, scores, out0 + i * out_stride + h * hd); continue; }
#endif
                attend_portable(a, rotated, k, v, p + 1, scores, out0 + i * out_stride + h * hd);
            }
        }
    }
}

/* Whether this CPU runs the AVX2 attention (with FMA and F16C) for block-product PATH (not the portable one). */
static int attention_wide(int path) {
#ifdef SPEEDC_X86
    __builtin_cpu_init();
    return path != PATH_PORTABLE && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    (void)path;
    return 0;
#endif
}
