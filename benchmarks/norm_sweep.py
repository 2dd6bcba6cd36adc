"""The norms' tiles at the 20b's shapes (issue 34: 49 norm launches are ~10.6 ms of a 32768-token prefill on the
H200, ~3.5 TB/s of the bytes they must move).

Two norms a layer, as the model calls ``rms_norm_quant``: "combine" (the input norm after a MoE: x + the weighted
combine of the 4 per-slot bf16 rows, the new x and its FP8 rows out, no bf16 rows) and "stream" (the post-attention
norm: the stream alone, its FP8 rows and rsqrt factors out). Each tile (BLOCK_H, BLOCK_M, num_warps) against
``norm_tile``'s, in rounds with the order rotated (do_bench blocks drift with the card's state), with the bytes it
moves a second and whether its outputs are the default's bits (another tile may sum the squares in another order:
a new default would need the router, which remakes the rows on ``norm_tile``'s, moved with it).

    PYTHONPATH=$(pwd) python3 benchmarks/norm_sweep.py [--tokens 32768] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
import triton

from gptoss_fp8.kernels.norm import norm_tile, rms_norm_quant

HIDDEN, TOP_K = 2880, 4
TILES = [(4096, 1, 4), (4096, 1, 16), (4096, 2, 8), (4096, 2, 16), (4096, 4, 16)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    t = a.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    slots = (0.5 * torch.randn(t * TOP_K, HIDDEN, device="cuda", generator=g)).to(torch.bfloat16)
    cw = torch.softmax(torch.randn(t, TOP_K, device="cuda", generator=g), -1).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).float()
    rstd = torch.empty(t, device="cuda")
    calls = {
        "combine": (lambda tile: rms_norm_quant(x, slots, w, 1e-5, combine=cw, rows=False, tile=tile),
                    t * HIDDEN * (2 + TOP_K * 2 + 2 + 1) + t * 23 * 4),
        "stream": (lambda tile: rms_norm_quant(x, None, w, 1e-5, rows=False, rstd=rstd, tile=tile),
                   t * HIDDEN * (2 + 1) + t * 23 * 4 + t * 4),
    }
    default = norm_tile(HIDDEN, True)
    tiles = [default] + [tile for tile in TILES if tile != default]
    for name, (fn, nbytes) in calls.items():
        ref = fn(None)
        same = {}
        for tile in tiles:
            got = fn(tile)
            same[tile] = all(torch.equal(u.view(torch.uint8) if u.dtype == torch.float8_e4m3fn else u,
                                         v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
                             for u, v in zip([got[0], *got[2]], [ref[0], *ref[2]], strict=True))
        print(f"# {name}: {t} rows, {nbytes / 1e9:.3f} GB a launch; default tile {default}")
        for rnd in range(a.rounds):
            order = tiles[rnd % len(tiles):] + tiles[:rnd % len(tiles)]
            for tile in order:
                ms = triton.testing.do_bench(lambda tile=tile: fn(tile), warmup=20, rep=200, return_mode="median")
                print(f"round {rnd} {name} {tile}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                      f"{'same bits' if same[tile] else 'other bits'}", flush=True)


if __name__ == "__main__":
    main()
