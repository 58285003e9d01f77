"""Discovery from Envoy's admin: the pool is an EDS cluster fed from a file;
the filter has no static list and follows Envoy's view of the hosts."""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import yaml

from harness import (
    WASM_FAULT,
    Envoy,
    backends,
    completion,
    free_port,
    render_config,
    request,
    stat_label,
    vllm_metrics,
    wait_until,
    wasm_http_filter,
)


def eds(path: Path, addrs: list[str]):
    """Replace the EDS file atomically (Envoy watches for the move)."""
    doc = {
        "resources": [
            {
                "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                "cluster_name": "pool",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": a.rsplit(":", 1)[0],
                                            "port_value": int(a.rsplit(":", 1)[1]),
                                        }
                                    }
                                }
                            }
                            for a in addrs
                        ]
                    }
                ],
            }
        ]
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


def config(eds_path: Path, plugin: dict) -> dict:
    admin_port = free_port()
    cfg = render_config("override_host", plugin, [], free_port(), admin_port)
    cfg["node"] = {"id": "prefix-router-e2e", "cluster": "e2e"}  # needed for EDS
    pool = cfg["static_resources"]["clusters"][0]
    pool["type"] = "EDS"
    del pool["load_assignment"]
    pool["eds_cluster_config"] = {"eds_config": {"path_config_source": {"path": str(eds_path)}}}
    # The route to Envoy's own admin that discovery reads through. Only the
    # filter's callouts use it: no route points at it.
    cfg["static_resources"]["clusters"].append(
        {
            "name": "envoy_admin",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": "envoy_admin",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {"address": "127.0.0.1", "port_value": admin_port}
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
    )
    return cfg


def hcm_of(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def served_by(port: int, n: int) -> Counter:
    c = Counter()
    for i in range(n):
        status, headers, _ = request(port, body=completion(f"discovery {i} " * 10))
        assert status == 200
        c[headers["x-served-by"]] += 1
    return c


def wait_stat(envoy, name: str, value: int, seconds: float = 10, poll: float = 0.1) -> float:
    """Wait until a stat reads `value` (asserted); the seconds it took."""
    start = time.time()
    while time.time() < start + seconds and envoy.stat(name) != value:
        time.sleep(poll)
    assert envoy.stat(name) == value, name
    return time.time() - start


def discovering(interval_ms: int = 200, **plugin) -> dict:
    """A plugin config that discovers the `pool` cluster through
    `envoy_admin` and scrapes through the pool."""
    return {
        "discovery": {"cluster": "pool", "admin_cluster": "envoy_admin", "interval_ms": interval_ms},
        "cluster": "pool",
        **plugin,
    }


def test_pool_follows_envoys_hosts(tmp_path):
    with backends(3, metrics=vllm_metrics(running=2, kv=0.3)) as (a, b, c):
        path = tmp_path / "eds.yaml"
        eds(path, [a.addr, b.addr])
        plugin = discovering(max_fallbacks=1)
        with Envoy(config(path, plugin), concurrency=2) as envoy:
            wait_stat(envoy, "prefix_router.discovery.hosts", 2)
            time.sleep(0.5)
            first = served_by(envoy.port, 40)
            assert set(first) == {str(a.port), str(b.port)}, first
            gone = f"prefix_router.replica.{stat_label(a.addr)}"
            shown = lambda: (envoy.stat(f"{gone}.running"), envoy.stat(f"{gone}.kv_usage_percent"))  # noqa: E731
            # Set by the scraper when its page comes back: polled.
            assert wait_until(lambda: shown() == (2, 30)), shown()
            # The pool changes in Envoy: a leaves, c joins.
            eds(path, [b.addr, c.addr])
            deadline = time.time() + 10
            while time.time() < deadline:
                time.sleep(0.3)
                now = served_by(envoy.port, 20)
                if set(now) == {str(b.port), str(c.port)}:
                    break
            assert set(now) == {str(b.port), str(c.port)}, now
            a_before = a.count
            assert set(served_by(envoy.port, 40)) == {str(b.port), str(c.port)}
            assert a.count == a_before
            assert envoy.stat("prefix_router.discovery.failures") == 0
            # A replica that left shows no load (Envoy keeps the stat).
            # Zeroed on the ticks that see it gone (the scraper's, each VM's).
            left = lambda: {g: envoy.stat(f"{gone}.{g}") for g in ["running", "kv_usage_percent", "inflight"]}  # noqa: E731
            assert wait_until(lambda: not any(left().values())), left()


def test_discovery_keeps_its_own_interval_when_scrapes_are_rarer(tmp_path):
    # Scrapes every 5 s, discovery every 200 ms: a host that joins shows in
    # the discovered pool within a second or two, not at the next scrape.
    with backends(3, metrics=vllm_metrics(running=1, kv=0.1)) as (a, b, c):
        path = tmp_path / "eds.yaml"
        eds(path, [a.addr, b.addr])
        plugin = discovering(scrape_interval_ms=5000, staleness_ms=20000)
        with Envoy(config(path, plugin), concurrency=1) as envoy:
            wait_stat(envoy, "prefix_router.discovery.hosts", 2, poll=0.05)
            # Right after a scrape round: the next one is ~5 s away.
            eds(path, [a.addr, b.addr, c.addr])
            took = wait_stat(envoy, "prefix_router.discovery.hosts", 3, poll=0.05)
            assert took < 3.0, f"the new host was discovered {took:.1f} s later"


def test_a_reloaded_vm_routes_to_the_discovered_pool_at_once(tmp_path):
    # FAIL_RELOAD recreates a trapped VM on the next request, and that
    # request is served by a root context that has not ticked yet. The
    # discovered pool is in shared data already: read at configure time,
    # not a tick (here a second) later, when a discovery-only pool had no
    # replica and every request until then got a 503.
    with backends(2, metrics=vllm_metrics()) as bs:
        path = tmp_path / "eds.yaml"
        eds(path, [b.addr for b in bs])
        plugin = discovering(1000, scrape_interval_ms=1000, tick_ms=1000, debug_trap_on_request=5)
        cfg = config(path, plugin)
        wasm = wasm_http_filter(hcm_of(cfg))["typed_config"]["config"]
        wasm["vm_config"]["code"]["local"]["filename"] = str(WASM_FAULT)
        wasm["failure_policy"] = "FAIL_RELOAD"
        wasm["reload_config"] = {"backoff": {"base_interval": "0.1s", "max_interval": "0.2s"}}
        with Envoy(cfg, concurrency=1) as envoy:
            wait_stat(envoy, "prefix_router.eligible_replicas", 2)
            results = []
            # Nine: the new VM counts from 1 again and would trap on its fifth.
            for i in range(9):
                results.append(request(envoy.port, body=completion(f"reload {i} " * 10))[0])
                time.sleep(0.05)
            assert envoy.stats().get("wasm.prefix-router.vm_reload_success", 0) >= 1
            # The fifth request trapped the VM; every other one was routed,
            # the ones right after the reload included.
            assert results[:4] == [200] * 4, results
            assert results[5:] == [200] * 4, results


def test_bad_admin_cluster_is_counted_and_traffic_still_flows_to_the_static_list(tmp_path):
    with backends(2, metrics=vllm_metrics()) as bs:
        path = tmp_path / "eds.yaml"
        eds(path, [b.addr for b in bs])
        plugin = {
            "endpoints": [bs[0].addr],
            "discovery": {"cluster": "no-such-cluster", "admin_cluster": "envoy_admin", "interval_ms": 100},
        }
        with Envoy(config(path, plugin), concurrency=2) as envoy:
            assert wait_until(lambda: envoy.stat("prefix_router.discovery.failures") >= 3), envoy.stat(
                "prefix_router.discovery.failures"
            )
            assert served_by(envoy.port, 10) == Counter({str(bs[0].port): 10})
