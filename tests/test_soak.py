"""The soak at CI size: three phases of a fixed number of mixed requests against `fluxlab serve`.

Correctness only (no error, no page, no memory left behind): a phase runs its requests to the end
however long that takes on a loaded machine. Throughput is the soak benchmark's to report
(`python -m fluxlab.bench.soak`, docs/server.md § Soak), never a test's to assert.
"""
from __future__ import annotations

import math
from collections import Counter

from fluxlab.bench.soak import KINDS, soak
from server_helpers import MODEL, TINY, ServerProcess

REQUESTS_PER_PHASE = 40


def test_a_mixed_load_leaves_no_error_no_page_and_no_memory_behind(tmp_path):
    server = ServerProcess(TINY, tmp_path)
    try:
        report = soak(server.url, MODEL, phases=3, phase_seconds=math.inf, max_requests=REQUESTS_PER_PHASE,
                      concurrency=6, max_tokens=32, seed=0, pid=server.proc.pid)
    finally:
        server.stop()
    print("\n" + report.table())
    assert report.failures == []
    assert report.server_errors == 0
    for phase in report.phases:
        assert phase.requests == REQUESTS_PER_PHASE, phase
        assert sum(phase.by_kind.values()) == REQUESTS_PER_PHASE, phase.by_kind
        assert phase.kv_free_pages == phase.kv_total_pages
        assert set(phase.statuses) <= {"200", "400", "404", "abandoned"}, phase.statuses
    assert set(sum((Counter(p.by_kind) for p in report.phases), Counter())) == set(KINDS)
    # memory is flat after the first phase (which pays for warm-up allocations)
    rss = [p.rss_mib for p in report.phases]
    assert rss[-1] - rss[0] < max(64.0, 0.15 * rss[0]), rss
