"""Prefix-aware routing in a real Envoy with 4 workers: groups stick to a
replica, groups spread, a hot prefix spills to one more replica (not all),
and a growing multi-turn conversation stays put."""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

from harness import (
    backends,
    chat,
    completion,
    filter_envoy,
    request,
)

def start(pool, concurrency=4, **extra):
    return filter_envoy(pool, {"debug_header": True, **extra}, concurrency=concurrency)


def doc(group: int) -> str:
    # About 4 KiB (64 blocks) of document text per group.
    return f"Document {group} about topic {group * 7919 % 1000}. " + (
        f"Paragraph of group {group} with facts and figures. " * 80
    )


def test_groups_stick_to_one_replica_and_spread_over_the_pool():
    with backends(4) as bs, start([b.addr for b in bs]) as envoy:
        home = {}
        for g in range(20):
            status, headers, _ = request(envoy.port, body=completion(doc(g) + " Q0?"))
            assert status == 200
            home[g] = headers["x-served-by"]

        work = [(g, q) for q in range(1, 10) for g in range(20)]

        def send(item):
            g, q = item
            status, headers, _ = request(envoy.port, body=completion(doc(g) + f" Q{q}?"))
            return g, status, headers

        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(send, work))
        by_group = defaultdict(Counter)
        for g, status, headers in results:
            assert status == 200
            by_group[g][headers["x-served-by"]] += 1
            assert "reason=prefix_hit" in headers["x-prefix-router-debug"], headers
        for g, served in by_group.items():
            assert served == Counter({home[g]: 9}), (g, home[g], served)
        spread = Counter(home.values())
        assert len(spread) == 4 and all(4 <= n <= 6 for n in spread.values()), spread
        # All 4 workers took part, so the index really was shared.
        stats = envoy.stats()
        workers = [v for k, v in stats.items() if ".worker_" in k and k.endswith("downstream_cx_total")]
        assert len(workers) == 4 and sum(1 for v in workers if v > 0) >= 3, workers
        assert envoy.stat("prefix_router.decision.prefix_hit") == 180
        assert envoy.stat("prefix_router.decision.new_prefix") == 20


def test_a_prompt_a_replica_refused_is_not_looked_for_there():
    # A 429 (a replica rate limiting) or a 400 ran nothing: the next
    # request with the prompt is placed as new, not sent back to it.
    with backends(4) as bs, start([b.addr for b in bs], concurrency=2) as envoy:
        for g in range(8):
            refusal = (b"429", b"400")[g % 2]
            status, headers, _ = request(
                envoy.port, body=completion(doc(g) + " Q0?"), headers=[("x-test-status", refusal)]
            )
            assert status == int(refusal)
            assert "reason=new_prefix" in headers["x-prefix-router-debug"], headers
            status, headers, _ = request(envoy.port, body=completion(doc(g) + " Q1?"))
            assert status == 200
            assert "reason=new_prefix" in headers["x-prefix-router-debug"], headers
            home = headers["x-served-by"]
            # What did run is found where it ran.
            status, headers, _ = request(envoy.port, body=completion(doc(g) + " Q2?"))
            assert status == 200 and headers["x-served-by"] == home
            assert "reason=prefix_hit" in headers["x-prefix-router-debug"], headers
        assert envoy.stat("prefix_router.index.uncredited") == 8
        assert envoy.stat("prefix_router.decision.new_prefix") == 16
        assert envoy.stat("prefix_router.decision.prefix_hit") == 8


def test_a_hot_prefix_spills_to_a_second_replica_not_a_third():
    with backends(4) as bs, start([b.addr for b in bs]) as envoy:
        hot = "Hot system prompt shared by everyone. " + "Policy text. " * 600  # ~8 KiB

        def send(i):
            return request(
                envoy.port,
                body=completion(hot + f" question {i}?"),
                headers=[("x-test-delay-ms", "5000")],
                timeout=20,
            )

        # 24 requests held in flight: the holder takes about a dozen before
        # bounded load (3x the mean + slack) spills it; the second holder
        # then shares; a third copy would cost more than the queue.
        ex = ThreadPoolExecutor(24)
        futures = []
        for i in range(24):
            futures.append(ex.submit(send, i))
            time.sleep(0.08)  # each decision sees the previous ones in flight
        served = Counter()
        for f in futures:
            status, headers, _ = f.result()
            assert status == 200
            served[headers["x-served-by"]] += 1
        ex.shutdown()
        assert len(served) == 2, served
        assert min(served.values()) >= 3, served
        assert envoy.stat("prefix_router.decision.load_spill") >= 1


def test_multi_turn_conversations_stay_on_their_replica():
    with backends(4) as bs, start([b.addr for b in bs]) as envoy:
        convs = {
            c: [("system", f"You are assistant number {c}. " + "Follow the house rules. " * 20)]
            for c in range(3)
        }
        homes = defaultdict(list)
        for turn in range(8):
            for c, history in convs.items():
                history.append(("user", f"Turn {turn} question from conversation {c}?"))
                status, headers, _ = request(
                    envoy.port, path="/v1/chat/completions", body=chat(history, stream=turn % 2 == 0)
                )
                assert status == 200
                homes[c].append(headers["x-served-by"])
                if turn > 0:
                    assert "reason=prefix_hit" in headers["x-prefix-router-debug"]
                history.append(("assistant", f"Answer {turn} for {c}. " * 5))
        for c, served in homes.items():
            assert len(set(served)) == 1, (c, served)


def preamble() -> str:
    # About 40 KB: a system prompt and tool definitions, longer than the
    # 16 KiB dense window, shared by every request.
    tools = "".join(
        f'{{"name": "tool_{i}", "description": "Does task {i} for the agent", '
        f'"parameters": {{"type": "object", "properties": {{"arg": {{"type": "string"}}}}}}}}\n'
        for i in range(300)
    )
    return "You are a careful assistant with these tools:\n" + tools


def test_documents_below_a_long_shared_preamble_stick_and_spread():
    """40 KB shared preamble, 12 documents x 5 questions, 4 replicas: every
    document's questions land on one replica, and the documents spread 2-4
    per replica instead of piling onto the preamble's first holder."""
    shared = preamble()
    assert len(shared) > 40_000
    with backends(4) as bs, start([b.addr for b in bs], concurrency=2) as envoy:
        homes = defaultdict(Counter)
        for q in range(5):
            for d in range(12):
                messages = [("system", shared), ("user", doc(d) + f" Question {q}?")]
                status, headers, _ = request(envoy.port, body=chat(messages))
                assert status == 200
                homes[d][headers["x-served-by"]] += 1
        for d, served in homes.items():
            assert len(served) == 1, (d, served)
        per_replica = Counter(next(iter(s)) for s in homes.values())
        assert len(per_replica) == 4 and all(2 <= n <= 4 for n in per_replica.values()), per_replica
        assert envoy.stat("prefix_router.decision.new_branch") >= 8
        # Questions after the first find their whole document held.
        assert envoy.stat("prefix_router.decision.prefix_hit") >= 48


def test_a_short_question_stays_with_its_document_wherever_the_document_ends():
    """Past the dense window checkpoints are 16 blocks apart at this depth,
    so where a question leaves its document is known only to within a
    gap. Documents whose lengths sweep a whole gap: some end just before a
    checkpoint, and their 100-byte questions cross it. Those must still
    follow the document (prefix hits), not be placed like new documents
    (which copied documents to several replicas)."""
    shared = preamble()
    with backends(4) as bs, start([b.addr for b in bs], concurrency=2) as envoy:
        homes = defaultdict(Counter)
        for d in range(24):
            text = doc(d) + "x" * (45 * d)
            for q in range(4):
                question = f" Question {q}: " + "why is it so? " * 6
                messages = [("system", shared), ("user", text + question)]
                status, headers, _ = request(envoy.port, body=chat(messages))
                assert status == 200
                homes[d][headers["x-served-by"]] += 1
        for d, served in homes.items():
            assert len(served) == 1, (d, served)
        # Each document after the first is new content below the preamble;
        # every later question finds its document held.
        assert envoy.stat("prefix_router.decision.new_branch") == 23
        assert envoy.stat("prefix_router.decision.prefix_hit") == 72
