"""The filter in a real Envoy: every request pinned to a known replica, the
client never choosing the upstream, bad input never crashing the VM, and
in-flight balancing counted across workers."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (
    stat_label,
    Backend,
    Envoy,
    HEADER,
    backends,
    chat,
    completion,
    filter_envoy,
    free_port,
    render_config,
    request,
    wait_until,
)

MODES = ["original_dst", "override_host"]


def start(mode, pool, concurrency=2, buffer_limit=None):
    return filter_envoy(pool, envoy_mode=mode, concurrency=concurrency, buffer_limit=buffer_limit)


def bodies():
    """Completions and chat, streaming and not, short and multi-block."""
    out = []
    for i in range(10):
        doc = f"Shared document {i % 3}. " * 20
        out.append(("/v1/completions", completion(doc + f"Q{i}", stream=i % 2 == 0)))
        out.append(
            (
                "/v1/chat/completions",
                chat([("system", doc), ("user", f"question {i}")], stream=i % 2 == 1),
            )
        )
    return out


@pytest.mark.parametrize("mode", MODES)
def test_every_request_is_served_by_a_configured_replica(mode):
    with backends(4) as bs, start(mode, [b.addr for b in bs]) as envoy:
        ports = {str(b.port) for b in bs}
        work = bodies() * 2

        def send(item):
            path, body = item
            return request(envoy.port, path=path, body=body)

        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(send, work))
        for status, headers, data in results:
            assert status == 200, data
            assert headers["x-served-by"] in ports
        assert sum(b.count for b in bs) == len(work)
        # Each upstream request carried exactly one destination, ours.
        for b in bs:
            for r in b.requests:
                assert r["dest"], "header missing upstream"
                assert r["dest"][0].split(",")[0] in {x.addr for x in bs}
        stats = envoy.stats()
        workers = [v for k, v in stats.items() if ".worker_" in k and k.endswith("downstream_cx_total")]
        assert len(workers) == 2 and all(v > 0 for v in workers), workers
        assert envoy.stat("prefix_router.requests_total") == len(work)


SPOOFS = [
    [(HEADER, "{canary}")],
    [("X-Gateway-Destination-Endpoint", "{canary}")],
    [(HEADER.upper(), "  {canary}  ")],
    [(HEADER, "{canary}"), (HEADER, "{canary}")],
    [(HEADER, "{canary},{canary}")],
    [(HEADER, "")],
]


@pytest.mark.parametrize("mode", MODES)
def test_client_destination_header_never_reaches_the_canary(mode):
    with backends(2) as bs, Backend() as canary, start(mode, [b.addr for b in bs]) as envoy:
        pool = {b.addr for b in bs}
        sent = 0
        for spoof in SPOOFS:
            hdrs = [(k, v.format(canary=canary.addr)) for k, v in spoof]
            for method, path, body in [
                ("POST", "/v1/completions", completion("hello " * 30)),
                ("POST", "/v1/chat/completions", chat([("user", "hi " * 40)], stream=True)),
                ("GET", "/health", None),
                ("POST", "/other", b"{}"),
                ("POST", "/v1/completions", b"not json"),
            ]:
                status, headers, _ = request(envoy.port, method, path, body, headers=hdrs)
                assert status == 200
                assert headers["x-served-by"] != str(canary.port)
                sent += 1
        assert canary.count == 0
        assert sum(b.count for b in bs) == sent
        for b in bs:
            for r in b.requests:
                assert len(r["dest"]) == 1
                assert all(a in pool for a in r["dest"][0].split(","))
        assert envoy.stat("prefix_router.client_destination_stripped") >= sent - 5


@pytest.mark.parametrize("mode", MODES)
def test_bad_bodies_are_routed_and_do_not_crash_the_vm(mode):
    with backends(2) as bs, start(mode, [b.addr for b in bs], buffer_limit=32 << 20) as envoy:
        ports = {str(b.port) for b in bs}
        big = b'{"model":"m","prompt":"' + b"x" * (5 << 20) + b'"}'
        cases = [
            ("POST", "/v1/completions", b"this is not json"),
            ("POST", "/v1/completions", b""),
            ("POST", "/v1/chat/completions", b'{"messages": 5}'),
            ("POST", "/v1/chat/completions", b'{"messages": [' * 5000),
            ("POST", "/v1/completions", b"\xff\xfe\x00garbage"),
            ("GET", "/v1/completions", None),
            ("POST", "/v1/completions", big),
        ]
        for method, path, body in cases:
            status, headers, _ = request(envoy.port, method, path, body)
            assert status == 200, (method, path, (body or b"")[:40])
            assert headers["x-served-by"] in ports
        # The 5 MB body reached the replica whole.
        assert max(r["body_len"] for b in bs for r in b.requests) == len(big)
        # The VM is alive: routing still works, and nothing was reloaded.
        for i in range(4):
            status, _, _ = request(envoy.port, body=completion(f"after {i} " * 20))
            assert status == 200
        assert envoy.stat("prefix_router.parse_errors") >= 4
        assert envoy.stat("wasm.prefix-router.vm_reload_success") == 0
        assert envoy.stat("prefix_router.requests_total") == len(cases) + 4


def test_in_flight_balancing_across_workers_and_draining():
    slow = Backend(delay_s=3.0)
    with slow, backends(3) as fast:
        pool = [slow.addr] + [b.addr for b in fast]
        with start("override_host", pool, concurrency=2) as envoy:
            # Phase 1: a burst, each request held 0.5 s by every replica so
            # the in-flight counts build up: it spreads over all four; the
            # ones on the slow replica stay in flight for 3 s more.
            held = []

            def fire(i):
                return request(
                    envoy.port,
                    body=completion(f"burst {i}"),
                    headers=[("x-test-delay-ms", "500")],
                    timeout=20,
                )

            ex = ThreadPoolExecutor(8)
            held = [ex.submit(fire, i) for i in range(8)]
            deadline = time.time() + 5
            while slow.count == 0 and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.8)  # the fast replicas' held requests finish
            on_slow = slow.count
            assert on_slow >= 1
            gauge = f"replica.{stat_label(slow.addr)}.inflight"
            # Set from the shared load slots on the root's tick: polled, not
            # read once after a sleep (CI saw a tick-old value).
            assert wait_until(lambda: envoy.stat(gauge) == on_slow, timeout=2), (envoy.stat(gauge), on_slow)
            # Phase 2: while those hang, new requests (fresh connections, both
            # workers) avoid the slow replica.
            for i in range(12):
                status, headers, _ = request(envoy.port, body=completion(f"later {i}"))
                assert status == 200
                assert headers["x-served-by"] != str(slow.port)
            assert slow.count == on_slow
            for f in held:
                assert f.result()[0] == 200
            ex.shutdown()
            # Phase 3: every stream ended; the cross-worker counts drain.
            deadline = time.time() + 5
            while time.time() < deadline:
                inflight = {
                    k: v for k, v in envoy.stats().items() if k.endswith(".inflight")
                }
                if all(v == 0 for v in inflight.values()):
                    break
                time.sleep(0.1)
            assert inflight and all(v == 0 for v in inflight.values()), inflight


def test_client_reset_does_not_leak_in_flight():
    slow = Backend(delay_s=2.0)
    with slow, start("original_dst", [slow.addr]) as envoy:
        def abandon():
            try:
                request(envoy.port, body=completion("reset me"), timeout=0.5)
            except OSError:
                pass

        threads = [threading.Thread(target=abandon) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.time() + 10
        while time.time() < deadline and envoy.stat(".inflight") != 0:
            time.sleep(0.1)
        assert envoy.stat(".inflight") == 0
        assert envoy.stat("prefix_router.requests_total") == 4


@pytest.mark.parametrize(
    "plugin,needle",
    [
        ('{"endpoints": ["127.0.0.1:9"], "endpointz": 1}', "unknown field `endpointz`"),
        ('{"endpoints": []}', "`endpoints`: the list is empty"),
        ('{"endpoints": ["127.0.0.1:9", "127.0.0.1:9"]}', "listed twice"),
        ('{"endpoints": ["not-an-ip:80"]}', "`not-an-ip:80` is not an `ip:port`"),
        ('{"endpoints": ["127.0.0.1:9"], "destination_header": "Bad Header"}', "`destination_header`"),
        ("not json", "invalid plugin configuration"),
    ],
)
def test_bad_configuration_is_refused_with_the_key_named(plugin, needle):
    cfg = render_config("original_dst", plugin, [], free_port(), free_port())
    with Envoy(cfg, expect_start=False) as envoy:
        code = envoy.wait_exit(timeout=30)
        log = envoy.log()
        assert code not in (None, 0), "envoy accepted a bad plugin config"
        assert needle in log, log[-3000:]


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-override-host.yaml"])
def test_shipped_dev_configs_validate(name):
    """The configs users copy pass `envoy --mode validate` as shipped (run
    from the repository root, where their module path points)."""
    import subprocess

    from harness import ENVOY_DIR, ROOT, envoy_bin

    r = subprocess.run(
        [envoy_bin(), "--mode", "validate", "-c", str(ENVOY_DIR / name), "-l", "warning"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "OK" in r.stdout + r.stderr
