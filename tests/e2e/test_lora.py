"""LoRA affinity end to end: replica-sim replicas report their running
adapters in `vllm:lora_requests_info`; the scraper reads them and the filter
prefers the replica already running a request's adapter, and avoids one
whose only adapter slot is taken by another."""
from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.request
from collections import Counter

from harness import ROOT, Envoy, completion, free_port, render_config, request, stat_label, wait_until

SIM = ROOT / "target" / "release" / "replica-sim"


@contextlib.contextmanager
def replica_sim(n: int, *extra: str):
    """`n` simulated replicas in one process, killed by pid on exit."""
    proc = subprocess.Popen(
        [str(SIM), "--port", "0", "--replicas", str(n), "--preset", "fast", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        addrs = []
        deadline = time.time() + 30
        while len(addrs) < n and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("replica-sim listening on "):
                addrs.append(line.split()[-1])
        assert len(addrs) == n, f"replica-sim announced {addrs}"
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield addrs
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_lora_affinity_through_envoy():
    assert SIM.exists(), "build replica-sim first (scripts/build)"
    with replica_sim(3, "--lora", "sql,chat", "--max-loras", "1") as pool:
        plugin = {"endpoints": pool, "cluster": "pool", "scrape_interval_ms": 100, "max_fallbacks": 1}
        cfg = render_config("override_host", plugin, pool, free_port(), free_port())
        with Envoy(cfg, concurrency=2) as envoy:
            # Pin the `sql` adapter on replica 0 with a long generation sent
            # straight to it (so only its metrics, not the filter's own
            # in-flight count, say so).
            body = json.dumps({"model": "sql", "prompt": "pin", "max_tokens": 4000}).encode()
            pin = threading.Thread(
                target=lambda: urllib.request.urlopen(
                    urllib.request.Request(f"http://{pool[0]}/v1/completions", data=body,
                                           headers={"content-type": "application/json"}),
                    timeout=60,
                ).read()
            )
            pin.start()
            try:
                def pinned():
                    page = urllib.request.urlopen(f"http://{pool[0]}/metrics", timeout=5).read().decode()
                    return 'running_lora_adapters="sql"' in page
                assert wait_until(pinned, timeout=5)
                # A few scrapes later every worker sees it.
                assert wait_until(lambda: envoy.stat(f"{stat_label(pool[0])}.running") >= 1, timeout=5)
                time.sleep(0.3)
                sql, chat = Counter(), Counter()
                for i in range(6):
                    status, headers, _ = request(envoy.port, body=completion(f"question {i}", model="sql"))
                    assert status == 200
                    sql[headers["x-served-by"]] += 1
                for i in range(6):
                    status, headers, _ = request(envoy.port, body=completion(f"question {i}", model="chat"))
                    assert status == 200
                    chat[headers["x-served-by"]] += 1
                # `sql` goes where it is running; `chat` stays off the replica
                # whose single adapter slot `sql` occupies.
                assert sql == Counter({pool[0]: 6}), sql
                assert pool[0] not in chat, chat
            finally:
                pin.join(timeout=60)
