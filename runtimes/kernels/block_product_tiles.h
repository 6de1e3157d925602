/* The lanes16 layout's tile path, included by block_product_lanes.h once per tile implementation with:
     TILES_NAME     the path's name (amx, amx_standin): defines groups_NAME
     TILES_TARGET   its target attributes
     TILE_CONFIG, TILE_RELEASE, TILE_LOAD, TILE_STORE, TILE_ZERO, TILE_DP_SIGNED, TILE_DP_UNSIGNED   AMX's
                    ldtilecfg, tilerelease, tileloadd, tilestored, tilezero, tdpbssd and tdpbsud, the real
                    instructions or a stand-in
     TILES_ROWS     rows_* (block_product_lanes.h) for its target
   Groups G0 .. G1 - 1 of 16 features for all rows, up to 16 rows a tile: per superblock, 4 sub-blocks
   at a time, each sub-block's D_b [rows, 16] = A (its activations, [rows, 32] int8) . B (its codes,
   8 x 64 bytes) in tiles 0-3; then per row the exact total of block_product_lanes.h in int32, scaled
   once. 4-bit codes are unpacked as code - zp (signed), so their D_b are the zero-pointed sums, within
   int16 (32 x 127 x 8); 8-bit codes are tile-loaded as packed (unsigned) and take the zero point's
   share off as the vpdpbusd path does. The integers are exact, so the rows in a tile and the tile's height change no bit. */

#define TILES_CAT2(a, b) a##b
#define TILES_CAT(a, b) TILES_CAT2(a, b)

static __attribute__((target(TILES_TARGET))) void TILES_CAT(groups_, TILES_NAME)(const product_t *p, int64_t g0, int64_t g1) {
    const int bits = p->bits, super = super_of(bits), chunk = lanes_chunk(bits);
    const int64_t width = p->supers * super * SUB;
    const int rows = p->m < TILE_ROWS ? (int)p->m : TILE_ROWS;  /* the activation buffer holds whole tiles of rows */
    tile_config_t config;
    tile_config(&config, rows);
    TILE_CONFIG(&config);
    int8_t unpacked[SUPER_MAX][B_TILE_BYTES] __attribute__((aligned(64)));  /* 4-bit codes as B tiles, code - zp */
    int32_t sums[SUPER_MAX][TILE_ROWS][LANES] __attribute__((aligned(64)));  /* D_b per sub-block */
    float acc[TILE_ROWS][LANES] __attribute__((aligned(64)));
    for (int64_t g = g0; g < g1; g++) {
        const int features = p->n - g * LANES < LANES ? (int)(p->n - g * LANES) : LANES;
        for (int64_t r0 = 0; r0 < p->m; r0 += rows) {
            const int8_t *q = (const int8_t *)p->q + r0 * width;
            const int used = p->m - r0 < rows ? (int)(p->m - r0) : rows;
            memset(acc, 0, sizeof acc);
            for (int64_t s = 0; s < p->supers; s++) {
                const uint8_t *codes = p->codes + (g * p->supers + s) * super * chunk;
                const void *b_tiles = codes;  /* 8 bits: the packed codes are the B tiles */
                if (bits == 4) {  /* the whole superblock unpacked first: a tile load waits for the stores it reads */
                    for (int h = 0; h < 4 * SUPER_MAX; h++) {
                        _mm_prefetch((const char *)codes + PREFETCH_AHEAD * super * chunk + 64 * h, _MM_HINT_T0);
                        for (int t = 0; t < 64; t++) {
                            unpacked[h / 4][128 * (h % 4) + t] = (int8_t)((codes[64 * h + t] & 15) - 8);
                            unpacked[h / 4][128 * (h % 4) + 64 + t] = (int8_t)((codes[64 * h + t] >> 4) - 8);
                        }
                    }
                    b_tiles = unpacked[0];
                } else {
                    for (int t = 0; t < super * chunk; t += 64) _mm_prefetch((const char *)codes + PREFETCH_AHEAD * super * chunk + t, _MM_HINT_T0);
                }
                for (int j0 = 0; j0 < super; j0 += 4) {
                    const int count = super - j0 < 4 ? super - j0 : 4;
                    /* sub-block j0 + J: A in tile 4 or 5, B in 6 or 7, D_b in tile J (4 bits: s8 x s8, 8 bits: s8 x u8) */
#define SUBBLOCK(J, A, B)                                                                                     \
                    if (J < count) {                                                                       \
                        TILE_LOAD(A, q + (s * super + j0 + J) * SUB, width);                                 \
                        TILE_LOAD(B, (const uint8_t *)b_tiles + (j0 + J) * B_TILE_BYTES, 64);                \
                        TILE_ZERO(J);                                                                      \
                        if (bits == 4) TILE_DP_SIGNED(J, A, B); else TILE_DP_UNSIGNED(J, A, B);              \
                    }
                    SUBBLOCK(0, 4, 6) SUBBLOCK(1, 5, 7) SUBBLOCK(2, 4, 6) SUBBLOCK(3, 5, 7)  /* literal tiles: the intrinsics name them */
#undef SUBBLOCK
                    TILE_STORE(0, sums[j0], LANES * 4);  /* after all 4 products: each store waits for its tile */
                    TILE_STORE(1, sums[j0 + 1], LANES * 4);
                    if (count > 2) { TILE_STORE(2, sums[j0 + 2], LANES * 4); TILE_STORE(3, sums[j0 + 3], LANES * 4); }
                }
                TILES_ROWS(acc, sums, p->steps + (g * p->supers + s) * super * LANES, p->units + (g * p->supers + s) * LANES,
                           p->qs + r0 * p->supers * super + s * super, p->supers * super, p->dx + r0 * p->supers + s, p->supers,
                           used, bits);
            }
            for (int i = 0; i < used; i++) memcpy(p->y + (r0 + i) * p->n + g * LANES, acc[i], features * sizeof(float));
        }
    }
    TILE_RELEASE();
}

#undef TILES_NAME
#undef TILES_TARGET
#undef TILE_CONFIG
#undef TILE_RELEASE
#undef TILE_LOAD
#undef TILE_STORE
#undef TILE_ZERO
#undef TILE_DP_SIGNED
#undef TILE_DP_UNSIGNED
#undef TILES_ROWS
