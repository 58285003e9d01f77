"""Discovery at mesh scale: on an Istio gateway Envoy's admin /clusters lists
every cluster in the mesh, and the filter parses that page in the wasm VM on
every poll. With 1,000 other clusters (about 2 MB of admin JSON) it still
finds the pool and routes. bench/discovery_scale.py measures the cost (page
size, CPU) at 1,000 and 5,000."""
from __future__ import annotations

import json
import sys
import urllib.request

from harness import ROOT, Envoy, backends, completion, request, wait_until

sys.path.insert(0, str(ROOT / "bench"))

from discovery_scale import MAX_ADMIN_BYTES, scale_config  # noqa: E402

EXTRA = 1000


def test_discovery_finds_the_pool_among_1000_other_clusters():
    with backends(3) as bs:
        pool = [b.addr for b in bs]
        cfg = scale_config(pool, EXTRA, discovery=True, interval_ms=200)
        with Envoy(cfg, concurrency=2) as envoy:
            assert wait_until(lambda: envoy.stat("prefix_router.discovery.hosts") == 3, timeout=20, step=0.2), (
                envoy.log()[-3000:]
            )
            # The page the filter parsed really is mesh-sized, and under
            # the filter's limit.
            url = f"http://127.0.0.1:{envoy.admin_port}/clusters?format=json"
            with urllib.request.urlopen(url, timeout=30) as r:
                body = r.read()
            assert len(json.loads(body)["cluster_statuses"]) >= EXTRA + 2
            assert 1 << 20 < len(body) < MAX_ADMIN_BYTES, len(body)
            ports = {str(b.port) for b in bs}
            for i in range(20):
                status, headers, _ = request(envoy.port, body=completion(f"mesh scale {i} " * 20))
                assert status == 200
                assert headers["x-served-by"] in ports
            assert sum(b.count for b in bs) == 20
            # Several polls of the full page went by, none failed.
            assert wait_until(lambda: envoy.stat("cluster.envoy_admin.upstream_rq_total") >= 2, timeout=5)
            assert envoy.stat("prefix_router.discovery.failures") == 0


def test_discovery_asks_envoy_for_the_pool_cluster_only():
    """5,000 other clusters: the full admin page (~10 MB) is over the
    filter's 8 MiB read limit, so the filter asks for its cluster only
    (`filter=^pool$`, Envoy >= 1.38; a few KB). Envoy 1.36/1.37 ignore the
    parameter: there discovery fails at this size and the README says to
    keep a static `endpoints` list on such meshes."""
    from harness import envoy_version

    with backends(3) as bs:
        pool = [b.addr for b in bs]
        cfg = scale_config(pool, 5000, discovery=True, interval_ms=200)
        with Envoy(cfg, concurrency=2) as envoy:
            major, minor = (int(x) for x in envoy_version().split(".")[:2])
            if (major, minor) >= (1, 38):
                assert wait_until(
                    lambda: envoy.stat("prefix_router.discovery.hosts") == 3, timeout=30, step=0.2
                ), envoy.log()[-3000:]
                for i in range(10):
                    status, _, _ = request(envoy.port, body=completion(f"big mesh {i} " * 20))
                    assert status == 200
                assert envoy.stat("prefix_router.discovery.failures") == 0
            else:
                assert wait_until(lambda: envoy.stat("prefix_router.discovery.failures") >= 1, timeout=30)
                assert envoy.stat("prefix_router.discovery.hosts") == 0
