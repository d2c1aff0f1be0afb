/* winograd.c — Winograd F(2x2, 3x3) convolution on the CPU (see winograd.h).
 *
 * The transforms (Lavin and Gray, "Fast Algorithms for Convolutional Neural
 * Networks", 2015), for a 4x4 input tile d, a 3x3 filter g, a 2x2 output y:
 *
 *   B^T = | 1  0 -1  0 |    G = | 1    0    0   |    A^T = | 1  1  1  0 |
 *         | 0  1  1  0 |        | 1/2  1/2  1/2 |          | 0  1 -1 -1 |
 *         | 0 -1  1  0 |        | 1/2 -1/2  1/2 |
 *         | 0  1  0 -1 |        | 0    0    1   |
 *
 *   y = A^T [ (G g G^T) . (B^T d B) ] A   (cross-correlation, as conv2d computes)
 *
 * Layout: U (16, cout, cin) the transformed filter (dw: dU (16, O, C)); V
 * (16, cin, cols) the transformed tiles of one sample or a chunk of samples
 * (column = sample * tiles + tile row * tile columns + tile column), M (16,
 * cout, cols) = the 16 products U_xi . V_xi (dw: W (16, O, cols) the
 * transformed blocks of dy); per thread, without AVX-512, a zero-bordered
 * input plane (input_plane_bordered: narrow planes and dw) or input_plane's 4
 * rows (wide). The products go through dp_gemm (small_gemm.h).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_caches.h"
#include "gemm_kernel.h" /* dp_lanes_upto (and immintrin.h) */
#include "small_gemm.h"
#include "winograd.h"

/* On or off when DPCORE_WINOGRAD is unset: the whole ResNet-18 training step's
 * A/B (benchmarks/bench_winograd.py, benchmarks/RESULTS.md) decides. */
#define DP_WINOGRAD_DEFAULT 1
/* Fewer channels than this keep the GEMM path: at 32 channels in and out
 * (batch 32, 28x28 to 7x7 planes) Winograd measured no faster than the GEMM
 * path (the transforms' memory traffic eats the saved multiplies); at 64, 1.4x
 * to 1.6x faster. */
#define DP_WINOGRAD_MIN_CHANNELS 64
/* Layers of at least this many (O, C) pairs keep their forward pass's filter
 * transform for dx (dp_winograd_worth_keeping): ResNet-18's 256- and
 * 512-channel stages (60 MB for its six such layers), whose dx transformed a
 * 4 or 16 MB U again. */
#define DP_WINOGRAD_KEEP_PAIRS (256 * 256)
/* Planes of fewer outputs than this are narrow: a chunk of samples per GEMM
 * (backend_cpu.c's CONV_NARROW rule). */
#define WINO_NARROW 64
/* Narrow planes and dw: V and M (or W) of a chunk of samples at most this many
 * floats (8 MiB; at least one sample). With dpcore's own GEMM kernel
 * (small_gemm.h) 8 MiB measured 4-6% faster than 32 MiB on the backward pass
 * of each ResNet-18 stage (batch 32, 2 threads): dw's transposed packing
 * reads V back sooner. A build may set it (CFLAGS=-DWINO_CHUNK_FLOATS=...). */
#ifndef WINO_CHUNK_FLOATS
#define WINO_CHUNK_FLOATS ((int64_t)1 << 21)
#endif
/* The 16 matrices of U, V and M lie WINO_SKEW floats (64 bytes) further apart
 * than their sizes: at a power-of-two distance (64 or 512 channels, 128 tile
 * columns) the transforms' 16 streams fell in the same cache sets (that, with the
 * planes taken sample-major, made the input transform of 256 channels at 7x7
 * take 4.6 times as long). */
#define WINO_SKEW 16
/* With AVX-512 a thread's wide planes are taken a block of tiles at a time
 * (a multiple of 32: the GEMMs on whole panels of the kernel), V and M of a
 * block at most this many floats (or 32 tiles'): a core's L2 (measured faster
 * than half of it and than whole samples on a 1 MiB L2). */
#ifndef WIDE_BLOCK_FLOATS
#define WIDE_BLOCK_FLOATS (dp_cpu_l2_bytes() / (int64_t)sizeof(float)) /* a core's L2 */
#endif
/* dw of wide planes: the batch in up to DW_GROUPS groups of consecutive
 * samples (dw_groups), each group's partial dU summed by one thread,
 * a few samples at a time (at least DW_WIDE_COLS tile columns a GEMM), the
 * partials then added in group order: the same bits whatever the thread
 * count, and each thread transforms only its own samples (dealing the 16
 * GEMMs out instead made every thread read every plane: 2 threads ran dw
 * 1.58x as fast as 1 at 64x28x28, batch 64; grouped, see the A/B in
 * benchmarks/RESULTS.md). */
#define DW_GROUPS 8
#define DW_WIDE_COLS 128
/* A block's tiles lie in at most block / tw + 2 runs of a tile row; the
 * block is kept small enough for this many */
#define WIDE_BLOCK_MAX_RUNS 160
/* Without AVX-512, planes at least this wide take the row-at-a-time
 * (vectorized) transforms: input_plane (reading the source in place) in the
 * wide forward and dx passes, output_plane's output_row; narrower planes, and
 * dw's input transform, the tile-at-a-time ones (measured faster there: 14x14
 * and smaller, and dw's chunked V). */
#define WINO_ROW_MIN 16
/* With AVX-512 the tiles' transforms run in registers, a tile row at a time:
 * input_plane_bordered's (the source read in place) on every plane (the
 * ResNet-18 step, batch 32, measured 204 -> 193 ms against input_plane's rows
 * on the wide ones), and they may write a subset of the 16 entries, so that
 * on narrow planes and in dw each thread transforms its own GEMMs' entries;
 * planes of at most 16 tiles a group of planes at a time (plane_lanes). */
#if defined(__AVX512F__)
#define TILES_AVX512 1
#else
#define TILES_AVX512 0
#endif
/* The wide planes in blocks of tiles (p->block), read and written in place
 * by input_segment and output_segment: with AVX-512, and with AVX2 on planes
 * of fewer than AVX2_SAMPLE_TILES tiles (ResNet-18's 14x14 stage, batch 64:
 * each layer's forward 8.9 -> 7.9 ms, its backward 17.0 -> 16.0; a sample's
 * 49 tiles filled 49 of the GEMM's 64 columns). With AVX2 the 28x28 planes
 * keep a sample at a time and input_plane's row transforms (blocks measured
 * 0.1-0.3 ms slower a forward pass there, 0.4 ms a backward). */
#if defined(__AVX512F__) || defined(__AVX2__)
#define WIDE_BLOCKS 1
#else
#define WIDE_BLOCKS 0
#endif
#define AVX2_SAMPLE_TILES 128
/* Without AVX-512, with AVX2: narrow planes with the samples in lanes (8
 * planes of one channel, consecutive samples, one a lane; the doc above
 * group_transform) */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SAMPLE_LANES 1
#else
#define SAMPLE_LANES 0
#endif
#define SL 8 /* sample lanes: samples a vector */
/* narrow planes have at most this many tiles (h w < 64: 1x63's 32) */
#define NARROW_MAX_TILES 32
/* The scalar tile loops below write 16 streams a stride apart (never
 * overlapping within a row of tiles, nor the rows they read): GCC 12
 * vectorizes them only when told there is no dependence between iterations
 * (without it: "no vectype", or alias checks past its limit). */
#if defined(__GNUC__) && !defined(__clang__)
#define DP_IVDEP _Pragma("GCC ivdep")
#else
#define DP_IVDEP
#endif

dp_status dp_winograd_takes(const dp_conv_geom *g, int *takes) {
  *takes = 0;
  int on;
  DP_TRY(dp_env_switch("DPCORE_WINOGRAD", DP_WINOGRAD_DEFAULT, &on));
  *takes = on && g->KH == 3 && g->KW == 3 && g->stride == 1 && g->pad == 1 && g->C >= DP_WINOGRAD_MIN_CHANNELS &&
           g->O >= DP_WINOGRAD_MIN_CHANNELS;
  return DP_OK;
}

/* One convolution as computed here: input (cin, h, w) -> output (cout, h, w)
 * (3x3, stride 1, pad 1 keep the plane's size).
 *
 * Wide planes (h*w >= WINO_NARROW): thread t of nt takes the samples
 * [N*t/nt, N*(t+1)/nt) with V and M of its own: one sample at a time, or with
 * AVX-512 a block of p->block tiles at a time whatever samples it spans (a
 * GEMM column's sum does not depend on the columns beside it: a sample's bits
 * do not depend on the rest of the batch either way).
 * Narrow planes: the threads together take the batch in chunks of at most
 * `chunk` samples, all of a chunk's tiles side by side in each GEMM, the 16
 * GEMMs dealt to the threads (each U_xi packed once, not once per thread, and
 * 128 columns on ResNet-18's 4x4 stage at batch 32 instead of 64); or, in
 * lanes with a small U (narrow_own), forward and dx, each thread its own
 * samples in chunks of chunk / nt. */
/* Small planes in lanes (with AVX-512; planes of at most 16 tiles, narrow):
 * a group of P planes, consecutive samples of one channel (adjacent columns
 * of V, W and M), is read into a 64-float window (plane p at p * h * w) and
 * each tile of the group is a lane of a register (lane p * tiles + tile):
 * the tiles' values are picked out of the window by permutations, so an
 * entry xi of the whole group is one vector, stored (or loaded) whole. A tile
 * row at a time (input_tiles_avx512) a 7x7 plane's entry took four stores of
 * 4 lanes, a 4x4 plane's two of 2. The tables, per plan:
 *   in    B^T d B's window position (a, b) of each lane's tile (2 ti - 1 + a,
 *         2 tj - 1 + b), index 4 a + b; dy A dY A^T's (2 ti + r, 2 tj + c),
 *         index 2 r + c (dy);
 *   out   window lane e's output (tile row y / 2 col x / 2 of plane p, its
 *         (r, c) = (y % 2, x % 2)) in the 64 floats of the four output
 *         vectors o_rc, at (2 r + c) * 16 + its tile's lane.
 * An index's bit 5 picks the window's (or outputs') upper 32 floats, a
 * position outside the plane is a zero lane (ok clear).
 * Odd planes' edge tiles: a tile of the last tile row of an odd-height plane
 * has one output row, y0 = m0 + m1 + m2 in A^T m A's rows (m_a: the entries
 * 4 a + b), so its entries 12-15 feed only its second output row, which is
 * outside the plane; likewise entries 3, 7, 11, 15 of the last tile column of
 * an odd width. Those products are not made: entry xi keeps only the tiles
 * that use it (keep[xi], kt[xi] of a plane's tiles), packed in tile order
 * (each column of V, W, M one kept tile), so its GEMM is kt/tiles as wide.
 * The outputs are the same bits (the kept products are the same; what is
 * skipped fed only outputs never stored) and in dw the skipped products are
 * of dy's zero entries (dy's row or column past the plane): 7x7's 16 tiles
 * keep 16, 12 or 9 of their tiles an entry, 225 products for 256. */
typedef struct plane_lanes {
  int P;                  /* planes a group; 0: these planes take the tile-row transforms */
  int32_t in[16][16], dy[4][16], out[4][16];
  uint16_t in_ok[16], dy_ok[4];
  uint16_t keep[16];      /* entry xi: the group's lanes (tiles) that keep it */
  int kt[16];             /* entry xi: the tiles of a plane that keep it (also with sample lanes, P 0) */
} plane_lanes;

typedef struct wino_plan {
  int cin, cout, h, w;
  int th, tw, hp, wp;  /* the tile grid; the zero-bordered plane's size (2*th+2, 2*tw+2) */
  int64_t tiles;       /* th*tw, one sample's */
  int narrow;
  int64_t chunk;       /* narrow, and dw: samples per chunk, at most */
  int nt;              /* threads */
  int64_t shared;      /* floats of a chunk's V and M (narrow) or V and W (dw), shared by the threads */
  int64_t own;         /* floats of one sample's V and M (wide), a thread's own; with blocks a block's */
  int64_t block;       /* wide, with blocks: tiles a block (a multiple of 32) */
  int blocks;          /* wide planes in blocks of tiles (WIDE_BLOCKS), else a sample at a time */
  int own_gemm;        /* the products on small_gemm.h's kernel (else the BLAS) */
  plane_lanes lanes;   /* narrow planes of at most 16 tiles, with AVX-512 */
  int sl;              /* narrow planes with the samples in lanes (SAMPLE_LANES) */
  int8_t kidx[16][NARROW_MAX_TILES]; /* sample lanes: tile's column block in entry xi (-1: not kept) */
  int64_t plane_floats; /* the zero-bordered plane (hp, wp) (without AVX-512), then wp zeros (dw's zrow);
                           sample lanes: their three buffers (group_transform's doc) */
  int64_t per_thread;  /* floats a thread has alone: V and M (wide), the plane (input_plane's 4 rows, or
                          input_plane_bordered's zero-bordered plane), then wp zeros (dw's dy_plane); a
                          multiple of 16 (64 bytes) */
} wino_plan;

/* The edge tiles' kept entries (plane_lanes's doc): lanes.kt, and each kept
 * tile's place among its entry's in tile order, kidx (sample lanes) */
static void edge_keep_make(wino_plan *p) {
  int *kt = p->lanes.kt;
  for (int xi = 0; xi < 16; ++xi) {
    kt[xi] = 0;
    for (int tile = 0; tile < p->tiles && tile < NARROW_MAX_TILES; ++tile) {
      const int ti = tile / p->tw, tj = tile % p->tw;
      const int kept = !((xi / 4 == 3 && p->h % 2 && ti == p->th - 1) || (xi % 4 == 3 && p->w % 2 && tj == p->tw - 1));
      p->kidx[xi][tile] = (int8_t)(kept ? kt[xi] : -1);
      kt[xi] += kept;
    }
  }
}

static void plane_lanes_make(wino_plan *p) {
  plane_lanes *L = &p->lanes;
  memset(L, 0, sizeof *L);
  const int hw = p->h * p->w, T = (int)p->tiles;
  if (!TILES_AVX512 || !p->narrow || p->sl || T > 16) return;
  L->P = 16 / T < 64 / hw ? 16 / T : 64 / hw;
  for (int pl = 0; pl < L->P; ++pl)
    for (int ti = 0; ti < p->th; ++ti)
      for (int tj = 0; tj < p->tw; ++tj) {
        const int lane = pl * T + ti * p->tw + tj;
        for (int ab = 0; ab < 16; ++ab) {
          const int y = 2 * ti - 1 + ab / 4, x = 2 * tj - 1 + ab % 4;
          if (y >= 0 && y < p->h && x >= 0 && x < p->w) {
            L->in[ab][lane] = pl * hw + y * p->w + x;
            L->in_ok[ab] |= (uint16_t)(1u << lane);
          }
        }
        for (int rc = 0; rc < 4; ++rc) {
          const int y = 2 * ti + rc / 2, x = 2 * tj + rc % 2;
          if (y < p->h && x < p->w) {
            L->dy[rc][lane] = pl * hw + y * p->w + x;
            L->dy_ok[rc] |= (uint16_t)(1u << lane);
          }
        }
      }
  for (int e = 0; e < L->P * hw; ++e) {
    const int pl = e / hw, y = e % hw / p->w, x = e % p->w;
    L->out[e / 16][e % 16] = (2 * (y % 2) + x % 2) * 16 + pl * T + y / 2 * p->tw + x / 2;
  }
  edge_keep_make(p);
  for (int xi = 0; xi < 16; ++xi)
    for (int tile = 0; tile < T; ++tile)
      if (p->kidx[xi][tile] >= 0)
        for (int pl = 0; pl < L->P; ++pl) L->keep[xi] |= (uint16_t)(1u << (pl * T + tile));
}

/* the tiles of a sample that entry xi of a narrow plan keeps (plane_lanes) */
static int64_t kept_tiles(const wino_plan *p, int xi) { return p->lanes.P || p->sl ? p->lanes.kt[xi] : p->tiles; }

/* Planes in lanes whose groups fill every lane and keep every entry (an
 * entry of a group: one whole cache line of V, W or M, 16 floats at a
 * multiple of 16): their transforms go a sample group at a time through the
 * channels, each sample's planes read front to back, where a channel at a
 * time read a 64-byte plane per sample 32 KB apart (ResNet-18's 4x4 stage at
 * batch 64: each layer's forward 0.15-0.2 ms faster, its backward 0.3-0.5
 * ms). A group that keeps fewer lanes of an entry (odd planes' edges) writes
 * part of a line, which the channel-major order completes with the next
 * group at once (7x7 measured 0.1-0.3 ms slower a pass the other way); the
 * output transforms stay channel-major (sample-major measured slower). */
#if TILES_AVX512
static int lanes_sample_major(const wino_plan *p) {
  if (!p->lanes.P || p->lanes.P * p->tiles != 16) return 0;
  for (int xi = 0; xi < 16; ++xi)
    if (p->lanes.kt[xi] != p->tiles) return 0;
  return 1;
}
#endif

static wino_plan wino_plan_make(int cin, int cout, int h, int w, int64_t N, int nthreads) {
  wino_plan p;
  p.cin = cin;
  p.cout = cout;
  p.h = h;
  p.w = w;
  p.th = (h + 1) / 2;
  p.tw = (w + 1) / 2;
  p.hp = 2 * p.th + 2;
  p.wp = 2 * p.tw + 2;
  p.tiles = (int64_t)p.th * p.tw;
  p.nt = nthreads < 1 ? 1 : nthreads;
  p.narrow = (int64_t)h * w < WINO_NARROW;
  const int64_t per_sample = 16 * ((int64_t)cin + cout) * p.tiles; /* V and M, without the skews */
  p.chunk = WINO_CHUNK_FLOATS / per_sample;
  if (p.chunk < 1) p.chunk = 1;
  if (p.chunk > N) p.chunk = N < 1 ? 1 : N;
  p.shared = p.chunk * per_sample + 32 * WINO_SKEW * (int64_t)p.nt; /* (the threads' own chunks: a skew each) */
  p.own = per_sample + 32 * WINO_SKEW;
  p.block = WIDE_BLOCK_FLOATS / (16 * ((int64_t)cin + cout)) / 32 * 32;
  if (p.block < 32) p.block = 32;
  if (p.block > (WIDE_BLOCK_MAX_RUNS - 2) * (int64_t)p.tw / 32 * 32)
    p.block = (WIDE_BLOCK_MAX_RUNS - 2) * (int64_t)p.tw / 32 * 32;
  p.blocks = TILES_AVX512 || (WIDE_BLOCKS && p.tiles < AVX2_SAMPLE_TILES);
  if (p.blocks) p.own = 16 * ((int64_t)cin + cout) * p.block + 32 * WINO_SKEW;
  p.plane_floats = (int64_t)p.hp * p.wp + p.wp;
  p.sl = SAMPLE_LANES && p.narrow;
  if (p.sl) /* the bordered input planes, dy's, and the outputs, SL lanes a position (group_transform) */
    p.plane_floats = SL * (2 * (int64_t)p.hp * p.wp + (int64_t)h * w);
  p.per_thread = ((p.narrow ? 0 : p.own) + p.plane_floats + 15) & ~(int64_t)15;
  p.own_gemm = 0;
  plane_lanes_make(&p);
  if (p.sl) edge_keep_make(&p); /* (after plane_lanes_make, which clears lanes) */
  return p;
}

/* dw of wide planes (DW_GROUPS): samples a GEMM, and a thread's floats (its
 * V and W of that many samples, the zero-bordered plane and zrow) */
static int64_t dw_wide_samples(const wino_plan *p) { return (DW_WIDE_COLS + p->tiles - 1) / p->tiles; }

static int64_t dw_wide_thread_floats(const wino_plan *p) {
  const int64_t cols = dw_wide_samples(p) * p->tiles;
  return 16 * ((int64_t)(p->cin + p->cout) * cols + 2 * WINO_SKEW) + ((p->plane_floats + 15) & ~(int64_t)15);
}

/* groups of at least DW_WIDE_COLS tile columns, an even count where more
 * than one (two threads: equal shares), at most DW_GROUPS */
static int64_t dw_groups(const wino_plan *p, int64_t N) {
  int64_t G = N * p->tiles / DW_WIDE_COLS;
  if (G > DW_GROUPS) G = DW_GROUPS;
  if (G > N) G = N;
  if (G > 1) G &= ~(int64_t)1;
  return G < 1 ? 1 : G;
}

size_t dp_winograd_scratch_floats(const dp_conv_geom *g, int64_t N, int nthreads) {
  if (N <= 0) return 0;
  /* forward: C -> O; dx: O -> C; V + M hold 16*(C+O) floats a column either way */
  const wino_plan p = wino_plan_make(g->C, g->O, g->OH, g->OW, N, nthreads);
  /* dU, then the chunk's V and W and the threads' own floats, or (wide planes) the groups' partial dU and
   * the threads' floats; and dw's packing buffers for small_gemm.h's NT product, one a thread */
  const int64_t du = 16 * ((int64_t)g->C * g->O + WINO_SKEW);
  int64_t rest = p.shared + p.nt * p.per_thread;
  if (!p.narrow && rest < dw_groups(&p, N) * du + p.nt * dw_wide_thread_floats(&p))
    rest = dw_groups(&p, N) * du + p.nt * dw_wide_thread_floats(&p);
  return (size_t)(du + rest + p.nt * DP_SMALL_GEMM_PACK_FLOATS);
}

/* u (16) = G g G^T of the 3x3 filter g (row stride 3). */
static void filter_tile(const float g[9], float u[16]) {
  float t[4][3]; /* G g */
  for (int j = 0; j < 3; ++j) {
    t[0][j] = g[j];
    t[1][j] = 0.5f * (g[j] + g[3 + j] + g[6 + j]);
    t[2][j] = 0.5f * (g[j] - g[3 + j] + g[6 + j]);
    t[3][j] = g[6 + j];
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = t[i][0];
    u[4 * i + 1] = 0.5f * (t[i][0] + t[i][1] + t[i][2]);
    u[4 * i + 2] = 0.5f * (t[i][0] - t[i][1] + t[i][2]);
    u[4 * i + 3] = t[i][2];
  }
}

/* U (16, O, C), matrix xi at U + xi * ustride, from w (O, C, 3, 3) (dx reads
 * it transposed: wino_gemm). Written in U's order, a block of FILTER_BLOCK
 * entries of each of the 16 matrices at a time (one entry of each at a time
 * wrote 16 far-apart streams a float each). Called by every thread of a
 * parallel region (a worksharing loop). */
#define FILTER_BLOCK 64

static void filter_transform(const float *w, int O, int C, float *U, int64_t ustride) {
  const int64_t pairs = (int64_t)O * C, blocks = (pairs + FILTER_BLOCK - 1) / FILTER_BLOCK;
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t d0 = blk * FILTER_BLOCK, len = pairs - d0 < FILTER_BLOCK ? pairs - d0 : FILTER_BLOCK;
    float u[16][FILTER_BLOCK];
    int64_t j = 0;
#if defined(__AVX512F__)
    /* 16 pairs at a time: the filters' 9 taps as 9 vectors (each filter's 9
     * floats a masked load, the 16 transposed in registers: stride-9 gathers
     * measured slower), filter_tile's arithmetic in its order */
    const __m512 half = _mm512_set1_ps(0.5f);
    for (; j < len; j += 16) {
      const __mmask16 m = dp_lanes_upto(len - j);
      const float *wj = w + (d0 + j) * 9;
      __m512 rows[16], g[16];
      for (int l = 0; l < 16; ++l) rows[l] = j + l < len ? _mm512_maskz_loadu_ps(0x1FF, wj + 9 * l) : _mm512_setzero_ps();
      dp_transpose16(rows, g);
      for (int i = 0; i < 4; ++i) { /* row i of G g (its 3 columns t), then . G^T */
        __m512 t[3];
        for (int c = 0; c < 3; ++c)
          t[c] = i == 0   ? g[c]
                 : i == 3 ? g[6 + c]
                 : _mm512_mul_ps(half, i == 1 ? _mm512_add_ps(_mm512_add_ps(g[c], g[3 + c]), g[6 + c])
                                              : _mm512_add_ps(_mm512_sub_ps(g[c], g[3 + c]), g[6 + c]));
        /* straight into U: 16 streams of whole vectors (lanes past len not stored) */
        float *ui = U + 4 * i * ustride + d0 + j;
        _mm512_mask_storeu_ps(ui, m, t[0]);
        _mm512_mask_storeu_ps(ui + ustride, m,
                              _mm512_mul_ps(half, _mm512_add_ps(_mm512_add_ps(t[0], t[1]), t[2])));
        _mm512_mask_storeu_ps(ui + 2 * ustride, m,
                              _mm512_mul_ps(half, _mm512_add_ps(_mm512_sub_ps(t[0], t[1]), t[2])));
        _mm512_mask_storeu_ps(ui + 3 * ustride, m, t[2]);
      }
    }
    continue;
#endif
    for (; j < len; ++j) {
      float t[16];
      filter_tile(w + (d0 + j) * 9, t);
      for (int xi = 0; xi < 16; ++xi) u[xi][j] = t[xi];
    }
    for (int xi = 0; xi < 16; ++xi) memcpy(U + xi * ustride + d0, u[xi], sizeof(float) * (size_t)len);
  }
}

#if !TILES_AVX512 /* the wide planes' row transforms, a sample at a time (with AVX-512: input_segment) */
/* B^T d's rows over a row of the plane: o0 = r0 - r2, o1 = r1 + r2, o2 = r2 - r1, o3 = r1 - r3 (vectorized). */
static void input_rows(const float *restrict r0, const float *restrict r1, const float *restrict r2,
                       const float *restrict r3, int w, float *restrict o0, float *restrict o1, float *restrict o2,
                       float *restrict o3) {
  for (int j = 0; j < w; ++j) {
    const float a = r0[j], b = r1[j], c = r2[j], d = r3[j];
    o0[j] = a - c;
    o1[j] = b + c;
    o2[j] = c - b;
    o3[j] = b - d;
  }
}

/* input_rows at the plane's top or bottom edge: a NULL row is zero. */
static void input_rows_edge(const float *r0, const float *r1, const float *r2, const float *r3, int w, float *o0,
                            float *o1, float *o2, float *o3) {
  for (int j = 0; j < w; ++j) {
    const float a = r0 ? r0[j] : 0.0f, b = r1[j], c = r2 ? r2[j] : 0.0f, d = r3 ? r3[j] : 0.0f;
    o0[j] = a - c;
    o1[j] = b + c;
    o2[j] = c - b;
    o3[j] = b - d;
  }
}

#if !defined(__AVX2__) /* (with AVX2: input_cols_avx2) */
/* B^T d B's columns over a tile row: t the row-combined row (column j of the plane at j + 1), tw tiles. */
static void input_cols(const float *restrict t, int tw, float *restrict v0, float *restrict v1, float *restrict v2,
                       float *restrict v3) {
  for (int tj = 0; tj < tw; ++tj) {
    const float a = t[2 * tj], b = t[2 * tj + 1], c = t[2 * tj + 2], d = t[2 * tj + 3];
    v0[tj] = a - c;
    v1[tj] = b + c;
    v2[tj] = c - b;
    v3[tj] = b - d;
  }
}
#endif

#if defined(__AVX2__)
/* columns s, s + 2, ..., s + 14 of a row from its 8 + 8 floats lo, hi (s = 0 even, 1 odd) */
static inline __m256 cols_of(__m256 lo, __m256 hi, int odd) {
  const __m256 t = odd ? _mm256_shuffle_ps(lo, hi, 0xDD) : _mm256_shuffle_ps(lo, hi, 0x88);
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), 0xD8));
}

/* input_cols for the tiles tj0 .. tj0 + min(n, 8) - 1 of a row-combined row t
 * of wp floats: input_cols's arithmetic (the same bits), 8 tiles a vector,
 * the columns picked by shuffles (GCC vectorized input_cols's stride-2 reads
 * with gathers, slow on AMD: a quarter of the 28x28 forward pass's time), the
 * loads masked to the row, the stores to the tiles */
static inline void input_cols_avx2(const float *t, int wp, int tj0, int n, float *v, int64_t vs) {
  const float *r = t + 2 * tj0;
  const int left = wp - 2 * tj0;
  const __m256 a = _mm256_maskload_ps(r, dp_lanes8_upto(left)), b = _mm256_maskload_ps(r + 8, dp_lanes8_upto(left - 8));
  const __m256 c = _mm256_maskload_ps(r + 2, dp_lanes8_upto(left - 2)),
               e = _mm256_maskload_ps(r + 10, dp_lanes8_upto(left - 10));
  const __m256 d0 = cols_of(a, b, 0), d1 = cols_of(a, b, 1), d2 = cols_of(c, e, 0), d3 = cols_of(c, e, 1);
  const __m256i sm = dp_lanes8_upto(n);
  float *o = v + tj0;
  _mm256_maskstore_ps(o, sm, _mm256_sub_ps(d0, d2));
  _mm256_maskstore_ps(o + vs, sm, _mm256_add_ps(d1, d2));
  _mm256_maskstore_ps(o + 2 * vs, sm, _mm256_sub_ps(d2, d1));
  _mm256_maskstore_ps(o + 3 * vs, sm, _mm256_sub_ps(d1, d3));
}
#endif

/* v[xi*vstride + tile] = (B^T d B)[xi] for every tile d of one (h, w) plane
 * src, read in place (the zero border handled at the edges, no copy): per
 * tile row, the rows combined (B^T d) over the whole width into buf's four
 * rows of wp floats (column j of the plane at j + 1, the border's columns
 * zero), then the columns combined per tile. buf: 4 * wp floats, a thread's. */
static void input_plane(const wino_plan *p, const float *src, float *buf, float *v, int64_t vstride) {
  const int h = p->h, w = p->w, wp = p->wp;
  float *t0 = buf, *t1 = t0 + wp, *t2 = t1 + wp, *t3 = t2 + wp;
  for (int k = 0; k < 4; ++k) { /* the border columns: 0, and w + 1 to wp - 1 */
    buf[k * wp] = 0.0f;
    for (int j = w + 1; j < wp; ++j) buf[k * wp + j] = 0.0f;
  }
  for (int ti = 0; ti < p->th; ++ti) {
    const int i0 = 2 * ti - 1; /* the tile's first row in the plane's coordinates */
    const float *r0 = i0 >= 0 ? src + (int64_t)i0 * w : NULL;
    const float *r1 = src + (int64_t)(i0 + 1) * w; /* i0 + 1 = 2 ti < h always */
    const float *r2 = i0 + 2 < h ? src + (int64_t)(i0 + 2) * w : NULL;
    const float *r3 = i0 + 3 < h ? src + (int64_t)(i0 + 3) * w : NULL;
    if (r0 && r2 && r3)
      input_rows(r0, r1, r2, r3, w, t0 + 1, t1 + 1, t2 + 1, t3 + 1);
    else /* an edge row: the missing rows zero (0 - x and x - 0 as the bordered plane computed them) */
      input_rows_edge(r0, r1, r2, r3, w, t0 + 1, t1 + 1, t2 + 1, t3 + 1);
    float *vt = v + (int64_t)ti * p->tw;
    const float *tr[4] = {t0, t1, t2, t3};
#if defined(__AVX2__)
    for (int i = 0; i < 4; ++i)
      for (int tj = 0; tj < p->tw; tj += 8) input_cols_avx2(tr[i], wp, tj, p->tw - tj, vt + 4 * i * vstride, vstride);
#else
    for (int i = 0; i < 4; ++i)
      input_cols(tr[i], p->tw, vt + (4 * i + 0) * vstride, vt + (4 * i + 1) * vstride, vt + (4 * i + 2) * vstride,
                 vt + (4 * i + 3) * vstride);
#endif
  }
}
#endif

#if defined(__AVX512F__)
/* Tile rows in AVX-512 registers: 16 lanes, one tile each; a tile's columns
 * 2k + s of a 32-float window (two registers lo, hi) gathered by one
 * permutation per s. The arithmetic is the scalar code's, in its order: the
 * same bits. */
static inline __m512 window_cols(__m512 lo, __m512 hi, int s) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  /* lane k: column 2k + s (indices wrap past 31: only lane 15's, never stored) */
  return _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(s)), hi);
}

static inline __m512 negated(__m512 x) { /* -x, the sign bit flipped (0 - x would turn -0 into +0) */
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000)));
}

/* entry xi of a tile row: v[xi*vs + k] for the tiles k in m, if xi is in
 * xmask (bit xi: the entries this call writes; dw's threads each write the
 * entries of their own GEMMs) */
static inline void put(unsigned xmask, int xi, float *v, int64_t vs, __mmask16 m, __m512 val) {
  if (xmask >> xi & 1u) _mm512_mask_storeu_ps(v + xi * vs, m, val);
}

/* p[off + l] for the lanes l of m, zero elsewhere; p + off formed only when
 * some lane is loaded (so never past the end of p's array) */
static inline __m512 load_lanes(__mmask16 m, const float *p, int64_t off) {
  return m ? _mm512_maskz_loadu_ps(m, p + off) : _mm512_setzero_ps();
}

static inline void store_lanes(__mmask16 m, float *p, int64_t off, __m512 v) {
  if (m) _mm512_mask_storeu_ps(p + off, m, v);
}

/* The 32-column window of a plane row from column col0 (-1 at the left
 * border): lanes outside the row [0, w), or of a border row (NULL), zero;
 * masked loads never touch them, and no pointer goes before the row. */
static inline void row_window(const float *row, int col0, int w, __m512 *x0, __m512 *x1) {
  if (!row) {
    *x0 = *x1 = _mm512_setzero_ps();
    return;
  }
  if (col0 < 0) { /* lane 0 the border, lane l >= 1 column l - 1: columns 0-31 shifted up a lane (an
                   * expanding load measured a quarter of this function's time) */
    const __m512i c0 = _mm512_castps_si512(load_lanes(dp_lanes_upto(w), row, 0));
    const __m512i c1 = _mm512_castps_si512(load_lanes(dp_lanes_upto(w - 16), row, 16));
    *x0 = _mm512_castsi512_ps(_mm512_alignr_epi32(c0, _mm512_setzero_si512(), 15));
    *x1 = _mm512_castsi512_ps(_mm512_alignr_epi32(c1, c0, 15));
  } else {
    *x0 = load_lanes(dp_lanes_upto(w - col0), row, col0);
    *x1 = load_lanes(dp_lanes_upto(w - col0 - 16), row, col0 + 16);
  }
}

/* Row i of B^T d B from row i of B^T d (t0..t3: its columns, a tile a lane):
 * its 4 entries, the scalar code's arithmetic */
static inline void input_row_values(__m512 t0, __m512 t1, __m512 t2, __m512 t3, __m512 e[4]) {
  e[0] = _mm512_sub_ps(t0, t2);
  e[1] = _mm512_add_ps(t1, t2);
  e[2] = _mm512_sub_ps(t2, t1);
  e[3] = _mm512_sub_ps(t1, t3);
}

/* those of the entries 4i..4i+3 in xmask, into v */
static inline void input_row_entries(unsigned xmask, int i, __m512 t0, __m512 t1, __m512 t2, __m512 t3, float *v,
                                     int64_t vs, __mmask16 m) {
  __m512 e[4];
  input_row_values(t0, t1, t2, t3, e);
  for (int k = 0; k < 4; ++k) put(xmask, 4 * i + k, v, vs, m, e[k]);
}

/* Row i (0: A^T's first, 1: its second) of A^T m A + bias, v[xi] entry xi a
 * tile a lane: the outputs of the tiles' columns 0 (even) and 1 (odd),
 * output_tile's arithmetic in its order */
static inline void output_row_lanes(const __m512 v[16], __m512 bv, int i, __m512 *even, __m512 *odd) {
  __m512 t[4]; /* A^T m's row i: t[0][k] = m0 + m1 + m2, t[1][k] = m1 - m2 - m3 (m_r = v[4r + k]) */
  for (int k = 0; k < 4; ++k)
    t[k] = i == 0 ? _mm512_add_ps(_mm512_add_ps(v[k], v[4 + k]), v[8 + k])
                  : _mm512_sub_ps(_mm512_sub_ps(v[4 + k], v[8 + k]), v[12 + k]);
  *even = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[1]), t[2]), bv);
  *odd = _mm512_add_ps(_mm512_sub_ps(_mm512_sub_ps(t[1], t[2]), t[3]), bv);
}

/* B^T d B of the n <= 15 tiles of a tile row read in place: rows[k] the
 * source row of the tile's row k (NULL past the plane's top or bottom), the
 * first tile's first column col0 = 2 tj0 - 1, the plane's width w */
static inline __attribute__((always_inline)) void input_tiles_avx512(const float *const rows[4], int col0, int w, int n, float *vt, int64_t vs,
                               unsigned xmask) {
  __m512 a0, a1, b0, b1, c0, c1, d0, d1; /* each row's window: columns 0-15 and 16-31 (tile k: 2k..2k+3) */
  row_window(rows[0], col0, w, &a0, &a1);
  row_window(rows[1], col0, w, &b0, &b1);
  row_window(rows[2], col0, w, &c0, &c1);
  row_window(rows[3], col0, w, &d0, &d1);
  const __mmask16 m = dp_lanes_upto(n);
  /* B^T d: the rows combined, as the scalar code's t[i][.] */
  const __m512 lo[4] = {_mm512_sub_ps(a0, c0), _mm512_add_ps(b0, c0), _mm512_sub_ps(c0, b0), _mm512_sub_ps(b0, d0)};
  const __m512 hi[4] = {_mm512_sub_ps(a1, c1), _mm512_add_ps(b1, c1), _mm512_sub_ps(c1, b1), _mm512_sub_ps(b1, d1)};
  for (int i = 0; i < 4; ++i) {
    if (!(xmask >> (4 * i) & 15u)) continue;
    input_row_entries(xmask, i, window_cols(lo[i], hi[i], 0), window_cols(lo[i], hi[i], 1),
                      window_cols(lo[i], hi[i], 2), window_cols(lo[i], hi[i], 3), vt, vs, m);
  }
}

/* A dY A^T's 16 entries of 2x2 blocks (a, b; c, d), a block a lane */
static inline void dy_values(__m512 a, __m512 b, __m512 c, __m512 d, __m512 e[16]) {
  /* A dY (4x2): rows (a, b), (a + c, b + d), (a - c, b - d), (-c, -d); then . A^T per row (dy_cols) */
  const __m512 t0[4] = {a, _mm512_add_ps(a, c), _mm512_sub_ps(a, c), negated(c)};
  const __m512 t1[4] = {b, _mm512_add_ps(b, d), _mm512_sub_ps(b, d), negated(d)};
  for (int i = 0; i < 4; ++i) {
    e[4 * i + 0] = t0[i];
    e[4 * i + 1] = _mm512_add_ps(t0[i], t1[i]);
    e[4 * i + 2] = _mm512_sub_ps(t0[i], t1[i]);
    e[4 * i + 3] = negated(t1[i]);
  }
}

/* A dY A^T's entries (those in xmask) of the lanes m of 2x2 blocks (a, b; c, d) */
static inline void dy_entries(__m512 a, __m512 b, __m512 c, __m512 d, __mmask16 m, float *wt, int64_t ws,
                              unsigned xmask) {
  __m512 e[16];
  dy_values(a, b, c, d, e);
  for (int xi = 0; xi < 16; ++xi) put(xmask, xi, wt, ws, m, e[xi]);
}

/* A dY A^T of the n <= 16 tiles of dy's rows r0, r1 (tile k: columns 2k,
 * 2k + 1; columns at or past `cols` read as zero), entry xi at wt[xi*ws + k] */
static void dy_tiles_avx512(const float *r0, const float *r1, int cols, int n, float *wt, int64_t ws,
                            unsigned xmask) {
  const __mmask16 m = dp_lanes_upto(n), l0 = dp_lanes_upto(cols), l1 = dp_lanes_upto(cols - 16);
  const __m512 x0 = load_lanes(l0, r0, 0), x1 = load_lanes(l1, r0, 16);
  const __m512 y0 = load_lanes(l0, r1, 0), y1 = load_lanes(l1, r1, 16);
  const __m512 a = window_cols(x0, x1, 0), b = window_cols(x0, x1, 1), c = window_cols(y0, y1, 0),
               d = window_cols(y0, y1, 1);
  dy_entries(a, b, c, d, m, wt, ws, xmask);
}

/* A group's window (plane_lanes): its pc planes, plane q at src + q * pstride
 * (hw floats), at q * hw of R's 64 floats, zero past them. */
static inline void lanes_window(int hw, const float *src, int64_t pstride, int pc, __m512 R[4]) {
  if (pc == 1) {
    for (int q = 0; q < 4; ++q) R[q] = load_lanes(dp_lanes_upto(hw - 16 * q), src, 16 * q);
  } else if (hw == 16) {
    for (int q = 0; q < 4; ++q) R[q] = q < pc ? _mm512_loadu_ps(src + q * pstride) : _mm512_setzero_ps();
  } else {
    _Alignas(64) float buf[64] = {0};
    for (int q = 0; q < pc; ++q) memcpy(buf + q * hw, src + q * pstride, sizeof(float) * (size_t)hw);
    for (int q = 0; q < 4; ++q) R[q] = _mm512_load_ps(buf + 16 * q);
  }
}

/* lanes_window's inverse: the window W's planes into pc planes at dst + q * pstride */
static inline void lanes_store(int hw, float *dst, int64_t pstride, int pc, const __m512 W[4]) {
  if (pc == 1) {
    for (int q = 0; q < 4; ++q) store_lanes(dp_lanes_upto(hw - 16 * q), dst, 16 * q, W[q]);
  } else if (hw == 16) {
    for (int q = 0; q < pc; ++q) _mm512_storeu_ps(dst + q * pstride, W[q]);
  } else {
    _Alignas(64) float buf[64];
    for (int q = 0; q < 4; ++q) _mm512_store_ps(buf + 16 * q, W[q]);
    for (int q = 0; q < pc; ++q) memcpy(dst + q * pstride, buf + q * hw, sizeof(float) * (size_t)hw);
  }
}

/* lane l: the float idx[l] of the 64 in R (bit 5: R[2], R[3]), zero outside ok */
static inline __m512 lanes_pick(const __m512 R[4], const int32_t idx[16], __mmask16 ok) {
  const __m512i i = _mm512_loadu_si512(idx);
  const __mmask16 up = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32));
  const __m512 lo = _mm512_permutex2var_ps(R[0], i, R[1]), hi = _mm512_permutex2var_ps(R[2], i, R[3]);
  return _mm512_maskz_mov_ps(ok, _mm512_mask_blend_ps(up, lo, hi));
}

/* Entry xi (if in xmask) of a group's lanes m, the group's column idx (its
 * channel's row times the chunk's samples, plus its first sample) of V (W):
 * the lanes that keep the entry, packed, at v + xi vs + idx kt[xi] */
static inline void lanes_put(const plane_lanes *L, unsigned xmask, int xi, float *v, int64_t vs, int64_t idx,
                             __mmask16 m, __m512 val) {
  if (!(xmask >> xi & 1u)) return;
  const __mmask16 k = m & L->keep[xi];
  /* the compress's register form (its store form is microcoded on some cores); an entry every lane
   * keeps: the identity, m a prefix */
  _mm512_mask_storeu_ps(v + xi * vs + idx * L->kt[xi], dp_lanes_upto(__builtin_popcount(k)),
                        _mm512_maskz_compress_ps(k, val));
}

/* B^T d B of a group's tiles (lanes m) from its window R, into V at the
 * group's column idx (lanes_put): input_tiles_avx512's arithmetic in its
 * order (the same bits) */
static void input_group_lanes(const plane_lanes *L, const __m512 R[4], __mmask16 m, float *v, int64_t vs,
                              int64_t idx, unsigned xmask) {
  static const unsigned rows_of[4] = {5u, 6u, 6u, 10u}; /* the rows of d each row i of B^T d reads */
  unsigned need = 0;
  for (int i = 0; i < 4; ++i)
    if (xmask >> (4 * i) & 15u) need |= rows_of[i];
  __m512 d[4][4];
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 4; ++b)
      d[a][b] = need >> a & 1u ? lanes_pick(R, L->in[4 * a + b], L->in_ok[4 * a + b]) : _mm512_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    if (!(xmask >> (4 * i) & 15u)) continue;
    __m512 t[4];
    for (int k = 0; k < 4; ++k)
      t[k] = i == 0   ? _mm512_sub_ps(d[0][k], d[2][k])
             : i == 1 ? _mm512_add_ps(d[1][k], d[2][k])
             : i == 2 ? _mm512_sub_ps(d[2][k], d[1][k])
                      : _mm512_sub_ps(d[1][k], d[3][k]);
    __m512 e[4];
    input_row_values(t[0], t[1], t[2], t[3], e);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) lanes_put(L, xmask, 4 * i + k, v, vs, idx, m, e[k]);
  }
}

/* A dY A^T of a group's tiles into W at the group's column idx (lanes_put):
 * dy_tiles_avx512's arithmetic in its order */
static void dy_group_lanes(const plane_lanes *L, const __m512 R[4], __mmask16 m, float *wt, int64_t ws, int64_t idx,
                           unsigned xmask) {
  const __m512 a = lanes_pick(R, L->dy[0], L->dy_ok[0]), b = lanes_pick(R, L->dy[1], L->dy_ok[1]),
               c = lanes_pick(R, L->dy[2], L->dy_ok[2]), d = lanes_pick(R, L->dy[3], L->dy_ok[3]);
  __m512 e[16];
  dy_values(a, b, c, d, e);
#pragma GCC unroll 16
  for (int xi = 0; xi < 16; ++xi) lanes_put(L, xmask, xi, wt, ws, idx, m, e[xi]);
}

/* A^T m A + bias of a group's tiles (lanes lm; entry xi at m + xi ms + idx
 * kt[xi], packed as lanes_put left it, a skipped entry zero) as its output
 * window W: output_tiles_avx512's arithmetic in its order */
static void output_group_lanes(const plane_lanes *L, const float *m, int64_t ms, int64_t idx, __mmask16 lm,
                               float bias, __m512 W[4]) {
  __m512 v[16], o[4]; /* o[2 r + c]: output (r, c) of each lane's tile */
#pragma GCC unroll 16
  for (int xi = 0; xi < 16; ++xi) { /* an entry every lane keeps: its expand is the identity */
    const __mmask16 k = lm & L->keep[xi];
    v[xi] = _mm512_maskz_expand_ps(k, _mm512_maskz_loadu_ps(dp_lanes_upto(__builtin_popcount(k)),
                                                            m + xi * ms + idx * L->kt[xi]));
  }
  const __m512 bv = _mm512_set1_ps(bias);
  for (int i = 0; i < 2; ++i) output_row_lanes(v, bv, i, &o[2 * i], &o[2 * i + 1]);
  for (int q = 0; q < 4; ++q) {
    const __m512i i = _mm512_loadu_si512(L->out[q]);
    const __mmask16 up = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32));
    W[q] = _mm512_mask_blend_ps(up, _mm512_permutex2var_ps(o[0], i, o[1]), _mm512_permutex2var_ps(o[2], i, o[3]));
  }
}
#endif

#define ALL_ENTRIES 0xFFFFu

#if defined(__AVX512F__)
/* The tiles tj0 <= tj < tj1 of tile row ti of the plane src into v (tile tj at
 * v + tj - tj0), read in place: the border's lanes masked, no copy */
static void input_segment(const wino_plan *p, const float *src, int ti, int tj0, int tj1, float *v, int64_t vstride,
                          unsigned xmask) {
  const float *rows[4];
  for (int k = 0; k < 4; ++k) {
    const int i = 2 * ti - 1 + k;
    rows[k] = i >= 0 && i < p->h ? src + (int64_t)i * p->w : NULL;
  }
  for (int tj = tj0; tj < tj1; tj += 15)
    input_tiles_avx512(rows, 2 * tj - 1, p->w, tj1 - tj < 15 ? tj1 - tj : 15, v + tj - tj0, vstride, xmask);
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* 8 floats of a row from column col0, the columns outside [0, w) (and a NULL
 * row) zero, nothing read there (the address is an integer's: col0 may lie
 * before the row, or far past it with every lane masked) */
static inline __m256 row8(const float *row, int col0, int w) {
  if (!row) return _mm256_setzero_ps();
  const __m256i k = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(col0));
  const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_setzero_si256(), k),
                                         _mm256_cmpgt_epi32(_mm256_set1_epi32(w), k));
  return _mm256_maskload_ps((const float *)(uintptr_t)((uintptr_t)row + (uintptr_t)((intptr_t)col0 * 4)), in);
}

/* The tiles (B^T d B) of min(n, 8) consecutive tiles of a tile row, the
 * first tile's first column col0 of the rows r[0..3] (w floats each, a NULL
 * row zero; columns outside [0, w) zero): input_plane_bordered's scalar
 * arithmetic per tile in its order (the same bits), 8 tiles a vector, the
 * stores masked to the tiles. The rows of the zero-bordered plane (col0 = 2
 * tj, w = wp) or of the plane itself, read in place (col0 = 2 tj - 1). */
static inline void input_tiles_avx2(const float *const r[4], int col0, int w, int n, float *o, int64_t vs) {
  __m256 d[4][4]; /* d[row][s]: column s of each of the 8 tiles */
  const int inside = col0 >= 0 && col0 + 18 <= w; /* no column outside: plain loads */
  for (int k = 0; k < 4; ++k) {
    __m256 a, b, c, e;
    if (inside && r[k]) {
      a = _mm256_loadu_ps(r[k] + col0), b = _mm256_loadu_ps(r[k] + col0 + 8);
      c = _mm256_loadu_ps(r[k] + col0 + 2), e = _mm256_loadu_ps(r[k] + col0 + 10);
    } else {
      a = row8(r[k], col0, w), b = row8(r[k], col0 + 8, w);
      c = row8(r[k], col0 + 2, w), e = row8(r[k], col0 + 10, w);
    }
    d[k][0] = cols_of(a, b, 0);
    d[k][1] = cols_of(a, b, 1);
    d[k][2] = cols_of(c, e, 0);
    d[k][3] = cols_of(c, e, 1);
  }
  const __m256i sm = dp_lanes8_upto(n);
  for (int i = 0; i < 4; ++i) {
    __m256 t[4];
    for (int k = 0; k < 4; ++k)
      t[k] = i == 0   ? _mm256_sub_ps(d[0][k], d[2][k])
             : i == 1 ? _mm256_add_ps(d[1][k], d[2][k])
             : i == 2 ? _mm256_sub_ps(d[2][k], d[1][k])
                      : _mm256_sub_ps(d[1][k], d[3][k]);
    _mm256_maskstore_ps(o + (4 * i + 0) * vs, sm, _mm256_sub_ps(t[0], t[2]));
    _mm256_maskstore_ps(o + (4 * i + 1) * vs, sm, _mm256_add_ps(t[1], t[2]));
    _mm256_maskstore_ps(o + (4 * i + 2) * vs, sm, _mm256_sub_ps(t[2], t[1]));
    _mm256_maskstore_ps(o + (4 * i + 3) * vs, sm, _mm256_sub_ps(t[1], t[3]));
  }
}

/* input_segment (below) without AVX-512: 8 tiles at a time, read in place */
static void input_segment(const wino_plan *p, const float *src, int ti, int tj0, int tj1, float *v, int64_t vstride,
                          unsigned xmask) {
  (void)xmask; /* every entry */
  const float *rows[4];
  for (int k = 0; k < 4; ++k) {
    const int i = 2 * ti - 1 + k;
    rows[k] = i >= 0 && i < p->h ? src + (int64_t)i * p->w : NULL;
  }
  for (int tj = tj0; tj < tj1; tj += 8) input_tiles_avx2(rows, 2 * tj - 1, p->w, tj1 - tj, v + tj - tj0, vstride);
}
#endif

/* v[xi*vstride + tile] = (B^T d B)[xi] for every tile d of one (h, w) plane
 * src: with AVX-512 read in place (every plane) and only the entries xi in
 * xmask written; else copied into plane (hp, wp), its border zero (only the
 * interior is written), all 16 entries written: narrow planes and dw, where
 * it measured faster than input_plane. */
static void input_plane_bordered(const wino_plan *p, const float *src, float *plane, float *v, int64_t vstride,
                                 unsigned xmask) {
#if defined(__AVX512F__)
  (void)plane;
  for (int ti = 0; ti < p->th; ++ti) input_segment(p, src, ti, 0, p->tw, v + (int64_t)ti * p->tw, vstride, xmask);
  return;
#else
  (void)xmask;
#endif
  for (int i = 0; i < p->h; ++i)
    memcpy(plane + (int64_t)(i + 1) * p->wp + 1, src + (int64_t)i * p->w, sizeof(float) * (size_t)p->w);
  for (int ti = 0; ti < p->th; ++ti) {
    const float *r0 = plane + (int64_t)2 * ti * p->wp, *r1 = r0 + p->wp, *r2 = r1 + p->wp, *r3 = r2 + p->wp;
    float *vt = v + (int64_t)ti * p->tw;
    int tj = 0;
#if defined(__AVX2__) && !defined(__AVX512F__) /* 8 tiles a vector */
    const float *rows[4] = {r0, r1, r2, r3};
    for (; tj < p->tw; tj += 8) input_tiles_avx2(rows, 2 * tj, p->wp, p->tw - tj, vt + tj, vstride);
#endif
    DP_IVDEP
    for (; tj < p->tw; ++tj) {
      const int j = 2 * tj;
      float t[4][4]; /* B^T d: the rows combined */
      for (int k = 0; k < 4; ++k) {
        t[0][k] = r0[j + k] - r2[j + k];
        t[1][k] = r1[j + k] + r2[j + k];
        t[2][k] = r2[j + k] - r1[j + k];
        t[3][k] = r1[j + k] - r3[j + k];
      }
      for (int i = 0; i < 4; ++i) {
        vt[(4 * i + 0) * vstride + tj] = t[i][0] - t[i][2];
        vt[(4 * i + 1) * vstride + tj] = t[i][1] + t[i][2];
        vt[(4 * i + 2) * vstride + tj] = t[i][2] - t[i][1];
        vt[(4 * i + 3) * vstride + tj] = t[i][1] - t[i][3];
      }
    }
  }
}

/* One (h, w) output plane y = A^T m A + bias for its tiles, m[xi*mstride +
 * tile]; outputs past the plane's edge dropped. A tile row at a time, the
 * tiles of the row in the inner loop (the 16 streams of m read contiguously,
 * vectorized); the last tile column apart when w is odd. */
static inline void output_tile(const float *mt, int64_t mstride, float bias, float out[2][2]) {
  float t[2][4]; /* A^T m: the rows combined */
  for (int k = 0; k < 4; ++k) {
    const float m0 = mt[k * mstride], m1 = mt[(4 + k) * mstride], m2 = mt[(8 + k) * mstride],
                m3 = mt[(12 + k) * mstride];
    t[0][k] = m0 + m1 + m2;
    t[1][k] = m1 - m2 - m3;
  }
  for (int i = 0; i < 2; ++i) {
    out[i][0] = (t[i][0] + t[i][1] + t[i][2]) + bias;
    out[i][1] = (t[i][1] - t[i][2] - t[i][3]) + bias;
  }
}

#if !defined(__AVX2__) || defined(__AVX512F__) /* (with AVX2 alone: output_tiles_avx2) */
/* Two full output rows of n tile columns each (2n outputs a row): output_tile's
 * arithmetic over the tile row, in a form the compiler vectorizes. */
static void output_row(const float *restrict m, int64_t ms, int n, float bias, float *restrict y0,
                       float *restrict y1) {
  for (int tj = 0; tj < n; ++tj) {
    const float *mt = m + tj;
    const float a0 = mt[0] + mt[4 * ms] + mt[8 * ms], a1 = mt[ms] + mt[5 * ms] + mt[9 * ms],
                a2 = mt[2 * ms] + mt[6 * ms] + mt[10 * ms], a3 = mt[3 * ms] + mt[7 * ms] + mt[11 * ms];
    const float b0 = mt[4 * ms] - mt[8 * ms] - mt[12 * ms], b1 = mt[5 * ms] - mt[9 * ms] - mt[13 * ms],
                b2 = mt[6 * ms] - mt[10 * ms] - mt[14 * ms], b3 = mt[7 * ms] - mt[11 * ms] - mt[15 * ms];
    y0[2 * tj] = (a0 + a1 + a2) + bias;
    y0[2 * tj + 1] = (a1 - a2 - a3) + bias;
    y1[2 * tj] = (b0 + b1 + b2) + bias;
    y1[2 * tj + 1] = (b1 - b2 - b3) + bias;
  }
}
#endif

#if defined(__AVX512F__)
/* The outputs of the n <= 16 tiles of a tile row (m: tile k's entry xi at
 * m[xi*ms + k]) into rows y0 and y1 (y1 NULL past the plane's bottom), cols
 * outputs of each stored: output_tile's arithmetic in its order, 16 tiles at
 * a time, the even and odd columns interleaved by two permutations. */
static inline __attribute__((always_inline)) void output_tiles_avx512(const float *m, int64_t ms, int n, int cols, float bias, float *y0, float *y1) {
  const __mmask16 lm = dp_lanes_upto(n);
  __m512 v[16];
  for (int xi = 0; xi < 16; ++xi) v[xi] = _mm512_maskz_loadu_ps(lm, m + xi * ms);
  const __m512 bv = _mm512_set1_ps(bias);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __mmask16 s0 = dp_lanes_upto(cols), s1 = dp_lanes_upto(cols - 16);
  for (int i = 0; i < 2; ++i) {
    float *y = i == 0 ? y0 : y1;
    if (!y) break;
    __m512 even, odd;
    output_row_lanes(v, bv, i, &even, &odd);
    store_lanes(s0, y, 0, _mm512_permutex2var_ps(even, lo, odd));
    store_lanes(s1, y, 16, _mm512_permutex2var_ps(even, hi, odd));
  }
}
#endif

#if defined(__AVX512F__)
/* The outputs of the tiles tj0 <= tj < tj1 of tile row ti of the plane y (tile tj's entries at m + tj - tj0) */
static void output_segment(const wino_plan *p, const float *m, int64_t mstride, float bias, float *y, int ti, int tj0,
                           int tj1) {
  const int w = p->w;
  float *y0 = y + (int64_t)2 * ti * w, *y1 = 2 * ti + 1 < p->h ? y0 + w : NULL;
  for (int tj = tj0; tj < tj1; tj += 16) {
    const int n = tj1 - tj < 16 ? tj1 - tj : 16, cols = w - 2 * tj < 2 * n ? w - 2 * tj : 2 * n;
    output_tiles_avx512(m + tj - tj0, mstride, n, cols, bias, y0 + 2 * tj, y1 ? y1 + 2 * tj : NULL);
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* output_tile for the min(n, 8) tiles of a tile row (tile k's entry xi at
 * m[xi*ms + k]) into rows y0 and y1 (NULL: past the plane's bottom), cols
 * outputs of each row stored: output_tile's arithmetic in its order (the
 * same bits), the even and odd columns interleaved in registers */
static inline void output_tiles_avx2(const float *m, int64_t ms, int n, int cols, float bias, float *y0, float *y1) {
  const __m256i lm = dp_lanes8_upto(n), s0 = dp_lanes8_upto(cols), s1 = dp_lanes8_upto(cols - 8);
  __m256 v[16];
  for (int xi = 0; xi < 16; ++xi) v[xi] = _mm256_maskload_ps(m + xi * ms, lm);
  const __m256 bv = _mm256_set1_ps(bias);
  for (int i = 0; i < 2; ++i) {
    float *y = i == 0 ? y0 : y1;
    if (!y) break;
    __m256 t[4];
    for (int k = 0; k < 4; ++k)
      t[k] = i == 0 ? _mm256_add_ps(_mm256_add_ps(v[k], v[4 + k]), v[8 + k])
                    : _mm256_sub_ps(_mm256_sub_ps(v[4 + k], v[8 + k]), v[12 + k]);
    const __m256 even = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t[0], t[1]), t[2]), bv);
    const __m256 odd = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(t[1], t[2]), t[3]), bv);
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_maskstore_ps(y, s0, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_maskstore_ps(y + 8, s1, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* output_segment (above) without AVX-512: 8 tiles at a time */
static void output_segment(const wino_plan *p, const float *m, int64_t mstride, float bias, float *y, int ti, int tj0,
                           int tj1) {
  const int w = p->w;
  float *y0 = y + (int64_t)2 * ti * w, *y1 = 2 * ti + 1 < p->h ? y0 + w : NULL;
  for (int tj = tj0; tj < tj1; tj += 8)
    output_tiles_avx2(m + tj - tj0, mstride, tj1 - tj, w - 2 * tj, bias, y0 + 2 * tj, y1 ? y1 + 2 * tj : NULL);
}
#endif

static void output_plane(const wino_plan *p, const float *m, int64_t mstride, float bias, float *y) {
  const int w = p->w, full = w / 2; /* tile columns with both outputs inside */
#if defined(__AVX512F__)
  for (int ti = 0; ti < p->th; ++ti) output_segment(p, m + (int64_t)ti * p->tw, mstride, bias, y, ti, 0, p->tw);
  (void)full;
  return;
#endif
#if defined(__AVX2__) && !defined(__AVX512F__) /* 8 tiles a vector, every width (output_row's remainder \
                                                   ran scalar: 6 of a 28x28 plane's 14 tiles a row) */
  {
    for (int ti = 0; ti < p->th; ++ti) {
      float *y0 = y + (int64_t)2 * ti * w, *y1 = 2 * ti + 1 < p->h ? y0 + w : NULL;
      for (int tj = 0; tj < p->tw; tj += 8)
        output_tiles_avx2(m + (int64_t)ti * p->tw + tj, mstride, p->tw - tj, w - 2 * tj, bias, y0 + 2 * tj,
                          y1 ? y1 + 2 * tj : NULL);
    }
    (void)full;
    return;
  }
#else
  if (w < WINO_ROW_MIN) { /* short rows: a tile at a time (the row loops measured slower) */
    for (int ti = 0; ti < p->th; ++ti)
      for (int tj = 0; tj < p->tw; ++tj) {
        float o[2][2];
        output_tile(m + (int64_t)ti * p->tw + tj, mstride, bias, o);
        const int i0 = 2 * ti, j0 = 2 * tj;
        for (int i = 0; i < 2 && i0 + i < p->h; ++i) {
          float *row = y + (int64_t)(i0 + i) * w + j0;
          row[0] = o[i][0];
          if (j0 + 1 < w) row[1] = o[i][1];
        }
      }
    return;
  }
  for (int ti = 0; ti < p->th; ++ti) {
    const int i0 = 2 * ti;
    const float *mr = m + (int64_t)ti * p->tw;
    float *y0 = y + (int64_t)i0 * w;
    if (i0 + 1 < p->h) {
      float *y1 = y0 + w;
      output_row(mr, mstride, full, bias, y0, y1);
      if (full < p->tw) {
        float o[2][2];
        output_tile(mr + full, mstride, bias, o);
        y0[2 * full] = o[0][0];
        y1[2 * full] = o[1][0];
      }
    } else {
      for (int tj = 0; tj < p->tw; ++tj) {
        float o[2][2];
        output_tile(mr + tj, mstride, bias, o);
        y0[2 * tj] = o[0][0];
        if (2 * tj + 1 < w) y0[2 * tj + 1] = o[0][1];
      }
    }
  }
#endif
}

/* M_xi (cout, cols) = U_xi (cout, cin) . V_xi (cin, cols); the matrices xi
 * at U + xi*(cout*cin + WINO_SKEW), V + xi*vstride, M + xi*mstride.
 *
 * dx (flip): the filter of (c, o) is w[o, c] rotated by 180 degrees, and G
 * with its input's rows reversed is G with rows 0 and 3 swapped (G R = P G),
 * so its transform is P (G g G^T) P^T: U_dx[4a + b] (C, O) = the forward
 * transform's U[4 pi(a) + pi(b)] (O, C) transposed, pi swapping 0 and 3. U
 * holds the forward transform and the GEMM reads it transposed: the filter
 * is read in its own order (the rotated, transposed read gathered a cache
 * line per float: 9 MiB of them at 512 channels). */
static int flipped_xi(int xi) {
  static const int pi[4] = {3, 1, 2, 0};
  return 4 * pi[xi / 4] + pi[xi % 4];
}

static void wino_gemm(const wino_plan *p, int flip, int xi, const float *U, const float *V, int64_t vstride, float *M,
                      int64_t mstride, int64_t cols) {
  const float *u = U + (flip ? flipped_xi(xi) : xi) * ((int64_t)p->cout * p->cin + WINO_SKEW);
  dp_gemm(p->own_gemm, flip, 0, p->cout, cols, p->cin, u, flip ? p->cout : p->cin, V + xi * vstride, cols,
          M + xi * mstride, cols, 0, NULL);
}

/* Thread t of nt's GEMMs: the entries [*lo, *hi) (16 t / nt to 16 (t+1) / nt);
 * returns them as a mask (bit xi). */
static unsigned entries_of(int t, int nt, int *lo, int *hi) {
  *lo = 16 * t / nt;
  *hi = 16 * (t + 1) / nt;
  return ((1u << *hi) - 1u) & ~((1u << *lo) - 1u);
}

#if TILES_AVX512
/* Narrow planes in lanes whose filter transform is at most NARROW_OWN_U
 * floats (8 MiB: ResNet-18's 7x7 stage, 4 MiB), forward and dx: each thread
 * its own samples, in chunks of chunk / nt, its transforms (every entry), the
 * 16 products and the outputs, no barrier. Every thread then reads all of U
 * for each of its chunks, but only the samples its own core's passes before
 * wrote: where the threads shared a chunk (each its entries), each read the
 * other core's half of every plane, and the entries' uneven columns (odd
 * planes' edges) left one waiting at the barrier. ResNet-18 at batch 64:
 * each 7x7 layer's forward 5.5 -> 4.9-5.1 ms, its dx 0.5 ms less; at 4x4
 * (16 MiB of U read again for every chunk) 5.6 -> 6.4 ms, so it keeps the
 * shared chunks. The same bits either way (a GEMM column's sums do not depend
 * on the columns beside it). */
#define NARROW_OWN_U ((int64_t)1 << 21)
static int narrow_own(const wino_plan *p) {
  return p->lanes.P && p->nt > 1 && p->chunk >= p->nt && 16 * (int64_t)p->cin * p->cout <= NARROW_OWN_U;
}
#endif

/* Thread t's entries of a narrow plan (bit xi): entries_of's, or where the
 * entries keep different numbers of tiles (odd planes' edges) consecutive
 * entries again, each thread's last where the columns so far come nearest to
 * its share (7x7 on 2 threads: 108 and 117 tiles' columns, where entries_of's
 * halves took 120 and 105; the widest first to the thread with the fewest
 * columns, 113 and 112, measured no faster: each thread then made every row
 * of B^T d, where consecutive entries take three of the four). Which thread
 * makes an entry changes no bits. */
static unsigned narrow_entries(const wino_plan *p, int t) {
  int lo, hi, uniform = 1;
  for (int xi = 1; xi < 16; ++xi) uniform &= kept_tiles(p, xi) == kept_tiles(p, 0);
  if (uniform || p->nt >= 16) return entries_of(t, p->nt, &lo, &hi); /* 16 threads and more: one entry each */
  int64_t cum[17] = {0}; /* cum[k]: the columns of the entries before k */
  for (int xi = 0; xi < 16; ++xi) cum[xi + 1] = cum[xi] + kept_tiles(p, xi);
  int first[2]; /* threads t's and t + 1's first entries */
  for (int e = 0; e < 2; ++e) {
    const int64_t share = cum[16] * (t + e); /* the share's end, times nt */
    int k = 0;
    while (k < 16 && cum[k + 1] * p->nt <= share) ++k; /* cum[k] <= share / nt < cum[k + 1] */
    if (k < 16 && cum[k + 1] * p->nt - share < share - cum[k] * p->nt) ++k;
    first[e] = k;
  }
  return ((1u << first[1]) - 1u) & ~((1u << first[0]) - 1u);
}

#if SAMPLE_LANES
/* Narrow planes with the samples in lanes (AVX2 without AVX-512): a group of
 * up to SL = 8 planes, one channel of consecutive samples, is transposed
 * into SL lanes a plane position (8x8 register transposes), so that
 * every tile's transform is the scalar code's arithmetic, in its order, on
 * whole vectors (the same bits as the tile-at-a-time forms; with AVX2 those
 * took 43 cycles a tile of a 7x7 plane, a quarter of a row of 8 lanes used).
 * Entry xi's columns in a chunk of cnt samples: kept tile k's samples side by
 * side, column k cnt + s, so that a group's entry is one store, and odd
 * planes' edge tiles skip the entries they do not use (plane_lanes's doc;
 * 7x7: 225 products for 256). The buffers, a thread's (plane_floats): the
 * input planes zero-bordered (hp, wp, SL: position (i, j) at (i + 1, j +
 * 1)), dy's (hp, wp, SL: zero past the plane), the outputs (h, w, SL).
 * With AVX-512 the same in 16 lanes measured no faster than plane_lanes
 * (ResNet-18's 7x7 and 4x4 layers within +-5% either way over two runs). */
/* -x: the sign flipped (0 - x would turn -0 into +0) */
static inline __m256 negated8(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

/* pc <= SL planes of hw floats, plane l at src + l * stride, into buf:
 * position e's lanes at buf + SL (e / w * bw + e % w + off) (past pc zero) */
static void lanes_in(const float *src, int64_t stride, int pc, int hw, int w, int bw, int off, float *buf) {
  for (int e0 = 0; e0 < hw; e0 += SL) {
    const __m256i m = dp_lanes8_upto(hw - e0);
    __m256 r[SL];
    for (int l = 0; l < SL; ++l) r[l] = l < pc ? _mm256_maskload_ps(src + l * stride + e0, m) : _mm256_setzero_ps();
    dp_transpose8(r);
    for (int j = 0; j < SL && e0 + j < hw; ++j) {
      const int e = e0 + j;
      _mm256_storeu_ps(buf + SL * (e / w * bw + e % w + off), r[j]);
    }
  }
}

/* lanes_in's inverse for the outputs: buf (hw, SL) into the pc planes at dst + l * stride */
static void lanes_out(const float *buf, int pc, int hw, float *dst, int64_t stride) {
  for (int e0 = 0; e0 < hw; e0 += SL) {
    const __m256i m = dp_lanes8_upto(hw - e0);
    __m256 r[SL];
    for (int j = 0; j < SL; ++j) r[j] = e0 + j < hw ? _mm256_loadu_ps(buf + SL * (e0 + j)) : _mm256_setzero_ps();
    dp_transpose8(r);
    for (int l = 0; l < pc; ++l) _mm256_maskstore_ps(dst + l * stride + e0, m, r[l]);
  }
}

/* The transforms of group (c, s) (pc planes from sample s of the chunk, plane
 * l at src + l * stride) into T's entries (stride ts; entry xi's columns cnt
 * kt[xi] a row): B^T d B of the input (dy = 0) or A dY A^T of dy. */
static void group_transform(const wino_plan *p, int dy, const float *src, int64_t stride, int pc, int64_t c,
                            int64_t s, int64_t cnt, float *buf, float *T, int64_t ts) {
  const int hw = p->h * p->w, wp = p->wp;
  float *b = dy ? buf + SL * (int64_t)p->hp * wp : buf;
  lanes_in(src, stride, pc, hw, p->w, wp, dy ? 0 : wp + 1, b);
  const __m256i m = dp_lanes8_upto(pc);
  for (int ti = 0; ti < p->th; ++ti)
    for (int tj = 0; tj < p->tw; ++tj) {
      const int tile = ti * p->tw + tj;
      __m256 e[16];
      if (dy) {
        const float *q = b + SL * (2 * ti * wp + 2 * tj);
        const __m256 a = _mm256_loadu_ps(q), bb = _mm256_loadu_ps(q + SL), cc = _mm256_loadu_ps(q + SL * wp), d = _mm256_loadu_ps(q + SL * wp + SL);
        const __m256 t0[4] = {a, _mm256_add_ps(a, cc), _mm256_sub_ps(a, cc), negated8(cc)};
        const __m256 t1[4] = {bb, _mm256_add_ps(bb, d), _mm256_sub_ps(bb, d), negated8(d)};
        for (int i = 0; i < 4; ++i) {
          e[4 * i + 0] = t0[i];
          e[4 * i + 1] = _mm256_add_ps(t0[i], t1[i]);
          e[4 * i + 2] = _mm256_sub_ps(t0[i], t1[i]);
          e[4 * i + 3] = negated8(t1[i]);
        }
      } else {
        __m256 d[4][4], t[4][4];
        for (int a = 0; a < 4; ++a)
          for (int k = 0; k < 4; ++k) d[a][k] = _mm256_loadu_ps(b + SL * ((2 * ti + a) * wp + 2 * tj + k));
        for (int k = 0; k < 4; ++k) {
          t[0][k] = _mm256_sub_ps(d[0][k], d[2][k]);
          t[1][k] = _mm256_add_ps(d[1][k], d[2][k]);
          t[2][k] = _mm256_sub_ps(d[2][k], d[1][k]);
          t[3][k] = _mm256_sub_ps(d[1][k], d[3][k]);
        }
        for (int i = 0; i < 4; ++i) {
          e[4 * i + 0] = _mm256_sub_ps(t[i][0], t[i][2]);
          e[4 * i + 1] = _mm256_add_ps(t[i][1], t[i][2]);
          e[4 * i + 2] = _mm256_sub_ps(t[i][2], t[i][1]);
          e[4 * i + 3] = _mm256_sub_ps(t[i][1], t[i][3]);
        }
      }
      for (int xi = 0; xi < 16; ++xi) {
        const int k = p->kidx[xi][tile];
        if (k < 0) continue;
        float *dst = T + xi * ts + (c * p->lanes.kt[xi] + k) * cnt + s;
        if (pc == SL)
          _mm256_storeu_ps(dst, e[xi]);
        else
          _mm256_maskstore_ps(dst, m, e[xi]);
      }
    }
}

/* The outputs of group (o, s) of a chunk of cnt samples from n0 (M's entry xi
 * at M + xi ms, its columns as group_transform's): A^T m A + bias, output_tile's
 * arithmetic in its order, into out (N, cout, h, w) */
static void group_output(const wino_plan *p, const float *M, int64_t ms, int64_t n0, int64_t cnt, int64_t o,
                         int64_t s, float bias, float *buf, float *out) {
  const int hw = p->h * p->w, w = p->w;
  const int pc = cnt - s < SL ? (int)(cnt - s) : SL;
  const __m256i m = dp_lanes8_upto(pc);
  const __m256 bv = _mm256_set1_ps(bias);
  float *ob = buf + 2 * SL * (int64_t)p->hp * p->wp;
  for (int ti = 0; ti < p->th; ++ti)
    for (int tj = 0; tj < p->tw; ++tj) {
      const int tile = ti * p->tw + tj;
      __m256 v[16];
      for (int xi = 0; xi < 16; ++xi) {
        const int k = p->kidx[xi][tile]; /* (a skipped entry feeds only outputs past the plane) */
        const float *q = M + xi * ms + (o * p->lanes.kt[xi] + k) * cnt + s;
        v[xi] = k < 0 ? _mm256_setzero_ps() : pc == SL ? _mm256_loadu_ps(q) : _mm256_maskload_ps(q, m);
      }
      for (int i = 0; i < 2 && 2 * ti + i < p->h; ++i) {
        __m256 t[4];
        for (int k = 0; k < 4; ++k)
          t[k] = i == 0 ? _mm256_add_ps(_mm256_add_ps(v[k], v[4 + k]), v[8 + k]) : _mm256_sub_ps(_mm256_sub_ps(v[4 + k], v[8 + k]), v[12 + k]);
        float *row = ob + SL * ((2 * ti + i) * w + 2 * tj);
        _mm256_storeu_ps(row, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(t[0], t[1]), t[2]), bv));
        if (2 * tj + 1 < w) _mm256_storeu_ps(row + SL, _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(t[1], t[2]), t[3]), bv));
      }
    }
  const int64_t out_sz = p->cout * (int64_t)hw;
  lanes_out(ob, pc, hw, out + (n0 + s) * out_sz + o * hw, out_sz);
}
#endif

static void dy_plane(const wino_plan *p, const float *src, const float *zrow, float *wv, int64_t wstride,
                     unsigned xmask);

/* One plane's transform into column s * tiles of its row of T: an input plane
 * (input_plane_bordered) or, dy, a plane of dy (dy_plane). */
static void transform_plane(const wino_plan *p, int dy, const float *src, float *plane, float *t, int64_t tstride,
                            unsigned entries) {
  if (dy)
    dy_plane(p, src, plane + (int64_t)p->hp * p->wp, t, tstride, entries);
  else
    input_plane_bordered(p, src, plane, t, tstride, entries);
}

/* The transforms of a chunk's planes (cnt samples from n0 of src: the input,
 * cin planes a sample, or dy, cout) into T, the chunk's tiles side by side
 * (column s * tiles + tile). With the AVX-512 tiles each thread transforms
 * every plane, writing only its own entries (its GEMMs then read what its
 * core wrote); else the planes are dealt to the threads, channel-major so
 * that consecutive planes fill T's rows front to back, and a barrier ends
 * it. Called by every thread of a parallel region. */
static void chunk_transform(const wino_plan *p, int dy, const float *src, int64_t n0, int64_t cnt, float *plane,
                            float *T, int64_t tstride, unsigned entries) {
  const int64_t hw = (int64_t)p->h * p->w, planes = dy ? p->cout : p->cin, cols = cnt * p->tiles;
#if TILES_AVX512
  if (p->lanes.P) { /* groups of P samples of a channel, channel-major as below */
    const int64_t groups = (cnt + p->lanes.P - 1) / p->lanes.P, sm = lanes_sample_major(p);
    for (int64_t k = 0; entries && k < planes * groups; ++k) {
      const int64_t c = sm ? k % planes : k / groups, s = (sm ? k / planes : k % groups) * p->lanes.P;
      const int pc = cnt - s < p->lanes.P ? (int)(cnt - s) : p->lanes.P;
      __m512 R[4];
      lanes_window((int)hw, src + ((n0 + s) * planes + c) * hw, planes * hw, pc, R);
      const __mmask16 m = dp_lanes_upto(pc * p->tiles);
      if (dy)
        dy_group_lanes(&p->lanes, R, m, T, tstride, c * cnt + s, entries);
      else
        input_group_lanes(&p->lanes, R, m, T, tstride, c * cnt + s, entries);
    }
    return;
  }
#endif
#if SAMPLE_LANES
  if (p->sl) { /* the groups of SL samples of a channel dealt to the threads, channel-major */
    (void)entries;
    const int64_t groups = (cnt + SL - 1) / SL;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < planes * groups; ++k) {
      const int64_t c = k / groups, s = k % groups * SL;
      group_transform(p, dy, src + ((n0 + s) * planes + c) * hw, planes * hw, cnt - s < SL ? (int)(cnt - s) : SL, c, s,
                      cnt, plane, T, tstride);
    }
    return;
  }
#endif
  if (TILES_AVX512) {
    for (int64_t cs = 0; entries && cs < planes * cnt; ++cs) {
      const int64_t c = cs / cnt, s = cs % cnt;
      transform_plane(p, dy, src + ((n0 + s) * planes + c) * hw, plane, T + c * cols + s * p->tiles, tstride,
                      entries);
    }
    return;
  }
#pragma omp for schedule(static)
  for (int64_t cs = 0; cs < planes * cnt; ++cs) {
    const int64_t c = cs / cnt, s = cs % cnt;
    transform_plane(p, dy, src + ((n0 + s) * planes + c) * hw, plane, T + c * cols + s * p->tiles, tstride,
                    ALL_ENTRIES);
  }
}

#if TILES_AVX512
/* The outputs of group og (output channel og / groups, its group og % groups
 * of P samples) of a chunk of cnt samples from n0 (planes in lanes): A^T m A
 * + bias from M's entries (stride ms), into out (N, cout, h, w) */
static void output_group(const wino_plan *p, const float *M, int64_t ms, int64_t n0, int64_t cnt, int64_t og,
                         const float *b, float *out) {
  const int64_t P = p->lanes.P, groups = (cnt + P - 1) / P, o = og / groups, s = og % groups * P;
  const int64_t hw = (int64_t)p->h * p->w, out_sz = p->cout * hw;
  const int pc = cnt - s < P ? (int)(cnt - s) : (int)P;
  __m512 W[4];
  output_group_lanes(&p->lanes, M, ms, o * cnt + s, dp_lanes_upto(pc * p->tiles), b ? b[o] : 0.0f, W);
  lanes_store((int)hw, out + (n0 + s) * out_sz + o * hw, out_sz, pc, W);
}

/* narrow_own's chunks: the calling thread's samples of in into out (U made;
 * shared: the threads' V and M, p->shared floats; plane: the thread's own) */
static void own_chunks(const wino_plan *p, int64_t N, const float *in, int flip, const float *b, float *out,
                       const float *U, float *shared, float *plane) {
  const int t = omp_get_thread_num();
  const int64_t P = p->lanes.P;
  const int64_t ct = p->chunk / p->nt, vs = p->cin * ct * p->tiles + WINO_SKEW,
                ms = p->cout * ct * p->tiles + WINO_SKEW;
  float *V = shared + t * 16 * (vs + ms), *M = V + 16 * vs; /* nt of them fit in p->shared */
  const int64_t s0 = N * t / p->nt, mine = N * (t + 1) / p->nt - s0, nch = (mine + ct - 1) / ct;
  for (int64_t k = 0; k < nch; ++k) {
    const int64_t n0 = s0 + mine * k / nch, cnt = s0 + mine * (k + 1) / nch - n0, groups = (cnt + P - 1) / P;
    chunk_transform(p, 0, in, n0, cnt, plane, V, vs, ALL_ENTRIES);
    for (int xi = 0; xi < 16; ++xi) /* (an entry no tile keeps: a 1x1 plane's 3, 7, 11-15) */
      if (kept_tiles(p, xi)) wino_gemm(p, flip, xi, U, V, vs, M, ms, cnt * kept_tiles(p, xi));
    for (int64_t og = 0; og < p->cout * groups; ++og) output_group(p, M, ms, n0, cnt, og, b, out);
  }
}
#endif

#if WIDE_BLOCKS
/* Wide planes, thread t's samples' tiles in blocks of p->block (tile k: sample
 * n0 + k / tiles, its tile k % tiles), whatever the samples and tile rows they
 * span: V and M in L2, and the GEMMs on whole 32-column panels of the kernel
 * (a 14x14 plane's 49 tiles filled 49 of 64 columns). V: the thread's own
 * p->own floats. */
static void wide_blocks(const wino_plan *p, int64_t N, int t, const float *in, int flip, const float *U,
                        const float *b, float *out, float *V) {
  const int64_t hw = (int64_t)p->h * p->w, in_sz = p->cin * hw, out_sz = p->cout * hw;
  const int64_t n0 = N * t / p->nt, total = (N * (t + 1) / p->nt - n0) * p->tiles;
  for (int64_t k0 = 0; k0 < total; k0 += p->block) {
    const int64_t bc = total - k0 < p->block ? total - k0 : p->block, bvs = p->cin * bc + WINO_SKEW,
                  bms = p->cout * bc + WINO_SKEW;
    float *M = V + 16 * bvs;
    /* the block's runs of a tile row: sample, tile row, first and end tile column, column in the block */
    int seg[WIDE_BLOCK_MAX_RUNS][5], nseg = 0;
    for (int64_t k = k0; k < k0 + bc; ++nseg) {
      const int r = (int)(k % p->tiles), tj0 = r % p->tw;
      const int tj1 = k0 + bc - k < p->tw - tj0 ? tj0 + (int)(k0 + bc - k) : p->tw;
      seg[nseg][0] = (int)(k / p->tiles), seg[nseg][1] = r / p->tw, seg[nseg][2] = tj0, seg[nseg][3] = tj1;
      seg[nseg][4] = (int)(k - k0);
      k += tj1 - tj0;
    }
    const float *src = in + n0 * in_sz;
    for (int c = 0; c < p->cin; ++c)
      for (int q = 0; q < nseg; ++q)
        input_segment(p, src + seg[q][0] * in_sz + c * hw, seg[q][1], seg[q][2], seg[q][3], V + c * bc + seg[q][4],
                      bvs, ALL_ENTRIES);
    for (int xi = 0; xi < 16; ++xi) wino_gemm(p, flip, xi, U, V, bvs, M, bms, bc);
    float *dst = out + n0 * out_sz;
    for (int o = 0; o < p->cout; ++o)
      for (int q = 0; q < nseg; ++q)
        output_segment(p, M + o * bc + seg[q][4], bms, b ? b[o] : 0.0f, dst + seg[q][0] * out_sz + o * hw,
                       seg[q][1], seg[q][2], seg[q][3]);
  }
}
#endif

#if !TILES_AVX512
/* Wide planes, a sample at a time (thread t's samples; V: its own p->own
 * floats, plane: its buffer for the row transforms) */
static void wide_samples(const wino_plan *p, int64_t N, int t, const float *in, int flip, const float *U,
                         const float *b, float *out, float *V, float *plane) {
  const int64_t hw = (int64_t)p->h * p->w, in_sz = p->cin * hw, out_sz = p->cout * hw;
  const int64_t cols = p->tiles, vstride = p->cin * cols + WINO_SKEW, mstride = p->cout * cols + WINO_SKEW;
  float *M = V + 16 * vstride;
  for (int64_t n = N * t / p->nt; n < N * (t + 1) / p->nt; ++n) {
    for (int c = 0; c < p->cin; ++c) {
      if (p->w >= WINO_ROW_MIN)
        input_plane(p, in + n * in_sz + c * hw, plane, V + c * cols, vstride);
      else
        input_plane_bordered(p, in + n * in_sz + c * hw, plane, V + c * cols, vstride, ALL_ENTRIES);
    }
    for (int xi = 0; xi < 16; ++xi) wino_gemm(p, flip, xi, U, V, vstride, M, mstride, cols);
    for (int o = 0; o < p->cout; ++o)
      output_plane(p, M + o * cols, mstride, b ? b[o] : 0.0f, out + n * out_sz + o * hw);
  }
}
#endif

/* out (N, cout, h, w) = the convolution of in (N, cin, h, w) with w (+ b).
 * u_out: where the filter transform goes (NULL: the scratch's start); u_in
 * (NULL: none): the transform already made (a forward pass's, kept). */
static void wino_conv(const wino_plan *p, int64_t N, const float *in, const float *w, int flip, const float *b,
                      float *out, float *scratch, float *u_out, const float *u_in) {
  const int64_t hw = (int64_t)p->h * p->w, out_sz = p->cout * hw;
  float *Uw = u_out ? u_out : scratch;
  const float *U = u_in ? u_in : Uw;
  const int64_t ustride = (int64_t)p->cin * p->cout + WINO_SKEW;
  float *shared = scratch + 16 * ustride; /* narrow: V and M */
  float *own = shared + p->shared;
#pragma omp parallel num_threads(p->nt)
  {
    const int t = omp_get_thread_num();
    /* the forward transform (O, C) of the layer: forward cout = O; dx (flip) cout = C, read transposed */
    if (!u_in) filter_transform(w, flip ? p->cin : p->cout, flip ? p->cout : p->cin, Uw, ustride); /* ends in a barrier */
    float *mine = own + t * p->per_thread;
    float *plane = mine + (p->narrow ? 0 : p->own);
    /* the zero border input_plane_bordered reads without AVX-512 (every narrow plane, whatever its width, and
       the wide ones narrower than WINO_ROW_MIN; input_plane writes its own), sample lanes' buffers */
    if (p->sl || (!TILES_AVX512 && (p->narrow || p->w < WINO_ROW_MIN)))
      memset(plane, 0, sizeof(float) * (size_t)p->plane_floats);
    if (!p->narrow) {
#if WIDE_BLOCKS
      if (p->blocks) wide_blocks(p, N, t, in, flip, U, b, out, mine);
#endif
#if !TILES_AVX512
      if (!p->blocks) wide_samples(p, N, t, in, flip, U, b, out, mine, plane);
#endif
#if TILES_AVX512
    } else if (narrow_own(p)) {
      own_chunks(p, N, in, flip, b, out, U, shared, plane);
#endif
    } else {
      float *V = shared;
      const int64_t nchunks = (N + p->chunk - 1) / p->chunk;
      const unsigned entries = narrow_entries(p, t); /* thread t's GEMMs */
      /* the largest chunk's strides for every chunk (entry xi stays where it was) */
      const int64_t vstride = p->cin * p->chunk * p->tiles + WINO_SKEW;
      const int64_t mstride = p->cout * p->chunk * p->tiles + WINO_SKEW;
      float *M = V + 16 * vstride;
      for (int64_t k = 0; k < nchunks; ++k) {
        const int64_t n0 = N * k / nchunks, cnt = N * (k + 1) / nchunks - n0, cols = cnt * p->tiles;
        chunk_transform(p, 0, in, n0, cnt, plane, V, vstride, entries);
        for (int xi = 0; xi < 16; ++xi) /* (an entry no tile keeps: a 1x1 plane's 3, 7, 11-15) */
          if (entries >> xi & 1u && kept_tiles(p, xi))
            wino_gemm(p, flip, xi, U, V, vstride, M, mstride, cnt * kept_tiles(p, xi));
#pragma omp barrier /* every entry's products, for the output transforms */
#if SAMPLE_LANES
        if (p->sl) {
          const int64_t groups = (cnt + SL - 1) / SL;
#pragma omp for schedule(static)
          for (int64_t og = 0; og < p->cout * groups; ++og)
            group_output(p, M, mstride, n0, cnt, og / groups, og % groups * SL, b ? b[og / groups] : 0.0f, plane, out);
          continue;
        }
#endif
#if TILES_AVX512
        if (p->lanes.P) {
          const int64_t P = p->lanes.P, groups = (cnt + P - 1) / P;
#pragma omp for schedule(static)
          for (int64_t og = 0; og < p->cout * groups; ++og) output_group(p, M, mstride, n0, cnt, og, b, out);
          continue;
        }
#endif
#pragma omp for schedule(static)
        for (int64_t os = 0; os < p->cout * cnt; ++os) {
          const int64_t o = os / cnt, s = os % cnt;
          output_plane(p, M + o * cols + s * p->tiles, mstride, b ? b[o] : 0.0f, out + (n0 + s) * out_sz + o * hw);
        }
      }
    }
  }
}

/* The 16 entries of A dY A^T for the tiles [0, n) of a tile row, dY's rows
 * r0 and r1 (tile tj: columns 2tj, 2tj + 1), entry xi at wt[xi*ws + tj];
 * one tile per iteration, 16 streams: vectorized across tiles. */
static void dy_cols(const float *restrict r0, const float *restrict r1, int n, float *restrict wt, int64_t ws) {
  DP_IVDEP
  for (int tj = 0; tj < n; ++tj) {
    const float a = r0[2 * tj], b = r0[2 * tj + 1], c = r1[2 * tj], d = r1[2 * tj + 1];
    /* A dY (4x2): rows (a, b), (a + c, b + d), (a - c, b - d), (-c, -d); then . A^T per row */
    const float t0[4] = {a, a + c, a - c, -c}, t1[4] = {b, b + d, b - d, -d};
    for (int i = 0; i < 4; ++i) {
      wt[(4 * i + 0) * ws + tj] = t0[i];
      wt[(4 * i + 1) * ws + tj] = t0[i] + t1[i];
      wt[(4 * i + 2) * ws + tj] = t0[i] - t1[i];
      wt[(4 * i + 3) * ws + tj] = -t1[i];
    }
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* dy_cols for the min(n, 8) tiles from dy's rows r0, r1 (columns at or past
 * cols read as zero: an odd width's last tile): its arithmetic in its order
 * (the same bits), 8 tiles a vector */
static inline void dy_tiles_avx2(const float *r0, const float *r1, int cols, int n, float *wt, int64_t ws) {
  const __m256i c0 = dp_lanes8_upto(cols), c8 = dp_lanes8_upto(cols - 8), sm = dp_lanes8_upto(n);
  const __m256 x0 = _mm256_maskload_ps(r0, c0), x1 = _mm256_maskload_ps(r0 + 8, c8);
  const __m256 y0 = _mm256_maskload_ps(r1, c0), y1 = _mm256_maskload_ps(r1 + 8, c8);
  const __m256 a = cols_of(x0, x1, 0), b = cols_of(x0, x1, 1), c = cols_of(y0, y1, 0), d = cols_of(y0, y1, 1);
  const __m256 sign = _mm256_set1_ps(-0.0f); /* -x as the scalar code's: the sign bit flipped */
  const __m256 t0[4] = {a, _mm256_add_ps(a, c), _mm256_sub_ps(a, c), _mm256_xor_ps(c, sign)};
  const __m256 t1[4] = {b, _mm256_add_ps(b, d), _mm256_sub_ps(b, d), _mm256_xor_ps(d, sign)};
  for (int i = 0; i < 4; ++i) {
    _mm256_maskstore_ps(wt + (4 * i + 0) * ws, sm, t0[i]);
    _mm256_maskstore_ps(wt + (4 * i + 1) * ws, sm, _mm256_add_ps(t0[i], t1[i]));
    _mm256_maskstore_ps(wt + (4 * i + 2) * ws, sm, _mm256_sub_ps(t0[i], t1[i]));
    _mm256_maskstore_ps(wt + (4 * i + 3) * ws, sm, _mm256_xor_ps(t1[i], sign));
  }
}
#endif

/* w[xi*wstride + tile] = (A dY A^T)[xi] for every 2x2 block dY of one (h, w)
 * plane of dy, zero past the plane's edge (the forward pass dropped those
 * outputs): the gradient of the tile's M given its outputs' gradients. zrow:
 * w zeros (a last tile row's second row when h is odd). */
static void dy_plane(const wino_plan *p, const float *src, const float *zrow, float *wv, int64_t wstride,
                     unsigned xmask) {
  const int full = p->w / 2; /* tile columns with both columns inside */
  for (int ti = 0; ti < p->th; ++ti) {
    const float *r0 = src + (int64_t)2 * ti * p->w;
    const float *r1 = 2 * ti + 1 < p->h ? r0 + p->w : zrow;
    float *wt = wv + (int64_t)ti * p->tw;
#if defined(__AVX512F__)
    for (int tj = 0; tj < p->tw; tj += 16)
      dy_tiles_avx512(r0 + 2 * tj, r1 + 2 * tj, p->w - 2 * tj, p->tw - tj < 16 ? p->tw - tj : 16, wt + tj, wstride,
                      xmask);
    (void)full;
    continue;
#else
    (void)xmask; /* the scalar code writes all 16 entries */
#endif
#if defined(__AVX2__) && !defined(__AVX512F__) /* 8 tiles a vector */
    for (int tj = 0; tj < p->tw; tj += 8)
      dy_tiles_avx2(r0 + 2 * tj, r1 + 2 * tj, p->w - 2 * tj, p->tw - tj, wt + tj, wstride);
    (void)full;
    continue;
#endif
    dy_cols(r0, r1, full, wt, wstride);
    if (full < p->tw) { /* odd w: the last tile's second column is outside */
      const float e0[2] = {r0[2 * full], 0.0f}, e1[2] = {r1[2 * full], 0.0f};
      dy_cols(e0, e1, 1, wt + full, wstride);
    }
  }
}

/* dw (O, C, 3, 3) = G^T dU G of each (o, c), dU (16, O, C) at dU + xi * ustride.
 * A worksharing loop of a parallel region. */
static void filter_gradient(const float *dU, int64_t ustride, int64_t pairs, float *dw) {
#if defined(__AVX512F__)
  /* 16 pairs a lane each: the 16 entries loaded whole, the arithmetic below's
   * in its order (the same bits); each pair's 9 taps out as a masked store
   * after a transpose in registers (scatters measured slower) */
  const int64_t blocks = (pairs + 15) / 16;
  const __m512 half = _mm512_set1_ps(0.5f);
#pragma omp for schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t oc = blk * 16;
    const __mmask16 m = dp_lanes_upto(pairs - oc);
    __m512 u[16], t[3][4];
    for (int xi = 0; xi < 16; ++xi) u[xi] = _mm512_maskz_loadu_ps(m, dU + xi * ustride + oc);
    for (int k = 0; k < 4; ++k) {
      const __m512 s12 = _mm512_add_ps(u[4 + k], u[8 + k]);
      t[0][k] = _mm512_add_ps(u[k], _mm512_mul_ps(half, s12));
      t[1][k] = _mm512_mul_ps(half, _mm512_sub_ps(u[4 + k], u[8 + k]));
      t[2][k] = _mm512_add_ps(_mm512_mul_ps(half, s12), u[12 + k]);
    }
    __m512 tap[16], out[16]; /* tap k of the 16 pairs, then pair l's 9 taps */
    for (int i = 0; i < 3; ++i) {
      const __m512 s12 = _mm512_add_ps(t[i][1], t[i][2]);
      tap[3 * i + 0] = _mm512_add_ps(t[i][0], _mm512_mul_ps(half, s12));
      tap[3 * i + 1] = _mm512_mul_ps(half, _mm512_sub_ps(t[i][1], t[i][2]));
      tap[3 * i + 2] = _mm512_add_ps(_mm512_mul_ps(half, s12), t[i][3]);
    }
    for (int k = 9; k < 16; ++k) tap[k] = _mm512_setzero_ps();
    dp_transpose16(tap, out);
    float *g = dw + oc * 9;
    const int n = pairs - oc < 16 ? (int)(pairs - oc) : 16;
    for (int l = 0; l < n; ++l) _mm512_mask_storeu_ps(g + 9 * l, 0x1FF, out[l]);
  }
  return;
#endif
#pragma omp for schedule(static)
  for (int64_t oc = 0; oc < pairs; ++oc) {
    float u[4][4], t[3][4];
    for (int xi = 0; xi < 16; ++xi) u[xi / 4][xi % 4] = dU[xi * ustride + oc];
    for (int k = 0; k < 4; ++k) { /* G^T dU */
      t[0][k] = u[0][k] + 0.5f * (u[1][k] + u[2][k]);
      t[1][k] = 0.5f * (u[1][k] - u[2][k]);
      t[2][k] = 0.5f * (u[1][k] + u[2][k]) + u[3][k];
    }
    float *g = dw + oc * 9;
    for (int i = 0; i < 3; ++i) {
      g[3 * i + 0] = t[i][0] + 0.5f * (t[i][1] + t[i][2]);
      g[3 * i + 1] = 0.5f * (t[i][1] - t[i][2]);
      g[3 * i + 2] = 0.5f * (t[i][1] + t[i][2]) + t[i][3];
    }
  }
}

size_t dp_winograd_u_floats(const dp_conv_geom *g) { return (size_t)16 * ((size_t)g->C * g->O + WINO_SKEW); }

int dp_winograd_worth_keeping(const dp_conv_geom *g) { return (int64_t)g->C * g->O >= DP_WINOGRAD_KEEP_PAIRS; }

dp_status dp_winograd_forward(const dp_conv_geom *g, int64_t N, const float *x, const float *w, const float *b,
                              float *y, int nthreads, float *scratch, float *u_keep) {
  if (N <= 0) return DP_OK;
  wino_plan p = wino_plan_make(g->C, g->O, g->OH, g->OW, N, nthreads);
  DP_TRY(dp_small_gemm_on(&p.own_gemm));
  wino_conv(&p, N, x, w, 0, b, y, scratch, u_keep, NULL);
  return DP_OK;
}

dp_status dp_winograd_backward_dx(const dp_conv_geom *g, int64_t N, const float *w, const float *dy, float *dx,
                                  int nthreads, float *scratch, const float *u_kept) {
  if (N <= 0) return DP_OK;
  wino_plan p = wino_plan_make(g->O, g->C, g->OH, g->OW, N, nthreads);
  DP_TRY(dp_small_gemm_on(&p.own_gemm));
  wino_conv(&p, N, dy, w, 1, NULL, dx, scratch, NULL, u_kept);
  return DP_OK;
}

/* dU of wide planes (DW_GROUPS): thread t takes the groups [G*t/nt,
 * G*(t+1)/nt), each its samples a few at a time, transformed by the thread
 * itself (every entry) into its own V and W, its partial dU_xi (+)= W_xi .
 * V_xi^T; then the partials added in group order. Called by every thread of a
 * parallel region. */
static void dw_wide(const wino_plan *p, int64_t N, const float *x, const float *dy, float *dU, int64_t ustride,
                    float *scratch) {
  const int64_t hw = (int64_t)p->h * p->w, G = dw_groups(p, N), S = dw_wide_samples(p), du = 16 * ustride;
  const int64_t vstride = p->cin * S * p->tiles + WINO_SKEW, wstride = p->cout * S * p->tiles + WINO_SKEW;
  float *part = scratch, *own = part + G * du, *packs = own + p->nt * dw_wide_thread_floats(p);
  const int t = omp_get_thread_num();
  float *V = own + t * dw_wide_thread_floats(p), *W = V + 16 * vstride, *plane = W + 16 * wstride;
  float *pack = packs + t * DP_SMALL_GEMM_PACK_FLOATS;
  memset(plane, 0, sizeof(float) * (size_t)p->plane_floats); /* the plane's border, and zrow */
  for (int64_t g = G * t / p->nt; g < G * (t + 1) / p->nt; ++g) {
    const int64_t g0 = N * g / G, g1 = N * (g + 1) / G;
    float *pu = part + g * du;
    for (int64_t n0 = g0; n0 < g1; n0 += S) {
      const int64_t cnt = g1 - n0 < S ? g1 - n0 : S, cols = cnt * p->tiles;
      for (int64_t c = 0; c < p->cin; ++c)
        for (int64_t s = 0; s < cnt; ++s)
          transform_plane(p, 0, x + ((n0 + s) * p->cin + c) * hw, plane, V + c * cols + s * p->tiles, vstride,
                          ALL_ENTRIES);
      for (int64_t o = 0; o < p->cout; ++o)
        for (int64_t s = 0; s < cnt; ++s)
          transform_plane(p, 1, dy + ((n0 + s) * p->cout + o) * hw, plane, W + o * cols + s * p->tiles, wstride,
                          ALL_ENTRIES);
      for (int xi = 0; xi < 16; ++xi)
        dp_gemm(p->own_gemm, 0, 1, p->cout, p->cin, cols, W + xi * wstride, cols, V + xi * vstride, cols,
                pu + xi * ustride, p->cin, n0 > g0, pack);
    }
  }
#pragma omp barrier
#pragma omp for schedule(static)
  for (int64_t e = 0; e < du; ++e) {
    float sum = part[e];
    for (int64_t k = 1; k < G; ++k) sum += part[k * du + e];
    dU[e] = sum;
  }
}

/* dU of narrow planes: the batch in chunks, the 16 GEMMs dealt to the
 * threads, each summing its entries' chunks in order; with AVX-512 each
 * thread transforms its own GEMMs' entries (chunk_transform), and no barrier
 * separates the chunks. Called by every thread of a parallel region. */
static void dw_narrow(const wino_plan *p, int64_t N, const float *x, const float *dy, float *dU, int64_t ustride,
                      float *scratch) {
  float *V = scratch, *own = V + p->shared, *packs = own + p->nt * p->per_thread;
  const int64_t nchunks = (N + p->chunk - 1) / p->chunk;
  const int t = omp_get_thread_num();
  /* narrow planes: a thread's own floats are its plane alone (no V and M) */
  float *plane = own + t * p->per_thread, *pack = packs + t * DP_SMALL_GEMM_PACK_FLOATS;
  memset(plane, 0, sizeof(float) * (size_t)p->plane_floats); /* the plane's border, and zrow */
  const unsigned entries = narrow_entries(p, t);
  for (int64_t k = 0; k < nchunks; ++k) {
    const int64_t n0 = N * k / nchunks, cnt = N * (k + 1) / nchunks - n0;
    /* the largest chunk's strides for every chunk: entry xi's V and W stay where they were (another
     * thread may still read its own entries of the last chunk) */
    const int64_t vstride = p->cin * p->chunk * p->tiles + WINO_SKEW, wstride = p->cout * p->chunk * p->tiles + WINO_SKEW;
    float *W = V + 16 * vstride;
    chunk_transform(p, 0, x, n0, cnt, plane, V, vstride, entries);
    chunk_transform(p, 1, dy, n0, cnt, plane, W, wstride, entries);
    /* dU_xi (O, C) (+)= W_xi (O, cols) . V_xi^T (cols, C): the chunks in order, whatever the threads */
    for (int xi = 0; xi < 16; ++xi) {
      if (!(entries >> xi & 1u)) continue;
      const int64_t kc = cnt * kept_tiles(p, xi); /* the entry's columns (odd planes' edges skipped) */
      if (kc) /* (else no tile keeps it, a 1x1 plane's 3, 7, 11-15: zero, the BLAS taking no empty matrix) */
        dp_gemm(p->own_gemm, 0, 1, p->cout, p->cin, kc, W + xi * wstride, kc, V + xi * vstride, kc,
                dU + xi * ustride, p->cin, k > 0, pack);
      else if (k == 0)
        memset(dU + xi * ustride, 0, sizeof(float) * (size_t)p->cout * p->cin);
    }
    if (!TILES_AVX512 || p->sl) {
#pragma omp barrier /* the GEMMs read before the next chunk's transforms overwrite */
    }
  }
#pragma omp barrier /* every dU_xi summed */
}

dp_status dp_winograd_backward_dw(const dp_conv_geom *g, int64_t N, const float *x, const float *dy, float *dw,
                                  float *db, int nthreads, float *scratch) {
  const int64_t pairs = (int64_t)g->O * g->C, P = (int64_t)g->OH * g->OW;
  if (N <= 0) {
    memset(dw, 0, sizeof(float) * (size_t)pairs * 9);
    if (db) memset(db, 0, sizeof(float) * (size_t)g->O);
    return DP_OK;
  }
  wino_plan pl = wino_plan_make(g->C, g->O, g->OH, g->OW, N, nthreads);
  DP_TRY(dp_small_gemm_on(&pl.own_gemm));
  const wino_plan *p = &pl;
  const int64_t ustride = pairs + WINO_SKEW;
  float *dU = scratch;
#pragma omp parallel num_threads(p->nt)
  {
    if (p->narrow)
      dw_narrow(p, N, x, dy, dU, ustride, dU + 16 * ustride);
    else
      dw_wide(p, N, x, dy, dU, ustride, dU + 16 * ustride);
    filter_gradient(dU, ustride, pairs, dw); /* ends in a barrier: dU read, its floats free for db's partials */
    if (db) dp_winograd_bias_grad(dy, N, g->O, P, (double *)(void *)dU, db);
  }
  return DP_OK;
}

/* row r's P values added into 16 double lanes (value i into lane i % 16): 16 chains where
 * one chain of dependent adds measured 3% of the ResNet-18 step; dp_lanes16_total adds them */
static void lanes_add_row(const float *r, int64_t P, double lane[16]) {
  int64_t i = 0;
  for (; i + 16 <= P; i += 16)
    for (int l = 0; l < 16; ++l) lane[l] += (double)r[i + l];
  for (int l = 0; i < P; ++i, ++l) lane[l] += (double)r[i];
}

void dp_winograd_bias_grad(const float *dy, int64_t N, int O, int64_t P, double *part, float *db) {
  const int64_t G = dp_sample_groups(N);
#pragma omp for schedule(static)
  for (int64_t g = 0; g < G; ++g) {
    double *pg = part + g * O;
    for (int o = 0; o < O; ++o) pg[o] = 0.0;
    for (int64_t n = N * g / G; n < N * (g + 1) / G; ++n)
      for (int o = 0; o < O; ++o) {
        double lane[16] = {0.0};
        lanes_add_row(dy + (n * O + o) * P, P, lane);
        pg[o] += dp_lanes16_total(lane);
      }
  }
#pragma omp for schedule(static)
  for (int o = 0; o < O; ++o) {
    double sum = 0.0;
    for (int64_t g = 0; g < G; ++g) sum += part[g * O + o];
    db[o] = (float)sum;
  }
}

void dp_bias_grad_by_channel(const float *dy, int64_t N, int O, int64_t P, float *db, int nthreads) {
  /* each channel's rows into its own 16 lanes in sample order (one chain of dependent adds was
   * 2.7% of the AVX2 LeNet step), 8 channels at a time: a sample's 8 rows lie together, where a
   * channel at a time read rows a sample apart, each from L3 */
  enum { OB8 = 8 };
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int o0 = 0; o0 < O; o0 += OB8) {
    const int on = O - o0 < OB8 ? O - o0 : OB8;
    double lane[OB8][16] = {{0.0}};
    for (int64_t n = 0; n < N; ++n)
      for (int t = 0; t < on; ++t) lanes_add_row(dy + (n * O + o0 + t) * P, P, lane[t]);
    for (int t = 0; t < on; ++t) db[o0 + t] = (float)dp_lanes16_total(lane[t]);
  }
}
