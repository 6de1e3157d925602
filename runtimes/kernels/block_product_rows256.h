/* The 256-bit x86 paths' body, included by block_product_x86.h once per instruction set with:
     ROWS_NAME     the path's name (avx2, avx_vnni, vnni_standin): defines feature_rows_NAME, features_NAME
     ROWS_TARGET   its target attributes
     ROWS_VNNI     0: AVX2's maddubs / madd;  1: int8 dot products DPBUSD (u8 x s8, 4 a lane, summed in int32)
                   and DPWSSD (s16 x s16, 2 a lane, summed in int32), the real instructions or exact stand-ins
   Rows R0 .. R0 + ROWS - 1 of feature N (ROWS a constant after inlining): each row's lanes see the same
   operations in the same order whatever ROWS is. */

#define ROWS_CAT2(a, b) a##b
#define ROWS_CAT(a, b) ROWS_CAT2(a, b)
#define ROWS_INLINE static inline __attribute__((always_inline, target(ROWS_TARGET)))

ROWS_INLINE void ROWS_CAT(feature_rows_, ROWS_NAME)(const product_t *p, int64_t n, int64_t r0, const int rows, const int bits) {
    const int super = super_of(bits);
    const uint8_t *q[4];
    const float *dx[4];
    row_pointers(p, r0, rows, q, dx, 4);
    const int16_t *steps = p->steps + n * p->supers * super;
    const float *units = p->units + n * p->supers;
    const int32_t *offsets = p->offsets + n * p->supers;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    uint8_t tail[SUPER_MAX * SUB];
    const __m256i nibble = _mm256_set1_epi8(15), zp4 = _mm256_set1_epi8(8), flip = _mm256_set1_epi8((char)0x80);
#if ROWS_VNNI
    /* steps j .. j + 3 (adjacent int16) as packs_epi32(pair j, pair j + 2) lays their sums out:
       [j x 4, j + 2 x 4 | j + 1 x 4, j + 3 x 4] */
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 4, 5, 4, 5, 4, 5, 4, 5,
                                            2, 3, 2, 3, 2, 3, 2, 3, 6, 7, 6, 7, 6, 7, 6, 7);
#else
    /* steps j, j + 1 (adjacent int16) as [j x 8 | j + 1 x 8] */
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
#endif
    for (int64_t s = 0; s < p->supers; s++) {
        const uint8_t *codes = superblock_codes(p, n, s, bits, tail);
        const int16_t *step = steps + s * super;
        const int64_t at = s * super * SUB;  /* the superblock's first activation byte in a row */
        /* each row's lanes start at minus the offset q + 128 adds (lane 0) */
        const __m256i start = _mm256_zextsi128_si256(_mm_cvtsi32_si128(bits == 4 ? -offsets[s] : 0));
        const __m256 unit = _mm256_set1_ps(units[s]);
        __m256i lanes[4] = {start, start, start, start};
        if (bits == 4) {
#if ROWS_VNNI
            /* 4 sub-blocks: their codes as two pairs [j even | j + 1 even], [j odd | j + 1 odd] (signed
               code - zp), each pair's products summed per sub-block in 4 int32 lanes (8 products of at most
               255 x 8: int16 range), packed to int16 and scaled by the 4 steps in one DPWSSD */
            for (int j = 0; j < super; j += 4) {
                const __m256i c0 = _mm256_loadu_si256((const __m256i *)(codes + j * 16));
                const __m256i c1 = _mm256_loadu_si256((const __m256i *)(codes + (j + 2) * 16));
                const __m256i low0 = _mm256_sub_epi8(_mm256_and_si256(c0, nibble), zp4);
                const __m256i high0 = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(c0, 4), nibble), zp4);
                const __m256i low1 = _mm256_sub_epi8(_mm256_and_si256(c1, nibble), zp4);
                const __m256i high1 = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(c1, 4), nibble), zp4);
                int64_t four;  /* steps j .. j + 3 */
                memcpy(&four, step + j, sizeof four);
                const __m256i quad_steps = _mm256_shuffle_epi8(_mm256_set1_epi64x(four), spread);
                const int64_t a = at + j * SUB;
#pragma GCC unroll 4
                for (int i = 0; i < rows; i++) {
                    const __m256i *x = (const __m256i *)(q[i] + a);
                    const __m256i d0 = DPBUSD(DPBUSD(_mm256_setzero_si256(), _mm256_loadu_si256(x), low0), _mm256_loadu_si256(x + 1), high0);
                    const __m256i d1 = DPBUSD(DPBUSD(_mm256_setzero_si256(), _mm256_loadu_si256(x + 2), low1), _mm256_loadu_si256(x + 3), high1);
                    lanes[i] = DPWSSD(lanes[i], _mm256_packs_epi32(d0, d1), quad_steps);
                }
            }
#else
            for (int j = 0; j < super; j += 2) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(codes + j * 16));
                const __m256i low = _mm256_sub_epi8(_mm256_and_si256(packed, nibble), zp4);
                const __m256i high = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), zp4);
                int32_t two;  /* steps j and j + 1 */
                memcpy(&two, step + j, sizeof two);
                const __m256i pair_steps = _mm256_shuffle_epi8(_mm256_set1_epi32(two), spread);
#pragma GCC unroll 4
                for (int i = 0; i < rows; i++) lanes[i] = pair4_dot(lanes[i], low, high, pair_steps, q[i] + at + j * SUB);
            }
#endif
        } else {
            for (int j = 0; j < super; j++) {
                const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + j * SUB)), flip);
                const __m256i magnitude = _mm256_abs_epi8(w), one_step = _mm256_set1_epi16(step[j]);
#pragma GCC unroll 4
                for (int i = 0; i < rows; i++) {
                    const __m256i signed_q = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q[i] + at + j * SUB)), w);
#if ROWS_VNNI
                    lanes[i] = DPWSSD(lanes[i], _mm256_maddubs_epi16(magnitude, signed_q), one_step);
#else
                    lanes[i] = _mm256_add_epi32(lanes[i], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), one_step));
#endif
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < rows; i++) {
            const __m256 scale = _mm256_mul_ps(unit, _mm256_set1_ps(dx[i][s]));  /* unit x dx, as one float product */
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[i]), scale, acc[i]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < rows; i++) p->y[(r0 + i) * p->n + n] = sum_lanes(acc[i]);
}

static __attribute__((target(ROWS_TARGET))) void ROWS_CAT(features_, ROWS_NAME)(const product_t *p, int64_t n0, int64_t n1) {
    const int64_t row_bytes = p->blocks * (p->block_size * p->bits / 8);
    for (int64_t n = n0; n < n1; n++) {
        if (n + FEATURE_PREFETCH < n1) {  /* the codes of the feature FEATURE_PREFETCH ahead, while this one computes */
            const char *ahead = (const char *)sub_block_codes(p, n + FEATURE_PREFETCH, 0);
            for (int64_t t = 0; t < row_bytes; t += 64) _mm_prefetch(ahead + t, _MM_HINT_T0);
        }
        for (int64_t r = 0; r < p->m; r += 4) {
            const int bits = p->bits;
            switch (p->m - r < 4 ? p->m - r : 4) {  /* each case its own unrolled copy */
                case 4: if (bits == 4) ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 4, 4); else ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 4, 8); break;
                case 3: if (bits == 4) ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 3, 4); else ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 3, 8); break;
                case 2: if (bits == 4) ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 2, 4); else ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 2, 8); break;
                default: if (bits == 4) ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 1, 4); else ROWS_CAT(feature_rows_, ROWS_NAME)(p, n, r, 1, 8); break;
            }
        }
    }
}

#undef ROWS_INLINE
#undef ROWS_CAT
#undef ROWS_CAT2
#undef ROWS_NAME
#undef ROWS_TARGET
#undef ROWS_VNNI
#undef DPBUSD
#undef DPWSSD
