// gemm_bf16act_tma: gemm_bf16act's contract on Hopper's TMA and warpgroup MMAs, warp-specialised
// (the template and its description: gemm_bf16act_tma.cuh), for the tile
// pydflash/linear/gemm_bf16act.py (TMA_TILES) launches; the tiles benchmarked beside it:
// dev/cuda/gemm_bf16act_tma_tiles.cu. Compiled for sm_90a only (Family(arch_specific=True)).
#include "gemm_bf16act_tma.cuh"

TM_TILE(tma_128x128_s6, 128, 6, 1)
TM_TILE_TILED(tma_128x128_s6, 128, 6, 1)  // gemm_bf16act_<epilogue>_tma_128x128_s6_tiled
