#!/usr/bin/env python3
"""The A/B table of a staged device call: `ab_table.py DIR BUILD...` reads DIR/ab_<build>_<spec>_r<round>.json
(`megamoe bench forward --json` output) and prints, per (spec, shape, row kind, T), every build's
median ms per round and the change of its best round against the last build named (the baseline).
Build and spec names must not contain underscores (the file name's fields)."""
import collections
import glob
import json
import sys


def main():
    folder, builds = sys.argv[1], sys.argv[2:]
    rows = collections.defaultdict(list)
    for f in sorted(glob.glob(folder + "/ab_*_r*.json")):
        build, spec = f.rsplit("/", 1)[1].split("_")[1:3]
        for r in json.load(open(f))["rows"]:
            rows[(spec, r["shape"], r.get("kind", "?"), r["T"], build)].append(r["median_ms"])
    base = builds[-1]
    for key in sorted({k[:4] for k in rows}):
        ref = min(rows.get(key + (base,), [0.0]))
        cells = []
        for b in builds:
            ms = rows.get(key + (b,), [])
            pct = 100.0 * (min(ms) - ref) / ref if ms and ref else 0.0
            cells.append("%s %s (%+.2f%%)" % (b, ["%.4f" % v for v in ms], pct))
        print(key, " ".join(cells))


if __name__ == "__main__":
    main()
