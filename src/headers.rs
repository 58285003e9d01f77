//! The proxy-wasm header-map wire format, parsed and written without
//! trusting anything: header values are raw bytes (HTTP allows obs-text, so
//! a client can send bytes that aren't UTF-8), and the SDK's own decoder
//! panics on those, which would kill the worker's VM.
//!
//! Format: u32 count, then (u32 key length, u32 value length) per pair,
//! then each key and value followed by a NUL.

pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Pairs from a serialized map; a malformed map yields the pairs before the
/// damage (never a panic, never an out-of-bounds read).
pub fn parse(buf: &[u8]) -> Pairs {
    let word = |at: usize| -> Option<usize> {
        let b = buf.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(b.try_into().ok()?) as usize)
    };
    let Some(n) = word(0) else { return Vec::new() };
    // Each pair needs at least 10 bytes: caps a lying count.
    let n = n.min(buf.len() / 10);
    let mut out = Vec::with_capacity(n);
    let Some(mut p) = n.checked_mul(8).and_then(|x| x.checked_add(4)) else {
        return out;
    };
    for i in 0..n {
        let (Some(klen), Some(vlen)) = (word(4 + i * 8), word(8 + i * 8)) else {
            break;
        };
        let Some(key) = buf.get(p..p.saturating_add(klen)) else {
            break;
        };
        p = p.saturating_add(klen + 1);
        let Some(val) = buf.get(p..p.saturating_add(vlen)) else {
            break;
        };
        p = p.saturating_add(vlen + 1);
        out.push((key.to_vec(), val.to_vec()));
    }
    out
}

pub fn serialize(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// First value of `name` (ASCII case-insensitive), as bytes.
pub fn get<'a>(pairs: &'a Pairs, name: &str) -> Option<&'a [u8]> {
    pairs
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
        .map(|(_, v)| v.as_slice())
}

/// First value of `name` as text, if it is UTF-8.
pub fn get_str<'a>(pairs: &'a Pairs, name: &str) -> Option<&'a str> {
    get(pairs, name).and_then(|v| std::str::from_utf8(v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_lookup() {
        let buf = serialize(&[(":method", "POST"), ("X-Prio", "low"), ("x-prio", "second")]);
        let pairs = parse(&buf);
        assert_eq!(pairs.len(), 3);
        assert_eq!(get_str(&pairs, ":method"), Some("POST"));
        assert_eq!(get_str(&pairs, "x-prio"), Some("low"));
        assert_eq!(get(&pairs, "missing"), None);
    }

    #[test]
    fn non_utf8_values_are_bytes_not_panics() {
        let mut buf = serialize(&[("x-gateway-destination-endpoint", "AB")]);
        let at = buf.len() - 3;
        buf[at] = 0xff;
        buf[at + 1] = 0xfe;
        let pairs = parse(&buf);
        assert_eq!(
            get(&pairs, "x-gateway-destination-endpoint"),
            Some(&[0xff, 0xfe][..])
        );
        assert_eq!(get_str(&pairs, "x-gateway-destination-endpoint"), None);
    }

    #[test]
    fn malformed_maps_never_panic() {
        let good = serialize(&[("a", "1"), ("bb", "22")]);
        for cut in 0..good.len() {
            let p = parse(&good[..cut]);
            assert!(p.len() <= 2);
        }
        assert!(parse(&[0xff, 0xff, 0xff, 0xff]).is_empty());
        let mut lying = good.clone();
        lying[4] = 0xff; // key length far past the end
        assert!(parse(&lying).is_empty());
    }
}
