"""Many gateways, one placement: three independent Envoy processes (no
shared state) in front of the same replicas. New content is placed by a
function of the content and the replica set that every instance computes
alike, so a group, or a conversation below a system prompt that every
conversation shares, keeps its replica whichever instance each request
reaches; a session-affinity token minted by one instance is honoured by
another, in a header or in a cookie that several sessions share; forged and
foreign tokens are ignored and counted."""
from __future__ import annotations

import contextlib
import http.cookiejar
import json
import random
import urllib.request
from collections import Counter, defaultdict

from harness import Envoy, backends, chat, completion, filter_envoy, free_port, render_config, request, wait_until

KEY = "gateway-shared-secret-0123456789abcdef"
AFFINITY = "x-prefix-router-affinity"


def doc(group: int) -> str:
    return f"Document {group} about topic {group * 7919 % 1000}. " + (
        f"Paragraph of group {group} with facts and figures. " * 60
    )


@contextlib.contextmanager
def gateways(pool, n=3, key=KEY, clients_echo=False, cookie=None):
    affinity = {"key": key, "clients_echo": clients_echo}
    if cookie:
        affinity["cookie"] = cookie
    plugin = {"gateways": n, "debug_header": True, "affinity": affinity}
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(filter_envoy(pool, plugin, concurrency=1)) for _ in range(n)]


def test_groups_keep_their_replica_whichever_instance_a_request_reaches():
    rng = random.Random(7)
    with backends(4) as bs, gateways([b.addr for b in bs]) as gws:
        served = defaultdict(Counter)
        for q in range(6):
            for g in range(16):
                gw = rng.choice(gws)
                status, headers, _ = request(gw.port, body=completion(doc(g) + f" Question {q}?"))
                assert status == 200
                served[g][headers["x-served-by"]] += 1
        for g, c in served.items():
            assert len(c) == 1, (g, c)
        homes = Counter(next(iter(c)) for c in served.values())
        # Rendezvous spreads them, lumpily with 12 keys (up to 7 on one).
        assert len(homes) >= 2, homes
        # Each instance placed groups it had never seen and agreed.
        assert all(gw.stat("prefix_router.decision.new_prefix") >= 1 for gw in gws)


def conversation(c: int, turns: int) -> dict:
    """Conversation `c` at its `turns`-th turn, below a system prompt that
    every conversation shares."""
    system = "You are the support assistant of ACME. Answer exactly and cite the manual. " * 20
    messages = [("system", system)]
    for t in range(turns):
        if t:
            messages.append(("assistant", f"Answer {c}.{t}. " * 10))
        # Over 1 KB of its own from the first turn: a new branch below the
        # shared system prompt, not a question that stays with its holder.
        messages.append(("user", f"[{c}.{t}] Conversation {c}: " + "details of the case " * 60))
    return chat(messages)


def test_conversations_keep_their_replica_across_instances_without_tokens():
    # Each instance's first request is a conversation's first turn, before
    # it has seen the system prompt shared (it can't tell the system prompt
    # from the conversation's own part by what it learned): it must still
    # put the conversation where the others do. Keyed by the system prompt,
    # those three conversations went to one replica, and their later turns
    # split between it and the replica the other instances chose.
    rng = random.Random(5)
    with backends(4) as bs, gateways([b.addr for b in bs]) as gws:
        served = defaultdict(Counter)
        for turns in range(1, 5):
            for c in range(12):
                gw = gws[c % 3] if turns == 1 else rng.choice(gws)
                status, headers, _ = request(gw.port, body=conversation(c, turns))
                assert status == 200
                served[c][headers["x-served-by"]] += 1
        for c, replicas in served.items():
            assert len(replicas) == 1, (c, replicas)
        homes = Counter(next(iter(r)) for r in served.values())
        # Rendezvous spreads them, lumpily with 12 keys (up to 7 on one).
        assert len(homes) >= 2, homes
        assert all(gw.stat("prefix_router.decision.new_prefix") == 1 for gw in gws)


def test_session_affinity_survives_a_hop_between_instances():
    with backends(4) as bs, gateways([b.addr for b in bs]) as (a, b, c):
        # A conversation on instance A: its token names the replica.
        status, headers, _ = request(a.port, body=completion(doc(1) + " Turn 1?"))
        assert status == 200
        token = headers[AFFINITY]
        first = headers["x-served-by"]
        # Another conversation, whose own placement is elsewhere, sent to
        # instance B with A's token: B follows the token.
        for g in range(2, 40):
            status, headers, _ = request(b.port, body=completion(doc(g) + " Turn 1?"))
            if headers["x-served-by"] != first:
                break
        else:
            raise AssertionError("every group landed on the token's replica")
        status, headers, _ = request(
            b.port, body=completion(doc(g) + " Turn 2?"), headers=[(AFFINITY, token)]
        )
        assert status == 200
        assert headers["x-served-by"] == first
        assert "reason=affinity" in headers["x-prefix-router-debug"]
        assert b.stat("prefix_router.decision.affinity") == 1
        # The upstream never sees the token.
        assert all(AFFINITY not in r["headers"] for be in bs for r in be.requests)


def test_a_failed_response_carries_no_affinity_token():
    # A 5xx (here the replicas' own 503, through Envoy's retry) names no
    # replica for the client to come back to; a success does.
    with backends(2) as bs, gateways([b.addr for b in bs], n=1) as (gw,):
        for b in bs:
            b.down = True
        status, headers, _ = request(gw.port, body=completion(doc(1) + " Turn 1?"))
        assert status == 503
        assert AFFINITY not in headers
        for b in bs:
            b.down = False
        status, headers, _ = request(gw.port, body=completion(doc(1) + " Turn 1?"))
        assert status == 200
        assert AFFINITY in headers


def test_a_request_served_elsewhere_than_the_pick_is_accounted_there():
    # The pick refuses connections (down, no scraping to tell); Envoy
    # retries on the header's next address. The affinity token and the
    # prompt's place in the index follow the replica that answered (its load
    # too: the filter's unit test; the in-flight gauge here is a tick's
    # sample, racy to read).
    with backends(2) as (live, dead):
        plugin = {"max_fallbacks": 1, "debug_header": True, "affinity": {"key": KEY}}
        with filter_envoy([live.addr, dead.addr], plugin, concurrency=1) as gw:
            dead.stop()
            picked_dead = 0
            for g in range(16):
                status, headers, _ = request(gw.port, body=completion(doc(g) + " Turn 1?"))
                assert status == 200
                assert headers["x-served-by"] == str(live.port)
                picked_dead += f"replica={dead.addr};" in headers["x-prefix-router-debug"]
                token = headers[AFFINITY]
                # The token leads back to the replica that answered: followed,
                # and served there at the first attempt.
                status, headers, _ = request(
                    gw.port, body=completion(doc(100 + g) + " Turn 2?"), headers=[(AFFINITY, token)]
                )
                assert status == 200
                assert f"replica={live.addr}; reason=affinity" in headers["x-prefix-router-debug"], headers
            assert picked_dead > 0
            assert gw.stat("prefix_router.served_elsewhere") == picked_dead
            # The prompts moved in the index as well: asked again without a
            # token, each is looked for where it was served.
            for g in range(16):
                status, headers, _ = request(gw.port, body=completion(doc(g) + " Turn 1?"))
                assert status == 200
                assert f"replica={live.addr};" in headers["x-prefix-router-debug"], headers


def test_a_failure_after_a_retry_elsewhere_leaves_its_prompt_where_it_failed():
    # The pick refuses connections; Envoy's retry reaches the other
    # replica, which answers 500 (the test backend answers what
    # x-test-status asks). A 500 may have computed the prompt, the refused
    # pick did not: asked again, the prompt is looked for where it failed.
    with backends(2) as (live, dead):
        plugin = {"max_fallbacks": 1, "debug_header": True, "affinity": {"key": KEY}}
        with filter_envoy([live.addr, dead.addr], plugin, concurrency=1) as gw:
            dead.stop()
            picked_dead = []
            for g in range(16):
                status, headers, _ = request(
                    gw.port, body=completion(doc(g) + " Turn 1?"), headers=[("x-test-status", "500")]
                )
                assert status == 500
                assert AFFINITY not in headers
                if f"replica={dead.addr};" in headers["x-prefix-router-debug"]:
                    picked_dead.append(g)
            assert picked_dead
            assert gw.stat("prefix_router.served_elsewhere") == len(picked_dead)
            for g in picked_dead:
                status, headers, _ = request(gw.port, body=completion(doc(g) + " Turn 1?"))
                assert status == 200
                assert f"replica={live.addr}; reason=prefix_hit" in headers["x-prefix-router-debug"], headers


def test_with_echoing_clients_sessions_keep_their_replica_across_instances():
    # `clients_echo`: a new session is placed by the instance it reaches,
    # as with one gateway; its later turns, each to a random instance,
    # carry the token and follow it.
    rng = random.Random(11)
    with backends(4) as bs, gateways([b.addr for b in bs], clients_echo=True) as gws:
        served = defaultdict(Counter)
        tokens = {}
        for turn in range(1, 5):
            for s in range(12):
                prompt = doc(100 + s) + "".join(f" Turn {t}?" for t in range(1, turn + 1))
                extra = [(AFFINITY, tokens[s])] if s in tokens else []
                status, headers, _ = request(
                    rng.choice(gws).port, body=completion(prompt), headers=extra
                )
                assert status == 200
                served[s][headers["x-served-by"]] += 1
                tokens[s] = headers[AFFINITY]
        for s, c in served.items():
            assert len(c) == 1, (s, c)
        # Each instance spreads the sessions it starts over the pool.
        per_replica = Counter(next(iter(c)) for c in served.values())
        assert len(per_replica) == 4 and max(per_replica.values()) <= 4, per_replica
        assert sum(gw.stat("prefix_router.decision.affinity") for gw in gws) == 12 * 3
        assert sum(gw.stat("prefix_router.affinity.rejected") for gw in gws) == 0


def test_forged_and_foreign_tokens_are_ignored_and_counted():
    with backends(3) as bs:
        pool = [b.addr for b in bs]
        with gateways(pool, n=1) as (gw,), gateways(pool, n=1, key="another-key-" + "x" * 30) as (other,):
            _, headers, _ = request(other.port, body=completion(doc(1) + " Q?"))
            foreign = headers[AFFINITY]
            _, headers, _ = request(gw.port, body=completion(doc(2) + " Q?"))
            good = headers[AFFINITY]
            forged = good[:15] + ("0" if good[15] != "0" else "1") + good[16:]
            for bad in (foreign, forged, "not-a-token", "f" * 56):
                status, headers, _ = request(
                    gw.port, body=completion(doc(3) + " Q?"), headers=[(AFFINITY, bad)]
                )
                assert status == 200
                assert "reason=affinity" not in headers["x-prefix-router-debug"]
            assert gw.stat("prefix_router.affinity.rejected") == 4
            assert gw.stat("prefix_router.decision.affinity") == 0


def test_sessions_sharing_a_cookie_jar_each_keep_their_replica_across_instances():
    # One client with a standard cookie jar (http.cookiejar: httpx, and so
    # the OpenAI Python SDK, keeps its cookies in one) runs six
    # conversations; it never echoes a header. With `clients_echo`, each
    # instance places a new conversation by its own load, so a later turn
    # that reaches another instance finds its replica only through the
    # cookie, whose entry for that conversation it picks out of the six by
    # the prompt. (One turn at a time: no response races another for the
    # jar, which can lose a new session's entry; hence the README's advice
    # to leave `clients_echo` off with shared jars.)
    rng = random.Random(13)
    with backends(4) as bs, gateways([b.addr for b in bs], clients_echo=True, cookie="pr") as gws:
        jar = http.cookiejar.CookieJar()
        client = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))

        def post(port, body):
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            with client.open(req, timeout=30) as resp:
                assert resp.status == 200
                return resp.headers

        served = defaultdict(Counter)
        for turns in range(1, 5):
            for c in range(6):
                gw = gws[c % 3] if turns == 1 else rng.choice(gws)
                headers = post(gw.port, conversation(c, turns))
                served[c][headers["x-served-by"]] += 1
                assert any(ck.name == "pr" for ck in jar)
        for c, replicas in served.items():
            assert len(replicas) == 1, (c, replicas)
        # Each instance put the two it started on two replicas (by its own
        # load: it doesn't see the others' placements here, the backends
        # export no metrics).
        home = {c: next(iter(r)) for c, r in served.items()}
        assert all(home[i] != home[i + 3] for i in range(3)), home
        # Every later turn followed its own entry; none was refused.
        assert sum(gw.stat("prefix_router.decision.affinity") for gw in gws) == 6 * 3
        assert sum(gw.stat("prefix_router.affinity.rejected") for gw in gws) == 0
        # The upstream never sees the cookie.
        seen = [r["headers"].get("cookie", "") for be in bs for r in be.requests]
        assert len(seen) == 24 and not any("pr=" in c for c in seen), seen


def response_id(data: bytes, streamed: bool) -> str:
    """A Responses API answer's id, streamed (its `response.completed`
    event) or not."""
    text = data.decode()
    if not streamed:
        return json.loads(text)["id"]
    done = [l for l in text.splitlines() if '"response.completed"' in l and l.startswith("data:")]
    return json.loads(done[-1][5:])["response"]["id"]


def responses_conversations(gws, rng, conversations=6, turns=5):
    """Responses API conversations, each later turn continuing the last by
    `previous_response_id`, every turn (and a read-back of each stored
    response) sent to a random instance; streamed and not, alternately.
    What each conversation's turns got: (status, served by, response id)."""
    out = defaultdict(list)
    for c in range(conversations):
        previous = None
        for t in range(turns):
            body = {
                "model": "sim-model",
                "instructions": "You are a careful assistant. " * 40,
                "input": f"Conversation {c}, question {t}: what next?",
                "max_output_tokens": 4,
                "stream": t % 2 == 1,
            }
            if previous:
                body["previous_response_id"] = previous
            gw = rng.choice(gws)
            status, headers, data = request(gw.port, path="/v1/responses", body=body)
            rid = None
            if status == 200:
                rid = response_id(data, body["stream"])
                previous = rid
            out[c].append((status, headers.get("x-served-by"), rid))
    return out


def test_stored_responses_are_continued_on_their_replica_from_any_instance():
    # vLLM keeps a stored response (Responses API, `store` by default) in
    # its own memory: a follow-up by `previous_response_id` that reaches
    # another replica is answered 404. With `response_ids` the filter names
    # each response after its replica, and every instance reads it back.
    from test_lora import SIM, replica_sim

    assert SIM.exists(), "build replica-sim first (scripts/build)"
    paths = ["/v1/completions", "/v1/chat/completions", "/v1/responses"]
    rng = random.Random(5)
    with replica_sim(4) as pool:
        for named in (True, False):
            plugin = {
                "gateways": 3,
                "inference_paths": paths,
                "affinity": {"key": KEY, "response_ids": named},
            }
            with contextlib.ExitStack() as stack:
                gws = [stack.enter_context(filter_envoy(pool, plugin, concurrency=1)) for _ in range(3)]
                turns = responses_conversations(gws, rng)
                statuses = Counter(s for got in turns.values() for s, _, _ in got)
                if not named:
                    # Without it, follow-ups land where a new prompt would:
                    # 404s (5 and 12 of the 24 follow-ups in two runs), or,
                    # about one run in twelve, none because every turn of
                    # every conversation went to the one replica holding
                    # the shared instructions (the inputs are shorter than
                    # a block).
                    served = {by for got in turns.values() for s, by, _ in got if s == 200}
                    assert statuses[404] >= 1 or len(served) == 1, (statuses, served)
                    continue
                assert statuses == {200: 30}, statuses
                for c, got in turns.items():
                    assert len({by for _, by, _ in got}) == 1, (c, got)
                    assert all(rid.startswith("resp_") and len(rid) == 77 for _, _, rid in got), got
                # Sessions spread from their first turn (4 replicas in two
                # runs; the control put 6 and 5 of 6 on one).
                homes = Counter(got[0][1] for got in turns.values())
                assert len(homes) >= 3, homes
                # A stored response read back through any instance.
                for c, got in turns.items():
                    status, headers, _ = request(rng.choice(gws).port, method="GET", path=f"/v1/responses/{got[-1][2]}")
                    assert (status, headers.get("x-served-by")) == (200, got[0][1]), c
                total = lambda name: sum(gw.stat(f"prefix_router.{name}") for gw in gws)
                assert total("responses.named") == 30
                assert total("decision.stored_response") == 6 * 4 + 6
                assert total("responses.unknown") == 0


def set_fault(addr: str, mode: str) -> None:
    body = json.dumps({"mode": mode}).encode()
    req = urllib.request.Request(f"http://{addr}/admin/fault", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


def test_a_stored_response_its_replica_refused_is_continued_on_its_successor():
    # A create named after a replica that answers 503 is retried by Envoy
    # on the header's next address and stored there, under the first's
    # name (streamed or not, alternately). The next address is the named replica's successor, the same on
    # every instance, and every follow-up lists it too: while the replica
    # is down its 503 is retried there, and once it is back its 404 is.
    from test_lora import SIM, replica_sim

    assert SIM.exists(), "build replica-sim first (scripts/build)"
    paths = ["/v1/completions", "/v1/chat/completions", "/v1/responses"]
    plugin = {
        "inference_paths": paths,
        "max_fallbacks": 1,
        "affinity": {"key": KEY, "response_ids": True},
    }
    rng = random.Random(7)
    with replica_sim(4) as pool, contextlib.ExitStack() as stack:
        gws = []
        for _ in range(2):
            cfg = render_config("override_host", {"endpoints": pool, **plugin}, pool, free_port(), free_port())
            hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            retry = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"]
            # As envoy-production.yaml: a 503 goes to the next address.
            retry["retry_on"] += ",retriable-status-codes"
            retry["retriable_status_codes"] = [503]
            gws.append(stack.enter_context(Envoy(cfg, concurrency=1)))
        down = pool[0]
        set_fault(down, "down")
        turns = defaultdict(list)
        previous = {}
        for t in range(4):
            if t == 2:
                set_fault(down, "ok")  # back, without the responses
                retried = sum(gw.stat("cluster.pool.upstream_rq_retry") for gw in gws)
            for c in range(8):
                body = {
                    "model": "sim-model",
                    "instructions": "You are a careful assistant. " * 40,
                    "input": f"Conversation {c}, question {t}: what next?",
                    "max_output_tokens": 4,
                    "stream": (c + t) % 2 == 1,
                }
                if c in previous:
                    body["previous_response_id"] = previous[c]
                status, headers, data = request(rng.choice(gws).port, path="/v1/responses", body=body)
                if status == 200:
                    previous[c] = response_id(data, body["stream"])
                turns[c].append((status, headers.get("x-served-by")))
        statuses = Counter(s for got in turns.values() for s, _ in got)
        assert statuses == {200: 32}, (statuses, dict(turns))
        for c, got in turns.items():
            assert len({by for _, by in got}) == 1, (c, got)
            assert got[0][1] != down, (c, got)
        for c, rid in previous.items():
            status, headers, _ = request(rng.choice(gws).port, method="GET", path=f"/v1/responses/{rid}")
            assert (status, headers.get("x-served-by")) == (200, turns[c][0][1]), c
        total = lambda name: sum(gw.stat(name) for gw in gws)
        # At least one session of the down replica's (sessions start where
        # the fewest are), each turn served by its successor: its last two
        # after a 404 from the replica, back.
        elsewhere = total("prefix_router.served_elsewhere")
        assert elsewhere >= 4 and total("cluster.pool.upstream_rq_retry") == elsewhere, elsewhere
        # While it was down, its sessions' first two turns were retried
        # after its 503; back, their last two and the read-back after its
        # 404.
        assert retried % 2 == 0 and elsewhere - retried == 3 * (retried // 2), (elsewhere, retried)
        assert total("prefix_router.responses.misplaced") == 0
        assert total("prefix_router.responses.unknown") == 0
        assert total("prefix_router.responses.named") == 32


def test_a_long_stored_request_is_renamed_whole_with_its_length():
    # A 300 KB body reaches the filter in many chunks; the renamed body the
    # upstream gets is all of it, behind the new first member, with a
    # content-length that says so.
    plugin = {"inference_paths": ["/v1/responses"], "affinity": {"key": KEY, "response_ids": True}}
    with backends(2) as bs, filter_envoy([b.addr for b in bs], plugin) as gw:
        body = json.dumps({"model": "m", "instructions": "Be brief.", "input": "word " * 60_000}).encode()
        status, _, _ = request(gw.port, path="/v1/responses", body=body)
        assert status == 200
        (got,) = [r for b in bs for r in b.requests]
        head, tail = got["body_ends"]
        first = len(b'{"request_id":"",') + 77
        assert head.startswith(b'{"request_id":"resp_') and head[first:] == body[1 : 129 - first], head
        assert tail == body[-64:]
        assert got["body_len"] == len(body) + len(b'"request_id":"",') + 77
        assert got["headers"]["content-length"] == str(got["body_len"])
        assert gw.stat("prefix_router.responses.named") == 1


def test_stored_responses_without_a_fallback_address_are_warned_about_at_start():
    # With `max_fallbacks` 0 (the default) a create its replica refuses is
    # stored where no follow-up looks: the operator is told once, at start.
    affinity = {"inference_paths": ["/v1/responses"], "affinity": {"key": KEY, "response_ids": True}}
    advice = "`affinity.response_ids` with `max_fallbacks` 0"
    with backends(1) as (b,):
        with filter_envoy([b.addr], affinity) as gw:
            assert request(gw.port, body=completion("hello there"))[0] == 200
            # The log file is flushed every 100 ms.
            assert wait_until(lambda: advice in gw.log()), gw.log()[-2000:]
        with filter_envoy([b.addr], {**affinity, "max_fallbacks": 1}) as gw:
            assert request(gw.port, body=completion("hello there"))[0] == 200
            assert wait_until(lambda: "configured with 1 replicas" in gw.log()), gw.log()[-2000:]
            assert advice not in gw.log()
