#!/usr/bin/env python3
"""Writes the routing the `triton_kernels` peer times, for `megamoe bench forward --routing FILE`.

The peer (`../shared/peers/triton_kernels_moe.py`, copied to `.peers/`) draws its own top-k routing
per token count T on the GPU (`draw_routing` with a generator seeded `seed * 1000003 + T`, as its
main loop does). This script calls that same function with the same seeds and arguments, so the ids
it writes are exactly the peer's, and megamoe's EP-rank rows then time the same (token, expert)
pairs — the same experts touched, the same bytes — instead of a draw of their own (at T=64 the
two draws touched 33 and 29 of the rank's 48 experts in earlier runs).

Usage (on the GPU machine, torch with CUDA):
  python3 scripts/peer_routing.py --peer .peers/triton_kernels_moe.py --out routing.json \
      [--tokens 1,8,64,512,4096,16384] [--seed 0]
Format: bench/routing.rs (`{"experts", "topk", "tokens": {"T": {"ids", "weights"}}}`).
"""
import argparse
import importlib.util
import json

import torch


def load_peer(path):
    spec = importlib.util.spec_from_file_location("peer_triton_kernels_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # defines functions only: nothing runs without its main()
    return mod


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default=".peers/triton_kernels_moe.py")
    p.add_argument("--out", required=True)
    # The peer's defaults (its own argparse): change them together with the peer's command line.
    p.add_argument("--tokens", default="1,8,64,512,4096,16384")
    p.add_argument("--n-experts-total", type=int, default=384)
    p.add_argument("--n-experts-local", type=int, default=48)
    p.add_argument("--local-start", type=int, default=0)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--min-pairs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    peer = load_peer(a.peer)
    dev = torch.device("cuda")
    doc = {
        "source": f"{a.peer} draw_routing, seed {a.seed} * 1000003 + T, local [{a.local_start}, "
                  f"{a.local_start + a.n_experts_local})",
        "experts": a.n_experts_total,
        "topk": a.topk,
        "tokens": {},
    }
    for t in [int(s) for s in a.tokens.split(",") if s]:
        gen = torch.Generator(device=dev)
        gen.manual_seed(a.seed * 1000003 + t)
        ids, w = peer.draw_routing(t, a.n_experts_total, a.topk, a.local_start, a.n_experts_local,
                                   a.min_pairs, gen, dev)
        ids = ids.to(torch.int64).cpu()
        local = (ids >= a.local_start) & (ids < a.local_start + a.n_experts_local)
        active = torch.unique(ids[local]).numel()
        print(f"T={t:6d}: {int(local.sum())} local pairs, {active} of {a.n_experts_local} experts")
        doc["tokens"][str(t)] = {"ids": ids.reshape(-1).tolist(), "weights": w.cpu().reshape(-1).tolist()}
    with open(a.out, "w") as f:
        json.dump(doc, f)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
