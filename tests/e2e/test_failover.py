"""Failover under steady load: one replica dies mid-run and comes back.

override_host (max_fallbacks 1 + Envoy retries): at least 99.9% of requests
succeed, the dead replica stops being chosen within 3 scrape intervals, and
gets traffic again after it returns. original_dst (one address, no Envoy
retries to another host): what clients see is measured and printed; the
replica is still excluded within 3 intervals and readmitted.

FAILOVER_SECONDS stretches the run (the closing note's long version)."""
from __future__ import annotations

import http.client
import os
import threading
import time
from collections import Counter

import pytest

from harness import Backend, backends, completion, filter_envoy, request, stat_label, vllm_metrics

INTERVAL_MS = 100
CUT = -1  # a response cut off mid-body



@pytest.mark.parametrize("mode", ["override_host", "original_dst"])
def test_replica_dies_and_returns_under_steady_load(mode):
    total = float(os.environ.get("FAILOVER_SECONDS", "9"))
    kill_at, back_at = total / 3, 2 * total / 3
    with backends(3, metrics=vllm_metrics()) as bs:
        victim = Backend(metrics=vllm_metrics())
        victim.__enter__()
        port = victim.port
        try:
            pool = [b.addr for b in bs] + [victim.addr]
            plugin = {
                "cluster": "pool",
                "scrape_interval_ms": INTERVAL_MS,
                "scrape_timeout_ms": 200,
                "max_fallbacks": 1 if mode == "override_host" else 0,
            }
            with filter_envoy(pool, plugin, mode) as envoy:
                time.sleep(0.5)
                results: list[tuple[float, int]] = []
                lock = threading.Lock()
                t0 = time.time()

                def client(k):
                    i = 0
                    while time.time() - t0 < total:
                        try:
                            status, _, _ = request(envoy.port, body=completion(f"c{k} r{i} " * 20), timeout=5)
                        except OSError:
                            status = 0
                        except http.client.HTTPException:
                            # Headers came from the victim, then it died: the
                            # response was cut after Envoy could retry it.
                            status = CUT
                        with lock:
                            results.append((time.time() - t0, status))
                        i += 1

                threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
                for t in threads:
                    t.start()
                routed = lambda: envoy.stat(f"replica.{stat_label(victim.addr)}.routed")  # noqa: E731
                time.sleep(kill_at)
                victim.stop()
                killed = time.time() - t0
                # Exclusion: the routed counter freezes within 3 intervals.
                # Sampled until the return, so that a failure says when the
                # dead replica was last chosen.
                freeze_at = killed + 3 * INTERVAL_MS / 1000 + 0.25
                moves: list[tuple[float, float, int]] = []  # (after, by, requests)
                last, seen = routed(), time.time() - t0
                while seen < back_at:
                    time.sleep(0.05)
                    now, at = routed(), time.time() - t0
                    if now != last:
                        moves.append((round(seen, 2), round(at, 2), now - last))
                        last = now
                    seen = at
                excluded_ok = not any(after >= freeze_at for after, _, _ in moves)
                victim = Backend(port=port, metrics=vllm_metrics())
                victim.__enter__()
                returned = time.time() - t0
                for t in threads:
                    t.join(timeout=total + 30)
                after_return = victim.count
                statuses = Counter(s for _, s in results)
                failed = [(round(t, 2), s) for t, s in results if s != 200]
                ok = statuses[200] / len(results)
                print(
                    f"\nfailover[{mode}]: {len(results)} requests, {ok:.4%} ok, failures {dict(Counter(s for _, s in failed))}"
                    f" at t={[t for t, _ in failed][:5]}{'...' if len(failed) > 5 else ''}; killed at {killed:.2f}s,"
                    f" back at {returned:.2f}s, requests to it after return: {after_return}"
                )
                assert len(results) > 200
                assert excluded_ok, f"dead replica still chosen 3 intervals after it died (killed at {killed:.2f}s; (after, by, requests): {moves})"
                assert after_return > 0, "replica got no traffic after it came back"
                if mode == "override_host":
                    # A response already streaming from the victim when it
                    # died cannot be retried: at most one per client, all at
                    # the kill. Everything else must succeed.
                    cut = [t for t, s in failed if s == CUT]
                    assert len(cut) <= len(threads), failed
                    assert all(killed - 0.1 <= t <= killed + 1.0 for t in cut), failed
                    ok = statuses[200] / (len(results) - len(cut))
                    assert ok >= 0.999, failed
                else:
                    # One address, no retry to another host: only requests
                    # routed to it before exclusion can fail, all within
                    # about 3 scrape intervals of the kill.
                    assert all(killed - 0.1 <= t <= killed + 3 * INTERVAL_MS / 1000 + 1.0 for t, _ in failed), failed
        finally:
            victim.stop()
