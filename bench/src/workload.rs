//! Workloads: what to send, built deterministically from a seed.

use std::path::Path;

use serde_json::{json, Value};

use crate::text::{self, Rng};

/// One request of a pre-planned workload (everything but multi-turn).
#[derive(Clone, Debug)]
pub struct Planned {
    /// Arrival offset in workload seconds (open loop / replay); unused in
    /// closed loop.
    pub at: f64,
    pub path: &'static str,
    pub body: Value,
    /// Group / session key: sent as the session header, kept in records.
    pub key: String,
}

/// A conversation of the multi-turn workload: the history grows with the
/// server's answers, so only the user turns are planned.
#[derive(Clone, Debug)]
pub struct Conversation {
    pub key: String,
    pub system: String,
    pub user_turns: Vec<String>,
    /// Think time before each turn after the first (workload seconds).
    pub think: Vec<f64>,
    /// Delay before the first turn (spreads conversation starts).
    pub start: f64,
}

pub enum Plan {
    Requests(Vec<Planned>),
    Conversations(Vec<Conversation>),
}

pub fn completion(model: &str, prompt: String, max_tokens: usize) -> Value {
    json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    })
}

pub fn chat(model: &str, messages: Vec<Value>, max_tokens: usize) -> Value {
    json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    })
}

/// Arrival times: Poisson at `rate` per second (0 = all at once).
fn arrivals(rng: &mut Rng, n: usize, rate: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            if rate > 0.0 {
                t += rng.exp(1.0 / rate);
            }
            t
        })
        .collect()
}

pub struct SharedPrefix {
    pub groups: usize,
    pub prompts: usize,
    pub prefix_tokens: usize,
    pub question_tokens: usize,
    pub max_tokens: usize,
}

/// G long shared prefixes (a RAG document or system prompt each), every
/// request = its group's prefix + a short unique question; groups
/// interleaved at random.
pub fn shared_prefix(p: &SharedPrefix, model: &str, seed: u64, rate: f64) -> Plan {
    let groups = p.groups.max(1);
    let prefixes: Vec<String> = (0..groups)
        .map(|g| {
            let mut rng = Rng::derive(seed, "prefix", g as u64);
            format!(
                "You are answering questions about document {g}. Use only the document.\n\n{}\n\n",
                text::text(&mut rng, p.prefix_tokens)
            )
        })
        .collect();
    // Exactly prompts/groups per group (+1 for the first remainder groups),
    // then shuffled: groups interleave at random.
    let mut order: Vec<(usize, usize)> = (0..p.prompts).map(|i| (i % groups, i)).collect();
    let mut rng = Rng::derive(seed, "order", 0);
    rng.shuffle(&mut order);
    let times = arrivals(&mut Rng::derive(seed, "arrivals", 0), order.len(), rate);
    let reqs = order
        .into_iter()
        .zip(times)
        .map(|((g, i), at)| {
            let mut qrng = Rng::derive(seed, "question", i as u64);
            let q = text::text(&mut qrng, p.question_tokens);
            let prompt = format!("{}Question {i}: {q}\nAnswer:", prefixes[g]);
            Planned {
                at,
                path: "/v1/completions",
                body: completion(model, prompt, p.max_tokens),
                key: format!("group-{g}"),
            }
        })
        .collect();
    Plan::Requests(reqs)
}

pub struct Unique {
    pub prompts: usize,
    pub prompt_tokens: usize,
    pub max_tokens: usize,
}

/// Short independent prompts with nothing in common: the control.
pub fn unique(p: &Unique, model: &str, seed: u64, rate: f64) -> Plan {
    let times = arrivals(&mut Rng::derive(seed, "arrivals", 1), p.prompts, rate);
    let reqs = times
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let mut rng = Rng::derive(seed, "unique", i as u64);
            // A unique lead so no two prompts share even their first block.
            let prompt = format!(
                "Request {i} {seed}: {}",
                text::text(&mut rng, p.prompt_tokens)
            );
            Planned {
                at,
                path: "/v1/completions",
                body: completion(model, prompt, p.max_tokens),
                key: format!("req-{i}"),
            }
        })
        .collect();
    Plan::Requests(reqs)
}

pub struct MultiTurn {
    pub conversations: usize,
    pub turns: usize,
    pub system_tokens: usize,
    pub first_turn_tokens: usize,
    pub user_tokens: usize,
    pub think_s: f64,
}

/// C conversations x T turns; each turn resends the whole history (system
/// prompt shared by all conversations, previous user and assistant turns)
/// plus a new user message.
pub fn multi_turn(p: &MultiTurn, seed: u64) -> Plan {
    let system = format!(
        "You are a helpful assistant for a support team. {}",
        text::text(&mut Rng::derive(seed, "system", 0), p.system_tokens)
    );
    let convs = (0..p.conversations)
        .map(|c| {
            let mut rng = Rng::derive(seed, "conversation", c as u64);
            let user_turns = (0..p.turns)
                .map(|t| {
                    let n = if t == 0 {
                        p.first_turn_tokens
                    } else {
                        p.user_tokens
                    };
                    format!("[conversation {c}, turn {t}] {}", text::text(&mut rng, n))
                })
                .collect();
            let think = (0..p.turns).map(|_| rng.exp(p.think_s)).collect();
            let start = rng.f64() * p.think_s;
            Conversation {
                key: format!("conv-{c}"),
                system: system.clone(),
                user_turns,
                think,
                start,
            }
        })
        .collect();
    Plan::Conversations(convs)
}

/// A JSONL trace, one request a line:
/// `{"timestamp": 12.5, "prompt": "..."}` or `{"timestamp": ..., "messages": [...]}`
/// or `{"timestamp": ..., "body": {<full OpenAI body>}}`, with optional
/// `max_tokens`, `session_id`, `path`. Timestamps are seconds (any origin;
/// the first line's is subtracted; lines are sorted by time). Streaming is
/// always switched on.
pub fn replay(
    file: &Path,
    model: &str,
    default_max_tokens: usize,
    speedup: f64,
) -> Result<Plan, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read trace {}: {e}", file.display()))?;
    let mut reqs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: not JSON: {e}", file.display(), n + 1))?;
        let at = v
            .get("timestamp")
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("{}:{}: missing numeric timestamp", file.display(), n + 1))?;
        let max_tokens = v
            .get("max_tokens")
            .and_then(Value::as_u64)
            .map_or(default_max_tokens, |m| m as usize);
        let mut body = if let Some(b) = v.get("body") {
            b.clone()
        } else if let Some(m) = v.get("messages") {
            chat(model, m.as_array().cloned().unwrap_or_default(), max_tokens)
        } else if let Some(p) = v.get("prompt").and_then(Value::as_str) {
            completion(model, p.to_string(), max_tokens)
        } else {
            return Err(format!(
                "{}:{}: needs one of body, messages, prompt",
                file.display(),
                n + 1
            ));
        };
        if let Some(obj) = body.as_object_mut() {
            obj.insert("stream".into(), json!(true));
            obj.insert("stream_options".into(), json!({"include_usage": true}));
            obj.entry("model").or_insert(json!(model));
        }
        let path = match v.get("path").and_then(Value::as_str) {
            Some("/v1/chat/completions") => "/v1/chat/completions",
            Some("/v1/completions") => "/v1/completions",
            Some(other) => {
                return Err(format!(
                    "{}:{}: unsupported path {other}",
                    file.display(),
                    n + 1
                ))
            }
            None if body.get("messages").is_some() => "/v1/chat/completions",
            None => "/v1/completions",
        };
        let key = v
            .get("session_id")
            .map(|s| s.as_str().map_or_else(|| s.to_string(), str::to_string))
            .unwrap_or_else(|| format!("line-{}", n + 1));
        reqs.push(Planned {
            at,
            path,
            body,
            key,
        });
    }
    reqs.sort_by(|a, b| a.at.total_cmp(&b.at));
    let t0 = reqs.first().map_or(0.0, |r| r.at);
    for r in &mut reqs {
        r.at = (r.at - t0) / speedup.max(1e-9);
    }
    Ok(Plan::Requests(reqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_is_deterministic_and_grouped() {
        let p = SharedPrefix {
            groups: 3,
            prompts: 12,
            prefix_tokens: 200,
            question_tokens: 10,
            max_tokens: 4,
        };
        let (Plan::Requests(a), Plan::Requests(b)) = (
            shared_prefix(&p, "m", 1, 5.0),
            shared_prefix(&p, "m", 1, 5.0),
        ) else {
            panic!("requests expected");
        };
        assert_eq!(a.len(), 12);
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.body, y.body);
            assert_eq!(x.at, y.at);
        }
        let same: Vec<_> = a.iter().filter(|r| r.key == "group-0").collect();
        assert_eq!(same.len(), 4);
        let p0 = same[0].body["prompt"].as_str().unwrap();
        let p1 = same[1].body["prompt"].as_str().unwrap();
        let common = p0
            .bytes()
            .zip(p1.bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(common > 600, "shared prefix of {common} bytes");
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
    }

    #[test]
    fn replay_parses_and_rebases() {
        let dir = std::env::temp_dir().join(format!("prefix-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.jsonl");
        std::fs::write(
            &f,
            "{\"timestamp\": 12, \"prompt\": \"hi\"}\n\n{\"timestamp\": 10, \"messages\": [{\"role\":\"user\",\"content\":\"x\"}], \"session_id\": 3}\n",
        )
        .unwrap();
        let Plan::Requests(r) = replay(&f, "m", 8, 2.0).unwrap() else {
            panic!()
        };
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].path, "/v1/chat/completions");
        assert_eq!(r[0].key, "3");
        assert_eq!(r[1].at, 1.0);
        assert_eq!(r[1].body["stream"], true);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
