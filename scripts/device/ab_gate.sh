#!/usr/bin/env bash
# Runs THERE: an A/B of this build against .device-carry/old/megamoe (run.sh AB_OLD, AB_* knobs as
# run.sh reads them), then — only when this build's median is at least GATE_PCT percent lower than
# the old one's on GATE_SHAPE at GATE_T — run.sh again for the correctness steps, under the caller's
# environment (its knobs: TEST_FILTER, SANITIZE_TESTS, ...; set TIMINGS=0 NCU=0 there, and pass
# AB_OLD only through this script), so a losing candidate costs no test time.
# Env: GATE_SHAPE (default v4-pro), GATE_T (4096), GATE_PCT (0.5), FORCE=1 (the checks regardless).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/megamoe-out}"; mkdir -p "$OUT"
OUT="$OUT/ab" SKIP_TESTS=1 SKIP_VERIFY=1 SKIP_DEMO=1 SANITIZE=0 TIMINGS=0 NCU=0 \
  AB_OLD="${AB_OLD:-$here/old/megamoe}" bash "$here/run.sh" | grep -vE "^\s*$" | tail -n 40
verdict=$(python3 - "$OUT/ab/logs.tgz" "${GATE_SHAPE:-v4-pro}" "${GATE_T:-4096}" "${GATE_PCT:-0.5}" <<'PY'
import json, statistics, sys, tarfile
tgz, shape, t, pct = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
ms = {"new": [], "old": []}
with tarfile.open(tgz) as tar:
    for m in tar.getmembers():
        name = m.name.rsplit("/", 1)[-1]
        if not (name.startswith("ab_") and name.endswith(".json")):
            continue
        which = name.split("_")[1]
        for r in json.load(tar.extractfile(m))["rows"]:
            # The routed experts' rows only (a spec's rank + shared rows share its shape and T).
            if r["shape"] == shape and r["T"] == t and r.get("kind") == "rank" and which in ms:
                ms[which].append(r["median_ms"])
if not ms["new"] or not ms["old"]:
    print("no-rows"); sys.exit()
new, old = statistics.median(ms["new"]), statistics.median(ms["old"])
gain = 100.0 * (old - new) / old
print(f"{'win' if gain >= pct else 'lose'} new {new:.4f} old {old:.4f} ms ({gain:+.2f}%) on {shape} T={t}")
PY
)
echo "=== gate: $verdict"
if [ "${verdict%% *}" = win ] || [ "${FORCE:-0}" = 1 ]; then
  OUT="$OUT/checks" bash "$here/run.sh" | grep -vE "^\s*$" | tail -n 40
fi
exit 0
