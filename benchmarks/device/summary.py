"""One line per job of a bench results.jsonl: python3 benchmarks/device/summary.py RESULTS.jsonl..."""
import json
import sys

KEYS = ("output_throughput", "mean_step_ms", "mean_host_ms", "median_ttft_ms", "p99_ttft_ms", "graph_share",
        "cached_token_share", "completed")
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        print(r.get("name"), r.get("status"), *(f"{k}={r[k]:.2f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
                                                for k in KEYS if k in r), r.get("error", "")[:200])
