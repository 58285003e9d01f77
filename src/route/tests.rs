use super::*;
use crate::load::tests::started;
use crate::request::extract;
use crate::store::MemStore;

fn router(extra: &str) -> Router {
    let json = format!(
        r#"{{"endpoints":["10.0.0.1:80","10.0.0.2:80","10.0.0.3:80","10.0.0.4:80"]{extra}}}"#
    );
    Router::new(Config::parse(json.as_bytes()).unwrap())
}

fn hashed(r: &Router, body: &str) -> Hashed {
    Hashed::of(&extract(body.as_bytes(), 1 << 20).unwrap(), &r.config)
}

fn doc(group: usize, q: usize) -> String {
    let prefix = format!("Document {group}: ").repeat(200);
    format!(r#"{{"model":"m","prompt":"{prefix} Question {q}?"}}"#)
}

#[test]
fn a_group_sticks_to_one_replica_and_groups_spread() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    let mut homes = Vec::new();
    for g in 0..20 {
        let mut picks = Vec::new();
        for q in 0..10 {
            let h = hashed(&r, &doc(g, q));
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            if q > 0 {
                assert_eq!(c.reason, Reason::PrefixHit);
            }
            r.commit(&s, &mut board, &c, &h, 1000);
            board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
            picks.push(c.order[0]);
        }
        assert!(picks.iter().all(|&p| p == picks[0]), "group {g}: {picks:?}");
        homes.push(picks[0]);
    }
    // New prefixes go where less new content went: an even spread even
    // when requests come one at a time (no load to balance on).
    for r in 0..4 {
        let n = homes.iter().filter(|&&h| h == r).count();
        assert!(
            (4..=6).contains(&n),
            "replica {r} got {n} groups: {homes:?}"
        );
    }
}

/// A 40 KB shared preamble (longer than any fixed window), then one of
/// `doc` documents (about 1,500 tokens), then a question.
fn preambled(doc: usize, q: usize) -> String {
    let preamble =
        "You are a careful assistant. Tools: search(query), fetch(url). ".repeat(40_000 / 64);
    let body = format!("Document {doc}: ").repeat(6_000 / 12);
    format!(r#"{{"model":"m","prompt":"{preamble}{body} Question {q}?"}}"#)
}

#[test]
fn documents_below_a_long_shared_preamble_stick_and_spread() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    let mut homes = std::collections::HashMap::new();
    for q in 0..5 {
        for d in 0..12 {
            let h = hashed(&r, &preambled(d, q));
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            r.commit(&s, &mut board, &c, &h, 1000);
            board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
            let home = *homes.entry(d).or_insert(c.order[0]);
            assert_eq!(c.order[0], home, "document {d}, question {q}");
            if q > 0 {
                assert_eq!(c.matched, c.blocks, "the whole document is held");
            }
        }
    }
    for replica in 0..4 {
        let n = homes.values().filter(|&&h| h == replica).count();
        assert!(
            (2..=4).contains(&n),
            "replica {replica} has {n} documents: {homes:?}"
        );
    }
}

#[test]
fn a_short_question_after_a_deep_document_stays_with_it() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    // Documents of 6,000-7,020 bytes: some end just before a
    // checkpoint, so a 100-byte question crosses it. Past the dense
    // window checkpoints are 16 blocks apart at this depth.
    let ask = |d: usize, q: usize| {
        let preamble =
            "You are a careful assistant. Tools: search(query), fetch(url). ".repeat(625);
        let doc = format!("{:>20}", format!("Document {d}: ")).repeat(300 + d);
        let question = format!("Question {q}: {}?", "why? ".repeat(18));
        format!(r#"{{"model":"m","prompt":"{preamble}{doc}{question}"}}"#)
    };
    let mut run = |d: usize, q: usize| {
        let h = hashed(&r, &ask(d, q));
        let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        r.commit(&s, &mut board, &c, &h, 1000);
        board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
        (c, h.blocks())
    };
    let mut crossed = 0;
    for d in 0..52 {
        let home = run(d, 0).0.order[0];
        for q in 1..4 {
            let (c, blocks) = run(d, q);
            let held = c.matches.branch.map_or(0, |b| b.held);
            crossed += usize::from(blocks - held >= 16);
            assert_eq!(
                (c.order[0], c.reason),
                (home, Reason::PrefixHit),
                "document {d}, question {q}: {blocks} blocks, {held} shared"
            );
        }
    }
    // Counted from the last shared checkpoint, these questions brought
    // 16 or more blocks of new content: placed like new documents.
    assert!(crossed >= 9, "{crossed} questions crossed a checkpoint");
}

/// An agent session's `turns`-th request: the 40 KB shared preamble,
/// its task (about 15 blocks), then a 6 KB tool result per turn.
pub(crate) fn agent(session: usize, turns: usize) -> String {
    let preamble =
        "You are a careful assistant. Tools: search(query), fetch(url). ".repeat(40_000 / 64);
    let task = format!("Task {session}: make the build green. ").repeat(30);
    let results: String = (0..turns)
        .map(|t| format!("Result {session}.{t}: ").repeat(6_000 / 12))
        .collect();
    format!(r#"{{"model":"m","prompt":"{preamble}{task}{results}"}}"#)
}

#[test]
fn agent_sessions_spread_evenly_when_their_first_result_finds_home_busy() {
    // One Envoy worker, then two: each session's task is placed by one
    // worker and its first tool result by the other, as a client's pooled
    // connections spread a session's requests over workers.
    for workers in [1, 2] {
        sessions_spread_evenly(workers);
    }
}

fn sessions_spread_evenly(workers: u64) {
    let r = router("");
    let s = MemStore::new();
    let mut boards: Vec<LoadBoard> = (1..=workers).map(|w| LoadBoard::new(w, 10_000)).collect();
    let vms = boards.len();
    let id = |i: usize| r.endpoint(i).unwrap().id();
    let run = |body: &str, board: &mut LoadBoard| {
        let h = hashed(&r, body);
        let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        r.commit(&s, board, &c, &h, 1000);
        board.finish(&s, id(c.order[0]), c.work, 1000);
        c
    };
    // First turns: a task below the preamble, two per replica.
    let first: Vec<usize> = (0..8)
        .map(|a| run(&agent(a, 0), &mut boards[a % vms]).order[0])
        .collect();
    // Each session's first tool result arrives while another session's
    // long turn runs on the replica that took its task. A task is no
    // home yet: the session is placed like new content, by how many
    // sessions each replica took, not by who is idle this instant.
    // A turn that arrives while `work` runs on `busy`.
    let run_beside = |body: &str, board: &mut LoadBoard, busy: usize, work: u64| {
        board.start(&s, id(busy), started(work, 0, false), 1000);
        let c = run(body, board);
        board.finish(&s, id(busy), work, 1000);
        c
    };
    let branches = |replica: usize| load::snapshot(&s, 1000, 10_000)[&id(replica)].branches;
    let mut homes = Vec::new();
    for (a, &took) in first.iter().enumerate() {
        let c = run_beside(&agent(a, 1), &mut boards[(a + 1) % vms], took, 900);
        assert_eq!(
            c.reason,
            Reason::NewBranch,
            "{workers} workers, session {a}"
        );
        homes.push(c.order[0]);
    }
    for replica in 0..4 {
        let n = homes.iter().filter(|&&h| h == replica).count();
        let why = format!("{workers} workers, replica {replica}: {homes:?} (tasks on {first:?})");
        assert_eq!(n, 2, "{why}");
        // A moved session counts where it went, once, whichever worker
        // placed it first.
        assert_eq!(branches(replica), 2, "{why}");
    }
    // From then on each session stays home.
    for (a, &home) in homes.iter().enumerate() {
        let c = run(&agent(a, 2), &mut boards[a % vms]);
        assert_eq!(
            (c.order[0], c.reason),
            (home, Reason::PrefixHit),
            "{workers} workers, session {a}"
        );
    }
    // A later turn that finds its home busy spills, and its session
    // moves with it: counted where it went, no longer where
    // it was, so the next spill goes where the fewest sessions are.
    let spill = |a: usize, boards: &mut Vec<LoadBoard>| {
        let c = run_beside(&agent(a, 3), &mut boards[a % vms], homes[a], 6_000);
        assert_eq!(
            c.reason,
            Reason::LoadSpill,
            "{workers} workers, session {a}"
        );
        c.order[0]
    };
    let left = homes[0];
    let went = spill(0, &mut boards);
    assert_ne!(went, left);
    assert_eq!(
        (branches(left), branches(went)),
        (1, 3),
        "{workers} workers"
    );
    let b = (1..8)
        .find(|&b| homes[b] != left && homes[b] != went)
        .unwrap();
    assert_eq!(spill(b, &mut boards), left, "{workers} workers");
}

#[test]
fn with_instances_that_must_agree_a_sessions_lead_is_followed() {
    // What one instance saw of a session may be a part of it: its lead
    // is a held prefix like any other, not a session still to place.
    for (extra, reason) in [
        ("", Reason::NewBranch),
        (r#","gateways":3"#, Reason::PrefixHit),
    ] {
        let r = router(extra);
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let mut first = Vec::new();
        for a in 0..8 {
            let h = hashed(&r, &agent(a, if a == 0 { 0 } else { 1 }));
            let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
            r.commit(&s, &mut board, &c, &h, 1000);
            board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
            first.push(c.order[0]);
        }
        let c = r
            .decide(&s, &hashed(&r, &agent(0, 1)), Meta::default(), 1000)
            .unwrap();
        assert_eq!(c.reason, reason, "{extra}");
        if reason == Reason::PrefixHit {
            assert_eq!(c.order[0], first[0]);
        }
    }
}

/// A chat conversation's `turns`-th request (1-based): a 1.5 KB system
/// prompt every conversation shares, then 2 KB user turns and short
/// answers.
pub(crate) fn chat(conv: usize, turns: usize) -> String {
    let system = "You are the support assistant of ACME. Be exact. ".repeat(30);
    let mut messages = vec![format!(r#"{{"role":"system","content":"{system}"}}"#)];
    for t in 0..turns {
        if t > 0 {
            let answer = format!("Answer {conv}.{t}. ").repeat(10);
            messages.push(format!(r#"{{"role":"assistant","content":"{answer}"}}"#));
        }
        let user = format!("Conversation {conv}, turn {t}: ").repeat(80);
        messages.push(format!(r#"{{"role":"user","content":"{user}"}}"#));
    }
    format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
}

/// One decision, committed and finished at once.
fn run(r: &Router, s: &MemStore, board: &mut LoadBoard, body: &str) -> Choice {
    let h = hashed(r, body);
    let c = r.decide(s, &h, Meta::default(), 1000).unwrap();
    r.commit(s, board, &c, &h, 1000);
    board.finish(s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
    c
}

/// Endpoint indices by rendezvous weight for where conversation `conv`
/// leaves the shared system prompt: the order every instance computes.
fn agreed_order(r: &Router, conv: usize) -> Vec<usize> {
    let h = hashed(r, &chat(conv, 2));
    let key = h.checkpoints[h.lead_end().unwrap() + 1].hash;
    let mut order: Vec<usize> = (0..r.endpoints().len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(score::rendezvous(key, r.endpoint(i).unwrap().id())));
    order
}

#[test]
fn an_instances_first_conversation_goes_where_every_instance_puts_it() {
    // Three gateway instances, each with its own index. `aware` has
    // seen several conversations below the shared system prompt; a
    // fresh instance's very first request is conversation `f`, and it
    // knows nothing of the system prompt. Both must put `f` on the
    // same replica, and the fresh one must keep it there once it has
    // seen the system prompt fork. Keyed at its first checkpoint (the
    // system prompt) as an instance that knows nothing did before,
    // `f` went to the system prompt's replica instead.
    let extra = r#","gateways":3"#;
    let aware = router(extra);
    let (s_aware, mut b_aware) = (MemStore::new(), LoadBoard::new(1, 10_000));
    for other in 100..104 {
        run(&aware, &s_aware, &mut b_aware, &chat(other, 1));
    }
    let mut homes = HashSet::new();
    for f in 0..24 {
        let fresh = router(extra);
        let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
        let first = run(&fresh, &s, &mut board, &chat(f, 1));
        assert_eq!(first.reason, Reason::NewPrefix, "conversation {f}");
        let home = agreed_order(&fresh, f)[0];
        assert_eq!(first.order[0], home, "conversation {f}");
        let agreed = run(&aware, &s_aware, &mut b_aware, &chat(f, 1));
        assert_eq!((agreed.order[0], agreed.reason), (home, Reason::NewBranch));
        for other in 100..102 {
            run(&fresh, &s, &mut board, &chat(other, 1));
        }
        for turns in 2..4 {
            let c = run(&fresh, &s, &mut board, &chat(f, turns));
            assert_eq!((c.order[0], c.reason), (home, Reason::PrefixHit), "{f}");
        }
        homes.insert(home);
    }
    // The conversations' keys differ: they spread over the pool.
    assert_eq!(homes.len(), 4);
}

#[test]
fn a_session_spilled_past_its_two_replicas_returns_to_them() {
    // Both replicas every instance computes for conversation 7 are
    // over the load bound when its first turn arrives, so it spills to
    // a third. Another instance would look for it on the first of the
    // two, so once they have room its next turn moves there (once),
    // and stays.
    let r = router(r#","gateways":3,"bounded_load_factor":1.2"#);
    let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
    for other in 100..102 {
        run(&r, &s, &mut board, &chat(other, 1));
    }
    let order = agreed_order(&r, 7);
    let id = |i: usize| r.endpoint(i).unwrap().id();
    for &i in &order[..2] {
        for _ in 0..2 {
            board.start(&s, id(i), started(20_000, 0, false), 1000);
        }
    }
    let spilled = run(&r, &s, &mut board, &chat(7, 1));
    assert!(
        !order[..2].contains(&spilled.order[0]),
        "{:?}",
        spilled.order
    );
    for &i in &order[..2] {
        for _ in 0..2 {
            board.finish(&s, id(i), 20_000, 1000);
        }
    }
    let back = run(&r, &s, &mut board, &chat(7, 2));
    assert_eq!((back.order[0], back.reason), (order[0], Reason::NewBranch));
    let stays = run(&r, &s, &mut board, &chat(7, 3));
    assert_eq!(
        (stays.order[0], stays.reason),
        (order[0], Reason::PrefixHit)
    );
}

#[test]
fn a_session_on_the_second_of_its_replicas_moves_to_the_first_once_it_has_room() {
    // The first of conversation 7's two replicas is busy when its first
    // turns arrive, so they go to the second. Other instances look for
    // it on the first whenever the first has room, so once it has, the
    // conversation moves there (once) and stays.
    let r = router(r#","gateways":3"#);
    let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
    for other in 100..102 {
        run(&r, &s, &mut board, &chat(other, 1));
    }
    let order = agreed_order(&r, 7);
    let first = r.endpoint(order[0]).unwrap().id();
    board.start(&s, first, started(1_000, 0, false), 1000);
    for turns in 1..3 {
        let c = run(&r, &s, &mut board, &chat(7, turns));
        assert_eq!(c.order[0], order[1], "turn {turns}");
    }
    board.finish(&s, first, 1_000, 1000);
    let moved = run(&r, &s, &mut board, &chat(7, 3));
    assert_eq!(
        (moved.order[0], moved.reason),
        (order[0], Reason::NewBranch)
    );
    let stays = run(&r, &s, &mut board, &chat(7, 4));
    assert_eq!(
        (stays.order[0], stays.reason),
        (order[0], Reason::PrefixHit)
    );
}

#[test]
fn a_conversation_with_its_own_system_prompt_stays_where_it_started() {
    // No fork at the lead: the system prompt is the conversation's own,
    // and every instance keys it there. Nothing is rehomed.
    let r = router(r#","gateways":3"#);
    let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
    let own = |turns: usize| chat(7, turns).replace("ACME", "Initech");
    let h = hashed(&r, &own(1));
    let first = r.decide(&s, &h, Meta::default(), 1000).unwrap();
    r.commit(&s, &mut board, &first, &h, 1000);
    board.finish(
        &s,
        r.endpoint(first.order[0]).unwrap().id(),
        first.work,
        1000,
    );
    for turns in 2..6 {
        let h = hashed(&r, &own(turns));
        let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        assert_eq!((c.order[0], c.reason), (first.order[0], Reason::PrefixHit));
        r.commit(&s, &mut board, &c, &h, 1000);
        board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
    }
}

#[test]
fn work_estimates_grow_with_the_whole_prompt() {
    let r = router("");
    let s = MemStore::new();
    let short = hashed(&r, &doc(1, 1));
    let long = hashed(&r, &preambled(1, 1));
    assert!(long.blocks() > 600, "{} blocks", long.blocks());
    let ws = r.decide(&s, &short, Meta::default(), 0).unwrap().work;
    let wl = r.decide(&s, &long, Meta::default(), 0).unwrap().work;
    assert!(wl > 2 * ws, "long {wl} vs short {ws}");
    // A replica busy with three long cold prefills looks busy.
    let mut board = LoadBoard::new(1, 10_000);
    for q in 0..3 {
        let h = hashed(&r, &preambled(100 + q, q));
        let mut c = r.decide(&s, &h, Meta::default(), 0).unwrap();
        c.order = vec![0];
        r.commit(&s, &mut board, &c, &h, 0);
    }
    for q in 0..20 {
        let c = r
            .decide(&s, &hashed(&r, &doc(50 + q, 0)), Meta::default(), 0)
            .unwrap();
        assert_ne!(c.order[0], 0);
    }
}

#[test]
fn index_writes_per_request_are_bounded_whatever_its_length() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    let text = "x".repeat(1 << 20);
    let body = format!(r#"{{"model":"m","prompt":"{text}"}}"#);
    let h = hashed(&r, &body);
    let c = r.decide(&s, &h, Meta::default(), 0).unwrap();
    let (rec, _) = r.commit(&s, &mut board, &c, &h, 0);
    assert!(
        rec.writes <= 257,
        "{} writes for a 1 MiB prompt",
        rec.writes
    );
    assert_eq!(c.blocks, (1 << 20) / 64);
}

#[test]
fn a_hot_prefix_spills_to_a_second_replica_before_a_third() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    let mut used = Vec::new();
    // Requests of one 8 KiB document (about 2,000 tokens, 128 blocks)
    // that all stay in flight.
    let long = format!("Document seven: {}", "lorem ipsum dolor ".repeat(460));
    for q in 0..40 {
        let body = format!(r#"{{"model":"m","prompt":"{long} Question {q}?"}}"#);
        let h = hashed(&r, &body);
        let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        r.commit(&s, &mut board, &c, &h, 1000);
        if !used.contains(&c.order[0]) {
            used.push(c.order[0]);
        }
        // Holding the prefix is worth 2 x 128 blocks of cost: two holders
        // absorb about 25 in-flight requests before a third copy pays.
        if q < 20 {
            assert!(used.len() <= 2, "third replica after {q} requests");
        }
    }
    assert!(used.len() >= 2, "never spilled: {used:?}");
    assert!(used.len() <= 4);
}

#[test]
fn a_busy_holders_followers_spill_over_several_replicas() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    let h = hashed(&r, &doc(0, 0));
    let first = r.decide(&s, &h, Meta::default(), 1000).unwrap();
    r.commit(&s, &mut board, &first, &h, 1000);
    let holder = first.order[0];
    // Unrelated requests in flight on the holder, well over the bound.
    for _ in 0..60 {
        let mut c = first.clone();
        c.order = vec![holder];
        r.commit(&s, &mut board, &c, &Hashed::default(), 1000);
    }
    // Questions a few blocks long, each different.
    let ask = |q: usize| {
        let question = format!("Question {q}: ").repeat(30);
        let body = format!(
            r#"{{"model":"m","prompt":"{} {question}"}}"#,
            "Document 0: ".repeat(200)
        );
        hashed(&r, &body)
    };
    let picks: HashSet<usize> = (1..40)
        .map(|q| r.decide(&s, &ask(q), Meta::default(), 1000).unwrap().order[0])
        .collect();
    assert!(!picks.contains(&holder), "{picks:?}");
    // Near-ties among the others go by each question's own key: the
    // hot document's overflow is shared by all three.
    assert_eq!(picks.len(), 3, "{picks:?} holder {holder}");
}

#[test]
fn header_lists_fallbacks_best_first() {
    let r = router(r#","max_fallbacks":2"#);
    let s = MemStore::new();
    let c = r
        .decide(&s, &Hashed::default(), Meta::default(), 0)
        .unwrap();
    let v = r.header_value(&c);
    let parts: Vec<&str> = v.split(',').collect();
    assert_eq!(parts.len(), 3);
    assert!(parts
        .iter()
        .all(|p| r.config.static_endpoints.iter().any(|e| e.as_str() == *p)));
    assert_eq!(c.reason, Reason::NoPrompt);
}

#[test]
fn in_flight_work_steers_requests_without_prompts() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    let mut seen = Vec::new();
    for _ in 0..4 {
        let c = r
            .decide(&s, &Hashed::default(), Meta::default(), 0)
            .unwrap();
        r.commit(&s, &mut board, &c, &Hashed::default(), 0);
        seen.push(c.order[0]);
    }
    seen.sort();
    assert_eq!(seen, vec![0, 1, 2, 3], "each idle replica gets one");
}

#[test]
fn shadow_routes_with_the_baseline_and_measures_the_gap() {
    for (baseline, name) in [("round_robin", "rr"), ("least_request", "lr")] {
        let r = router(&format!(
            r#","mode":"shadow","shadow_baseline":"{baseline}""#
        ));
        let s = MemStore::new();
        let mut board = LoadBoard::new(1, 10_000);
        let (mut ours, mut base) = (0u64, 0u64);
        let mut picks = std::collections::HashSet::new();
        // 30 documents, each asked twice: the second ask finds its
        // document on one replica, which the baseline hits 1 time in 4.
        for q in 0..60 {
            let h = hashed(&r, &doc(q % 30, q));
            let (c, why) = r.decide_explained(&s, &h, Meta::default(), 1000).unwrap();
            let sh = r.shadow(c, &why, q as u64);
            picks.insert(sh.routed.order[0]);
            ours += sh.ours_matched as u64;
            base += sh.routed.matched as u64;
            r.commit(&s, &mut board, &sh.routed, &h, 1000);
            if name == "lr" {
                let id = r.endpoint(sh.routed.order[0]).unwrap().id();
                board.finish(&s, id, sh.routed.work, 1000);
            }
        }
        // The baseline spreads the two documents over all replicas...
        assert_eq!(picks.len(), 4, "{name}");
        // ...and our pick would have matched far more of each prefix.
        assert!(ours > base * 2, "{name}: ours {ours} vs baseline {base}");
    }
}

#[test]
fn discovered_replicas_join_after_their_first_scrape_and_leave_when_gone() {
    use crate::metrics::ReplicaMetrics;
    use crate::replicas::record_scrape;
    let json = r#"{"endpoints":["10.0.0.1:80"],"cluster":"pool",
        "discovery":{"cluster":"pool","admin_cluster":"admin"}}"#;
    let mut r = Router::new(Config::parse(json.as_bytes()).unwrap());
    let s = MemStore::new();
    let new: Endpoint = "10.0.0.9:80".parse().unwrap();
    discovery::publish(&s, std::slice::from_ref(&new));
    r.refresh(&s);
    assert_eq!(r.endpoints().len(), 2);
    let picks = |r: &Router, now| {
        (0..40)
            .flat_map(|q| {
                r.decide(&s, &hashed(r, &doc(q, 0)), Meta::default(), now)
                    .unwrap()
                    .order
            })
            .collect::<std::collections::HashSet<usize>>()
    };
    assert_eq!(picks(&r, 1000), [0].into(), "not before its first scrape");
    let ids: Vec<u64> = r.endpoints().iter().map(|e| e.id()).collect();
    record_scrape(&s, new.id(), Ok(&ReplicaMetrics::default()), &ids, 1000).unwrap();
    assert!(picks(&r, 1000).contains(&1));
    discovery::publish(&s, &[]);
    r.refresh(&s);
    assert_eq!(r.endpoints().len(), 1);
}

#[test]
fn discovered_replicas_awaiting_their_first_scrape_are_no_scrape_failure() {
    use crate::replicas::record_scrape;
    let json = r#"{"cluster":"pool","discovery":{"cluster":"pool","admin_cluster":"admin"}}"#;
    let mut r = Router::new(Config::parse(json.as_bytes()).unwrap());
    let s = MemStore::new();
    let found: Vec<Endpoint> = ["10.0.0.8:80", "10.0.0.9:80"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    discovery::publish(&s, &found);
    r.refresh(&s);
    // The start: none eligible yet, none failed.
    assert_eq!(r.eligible_count(&s, 1000), 0);
    assert!(r.awaiting_first_scrapes(&s));
    // One failed scrape: that is news.
    let ids: Vec<u64> = found.iter().map(Endpoint::id).collect();
    record_scrape(&s, ids[0], Err(()), &ids, 1000).unwrap();
    assert!(!r.awaiting_first_scrapes(&s));
    // A static replica never waits for a scrape.
    let r = router(r#","cluster":"pool""#);
    assert!(!r.awaiting_first_scrapes(&MemStore::new()));
}

#[test]
fn sheddable_values() {
    for yes in ["sheddable", " Sheddable ", "low", "BATCH", "-1", "-100"] {
        assert!(is_sheddable(yes), "{yes}");
    }
    for no in ["", "critical", "standard", "0", "5", "-", "sheddable-ish"] {
        assert!(!is_sheddable(no), "{no}");
    }
}

#[test]
fn saturation_sheds_only_sheddable_requests_and_no_replica_is_a_503() {
    use crate::metrics::ReplicaMetrics;
    use crate::replicas::record_scrape;
    let r = router(r#","cluster":"pool""#);
    let s = MemStore::new();
    let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
    let busy = ReplicaMetrics {
        waiting: 9.0,
        ..ReplicaMetrics::default()
    };
    for &id in &ids[..3] {
        record_scrape(&s, id, Ok(&busy), &ids, 1000).unwrap();
    }
    let shed = Meta {
        sheddable: true,
        ..Meta::default()
    };
    // One replica has no metrics yet: not everyone is saturated.
    assert!(r.decide(&s, &Hashed::default(), shed, 1000).is_ok());
    record_scrape(&s, ids[3], Ok(&busy), &ids, 1000).unwrap();
    let rej = r.decide(&s, &Hashed::default(), shed, 1000).unwrap_err();
    assert_eq!(rej.status, 429);
    assert!(r
        .decide(&s, &Hashed::default(), Meta::default(), 1000)
        .is_ok());
    // Everyone stale: none passes its scrapes, so every one is ranked,
    // without their stale rows (no longer saturated: nothing is shed).
    for meta in [shed, Meta::default()] {
        let c = r.decide(&s, &Hashed::default(), meta, 10_000).unwrap();
        assert!(c.blind);
        assert_eq!(c.order.len(), ids.len());
    }
}

#[test]
fn when_no_replica_passes_its_scrapes_every_one_is_ranked_by_load_and_prefix() {
    use crate::replicas::record_scrape;
    let r = router(r#","cluster":"pool""#);
    let s = MemStore::new();
    let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
    let mut board = LoadBoard::new(1, 60_000);
    // A document placed while every replica was healthy.
    let first = run(&r, &s, &mut board, &doc(1, 0));
    assert!(!first.blind);
    // One replica fails its scrapes: never picked.
    for _ in 0..3 {
        record_scrape(&s, ids[first.order[0]], Err(()), &ids, 1000).unwrap();
    }
    let c = r
        .decide(&s, &hashed(&r, &doc(1, 1)), Meta::default(), 1000)
        .unwrap();
    assert!(!c.blind && !c.order.contains(&first.order[0]));
    // Every one fails (a wrong metrics path, the connection limit): all
    // are ranked again, the document goes back to its holder, and new
    // ones spread by load.
    for &id in &ids {
        for _ in 0..3 {
            record_scrape(&s, id, Err(()), &ids, 1000).unwrap();
        }
    }
    let c = r
        .decide(&s, &hashed(&r, &doc(1, 2)), Meta::default(), 1000)
        .unwrap();
    assert!(c.blind);
    assert_eq!((c.order[0], c.reason), (first.order[0], Reason::PrefixHit));
    let mut picked = HashSet::new();
    for d in 10..30 {
        let c = r
            .decide(&s, &hashed(&r, &doc(d, 0)), Meta::default(), 1000)
            .unwrap();
        r.commit(&s, &mut board, &c, &hashed(&r, &doc(d, 0)), 1000);
        picked.insert(c.order[0]);
    }
    assert_eq!(picked.len(), ids.len());
}

#[test]
fn unhealthy_replicas_are_never_picked() {
    use crate::replicas::record_scrape;
    let r = router(r#","cluster":"pool""#);
    let s = MemStore::new();
    let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
    for _ in 0..3 {
        record_scrape(&s, ids[0], Err(()), &ids, 1000).unwrap();
    }
    for q in 0..50 {
        let h = hashed(&r, &doc(q, 0));
        let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        assert_ne!(c.order[0], 0);
        assert!(!c.order.contains(&0));
    }
}

#[test]
fn diagnostics_are_built_only_on_request_and_change_nothing() {
    let r = router("");
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 10_000);
    for q in 0..12 {
        let h = hashed(&r, &doc(q % 3, q));
        let plain = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        let (c, why) = r.decide_explained(&s, &h, Meta::default(), 1000).unwrap();
        assert_eq!(
            (&plain.order, plain.reason, plain.matched, plain.work),
            (&c.order, c.reason, c.matched, c.work)
        );
        // Every eligible replica, costs best first like the order.
        let by_cost: Vec<usize> = why.costs.iter().map(|c| c.endpoint).collect();
        assert_eq!(by_cost, c.order);
        let listed: Vec<usize> = why.requests.iter().map(|r| r.endpoint).collect();
        assert_eq!(listed, vec![0, 1, 2, 3]);
        r.commit(&s, &mut board, &c, &h, 1000);
    }
    let in_flight: u32 = r
        .decide_explained(&s, &Hashed::default(), Meta::default(), 1000)
        .unwrap()
        .1
        .requests
        .iter()
        .map(|r| r.requests)
        .sum();
    assert_eq!(in_flight, 12);
}

#[test]
fn explain_names_the_pick() {
    let r = router("");
    let s = MemStore::new();
    let h = hashed(&r, &doc(1, 1));
    let (c, why) = r.decide_explained(&s, &h, Meta::default(), 0).unwrap();
    let text = r.explain(&c, &why);
    assert!(text.starts_with(&format!("replica={}", r.endpoint(c.order[0]).unwrap())));
    assert!(text.contains("reason=new_prefix"));
}

/// Forty groups placed by one of three gateway instances (`extra` adds to
/// its config), then three more questions each, after scrapes that say
/// the replica holding the most groups looks up twice what each other one
/// does. Returns that replica's groups, and each (group, replica) a
/// question went to other than its first one's.
fn after_a_hot_replica(extra: &str) -> (Vec<usize>, Vec<(usize, usize)>) {
    use crate::metrics::{CacheCounters, ReplicaMetrics};
    use crate::replicas::record_scrape;
    let r = router(&format!(r#","cluster":"pool","gateways":3{extra}"#));
    let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
    let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
    // Every replica reports; its counters' increments are its traffic.
    let scrape = |looked_up: &dyn Fn(usize) -> f64| {
        for (i, &id) in ids.iter().enumerate() {
            let m = ReplicaMetrics {
                cache: Some(CacheCounters {
                    queries: looked_up(i),
                    hits: looked_up(i) * 0.9,
                }),
                ..ReplicaMetrics::default()
            };
            record_scrape(&s, id, Ok(&m), &ids, 1000).unwrap();
        }
    };
    scrape(&|_| 0.0);
    let homes: Vec<usize> = (0..40)
        .map(|g| run(&r, &s, &mut board, &doc(g, 0)).order[0])
        .collect();
    let count = |i: usize| homes.iter().filter(|&&h| h == i).count();
    let hot = (0..4).max_by_key(|&i| count(i)).unwrap();
    let on_hot: Vec<usize> = (0..40).filter(|&g| homes[g] == hot).collect();
    // Even traffic: every group stays.
    scrape(&|_| 200_000.0);
    for (g, &home) in homes.iter().enumerate() {
        let c = run(&r, &s, &mut board, &doc(g, 1));
        assert_eq!((c.order[0], c.hot, c.withheld), (home, 0, 0), "group {g}");
    }
    // 800k tokens looked up lately against 400k on each other replica: a
    // share of 1.6 (the mean is 500k), so about 1 - 1.1 / 1.6 = 31% of its
    // groups leave it.
    scrape(&|i| if i == hot { 800_000.0 } else { 400_000.0 });
    let mut moved: Vec<(usize, usize)> = Vec::new();
    for q in 2..5 {
        for (g, &home) in homes.iter().enumerate() {
            let c = run(&r, &s, &mut board, &doc(g, q));
            if home != hot {
                assert_eq!(c.order[0], home, "group {g}, question {q}");
            } else if c.order[0] != hot {
                moved.push((g, c.order[0]));
            }
        }
    }
    (on_hot, moved)
}

#[test]
fn with_several_gateways_a_replica_over_its_traffic_share_sheds_some_groups() {
    let (on_hot, moved) = after_a_hot_replica(r#","traffic_balance":true"#);
    assert!(on_hot.len() >= 8, "{on_hot:?}");
    // Some of its groups left, not all, and each went to one replica and
    // stayed there for every later question (the same hash on every
    // request, and on every instance).
    let left: HashSet<usize> = moved.iter().map(|&(g, _)| g).collect();
    assert!(
        !left.is_empty() && left.len() < on_hot.len(),
        "{left:?} of {on_hot:?}"
    );
    for &g in &left {
        let to: Vec<usize> = moved.iter().filter(|m| m.0 == g).map(|m| m.1).collect();
        assert_eq!(to.len(), 3, "group {g} came back: {to:?}");
        assert!(to.iter().all(|&t| t == to[0]), "group {g}: {to:?}");
    }
    // Off (the default), none moves.
    let (_, moved) = after_a_hot_replica("");
    assert_eq!(moved, vec![]);
}

#[test]
fn every_shared_data_key_is_in_this_builds_key_space() {
    // Routing, scraping, the scraper lease and discovery all write under
    // `store::shared_key`, so a release with other records never reads or
    // contends for them during a rollout.
    use crate::metrics::ReplicaMetrics;
    use crate::replicas::{acquire_lease, record_scrape};
    let r = router(r#","cluster":"pool""#);
    let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
    let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
    acquire_lease(&s, 1, 0, 1000, 500);
    acquire_lease(&s, 1, 0, 1000, 500);
    record_scrape(&s, ids[0], Ok(&ReplicaMetrics::default()), &ids, 1000).unwrap();
    discovery::publish(&s, &r.config.static_endpoints);
    for q in 0..4 {
        run(&r, &s, &mut board, &doc(q, 0));
    }
    let keys = s.keys();
    let ours = crate::store::shared_key!("");
    assert!(keys.iter().all(|k| k.starts_with(ours)), "{keys:?}");
    for kind in [
        "idx/",
        "load/slots",
        "load/0",
        "replicas",
        "scrape-lease",
        "discovered",
    ] {
        let of_kind = format!("{ours}{kind}");
        assert!(
            keys.iter().any(|k| k.starts_with(&of_kind)),
            "{kind}: {keys:?}"
        );
    }
}

#[test]
fn any_gateway_count_above_one_decides_alike() {
    // Only one gateway against several changes a decision, so an
    // autoscaled fleet keeps one config (README, `gateways`). Same
    // requests, some left in flight so loads differ: the same picks at 2,
    // 3 and 64 instances, and other picks with one, whether clients echo
    // the affinity token or not. The scraped running requests differ:
    // other instances' requests count (`others`).
    use crate::metrics::ReplicaMetrics;
    use crate::replicas::record_scrape;
    let picks = |gateways: u32, echo: bool| {
        let affinity =
            r#","affinity":{"key":"0123456789abcdef0123456789abcdef","clients_echo":true}"#;
        let extra = if echo { affinity } else { "" };
        let r = router(&format!(
            r#","cluster":"pool","gateways":{gateways}{extra}"#
        ));
        let (s, mut board) = (MemStore::new(), LoadBoard::new(1, 10_000));
        let ids: Vec<u64> = r.config.static_endpoints.iter().map(|e| e.id()).collect();
        for (i, &id) in ids.iter().enumerate() {
            let m = ReplicaMetrics {
                running: [0.0, 3.0, 1.0, 5.0][i],
                ..ReplicaMetrics::default()
            };
            record_scrape(&s, id, Ok(&m), &ids, 1000).unwrap();
        }
        (0..60)
            .map(|step: usize| {
                let body = if step.is_multiple_of(3) {
                    doc(step % 7, step)
                } else {
                    chat(step % 5, 1 + step / 10)
                };
                let h = hashed(&r, &body);
                let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
                r.commit(&s, &mut board, &c, &h, 1000);
                if step.is_multiple_of(2) {
                    board.finish(&s, r.endpoint(c.order[0]).unwrap().id(), c.work, 1000);
                }
                (c.order[0], c.reason)
            })
            .collect::<Vec<_>>()
    };
    for echo in [false, true] {
        let several = picks(2, echo);
        assert_eq!(picks(3, echo), several, "clients_echo {echo}");
        assert_eq!(picks(64, echo), several, "clients_echo {echo}");
        assert_ne!(picks(1, echo), several, "clients_echo {echo}");
    }
}

/// Questions on one long document, all in flight at once: the first
/// that leaves the document's holder, with `n` replicas (`None`: none of
/// `k` did).
fn first_spill(n: usize, k: usize) -> Option<usize> {
    let eps: Vec<String> = (1..=n).map(|i| format!("\"10.0.0.{i}:80\"")).collect();
    let json = format!(r#"{{"endpoints":[{}]}}"#, eps.join(","));
    let r = Router::new(Config::parse(json.as_bytes()).unwrap());
    let s = MemStore::new();
    let mut board = LoadBoard::new(1, 60_000);
    let text = "Clause 17b binds every party to the schedule. ".repeat(1400);
    let ask = |q: usize| format!(r#"{{"model":"m","prompt":"{text} Question {q}?"}}"#);
    let home = run(&r, &s, &mut board, &ask(0)).order[0];
    (1..=k).find(|&q| {
        let h = hashed(&r, &ask(q));
        let c = r.decide(&s, &h, Meta::default(), 1000).unwrap();
        r.commit(&s, &mut board, &c, &h, 1000);
        c.order[0] != home
    })
}

#[test]
fn a_hot_prefix_spills_however_few_the_replicas() {
    // The holder keeps a few (one request is no overload, and the slack),
    // then the load bound moves the rest; with two or three replicas it
    // never did.
    for n in [2, 3, 4, 8] {
        let spill = first_spill(n, 300);
        assert!(
            spill.is_some_and(|q| (4..=64).contains(&q)),
            "{n} replicas: {spill:?}"
        );
    }
}

#[test]
fn requests_without_a_prompt_spread_when_loads_tie() {
    let r = router("");
    let s = MemStore::new();
    let picked: HashSet<usize> = (0..200u64)
        .map(|t| {
            let c = r
                .decide(&s, &Hashed::default(), Meta::default(), 1000 + t)
                .unwrap();
            c.order[0]
        })
        .collect();
    assert_eq!(picked.len(), r.endpoints().len());
}

/// Every replica's scraped row, in both stores: `waiting` on endpoint `busy`.
fn scrape_both(r: &Router, stores: &[&MemStore], busy: usize, waiting: f64) {
    use crate::metrics::ReplicaMetrics;
    use crate::replicas::record_scrape;
    let ids: Vec<u64> = r.endpoints().iter().map(|e| e.id()).collect();
    for s in stores {
        for (i, &id) in ids.iter().enumerate() {
            let m = ReplicaMetrics {
                waiting: if i == busy { waiting } else { 0.0 },
                ..ReplicaMetrics::default()
            };
            record_scrape(*s, id, Ok(&m), &ids, 1000).unwrap();
        }
    }
}

#[test]
fn instances_weigh_a_new_sessions_two_replicas_alike_whatever_they_saw_of_its_preamble() {
    // Two instances, the same scraped queue on the first of conversation
    // 7's two agreed replicas. `aware` has seen the shared system prompt
    // fork, `fresh` has seen nothing: both key the conversation past the
    // system prompt (`Hashed::lead_floor`), and both must also leave the
    // first replica for the second at the same queue. The fresh one
    // counted the system prompt as new content, so its margin (what a
    // second copy would cost) was the whole prompt's, the aware one's
    // only the conversation's own part: at queues in between they put
    // the conversation on different replicas for good.
    let extra = r#","cluster":"pool","gateways":3"#;
    let aware = router(extra);
    let fresh = router(extra);
    let (s_aware, mut b_aware) = (MemStore::new(), LoadBoard::new(1, 10_000));
    let s_fresh = MemStore::new();
    scrape_both(&aware, &[&s_aware, &s_fresh], 0, 0.0);
    for other in 100..104 {
        run(&aware, &s_aware, &mut b_aware, &chat(other, 1));
    }
    let order = agreed_order(&fresh, 7);
    let mut moved = None;
    for waiting in 0..40 {
        scrape_both(&aware, &[&s_aware, &s_fresh], order[0], f64::from(waiting));
        let a = aware
            .decide(
                &s_aware,
                &hashed(&aware, &chat(7, 1)),
                Meta::default(),
                1000,
            )
            .unwrap();
        let f = fresh
            .decide(
                &s_fresh,
                &hashed(&fresh, &chat(7, 1)),
                Meta::default(),
                1000,
            )
            .unwrap();
        assert_eq!(a.order[0], f.order[0], "{waiting} waiting on the first");
        assert!(order[..2].contains(&a.order[0]));
        if a.order[0] == order[1] {
            moved.get_or_insert(waiting);
        }
    }
    // A queue deep enough moves it, on both.
    assert!(moved.is_some());
}
