"""The soak at CI size: three short phases of mixed load against `fluxlab serve` on loopback."""
from __future__ import annotations

from fluxlab.bench.soak import KINDS, soak
from server_helpers import MODEL, TINY, ServerProcess


def test_a_mixed_load_leaves_no_error_no_page_and_no_memory_behind(tmp_path):
    server = ServerProcess(TINY, tmp_path)
    try:
        report = soak(server.url, MODEL, phases=3, phase_seconds=7, max_requests=200, concurrency=6, max_tokens=32,
                      seed=0, pid=server.proc.pid)
    finally:
        server.stop()
    print("\n" + report.table())
    assert report.failures == []
    assert report.server_errors == 0
    for phase in report.phases:
        assert phase.requests >= 50, phase  # it really loaded the server
        assert set(phase.by_kind) == set(KINDS), phase.by_kind
        assert phase.kv_free_pages == phase.kv_total_pages
        assert set(phase.statuses) <= {"200", "400", "404", "abandoned"}, phase.statuses
    # memory is flat after the first phase (which pays for warm-up allocations)
    rss = [p.rss_mib for p in report.phases]
    assert rss[-1] - rss[0] < max(64.0, 0.15 * rss[0]), rss
