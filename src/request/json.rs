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
//! validated, and an object or array the filter skips is only measured
//! (its strings close, its brackets balance; see [`container_end`]). The
//! model server rejects such a body. Nothing here recurses, so nothing
//! can overflow the stack.

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
    /// Units its caller may still keep (`keep`).
    left: u32,
}

impl<'a> Reader<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Reader {
            b,
            at: 0,
            left: u32::MAX,
        }
    }

    /// A reader whose caller keeps at most `units` (see `keep`).
    pub(super) fn with_budget(b: &'a [u8], units: u32) -> Self {
        Reader {
            left: units,
            ..Reader::new(b)
        }
    }

    /// The caller keeps one more value, worth `units`: an error once the
    /// budget is spent. The reader allocates nothing itself, but what its
    /// caller collects can be 10-20 times the JSON's bytes (`{}` is three
    /// bytes and a whole message), so a body of empty objects grew each
    /// worker's memory by hundreds of MB, for good (wasm memory never
    /// shrinks).
    pub(super) fn keep(&mut self, units: u32) -> Result<(), JsonError> {
        self.left = self
            .left
            .checked_sub(units)
            .ok_or_else(|| self.error("fewer array items (see request::body::KEPT_UNITS)"))?;
        Ok(())
    }

    /// Where the reader is, in bytes (for errors).
    pub(super) fn at(&self) -> usize {
        self.at
    }

    /// The bytes read since `start` (an earlier `at()`), as spelled.
    pub(super) fn since(&self, start: usize) -> &'a [u8] {
        self.b.get(start..self.at).unwrap_or_default()
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

    /// An integer that fits an `i64` (a token id). A whole number written
    /// with a zero fraction (`1.0`: Python's `json` writes a float list
    /// so) is that integer, as the model server's validation takes it.
    pub(super) fn int(&mut self) -> Result<i64, JsonError> {
        self.ws();
        let start = self.at;
        let int = self.number()?;
        let spelled = self.b.get(start..self.at).unwrap_or_default();
        let whole = match spelled.iter().position(|&c| c == b'.') {
            Some(dot) => match spelled.split_at_checked(dot) {
                Some((int, frac)) if frac.iter().skip(1).all(|&c| c == b'0') => int,
                _ => spelled,
            },
            None => spelled,
        };
        if !int && whole.len() == spelled.len() {
            // Exponent form (`1e3`, `1.0e3`): the server reads a float and
            // takes it as an int when it has no fraction (pydantic's lax
            // int, as `body::stores` reads `1e0`).
            const I64_END: f64 = 9_223_372_036_854_775_808.0; // 2^63
            return std::str::from_utf8(spelled)
                .ok()
                .and_then(|s| s.parse::<f64>().ok())
                .filter(|v| v.fract() == 0.0 && (-I64_END..I64_END).contains(v))
                .map(|v| v as i64)
                .ok_or(JsonError {
                    at: start,
                    expected: "an integer",
                });
        }
        std::str::from_utf8(whole)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(JsonError {
                at: start,
                expected: "an integer that fits 64 bits",
            })
    }

    /// Any value, returned as the body spells it. An object or array is
    /// only checked for its extent (see [`container_end`]).
    pub(super) fn skip(&mut self) -> Result<&'a [u8], JsonError> {
        self.ws();
        let start = self.at;
        match self.b.get(start) {
            Some(b'{' | b'[') => self.at = container_end(self.b, start)?,
            Some(b'"') => {
                self.string()?;
            }
            Some(b'-' | b'0'..=b'9') => {
                self.number()?;
            }
            _ => self.literal()?,
        }
        Ok(self.b.get(start..self.at).unwrap_or_default())
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

/// A class of bytes a block mask marks: the bytes `c` with `c | or == x`.
/// `or = 0x20` folds `[` onto `{` and `]` onto `}`: they differ only in
/// that bit, and no other byte lands on either.
#[derive(Debug, Clone, Copy)]
struct Class {
    x: u8,
    or: u8,
}

const QUOTE: Class = Class { x: b'"', or: 0 };
const SLASH: Class = Class { x: b'\\', or: 0 };
const OPEN: Class = Class { x: b'{', or: 0x20 };
const CLOSE: Class = Class { x: b'}', or: 0x20 };

/// Where the string whose content starts at `from` ends: the index of
/// its closing quote, and whether it holds a backslash; `None` if the
/// body ends first.
///
/// A short string (a key, a name) ends within its first 16 bytes: one
/// SIMD compare, no call. Past that, `memchr2` to the first quote or
/// backslash (a string without escapes ends there); from a backslash on,
/// 64 bytes at a time: a mask of the quotes and one of the backslashes,
/// then which bytes a backslash escapes ([`escaped`]), all in a few word
/// operations; the first quote not escaped ends the string. The cost is
/// per block, not per escape.
pub(super) fn string_end(b: &[u8], from: usize) -> Option<(usize, bool)> {
    scan(b, from, lane)
}

/// Where the object or array that opens at `from` ends: the index just
/// past its closing bracket.
///
/// For values the filter skips (tool definitions, tool calls, fields it
/// doesn't read), which only need their extent: 64 bytes at a time, the
/// masks of quotes, backslashes and brackets; which bytes lie inside
/// strings (the prefix XOR of the quotes no backslash escapes); then the
/// depth, counted over the brackets outside them: a block at a time where
/// it can't reach zero, else bracket by bracket. Strings must close and
/// brackets must balance, at most [`MAX_DEPTH`] deep; which kind closes
/// which and the tokens between them are not checked (the model server
/// parses the body; for a valid body the extent is the same). Tool
/// definitions are a token every ten bytes or so, so this is several
/// times cheaper than walking them token by token.
pub(super) fn container_end(b: &[u8], from: usize) -> Result<usize, JsonError> {
    structure(b, from, lane)
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
use simd128_lane as lane;
/// The target's 16-byte class mask: SSE2 natively (part of the x86_64
/// baseline), wasm SIMD in the filter's build, eight bytes per word
/// elsewhere.
#[cfg(target_arch = "x86_64")]
use sse2_lane as lane;
#[cfg(not(any(
    target_arch = "x86_64",
    all(target_arch = "wasm32", target_feature = "simd128")
)))]
use swar_lane as lane;

/// The masks of `classes` over the 64 bytes at the start of `rest`
/// (zero-padded past its end: zero is in no class), and how many bytes
/// were real. `lane` gives one class's mask of 16 bytes (bit i set when
/// byte i is in it).
#[inline(always)]
fn block_masks<const K: usize>(
    rest: &[u8],
    classes: [Class; K],
    lane: impl Fn(&[u8; 16], Class) -> u16,
) -> ([u64; K], usize) {
    let masks = |block: &[u8; 64]| {
        let mut out = [0u64; K];
        for (i, c) in block.as_chunks::<16>().0.iter().enumerate() {
            for (m, &class) in out.iter_mut().zip(&classes) {
                *m |= u64::from(lane(c, class)) << (16 * i);
            }
        }
        out
    };
    match rest.first_chunk::<64>() {
        Some(block) => (masks(block), 64),
        None => {
            let mut block = [0u8; 64];
            if let Some(head) = block.get_mut(..rest.len()) {
                head.copy_from_slice(rest);
            }
            (masks(&block), rest.len())
        }
    }
}

/// [`string_end`], with `lane` the target's 16-byte class mask.
#[inline(always)]
fn scan(
    b: &[u8],
    from: usize,
    lane: impl Fn(&[u8; 16], Class) -> u16 + Copy,
) -> Option<(usize, bool)> {
    let rest = b.get(from..)?;
    let first = match rest.first_chunk::<16>() {
        Some(head) => {
            let quotes = lane(head, QUOTE);
            let either = quotes | lane(head, SLASH);
            if either == 0 {
                // Up to the first quote or backslash at memchr's speed: a
                // string without escapes ends there (plain text).
                from + 16 + memchr::memchr2(b'"', b'\\', rest.get(16..)?)?
            } else {
                let i = either.trailing_zeros();
                if quotes >> i & 1 == 1 {
                    return Some((from + i as usize, false));
                }
                from + i as usize
            }
        }
        None => from + memchr::memchr2(b'"', b'\\', rest)?,
    };
    if b.get(first) == Some(&b'"') {
        return Some((first, false));
    }
    // From the first backslash (not escaped: nothing before it is one),
    // so the string holds one.
    let mut at = first;
    let mut carry = false;
    loop {
        let ([quotes, slashes], n) = block_masks(b.get(at..)?, [QUOTE, SLASH], lane);
        if quotes | slashes == 0 && n == 64 && !carry {
            at += 64;
            continue;
        }
        let real = quotes & !escaped(slashes, &mut carry);
        if real != 0 {
            return Some((at + real.trailing_zeros() as usize, true));
        }
        if n < 64 {
            return None;
        }
        at += 64;
    }
}

/// [`container_end`], with `lane` the target's 16-byte class mask.
#[inline(always)]
fn structure(
    b: &[u8],
    from: usize,
    lane: impl Fn(&[u8; 16], Class) -> u16 + Copy,
) -> Result<usize, JsonError> {
    let error = |at: usize, expected: &'static str| JsonError { at, expected };
    let mut depth = 0u32;
    let mut at = from;
    let mut carry = false;
    // All ones when the block starts inside a string.
    let mut inside = 0u64;
    loop {
        let rest = b.get(at..).unwrap_or_default();
        if rest.is_empty() {
            return Err(error(b.len(), "a closing bracket"));
        }
        let ([quotes, slashes, opens, closes], n) =
            block_masks(rest, [QUOTE, SLASH, OPEN, CLOSE], lane);
        let escapes = escaped(slashes, &mut carry);
        let real = quotes & !escapes;
        // From each opening quote up to (not with) its closing one.
        let strings = prefix_xor(real) ^ inside;
        inside = 0u64.wrapping_sub(strings >> 63);
        // (A backslash outside a string is invalid JSON; it escapes the
        // next byte there too, so one rule covers every byte.)
        let outside = !strings & !escapes;
        let (opens, closes) = (opens & outside, closes & outside);
        // Most blocks can neither close the value nor nest too deep
        // whatever their order: count them whole.
        if closes.count_ones() < depth && depth + opens.count_ones() <= MAX_DEPTH as u32 {
            depth = depth + opens.count_ones() - closes.count_ones();
        } else {
            let mut brackets = opens | closes;
            while brackets != 0 {
                let i = brackets.trailing_zeros();
                brackets &= brackets - 1;
                if opens >> i & 1 == 1 {
                    if depth == MAX_DEPTH as u32 {
                        return Err(error(at + i as usize, "nesting at most 1024 deep"));
                    }
                    depth += 1;
                    continue;
                }
                // `from` opens the first level, and the scan returns when
                // it closes: a close always has a level to close.
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Ok(at + i as usize + 1);
                }
            }
        }
        if n < 64 {
            return Err(error(b.len(), "a closing bracket"));
        }
        at += 64;
    }
}

/// Bit i of the result is the XOR of bits 0..=i of `x`: with `x` the
/// quotes that delimit strings, the bytes inside a string (its opening
/// quote included, its closing one not).
fn prefix_xor(mut x: u64) -> u64 {
    for shift in [1, 2, 4, 8, 16, 32] {
        x ^= x << shift;
    }
    x
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
    // Most blocks (tool results: `\"` and `\n`) have no run longer than
    // one: each backslash escapes the byte after it.
    if slashes & ((slashes << 1) | first) == 0 {
        *carry = slashes >> 63 == 1;
        return (slashes << 1) | first;
    }
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
#[inline]
fn sse2_lane(c: &[u8; 16], class: Class) -> u16 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY: SSE2 is part of the x86_64 baseline (every x86_64 CPU has
    // it); `c` is 16 readable bytes, and loadu needs no alignment.
    unsafe {
        let mut v = _mm_loadu_si128(c.as_ptr().cast::<__m128i>());
        if class.or != 0 {
            v = _mm_or_si128(v, _mm_set1_epi8(class.or as i8));
        }
        _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(class.x as i8))) as u16
    }
}

/// The same with wasm SIMD (the filter's build enables simd128).
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline]
fn simd128_lane(c: &[u8; 16], class: Class) -> u16 {
    use std::arch::wasm32::{i8x16_bitmask, i8x16_eq, u64x2, u8x16_splat, v128_or};
    let (lo, hi) = c.split_at(8);
    let word = |w: &[u8]| <[u8; 8]>::try_from(w).map_or(0, u64::from_le_bytes);
    let mut v = u64x2(word(lo), word(hi));
    if class.or != 0 {
        v = v128_or(v, u8x16_splat(class.or));
    }
    i8x16_bitmask(i8x16_eq(v, u8x16_splat(class.x)))
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
fn swar_lane(c: &[u8; 16], class: Class) -> u16 {
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
    let mut out = 0u16;
    for (i, w) in c.as_chunks::<8>().0.iter().enumerate() {
        let w = u64::from_le_bytes(*w) | (ONES * u64::from(class.or));
        out |= gather(equal(w, class.x)) << (8 * i);
    }
    out
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
    fn escaped_agrees_with_reading_bit_by_bit() {
        // Masks as sparse as a tool result's (each backslash alone: the
        // shortcut) and as dense as a run-heavy one (the general case),
        // with and without a run carried in, backslashes on bits 0 and 63.
        // What callers use: which other bytes are escaped (a quote, a
        // bracket), and the carry; backslashes inside a run may be marked
        // or not.
        let slow = |slashes: u64, carry: bool| {
            let (mut out, mut next) = (0u64, carry);
            for i in 0..64 {
                let escaped_here = next;
                out |= u64::from(escaped_here) << i;
                next = !escaped_here && slashes >> i & 1 == 1;
            }
            (out & !slashes, next)
        };
        let mut next = rng(5);
        for density in [1u32, 2, 3, 4, 6] {
            for _ in 0..4000 {
                // Each bit set with probability 1 / 2^density.
                let mut slashes = u64::MAX;
                for _ in 0..density {
                    slashes &= next();
                }
                for (mask, carry_in) in [
                    (slashes, false),
                    (slashes, true),
                    (slashes | 1 | 1 << 63, true),
                ] {
                    let mut carry = carry_in;
                    let got = escaped(mask, &mut carry) & !mask;
                    assert_eq!((got, carry), slow(mask, carry_in), "{mask:064b} {carry_in}");
                }
            }
        }
    }

    #[test]
    fn lanes_mark_each_class_on_every_target() {
        let mut next = rng(7);
        for _ in 0..5_000 {
            let mut c = [0u8; 16];
            for b in &mut c {
                *b = match next() % 5 {
                    0 => b"\"\\{}[]"[(next() % 6) as usize],
                    1 => (next() % 256) as u8,
                    _ => b'a',
                };
            }
            for (class, members) in [
                (QUOTE, &b"\""[..]),
                (SLASH, b"\\"),
                (OPEN, b"{["),
                (CLOSE, b"}]"),
            ] {
                let want = c
                    .iter()
                    .enumerate()
                    .fold(0u16, |m, (i, b)| m | (u16::from(members.contains(b)) << i));
                #[cfg(target_arch = "x86_64")]
                assert_eq!(sse2_lane(&c, class), want, "{c:?} {class:?}");
                #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                assert_eq!(simd128_lane(&c, class), want, "{c:?} {class:?}");
                assert_eq!(swar_lane(&c, class), want, "{c:?} {class:?}");
            }
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
                    assert_eq!(scan(&b, from, swar_lane), want);
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
            assert_eq!(scan(&b, 0, swar_lane), Some((128, true)), "{run}");
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
            assert_eq!(scan(&b, 0, swar_lane), string_end(&b, 0), "run {run}");
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
            "", "01", "1.", "-", "1e", "nul", "[[]", "]", "\"open", "{\"a\":1", "[\"]\"", "truex",
            "[] 1", "[]]",
        ] {
            assert!(skip(bad).is_err(), "{bad}");
        }
        // Inside an object or array only strings and brackets are read:
        // the model server rejects these, the filter only needs their end.
        for loose in [
            "[1,]", "[1 2]", "{\"a\"}", "{\"a\":}", "{1:2}", "[x]", "[1}", "{]",
        ] {
            assert_eq!(skip(loose).as_deref(), Ok(loose), "{loose}");
        }
        // Deep, without recursion, to a bound.
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(skip(&deep(MAX_DEPTH)).map(|s| s.len()), Ok(2 * MAX_DEPTH));
        assert!(skip(&deep(MAX_DEPTH + 1)).is_err());
        assert!(skip(&deep(100_000)).is_err());
    }

    /// The plain reading of a container's end: a backslash escapes the
    /// next byte (inside a string or not), a string runs to its first
    /// unescaped quote, and brackets outside strings nest.
    fn slow_container_end(b: &[u8], from: usize) -> Option<usize> {
        let mut open = 0;
        let mut i = from;
        while i < b.len() {
            match b[i] {
                b'\\' => i += 1,
                b'"' => i = slow_end(b, i + 1)?,
                b'{' | b'[' => {
                    if open == MAX_DEPTH {
                        return None;
                    }
                    open += 1;
                }
                b'}' | b']' => {
                    open -= 1;
                    if open == 0 {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
            i += 1;
        }
        None
    }

    #[test]
    fn container_end_agrees_with_the_byte_by_byte_reading() {
        // Random structure: brackets of both kinds, quotes and backslash
        // runs, across block boundaries, most of it unbalanced or cut.
        let mut next = rng(13);
        for len in 1..400 {
            for _ in 0..6 {
                let mut b: Vec<u8> = (0..len)
                    .map(|_| b"{}[]\"\\\\x,:"[(next() % 10) as usize])
                    .collect();
                b[0] = if next().is_multiple_of(2) { b'{' } else { b'[' };
                let want = slow_container_end(&b, 0);
                assert_eq!(
                    container_end(&b, 0).ok(),
                    want,
                    "{:?}",
                    String::from_utf8_lossy(&b)
                );
                assert_eq!(structure(&b, 0, swar_lane).ok(), want);
            }
        }
        // Balanced ones, so that most end somewhere inside.
        for _ in 0..3_000 {
            let mut b = Vec::new();
            let mut open = Vec::new();
            loop {
                match next() % 9 {
                    0 | 1 if open.len() < 40 => {
                        let c = if next().is_multiple_of(2) { b'{' } else { b'[' };
                        open.push(c);
                        b.push(c);
                    }
                    2 | 3 => match open.pop() {
                        Some(c) => b.push(if c == b'{' { b'}' } else { b']' }),
                        None => break,
                    },
                    4 => b.extend_from_slice(br#""a\"b\\""#),
                    5 => b.extend_from_slice(br#""[{\"}]""#),
                    _ => b.extend_from_slice(b"1,"),
                }
                if open.is_empty() && !b.is_empty() {
                    break;
                }
            }
            b.extend_from_slice(b" [1]");
            let want = slow_container_end(&b, 0);
            assert!(want.is_some());
            assert_eq!(
                container_end(&b, 0).ok(),
                want,
                "{:?}",
                String::from_utf8_lossy(&b)
            );
        }
    }

    #[test]
    fn container_end_of_valid_json_is_where_a_parser_ends() {
        // Random JSON values (serde_json writes them, escapes and all);
        // the skipped extent must be the whole value.
        let mut next = rng(17);
        fn value(next: &mut impl FnMut() -> u64, depth: u32) -> serde_json::Value {
            use serde_json::Value;
            let text = |next: &mut dyn FnMut() -> u64| -> String {
                (0..next() % 90)
                    .map(|_| ['a', '"', '\\', '\n', '{', ']', 'é', '\u{1}'][(next() % 8) as usize])
                    .collect()
            };
            match (next() % 6, depth) {
                (0, d) if d < 6 => {
                    Value::Array((0..next() % 5).map(|_| value(next, d + 1)).collect())
                }
                (1 | 2, d) if d < 6 => Value::Object(
                    (0..next() % 5)
                        .map(|_| (text(next), value(next, d + 1)))
                        .collect(),
                ),
                (3, _) => Value::from(next() % 1000),
                (4, _) => Value::Null,
                _ => Value::String(text(next)),
            }
        }
        for _ in 0..2_000 {
            let v = serde_json::Value::Array(vec![value(&mut next, 0)]);
            let s = if next().is_multiple_of(2) {
                serde_json::to_string(&v).unwrap()
            } else {
                serde_json::to_string_pretty(&v).unwrap()
            };
            let b = format!("{s},\"tail\"]");
            assert_eq!(container_end(b.as_bytes(), 0), Ok(s.len()), "{s}");
            let mut r = Reader::new(s.as_bytes());
            assert_eq!(r.skip().map(<[u8]>::len), Ok(s.len()));
        }
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
