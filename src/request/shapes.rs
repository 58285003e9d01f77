//! Deserializers for the fields that take one of several JSON shapes (a
//! string or an array). serde's `untagged` enums buffer the whole value
//! first and copy every string out of the buffer again, so a 1 MiB prompt
//! with escapes was copied three times; these visitors look at the JSON
//! type once and borrow a string straight from the body when it has no
//! escapes (one copy, serde_json's unescape, when it has).
//!
//! Prompt text is read as bytes (`deserialize_bytes`), not `str`: the
//! filter only hashes it, and serde_json's byte-string path finds the
//! closing quote with `memchr` and skips UTF-8 validation. Those two were
//! two thirds of a 256 KiB prompt's decision (the string scan 54%, UTF-8
//! 12%); a prompt that isn't UTF-8 is the model server's to reject.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::{Content, InputField, InputItem, Part, PromptField};

/// Prompt text as the body spells it, unescaped, not checked for UTF-8.
#[derive(Debug, Clone)]
pub(super) struct Text<'a>(pub(super) Cow<'a, [u8]>);

impl Text<'_> {
    /// The same bytes, borrowed (no copy of an owned, unescaped string).
    pub(super) fn borrowed(&self) -> Text<'_> {
        Text(Cow::Borrowed(&self.0))
    }
}

/// A visitor's string and byte-string methods, building `$ctor(Text)`:
/// borrowed when the body holds the string verbatim, owned when it was
/// unescaped. (serde_json calls the byte methods from `deserialize_bytes`,
/// the string ones from `deserialize_any`.)
macro_rules! visit_text {
    ($ctor:expr) => {
        fn visit_borrowed_bytes<E: de::Error>(self, b: &'de [u8]) -> Result<Self::Value, E> {
            Ok($ctor(Text(Cow::Borrowed(b))))
        }
        fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<Self::Value, E> {
            Ok($ctor(Text(Cow::Owned(b.to_vec()))))
        }
        fn visit_byte_buf<E: de::Error>(self, b: Vec<u8>) -> Result<Self::Value, E> {
            Ok($ctor(Text(Cow::Owned(b))))
        }
        fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
            Ok($ctor(Text(Cow::Borrowed(s.as_bytes()))))
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok($ctor(Text(Cow::Owned(s.as_bytes().to_vec()))))
        }
        fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
            Ok($ctor(Text(Cow::Owned(s.into_bytes()))))
        }
    };
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            visit_text!(std::convert::identity);
        }
        d.deserialize_bytes(V(PhantomData))
    }
}

/// Generates a visitor that accepts a string (as `$text`) or an array of
/// `$item` (as `$items`).
macro_rules! string_or_seq {
    ($ty:ident, $item:ty, $what:literal, $text:path, $items:path) => {
        impl<'de: 'a, 'a> Deserialize<'de> for $ty<'a> {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V<'a>(PhantomData<&'a ()>);
                impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
                    type Value = $ty<'a>;
                    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                        f.write_str($what)
                    }
                    visit_text!($text);
                    fn visit_seq<A: SeqAccess<'de>>(
                        self,
                        mut seq: A,
                    ) -> Result<Self::Value, A::Error> {
                        let mut items: Vec<$item> = Vec::new();
                        while let Some(item) = seq.next_element()? {
                            items.push(item);
                        }
                        Ok($items(items))
                    }
                }
                d.deserialize_bytes(V(PhantomData))
            }
        }
    };
}

string_or_seq!(
    Content,
    Part<'a>,
    "a string or an array of content parts",
    Content::Text,
    Content::Parts
);
string_or_seq!(
    InputField,
    InputItem<'a>,
    "a string or an array of input items",
    InputField::Text,
    InputField::Items
);

/// One element of a completions `prompt` array.
enum Element<'a> {
    Text(Text<'a>),
    Token(i64),
    Tokens(Vec<i64>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Element<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Element<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }
            visit_text!(Element::Text);
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Element::Token(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                i64::try_from(v)
                    .map(Element::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<i64>()? {
                    ids.push(id);
                }
                Ok(Element::Tokens(ids))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A completions `prompt`: a string, strings, token ids, or batches of
/// token ids (an array of one kind only).
impl<'de: 'a, 'a> Deserialize<'de> for PromptField<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptField<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an array of strings, token ids or token id arrays")
            }
            visit_text!(PromptField::Text);
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items: Vec<Element<'a>> = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                of_one_kind(items).ok_or_else(|| de::Error::custom("a prompt array mixes kinds"))
            }
        }
        d.deserialize_bytes(V(PhantomData))
    }
}

fn of_one_kind(items: Vec<Element<'_>>) -> Option<PromptField<'_>> {
    match items.first() {
        None | Some(Element::Text(_)) => all(items, |e| match e {
            Element::Text(t) => Some(t),
            _ => None,
        })
        .map(PromptField::Texts),
        Some(Element::Token(_)) => all(items, |e| match e {
            Element::Token(t) => Some(t),
            _ => None,
        })
        .map(PromptField::Tokens),
        Some(Element::Tokens(_)) => all(items, |e| match e {
            Element::Tokens(t) => Some(t),
            _ => None,
        })
        .map(PromptField::TokenBatch),
    }
}

/// Every element unwrapped by `f`, or `None` if one is of another kind.
fn all<'a, T>(items: Vec<Element<'a>>, f: impl Fn(Element<'a>) -> Option<T>) -> Option<Vec<T>> {
    items.into_iter().map(f).collect()
}
