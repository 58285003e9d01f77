"""A client's destination header never reaches the load balancer, even when
the wasm VM is dead.

The filter removes a client-sent `x-gateway-destination-endpoint` itself,
but only while its VM is alive: with FAIL_OPEN a failed VM is skipped. So
every shipped Envoy config (dev and production, both cluster modes) and the
Istio EnvoyFilters also remove it with Envoy's native header_mutation filter,
placed before the wasm filter, and an ORIGINAL_DST config never fails open.

- Inspection: in every envoy/*.yaml and every assembled Istio gateway, each
  header a cluster routes by is removed by a filter ahead of the wasm filter;
  ORIGINAL_DST configs use FAIL_CLOSED or FAIL_RELOAD; no route rule removes
  the header (it would delete the filter's pick).
- End to end: each config runs the fault-injection module, whose VM traps on
  its first routed request; clients then name a canary replica (a pool
  member, and for ORIGINAL_DST also an address outside the pool). The canary
  receives nothing, and the statuses are what the failure policy implies.
"""
from __future__ import annotations

import copy
import json
import time

import pytest
import yaml

from harness import (
    ENVOY_DIR,
    HEADER,
    WASM_FAULT,
    Backend,
    Envoy,
    backends,
    completion,
    free_port,
    is_wasm_filter,
    request,
    shipped_config,
    stripped_headers,
    vllm_metrics,
    wait_until,
)
from test_deploy import (
    ISTIO_POOL_CLUSTER,
    assembled,
    clusters,
    envoyfilters,
    hcm,
    lb_endpoints,
    listeners,
    on_loopback,
    production,
    validate,
)

SHIPPED = sorted(ENVOY_DIR.glob("*.yaml"))
HCM_NAME = "envoy.filters.network.http_connection_manager"
SAFE_FOR_ORIGINAL_DST = {"FAIL_CLOSED", "FAIL_RELOAD"}


# --------------------------------------------------------------------------
# Inspection


def wasm_config(f: dict) -> dict:
    """The wasm PluginConfig of a wasm filter entry (typed or TypedStruct)."""
    tc = f["typed_config"]
    return (tc["value"] if "type_url" in tc else tc)["config"]


def plugin_header(f: dict) -> str:
    plugin = json.loads(wasm_config(f)["configuration"]["value"])
    return plugin.get("destination_header", HEADER).lower()


def failure_policy(f: dict) -> str | None:
    """The policy as written (None: left to Envoy's default)."""
    cfg = wasm_config(f)
    if cfg.get("fail_open"):
        return "FAIL_OPEN"
    return cfg.get("failure_policy")


def header_routed_clusters(cfg: dict) -> dict[str, set[str]]:
    """Cluster name -> request headers its load balancer takes the upstream
    from (ORIGINAL_DST with use_http_header, override_host header sources)."""
    out = {}
    for c in cfg["static_resources"].get("clusters", []):
        headers = set()
        odst = c.get("original_dst_lb_config") or {}
        if c.get("type") == "ORIGINAL_DST" and odst.get("use_http_header"):
            headers.add(odst.get("http_header_name", "x-envoy-original-dst-host").lower())
        for policy in (c.get("load_balancing_policy") or {}).get("policies", []):
            tc = policy["typed_extension_config"].get("typed_config", {})
            if tc.get("@type", "").endswith("override_host.v3.OverrideHost"):
                headers |= {s["header"].lower() for s in tc.get("override_host_sources", []) if "header" in s}
        if headers:
            out[c["name"]] = headers
    return out


def routed_original_dst(cfg: dict) -> bool:
    """Whether a route sends clients' requests to an ORIGINAL_DST cluster
    (one that only the filter's own calls reach, as the production
    config's scrape cluster, is no way for a client to pick)."""
    targets = set()
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for nf in chain["filters"]:
                rc = nf.get("typed_config", {}).get("route_config", {})
                for vh in rc.get("virtual_hosts", []):
                    for r in vh.get("routes", []):
                        route = r.get("route", {})
                        targets.add(route.get("cluster"))
                        targets |= {w["name"] for w in route.get("weighted_clusters", {}).get("clusters", [])}
    clusters = cfg["static_resources"].get("clusters", [])
    return any(c.get("type") == "ORIGINAL_DST" and c["name"] in targets for c in clusters)


def route_removals(route_config: dict) -> set[str]:
    """Headers removed by route rules, at any level of a route config."""
    out = set(route_config.get("request_headers_to_remove", []))
    for vh in route_config.get("virtual_hosts", []):
        out |= set(vh.get("request_headers_to_remove", []))
        for r in vh.get("routes", []):
            out |= set(r.get("request_headers_to_remove", []))
    return {h.lower() for h in out}


def strip_problems(cfg: dict) -> list[str]:
    """Why a client's destination header could reach the load balancer when
    the wasm VM has failed (empty: it can't)."""
    problems = []
    routed = header_routed_clusters(cfg)
    obeyed = set().union(*routed.values())
    original_dst = routed_original_dst(cfg)
    if not obeyed:
        problems.append("no cluster routes by a header")
    seen = 0
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for nf in chain["filters"]:
                if nf["name"] != HCM_NAME:
                    continue
                filters = nf["typed_config"].get("http_filters", [])
                for i, f in enumerate(filters):
                    if not is_wasm_filter(f):
                        continue
                    seen += 1
                    where = f"listener {listener['name']}, filter {f['name']}"
                    stripped = set().union(*(stripped_headers(g) for g in filters[:i]))
                    missing = (obeyed | {plugin_header(f)}) - stripped
                    if missing:
                        problems.append(f"{where}: {sorted(missing)} not removed before the wasm filter")
                    policy = failure_policy(f)
                    if original_dst and policy not in SAFE_FOR_ORIGINAL_DST:
                        problems.append(f"{where}: failure_policy {policy} with an ORIGINAL_DST cluster")
                    removed = route_removals(nf["typed_config"].get("route_config", {})) & (obeyed | {plugin_header(f)})
                    if removed:
                        problems.append(f"{where}: a route rule removes {sorted(removed)} (the filter's pick)")
    if not seen:
        problems.append("no wasm filter")
    return problems


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_envoy_config_strips_before_the_wasm_filter(path):
    cfg = yaml.safe_load(path.read_text())
    assert strip_problems(cfg) == []
    if routed_original_dst(cfg):
        # Written out, so nobody reads Envoy's default as "open".
        policies = {
            wasm_config(f).get("failure_policy")
            for l in cfg["static_resources"]["listeners"]
            for f in hcm(l).get("http_filters", [])
            if is_wasm_filter(f)
        }
        assert policies <= SAFE_FOR_ORIGINAL_DST, policies


def test_both_cluster_modes_are_shipped():
    kinds = set()
    for path in SHIPPED:
        for c in yaml.safe_load(path.read_text())["static_resources"]["clusters"]:
            if c.get("type") == "ORIGINAL_DST":
                kinds.add("original_dst")
            if c.get("load_balancing_policy"):
                kinds.add("override_host")
    assert kinds == {"original_dst", "override_host"}


@pytest.mark.parametrize("variant", ["remote", "configmap"])
def test_every_istio_gateway_strips_before_the_wasm_filter(variant):
    """The EnvoyFilters as istiod applies them, and as written: the strip
    patch comes first and matches what the filter patch matches, on every
    listener rather than the filter's port (a version edited in one only
    would leave the filter unguarded; another listener routing to the pool
    would let its clients name the replica)."""
    cfg = assembled(variant, ["10.8.0.11:8000"], 8080, 15000)
    assert strip_problems(cfg) == []
    (ef,) = envoyfilters(f"prefix-router-{variant}.yaml")
    http = [p for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    wasm = [i for i, p in enumerate(http) if is_wasm_filter(p["patch"]["value"])]
    strips = [i for i, p in enumerate(http) if HEADER in stripped_headers(p["patch"]["value"])]
    assert len(wasm) == 1 and strips and max(strips) < wasm[0]
    for i in strips:
        strip, filt = http[i]["match"], copy.deepcopy(http[wasm[0]]["match"])
        assert filt["listener"].pop("portNumber")
        assert strip == filt
        assert http[i]["patch"]["operation"] == http[wasm[0]]["patch"]["operation"] == "INSERT_BEFORE"


def test_the_inspection_catches_each_way_to_get_it_wrong():
    """The check above is not vacuous: it flags a config without the strip,
    with the strip after the filter, stripping another header, removing the
    header on the route, and an ORIGINAL_DST config that fails open or
    leaves the policy to Envoy's default."""
    odst = yaml.safe_load((ENVOY_DIR / "envoy.yaml").read_text())
    override = yaml.safe_load((ENVOY_DIR / "envoy-override-host.yaml").read_text())

    def chain(cfg):
        return hcm(cfg["static_resources"]["listeners"][0])["http_filters"]

    def mutated(cfg, fn):
        cfg = copy.deepcopy(cfg)
        fn(cfg)
        return strip_problems(cfg)

    def drop_strip(cfg):
        chain(cfg)[:] = [f for f in chain(cfg) if not stripped_headers(f)]

    def strip_after(cfg):
        f = chain(cfg).pop(0)
        chain(cfg).insert(1, f)

    def other_header(cfg):
        chain(cfg)[0]["typed_config"]["mutations"]["request_mutations"] = [{"remove": "x-something-else"}]

    def route_removal(cfg):
        hcm(cfg["static_resources"]["listeners"][0])["route_config"]["virtual_hosts"][0]["routes"][0][
            "request_headers_to_remove"
        ] = [HEADER]

    def fail_open(cfg):
        wasm_config(chain(cfg)[1])["failure_policy"] = "FAIL_OPEN"

    def default_policy(cfg):
        wasm_config(chain(cfg)[1]).pop("failure_policy")

    for cfg in (odst, override):
        assert strip_problems(cfg) == []
        for fn in (drop_strip, strip_after, other_header, route_removal):
            assert mutated(cfg, fn), fn.__name__
    for fn in (fail_open, default_policy):
        assert mutated(odst, fn), fn.__name__
        assert not mutated(override, fn), fn.__name__


# --------------------------------------------------------------------------
# End to end: the VM traps on its first request, clients name a canary


def with_priority_1_member(cfg: dict, cluster: str, addr: str) -> dict:
    """Make `addr` a member of `cluster` at priority 1. override_host finds
    a host in any priority, but the fallback policy only uses priority 0
    while it is healthy: the canary is then reachable only through the
    destination header, so any request it gets came from a client's value."""
    c = clusters(cfg)[cluster]
    c["load_assignment"]["endpoints"].append({"priority": 1, "lb_endpoints": lb_endpoints([addr])})
    return cfg


def set_plugin(wasm_filter: dict, **changes) -> None:
    config = wasm_config(wasm_filter)
    plugin = json.loads(config["configuration"]["value"])
    plugin.update(changes)
    config["configuration"]["value"] = json.dumps(plugin)


def the_wasm_filter(cfg: dict) -> dict:
    (f,) = [f for f in hcm(cfg["static_resources"]["listeners"][0])["http_filters"] if is_wasm_filter(f)]
    return f


def dev_original_dst(pool, canary_in, canary_out, fail_open=False):
    cfg = shipped_config(
        "original_dst",
        {"endpoints": pool + [canary_in.addr], "max_fallbacks": 0, "debug_trap_on_request": 1},
        pool,
        free_port(),
        free_port(),
        wasm_path=WASM_FAULT,
    )
    if fail_open:
        wasm_config(the_wasm_filter(cfg))["failure_policy"] = "FAIL_OPEN"
    return cfg, [canary_in, canary_out]


def dev_override_host(pool, canary, _):
    cfg = shipped_config(
        "override_host",
        {"endpoints": pool + [canary.addr], "max_fallbacks": 1, "debug_trap_on_request": 1},
        pool,
        free_port(),
        free_port(),
        wasm_path=WASM_FAULT,
    )
    return with_priority_1_member(cfg, "pool", canary.addr), [canary]


def production_override_host(pool, canary, _):
    cfg = production(pool, debug_trap_on_request=1)
    wasm = the_wasm_filter(cfg)
    wasm_config(wasm)["vm_config"]["code"]["local"]["filename"] = str(WASM_FAULT)
    set_plugin(wasm, endpoints=pool + [canary.addr])
    return with_priority_1_member(cfg, "pool", canary.addr), [canary]


def istio_gateway_override_host(pool, canary, _):
    admin_port = free_port()
    cfg = assembled("configmap", pool, free_port(), admin_port)
    cfg = on_loopback(cfg, admin_port, module=WASM_FAULT)
    set_plugin(the_wasm_filter(cfg), debug_trap_on_request=1)
    return with_priority_1_member(cfg, ISTIO_POOL_CLUSTER, canary.addr), [canary]


CONFIGS = {
    "envoy.yaml": dev_original_dst,
    # Not shipped (the inspection forbids it): even if someone set FAIL_OPEN
    # on the ORIGINAL_DST config, the strip filter alone keeps clients out.
    "envoy.yaml-if-set-to-FAIL_OPEN": lambda p, a, b: dev_original_dst(p, a, b, fail_open=True),
    "envoy-override-host.yaml": dev_override_host,
    "envoy-production.yaml": production_override_host,
    "istio-gateway": istio_gateway_override_host,
}

INFERENCE_PATHS = ("/v1/completions", "/v1/models")


def spoofs(target: str) -> list[list[tuple[str, str]]]:
    return [
        [(HEADER, target)],
        [("X-Gateway-Destination-Endpoint", target)],
        [(HEADER, target), (HEADER, target)],
        [(HEADER, f"  {target} ")],
    ]


def served(b: Backend) -> list[dict]:
    """What a backend served to clients (not health checks or scrapes)."""
    return [r for r in b.requests if r["path"] in INFERENCE_PATHS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_trapped_vm_never_lets_a_client_pick_the_upstream(name):
    with backends(2, metrics=vllm_metrics()) as bs, Backend(metrics=vllm_metrics()) as canary_in, Backend(
        metrics=vllm_metrics()
    ) as canary_out:
        pool = [b.addr for b in bs]
        cfg, canaries = CONFIGS[name](pool, canary_in, canary_out)
        wasm = the_wasm_filter(cfg)
        policy = failure_policy(wasm) or "FAIL_CLOSED"
        original_dst = routed_original_dst(cfg)
        assert validate(cfg)[0] == 0, validate(cfg)[1]
        # One worker: its VM's first routed request is the one that traps.
        with Envoy(cfg, concurrency=1) as envoy:
            # Let the filter know its pool first (so the first request is
            # routed, and traps, rather than refused for want of replicas).
            plugin = json.loads(wasm_config(wasm)["configuration"]["value"])
            if "discovery" in plugin:
                assert wait_until(lambda: envoy.stat("prefix_router.discovery.hosts") >= 2)
            if "cluster" in plugin:
                assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") >= 2)
            statuses = []
            for i in range(12):
                target = canaries[i % len(canaries)].addr
                hdrs = spoofs(target)[i % 4]
                if i % 2 == 0:
                    status, _, _ = request(envoy.port, body=completion(f"request {i} " * 20), headers=hdrs)
                else:
                    status, _, _ = request(envoy.port, "GET", "/v1/models", headers=hdrs)
                statuses.append(status)
                time.sleep(0.02)
            # The log file is flushed every 100 ms.
            assert wait_until(lambda: "debug_trap_on_request reached (1)" in envoy.log()), "the VM did not trap"
        # The point of it all: no client-chosen request reached a canary.
        assert [len(served(c)) for c in canaries] == [0] * len(canaries), statuses
        upstream = [r for b in bs for r in served(b)]
        if policy == "FAIL_OPEN" and not original_dst:
            # The request that met the trap fails (503); afterwards the
            # filter is skipped and the fallback policy balances over the
            # pool's priority 0, with no destination header at all.
            assert statuses == [503] + [200] * 11, statuses
            assert len(upstream) == 11
            assert all(r["dest"] == [] for r in upstream), upstream
        else:
            # FAIL_CLOSED / FAIL_RELOAD: every request meets a failed (or
            # freshly reloaded, trapping again) VM and gets 503. FAIL_OPEN
            # with ORIGINAL_DST: no header left, no address, 503 from Envoy.
            assert statuses == [503] * 12, statuses
            assert upstream == []
