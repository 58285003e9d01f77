"""Discovery at mesh scale: what polling Envoy's admin `/clusters?format=json`
costs when the Envoy knows thousands of clusters (an Istio gateway lists
every service in the mesh).

For each size N (default 0, 1000, 5000), one static Envoy config: the pool
cluster (3 loopback backends), the admin cluster, prefix-router, and N extra
clusters named like Istio's (`outbound|8080||svc-17.ns-17.svc.cluster.local`)
with 1-3 endpoints each on 127.0.0.1 ports nothing listens on (no health
checks, no traffic: Envoy never connects to them). Envoy runs twice per
size: discovery on (`interval_ms`, default 1000, no static list) and off
(the same pool as a static `endpoints` list). Measured:

- the admin page: bytes of `/clusters?format=json`, the time to serve it
  and Envoy's CPU per fetch, and the same for
  `/clusters?format=json&filter=^pool$` (the `filter` parameter exists from
  Envoy 1.38; older Envoys ignore it and send everything);
- Envoy's CPU while idle: utime+stime of the Envoy process (all threads,
  /proc/<pid>/stat) over `--seconds`, as % of one core, and the number of
  discovery polls in that window (cluster.envoy_admin.upstream_rq_total);
- whether discovery still works: the `prefix_router.discovery.hosts` gauge
  equals the pool size, no `discovery.failures`, and requests route to the
  pool;
- resident memory (VmRSS) after the window.

    .venv/bin/python bench/discovery_scale.py [--clusters 0,1000,5000]
        [--seconds 20] [--interval-ms 1000] [--concurrency 2] [--out target/discovery-scale]

PREFIX_ROUTER_ENVOY=/path/to/envoy measures another Envoy build. Every
Envoy is killed by pid when its measurement ends (the test harness's Envoy).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
try:
    from testkit import harness  # noqa: E402
except ImportError:  # a tree from before the harness moved to testkit/
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    import harness  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
POOL_SIZE = 3
# The filter refuses a larger admin answer (src/host/scrape.rs MAX_ADMIN_BYTES).
MAX_ADMIN_BYTES = 8 << 20
ADMIN_CLUSTER = "envoy_admin"


# --------------------------------------------------------------------------
# Config


def socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def static_cluster(name: str, addrs: list[tuple[str, int]]) -> dict:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(h, p)}} for h, p in addrs]}],
        },
    }


def mesh_clusters(n: int) -> list[dict]:
    """N clusters named like an Istio gateway's outbound clusters, with
    1-3 endpoints each on loopback ports nobody listens on (Envoy never
    connects: no health checks, no routes)."""
    out = []
    for i in range(n):
        name = f"outbound|8080||svc-{i}.ns-{i % 97}.svc.cluster.local"
        hosts = [("127.0.0.1", 20000 + (i * 3 + j) % 20000) for j in range(1 + i % 3)]
        out.append(static_cluster(name, hosts))
    return out


def scale_config(pool: list[str], extra_clusters: int, discovery: bool, interval_ms: int = 1000) -> dict:
    """The dev override_host config with the pool, an admin cluster, the
    filter in discovery mode (or with the pool as a static list), and
    `extra_clusters` mesh clusters."""
    admin_port = harness.free_port()
    if discovery:
        plugin = {"discovery": {"cluster": "pool", "admin_cluster": ADMIN_CLUSTER, "interval_ms": interval_ms}}
    else:
        plugin = {"endpoints": pool}
    cfg = harness.render_config("override_host", plugin, pool, harness.free_port(), admin_port)
    clusters = cfg["static_resources"]["clusters"]
    assert clusters[0]["name"] == "pool"
    clusters.append(static_cluster(ADMIN_CLUSTER, [("127.0.0.1", admin_port)]))
    clusters.extend(mesh_clusters(extra_clusters))
    return cfg


# --------------------------------------------------------------------------
# Measuring


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def admin_get(port: int, path: str, timeout: float = 30) -> tuple[int, bytes, float]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        body = r.read()
        return r.status, body, time.perf_counter() - t0


def page(port: int, pid: int, query: str = "", reps: int = 5) -> dict:
    """Size, median serve time and Envoy CPU per fetch of
    /clusters?format=json[&query]."""
    path = "/clusters?format=json" + (f"&{query}" if query else "")
    sizes, times = [], []
    c0 = cpu_seconds(pid)
    for _ in range(reps):
        status, body, dt = admin_get(port, path)
        assert status == 200, (path, status)
        sizes.append(len(body))
        times.append(dt)
    cpu_ms = 1000 * (cpu_seconds(pid) - c0) / reps
    names = len(json.loads(body).get("cluster_statuses", []))
    return {"bytes": max(sizes), "ms": statistics.median(times) * 1000, "cpu_ms": round(cpu_ms, 1), "clusters": names}


def measure(n: int, discovery: bool, seconds: float, interval_ms: int, concurrency: int) -> dict:
    with harness.backends(POOL_SIZE) as bs:
        pool = [b.addr for b in bs]
        cfg = scale_config(pool, n, discovery, interval_ms)
        t0 = time.time()
        with harness.Envoy(cfg, concurrency=concurrency) as envoy:
            ready_s = time.time() - t0
            pid = envoy.proc.pid
            out: dict = {"clusters": n, "discovery": discovery, "ready_s": round(ready_s, 2)}
            if discovery:
                found = harness.wait_until(
                    lambda: envoy.stat("prefix_router.discovery.hosts") == POOL_SIZE,
                    timeout=max(15, 5 * interval_ms / 1000), step=0.2,
                )
                out["discovered_hosts"] = envoy.stat("prefix_router.discovery.hosts")
                out["discovery_ok"] = found
            # Route: every request to a pool member.
            ports = {str(b.port) for b in bs}
            statuses = []
            for i in range(20):
                status, headers, _ = harness.request(envoy.port, body=harness.completion(f"scale {i} " * 20))
                statuses.append(status == 200 and headers.get("x-served-by") in ports)
            out["routed_ok"] = f"{sum(statuses)}/{len(statuses)}"
            time.sleep(1.0)  # let the request work settle before the idle window
            polls0 = envoy.stat(f"cluster.{ADMIN_CLUSTER}.upstream_rq_total")
            c0, w0 = cpu_seconds(pid), time.time()
            time.sleep(seconds)
            c1, w1 = cpu_seconds(pid), time.time()
            polls = envoy.stat(f"cluster.{ADMIN_CLUSTER}.upstream_rq_total") - polls0
            out["cpu_pct"] = round(100 * (c1 - c0) / (w1 - w0), 2)
            out["polls"] = polls
            out["cpu_ms_per_poll"] = round(1000 * (c1 - c0) / polls, 1) if polls else None
            out["rss_mib"] = round(rss_mib(pid), 1)
            out["discovery_failures"] = envoy.stat("prefix_router.discovery.failures")
            # The page last (its own serving would count as CPU otherwise).
            out["page"] = page(envoy.admin_port, pid)
            out["page_filtered"] = page(envoy.admin_port, pid, "filter=%5Epool%24")
            out["over_limit"] = out["page"]["bytes"] > MAX_ADMIN_BYTES
            if discovery:
                out["log_discovery_errors"] = [
                    line[-300:] for line in envoy.log().splitlines() if "discovery from" in line
                ][:3]
            return out


# --------------------------------------------------------------------------
# Report


def report(rows: list[dict], args, version: str) -> str:
    lines = [
        "# Discovery at mesh scale",
        "",
        f"Envoy {version}, --concurrency {args.concurrency}, discovery interval {args.interval_ms} ms, "
        f"idle window {args.seconds:.0f} s, pool of {POOL_SIZE}; extra clusters have 1-3 endpoints "
        "(2 on average). CPU is the Envoy process's utime+stime over the window, in % of one core.",
        "",
        "| extra clusters | discovery | /clusters JSON bytes | serve ms (CPU ms) | `filter=^pool$` bytes "
        "(clusters; CPU ms) | > 8 MiB | hosts found | routed | polls | CPU % | CPU ms/poll | RSS MiB | ready s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            "| {clusters} | {d} | {b:,} | {ms:.0f} ({cms}) | {fb:,} ({fc}; {fcms}) | {over} | {hosts} | {routed} | {polls} "
            "| {cpu} | {per} | {rss} | {ready} |".format(
                clusters=r["clusters"],
                d="on" if r["discovery"] else "off",
                b=r["page"]["bytes"],
                ms=r["page"]["ms"],
                cms=r["page"]["cpu_ms"],
                fb=r["page_filtered"]["bytes"],
                fc=r["page_filtered"]["clusters"],
                fcms=r["page_filtered"]["cpu_ms"],
                over="yes" if r["over_limit"] else "no",
                hosts=(f"{r['discovered_hosts']}/{POOL_SIZE}" + ("" if r["discovery_ok"] else " FAIL"))
                if r["discovery"] else "-",
                routed=r["routed_ok"],
                polls=r["polls"],
                cpu=r["cpu_pct"],
                per=r["cpu_ms_per_poll"] if r["discovery"] else "-",
                rss=r["rss_mib"],
                ready=r["ready_s"],
            )
        )
    sized = [r for r in rows if r["clusters"]]
    if sized:
        base = next((r for r in rows if r["clusters"] == 0), None)
        r = max(sized, key=lambda r: r["clusters"])
        per = (r["page"]["bytes"] - (base["page"]["bytes"] if base else 0)) / r["clusters"]
        lines += [
            "",
            f"About {per:,.0f} bytes of admin JSON per extra cluster (2 endpoints on average): "
            f"the 8 MiB limit is reached near {MAX_ADMIN_BYTES / per:,.0f} such clusters.",
        ]
    errors = [e for r in rows for e in r.get("log_discovery_errors", [])]
    if errors:
        lines += ["", "Discovery errors in Envoy's log:", ""] + [f"- `{e}`" for e in errors]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="0,1000,5000")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interval-ms", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "target" / "discovery-scale")
    args = ap.parse_args()
    if not harness.WASM.exists():
        sys.exit(f"{harness.WASM} is missing: run scripts/build first")
    version = harness.envoy_version()
    rows = []
    for n in (int(x) for x in args.clusters.split(",")):
        for discovery in (False, True):
            print(f"discovery-scale: {n} clusters, discovery {'on' if discovery else 'off'}", file=sys.stderr)
            rows.append(measure(n, discovery, args.seconds, args.interval_ms, args.concurrency))
    text = report(rows, args, version)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"envoy": version, "rows": rows}, indent=1))
    print(text)
    print(f"written to {args.out.with_suffix('.md')} and .json")
    bad = [r for r in rows if r["discovery"] and not r["discovery_ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
