#!/usr/bin/env python3
"""Roofline plot of MoE timings: `megamoe bench forward --json` outputs and the peers' JSON outputs.

    python3 scripts/plot_roofline.py bench.json [peers_torch.json peers_triton.json ...] --out roofline.png

Axes (log-log): x = useful FLOPs per byte that must move, y = achieved TFLOP/s (useful FLOPs over the
median time). The two ceilings (copy bandwidth x intensity, and the bf16 matmul rate) come from the first
file that has them, normally the first file given: megamoe's `copy_tbs` / `bf16_tflops`, the torch
baselines' `copy_TBps` / `bf16_TFLOPs` (triton_kernels' output has none).

Inputs, recognised by their keys:
  - megamoe (`bench forward --json`): rows with `bytes`, `flops`, `median_ms`, `T`, `family`, `kind`;
    one series per file, family and kind (rank, rank+shared, whole-layer).
  - `torch_baselines.py --json` (../shared/peers): {copy_TBps, bf16_TFLOPs, rows: [{T, experts_used,
    pairs, seed_loop_ms, bf16_loop_ms, grouped_mm_ms}]}; one series per method.
  - `triton_kernels_moe.py --json`: {meta: {args: {hidden, inter, ...}}, results: [{variant, T, n_pairs,
    experts_used, graph_total_ms | total_ms}]} (rows with `error` skipped); one series per variant.
  Peers' points use megamoe's cost model on the V4-Pro EP8 rank (H 7168, I 3072 unless the file says
  otherwise): bytes = experts_used x 3 x H x I x bytes/weight (NVFP4 0.5625 for the torch peers, whose
  weights are NVFP4-sourced; MXFP4 0.53125 for triton_kernels) + x read (T x H x 2) + y written
  (T x H x 4); FLOPs = 2 x pairs x 3 x H x I. So every point sits at the problem's own intensity.

Every point is labelled with its T. Needs matplotlib (not a project dependency; e.g.
`pip install --target target/pydeps-plot matplotlib` and PYTHONPATH=target/pydeps-plot).
"""
import argparse
import json
import os
import sys

# DESIGN.md's H200 figures, used only when no input carries ceilings.
DEFAULT_COPY_TBS = 4.28
DEFAULT_BF16_TFLOPS = 761.0
V4_PRO_H, V4_PRO_I = 7168, 3072
NVFP4_BPW = 0.5 + 1 / 16
MXFP4_BPW = 0.5 + 1 / 32
TORCH_METHODS = [("seed_loop_ms", "seed loop"), ("bf16_loop_ms", "bf16 loop"), ("grouped_mm_ms", "grouped_mm")]


def peer_point(t, pairs, used, ms, h, i, bpw):
    """(T, FLOP/byte, TFLOP/s) of a peer row under megamoe's cost model."""
    bytes_ = used * 3 * h * i * bpw + t * h * (2 + 4)
    flops = 2.0 * pairs * 3 * h * i
    return t, flops / bytes_, flops / (ms * 1e-3) / 1e12


def load(path):
    """Returns (ceilings or None, {series label: [(T, intensity, TFLOP/s)]}) of one file."""
    with open(path) as f:
        doc = json.load(f)
    name = os.path.splitext(os.path.basename(path))[0]
    series = {}

    def add(label, point):
        series.setdefault(label, []).append(point)

    if isinstance(doc, dict) and "results" in doc:  # triton_kernels_moe.py
        args = (doc.get("meta") or {}).get("args") or {}
        h, i = int(args.get("hidden", V4_PRO_H)), int(args.get("inter", V4_PRO_I))
        for r in doc["results"]:
            if "error" in r:
                continue
            ms = r.get("graph_total_ms", r.get("total_ms"))
            pairs = r.get("n_pairs", r.get("pairs"))
            if ms is None or pairs is None or not ms > 0:
                continue
            add(f"{name}: triton_kernels {r.get('variant', '?')}",
                peer_point(r["T"], pairs, r["experts_used"], ms, h, i, MXFP4_BPW))
        return None, series
    rows = doc.get("rows", []) if isinstance(doc, dict) else []
    if "copy_TBps" in doc:  # torch_baselines.py
        for r in rows:
            for key, label in TORCH_METHODS:
                if r.get(key):
                    add(f"{name}: torch {label}",
                        peer_point(r["T"], r["pairs"], r["experts_used"], r[key], V4_PRO_H, V4_PRO_I, NVFP4_BPW))
        return (doc["copy_TBps"], doc["bf16_TFLOPs"]), series
    if "copy_tbs" in doc or any("flops" in r for r in rows):  # megamoe bench forward
        for r in rows:
            if not (r.get("median_ms", 0) > 0 and r.get("bytes", 0) > 0 and r.get("flops", 0) > 0):
                continue
            label = f"{name}: megamoe {r.get('family', '?')} {r.get('kind', '')} {r.get('mode', '')}".rstrip()
            add(label, (r["T"], r["flops"] / r["bytes"], r["flops"] / (r["median_ms"] * 1e-3) / 1e12))
        ceil = (doc["copy_tbs"], doc["bf16_tflops"]) if "copy_tbs" in doc and "bf16_tflops" in doc else None
        return ceil, series
    raise SystemExit(f"{path}: not a megamoe bench, torch_baselines or triton_kernels_moe JSON")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", metavar="JSON")
    ap.add_argument("--out", required=True, metavar="PNG")
    ap.add_argument("--title", default="MoE roofline")
    a = ap.parse_args(argv)

    loaded = [(p, *load(p)) for p in a.inputs]
    ceil = next((c for _, c, _ in loaded if c), None)
    if ceil is None:
        print(f"warning: no input has ceilings; using DESIGN.md's {DEFAULT_COPY_TBS} TB/s and "
              f"{DEFAULT_BF16_TFLOPS} TFLOP/s", file=sys.stderr)
        ceil = (DEFAULT_COPY_TBS, DEFAULT_BF16_TFLOPS)
    elif loaded[0][1] is None:
        src = next(p for p, c, _ in loaded if c)
        print(f"note: {a.inputs[0]} has no ceilings; taking them from {src}", file=sys.stderr)
    copy, bf16 = ceil
    points = [pt for _, _, s in loaded for pts in s.values() for pt in pts]
    if not points:
        raise SystemExit("no timed rows in the inputs")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p[1] for p in points]
    ridge = bf16 / copy
    lo, hi = min(min(xs), ridge) / 3, max(max(xs), ridge) * 3
    fig, ax = plt.subplots(figsize=(10, 7))
    grid = [lo * (hi / lo) ** (j / 200) for j in range(201)]
    ax.plot(grid, [min(copy * x, bf16) for x in grid], color="black", lw=2,
            label=f"roof: copy {copy:.2f} TB/s, bf16 {bf16:.0f} TFLOP/s")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    markers = "osD^v<>pP*Xh"
    n = 0
    for fi, (path, _, series) in enumerate(loaded):
        for label, pts in series.items():
            pts = sorted(pts)
            color = f"C{n % 10}"
            n += 1
            ax.plot([p[1] for p in pts], [p[2] for p in pts], marker=markers[fi % len(markers)], color=color,
                    ls="-", lw=1, ms=6, label=label)
            for t, x, y in pts:
                ax.annotate(f"{t}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ys = [p[2] for p in points]
    ax.set_ylim(min(min(ys), copy * lo) / 2, bf16 * 2)
    ax.set_xlabel("arithmetic intensity (useful FLOP / byte that must move)")
    ax.set_ylabel("TFLOP/s (useful FLOPs / median time)")
    ax.set_title(a.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=130)
    print(f"wrote {a.out} ({n} series, {len(points)} points)")


if __name__ == "__main__":
    main()
