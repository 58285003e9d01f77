"""Replica load from metrics scraping, in a real Envoy with 4 workers: one
scraper for the whole process, queue depth steering traffic, dead replicas
excluded and readmitted, saturation shedding, hostile metrics pages."""
from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import (
    stat_label,
    Backend,
    backends,
    completion,
    filter_envoy,
    request,
    vllm_metrics,
    wait_until,
)

INTERVAL_MS = 100


def doc(d: int) -> str:
    return f"Document {d}: " + "lorem ipsum dolor sit amet " * 150


def start(pool, mode="override_host", concurrency=4, **extra):
    plugin = {
        "cluster": "pool",
        "scrape_interval_ms": INTERVAL_MS,
        "max_fallbacks": 1 if mode == "override_host" else 0,
        **extra,
    }
    return filter_envoy(pool, plugin, mode, concurrency)



@pytest.mark.parametrize("mode", ["original_dst", "override_host"])
def test_one_scraper_per_process_about_once_per_interval(mode):
    with backends(3, metrics=vllm_metrics()) as bs, start([b.addr for b in bs], mode) as envoy:
        time.sleep(0.5)
        before = [b.metrics_hits for b in bs]
        time.sleep(2.0)
        hits = [b.metrics_hits - h for b, h in zip(bs, before)]
        # 2 s / 100 ms = 20 per replica; 5 VMs scraping would be ~100.
        assert all(12 <= h <= 30 for h in hits), hits
        assert envoy.stat("prefix_router.eligible_replicas") == 3
        assert all(envoy.stat(f"{stat_label(b.addr)}.scrapes_ok") > 10 for b in bs)


def test_the_scraper_lease_stays_with_one_vm_under_steady_load():
    # Four workers contend for the lease while they serve traffic. The
    # holder renews it every interval; the lease lasts two. Timers that
    # fire a little early used to skip a round now and then, so the lease
    # lapsed and moved between live VMs (about one move in 5 s here).
    with backends(3, metrics=vllm_metrics()) as bs, start([b.addr for b in bs]) as envoy:
        time.sleep(0.5)
        before = [b.metrics_hits for b in bs]
        stop = time.time() + 4.0

        def client(k):
            i = 0
            while time.time() < stop:
                assert request(envoy.port, body=completion(f"c{k} r{i} " * 20))[0] == 200
                i += 1
            return i

        with ThreadPoolExecutor(4) as ex:
            sent = sum(ex.map(client, range(4)))
        hits = [b.metrics_hits - h for b, h in zip(bs, before)]
        assert sent > 100
        assert envoy.stat("scrape.lease_takeovers") == 0
        # 4 s / 100 ms: 40 rounds, none skipped by an early tick.
        assert all(34 <= h <= 46 for h in hits), hits


def test_a_replica_reporting_a_long_queue_gets_fewer_requests():
    with backends(4, metrics=vllm_metrics()) as bs:
        bs[0].metrics = vllm_metrics(waiting=40, running=16, kv=0.7)
        with start([b.addr for b in bs]) as envoy:
            # The gauge is recorded after the scraper published the row the
            # decisions read (a fixed sleep raced the first scrape).
            queue = f"{stat_label(bs[0].addr)}.waiting"
            assert wait_until(lambda: envoy.stat(queue) == 40), envoy.stat(queue)
            served = Counter()
            for i in range(40):
                status, headers, _ = request(envoy.port, body=completion(f"short {i}"))
                assert status == 200
                served[headers["x-served-by"]] += 1
            assert served[str(bs[0].port)] == 0, served
            assert envoy.stat(f"{stat_label(bs[0].addr)}.waiting") == 40


def group_doc(g):
    """About 13 KB of one group's document (210 blocks)."""
    return f"Document {g}. " + f"Facts of group {g}, with figures. " * 400


def ask_groups(envoy, rounds):
    """`rounds` more questions to each of 40 groups: where each went."""
    seen = {g: [] for g in range(40)}
    for rnd in range(rounds):
        for g in range(40):
            status, headers, _ = request(envoy.port, body=completion(group_doc(g) + f" Q{rnd + 1}?"))
            assert status == 200
            seen[g].append(headers["x-served-by"])
    return seen


def test_a_replica_that_evicts_its_prefixes_loses_some_of_them_for_good():
    """A replica whose own prefix-cache counters say it misses most of what
    it is sent (a smaller KV cache than its share) keeps only part of its
    groups: the others move, once, to replicas that keep them."""
    with backends(4, metrics=vllm_metrics(cache=(0, 0))) as bs:
        with start([b.addr for b in bs], debug_header=True) as envoy:  # hit_rate_feedback is on by default
            home = {}
            for g in range(40):
                status, headers, _ = request(envoy.port, body=completion(group_doc(g) + " Q0?"))
                assert status == 200
                home[g] = headers["x-served-by"]
            small = str(bs[0].port)
            mine = [g for g in home if home[g] == small]
            assert len(mine) >= 4, Counter(home.values())
            # Two more questions each: the index now expects each replica to
            # hit most of what it is sent (what it measures is judged against
            # that, once 1,024 blocks of hits were expected).
            for q in ("Qa", "Qb"):
                for g in range(40):
                    _, headers, _ = request(envoy.port, body=completion(group_doc(g) + f" {q}?"))
                    assert headers["x-served-by"] == home[g]
            # The index credited each replica with about two thirds of what
            # it sent it (one cold round, two warm ones).
            expected = f"{stat_label(bs[0].addr)}.cache_expected_percent"
            assert wait_until(lambda: 55 <= envoy.stat(expected) <= 70), envoy.stat(expected)
            assert envoy.stat("prefix_router.decision.replica_evicting") == 0
            # Counters that grow: replica 0 hits 30% of the tokens it looks
            # up, the others 95%.
            for step in range(1, 11):
                for i, b in enumerate(bs):
                    q = 100_000.0 * step
                    b.metrics = vllm_metrics(cache=(q, q * (0.3 if i == 0 else 0.95)))
                time.sleep(INTERVAL_MS / 1000)
            label = stat_label(bs[0].addr)
            assert wait_until(lambda: envoy.stat(f"{label}.cache_hit_percent") == 30)
            assert envoy.stat(f"{stat_label(bs[1].addr)}.cache_hit_percent") == 95
            rounds = 4
            seen = ask_groups(envoy, rounds)
            # The other replicas' groups stay where they were.
            assert all(seen[g] == [home[g]] * rounds for g in home if home[g] != small), seen
            # Its groups move at most once, away from it, and stay where they
            # went. (Which ones can grow for a while: the index's expected
            # rate for it still rises from its cold first round, so it keeps
            # a little less of its credit each round.)
            for g in mine:
                changes = [i for i in range(1, rounds) if seen[g][i] != seen[g][i - 1]]
                assert len(changes) <= 1, (g, seen[g])
                assert seen[g][0] == small or not changes, (g, seen[g])
            moved = [g for g in mine if seen[g][-1] != small]
            # About 1 - 0.30 / 0.95 = 68% of its groups leave it.
            assert 1 <= len(moved) < len(mine), (moved, mine)
            assert envoy.stat("prefix_router.decision.credit_withheld") >= len(moved)
            # Every request after the counters changed saw it evicting.
            assert envoy.stat("prefix_router.decision.replica_evicting") == rounds * 40


def test_with_several_gateways_a_replica_over_its_traffic_share_sheds_some_groups():
    """One of three gateway instances: when the replicas' own lookup
    counters say one of them carries twice the traffic of each other one
    (rendezvous gave it more than its share of groups), part of its
    groups move, once, and the rest of the pool's stay."""
    with backends(4, metrics=vllm_metrics(cache=(0, 0))) as bs:
        with start([b.addr for b in bs], debug_header=True, gateways=3, traffic_balance=True) as envoy:
            home = {}
            for g in range(40):
                status, headers, _ = request(envoy.port, body=completion(group_doc(g) + " Q0?"))
                assert status == 200
                home[g] = headers["x-served-by"]
            count = Counter(home.values())
            hot_port, _ = count.most_common(1)[0]
            hot = next(b for b in bs if str(b.port) == hot_port)
            mine = [g for g in home if home[g] == hot_port]
            assert len(mine) >= 8, count
            # Counters that grow: the hot replica looks up twice the tokens
            # each other one does (a share of 1.6 of the mean), all hitting
            # 95% (nobody evicts).
            for step in range(1, 11):
                for b in bs:
                    q = 200_000.0 * step * (2 if b is hot else 1)
                    b.metrics = vllm_metrics(cache=(q, q * 0.95))
                time.sleep(INTERVAL_MS / 1000)
            share = f"{stat_label(hot.addr)}.traffic_share_percent"
            # (Each replica's sum decays from its own scrape times: a few
            # tenths of a percent apart.)
            assert wait_until(lambda: 158 <= envoy.stat(share) <= 162), envoy.stat(share)
            other = next(b for b in bs if b is not hot)
            assert 79 <= envoy.stat(f"{stat_label(other.addr)}.traffic_share_percent") <= 81
            rounds = 3
            seen = ask_groups(envoy, rounds)
            # The other replicas' groups stay; none moves to the hot one.
            assert all(seen[g] == [home[g]] * rounds for g in home if home[g] != hot_port), seen
            # About 1 - 1.1 / 1.6 = 31% of its groups leave it, in the first
            # round after the counters changed, and stay where they went.
            moved = [g for g in mine if seen[g][0] != hot_port]
            assert 1 <= len(moved) < len(mine), (moved, mine)
            assert all(seen[g] == [seen[g][0]] * rounds for g in mine), {g: seen[g] for g in mine}
            assert envoy.stat("prefix_router.decision.credit_withheld") == rounds * len(moved)
            assert envoy.stat("prefix_router.decision.replica_hot") == rounds * 40
            assert envoy.stat("prefix_router.decision.replica_evicting") == 0


def test_a_dead_replica_is_excluded_without_failed_requests_and_comes_back():
    with backends(3, metrics=vllm_metrics()) as bs:
        victim = Backend(metrics=vllm_metrics())
        victim.__enter__()
        port = victim.port
        try:
            pool = [b.addr for b in bs] + [victim.addr]
            with start(pool) as envoy:
                time.sleep(0.5)
                label = stat_label(victim.addr)
                routed = lambda: envoy.stat(f"replica.{label}.routed")  # noqa: E731
                statuses = Counter()

                def burst(n, tag):
                    for i in range(n):
                        status, _, _ = request(envoy.port, body=completion(f"{tag} {i} " * 30))
                        statuses[status] += 1

                burst(20, "before")
                assert victim.count > 0
                victim.stop()
                # Steady traffic across the failure: retries go to the
                # fallback address in the header.
                burst(30, "during")
                # Out once its failed scrapes are published (the gauge is
                # set on the scraper's tick, after the table decisions read).
                assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 3, timeout=5), (
                    "dead replica still eligible"
                )
                frozen = routed()
                burst(30, "after")
                assert routed() == frozen, "dead replica still chosen after 3 intervals"
                assert statuses == Counter({200: 80}), statuses
                # It comes back on its next good scrape.
                victim = Backend(port=port, metrics=vllm_metrics())
                victim.__enter__()
                assert wait_until(lambda: envoy.stat("prefix_router.eligible_replicas") == 4)
                burst(40, "recovered")
                assert victim.count > 0
                assert statuses[200] == 120
        finally:
            victim.stop()


def test_saturated_pool_sheds_sheddable_requests_only():
    busy = vllm_metrics(waiting=9, running=32, kv=0.95)
    with backends(2, metrics=busy) as bs, start([b.addr for b in bs]) as envoy:
        kv = [f"{stat_label(b.addr)}.kv_usage_percent" for b in bs]
        assert wait_until(lambda: all(envoy.stat(g) == 95 for g in kv)), [envoy.stat(g) for g in kv]
        status, headers, body = request(
            envoy.port, body=completion("x" * 200), headers=[("x-prefix-router-priority", "sheddable")]
        )
        assert status == 429
        assert headers["retry-after"] == "1"
        err = json.loads(body)["error"]
        assert err["type"] == "saturated" and "saturated" in err["message"]
        status, _, _ = request(envoy.port, body=completion("x" * 200))
        assert status == 200
        status, _, _ = request(envoy.port, method="GET", path="/v1/models",
                               headers=[("x-prefix-router-priority", "-1")])
        assert status == 429
        # An Anthropic Messages API client gets its API's error shape.
        messages = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 200}]}
        status, headers, body = request(
            envoy.port, path="/v1/messages?beta=true", body=messages,
            headers=[("x-prefix-router-priority", "sheddable"), ("anthropic-version", "2023-06-01")],
        )
        assert status == 429
        assert headers["retry-after"] == "1"
        answer = json.loads(body)
        assert answer["type"] == "error" and answer["error"]["type"] == "rate_limit_error", answer
        assert "saturated" in answer["error"]["message"]
        assert envoy.stat("prefix_router.shed_429") == 3
        # Load drops: nothing is shed any more.
        for b in bs:
            b.metrics = vllm_metrics(waiting=0, running=1, kv=0.2)
        assert wait_until(lambda: all(envoy.stat(g) == 20 for g in kv)), [envoy.stat(g) for g in kv]
        status, _, _ = request(
            envoy.port, body=completion("x" * 200), headers=[("x-prefix-router-priority", "sheddable")]
        )
        assert status == 200


def test_when_every_scrape_fails_the_filter_fails_open():
    with backends(2, metrics=None) as bs, start([b.addr for b in bs], mode="original_dst") as envoy:
        # Every metrics page is a 404 (metrics off, a wrong path): after 3
        # failures no replica passes its scrapes. The replicas still serve:
        # requests are routed over both, and a document still sticks.
        assert wait_until(lambda: envoy.stat(".scrapes_failed") >= 8, timeout=5)
        assert envoy.stat(".scrapes_ok") == 0
        assert envoy.stat("prefix_router.eligible_replicas") == 0
        served = Counter()
        for d in range(12):
            for q in range(2):
                status, headers, _ = request(envoy.port, body=completion(doc(d) + f" Q{q}?"))
                assert status == 200
                served[(d, headers["x-served-by"])] += 1
        assert len(served) == 12, served
        assert len({by for _, by in served}) == 2
        assert envoy.stat("prefix_router.routed_blind") == 24
        assert envoy.stat("prefix_router.unavailable_503") == 0
        # The log file is flushed every 100 ms.
        assert wait_until(lambda: "no replica passed its metrics scrapes" in envoy.log())
        assert envoy.log().count("no replica passed its metrics scrapes") == 1


def test_a_slow_page_is_not_a_failed_scrape_before_half_the_timeout():
    # A busy replica's metrics page can take a few hundred ms. Counted
    # failed at each tick it was still out, a 350 ms page made its replica
    # ineligible for the last 50 ms of every round (3 failures by 300 ms,
    # reset by the late answer).
    with backends(2, metrics=vllm_metrics()) as bs:
        bs[0].metrics_delay_s = 0.35
        with start([b.addr for b in bs]) as envoy:
            slow = stat_label(bs[0].addr)
            assert wait_until(lambda: envoy.stat(f"{slow}.scrapes_ok") >= 6, timeout=10)
            assert envoy.stat(f"{slow}.scrapes_failed") == 0
            assert envoy.stat("prefix_router.eligible_replicas") == 2


@pytest.mark.parametrize(
    "page",
    [
        b"",
        b"\x00\xff garbage {{{ not prometheus\n" * 100,
        b"vllm:num_requests_waiting{model_name=\"m\"} 1\n" + b"# padding\n" * (1 << 20),  # ~10 MB
        "slow",
    ],
    ids=["empty", "garbage", "10MB", "slow"],
)
def test_hostile_metrics_pages_do_not_crash_or_stall_the_filter(page):
    with backends(2, metrics=vllm_metrics()) as bs:
        if page == "slow":
            bs[0].metrics_delay_s = 5.0
        else:
            bs[0].metrics = page
        with start([b.addr for b in bs], scrape_timeout_ms=300) as envoy:
            time.sleep(1.5)
            label = stat_label(bs[0].addr)
            # Out once its failed scrapes are published, not after a guess.
            assert wait_until(
                lambda: envoy.stat("prefix_router.eligible_replicas") == 1 and envoy.stat(f"{label}.scrapes_failed") >= 3
            ), (envoy.stat("prefix_router.eligible_replicas"), envoy.stat(f"{label}.scrapes_failed"))
            with ThreadPoolExecutor(4) as ex:
                results = list(ex.map(lambda i: request(envoy.port, body=completion(f"q{i} " * 30)), range(20)))
            assert all(r[0] == 200 for r in results)
            served = Counter(r[1]["x-served-by"] for r in results)
            # The bad replica is out after its failed scrapes.
            assert served == Counter({str(bs[1].port): 20}), served
            assert envoy.stat(f"{label}.scrapes_failed") >= 3
            assert envoy.stat("wasm.prefix-router.vm_reload_success") == 0
            # The good replica kept being scraped on time.
            assert envoy.stat(f"{stat_label(bs[1].addr)}.scrapes_ok") >= 8
