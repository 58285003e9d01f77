//! A tolerant reader of the Prometheus text exposition format, as servers
//! really emit it.
//!
//! A line it cannot read is skipped, never fatal, because one odd line from
//! some unrelated exporter sharing the page must not blind the router to the
//! replica's load. Slicing goes through `str::get` and every loop advances by
//! at least one byte per step, so no input panics.

use std::borrow::Cow;

/// One sample line. Borrowed from the page; label values are unescaped only
/// when asked for.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Sample<'a> {
    /// Metric name as written, including any `_total`/`_bucket`/... suffix.
    pub(super) name: &'a str,
    pub(super) value: f64,
    /// Text between the braces, already checked to be well formed.
    labels: &'a str,
}

impl<'a> Sample<'a> {
    /// Label pairs in page order, values unescaped.
    pub(super) fn labels(&self) -> Labels<'a> {
        Labels { rest: self.labels }
    }

    /// The value of label `key` (the first one, if it is repeated).
    pub(super) fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(k, _)| *k == key).map(|(_, v)| v)
    }
}

/// Iterator over a sample's `(name, value)` label pairs.
#[derive(Debug, Clone)]
pub(super) struct Labels<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        match next_label(self.rest) {
            LabelStep::Pair { name, raw, rest } => {
                self.rest = rest;
                Some((name, unescape(raw)))
            }
            LabelStep::Close(_) | LabelStep::End | LabelStep::Bad => {
                self.rest = "";
                None
            }
        }
    }
}

/// Reads one line of the text format if `wanted` accepts its metric name.
/// The name is read first and the rest of the line only for a wanted name,
/// so skipping another family's sample costs no more than finding its name.
/// `None` for comments, blank lines, unwanted names and anything malformed.
///
/// Accepted, beyond the strict grammar, because real exporters do it:
/// leading/trailing blanks, `\r` (CRLF pages), blanks inside the braces and
/// around `=`, a trailing comma in the label set, tabs as separators, any
/// float spelling Rust reads (`NaN`, `+Inf`, `1.5e-05`, `.5`), fractional
/// (OpenMetrics) timestamps, and a trailing OpenMetrics exemplar (`# {...}`).
/// An unknown escape in a label value is kept as written. The timestamp
/// must be a finite number but is not kept.
pub(super) fn read_sample<'a>(
    line: &'a str,
    wanted: impl FnOnce(&str) -> bool,
) -> Option<Sample<'a>> {
    let (name, rest) = split_name(line)?;
    if !wanted(name) {
        return None;
    }
    parse_after_name(name, rest)
}

fn is_blank(b: u8) -> bool {
    // '\r' counts as a blank so CRLF pages need no separate pass.
    b == b' ' || b == b'\t' || b == b'\r'
}

fn trim_blank_start(s: &str) -> &str {
    s.trim_start_matches([' ', '\t', '\r'])
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// Splits a line into its metric name and the rest. Comments fail here
/// because `#` can't start a name.
fn split_name(line: &str) -> Option<(&str, &str)> {
    let line = trim_blank_start(line);
    let bytes = line.as_bytes();
    let first = *bytes.first()?;
    if !(first.is_ascii_alphabetic() || first == b'_' || first == b':') {
        return None;
    }
    let len = bytes
        .iter()
        .position(|&b| !is_name_byte(b))
        .unwrap_or(bytes.len());
    Some((line.get(..len)?, line.get(len..)?))
}

fn parse_after_name<'a>(name: &'a str, rest: &'a str) -> Option<Sample<'a>> {
    let rest = trim_blank_start(rest);
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inside) => split_label_block(inside)?,
        None => ("", rest),
    };
    let (value_token, rest) = split_token(trim_blank_start(rest));
    let value = parse_float(value_token)?;
    let rest = trim_blank_start(rest);
    // The optional timestamp: integer milliseconds in the Prometheus text
    // format, seconds in OpenMetrics. Checked, not interpreted.
    let rest = if ends_sample(rest) {
        rest
    } else {
        let (token, rest) = split_token(rest);
        if !parse_float(token).is_some_and(f64::is_finite) {
            return None;
        }
        trim_blank_start(rest)
    };
    if !ends_sample(rest) {
        return None;
    }
    Some(Sample {
        name,
        value,
        labels,
    })
}

/// Nothing left, or only an OpenMetrics exemplar, which we don't need.
fn ends_sample(rest: &str) -> bool {
    rest.is_empty() || rest.starts_with('#')
}

fn split_token(s: &str) -> (&str, &str) {
    match s.bytes().position(is_blank) {
        Some(i) => (s.get(..i).unwrap_or(s), s.get(i..).unwrap_or("")),
        None => (s, ""),
    }
}

fn parse_float(token: &str) -> Option<f64> {
    // Rust's parser takes exactly the Prometheus spellings that matter
    // (NaN, +Inf, -Inf, exponents) and rejects blanks, so no pre-check.
    token.parse::<f64>().ok()
}

/// Walks a label block starting just after `{`; returns the text inside the
/// braces and what follows the `}`. Fails on anything malformed, including a
/// block that never closes, so a sample is only ever built from a label set
/// that [`Labels`] can read back completely.
fn split_label_block(inside: &str) -> Option<(&str, &str)> {
    let mut rest = inside;
    loop {
        match next_label(rest) {
            LabelStep::Pair { rest: next, .. } => rest = next,
            LabelStep::Close(after) => {
                // `after` is a suffix of `inside`; the '}' sits just before it.
                let close_at = inside.len().checked_sub(after.len() + 1)?;
                return Some((inside.get(..close_at)?, after));
            }
            LabelStep::End | LabelStep::Bad => return None,
        }
    }
}

enum LabelStep<'a> {
    /// One `name="value"`; `rest` starts after its comma, or at the `}`/end.
    Pair {
        name: &'a str,
        raw: &'a str,
        rest: &'a str,
    },
    /// Reached the closing brace; holds what follows it.
    Close(&'a str),
    /// Ran out of text (fine inside a validated block, fatal while scanning).
    End,
    Bad,
}

fn next_label(s: &str) -> LabelStep<'_> {
    let s = trim_blank_start(s);
    let bytes = s.as_bytes();
    match bytes.first() {
        None => return LabelStep::End,
        Some(b'}') => return LabelStep::Close(s.get(1..).unwrap_or("")),
        Some(b) if b.is_ascii_alphabetic() || *b == b'_' => {}
        Some(_) => return LabelStep::Bad,
    }
    let name_len = bytes
        .iter()
        .position(|&b| !(b.is_ascii_alphanumeric() || b == b'_'))
        .unwrap_or(bytes.len());
    let (Some(name), Some(after_name)) = (s.get(..name_len), s.get(name_len..)) else {
        return LabelStep::Bad;
    };
    let Some(quoted) = trim_blank_start(after_name)
        .strip_prefix('=')
        .map(trim_blank_start)
        .and_then(|t| t.strip_prefix('"'))
    else {
        return LabelStep::Bad;
    };
    let Some(close_quote) = closing_quote(quoted) else {
        return LabelStep::Bad;
    };
    let (Some(raw), Some(after_value)) = (quoted.get(..close_quote), quoted.get(close_quote + 1..))
    else {
        return LabelStep::Bad;
    };
    let after_value = trim_blank_start(after_value);
    let rest = match after_value.as_bytes().first() {
        Some(b',') => after_value.get(1..).unwrap_or(""),
        Some(b'}') | None => after_value,
        Some(_) => return LabelStep::Bad,
    };
    LabelStep::Pair { name, raw, rest }
}

/// Index of the `"` ending a label value, honouring backslash escapes.
fn closing_quote(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    loop {
        match bytes.get(i)? {
            b'"' => return Some(i),
            // Skip the escaped byte whatever it is; a multi-byte character
            // after the backslash just leaves continuation bytes, which are
            // never '"' or '\\'.
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM_V1_DP2: &str = include_str!("../../tests/fixtures/metrics/vllm_v1_dp2.txt");

    fn parse_line(line: &str) -> Option<Sample<'_>> {
        read_sample(line, |_| true)
    }

    #[test]
    fn reads_plain_and_labelled_samples() {
        let s = parse_line("process_virtual_memory_bytes 2.5936637952e+010").unwrap();
        assert_eq!(s.name, "process_virtual_memory_bytes");
        assert_eq!(s.value, 2.5936637952e10);
        assert_eq!(s.labels().count(), 0);

        let s = parse_line(r#"vllm:num_requests_running{engine="0",model_name="m"} 12.0"#).unwrap();
        assert_eq!(s.name, "vllm:num_requests_running");
        assert_eq!(s.value, 12.0);
        let labels: Vec<_> = s.labels().collect();
        assert_eq!(
            labels,
            vec![
                ("engine", Cow::Borrowed("0")),
                ("model_name", Cow::Borrowed("m"))
            ]
        );
        assert_eq!(s.label("model_name").as_deref(), Some("m"));
        assert_eq!(s.label("absent"), None);
        assert_eq!(parse_line("x{} 1").unwrap().labels().count(), 0);
    }

    #[test]
    fn only_wanted_names_are_read() {
        let line = r#"a:b_total{x="1"} 2"#;
        let mut seen = None;
        let s = read_sample(line, |name| {
            seen = Some(name.to_string());
            name == "a:b_total"
        });
        assert_eq!(seen.as_deref(), Some("a:b_total"));
        assert_eq!(s.map(|s| s.value), Some(2.0));
        assert!(read_sample(line, |name| name == "a:b").is_none());
        // A comment never reaches `wanted`.
        assert!(read_sample("# TYPE a gauge", |_| panic!("asked")).is_none());
    }

    #[test]
    fn escaped_label_values_with_delimiters_inside() {
        let line = r#"m{a="say \"hi\", ok}",b="back\\slash",c="two\nlines",d="x=y}{,",e="\q"} 7"#;
        let s = parse_line(line).unwrap();
        assert_eq!(s.value, 7.0);
        assert_eq!(s.label("a").as_deref(), Some("say \"hi\", ok}"));
        assert_eq!(s.label("b").as_deref(), Some("back\\slash"));
        assert_eq!(s.label("c").as_deref(), Some("two\nlines"));
        assert_eq!(s.label("d").as_deref(), Some("x=y}{,"));
        // Unknown escapes are kept as written, as Prometheus itself does.
        assert_eq!(s.label("e").as_deref(), Some("\\q"));
        assert_eq!(s.labels().count(), 5);
        // Unescaping allocates only when there is something to unescape.
        assert!(matches!(s.label("d"), Some(Cow::Borrowed(_))));
    }

    #[test]
    fn special_floats_and_timestamps() {
        assert!(parse_line("a NaN").unwrap().value.is_nan());
        assert_eq!(parse_line("a +Inf").unwrap().value, f64::INFINITY);
        assert_eq!(parse_line("a -Inf").unwrap().value, f64::NEG_INFINITY);
        assert_eq!(parse_line("a 1.5e-05").unwrap().value, 1.5e-5);
        assert_eq!(parse_line("a -0.25").unwrap().value, -0.25);

        // A timestamp is accepted (and skipped), not taken for the value.
        assert_eq!(
            parse_line(r#"a{x="1"} 3 1712345678000"#).unwrap().value,
            3.0
        );
        assert_eq!(parse_line("a 3 -1").unwrap().value, 3.0);
        // OpenMetrics: seconds with a fraction, and an exemplar after it.
        let s = parse_line(r#"a_total 17 1712345678.5 # {trace_id="t"} 1.0"#).unwrap();
        assert_eq!(s.value, 17.0);
        let s = parse_line(r#"a_total 17 # {trace_id="t"} 1.0 1712345678.001"#).unwrap();
        assert_eq!(s.value, 17.0);
    }

    #[test]
    fn tolerant_spacing_and_line_endings() {
        let s = parse_line("  a { x = \"1\" , y=\"2\", }\t4.5\t\r").unwrap();
        assert_eq!(s.value, 4.5);
        assert_eq!(s.label("x").as_deref(), Some("1"));
        assert_eq!(s.label("y").as_deref(), Some("2"));
        assert_eq!(parse_line("a 2\r").unwrap().value, 2.0);
    }

    #[test]
    fn malformed_lines_are_rejected() {
        for line in [
            "",
            "   ",
            "\r",
            "# HELP a something",
            "# TYPE a gauge",
            "#a 1",
            "a",
            "a ",
            "a{",
            "a{} ",
            "1a 1",
            "a-b 1",
            "a one",
            "a 1 2 3",
            "a 1 ts",
            "a 1 NaN",
            "a 1 +Inf",
            r#"a{x="1" 2"#,
            r#"a{x="1"y="2"} 2"#,
            r#"a{x="unterminated} 2"#,
            r#"a{x="1",,} 2"#,
            r#"a{,} 2"#,
            r#"a{x=1} 2"#,
            r#"a{="1"} 2"#,
            r#"a{1x="1"} 2"#,
            r#"a{x="1\"} 2"#,
            r#"a{x "1"} 2"#,
            r#"a{x="\"#,
            "{\"a.b\"} 1",
        ] {
            assert!(parse_line(line).is_none(), "accepted {line:?}");
        }
    }

    #[test]
    fn only_samples_are_read_from_a_page() {
        let page =
            "# HELP a help\n# TYPE a gauge\n\na{x=\"1\"} 1\ngarbage here\na{x=\"2\"} 2\r\n# EOF";
        let got: Vec<_> = page
            .split('\n')
            .filter_map(parse_line)
            .map(|s| (s.name, s.label("x").map(Cow::into_owned), s.value))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", Some("1".to_string()), 1.0),
                ("a", Some("2".to_string()), 2.0)
            ]
        );
        assert_eq!(
            VLLM_V1_DP2
                .split('\n')
                .filter_map(parse_line)
                .filter(|s| s.name.ends_with("_created"))
                .count(),
            7
        );
    }
}
