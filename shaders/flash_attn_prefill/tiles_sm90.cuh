// Part of shaders/flash_attn_prefill_tensor.cu: the Hopper form's tile shapes, one row per
// head dim. Every choice of shape, depth and register split of the Hopper form is made
// here, so a variant to time is this file changed (or a -D of MLX_NATIVE_CUDA_DEFINES).
//
// Two kinds of CTA run the Hopper form:
// - the plain forms (one CTA, cp.async loads; any strides, variable length): HCfg of
//   mainloop_sm90.cuh reads MINB (CTAs an SM) and NSTAGE (K/V buffers) from here;
// - the pair forms (clusters of two CTAs that receive each K/V tile once, by TMA multicast;
//   fixed-length K/V the TMA can address). PIPE says which loop runs them:
//     0  the CTA-barrier loop of mainloop_sm90.cuh (head dim 512: O split over both
//        warpgroups, which exchange maxima and P every step);
//     1  the warp-specialised pipeline of mainloop_sm90_ws.cuh (head dim 256: 64 cache rows
//        a stage, two stages);
//     2  the warp-specialised pipeline of pipeline_sm90.cuh: N cache rows a stage (N / 64
//        table steps, so SPEC 1's table is read as it is), STAGES stages, and OVERLAP: a
//        consumer warpgroup's softmax of tile j runs while its own P V of tile j - 1 is on
//        the tensor cores (FlashAttention-3's intra-warpgroup overlap).
//   Both pipelines: a producer warpgroup of PRODUCER_REGS registers a thread and CONSUMERS
//   consumer warpgroups of 64 query rows each, CONSUMER_REGS registers a thread (setmaxnreg;
//   128 x PRODUCER_REGS + 128 x CONSUMERS x CONSUMER_REGS must fit the 65536 the launch of
//   128 x (CONSUMERS + 1) threads gives, or the claim never completes). PIPE 1 has two
//   consumers; PIPE 2 two or three (FlashAttention-3's shape at head dim 64: 192 query rows
//   a CTA, so a third warpgroup's softmax hides behind the other two's products).
//
// Why these shapes (docs/benchmarks.md, 2026-12-03): at head dims 64 and 128 a 64-row step
// is too little work for what each step costs besides its products (the walk, the mbarrier
// waits, the turn, the row maxima), and m64n64 products read as many bytes of shared memory
// as they compute; 128-row tiles halve both. O (64 or 32 registers) leaves room in the
// consumers' registers for the next tile's scores beside the last tile's P, which at head
// dim 256 (O: 128 registers) spilled (2026-12-01).
#pragma once

namespace hopper {

// Overrides for timing variants (one value each; the defaults are the table's).
#ifndef MLXN_WS_N_D64
#define MLXN_WS_N_D64 128
#endif
#ifndef MLXN_WS_N_D128
#define MLXN_WS_N_D128 128
#endif
// The wide d128 pipeline (WideTiles below): its tiles' cache rows (192, or 128 to compare
// the same shape with mask-tile room given up) and register split (producer, consumers:
// 128 x P + 256 x C <= 65536).
// Head dim 256's loop: 1 the pipeline of mainloop_sm90_ws.cuh, 2 pipeline_sm90.cuh's (a
// variant to time: its N is 64 there, the table's step).
// Whether flash_attn_prefill_d128.cu instantiates the WideTiles entry points (the host
// passes 1 where it launches them: attention_geometry.rs WIDE_LAUNCHED).
#ifndef MLXN_WS_WIDE_ENTRIES
#define MLXN_WS_WIDE_ENTRIES 0
#endif
#ifndef MLXN_WS_PIPE_D256
#define MLXN_WS_PIPE_D256 1
#endif
#ifndef MLXN_WS_WIDE_N_D128
#define MLXN_WS_WIDE_N_D128 192
#endif
#ifndef MLXN_WS_WIDE_PRODUCER_REGS
#define MLXN_WS_WIDE_PRODUCER_REGS 24
#endif
#ifndef MLXN_WS_WIDE_CONSUMER_REGS
#define MLXN_WS_WIDE_CONSUMER_REGS 240
#endif
// The d128 pipeline's register split (producer, consumers: 128 x P + 256 x C <= 65536) and
// its own overlap switch (MLXN_WS_OVERLAP's value unless given): variants to time.
#ifndef MLXN_WS_PRODUCER_REGS_D128
#define MLXN_WS_PRODUCER_REGS_D128 56
#endif
#ifndef MLXN_WS_CONSUMER_REGS_D128
#define MLXN_WS_CONSUMER_REGS_D128 224
#endif
// The d128 pipeline's stages, and whether its stages keep room for the explicit mask's tiles
// (without it, 3 stages of K and V fit: a launch whose tiles need a mask tile then traps, so
// such a build is timed on described masks only). Variants to time.
#ifndef MLXN_WS_STAGES_D128
#define MLXN_WS_STAGES_D128 2
#endif
#ifndef MLXN_WS_MASK_TILES_D128
#define MLXN_WS_MASK_TILES_D128 1
#endif
// Whether the pipeline's consumer warpgroups issue their products in turns (a ring of named
// barriers, pipeline_sm90.cuh; 0: each issues when ready, a variant to time).
#ifndef MLXN_WS_TURNS
#define MLXN_WS_TURNS 1
#endif
#ifndef MLXN_WS_STAGES_D64
#define MLXN_WS_STAGES_D64 2
#endif
// Consumer warpgroups of the d64 pipeline (2 or 3). The host launches the pair forms at
// head dim 64 with this many (attention_geometry.rs, WS_CONSUMERS_D64: a test reads this
// default), and the kernel stops where a launch's threads are not its own.
#ifndef MLXN_WS_CONSUMERS_D64
#define MLXN_WS_CONSUMERS_D64 3
#endif
// The register split of three consumers (128 x 32 + 384 x 160 = 65536, FlashAttention-3's;
// 56 / 152 fits too).
#ifndef MLXN_WS_PRODUCER_REGS3
#define MLXN_WS_PRODUCER_REGS3 32
#endif
#ifndef MLXN_WS_CONSUMER_REGS3
#define MLXN_WS_CONSUMER_REGS3 160
#endif
// The intra-warpgroup overlap lost (docs/benchmarks.md, 2026-12-03): as fast without it,
// and without it the softmax packs P once (pipeline_sm90.cuh), 2-4% faster.
#ifndef MLXN_WS_OVERLAP
#define MLXN_WS_OVERLAP 0
#endif
#ifndef MLXN_WS_OVERLAP_D128
#define MLXN_WS_OVERLAP_D128 MLXN_WS_OVERLAP
#endif

// The rows' sums of the rounded P (SPEC 2 step 5) on the tensor cores: P V's operand times a
// block of ones (an m64n8 product beside each of P V's), where the softmax would unpack
// every P and add it. Lost (docs/benchmarks.md, 2026-12-05): correct, and 1-3% slower at
// head dims 64 and 128 (the small products cost the tensor pipe more than the two
// instructions a score they save); kept as a variant to time.
#ifndef MLXN_WS_ROWSUM_MMA
#define MLXN_WS_ROWSUM_MMA 0
#endif

template <int D>
struct Tiles;

// The register split (producer, consumers) of a pipeline of C consumer warpgroups.
template <int C>
struct WsRegs {
    static constexpr int PRODUCER = 56, CONSUMER = 224;  // 128 x 56 + 256 x 224 <= 384 x 168
};
template <>
struct WsRegs<3> {
    static constexpr int PRODUCER = MLXN_WS_PRODUCER_REGS3, CONSUMER = MLXN_WS_CONSUMER_REGS3;
};

template <>
struct Tiles<64> {
    static constexpr int MINB = 2, NSTAGE = 2;  // plain: two CTAs an SM, double-buffered
    static constexpr int PIPE = 2, N = MLXN_WS_N_D64, STAGES = MLXN_WS_STAGES_D64;
    static constexpr int CONSUMERS = MLXN_WS_CONSUMERS_D64;
    static constexpr int PRODUCER_REGS = WsRegs<CONSUMERS>::PRODUCER, CONSUMER_REGS = WsRegs<CONSUMERS>::CONSUMER;
    static constexpr bool MASK_TILES = true;
    static constexpr bool OVERLAP = MLXN_WS_OVERLAP != 0;
    static constexpr bool ROWSUM_MMA = MLXN_WS_ROWSUM_MMA != 0;
    static constexpr int RAW_SLOTS = 0;  // quantised K/V's raw slots (QuantTiles)
};
template <>
struct Tiles<128> {
    // Plain: two CTAs an SM, single-buffered (two such CTAs fit in shared memory; measured
    // 308 against 221 TFLOP/s for one double-buffered CTA, causal 16k, 32/8 heads).
    static constexpr int MINB = 2, NSTAGE = 1;
    static constexpr int PIPE = 2, N = MLXN_WS_N_D128, STAGES = MLXN_WS_STAGES_D128, CONSUMERS = 2;
    static constexpr int PRODUCER_REGS = MLXN_WS_PRODUCER_REGS_D128, CONSUMER_REGS = MLXN_WS_CONSUMER_REGS_D128;
    static constexpr bool MASK_TILES = MLXN_WS_MASK_TILES_D128 != 0;
    static constexpr bool OVERLAP = MLXN_WS_OVERLAP_D128 != 0;
    static constexpr bool ROWSUM_MMA = MLXN_WS_ROWSUM_MMA != 0;
    static constexpr int RAW_SLOTS = 0;  // quantised K/V's raw slots (QuantTiles)
};
// The d128 pipeline where no tile reads the explicit mask (described masks, or none: the host
// launches it then, `_wide` entry points): tiles of 192 cache rows (three table steps), which
// spread each tile's fixed costs over 1.5x the products; two stages of their K and V and Q
// fill the shared memory, so there is no room for mask tiles (a tile that needs one traps),
// and the consumers' 96 scores and 48 words of P beside O need FlashAttention-3's 24 / 240
// register split. The one with mask tiles (Tiles<128>) runs the explicit masks.
template <int D>
struct WideTiles;
template <>
struct WideTiles<128> : Tiles<128> {
    static constexpr int N = MLXN_WS_WIDE_N_D128;
    static constexpr int PRODUCER_REGS = MLXN_WS_WIDE_PRODUCER_REGS, CONSUMER_REGS = MLXN_WS_WIDE_CONSUMER_REGS;
    static constexpr bool MASK_TILES = false;
};
template <>
struct Tiles<256> {
    static constexpr int MINB = 1, NSTAGE = 2;
    static constexpr int PIPE = MLXN_WS_PIPE_D256, N = 64, STAGES = 2, CONSUMERS = 2;
    static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
    static constexpr bool MASK_TILES = true;  // (PIPE 2) one 64-row mask tile a stage: 32 KB
    static constexpr bool OVERLAP = false;  // spilled at 240 registers (2026-12-01 18:05)
    static constexpr bool ROWSUM_MMA = false;  // (the PIPE 2 pipeline's alone)
    static constexpr int RAW_SLOTS = 0;  // quantised K/V's raw slots (QuantTiles)
};
// The quant module's pair forms (quant_pipe.cuh): the pipeline of PIPE 2 at every head dim
// it runs (256 too, in 64-row tiles: as fast as PIPE 1's loop there, docs/benchmarks.md,
// 2026-12-07), with RAW_SLOTS raw slots of each tile's FP8 bytes where the mask tiles
// were (a quant pair form runs without an explicit mask): two at 64 and 128, one at 256,
// whose two stages of F16 K and V and 128 rows of Q leave room for one.
template <int D>
struct QuantTiles : Tiles<D> {
    static constexpr int PIPE = 2;
    static constexpr bool MASK_TILES = false;
    static constexpr int RAW_SLOTS = D == 256 ? 1 : 2;
};

template <>
struct Tiles<512> {
    static constexpr int MINB = 1, NSTAGE = 1;  // the tiles take 192 KB
    static constexpr int PIPE = 0, N = 64, STAGES = 1, CONSUMERS = 2;
    static constexpr int PRODUCER_REGS = 0, CONSUMER_REGS = 0;
    static constexpr bool OVERLAP = false;
    static constexpr bool ROWSUM_MMA = false;
    static constexpr int RAW_SLOTS = 0;  // quantised K/V's raw slots (QuantTiles)
};

}  // namespace hopper
