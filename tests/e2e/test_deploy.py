"""Deployment artefacts, checked against a real Envoy:

- envoy/envoy-production.yaml: validates as shipped, routes, retries on the
  fallback pick, exposes only /stats/prometheus and /ready, fails open
  without obeying a client's destination header;
- deploy/istio/*.yaml: well-formed Kubernetes/Istio objects whose Envoy
  fragments, assembled the way Istio applies them, validate and route
  (remote module with its sha256, discovery, override_host via MERGE, a
  2 MiB prompt through the buffer-limit patches), every patch guarded for
  Istio 1.27+ proxies;
- deploy/grafana + deploy/prometheus: every metric name in the dashboard
  and the alerts is one a real Envoy with the filter emits (after the
  scrape-time relabelling in prometheus.yml) or a vLLM metric;
- scripts/module-info.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import http.client
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from harness import (
    stat_label,
    wait_until,
    HEADER,
    ROOT,
    WASM,
    Envoy,
    backends,
    completion,
    envoy_bin,
    free_port,
    render_config,
    request,
    vllm_metrics,
)

PRODUCTION = ROOT / "envoy" / "envoy-production.yaml"
ISTIO = ROOT / "deploy" / "istio"
DASHBOARD = ROOT / "deploy" / "grafana" / "prefix-router.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
MODULE_INFO = ROOT / "scripts" / "module-info"

ISTIO_POOL_CLUSTER = "outbound|8000||vllm.default.svc.cluster.local"


# --------------------------------------------------------------------------
# Small helpers



def validate(cfg: dict) -> tuple[int, str]:
    """`envoy --mode validate` on a config (from the repository root, like
    the README's commands). Validation loads the module and runs the
    plugin's configuration check, so a bad plugin config fails here."""
    with tempfile.TemporaryDirectory(prefix="prefix-router-validate-") as d:
        path = Path(d) / "envoy.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return validate_file(path)


def validate_file(path: Path) -> tuple[int, str]:
    r = subprocess.run(
        [envoy_bin(), "--mode", "validate", "-c", str(path), "-l", "warn", "--disable-hot-restart"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    return r.returncode, r.stdout + r.stderr


def socket_address(addr: str) -> dict:
    host, port = addr.rsplit(":", 1)
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def lb_endpoints(pool: list[str]) -> list[dict]:
    return [{"endpoint": {"address": socket_address(a)}} for a in pool]


def http_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


@contextlib.contextmanager
def module_server():
    """Serve the built module over loopback HTTP (a stand-in for the
    artifact server a remote load fetches from)."""
    data = WASM.read_bytes()
    hits = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/wasm")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------
# The production bootstrap


def production_doc() -> dict:
    return yaml.safe_load(PRODUCTION.read_text())


def listeners(cfg: dict) -> dict:
    return {l["name"]: l for l in cfg["static_resources"]["listeners"]}


def clusters(cfg: dict) -> dict:
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def hcm(listener: dict) -> dict:
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def http_filter(listener: dict, name: str) -> dict:
    return next(f for f in hcm(listener)["http_filters"] if f["name"] == name)


def plugin_of(wasm_filter: dict) -> dict:
    return json.loads(wasm_filter["typed_config"]["config"]["configuration"]["value"])


def production(pool: list[str], **overrides) -> dict:
    """envoy-production.yaml on loopback ports, this build's module and the
    given pool; `overrides` are merged into the plugin configuration."""
    cfg = production_doc()
    admin_port = free_port()
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    ls = listeners(cfg)
    for name in ("inference", "metrics"):
        ls[name]["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}
    cs = clusters(cfg)
    cs["admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = lb_endpoints([f"127.0.0.1:{admin_port}"])
    cs["pool"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = lb_endpoints(pool)
    wasm = http_filter(ls["inference"], "prefix-router")
    wasm["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(WASM)
    plugin = plugin_of(wasm)
    plugin["endpoints"] = pool
    plugin.update(overrides)
    wasm["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin)
    return cfg


def metrics_port(cfg: dict) -> int:
    return listeners(cfg)["metrics"]["address"]["socket_address"]["port_value"]


def test_production_config_validates_as_shipped():
    rc, out = validate_file(PRODUCTION)
    assert rc == 0, out
    assert "OK" in out


def test_production_config_is_consistent_and_production_shaped():
    cfg = production_doc()
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    ls, cs = listeners(cfg), clusters(cfg)
    inference = ls["inference"]
    names = [f["name"] for f in hcm(inference)["http_filters"]]
    # The strip filter runs first, the router last, the plugin in between.
    assert names == ["strip-destination", "prefix-router", "envoy.filters.http.router"]
    strip = http_filter(inference, "strip-destination")["typed_config"]
    assert strip["mutations"]["request_mutations"] == [{"remove": HEADER}]
    wasm = http_filter(inference, "prefix-router")["typed_config"]["config"]
    assert wasm["allow_on_headers_stop_iteration"] is True
    assert wasm["failure_policy"] == "FAIL_OPEN"
    plugin = plugin_of(http_filter(inference, "prefix-router"))
    # Scraping goes through a cluster that exists, and the filter's list is
    # exactly the cluster's members (override_host ignores anything else).
    assert plugin["cluster"] in cs
    members = [
        "{address}:{port_value}".format(**e["endpoint"]["address"]["socket_address"])
        for e in cs[plugin["cluster"]]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert sorted(plugin["endpoints"]) == sorted(members)
    route = hcm(inference)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == plugin["cluster"]
    assert route["timeout"] == "0s"
    retry = route["retry_policy"]
    assert set(retry["retry_on"].split(",")) >= {"connect-failure", "reset-before-request", "refused-stream"}
    assert retry["retriable_status_codes"] == [503]
    # Retries walk the header's fallbacks: one retry per fallback.
    assert retry["num_retries"] == plugin["max_fallbacks"] == 1
    assert "per_try_timeout" not in retry  # would cut streamed generations
    assert hcm(inference)["stream_idle_timeout"]
    # The listener buffers at least the largest body the filter parses.
    assert inference["per_connection_buffer_limit_bytes"] >= plugin.get("max_body_bytes", 16 * 2**20)
    pool = cs["pool"]
    assert pool["health_checks"][0]["http_health_check"]["path"] == "/health"
    assert pool["outlier_detection"]["max_ejection_percent"] <= 50
    limits = pool["circuit_breakers"]["thresholds"][0]
    assert min(limits["max_requests"], limits["max_pending_requests"], limits["max_connections"]) >= 10000
    assert "retry_budget" in limits
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [{"header": HEADER}]
    # Scrapes go where the header says and nowhere else (no fallback), and
    # no route leads to that cluster: only the filter's own calls.
    scrape = cs[plugin["metrics_cluster"]]
    assert scrape["type"] == "ORIGINAL_DST"
    assert scrape["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": HEADER}
    for listener in ls.values():
        for vh in hcm(listener)["route_config"]["virtual_hosts"]:
            assert all(r.get("route", {}).get("cluster") != plugin["metrics_cluster"] for r in vh["routes"])
    # The metrics listener only forwards two read-only paths to the admin.
    routes = hcm(ls["metrics"])["route_config"]["virtual_hosts"][0]["routes"]
    forwarded = [r["match"]["path"] for r in routes if "route" in r]
    assert forwarded == ["/stats/prometheus", "/ready"]
    assert all(r["route"]["cluster"] == "admin" for r in routes if "route" in r)
    assert routes[-1]["direct_response"]["status"] == 404
    assert cs["admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "socket_address": {"address": "127.0.0.1", "port_value": 9901}
    }


def test_production_config_routes_and_serves_only_metrics_on_its_metrics_port():
    with backends(3, metrics=vllm_metrics()) as bs:
        pool = [b.addr for b in bs]
        cfg = production(pool)
        with Envoy(cfg) as envoy:
            assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 3)
            system = "You are a careful assistant for the accounts team. " * 8
            spoof = [(HEADER, bs[0].addr)]
            for i in range(12):
                status, _, _ = request(envoy.port, body=completion(system + f"Question {i}?"), headers=spoof)
                assert status == 200
            seen = [(b, r) for b in bs for r in b.requests if r["path"] == "/v1/completions"]
            assert len(seen) == 12
            for b, r in seen:
                # The filter's header: the pick (who served it) and one
                # fallback, both pool members.
                assert len(r["dest"]) == 1
                picks = r["dest"][0].split(",")
                assert len(picks) == 2 and set(picks) <= set(pool)
                assert picks[0] == b.addr
            # One shared system prompt: after the first request, prefix hits.
            assert envoy.stat("prefix_router.decision.prefix_hit") >= 10

            port = metrics_port(cfg)
            status, text = http_get(port, "/stats/prometheus")
            assert status == 200
            # The stats tag turns the replica into a label.
            assert any(
                line.startswith(f'prefix_router_replica_routed{{replica="{stat_label(a)}"}}') for a in pool
                for line in text.splitlines()
            ), "no tagged per-replica series"
            assert f"prefix_router_replica_{stat_label(pool[0])}_" not in text
            assert http_get(port, "/ready") == (200, "LIVE\n")
            for method, path in [
                ("POST", "/quitquitquit"),
                ("GET", "/config_dump"),
                ("POST", "/runtime_modify?upstream.healthy_panic_threshold=0"),
                ("POST", "/stats/prometheus"),
                ("GET", "/stats/prometheus/../../quitquitquit"),
                ("POST", "/logging?level=trace"),
            ]:
                assert http_get(port, path, method)[0] == 404, (method, path)
            time.sleep(0.2)
            assert envoy.proc.poll() is None, "Envoy exited: the admin API leaked"


def test_production_config_scrapes_a_replica_its_health_checks_took_out_at_its_own_address():
    # A replica that is down: the pool's active health check takes it out,
    # and a scrape through the pool went to the fallback, another replica
    # answered, and its page made the dead one eligible again.
    with backends(2, metrics=vllm_metrics()) as bs:
        dead = f"127.0.0.1:{free_port()}"
        pool = [dead] + [b.addr for b in bs]
        cfg = production(pool)
        check = clusters(cfg)["pool"]["health_checks"][0]
        check.update(interval="0.2s", timeout="0.1s", no_traffic_interval="0.2s", unhealthy_threshold=1)
        with Envoy(cfg) as envoy:
            live = [stat_label(b.addr) for b in bs]
            assert wait_until(lambda: min(envoy.stat(f"{l}.scrapes_ok") for l in live) >= 15, timeout=10)
            assert envoy.stat("cluster.pool.health_check.failure") >= 1
            assert envoy.stat(f"{stat_label(dead)}.scrapes_ok") == 0
            assert envoy.stat(f"{stat_label(dead)}.scrapes_failed") >= 3
            assert envoy.stat("prefix_router.eligible_replicas") == 2


@pytest.mark.parametrize("failure", ["http_503", "connection_refused"])
def test_production_config_retries_on_the_fallback_replica(failure):
    with backends(2, metrics=vllm_metrics()) as bs:
        pool = [b.addr for b in bs]
        # Keep the broken replica eligible, so the filter still picks it:
        # what is tested is Envoy's retry, not the filter's health check.
        cfg = production(pool, unhealthy_after=1000, staleness_ms=600000)
        with Envoy(cfg) as envoy:
            assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 2)
            prompt = "A long shared instruction block for the retry test. " * 8
            status, headers, _ = request(envoy.port, body=completion(prompt + "one"))
            assert status == 200
            victim = next(b for b in bs if str(b.port) == headers["x-served-by"])
            other = next(b for b in bs if b is not victim)
            if failure == "http_503":
                victim.down = True
            else:
                victim.stop()
                time.sleep(0.3)  # let Envoy see its pooled connection close
            retries = envoy.stat("cluster.pool.upstream_rq_retry")
            status, headers, _ = request(envoy.port, body=completion(prompt + "two"))
            assert status == 200
            assert headers["x-served-by"] == str(other.port)
            assert envoy.stat("cluster.pool.upstream_rq_retry") == retries + 1
            # The filter did pick the victim (prefix hit): the retry, not the
            # filter, moved the request.
            last = [r for r in other.requests if r["path"] == "/v1/completions"][-1]
            assert last["dest"] == [f"{victim.addr},{other.addr}"]


def with_remote_module(cfg: dict, module_port: int, sha256: str) -> dict:
    """Load the plugin over HTTP instead of from a file."""
    wasm = http_filter(listeners(cfg)["inference"], "prefix-router")
    wasm["typed_config"]["config"]["vm_config"]["code"] = {
        "remote": {
            "http_uri": {
                "uri": f"http://127.0.0.1:{module_port}/prefix_router.wasm",
                "cluster": "module-source",
                "timeout": "5s",
            },
            "sha256": sha256,
            "retry_policy": {"num_retries": 1},
        }
    }
    cfg["static_resources"]["clusters"].append(
        {
            "name": "module-source",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": "module-source",
                "endpoints": [{"lb_endpoints": lb_endpoints([f"127.0.0.1:{module_port}"])}],
            },
        }
    )
    return cfg


@pytest.mark.parametrize("strip", [True, False], ids=["as_shipped", "without_strip_filter"])
def test_a_failed_vm_fails_open_and_only_the_strip_filter_keeps_client_destinations_out(strip):
    """A module whose sha256 doesn't match is refused; with FAIL_OPEN Envoy
    serves without the filter. The client's destination header then reaches
    override_host unless the strip filter removed it first."""
    with module_server() as (module_port, hits), backends(3) as bs:
        pool = [b.addr for b in bs]
        cfg = with_remote_module(production(pool), module_port, "0" * 64)
        if not strip:
            hcm(listeners(cfg)["inference"])["http_filters"].pop(0)
        with Envoy(cfg) as envoy:
            served = Counter()
            for i in range(12):
                status, headers, _ = request(
                    envoy.port, body=completion(f"prompt {i} " * 30), headers=[(HEADER, bs[0].addr)]
                )
                assert status == 200
                served[headers["x-served-by"]] += 1
            assert hits, "the module was never fetched"
            assert envoy.stat("wasm.remote_load_fetch_failures") >= 1
            assert envoy.stat("prefix_router.requests_total") == 0  # no filter ran
            dests = [r["dest"] for b in bs for r in b.requests if r["path"] == "/v1/completions"]
            if strip:
                assert all(d == [] for d in dests), dests
                assert len(served) >= 2, served  # balanced by least-request
            else:
                # The risk the strip filter exists for: the client picks.
                assert served == Counter({str(bs[0].port): 12})


def test_remote_module_with_the_right_sha256_routes():
    with module_server() as (module_port, hits), backends(2, metrics=vllm_metrics()) as bs:
        pool = [b.addr for b in bs]
        sha = hashlib.sha256(WASM.read_bytes()).hexdigest()
        with Envoy(with_remote_module(production(pool), module_port, sha)) as envoy:
            assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 2)
            status, _, _ = request(envoy.port, body=completion("remote module " * 20))
            assert status == 200
            assert envoy.stat("prefix_router.requests_total") == 1
            assert envoy.stat("wasm.remote_load_fetch_successes") == 1
            assert len(hits) == 1


def test_a_route_level_header_removal_would_break_routing():
    """Why the strip is an HTTP filter ahead of the plugin and never a route
    header rule (HTTPRoute RequestHeaderModifier, request_headers_to_remove):
    the route rule runs after the plugin and deletes its pick before the
    load balancer reads it."""
    with backends(3) as bs:
        pool = [b.addr for b in bs]
        plugin = {"endpoints": pool, "debug_header": True}
        cfg = render_config("override_host", plugin, pool, free_port(), free_port())
        hcm(cfg["static_resources"]["listeners"][0])["route_config"]["virtual_hosts"][0]["routes"][0][
            "request_headers_to_remove"
        ] = [HEADER]
        with Envoy(cfg) as envoy:
            mismatches = 0
            for i in range(30):
                status, headers, _ = request(envoy.port, body=completion(f"request {i} " * 30))
                assert status == 200
                pick = headers["x-prefix-router-debug"].split(";")[0].removeprefix("replica=")
                mismatches += pick != f"127.0.0.1:{headers['x-served-by']}"
            assert mismatches > 0
            assert all(r["dest"] == [] for b in bs for r in b.requests)


# --------------------------------------------------------------------------
# Istio


KINDS = {
    "EnvoyFilter": "networking.istio.io/v1alpha3",
    "Gateway": "gateway.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
    "ConfigMap": "v1",
    "Service": "v1",
}

# The EnvoyFilter fields and values this project uses, from the Istio 1.27
# CRD schema (networking.istio.io/v1alpha3).
ENVOYFILTER_KEYS = {
    "spec": {"workloadSelector", "targetRefs", "configPatches", "priority"},
    "configPatch": {"applyTo", "match", "patch"},
    "match": {"context", "proxy", "listener", "routeConfiguration", "cluster"},
    "listener": {"portNumber", "portName", "filterChain", "listenerFilter", "name"},
    "filterChain": {"name", "sni", "transportProtocol", "applicationProtocols", "filter", "destinationPort"},
    "filter": {"name", "subFilter"},
    "cluster": {"name", "portNumber", "service", "subset"},
    "proxy": {"proxyVersion", "metadata"},
    "patch": {"operation", "value", "filterClass"},
}
APPLY_TO = {
    "LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
    "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP", "LISTENER_FILTER",
}
CONTEXTS = {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"}
OPERATIONS = {"MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST", "REPLACE"}


def istio_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ISTIO / name).read_text()) if d]


def envoyfilters(*names: str) -> list[dict]:
    return [d for n in names for d in istio_docs(n) if d["kind"] == "EnvoyFilter"]


def check_keys(obj: dict, kind: str, where: str):
    extra = set(obj) - ENVOYFILTER_KEYS[kind]
    assert not extra, f"{where}: unknown {kind} field(s) {sorted(extra)}"


def wasm_patch(ef: dict) -> dict:
    """The wasm Wasm config of an EnvoyFilter's HTTP_FILTER patch."""
    for p in ef["spec"]["configPatches"]:
        tc = p["patch"]["value"].get("typed_config", {})
        if tc.get("type_url", "").endswith("envoy.extensions.filters.http.wasm.v3.Wasm"):
            return tc["value"]
    raise AssertionError("no wasm filter patch")


def test_istio_manifests_are_well_formed_objects():
    files = sorted(ISTIO.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "gateway.yaml",
        "pool-override-host.yaml",
        "prefix-router-remote.yaml",
        "prefix-router-configmap.yaml",
    }
    for f in files:
        for doc in istio_docs(f.name):
            where = f"{f.name}: {doc.get('kind')}"
            assert doc.get("kind") in KINDS, where
            assert doc.get("apiVersion") == KINDS[doc["kind"]], where
            assert doc["metadata"]["name"] and doc["metadata"]["namespace"], where
            if doc["kind"] != "EnvoyFilter":
                continue
            spec = doc["spec"]
            check_keys(spec, "spec", where)
            assert spec["workloadSelector"]["labels"], where
            for i, cp in enumerate(spec["configPatches"]):
                w = f"{where} patch {i}"
                check_keys(cp, "configPatch", w)
                check_keys(cp["match"], "match", w)
                check_keys(cp["patch"], "patch", w)
                assert cp["applyTo"] in APPLY_TO, w
                assert cp["match"]["context"] == "GATEWAY", w
                assert cp["patch"]["operation"] in OPERATIONS, w
                for key in ("listener", "cluster", "proxy"):
                    if key in cp["match"]:
                        check_keys(cp["match"][key], key, w)
                if "filterChain" in cp["match"].get("listener", {}):
                    fc = cp["match"]["listener"]["filterChain"]
                    check_keys(fc, "filterChain", w)
                    check_keys(fc["filter"], "filter", w)
                if cp["applyTo"] == "LISTENER":
                    # Only the inference listener, never every listener.
                    assert cp["patch"]["operation"] == "MERGE", w
                    assert cp["match"]["listener"]["portNumber"], w
                if cp["applyTo"] == "HTTP_FILTER":
                    assert cp["patch"]["operation"] == "INSERT_BEFORE", w
                    f_ = cp["match"]["listener"]["filterChain"]["filter"]
                    assert f_["name"] == "envoy.filters.network.http_connection_manager", w
                    assert f_["subFilter"]["name"] == "envoy.filters.http.router", w
                if cp["applyTo"] == "CLUSTER":
                    assert cp["patch"]["operation"] in ("MERGE", "ADD"), w
                    if cp["patch"]["operation"] == "MERGE":
                        assert cp["match"]["cluster"]["name"] == ISTIO_POOL_CLUSTER, w


def test_istio_filter_config_points_at_the_pool_and_needs_istio_1_27():
    for name in ("prefix-router-remote.yaml", "prefix-router-configmap.yaml"):
        (ef,) = envoyfilters(name)
        wasm = wasm_patch(ef)["config"]
        assert wasm["allow_on_headers_stop_iteration"] is True, name
        assert wasm["failure_policy"] == "FAIL_OPEN", name
        plugin = json.loads(wasm["configuration"]["value"])
        assert plugin["cluster"] == ISTIO_POOL_CLUSTER, name
        assert plugin["discovery"]["cluster"] == ISTIO_POOL_CLUSTER, name
        added = {
            p["patch"]["value"]["name"]
            for p in ef["spec"]["configPatches"]
            if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "ADD"
        }
        assert plugin["discovery"]["admin_cluster"] in added, name
        # The strip filter is inserted (before the router) ahead of the
        # plugin, so it ends up running first.
        http = [p["patch"]["value"]["name"] for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
        assert http == ["prefix-router-strip-destination", "prefix-router"], name
    (ef,) = envoyfilters("prefix-router-remote.yaml")
    remote = wasm_patch(ef)["config"]["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["cluster"] == "prefix-router-module"
    assert remote["sha256"] == "REPLACE_WITH_SHA256_FROM_SCRIPTS_MODULE_INFO"
    # The module ConfigMap is mounted where the configmap variant reads it.
    cm, ef = istio_docs("prefix-router-configmap.yaml")
    mounted = yaml.safe_load(cm["data"]["deployment"])["spec"]["template"]["spec"]
    mount = mounted["containers"][0]["volumeMounts"][0]
    assert mounted["containers"][0]["name"] == "istio-proxy"
    assert mounted["volumes"][0]["name"] == mount["name"]
    filename = wasm_patch(ef)["config"]["vm_config"]["code"]["local"]["filename"]
    assert filename == f"{mount['mountPath']}/prefix_router.wasm"
    # Every EnvoyFilter selects the gateway's pods, in the gateway's namespace.
    gateway = next(d for d in istio_docs("gateway.yaml") if d["kind"] == "Gateway")
    assert gateway["spec"]["gatewayClassName"] == "istio"
    ports = {listener["port"] for listener in gateway["spec"]["listeners"]}
    for ef in envoyfilters("pool-override-host.yaml", "prefix-router-remote.yaml", "prefix-router-configmap.yaml"):
        assert ef["metadata"]["namespace"] == gateway["metadata"]["namespace"]
        labels = ef["spec"]["workloadSelector"]["labels"]
        assert labels == {"gateway.networking.k8s.io/gateway-name": gateway["metadata"]["name"]}
        for p in ef["spec"]["configPatches"]:
            listener = p["match"].get("listener", {})
            if p["patch"]["value"].get("name") == "prefix-router-strip-destination":
                # Every listener: the pool's cluster obeys the header
                # whichever listener a request came in on.
                assert "portNumber" not in listener
            elif listener:
                assert listener["portNumber"] in ports
    # The HTTPRoute sends traffic to the Service whose cluster is patched.
    route = next(d for d in istio_docs("gateway.yaml") if d["kind"] == "HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    svc = next(d for d in istio_docs("gateway.yaml") if d["kind"] == "Service")
    assert ISTIO_POOL_CLUSTER == (
        f"outbound|{backend['port']}||{backend['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    )


# What Istio generates for the gateway, reduced to what the patches touch:
# the port-80 listener's connection manager ending in the router, and the
# Service's outbound cluster with Istio's default lb_policy.


def merge(dst: dict, src: dict):
    """Protobuf merge on the YAML form, as EnvoyFilter MERGE does: messages
    merge field by field, repeated fields append, scalars replace."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        elif isinstance(v, list) and isinstance(dst.get(k), list):
            dst[k].extend(copy.deepcopy(v))
        else:
            dst[k] = copy.deepcopy(v)


def istio_gateway(
    pool: list[str], listen_port: int, admin_port: int, locality: bool = False, second_port: int | None = None
) -> dict:
    """What Istio generates for the gateway (see above); with `second_port`,
    a second listener (Istio's port 443, on `second_port` here) whose route
    also goes to the pool."""
    cfg = istio_gateway_80(pool, listen_port, admin_port, locality)
    if second_port is not None:
        second = copy.deepcopy(cfg["static_resources"]["listeners"][0])
        second["name"] = "0.0.0.0_443"
        second["address"]["socket_address"]["port_value"] = second_port
        hcm(second)["stat_prefix"] = "outbound_0.0.0.0_443"
        cfg["static_resources"]["listeners"].append(second)
    return cfg


def istio_gateway_80(pool: list[str], listen_port: int, admin_port: int, locality: bool) -> dict:
    cluster = {
        "name": ISTIO_POOL_CLUSTER,
        "type": "STATIC",  # EDS in Istio
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "common_lb_config": {},
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295, "max_pending_requests": 4294967295,
                                             "max_requests": 4294967295, "max_retries": 4294967295}]},
        "load_assignment": {"cluster_name": ISTIO_POOL_CLUSTER, "endpoints": [{"lb_endpoints": lb_endpoints(pool)}]},
    }
    if locality:
        cluster["common_lb_config"]["locality_weighted_lb_config"] = {}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "0.0.0.0_80",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                        "http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "outbound_0.0.0.0_80",
                                        "route_config": {
                                            "name": "http.80",
                                            "virtual_hosts": [
                                                {
                                                    "name": "inference-gateway",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/v1"},
                                                            "route": {"cluster": ISTIO_POOL_CLUSTER, "timeout": "0s"},
                                                        }
                                                    ],
                                                }
                                            ],
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters.http."
                                                    "router.v3.Router"
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


def apply_envoyfilter(cfg: dict, ef: dict, listener_port: int = 80, proxy_version: str = "1.27.3") -> list[str]:
    """Apply an EnvoyFilter's patches to a GATEWAY config the way istiod
    does for the patch kinds used here, for a proxy of `proxy_version`
    (Istio's version, which proxyVersion matches) whose inference listener
    is on `listener_port`. Returns what was applied."""
    applied = []
    res = cfg["static_resources"]

    def matching(listener_match: dict) -> list[dict]:
        # The first listener is the inference one, on `listener_port`;
        # others are named for their port, as Istio names them.
        ports = [listener_port] + [int(l["name"].rsplit("_", 1)[1]) for l in res["listeners"][1:]]
        want = listener_match.get("portNumber")
        return [l for l, port in zip(res["listeners"], ports) if want in (None, port)]

    for p in ef["spec"]["configPatches"]:
        kind, op, value, match = p["applyTo"], p["patch"]["operation"], p["patch"]["value"], p["match"]
        wanted = match.get("proxy", {}).get("proxyVersion")
        if wanted and not re.search(wanted, proxy_version):
            continue
        if kind == "CLUSTER" and op == "ADD":
            res["clusters"].append(copy.deepcopy(value))
            applied.append(f"add cluster {value['name']}")
        elif kind == "CLUSTER" and op == "MERGE":
            for c in res["clusters"]:
                if c["name"] == match["cluster"]["name"]:
                    merge(c, value)
                    applied.append(f"merge cluster {c['name']}")
        elif kind == "HTTP_FILTER" and op == "INSERT_BEFORE":
            lm = match["listener"]
            for listener in matching(lm):
                filters = hcm(listener)["http_filters"]
                before = [f["name"] for f in filters].index(lm["filterChain"]["filter"]["subFilter"]["name"])
                filters.insert(before, copy.deepcopy(value))
                applied.append(f"insert {value['name']}")
        elif kind == "LISTENER" and op == "MERGE":
            for listener in matching(match["listener"]):
                merge(listener, value)
                applied.append(f"merge listener {listener['name']}")
        else:
            raise AssertionError(f"unexpected patch {kind} {op}")
    return applied


def is_buffer_patch(patch: dict) -> bool:
    return "per_connection_buffer_limit_bytes" in patch["patch"]["value"]


def assembled(
    variant: str,
    pool: list[str],
    listen_port: int,
    admin_port: int,
    locality: bool = False,
    buffer_limits: bool = True,
    second_port: int | None = None,
) -> dict:
    """The gateway's Envoy config after istiod applied pool-override-host.yaml
    and prefix-router-<variant>.yaml (without the buffer-limit patches if
    `buffer_limits` is false)."""
    cfg = istio_gateway(pool, listen_port, admin_port, locality, second_port)
    for ef in envoyfilters("pool-override-host.yaml", f"prefix-router-{variant}.yaml"):
        if not buffer_limits:
            ef = copy.deepcopy(ef)
            ef["spec"]["configPatches"] = [p for p in ef["spec"]["configPatches"] if not is_buffer_patch(p)]
        assert apply_envoyfilter(cfg, ef)
    return cfg


def on_loopback(cfg: dict, admin_port: int, module: Path = WASM) -> dict:
    """An assembled configmap variant, runnable here: the mounted module is
    `module`, and the admin cluster (discovery) points at this Envoy's admin."""
    cfg = json.loads(json.dumps(cfg).replace("/var/lib/prefix-router/prefix_router.wasm", str(module)))
    clusters(cfg)["prefix-router-envoy-admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = lb_endpoints(
        [f"127.0.0.1:{admin_port}"]
    )
    return cfg


@pytest.mark.parametrize("variant", ["remote", "configmap"])
def test_istio_fragments_validate_in_envoy(variant):
    cfg = assembled(variant, ["10.8.0.11:8000", "10.8.1.7:8000"], 8080, 15000)
    cs = clusters(cfg)
    assert cs[ISTIO_POOL_CLUSTER]["lb_policy"] == "CLUSTER_PROVIDED"
    assert len(cs[ISTIO_POOL_CLUSTER]["load_balancing_policy"]["policies"]) == 1
    names = [f["name"] for f in hcm(cfg["static_resources"]["listeners"][0])["http_filters"]]
    assert names == ["prefix-router-strip-destination", "prefix-router", "envoy.filters.http.router"]
    # Long prompts: the listener and the pool's cluster buffer 16 MiB, like
    # envoy-production.yaml and the filter's max_body_bytes default.
    prod = production_doc()
    limit = listeners(prod)["inference"]["per_connection_buffer_limit_bytes"]
    assert cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == limit == 16 << 20
    assert cs[ISTIO_POOL_CLUSTER]["per_connection_buffer_limit_bytes"] == limit
    if variant == "configmap":
        # The mounted file: this build's module.
        text = json.dumps(cfg).replace("/var/lib/prefix-router/prefix_router.wasm", str(WASM))
        cfg = json.loads(text)
    else:
        # Validation resolves STRICT_DNS hosts: keep it off the network
        # (localhost comes from /etc/hosts); everything else as shipped.
        source = clusters(cfg)["prefix-router-module"]
        source["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
            "address"
        ] = "localhost"
    rc, out = validate(cfg)
    assert rc == 0, out


def test_istio_cluster_merge_is_refused_next_to_locality_weighting():
    """The caveat in pool-override-host.yaml: with a DestinationRule that
    makes Istio add locality_weighted_lb_config, the merged cluster is
    invalid."""
    cfg = assembled("configmap", ["10.8.0.11:8000"], 8080, 15000, locality=True)
    cfg = json.loads(json.dumps(cfg).replace("/var/lib/prefix-router/prefix_router.wasm", str(WASM)))
    rc, out = validate(cfg)
    assert rc != 0
    assert "locality_weighted_lb_config" in out


ISTIO_ENVOYFILTERS = ("pool-override-host.yaml", "prefix-router-remote.yaml", "prefix-router-configmap.yaml")


def test_every_istio_patch_is_for_istio_1_27_or_later():
    """Each patch (the pool's LB policy, the buffer limits, the added
    clusters, the strip, the filter) carries the same proxyVersion guard:
    Istio 1.27+ proxies, whose Envoy (>= 1.35) runs the filter. An older
    gateway matched by the same selector keeps Istio's config untouched."""
    for name in ISTIO_ENVOYFILTERS:
        for ef in envoyfilters(name):
            guards = {p["match"].get("proxy", {}).get("proxyVersion") for p in ef["spec"]["configPatches"]}
            assert len(guards) == 1 and None not in guards, (name, guards)
            rx = re.compile(guards.pop())
            for version in ("1.27.0", "1.27.3", "1.28.1", "1.30.0-beta.1", "1.31.0", "1.41.2"):
                assert rx.search(version), (name, version)
            for version in ("1.26.6", "1.9.0", "1.2.7", "1.20.1"):
                assert not rx.search(version), (name, version)
    for variant in ("remote", "configmap"):
        untouched = istio_gateway(["10.8.0.11:8000"], 8080, 15000)
        cfg = copy.deepcopy(untouched)
        for ef in envoyfilters("pool-override-host.yaml", f"prefix-router-{variant}.yaml"):
            assert apply_envoyfilter(cfg, ef, proxy_version="1.26.6") == []
        assert cfg == untouched


def test_istio_listener_patches_match_only_the_inference_port():
    """With a gateway listening on another port (a Helm-installed gateway
    listens on the Service's targetPort, often 8080) `portNumber: 80`
    matches nothing: no buffer limit, no strip, no filter. docs/deploy.md
    says to set portNumber to the targetPort there."""
    for variant in ("remote", "configmap"):
        cfg = istio_gateway(["10.8.0.11:8000"], 8080, 15000)
        applied = []
        for ef in envoyfilters("pool-override-host.yaml", f"prefix-router-{variant}.yaml"):
            applied += apply_envoyfilter(cfg, ef, listener_port=8080)
        assert not [a for a in applied if "listener" in a], applied
        assert [a for a in applied if a.startswith("insert")] == ["insert prefix-router-strip-destination"]
        listener = cfg["static_resources"]["listeners"][0]
        # Only the strip, which goes on every listener.
        names = [f["name"] for f in hcm(listener)["http_filters"]]
        assert names == ["prefix-router-strip-destination", "envoy.filters.http.router"]
        assert "per_connection_buffer_limit_bytes" not in listener


@pytest.mark.parametrize("buffer_limits", [True, False], ids=["with_buffer_patches", "without_them"])
def test_istio_a_2_mib_prompt_needs_the_buffer_limit_patches(buffer_limits):
    """Istio sets no per_connection_buffer_limit_bytes, so Envoy's 1 MiB
    default applies and the filter, which buffers whole bodies, gets a 413
    for a longer prompt. With the LISTENER/CLUSTER MERGE patches a 2 MiB
    prompt is routed by the filter; without them it is a clean 413."""
    with backends(2, metrics=vllm_metrics()) as bs:
        pool = [b.addr for b in bs]
        admin_port = free_port()
        cfg = assembled("configmap", pool, free_port(), admin_port, buffer_limits=buffer_limits)
        cfg = on_loopback(cfg, admin_port)
        listener = cfg["static_resources"]["listeners"][0]
        assert ("per_connection_buffer_limit_bytes" in listener) == buffer_limits
        big = json.dumps(completion("Summarise this log. " + "x" * (2 << 20))).encode()
        assert len(big) > 2 << 20
        with Envoy(cfg) as envoy:
            assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 2)
            status, headers, _ = request(envoy.port, body=big, timeout=60)
            seen = [r for b in bs for r in b.requests if r["path"] == "/v1/completions"]
            if buffer_limits:
                assert status == 200
                (r,) = seen
                assert r["body_len"] == len(big)
                # Routed by the filter: its pick is who served it.
                assert r["dest"][0].split(",")[0] == f"127.0.0.1:{headers['x-served-by']}"
                assert envoy.stat("prefix_router.requests_total") == 1
            else:
                assert status == 413
                assert seen == []
                # Clean: the next (normal) request is routed as usual.
                status, headers, _ = request(envoy.port, body=completion("a short prompt " * 20))
                assert status == 200
                (r,) = [r for b in bs for r in b.requests if r["path"] == "/v1/completions"]
                assert r["dest"][0].split(",")[0] == f"127.0.0.1:{headers['x-served-by']}"
            # The gauge is set from the shared load on the root's tick: a
            # tick during the 2 MiB request showed it in flight.
            assert wait_until(lambda: envoy.stat(".inflight") == 0)


def test_istio_assembly_fetches_the_module_discovers_the_pool_and_routes():
    """The remote variant end to end: Envoy fetches the module through the
    added cluster and checks its sha256, discovery reads the Istio cluster's
    hosts from the admin, scraping goes through the `outbound|...` cluster,
    and the merged override_host policy obeys the filter's pick."""
    with module_server() as (module_port, hits), backends(3, metrics=vllm_metrics()) as bs:
        pool = [b.addr for b in bs]
        admin_port = free_port()
        cfg = assembled("remote", pool, free_port(), admin_port)
        cs = clusters(cfg)
        # The artifact server and the admin port, on loopback.
        source = cs["prefix-router-module"]
        source.update(type="STATIC")
        source.pop("transport_socket")
        source.pop("dns_lookup_family")
        source["load_assignment"]["endpoints"][0]["lb_endpoints"] = lb_endpoints([f"127.0.0.1:{module_port}"])
        cs["prefix-router-envoy-admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = lb_endpoints(
            [f"127.0.0.1:{admin_port}"]
        )
        wasm = next(
            f for f in hcm(cfg["static_resources"]["listeners"][0])["http_filters"] if f["name"] == "prefix-router"
        )
        remote = wasm["typed_config"]["value"]["config"]["vm_config"]["code"]["remote"]
        remote["http_uri"]["uri"] = f"http://127.0.0.1:{module_port}/prefix-router/prefix_router.wasm"
        remote["sha256"] = hashlib.sha256(WASM.read_bytes()).hexdigest()
        with Envoy(cfg) as envoy:
            assert hits == ["/prefix-router/prefix_router.wasm"]
            assert wait_until(lambda: envoy.stat("prefix_router.discovery.hosts") == 3)
            assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 3)
            for b in bs:
                assert wait_until(lambda: envoy.stat(f"replica.{stat_label(b.addr)}.scrapes_ok") > 0)
            system = "Shared preamble for the gateway test. " * 10
            for i in range(9):
                status, _, _ = request(
                    envoy.port, body=completion(system + f"q{i}"), headers=[(HEADER, "203.0.113.7:8000")]
                )
                assert status == 200
            seen = [(b, r) for b in bs for r in b.requests if r["path"] == "/v1/completions"]
            assert len(seen) == 9
            for b, r in seen:
                assert r["dest"][0].split(",")[0] == b.addr
                assert "203.0.113.7:8000" not in r["dest"][0]
            assert envoy.stat("prefix_router.decision.prefix_hit") >= 7


def test_istio_a_client_of_another_listener_cannot_pick_the_replica():
    """The pool's cluster obeys the destination header whichever listener a
    request came in on, so the strip is on every listener of the gateway: a
    client of a second listener routing to the pool (no filter there) that
    names a replica gets the fallback balancing, and the header never
    reaches a replica. (With the strip on port 80 only, every such request
    went to the replica the client named.)"""
    with backends(3, metrics=vllm_metrics()) as bs:
        admin_port, second_port = free_port(), free_port()
        cfg = on_loopback(
            assembled("configmap", [b.addr for b in bs], free_port(), admin_port, second_port=second_port), admin_port
        )
        second = listeners(cfg)["0.0.0.0_443"]
        assert [f["name"] for f in hcm(second)["http_filters"]] == [
            "prefix-router-strip-destination",
            "envoy.filters.http.router",
        ]
        with Envoy(cfg):
            named = bs[0].addr
            for i in range(30):
                status, _, _ = request(second_port, body=completion(f"other listener {i}"), headers=[(HEADER, named)])
                assert status == 200
            seen = [(b, r) for b in bs for r in b.requests if r["path"] == "/v1/completions"]
            assert len(seen) == 30
            assert not any(r["dest"] for _, r in seen), [r["dest"] for _, r in seen]
            assert len({b.addr for b, _ in seen}) > 1


# --------------------------------------------------------------------------
# Dashboard, Prometheus configuration and alerts

# vLLM's own metric names the dashboard and alerts may use (the ones in
# /work/shared/DESIGN.md and the usual serving metrics).
VLLM_METRICS = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
}
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:inter_token_latency_seconds",
}
VLLM_NAMES = VLLM_METRICS | {h + s for h in VLLM_HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
# Istio's standard request metric, which its gateways export by default
# (Envoy's `http.*` listener stats they don't): the traffic an Istio
# gateway sends the pool, for PrefixRouterNotRouting.
ISTIO_NAMES = {"istio_requests_total"}

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan", "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
    "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio", "atan2",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not
    functions, keywords, label names, strings, durations or variables."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # ranges, subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r" \1 ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana variables
    names = set()
    token = re.compile(r"(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-zA-Z]*)|([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
    for m in token.finditer(s):
        ident, call = m.group(2), m.group(3)
        if ident and not call and ident not in PROMQL_KEYWORDS:
            names.add(ident)
    return names


def dashboard_exprs(dash: dict) -> list[str]:
    out = []

    def walk(panels):
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        q = var.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q or "")
        if m:
            out.append(m.group(1))
    return out


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def parse_exposition(text: str) -> list[tuple[str, dict]]:
    series = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s", line)
        assert m, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        series.append((m.group(1), labels))
    return series


def relabel(labels: dict, rules: list[dict]) -> dict | None:
    """Prometheus relabelling (replace, keep, drop), regexes fully anchored."""
    labels = dict(labels)
    for r in rules:
        action = r.get("action", "replace")
        value = r.get("separator", ";").join(labels.get(l, "") for l in r.get("source_labels", []))
        m = re.fullmatch(r.get("regex", "(.*)"), value)
        if action == "keep" and not m or action == "drop" and m:
            return None
        if action == "replace" and m:
            out = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda g: m.group(int(g.group(1) or g.group(2))) or "",
                         r.get("replacement", "$1"))
            labels[r["target_label"]] = out
        elif action not in ("replace", "keep", "drop"):
            raise AssertionError(f"relabel action {action} not modelled")
    return labels


def scrape_jobs() -> dict:
    return {j["job_name"]: j for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}


@pytest.fixture(scope="module")
def emitted():
    """/stats/prometheus of real Envoys with the filter loaded, scraping on
    and requests routed to every replica: the dev override_host config (no
    stats tag) and the production config (replica tag)."""
    out = {}
    with backends(2, metrics=vllm_metrics(waiting=1, running=2, kv=0.25)) as bs:
        pool = [b.addr for b in bs]
        dev = render_config(
            "override_host", {"endpoints": pool, "cluster": "pool", "max_fallbacks": 1}, pool, free_port(), free_port()
        )
        prod = production(pool)
        for name, cfg in [("dev", dev), ("production", prod)]:
            with Envoy(cfg) as envoy:
                assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 2)
                for i in range(40):
                    if all(envoy.stat(f"replica.{stat_label(a)}.routed") > 0 for a in pool):
                        break
                    status, _, _ = request(envoy.port, body=completion(f"distinct prompt {i} " * 10))
                    assert status == 200
                assert all(envoy.stat(f"replica.{stat_label(a)}.routed") > 0 for a in pool)
                port = metrics_port(cfg) if name == "production" else envoy.admin_port
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats/prometheus", timeout=10) as r:
                    out[name] = parse_exposition(r.read().decode())
        out["pool"] = pool
    return out


def normalized(series, rules):
    out = []
    for name, labels in series:
        new = relabel({"__name__": name, **labels}, rules)
        if new is not None:
            out.append((new.pop("__name__"), new))
    return out


def test_prometheus_relabelling_matches_envoys_own_replica_tag(emitted):
    jobs = scrape_jobs()
    for job in ("prefix-router-envoy", "prefix-router-istio-gateway"):
        assert jobs[job]["metrics_path"] == "/stats/prometheus"
        rules = jobs[job]["metric_relabel_configs"]
        ours = {(n, frozenset(l.items())) for n, l in normalized(emitted["dev"], rules) if n.startswith("prefix_router")}
        envoys = {(n, frozenset(l.items())) for n, l in emitted["production"] if n.startswith("prefix_router")}
        # Same series either way, label values included.
        assert ours == envoys, sorted(ours ^ envoys)[:10]
        # And idempotent on already-tagged series.
        again = {(n, frozenset(l.items())) for n, l in normalized(emitted["production"], rules)
                 if n.startswith("prefix_router")}
        assert again == envoys
    names = {n for n, _ in emitted["production"]}
    assert not [n for n in names if re.match(r"prefix_router_replica_\d", n)]
    replicas = {l["replica"] for n, l in emitted["production"] if n == "prefix_router_replica_routed"}
    assert replicas == {stat_label(a) for a in emitted["pool"]}
    # The model servers' `replica` label is the same string as the filter's.
    for job in ("vllm", "vllm-pods"):
        assert jobs[job]["metrics_path"] == "/metrics"
        rules = [r for r in jobs[job]["relabel_configs"] if r.get("target_label") == "replica"]
        for a in emitted["pool"]:
            assert relabel({"__address__": a}, rules)["replica"] == stat_label(a), job
    assert yaml.safe_load(PROMETHEUS.read_text())["rule_files"] == ["alerts.yml"]


def known_names(emitted) -> set[str]:
    rules = scrape_jobs()["prefix-router-envoy"]["metric_relabel_configs"]
    envoy = {n for n, _ in normalized(emitted["dev"], rules)} | {n for n, _ in emitted["production"]}
    return envoy | VLLM_NAMES | ISTIO_NAMES


def unknown_names(exprs: list[str], known: set[str]) -> dict[str, set[str]]:
    bad = {}
    for e in exprs:
        missing = promql_metric_names(e) - known
        if missing:
            bad[e] = missing
    return bad


def test_promql_name_check_catches_an_unknown_metric(emitted):
    known = known_names(emitted)
    assert promql_metric_names(
        'sum by (replica) (rate(prefix_router_replica_routed{job=~"$j", replica!="a"}[$__rate_interval] offset 5m))'
        " / on (job) group_left () scalar(max(vllm:num_requests_waiting))"
    ) == {"prefix_router_replica_routed", "vllm:num_requests_waiting"}
    bad = unknown_names(["sum(rate(prefix_router_request_total[5m]))", "vllm:kv_cache_usage"], known)
    assert set(bad) == {"sum(rate(prefix_router_request_total[5m]))", "vllm:kv_cache_usage"}


def test_dashboard_and_alerts_only_use_emitted_or_vllm_metrics(emitted):
    known = known_names(emitted)
    dash = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dash)
    rules = alert_rules()
    assert unknown_names(exprs, known) == {}
    assert unknown_names([r["expr"] for r in rules], known) == {}
    # The panels the issue asks for are there.
    used = set().union(*(promql_metric_names(e) for e in exprs))
    for name in (
        "prefix_router_matched_blocks_total",
        "prefix_router_request_blocks_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "prefix_router_replica_routed",
        "prefix_router_replica_kv_usage_percent",
        "prefix_router_replica_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "prefix_router_decision_prefix_hit",
        "prefix_router_decision_load_spill",
        "prefix_router_decision_new_prefix",
        "prefix_router_decision_new_branch",
        "prefix_router_decision_no_prompt",
        "prefix_router_decision_affinity",
        "prefix_router_decision_stored_response",
        "prefix_router_shed_429",
        "prefix_router_unavailable_503",
        "prefix_router_index_uncredited",
        "prefix_router_replica_scrapes_failed",
        "prefix_router_eligible_replicas",
        "prefix_router_replica_inflight",
        "prefix_router_shadow_matched_blocks_total",
        "prefix_router_shadow_baseline_matched_blocks_total",
    ):
        assert name in used, name


def test_dashboard_is_importable_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids, boxes = set(), []

    def walk(panels):
        for p in panels:
            assert p["id"] not in ids, p["title"]
            ids.add(p["id"])
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
            boxes.append((p["title"], g["x"], g["y"], g["w"], g["h"]))
            if p["type"] != "row":
                assert p["targets"], p["title"]
                assert p["datasource"]["uid"] == "${datasource}", p["title"]
                for t in p["targets"]:
                    assert t["datasource"]["uid"] == "${datasource}"
                    # Every variable used is defined.
                    for var in re.findall(r"\$(\w+)", t["expr"]):
                        assert var in variables or var.startswith("__"), (p["title"], var)
            walk(p.get("panels", []))

    walk(dash["panels"])
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = a[1] < b[1] + b[3] and b[1] < a[1] + a[3] and a[2] < b[2] + b[4] and b[2] < a[2] + a[4]
            assert not overlap, (a[0], b[0])


def test_alert_rules_are_complete():
    rules = {r["alert"]: r for r in alert_rules()}
    for name in (
        "PrefixRouterHitRateCollapsed",
        "PrefixCacheTrueHitRateCollapsed",
        "PrefixRouterReplicaStarved",
        "PrefixRouterReplicaPinned",
        "PrefixRouterScrapesFailing",
        "PrefixRouterNoEligibleReplicas",
        "PrefixRouterShedding",
        "PrefixRouterNotRouting",
        "PrefixRouterStoredResponsesLost",
    ):
        assert name in rules, name
    for name, r in rules.items():
        assert r["labels"]["severity"] in ("info", "warning", "critical"), name
        assert r["annotations"]["summary"], name
        assert r["expr"].count("(") == r["expr"].count(")"), name


promtool = shutil.which("promtool")


def test_alert_rules_parse_and_fire_on_synthetic_series():
    """promtool parses every rule and runs alerts_test.yml: each alert fires
    on a series that should trigger it and stays quiet on a healthy one."""
    assert promtool, "promtool missing: scripts/setup installs Debian's `prometheus` package"
    r = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [promtool, "test", "rules", ALERT_TESTS.name], capture_output=True, text=True, timeout=120, cwd=ALERT_TESTS.parent
    )
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------
# scripts/module-info


def module_info(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(MODULE_INFO), *args], capture_output=True, text=True, timeout=30)


def test_module_info_prints_path_size_and_sha256(tmp_path):
    r = module_info()
    assert r.returncode == 0, r.stderr
    fields = dict(line.split(":", 1) for line in r.stdout.splitlines())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    assert Path(fields["path"]) == WASM.resolve()
    assert fields["size"] == f"{WASM.stat().st_size} bytes"
    assert fields["sha256"] == hashlib.sha256(WASM.read_bytes()).hexdigest()
    missing = module_info(str(tmp_path / "missing.wasm"))
    assert missing.returncode != 0 and "not found" in missing.stderr
    junk = tmp_path / "junk.wasm"
    junk.write_bytes(b"<html>404</html>")
    bad = module_info(str(junk))
    assert bad.returncode != 0 and "not a WebAssembly module" in bad.stderr


def test_module_fits_in_a_configmap():
    """deploy/istio/prefix-router-configmap.yaml needs the module under a
    ConfigMap's 1 MiB."""
    assert WASM.stat().st_size < 1024 * 1024
    fields = dict(line.split(":", 1) for line in module_info().stdout.splitlines())
    assert fields["configmap"].strip().startswith("fits")
