/* Blocked int4 / int8 weight products with int8 dot products: y [M, N] = x [M, K] . dequant(W [N, K])^T.

   The weights are read in ONNX Runtime's MatMulNBits layout, byte for byte what the artifact stores
   (passes/block_quant.py): codes [N, blocks, block_size * bits / 8] uint8 (4 bits: two codes a byte, the
   lower K index in the low nibble), one float scale per block, zero point 2^(bits-1):
   w = (code - zp) * scale. Activations are quantized to int8 per 32 values ("sub-blocks"; a weight block
   is 1 to 8 of them): dx = max|x| / 127, q = rint(x * 127 / max|x|), so every product of one sub-block is
   an exact integer dot, scaled once:

       y[m, n] = sum over sub-blocks b of  float(dot_b(code - zp, q)) * (scale_w[n, b] * dx[m, b])

   Why a kernel of our own (not MatMulNBits): SPEED is lossless only if a row is computed the same alone
   (plain decoding) and among the P rows of a step; MatMulNBits' 4-bit single-row kernel is not, so its
   graphs pad every product with a zero row. Here every row is summed in one fixed order whatever the
   row count, so 1 row and P rows give bitwise the same sums per row; the work is split over output
   features only, so the thread count does not change a sum either. Each weight sub-block is unpacked
   once and applied to up to 4 rows; the weights are read in place (weights.bin mapped), never copied.

   Paths: AVX2 (chosen at run time where the CPU has AVX2 and FMA) and portable C. Each is row-invariant
   on its own; they may differ from each other in the last bits (one machine runs one path).
   Built by runtimes/kernels/native.py with the system C compiler; speedc falls back to ONNX Runtime's
   MatMulNBits where it cannot build or load this file. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPEEDC_X86 1
#endif

#define SUB 32     /* activation values per quantization block */
#define GROUP 4    /* sub-blocks a vector step covers */
#define MAX_THREADS 64

enum { PATH_AUTO = 0, PATH_PORTABLE = 1, PATH_AVX2 = 2 };

/* Quantized activations of one call: rows padded to whole groups of sub-blocks with zeros.
   q      [m, groups * GROUP, 32] int8     (4-bit weights: each sub-block as its even then odd values,
                                            the order in which the codes unpack: low nibbles, high nibbles)
   dx     [m, groups, 4] float             (the group's 4 activation scales)
   fix    [m, groups, 4] int32             (4-bit: zp * sum(q) of each sub-block, else 0)  */
typedef struct {
    int64_t m, n, k, blocks, sub_blocks, groups;
    int block_size, bits, path;
    int scale_shift;  /* log2(block_size / 32): sub-block b reads the scale of block b >> scale_shift */
    const uint8_t *codes;
    const float *scales;
    const int8_t *q;
    const float *dx;
    const int32_t *fix;
    float *y;
} product_t;

/* ---------------------------------------------------------------- activations */

static void quantize_rows(const float *x, product_t *p, int8_t *q, float *dx, int32_t *fix) {
    const int64_t sub_blocks = p->groups * GROUP;
    const int zp = 1 << (p->bits - 1);
    for (int64_t r = 0; r < p->m; r++) {
        const float *row = x + r * p->k;
        for (int64_t b = 0; b < sub_blocks; b++) {
            int8_t *out = q + (r * sub_blocks + b) * SUB;
            const int64_t start = b * SUB;
            const int64_t count = start >= p->k ? 0 : (p->k - start < SUB ? p->k - start : SUB);
            float largest = 0.0f;
            for (int64_t i = 0; i < count; i++) {
                const float a = fabsf(row[start + i]);
                largest = a > largest ? a : largest;
            }
            const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
            int8_t values[SUB];
            int32_t sum = 0;
            for (int64_t i = 0; i < SUB; i++) {
                const float v = i < count ? nearbyintf(row[start + i] * inverse) : 0.0f;
                values[i] = (int8_t)v;
                sum += values[i];
            }
            if (p->bits == 4) {  /* even values, then odd values */
                for (int i = 0; i < SUB / 2; i++) {
                    out[i] = values[2 * i];
                    out[SUB / 2 + i] = values[2 * i + 1];
                }
            } else {
                memcpy(out, values, SUB);
            }
            const int64_t g = b / GROUP, lane = b % GROUP;
            float *scale = dx + (r * p->groups + g) * GROUP;
            int32_t *f = fix + (r * p->groups + g) * GROUP;
            scale[lane] = largest / 127.0f;
            f[lane] = p->bits == 4 ? zp * sum : 0;
        }
    }
}

/* The weight scale of sub-block B of feature N (0 past the row: a padded tail contributes nothing). */
static inline float weight_scale(const product_t *p, int64_t n, int64_t b) {
    return b < p->sub_blocks ? p->scales[n * p->blocks + (b >> p->scale_shift)] : 0.0f;
}

/* The codes of sub-block B of feature N. */
static inline const uint8_t *sub_block_codes(const product_t *p, int64_t n, int64_t b) {
    return p->codes + (n * p->blocks) * (p->block_size * p->bits / 8) + b * (SUB * p->bits / 8);
}

/* ---------------------------------------------------------------- portable path */

/* The same sums as the vector path's lanes would give are not needed here: this path is row-invariant
   on its own (each row: exact integer dots, then one float multiply-add per sub-block, in order). */
static void features_portable(const product_t *p, int64_t n0, int64_t n1) {
    const int zp = 1 << (p->bits - 1);
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < p->m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < p->sub_blocks; b++) {
                const uint8_t *c = sub_block_codes(p, n, b);
                const int8_t *q = p->q + (r * p->groups * GROUP + b) * SUB;
                int32_t dot = 0;
                if (p->bits == 4) {
                    for (int i = 0; i < SUB / 2; i++) {
                        dot += ((int32_t)(c[i] & 15) - zp) * q[i];            /* value 2i */
                        dot += ((int32_t)(c[i] >> 4) - zp) * q[SUB / 2 + i];  /* value 2i + 1 */
                    }
                } else {
                    for (int i = 0; i < SUB; i++) dot += ((int32_t)c[i] - zp) * q[i];
                }
                const float scale = weight_scale(p, n, b) * p->dx[(r * p->groups + b / GROUP) * GROUP + b % GROUP];
                acc = fmaf((float)dot, scale, acc);
            }
            p->y[r * p->n + n] = acc;
        }
    }
}

/* ---------------------------------------------------------------- AVX2 path */
#ifdef SPEEDC_X86
#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE_AVX2 static inline __attribute__((always_inline, target("avx2,fma")))

/* The 4 weight scales of group G of one feature, as [s0 s1 s2 s3 | s0 s1 s2 s3]. */
INLINE_AVX2 __m256 group_scales(const float *row_scales, int64_t g, int shift) {
    __m128 s;
    if (shift == 0) {
        s = _mm_loadu_ps(row_scales + g * GROUP);
    } else if (shift == 1) {  /* blocks of 64: two scales, each for two sub-blocks */
        const __m128 two = _mm_castpd_ps(_mm_load_sd((const double *)(row_scales + g * 2)));
        s = _mm_unpacklo_ps(two, two);
    } else {  /* blocks of 128 or more: one scale for the whole group */
        s = _mm_set1_ps(row_scales[(g * GROUP) >> shift]);
    }
    return _mm256_set_m128(s, s);
}

/* A whole group's 4 weight sub-blocks as 32 bytes each. 4 bits: unsigned codes, low nibbles then high
   nibbles of the sub-block's 16 bytes (two sub-blocks unpacked per 32-byte load); 8 bits: signed values
   code - 128. */
INLINE_AVX2 void unpack_group(const uint8_t *codes, const int bits, __m256i w[GROUP]) {
    if (bits == 4) {
        const __m256i nibble = _mm256_set1_epi8(15);
        for (int j = 0; j < GROUP; j += 2) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + j * 16));  /* sub-blocks j, j + 1 */
            const __m256i low = _mm256_and_si256(packed, nibble);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            w[j] = _mm256_permute2x128_si256(low, high, 0x20);
            w[j + 1] = _mm256_permute2x128_si256(low, high, 0x31);
        }
    } else {
        for (int j = 0; j < GROUP; j++)
            w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + j * SUB)), _mm256_set1_epi8((char)0x80));
    }
}

/* The last group of a row whose sub-blocks do not fill it: the missing ones are zero weights. */
static void unpack_tail(const product_t *p, int64_t n, int64_t g, uint8_t *codes) {
    const int bytes = SUB * p->bits / 8;
    memset(codes, p->bits == 4 ? 0x88 : 0x80, GROUP * bytes);  /* the zero point: a zero weight */
    for (int64_t b = g * GROUP; b < p->sub_blocks; b++)
        memcpy(codes + (b - g * GROUP) * bytes, sub_block_codes(p, n, b), bytes);
}

/* Four sub-blocks' 8-lane int32 partial dots -> [d0 d1 d2 d3 | d0 d1 d2 d3]: lane j and lane j + 4 hold
   the two 128-bit halves' sums of sub-block j (two unpack-and-add levels: cheaper here than phaddd). */
INLINE_AVX2 __m256i reduce4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    const __m256i c01 = _mm256_add_epi32(_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
    const __m256i c23 = _mm256_add_epi32(_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(c01, c23), _mm256_unpackhi_epi64(c01, c23));
}

/* The group's integer dots of one row, laid out as reduce4 says. */
INLINE_AVX2 __m256i group_dots4(const __m256i w[GROUP], const int8_t *q, const int32_t *fix) {
    /* codes 0..15 x q in [-127, 127]: a pair is at most 3810, within maddubs' int16 */
    const __m256i one = _mm256_set1_epi16(1);
    __m256i s[GROUP];
    for (int j = 0; j < GROUP; j++)
        s[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], _mm256_loadu_si256((const __m256i *)(q + j * SUB))), one);
    const __m256i sums = reduce4(s[0], s[1], s[2], s[3]);
    const __m256i zero_point = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)fix));  /* lanes 0..3 */
    return _mm256_sub_epi32(sums, zero_point);  /* the zero point, exactly */
}

INLINE_AVX2 __m256i group_dots8(const __m256i w[GROUP], const __m256i magnitude[GROUP], const int8_t *q) {
    /* |w| <= 128 and |q| <= 127: a pair is at most 32512, within maddubs' int16 */
    const __m256i one = _mm256_set1_epi16(1);
    __m256i s[GROUP];
    for (int j = 0; j < GROUP; j++) {
        const __m256i signed_q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + j * SUB)), w[j]);
        s[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[j], signed_q), one);
    }
    return reduce4(s[0], s[1], s[2], s[3]);
}

INLINE_AVX2 float sum_lanes(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

/* One group applied to ROWS rows (a constant after inlining): each row's accumulator sees the same
   operations in the same order whatever ROWS is. */
INLINE_AVX2 void group_rows(const __m256i w[GROUP], __m256 scale, const int bits, const int rows,
                            const int8_t *const q[4], const float *const dx[4], const int32_t *const fix[4],
                            int64_t g, __m256 acc[4]) {
    __m256i magnitude[GROUP];
    for (int j = 0; j < GROUP; j++) magnitude[j] = bits == 8 ? _mm256_abs_epi8(w[j]) : w[j];
#pragma GCC unroll 4
    for (int i = 0; i < rows; i++) {
        const __m256i dots = bits == 4 ? group_dots4(w, q[i] + g * GROUP * SUB, fix[i] + g * GROUP)
                                       : group_dots8(w, magnitude, q[i] + g * GROUP * SUB);
        const __m256 s = _mm256_mul_ps(scale, _mm256_broadcast_ps((const __m128 *)(dx[i] + g * GROUP)));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), s, acc[i]);
    }
}

/* Rows R0 .. R0 + ROWS - 1 of feature N. */
INLINE_AVX2 void feature_rows(const product_t *p, int64_t n, int64_t r0, const int rows, const int bits) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const int8_t *q[4];
    const float *dx[4];
    const int32_t *fix[4];
    for (int i = 0; i < 4; i++) {
        const int64_t r = r0 + (i < rows ? i : 0);
        q[i] = p->q + r * p->groups * GROUP * SUB;
        dx[i] = p->dx + r * p->groups * GROUP;
        fix[i] = p->fix + r * p->groups * GROUP;
    }
    const uint8_t *codes = sub_block_codes(p, n, 0);
    const float *row_scales = p->scales + n * p->blocks;
    const int64_t whole = p->sub_blocks / GROUP;
    const int group_bytes = GROUP * SUB * bits / 8;
    __m256i w[GROUP];
    for (int64_t g = 0; g < whole; g++) {
        unpack_group(codes + g * group_bytes, bits, w);
        group_rows(w, group_scales(row_scales, g, p->scale_shift), bits, rows, q, dx, fix, g, acc);
    }
    if (whole < p->groups) {  /* the tail */
        uint8_t tail[GROUP * SUB];
        float s[GROUP];
        unpack_tail(p, n, whole, tail);
        for (int j = 0; j < GROUP; j++) s[j] = weight_scale(p, n, whole * GROUP + j);
        const __m128 half = _mm_loadu_ps(s);
        unpack_group(tail, bits, w);
        group_rows(w, _mm256_set_m128(half, half), bits, rows, q, dx, fix, whole, acc);
    }
#pragma GCC unroll 4
    for (int i = 0; i < rows; i++) p->y[(r0 + i) * p->n + n] = sum_lanes(acc[i]);
}

INLINE_AVX2 void features_bits(const product_t *p, int64_t n0, int64_t n1, const int bits) {
    for (int64_t n = n0; n < n1; n++) {
        int64_t r = 0;
        for (; r + 4 <= p->m; r += 4) feature_rows(p, n, r, 4, bits);
        switch (p->m - r) {
            case 3: feature_rows(p, n, r, 3, bits); break;
            case 2: feature_rows(p, n, r, 2, bits); break;
            case 1: feature_rows(p, n, r, 1, bits); break;
            default: break;
        }
    }
}

static AVX2 void features_avx2(const product_t *p, int64_t n0, int64_t n1) {
    if (p->bits == 4) features_bits(p, n0, n1, 4);
    else features_bits(p, n0, n1, 8);
}

static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static int have_avx2(void) { return 0; }
static void features_avx2(const product_t *p, int64_t n0, int64_t n1) { features_portable(p, n0, n1); }
#endif

/* ---------------------------------------------------------------- threads */

/* A small pool of persistent workers: a call hands each worker a range of output features. Workers stay
   ready for 200 us after a call (the next product of a step follows within microseconds), yielding
   their core meanwhile to ONNX Runtime's threads (which run the rest of the graph), then sleep. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;
    atomic_long generation;
    atomic_int pending;
    void (*run)(const void *job, int part, int parts);
    const void *job;
    int parts;
    pthread_t threads[MAX_THREADS];
    long born[MAX_THREADS];
} pool_t;

static pool_t pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t pool_start = PTHREAD_MUTEX_INITIALIZER;  /* one call at a time uses the pool */

static void product_part(const void *job, int part, int parts) {
    const product_t *p = job;
    const int64_t n0 = p->n * part / parts, n1 = p->n * (part + 1) / parts;
    if (p->path == PATH_AVX2) features_avx2(p, n0, n1);
    else features_portable(p, n0, n1);
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *worker(void *arg) {
    const int index = (int)(intptr_t)arg;  /* part index - 1 */
    long seen = pool.born[index];  /* the generation before the call that started it */
    for (;;) {
        const double until = seconds() + 200e-6;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen && seconds() < until) {
            sched_yield();  /* ready at once, yet the core goes to whoever needs it (ONNX Runtime's own workers) */
        }
        if (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        if (index + 1 < pool.parts) {
            pool.run(pool.job, index + 1, pool.parts);
        }
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

static void forget_workers(void) { pool.workers = 0; }  /* a forked child has none of the parent's threads */

static int ensure_workers(int wanted) {
    static int registered = 0;
    if (!registered) { pthread_atfork(NULL, NULL, forget_workers); registered = 1; }
    while (pool.workers < wanted && pool.workers < MAX_THREADS) {
        pool.born[pool.workers] = atomic_load(&pool.generation);
        if (pthread_create(&pool.threads[pool.workers], NULL, worker, (void *)(intptr_t)pool.workers) != 0) break;
        pthread_detach(pool.threads[pool.workers]);
        pool.workers++;
    }
    return pool.workers;
}

/* RUN(JOB, part, parts) for parts 0 .. parts - 1 on up to THREADS threads (the caller's one of them). */
static void run_parallel(void (*run)(const void *, int, int), const void *job, int threads) {
    threads = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    if (threads == 1) { run(job, 0, 1); return; }
    pthread_mutex_lock(&pool_start);
    const int workers = ensure_workers(threads - 1);
    const int parts = workers + 1 < threads ? workers + 1 : threads;
    pool.run = run;
    pool.job = job;
    pool.parts = parts;
    atomic_store(&pool.pending, workers);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run(job, 0, parts);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) {
#ifdef SPEEDC_X86
        _mm_pause();
#endif
    }
    pthread_mutex_unlock(&pool_start);
}

/* ---------------------------------------------------------------- entry points */

/* The path PATH_AUTO takes on this CPU. */
int speedc_block_product_path(void) { return have_avx2() ? PATH_AVX2 : PATH_PORTABLE; }

/* y [m, n] = x [m, k] . dequant(codes, scales)^T, see the top of this file. Returns 0, or a negative
   number for arguments it does not take: -1 bits not 4 / 8, -2 block size not 32 times a power of two
   (or blocks too few for k), -3 a path this CPU lacks, -4 no memory. */
int speedc_block_product(const float *x, int64_t m, int64_t k, const uint8_t *codes, const float *scales,
                         int64_t n, int64_t blocks, int block_size, int bits, float *y, int threads, int path) {
    if (bits != 4 && bits != 8) return -1;
    if (block_size < SUB || block_size > 4096 || blocks * block_size < k) return -2;
    if (path == PATH_AUTO) path = speedc_block_product_path();
    if (path == PATH_AVX2 && !have_avx2()) return -3;
    if (path != PATH_AVX2 && path != PATH_PORTABLE) return -3;
    if (m <= 0 || n <= 0) return 0;
    product_t p = {0};
    p.m = m; p.n = n; p.k = k; p.blocks = blocks; p.block_size = block_size; p.bits = bits; p.path = path;
    p.sub_blocks = (k + SUB - 1) / SUB;
    while ((SUB << p.scale_shift) < block_size) p.scale_shift++;
    if ((SUB << p.scale_shift) != block_size) return -2;  /* a power of two times 32 */
    p.groups = (p.sub_blocks + GROUP - 1) / GROUP;
    p.codes = codes; p.scales = scales; p.y = y;
    /* per-thread scratch, kept between calls: a step's products reuse it */
    static __thread int8_t *q_buf = NULL;
    static __thread float *dx_buf = NULL;
    static __thread int32_t *fix_buf = NULL;
    static __thread int64_t capacity = 0;
    const int64_t need = m * p.groups;
    if (need > capacity) {
        free(q_buf); free(dx_buf); free(fix_buf);
        q_buf = malloc((size_t)need * GROUP * SUB);
        dx_buf = malloc((size_t)need * GROUP * sizeof(float));
        fix_buf = malloc((size_t)need * GROUP * sizeof(int32_t));
        capacity = (q_buf && dx_buf && fix_buf) ? need : 0;
        if (!capacity) return -4;
    }
    quantize_rows(x, &p, q_buf, dx_buf, fix_buf);
    p.q = q_buf; p.dx = dx_buf; p.fix = fix_buf;
    run_parallel(product_part, &p, m * n >= 2048 ? threads : 1);  /* tiny products: not worth a wake-up */
    return 0;
}

/* ---------------------------------------------------------------- the memory floor */

typedef struct {
    const uint8_t *const *buffers;
    const int64_t *sizes;
    int count;
    uint64_t sums[MAX_THREADS];
} stream_t;

static void stream_part(const void *job, int part, int parts) {
    const stream_t *s = job;
    uint64_t sum = 0;
    for (int b = 0; b < s->count; b++) {
        const int64_t words = s->sizes[b] / 8, w0 = words * part / parts, w1 = words * (part + 1) / parts;
        const uint64_t *data = (const uint64_t *)s->buffers[b];
        for (int64_t i = w0; i < w1; i++) sum += data[i];
    }
    ((stream_t *)s)->sums[part] = sum;
}

/* Reads every 8-byte word of the COUNT buffers once on THREADS threads (split like the products): the
   time the weights take to stream from memory, the floor a product's 1-row time is measured against.
   Returns a checksum so the reads are not optimised away. */
uint64_t speedc_stream_bytes(const uint8_t *const *buffers, const int64_t *sizes, int count, int threads) {
    stream_t s = {buffers, sizes, count, {0}};
    run_parallel(stream_part, &s, threads);
    uint64_t total = 0;
    for (int t = 0; t < MAX_THREADS; t++) total += s.sums[t];
    return total;
}
