/* block_product.c's lanes16 paths: avx512-vnni, amx and amx-standin. A weight is repacked once at load
   so that 16 output features sit side by side, one int32 lane each, and every superblock's sum is one
   exact integer per (row, feature), scaled once as the portable path scales it: these paths give the
   portable path's bits exactly, whatever the row or thread count.

   The packed codes (prepare_lanes), per group g of 16 features, superblock s, sub-block b, one chunk of
   the weight's codes in the order AMX's B tile and vpdpbusd read them (K = 32 values of sub-block b,
   4 consecutive bytes per feature and tile row):

       4 bits: 256 bytes [qd 0..3][feature j 0..15][e 0..3] = code byte 4 qd + e of feature 16 g + j's
               sub-block; its low nibbles are tile row 2 qd, its high nibbles row 2 qd + 1
       8 bits: 512 bytes [row r 0..7][feature j][e 0..3] = code byte 4 r + e

   So value i of a 4-bit sub-block is K index 8 (i / 8) + 4 (i & 1) + (i % 8) / 2 (lanes_q4_index), the
   activations' order; at 8 bits the values stay in order. Codes stay unsigned (no zero point taken off)
   and activations signed: D_b = sum q x code per sub-block (vpdpbusd's u8 x s8, AMX's tdpbsud s8 x u8),
   and the zero point comes back through the sub-block's activation sum qs_b:

       total[m, n] = sum_b step[n, b] x D_b[m, n]  -  (sum_b step[n, b] x qs_b[m]) x 2^(bits-1)

   in int32, wrapping (a product may leave int32; the total, the exact sum of step x (code - zp) x q,
   does not: see STEP_LIMIT). Steps are stored as int16 pairs [g][s][b / 2][16][2] (one 64-byte load
   gives two sub-blocks' steps, as vpdpwssd pairs them with qs), units [g][s][16]. At 4 bits both paths
   take the zero point off each D_b before scaling (vpdpbusd starts it at -8 qs_b; the tile path unpacks
   codes as code - zp, block_product_tiles.h), so D_b fits int16 and a pair of them meets its two steps in
   one vpdpwssd: the same integers.

   Padding: features past n and sub-blocks past the row have zero steps and codes at the zero point. */

#define LANES 16
#define PREFETCH_AHEAD 2  /* superblocks: the rows' work between reads left the memory idle without it */
/* One row reads the weight as fast as memory gives it: further ahead, into L2 (a layer stack's products of one
   row 36.8 -> 34.8 ms on the AMX Xeon, 2 threads); four rows ran 3% slower so (they compute between reads). */
#define PREFETCH_AHEAD_ONE_ROW 4

static inline int64_t lanes_groups(int64_t n) { return (n + LANES - 1) / LANES; }
static inline int lanes_chunk(int bits) { return bits == 4 ? 256 : 512; }  /* packed bytes per group and sub-block */

static void prepare_lanes_part(const void *job, int part, int parts) {
    const prepare_t *w = job;
    const int64_t groups = lanes_groups(w->n), g0 = groups * part / parts, g1 = groups * (part + 1) / parts;
    const int super = super_of(w->bits), chunk = lanes_chunk(w->bits), sub_bytes = SUB * w->bits / 8;
    const int64_t row_bytes = w->blocks * (w->block_size * w->bits / 8);
    const uint8_t zero = w->bits == 4 ? 0x88 : 0x80;
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t s = 0; s < w->supers; s++) {
            int16_t *pairs = w->steps + (g * w->supers + s) * super * LANES;
            float *units = w->units + (g * w->supers + s) * LANES;
            for (int j = 0; j < LANES; j++) {
                const int64_t n = g * LANES + j;
                int16_t steps[SUPER_MAX] = {0};
                float unit = 0.0f;
                if (n < w->n) superblock_steps(w, n, s, steps, &unit);
                units[j] = unit;
                for (int b = 0; b < super; b++) pairs[(b / 2) * 2 * LANES + 2 * j + (b & 1)] = steps[b];
                for (int b = 0; b < super; b++) {
                    const int64_t sub = s * super + b;
                    uint8_t *out = w->packed + ((g * w->supers + s) * super + b) * chunk;
                    const uint8_t *in = n < w->n && sub < w->sub_blocks ? w->codes + n * row_bytes + sub * sub_bytes : NULL;
                    for (int t = 0; t < sub_bytes; t++) out[(t / 4) * 64 + 4 * j + t % 4] = in ? in[t] : zero;
                }
            }
        }
    }
}

#ifdef SPEEDC_VNNI
/* ---------------------------------------------------------------- avx512-vnni, lanes16 */

/* Sub-block B's 16 steps as int32, from the pair [b & ~1, b | 1] of each feature */
INLINE_AVX512 __m512i lanes_step(const int16_t *pairs, int b) {
    const __m512i pair = _mm512_loadu_si512(pairs + (b / 2) * 2 * LANES);
    return b & 1 ? _mm512_srai_epi32(pair, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
}

/* Rows R0 .. R0 + ROWS - 1 (ROWS <= 8, a constant after inlining) of the 16 features of group G: each
   sub-block's codes are unpacked once into 8 registers (a tile's 8 rows of 16 features x 4 bytes) and
   applied to every row with 8 vpdpbusd, the activations' 4 bytes broadcast from memory.
   4 bits: each row's D_b starts at -8 qs_b, so it ends as the zero-pointed sum of q x (code - 8), within
   int16 (32 x 127 x 8); a pair of sub-blocks' D_b is then scaled by its two steps in one vpdpwssd, as the
   tile path does (a vpmulld per row and sub-block took 10% of a 4-row product). 8 bits: D_b x step (the
   sums leave int16), the zero point's share taken off once per superblock. */
INLINE_AVX512 void group_rows_avx512_vnni(const product_t *p, int64_t g, int64_t r0, const int rows, const int bits) {
    const int super = super_of(bits), chunk = lanes_chunk(bits);
    const int64_t width = p->supers * super * SUB;
    const int8_t *q = (const int8_t *)p->q + r0 * width;
    const int16_t *qs = p->qs + r0 * p->supers * super;
    const float *dx = p->dx + r0 * p->supers;
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int64_t s = 0; s < p->supers; s++) {
        const uint8_t *codes = p->codes + (g * p->supers + s) * super * chunk;
        const int16_t *pairs = p->steps + (g * p->supers + s) * super * LANES;
        __m512i total[8], fix[8], even[8];
        for (int i = 0; i < 8; i++) total[i] = fix[i] = even[i] = _mm512_setzero_si512();
        for (int b = 0; b < super; b++) {
            const __m512i pair = _mm512_loadu_si512(pairs + (b / 2) * 2 * LANES);
            for (int t = 0; t < chunk; t += 64) {
                if (rows == 1) _mm_prefetch((const char *)codes + PREFETCH_AHEAD_ONE_ROW * super * chunk + b * chunk + t, _MM_HINT_T1);
                else _mm_prefetch((const char *)codes + PREFETCH_AHEAD * super * chunk + b * chunk + t, _MM_HINT_T0);
            }
            __m512i w[8];
            if (bits == 4) {
                for (int h = 0; h < 4; h++) {
                    const __m512i c = _mm512_loadu_si512(codes + b * chunk + 64 * h);
                    w[2 * h] = _mm512_and_si512(c, nibble);
                    w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
                }
            } else {
                for (int h = 0; h < 8; h++) w[h] = _mm512_loadu_si512(codes + b * chunk + 64 * h);
            }
#pragma GCC unroll 8
            for (int i = 0; i < rows; i++) {
                const int32_t *x = (const int32_t *)(q + i * width + (s * super + b) * SUB);
                const int16_t *row_qs = qs + i * p->supers * super + s * super;
                __m512i d = bits == 4 ? _mm512_set1_epi32(-8 * (int32_t)row_qs[b]) : _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int h = 0; h < 8; h++) d = _mm512_dpbusd_epi32(d, w[h], _mm512_set1_epi32(x[h]));
                if (bits == 4) {  /* [D_b | D_b+1] as int16 pairs, times [step_b | step_b+1] */
                    if (b & 1) total[i] = _mm512_dpwssd_epi32(total[i], _mm512_mask_mov_epi16(even[i], 0xAAAAAAAA,
                                                                                               _mm512_slli_epi32(d, 16)), pair);
                    else even[i] = d;
                } else {
                    total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(d, lanes_step(pairs, b)));
                    if (b & 1) {  /* the pair's zero-point term: step_b qs_b + step_b+1 qs_b+1 */
                        int32_t two;
                        memcpy(&two, row_qs + b - 1, sizeof two);
                        fix[i] = _mm512_dpwssd_epi32(fix[i], pair, _mm512_set1_epi32(two));
                    }
                }
            }
        }
        const __m512 unit = _mm512_loadu_ps(p->units + (g * p->supers + s) * LANES);
#pragma GCC unroll 8
        for (int i = 0; i < rows; i++) {
            const __m512i exact = bits == 4 ? total[i] : _mm512_sub_epi32(total[i], _mm512_slli_epi32(fix[i], bits - 1));
            const __m512 scale = _mm512_mul_ps(unit, _mm512_set1_ps(dx[i * p->supers + s]));  /* unit x dx */
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[i]);
        }
    }
    const int64_t left = p->n - g * LANES;
    const __mmask16 keep = left >= LANES ? 0xFFFF : (__mmask16)((1u << left) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < rows; i++) _mm512_mask_storeu_ps(p->y + (r0 + i) * p->n + g * LANES, keep, acc[i]);
}

static __attribute__((target(AVX512_TARGET))) void groups_avx512_vnni(const product_t *p, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t r = 0; r < p->m; r += 8) {
            const int rows = p->m - r < 8 ? (int)(p->m - r) : 8;
#define ROWS_CASE(R) case R: if (p->bits == 4) group_rows_avx512_vnni(p, g, r, R, 4); else group_rows_avx512_vnni(p, g, r, R, 8); break;
            switch (rows) {  /* each case its own unrolled copy */
                ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5) ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2) default: ROWS_CASE(1)
            }
#undef ROWS_CASE
        }
    }
}
#endif

/* ---------------------------------------------------------------- amx (and its stand-in) */

/* AMX's tile configuration (palette 1): 8 tiles of up to 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

#define TILE_ROWS 16
#define B_TILE_BYTES (SUB / 4 * 64)  /* one sub-block's codes as a B tile: K / 4 rows of 16 features x 4 bytes */

/* The fewest rows amx runs on tiles: below them the avx512-vnni code is faster (a tile product costs
   about as much for 1 row as for 8; docs/benchmarks.md, "AMX"). */
static inline int amx_min_rows(int bits) { return bits == 4 ? 8 : 10; }

/* Tiles 0-3 hold 4 sub-blocks' sums C [rows, 16] int32, 4-5 their activations A [rows, 32] int8, 6-7
   their codes B [8, 64] (K / 4 rows of 16 features x 4 bytes). */
static void tile_config(tile_config_t *c, int rows) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < 4; t++) { c->rows[t] = (uint8_t)rows; c->colsb[t] = 64; }
    for (int t = 4; t < 6; t++) { c->rows[t] = (uint8_t)rows; c->colsb[t] = SUB; }
    for (int t = 6; t < 8; t++) { c->rows[t] = SUB / 4; c->colsb[t] = 64; }
}

/* The stand-in's tiles: AMX's instructions as their description states them, in plain C. */
typedef struct { int rows, colsb; uint8_t data[TILE_ROWS][64]; } tile_t;
static __thread tile_t standin_tiles[8];

static void standin_config(const tile_config_t *c) {
    for (int t = 0; t < 8; t++) { standin_tiles[t].rows = c->rows[t]; standin_tiles[t].colsb = c->colsb[t]; }
}
static void standin_load(int t, const void *from, int64_t stride) {
    for (int r = 0; r < standin_tiles[t].rows; r++) memcpy(standin_tiles[t].data[r], (const uint8_t *)from + r * stride, standin_tiles[t].colsb);
}
static void standin_store(int t, void *to, int64_t stride) {
    for (int r = 0; r < standin_tiles[t].rows; r++) memcpy((uint8_t *)to + r * stride, standin_tiles[t].data[r], standin_tiles[t].colsb);
}
static void standin_zero(int t) { memset(standin_tiles[t].data, 0, sizeof standin_tiles[t].data); }
/* tdpbssd / tdpbsud: C[m][n] += sum over k of A[m][4k + e] (signed) x B[k][4n + e] (signed or unsigned), in int32 */
static void standin_dp(int c, int a, int b, int b_signed) {
    tile_t *C = &standin_tiles[c];
    const tile_t *A = &standin_tiles[a], *B = &standin_tiles[b];
    for (int m = 0; m < C->rows; m++) {
        for (int n = 0; n < C->colsb / 4; n++) {
            uint32_t sum;
            memcpy(&sum, C->data[m] + 4 * n, 4);
            for (int k = 0; k < A->colsb / 4; k++)
                for (int e = 0; e < 4; e++) {
                    const int32_t w = b_signed ? (int8_t)B->data[k][4 * n + e] : B->data[k][4 * n + e];
                    sum += (uint32_t)((int8_t)A->data[m][4 * k + e] * w);
                }
            memcpy(C->data[m] + 4 * n, &sum, 4);
        }
    }
}

/* A tile pass's integer and float work per row, rows 0 .. USED - 1 (block_product_lanes.h's formula)
   from each sub-block's D_b in SUMS: the exact total (4 bits: D_b already zero-pointed; 8 bits: the
   zero point's share taken off), converted and scaled once into ACC. In plain C for the stand-in, in
   AVX-512 for amx: the same integers. */
static inline void rows_c(float acc[][LANES], int32_t sums[][TILE_ROWS][LANES], const int16_t *pairs, const float *units,
                          const int16_t *qs, int64_t qs_row, const float *dx, int64_t dx_row, int used, int bits) {
    const int super = super_of(bits);
    for (int i = 0; i < used; i++) {
        for (int l = 0; l < LANES; l++) {
            uint32_t total = 0, fix = 0;
            for (int b = 0; b < super; b++) {
                const int32_t step = pairs[(b / 2) * 2 * LANES + 2 * l + (b & 1)];
                total += (uint32_t)sums[b][i][l] * (uint32_t)step;
                fix += (uint32_t)(step * qs[i * qs_row + b]);
            }
            const int32_t exact = (int32_t)(bits == 4 ? total : total - (fix << (bits - 1)));
            acc[i][l] = fmaf((float)exact, units[l] * dx[i * dx_row], acc[i][l]);
        }
    }
}

#define TILES_NAME amx_standin
#define TILES_TARGET "avx2,fma"
#define TILE_CONFIG(c) standin_config(c)
#define TILE_RELEASE() ((void)0)
#define TILE_LOAD(t, from, stride) standin_load(t, from, stride)
#define TILE_STORE(t, to, stride) standin_store(t, to, stride)
#define TILE_ZERO(t) standin_zero(t)
#define TILE_DP_SIGNED(c, a, b) standin_dp(c, a, b, 1)
#define TILE_DP_UNSIGNED(c, a, b) standin_dp(c, a, b, 0)
#define TILES_ROWS rows_c
#include "block_product_tiles.h"

#ifdef SPEEDC_AMX

/* rows_c in AVX-512: 4 bits pairs D_b, D_b+1 (int16 each) into one vpdpwssd with their steps */
INLINE_AVX512 void rows_avx512(float acc[][LANES], int32_t sums[][TILE_ROWS][LANES], const int16_t *pairs, const float *units,
                               const int16_t *qs, int64_t qs_row, const float *dx, int64_t dx_row, int used, int bits) {
    const __m512 unit = _mm512_loadu_ps(units);
    for (int i = 0; i < used; i++) {
        __m512i exact = _mm512_setzero_si512();
        if (bits == 4) {
            for (int b = 0; b < SUPER_MAX; b += 2) {
                const __m512i two = _mm512_mask_mov_epi16(_mm512_load_si512(sums[b][i]), 0xAAAAAAAA,
                                                          _mm512_slli_epi32(_mm512_load_si512(sums[b + 1][i]), 16));
                exact = _mm512_dpwssd_epi32(exact, two, _mm512_loadu_si512(pairs + b * LANES));
            }
        } else {
            int32_t two;
            memcpy(&two, qs + i * qs_row, sizeof two);
            const __m512i fix = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(pairs), _mm512_set1_epi32(two));
            exact = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(sums[0][i]), lanes_step(pairs, 0)),
                                     _mm512_mullo_epi32(_mm512_load_si512(sums[1][i]), lanes_step(pairs, 1)));
            exact = _mm512_sub_epi32(exact, _mm512_slli_epi32(fix, 7));
        }
        const __m512 scale = _mm512_mul_ps(unit, _mm512_set1_ps(dx[i * dx_row]));
        _mm512_store_ps(acc[i], _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, _mm512_load_ps(acc[i])));
    }
}

#define TILES_NAME amx
#define TILES_TARGET AVX512_TARGET ",amx-tile,amx-int8"
#define TILE_CONFIG(c) _tile_loadconfig(c)
#define TILE_RELEASE() _tile_release()
#define TILE_LOAD(t, from, stride) _tile_loadd(t, from, stride)
#define TILE_STORE(t, to, stride) _tile_stored(t, to, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP_SIGNED(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_DP_UNSIGNED(c, a, b) _tile_dpbsud(c, a, b)
#define TILES_ROWS rows_avx512
#include "block_product_tiles.h"
#endif
