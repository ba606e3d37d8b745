#!/usr/bin/env python3
"""Warp-stall summary of an ncu source page: `ncu -i REP --page source --csv --print-source sass > F.csv`
(scripts/device/run.sh NCU_DETAIL=1 writes one per GEMM family into logs.tgz), then
`python3 scripts/ncu_stalls.py F.csv [TOP]`: per kernel, the stall reasons summed over its SASS lines and
the TOP lines with the most samples (their three largest reasons)."""
import collections
import csv
import sys

f=sys.argv[1]; top=int(sys.argv[2]) if len(sys.argv)>2 else 25
rows=list(csv.reader(open(f)))
kern=None; hdr=None; data=collections.OrderedDict()
for r in rows:
    if not r: continue
    if r[0]=="Kernel Name": kern=r[1]+"#%d"%len(data); data[kern]=[]; continue
    if r[0]=="Address": hdr=r; continue
    if hdr and kern: data[kern].append(r)
for k,rs in data.items():
    H={h:i for i,h in enumerate(hdr)}
    cols=[h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot=collections.Counter()
    for r in rs:
        for c in cols:
            try: tot[c]+=int(r[H[c]])
            except: pass
    s=sum(tot.values())
    ins=sum(int(r[H["Instructions Executed"]] or 0) for r in rs)
    print("==",k,"samples",s,"instr",ins)
    print("  "+", ".join("%s %.1f%%"%(c[6:],100*v/s) for c,v in tot.most_common(10)))
    tops=sorted(rs,key=lambda r:-int(r[H["Warp Stall Sampling (All Samples)"]] or 0))[:top]
    for r in tops:
        st=sorted(((int(r[H[c]] or 0),c[6:]) for c in cols),reverse=True)[:3]
        print("   %6s %-60s %s"%(r[H["Warp Stall Sampling (All Samples)"]], r[1].strip()[:60], st))
