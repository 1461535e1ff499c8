"""Top stalled SASS instructions of an Nsight Compute source page (``ncu -i R --page source --csv --print-source
sass``): prints each stall reason's share of all samples and the instructions with the most samples, with their
largest reasons. Usage: ``python stall_top.py um_sass.csv[.gz] [N]``."""
import csv
import gzip
import sys

path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 25
with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
    rows = list(csv.reader(f))
head = next(r for r in rows if r and r[0] == "Address")
data = [r for r in rows[rows.index(head) + 1:] if len(r) == len(head)]
col = {h: i for i, h in enumerate(head)}
reasons = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]


def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0


total = sum(num(r[col["Warp Stall Sampling (All Samples)"]]) for r in data)
print(f"samples {total:.0f}")
for h in sorted(reasons, key=lambda h: -sum(num(r[col[h]]) for r in data))[:8]:
    print(f"  {h}: {100 * sum(num(r[col[h]]) for r in data) / total:.1f}%")
top = sorted(data, key=lambda r: -num(r[col["Warp Stall Sampling (All Samples)"]]))[:n]
for r in top:
    s = num(r[col["Warp Stall Sampling (All Samples)"]])
    why = sorted(((num(r[col[h]]), h[6:]) for h in reasons), reverse=True)[:2]
    idx = data.index(r)
    print(f"{100 * s / total:5.1f}%  #{idx:4d}  {r[col['Source']].strip()[:60]:60s} {why}")
