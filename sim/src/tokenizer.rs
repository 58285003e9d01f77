//! A deterministic toy tokenizer: good enough to give realistic token counts
//! (about 4 characters per token on English) and stable ids, with no model
//! files to download.
//!
//! Pieces: an optional single leading space plus up to 4 letters; up to 3
//! digits; one punctuation/symbol char; one newline; a run of other
//! whitespace; or a chat special token such as `<|im_start|>`. Each piece maps
//! to an id by a stable hash into `VOCAB_SIZE`.

use crate::hash::hash_str;

pub const VOCAB_SIZE: u32 = 50_000;
/// Ids below this are reserved for special tokens.
const FIRST_REGULAR_ID: u32 = 16;
const SPECIALS: [(&str, u32); 3] = [("<|endoftext|>", 2), ("<|im_start|>", 3), ("<|im_end|>", 4)];
const MAX_LETTERS: usize = 4;
const MAX_DIGITS: usize = 3;

/// Id of one piece of text.
pub fn piece_id(piece: &str) -> u32 {
    if let Some((_, id)) = SPECIALS.iter().find(|(s, _)| *s == piece) {
        return *id;
    }
    let span = u64::from(VOCAB_SIZE - FIRST_REGULAR_ID);
    FIRST_REGULAR_ID + (hash_str(piece) % span) as u32
}

/// Token ids of `text`.
pub fn encode(text: &str) -> Vec<u32> {
    pieces(text).into_iter().map(piece_id).collect()
}

/// Splits `text` into pieces (see module docs). Never fails; every char of
/// the input lands in exactly one piece.
pub fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::with_capacity(text.len() / 3 + 1);
    let mut rest = text;
    while !rest.is_empty() {
        let n = next_piece_len(rest);
        out.push(&rest[..n]);
        rest = &rest[n..];
    }
    out
}

/// Byte length of the piece at the start of `s` (always > 0, on a char
/// boundary).
fn next_piece_len(s: &str) -> usize {
    if let Some((sp, _)) = SPECIALS.iter().find(|(sp, _)| s.starts_with(sp)) {
        return sp.len();
    }
    let mut chars = s.char_indices().peekable();
    let Some((_, first)) = chars.next() else {
        return s.len();
    };
    // A space glues onto a following word or number, as BPE vocabularies do.
    let (start, lead) = match (first, chars.peek()) {
        (' ', Some((i, c))) if c.is_alphanumeric() => (*i, *c),
        _ => (0, first),
    };
    let body = &s[start..];
    let run = if lead.is_alphabetic() {
        run_len(body, char::is_alphabetic, MAX_LETTERS)
    } else if lead.is_numeric() {
        run_len(body, char::is_numeric, MAX_DIGITS)
    } else if lead.is_whitespace() && lead != '\n' {
        run_len(body, |c| c.is_whitespace() && c != '\n', usize::MAX)
    } else {
        lead.len_utf8()
    };
    start + run
}

/// Byte length of the leading run of chars matching `pred`, at most `max`
/// chars.
fn run_len(s: &str, pred: fn(char) -> bool, max: usize) -> usize {
    s.char_indices()
        .take_while(|(_, c)| pred(*c))
        .take(max)
        .last()
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// Text of generated token `i` of a request. Every word is a single piece so
/// completion_tokens equals the number of text chunks streamed.
pub fn output_piece(request_seed: u64, i: usize) -> &'static str {
    const WORDS: [&str; 16] = [
        " the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " with",
        " was", " on", " be", " at",
    ];
    let k = (request_seed as usize).wrapping_add(i.wrapping_mul(7)) % WORDS.len();
    WORDS[k]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_input_exactly() {
        let text = "Hello, world! 12345 tokens\n\n  <|im_start|>user\nnaïve café ✓";
        assert_eq!(pieces(text).concat(), text);
    }

    #[test]
    fn about_four_chars_per_token_on_english() {
        let text = "The quick brown fox jumps over the lazy dog while the prefix cache \
                    keeps recently used blocks resident on the accelerator, and requests \
                    that share a system prompt can skip most of their prefill work.";
        let ratio = text.len() as f64 / encode(text).len() as f64;
        assert!((3.0..5.0).contains(&ratio), "chars/token = {ratio}");
    }

    #[test]
    fn ids_are_stable_and_in_range() {
        let a = encode("same text, same ids");
        assert_eq!(a, encode("same text, same ids"));
        assert!(a
            .iter()
            .all(|&t| (FIRST_REGULAR_ID..VOCAB_SIZE).contains(&t)));
        assert_eq!(encode("<|im_start|>"), vec![3]);
    }

    #[test]
    fn output_pieces_are_single_tokens() {
        for i in 0..16 {
            assert_eq!(encode(output_piece(3, i)).len(), 1);
        }
    }

    #[test]
    fn empty_and_odd_input_do_not_panic() {
        assert!(encode("").is_empty());
        assert_eq!(pieces(" ").concat(), " ");
        assert_eq!(
            pieces("\u{0}\u{10FFFF} \t\n").concat(),
            "\u{0}\u{10FFFF} \t\n"
        );
    }
}
