//! Deterministic English-like text with realistic token counts.
//!
//! Words come from a list of common English words; sentences get a capital
//! letter and a period. Token counts follow the common shape of BPE
//! vocabularies on English (and the simulator's tokenizer): a leading space
//! glues onto a word, long words split into pieces of up to 4 letters,
//! punctuation is its own token, so about 4 characters make a token.

/// SplitMix64: tiny, fast, and stable across versions and platforms, so a
/// `--seed` gives the same workload everywhere.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// An independent stream derived from a seed and a label (e.g. a group
    /// id), so group g's text doesn't depend on how many groups exist.
    pub fn derive(seed: u64, label: &str, n: u64) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in label.bytes().chain(n.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let mut r = Rng::new(seed ^ h);
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// Exponential with the given mean (Poisson inter-arrival gaps).
    pub fn exp(&mut self, mean: f64) -> f64 {
        if mean <= 0.0 {
            return 0.0;
        }
        -mean * (1.0 - self.f64()).ln()
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// Zipf's law over ranks `0..n`: P(rank k) proportional to 1 / (k + 1)^s
/// (s = 0 is uniform; about 1 is typical of document popularity).
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let cdf = (0..n.max(1))
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s.max(0.0));
                acc
            })
            .collect();
        Zipf { cdf }
    }

    /// Probability of rank `k`.
    pub fn p(&self, k: usize) -> f64 {
        let total = self.cdf[self.cdf.len() - 1];
        let prev = if k == 0 { 0.0 } else { self.cdf[k - 1] };
        (self.cdf.get(k).copied().unwrap_or(prev) - prev) / total
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.f64() * self.cdf[self.cdf.len() - 1];
        self.cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1)
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "at",
    "by",
    "this",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "we",
    "when",
    "there",
    "can",
    "more",
    "if",
    "no",
    "out",
    "so",
    "said",
    "what",
    "up",
    "its",
    "about",
    "into",
    "than",
    "them",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "first",
    "any",
    "like",
    "now",
    "such",
    "our",
    "over",
    "also",
    "after",
    "made",
    "many",
    "before",
    "must",
    "through",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "here",
    "get",
    "both",
    "between",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "system",
    "data",
    "request",
    "service",
    "policy",
    "customer",
    "account",
    "report",
    "section",
    "model",
    "network",
    "process",
    "support",
    "product",
    "document",
    "value",
    "result",
    "number",
    "general",
    "information",
    "development",
    "government",
    "important",
    "different",
    "following",
    "available",
    "management",
    "performance",
    "agreement",
    "security",
    "business",
    "provide",
    "include",
    "require",
    "described",
    "payment",
    "contract",
    "period",
    "notice",
    "access",
    "storage",
    "cluster",
    "latency",
    "memory",
    "cache",
];

/// Tokens of one ASCII word with a leading space (or at text start).
fn word_tokens(w: &str) -> usize {
    w.len().div_ceil(4)
}

/// Appends sentences to `out` until about `tokens` tokens were added;
/// returns the tokens added (by the counting rule above).
pub fn append_text(out: &mut String, rng: &mut Rng, tokens: usize) -> usize {
    let mut n = 0;
    let mut sentence_left = 0;
    while n < tokens {
        let mut w = WORDS[rng.below(WORDS.len())].to_string();
        if sentence_left == 0 {
            sentence_left = 6 + rng.below(14);
            if let Some(c) = w.get_mut(0..1) {
                c.make_ascii_uppercase();
            }
        }
        if !out.is_empty() && !out.ends_with('\n') {
            out.push(' ');
        }
        out.push_str(&w);
        n += word_tokens(&w);
        sentence_left -= 1;
        if sentence_left == 0 || n >= tokens {
            out.push('.');
            n += 1;
        } else if rng.below(12) == 0 {
            out.push(',');
            n += 1;
        }
    }
    n
}

/// A fresh text of about `tokens` tokens.
pub fn text(rng: &mut Rng, tokens: usize) -> String {
    let mut s = String::with_capacity(tokens * 5);
    append_text(&mut s, rng, tokens);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_sized() {
        let a = text(&mut Rng::derive(7, "g", 3), 500);
        let b = text(&mut Rng::derive(7, "g", 3), 500);
        assert_eq!(a, b);
        let c = text(&mut Rng::derive(7, "g", 4), 500);
        assert_ne!(a, c);
        let chars_per_token = a.len() as f64 / 500.0;
        assert!((3.0..6.0).contains(&chars_per_token), "{chars_per_token}");
    }

    #[test]
    fn zipf_is_skewed_and_normalised() {
        let z = Zipf::new(50, 1.0);
        let total: f64 = (0..50).map(|k| z.p(k)).sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(z.p(0) > 4.0 * z.p(9));
        let mut r = Rng::new(3);
        let mut counts = [0usize; 50];
        for _ in 0..20_000 {
            counts[z.sample(&mut r)] += 1;
        }
        let f0 = counts[0] as f64 / 20_000.0;
        assert!((f0 - z.p(0)).abs() < 0.02, "{f0} vs {}", z.p(0));
        assert!(counts.iter().all(|&c| c > 0));
        // s = 0: uniform.
        let u = Zipf::new(4, 0.0);
        assert!((u.p(3) - 0.25).abs() < 1e-12);
    }

    #[test]
    fn exp_mean_is_close() {
        let mut r = Rng::new(1);
        let n = 20_000;
        let mean: f64 = (0..n).map(|_| r.exp(2.0)).sum::<f64>() / n as f64;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
    }
}
