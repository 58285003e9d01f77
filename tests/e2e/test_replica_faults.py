"""One replica's bad metrics page must never take routing down.

replica-sim replicas behind a real Envoy with scraping on; one replica's
`/metrics` misbehaves the way dying or broken model servers do (reset
mid-body, a body that stalls after the headers, a 40 MiB page, absurd
values, HTTP 500, bytes that aren't a metrics page). Under steady load, in
both cluster modes and with each failure policy: no VM traps, every request
served (by a healthy replica once the faulty one is out), and routing stays
prefix-aware. Also: a busy replica gets few new prompts, and a crashed VM's
in-flight counts don't stay.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (
    WASM_FAULT,
    Backend,
    backends,
    completion,
    filter_envoy,
    request,
    stat_label,
    vllm_metrics,
    wait_until,
)
from test_lora import SIM, replica_sim

INTERVAL_MS = 100
TRAP_SIGNS = ("panicked at", "Uncaught RuntimeError", "unexpected status")


def set_metrics_fault(addr: str, mode: str, **extra) -> None:
    body = json.dumps({"mode": mode, **extra}).encode()
    req = urllib.request.Request(f"http://{addr}/admin/metrics-fault", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def routed(envoy, addr: str) -> int:
    return envoy.stat(f"replica.{stat_label(addr)}.routed")


def steady_load(port: int, seconds: float, workers: int = 4) -> list[int]:
    """Statuses of requests sent by `workers` clients for `seconds`; each
    client repeats a few documents so prefixes are shared (bounded count)."""
    stop = time.time() + seconds
    statuses: list[int] = []
    lock = threading.Lock()

    def client(k: int):
        i = 0
        while time.time() < stop and i < 400:
            doc = f"Document {k}-{i % 5}: " + "shared context words " * 40
            status, _, _ = request(port, body=completion(f"{doc} question {i}?"), timeout=15)
            with lock:
                statuses.append(status)
            i += 1

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(client, range(workers)))
    return statuses


def assert_no_trap(envoy):
    log = envoy.log()
    signs = [line for line in log.splitlines() if any(s in line for s in TRAP_SIGNS)]
    assert not signs, signs[:5]
    stats = envoy.stats()
    assert stats.get("wasm.prefix-router.vm_reload", 0) == 0, stats


def fault_envoy(pool, mode, policy=None):
    plugin = {
        "cluster": "pool",
        "scrape_interval_ms": INTERVAL_MS,
        "max_fallbacks": 1 if mode == "override_host" else 0,
    }
    return filter_envoy(pool, plugin, mode, concurrency=2, failure_policy=policy)


def run_fault(fault: str, mode: str, policy: str | None):
    assert SIM.exists(), "build replica-sim first (scripts/build)"
    with replica_sim(4) as pool:
        bad = pool[0]
        extra = {"bytes": 40 << 20} if fault == "huge" else {}
        set_metrics_fault(bad, fault, **extra)
        with fault_envoy(pool, mode, policy) as envoy:
            # Excluded within a few scrape intervals of the lease being
            # taken (absurd: not excluded, but its clamped queue is seen).
            if fault == "absurd":
                seen = lambda: envoy.stat(f"{stat_label(bad)}.waiting") == 1_000_000  # noqa: E731
            else:
                seen = lambda: envoy.stat("prefix_router.eligible_replicas") == 3  # noqa: E731
            assert wait_until(seen, timeout=5, step=0.05), fault
            before_bad = routed(envoy, bad)
            before_total = envoy.stat("prefix_router.requests_total")
            statuses = steady_load(envoy.port, 3.0)
            assert statuses and all(s == 200 for s in statuses), Counter(statuses)
            assert_no_trap(envoy)
            # Still routing (and prefix-aware: the documents come back).
            after_total = envoy.stat("prefix_router.requests_total")
            assert after_total - before_total >= len(statuses) * 0.9
            assert envoy.stat("prefix_router.decision.prefix_hit") > 0
            # The faulty replica got nothing once it was out (absurd: its
            # clamped queue of a million keeps it last).
            assert routed(envoy, bad) - before_bad == 0, fault
            if fault != "absurd":
                assert envoy.stat(f"{stat_label(bad)}.scrapes_failed") >= 3
                assert envoy.stat("prefix_router.eligible_replicas") == 3


FAULTS = ["reset", "stall", "huge", "absurd", "error", "garbage"]


@pytest.mark.parametrize("mode", ["original_dst", "override_host"])
@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_metrics_page_is_a_failed_scrape_not_a_trap(fault, mode):
    run_fault(fault, mode, None)


@pytest.mark.parametrize("policy", ["FAIL_OPEN", "FAIL_RELOAD", "FAIL_CLOSED"])
@pytest.mark.parametrize("fault", ["reset", "huge"])
def test_each_failure_policy_survives_a_dying_replica(fault, policy):
    run_fault(fault, "override_host", policy)


def test_absurd_values_do_not_readmit_a_failing_replica():
    """Before: one replica's 1e308 queue made the shared table unreadable,
    and every replica, the failing one too, looked eligible and idle."""
    with backends(3, metrics=vllm_metrics()) as bs:
        absurd, failing, good = bs
        absurd.metrics = vllm_metrics(waiting=1e308, running=1e39, kv=0.5)
        failing.down = True  # every request, /metrics too, gets a 503
        with fault_envoy([b.addr for b in bs], "override_host") as envoy:
            # Its clamped queue is seen, the failing one is out.
            queue = f"{stat_label(absurd.addr)}.waiting"
            assert wait_until(
                lambda: envoy.stat(queue) == 1_000_000 and envoy.stat("prefix_router.eligible_replicas") == 2
            ), (envoy.stat(queue), envoy.stat("prefix_router.eligible_replicas"))
            statuses = [request(envoy.port, body=completion(f"q {i} " * 30))[0] for i in range(60)]
            assert all(s == 200 for s in statuses), Counter(statuses)
            assert failing.count == 0
            assert absurd.count == 0
            assert good.count == 60
            assert envoy.stat(f"{stat_label(absurd.addr)}.waiting") == 1_000_000
            assert_no_trap(envoy)


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_busy_replica_gets_few_new_prompts(replicas):
    """Before: the unbounded "recent new content" term outgrew the queue
    and KV penalties, and a replica with queue 50 / KV 95% kept ~half."""
    with backends(replicas, metrics=vllm_metrics()) as bs:
        busy = bs[0]
        busy.metrics = vllm_metrics(waiting=50, running=16, kv=0.95)
        with fault_envoy([b.addr for b in bs], "override_host") as envoy:
            queue = f"{stat_label(busy.addr)}.waiting"
            assert wait_until(lambda: envoy.stat(queue) == 50), envoy.stat(queue)

            def send(i):
                return request(envoy.port, body=completion(f"new prompt {i} " * 40))[0]

            with ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(send, range(600)))
            assert all(s == 200 for s in statuses)
            share = busy.count / 600
            assert share <= 0.05, f"busy replica got {busy.count} of 600"


def test_a_crashed_vms_in_flight_counts_do_not_stay():
    """A VM that traps with requests in flight (FAIL_RELOAD): its load slot
    expires and the in-flight gauges return to 0."""
    with Backend(delay_s=2.0) as slow:
        pool = [slow.addr]
        with filter_envoy(
            pool,
            {"debug_trap_on_request": 11},
            "override_host",
            concurrency=1,
            failure_policy="FAIL_RELOAD",
            wasm_path=WASM_FAULT,
        ) as envoy:
            gauge = f"replica.{stat_label(slow.addr)}.inflight"
            with ThreadPoolExecutor(10) as ex:
                futures = [
                    ex.submit(request, envoy.port, body=completion(f"slow {i} " * 20)) for i in range(10)
                ]
                assert wait_until(lambda: envoy.stat(gauge) == 10, timeout=5), envoy.stat(gauge)
                # The 11th request traps the VM while ten are in flight.
                request(envoy.port, body=completion("trap " * 20), timeout=10)
                for f in futures:
                    f.result()
            # Envoy reloads the VM when the next request comes.
            def reloaded():
                request(envoy.port, method="GET", path="/health", timeout=10)
                return envoy.stats().get("wasm.prefix-router.vm_reload_success", 0) >= 1

            assert wait_until(reloaded, timeout=10, step=0.2)
            # Within the slot's staleness (2 s) plus a tick, not forever.
            assert wait_until(lambda: envoy.stat(gauge) == 0, timeout=5), envoy.stat(gauge)
