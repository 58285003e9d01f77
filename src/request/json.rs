//! A JSON reader over a request body that never unescapes what it hands
//! out: strings come back as the bytes between their quotes, as the body
//! spells them, and any value can be taken whole as its raw span.
//!
//! Why not serde_json: an agent's turn is mostly tool results that are
//! JSON text inside a JSON string, an escaped quote every few bytes.
//! serde_json handles each escape on its own (about 10 ns each), so merely
//! skipping a 256 KB agent turn took 245 µs and rendering it 680 µs,
//! against a budget of 60 µs for the whole decision. Here the end of a
//! string is found with `memchr` up to its first backslash, and from there
//! 64 bytes at a time with bit masks (see [`string_end`]), whatever the
//! escape density; nothing is copied: the filter only hashes prompt text,
//! so it hashes it as spelled.
//!
//! Names that are compared or shown (keys, `model`, `role`) are decoded
//! properly ([`Str::name`]), with serde_json when they carry escapes.
//!
//! The grammar is JSON's (RFC 8259) apart from what hashing doesn't need
//! checked: escapes inside strings and control characters in them are not
//! validated (the model server rejects such a body). Skipping nests
//! without recursion; nothing here can overflow the stack.

use std::borrow::Cow;

use thiserror::Error;

/// Deepest nesting walked. Python's `json` (the model servers') fails
/// near 1,000 levels, so a deeper body can't be served anyway; the cap
/// bounds the nesting stack at 1 KiB whatever the body's size.
const MAX_DEPTH: usize = 1024;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("expected {expected} at byte {at}")]
pub struct JsonError {
    pub at: usize,
    pub expected: &'static str,
}

/// A string as the body spells it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Str<'a> {
    /// With its quotes.
    quoted: &'a [u8],
    /// Whether it holds a backslash (an escape).
    escaped: bool,
}

impl<'a> Str<'a> {
    /// The bytes between the quotes, escapes as written.
    pub(super) fn raw(&self) -> &'a [u8] {
        self.quoted
            .get(1..self.quoted.len().saturating_sub(1))
            .unwrap_or_default()
    }

    /// A key as bytes to match against field names: as spelled, unless
    /// it has escapes (then decoded; rare). A key that isn't UTF-8 just
    /// matches no field.
    pub(super) fn key(&self, at: usize) -> Result<Cow<'a, [u8]>, JsonError> {
        if self.escaped {
            return self.name(at).map(|n| match n {
                Cow::Borrowed(s) => Cow::Borrowed(s.as_bytes()),
                Cow::Owned(s) => Cow::Owned(s.into_bytes()),
            });
        }
        Ok(Cow::Borrowed(self.raw()))
    }

    /// The string's value, unescaped and checked for UTF-8: for names
    /// that are matched or shown, not for prompt text.
    pub(super) fn name(&self, at: usize) -> Result<Cow<'a, str>, JsonError> {
        let bad = JsonError {
            at,
            expected: "a valid UTF-8 string",
        };
        if self.escaped {
            // Rare (names are plain ASCII in practice): serde_json knows
            // every escape, surrogate pairs included.
            serde_json::from_slice::<String>(self.quoted)
                .map(Cow::Owned)
                .map_err(|_| bad)
        } else {
            std::str::from_utf8(self.raw())
                .map(Cow::Borrowed)
                .map_err(|_| bad)
        }
    }
}

/// A cursor over one JSON text.
pub(super) struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Reader { b, at: 0 }
    }

    /// Where the reader is, in bytes (for errors).
    pub(super) fn at(&self) -> usize {
        self.at
    }

    pub(super) fn error(&self, expected: &'static str) -> JsonError {
        JsonError {
            at: self.at,
            expected,
        }
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.b.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte that isn't whitespace, not consumed.
    pub(super) fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.at).copied()
    }

    /// Consumes `c` if it comes next.
    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.at += usize::from(hit);
        hit
    }

    /// Consumes `c`, or fails saying `what` was expected there.
    fn require(&mut self, c: u8, what: &'static str) -> Result<(), JsonError> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(self.error(what))
        }
    }

    /// Only whitespace is left.
    pub(super) fn end(&mut self) -> Result<(), JsonError> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.error("the end of the body")),
        }
    }

    /// Consumes `null` if it comes next.
    pub(super) fn null(&mut self) -> Result<bool, JsonError> {
        if self.peek() != Some(b'n') {
            return Ok(false);
        }
        self.literal()?;
        Ok(true)
    }

    pub(super) fn string(&mut self) -> Result<Str<'a>, JsonError> {
        if self.peek() != Some(b'"') {
            return Err(self.error("a string"));
        }
        let start = self.at;
        let (end, escaped) = string_end(self.b, start + 1).ok_or(JsonError {
            at: start,
            expected: "a closing quote",
        })?;
        let quoted = self.b.get(start..=end).unwrap_or_default();
        self.at = end + 1;
        Ok(Str { quoted, escaped })
    }

    /// An object's members: `f` gets each key and must read its value.
    pub(super) fn object(
        &mut self,
        mut f: impl FnMut(&mut Self, Str<'a>) -> Result<(), JsonError>,
    ) -> Result<(), JsonError> {
        self.require(b'{', "an object")?;
        if self.eat(b'}') {
            return Ok(());
        }
        loop {
            let key = self.key()?;
            f(self, key)?;
            if !self.eat(b',') {
                return self.require(b'}', "`,` or `}`");
            }
        }
    }

    /// An array's elements: `f` must read each one.
    pub(super) fn array(
        &mut self,
        mut f: impl FnMut(&mut Self) -> Result<(), JsonError>,
    ) -> Result<(), JsonError> {
        self.require(b'[', "an array")?;
        if self.eat(b']') {
            return Ok(());
        }
        loop {
            f(self)?;
            if !self.eat(b',') {
                return self.require(b']', "`,` or `]`");
            }
        }
    }

    fn key(&mut self) -> Result<Str<'a>, JsonError> {
        let k = self.string()?;
        self.require(b':', "`:`")?;
        Ok(k)
    }

    /// An integer that fits an `i64` (a token id).
    pub(super) fn int(&mut self) -> Result<i64, JsonError> {
        self.ws();
        let start = self.at;
        if !self.number()? {
            return Err(JsonError {
                at: start,
                expected: "an integer",
            });
        }
        std::str::from_utf8(self.b.get(start..self.at).unwrap_or_default())
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(JsonError {
                at: start,
                expected: "an integer that fits 64 bits",
            })
    }

    /// Any value, returned as the body spells it. Nesting is tracked on
    /// the heap, not the stack, up to [`MAX_DEPTH`] levels.
    pub(super) fn skip(&mut self) -> Result<&'a [u8], JsonError> {
        self.ws();
        let start = self.at;
        let mut open: Vec<u8> = Vec::new();
        'value: loop {
            match self.peek() {
                Some(b'{') => {
                    self.nest(&open)?;
                    self.at += 1;
                    if !self.eat(b'}') {
                        open.push(b'}');
                        self.key()?;
                        continue 'value;
                    }
                }
                Some(b'[') => {
                    self.nest(&open)?;
                    self.at += 1;
                    if !self.eat(b']') {
                        open.push(b']');
                        continue 'value;
                    }
                }
                Some(b'"') => {
                    self.string()?;
                }
                Some(b'-' | b'0'..=b'9') => {
                    self.number()?;
                }
                _ => self.literal()?,
            }
            // After a value: close what it ended, or go on to the next.
            while let Some(&close) = open.last() {
                if self.eat(b',') {
                    if close == b'}' {
                        self.key()?;
                    }
                    continue 'value;
                }
                self.require(close, "`,` or a closing bracket")?;
                open.pop();
            }
            return Ok(self.b.get(start..self.at).unwrap_or_default());
        }
    }

    /// Room for one more level inside the `open` ones.
    fn nest(&self, open: &[u8]) -> Result<(), JsonError> {
        if open.len() >= MAX_DEPTH {
            return Err(self.error("nesting at most 1024 deep"));
        }
        Ok(())
    }

    fn literal(&mut self) -> Result<(), JsonError> {
        self.ws();
        let rest = self.b.get(self.at..).unwrap_or_default();
        let len = [&b"null"[..], b"true", b"false"]
            .into_iter()
            .find(|l| rest.starts_with(l))
            .map(<[u8]>::len)
            .ok_or(self.error("a value"))?;
        self.at += len;
        Ok(())
    }

    /// A number by JSON's grammar; whether it was an integer.
    fn number(&mut self) -> Result<bool, JsonError> {
        self.ws();
        self.at += usize::from(self.b.get(self.at) == Some(&b'-'));
        match self.b.get(self.at) {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.error("a digit")),
        }
        let mut int = true;
        if self.b.get(self.at) == Some(&b'.') {
            self.at += 1;
            self.some_digits()?;
            int = false;
        }
        if let Some(b'e' | b'E') = self.b.get(self.at) {
            self.at += 1;
            if let Some(b'+' | b'-') = self.b.get(self.at) {
                self.at += 1;
            }
            self.some_digits()?;
            int = false;
        }
        Ok(int)
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.b.get(self.at) {
            self.at += 1;
        }
    }

    fn some_digits(&mut self) -> Result<(), JsonError> {
        let from = self.at;
        self.digits();
        if self.at == from {
            return Err(self.error("a digit"));
        }
        Ok(())
    }
}

/// Where the string whose content starts at `from` ends: the index of
/// its closing quote, and whether it holds a backslash; `None` if the
/// body ends first.
///
/// `memchr2` to the first quote or backslash (a string without escapes
/// ends there); from a backslash on, 64 bytes at a time: a mask of the
/// quotes and one of the backslashes (SIMD where there is some), then
/// which bytes a backslash escapes ([`escaped`]), all in a few word
/// operations; the first quote not escaped ends the string. The cost is
/// per block, not per escape.
pub(super) fn string_end(b: &[u8], from: usize) -> Option<(usize, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: SSE2 is part of the x86_64 baseline: every x86_64 CPU
        // has it. (The function is entered once per string so that the
        // block loop inlines into it.)
        unsafe { sse2::string_end(b, from) }
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        scan(b, from, simd128_lanes)
    }
    #[cfg(not(any(
        target_arch = "x86_64",
        all(target_arch = "wasm32", target_feature = "simd128")
    )))]
    {
        scan(b, from, swar_lanes)
    }
}

/// [`string_end`], with `lanes` giving the quote and backslash masks of
/// 16 bytes (bit i set when byte i is a `"`, or a `\\`).
#[inline(always)]
fn scan(b: &[u8], from: usize, lanes: impl Fn(&[u8; 16]) -> (u16, u16)) -> Option<(usize, bool)> {
    // Up to the first quote or backslash at memchr's speed: a string
    // without escapes ends there (most keys and names, and plain text).
    let first = from + memchr::memchr2(b'"', b'\\', b.get(from..)?)?;
    if b.get(first) == Some(&b'"') {
        return Some((first, false));
    }
    let masks = |block: &[u8; 64]| {
        let (mut q, mut s) = (0u64, 0u64);
        for (i, c) in block.as_chunks::<16>().0.iter().enumerate() {
            let (lq, ls) = lanes(c);
            q |= u64::from(lq) << (16 * i);
            s |= u64::from(ls) << (16 * i);
        }
        (q, s)
    };
    // From the first backslash (not escaped: nothing before it is one).
    let mut at = first;
    let mut carry = false;
    let mut any_slash = 1;
    loop {
        let rest = b.get(at..)?;
        let (quotes, slashes, n) = match rest.first_chunk::<64>() {
            Some(block) => {
                let (q, s) = masks(block);
                (q, s, 64)
            }
            None => {
                // The tail, padded with zeros (neither quote nor backslash).
                let mut block = [0u8; 64];
                block.get_mut(..rest.len())?.copy_from_slice(rest);
                let (q, s) = masks(&block);
                (q, s, rest.len())
            }
        };
        if quotes | slashes == 0 && n == 64 && !carry {
            at += 64;
            continue;
        }
        let real = quotes & !escaped(slashes, &mut carry);
        if real != 0 {
            let i = real.trailing_zeros();
            // Backslashes before the closing quote (bits below it).
            any_slash |= slashes & ((1u64 << i) - 1);
            return Some((at + i as usize, any_slash != 0));
        }
        any_slash |= slashes;
        if n < 64 {
            return None;
        }
        at += 64;
    }
}

/// The bytes of a block that a backslash escapes, from the block's
/// backslashes. `carry`, in and out: the block before ended in a run of
/// backslashes of odd length, so this block's first byte is escaped.
///
/// In a run of backslashes they pair off from its start; the byte after
/// the run is escaped when the run is odd. Adding a run's lowest bit to
/// the mask carries through the run and lands on the byte after it. Runs
/// that start on an even bit and end on an odd one are odd, and the other
/// way round, so adding even and odd starts separately tells the parity
/// by where the carry lands.
fn escaped(slashes: u64, carry: &mut bool) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    let first = u64::from(*carry);
    // A backslash escaped by the last block starts nothing.
    let s = slashes & !first;
    let starts = s & !(s << 1);
    let even_ends = s.wrapping_add(starts & EVEN) & !s;
    let (odd_sum, odd_overflow) = s.overflowing_add(starts & !EVEN);
    let odd_ends = odd_sum & !s;
    // A run reaching the block's end from an odd start has odd length (a
    // run from an even start is even there, and escapes nothing).
    *carry = odd_overflow;
    (even_ends & !EVEN) | (odd_ends & EVEN) | first
}

/// SSE2 lanes.
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
    };

    #[target_feature(enable = "sse2")]
    pub(super) fn string_end(b: &[u8], from: usize) -> Option<(usize, bool)> {
        super::scan(b, from, |c| lanes(c))
    }

    #[target_feature(enable = "sse2")]
    #[inline]
    pub(super) fn lanes(c: &[u8; 16]) -> (u16, u16) {
        // SAFETY: `c` is 16 readable bytes; loadu needs no alignment.
        let v = unsafe { _mm_loadu_si128(c.as_ptr().cast::<__m128i>()) };
        let eq = |x: u8| _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(x as i8))) as u16;
        (eq(b'"'), eq(b'\\'))
    }
}

/// The same with wasm SIMD (the filter's build enables simd128).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline]
fn simd128_lanes(c: &[u8; 16]) -> (u16, u16) {
    use std::arch::wasm32::{i8x16_bitmask, i8x16_eq, u64x2, u8x16_splat};
    let (lo, hi) = c.split_at(8);
    let word = |w: &[u8]| <[u8; 8]>::try_from(w).map_or(0, u64::from_le_bytes);
    let v = u64x2(word(lo), word(hi));
    let eq = |x: u8| i8x16_bitmask(i8x16_eq(v, u8x16_splat(x)));
    (eq(b'"'), eq(b'\\'))
}

/// The portable version, eight bytes per word: for targets without the
/// SIMD above, and the reference the SIMD versions are tested against.
#[cfg_attr(
    any(
        target_arch = "x86_64",
        all(target_arch = "wasm32", target_feature = "simd128")
    ),
    allow(dead_code)
)]
fn swar_lanes(c: &[u8; 16]) -> (u16, u16) {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    const ONES: u64 = 0x0101_0101_0101_0101;
    // The high bit of every byte of `w` that equals `c` (exact: no carry
    // crosses bytes because the high bits are masked off first).
    let equal = |w: u64, c: u8| {
        let x = w ^ (ONES * u64::from(c));
        !(((x & LOW7).wrapping_add(LOW7)) | x) & !LOW7
    };
    // Byte k's high bit → bit k: each lands in the top byte at its own
    // place, and no two partial products overlap, so nothing carries.
    let gather = |m: u64| ((m >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) as u16;
    let (mut q, mut s) = (0u16, 0u16);
    for (i, w) in c.as_chunks::<8>().0.iter().enumerate() {
        let w = u64::from_le_bytes(*w);
        q |= gather(equal(w, b'"')) << (8 * i);
        s |= gather(equal(w, b'\\')) << (8 * i);
    }
    (q, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain reading of a string's end: a backslash escapes the next
    /// byte, the first unescaped quote ends it.
    fn slow_end(b: &[u8], from: usize) -> Option<usize> {
        let mut i = from;
        while i < b.len() {
            match b[i] {
                b'\\' => i += 2,
                b'"' => return Some(i),
                _ => i += 1,
            }
        }
        None
    }

    /// xorshift: deterministic bytes for the property checks.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed | 1;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    #[test]
    fn lanes_mark_quotes_and_backslashes_on_every_target() {
        let mut next = rng(7);
        for _ in 0..5_000 {
            let mut c = [0u8; 16];
            for b in &mut c {
                *b = match next() % 5 {
                    0 => b'"',
                    1 => b'\\',
                    2 => (next() % 256) as u8,
                    _ => b'a',
                };
            }
            let want = c.iter().enumerate().fold((0u16, 0u16), |(q, s), (i, &b)| {
                (
                    q | (u16::from(b == b'"') << i),
                    s | (u16::from(b == b'\\') << i),
                )
            });
            #[cfg(target_arch = "x86_64")]
            // SAFETY: SSE2 is part of the x86_64 baseline.
            assert_eq!(unsafe { sse2::lanes(&c) }, want, "{c:?}");
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            assert_eq!(simd128_lanes(&c), want, "{c:?}");
            assert_eq!(swar_lanes(&c), want, "{c:?}");
        }
    }

    #[test]
    fn string_end_agrees_with_the_byte_by_byte_reading() {
        // Backslash runs of every length, across block boundaries, at
        // every offset, in strings up to a few blocks long: quotes are
        // rare enough (1 in `sparse` bytes) that most strings cross a
        // block boundary.
        let mut next = rng(11);
        for len in 0..300 {
            for sparse in [8, 64, 256] {
                let b: Vec<u8> = (0..len)
                    .map(|_| match next() % sparse {
                        0 => b'"',
                        r if r % 2 == 1 => b'\\',
                        r if r % 8 == 2 => b'\n',
                        _ => b'x',
                    })
                    .collect();
                for from in [0, 1, len / 2] {
                    let from = from.min(len);
                    let want = slow_end(&b, from).map(|e| (e, b[from..e].contains(&b'\\')));
                    assert_eq!(scan(&b, from, swar_lanes), want);
                    assert_eq!(
                        string_end(&b, from),
                        want,
                        "{from} in {:?}",
                        String::from_utf8_lossy(&b)
                    );
                }
            }
        }
        // A block of plain text after a block that ended in a run of
        // backslashes (blocks count from the first backslash): when the
        // run is odd, the plain block's first byte is the escaped one,
        // and the quote after the plain block still ends the string.
        for run in 1..=60 {
            let b = [
                &br"\x"[..],
                &[b'x'; 62][..62 - run],
                &vec![b'\\'; run],
                &[b'y'; 64],
                b"\"",
            ]
            .concat();
            assert_eq!(b.len(), 129);
            assert_eq!(string_end(&b, 0), Some((128, true)), "{run}");
            assert_eq!(scan(&b, 0, swar_lanes), Some((128, true)), "{run}");
        }
        // A run of backslashes that fills a block and spills into the
        // next, odd and even.
        for run in 60..70 {
            let mut b = vec![b'\\'; run];
            b.extend_from_slice(b"\"x\"");
            assert_eq!(
                string_end(&b, 0),
                slow_end(&b, 0).map(|e| (e, true)),
                "run {run}"
            );
            assert_eq!(scan(&b, 0, swar_lanes), string_end(&b, 0), "run {run}");
        }
    }

    #[test]
    fn skip_returns_values_as_spelled_and_rejects_bad_ones() {
        let skip = |s: &str| {
            let mut r = Reader::new(s.as_bytes());
            let v = r.skip()?;
            r.end()?;
            Ok::<_, JsonError>(String::from_utf8(v.to_vec()).unwrap())
        };
        for ok in [
            "0",
            "-12.5e+3",
            "true",
            "null",
            r#""a\"b""#,
            "[]",
            "{}",
            r#"{"a":[1,{"b":null}],"c":"\\"}"#,
            "[ 1 , [ 2 , [ ] ] ]",
        ] {
            assert_eq!(skip(ok).as_deref(), Ok(ok), "{ok}");
        }
        assert_eq!(skip("  [1]  ").as_deref(), Ok("[1]"));
        for bad in [
            "", "[1,]", "[1 2]", "{\"a\"}", "{\"a\":}", "{1:2}", "01", "1.", "-", "1e", "nul",
            "[1}", "\"open", "{\"a\":1", "truex",
        ] {
            assert!(skip(bad).is_err(), "{bad}");
        }
        // Deep, without recursion, to a bound.
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(skip(&deep(MAX_DEPTH)).map(|s| s.len()), Ok(2 * MAX_DEPTH));
        assert!(skip(&deep(MAX_DEPTH + 1)).is_err());
        assert!(skip(&deep(100_000)).is_err());
    }

    #[test]
    fn names_are_decoded_text_is_not() {
        let body = [&br#""r\u006fle" "a\nb" ""#[..], b"\xff\""].concat();
        let mut r = Reader::new(&body);
        let k = r.string().unwrap();
        assert_eq!(k.name(0).unwrap(), "role");
        let t = r.string().unwrap();
        assert_eq!(t.raw(), br"a\nb");
        let bad = r.string().unwrap();
        assert_eq!(bad.raw(), b"\xff");
        assert!(bad.name(0).is_err());
        assert_eq!(Reader::new(b"123").int(), Ok(123));
        assert!(Reader::new(b"1.5").int().is_err());
        assert!(Reader::new(b"9223372036854775808").int().is_err());
        assert_eq!(Reader::new(b"-9223372036854775808").int(), Ok(i64::MIN));
    }
}
