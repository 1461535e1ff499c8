"""One line per timed row of ``benchmarks/mma_attention_gpu.py --sweep``: batch, context, switch set, config, whole
call (us), % of the copy bandwidth, speedup over dense / byte ratio, registers, per-kernel device times (us).

Usage: ``python3 sweep_rows.py FILE`` where FILE is the sweep's ``sweep.json`` or its log (JSON lines; what a sweep
cut off by its time limit leaves)."""
import json
import sys


def rows(path: str) -> list[dict]:
    if path.endswith(".json"):
        return json.load(open(path))["rows"]
    return [json.loads(line) for line in open(path) if line.startswith("{")]


for r in rows(sys.argv[1]):
    ku = r.get("kernel_us")
    ku = {k.split(":")[1][:8]: round(v, 1) for k, v in ku.items()} if isinstance(ku, dict) else ku
    print(r["b"], r["t"], r["variant"], r["config"].replace("mma bn=64 ", "").replace(" split_d=None one_pass=None", ""),
          round(r["ms"] * 1000, 1), round(100 * r["copy_share"], 1), round(r["speedup_over_byte_ratio"], 3),
          r.get("regs"), ku)
