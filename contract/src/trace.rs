//! The W3C Trace Context `traceparent` value (<https://www.w3.org/TR/trace-context/>), which
//! ties the router's log lines for a request to the worker's: the router passes the client's
//! on, or starts a trace when the client sent none, and both put its trace id in the request's
//! span.

use std::fmt;

/// The `sampled` trace flag: the router records every request it starts a trace for.
pub const SAMPLED: u8 = 0x01;

/// One `traceparent` value: `00-<trace id>-<parent id>-<flags>` in lowercase hex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    /// Never zero: the specification makes an all-zero id invalid.
    pub trace_id: u128,
    /// The caller's span; never zero.
    pub parent_id: u64,
    pub flags: u8,
}

impl TraceParent {
    /// A new trace from two random numbers; zeros, which the specification forbids, become one.
    pub fn start(trace_id: u128, parent_id: u64) -> Self {
        TraceParent {
            trace_id: trace_id.max(1),
            parent_id: parent_id.max(1),
            flags: SAMPLED,
        }
    }

    /// Reads a `traceparent` value. `None` for one the specification says to ignore: a wrong
    /// length or separator, uppercase or non-hex digits, version `ff`, all-zero ids. A later
    /// version is read by its version-00 fields, as the specification asks.
    pub fn parse(value: &str) -> Option<Self> {
        let value = value.trim();
        let version = value.get(..2)?;
        let parts = value.get(3..55)?;
        if !is_hex(version) || version == "ff" || value.as_bytes().get(2) != Some(&b'-') {
            return None;
        }
        // Version 00 is exactly 55 characters; later versions may append `-<more>`.
        let rest = &value[55..];
        if (version == "00" && !rest.is_empty()) || !(rest.is_empty() || rest.starts_with('-')) {
            return None;
        }
        let mut fields = parts.split('-');
        let (trace_id, parent_id, flags) = (fields.next()?, fields.next()?, fields.next()?);
        if fields.next().is_some()
            || trace_id.len() != 32
            || parent_id.len() != 16
            || flags.len() != 2
            || ![trace_id, parent_id, flags].into_iter().all(is_hex)
        {
            return None;
        }
        let parsed = TraceParent {
            trace_id: u128::from_str_radix(trace_id, 16).ok()?,
            parent_id: u64::from_str_radix(parent_id, 16).ok()?,
            flags: u8::from_str_radix(flags, 16).ok()?,
        };
        (parsed.trace_id != 0 && parsed.parent_id != 0).then_some(parsed)
    }

    /// The trace id as the header writes it: 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

fn is_hex(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.parent_id, self.flags
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_specifications_example_reads_and_writes_back() {
        let parsed = TraceParent::parse(EXAMPLE).unwrap();
        assert_eq!(parsed.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(parsed.parent_id, 0x00f067aa0ba902b7);
        assert_eq!(parsed.flags, SAMPLED);
        assert_eq!(parsed.to_string(), EXAMPLE);
        assert_eq!(parsed.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
    }

    #[test]
    fn invalid_values_are_ignored() {
        for bad in [
            "",
            "00",
            &EXAMPLE.to_uppercase(),
            &EXAMPLE.replace("-01", "-1"),
            &format!("{EXAMPLE}-extra"),
            &EXAMPLE.replacen("00-", "ff-", 1),
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736000f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_known_fields() {
        let later = format!("01{}-what-comes-later", &EXAMPLE[2..]);
        let parsed = TraceParent::parse(&later).unwrap();
        assert_eq!(parsed.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(TraceParent::parse(&format!("01{}x", &EXAMPLE[2..])), None);
    }

    #[test]
    fn a_started_trace_has_no_zero_ids() {
        let started = TraceParent::start(0, 0);
        assert_eq!((started.trace_id, started.parent_id), (1, 1));
        assert_eq!(TraceParent::parse(&started.to_string()), Some(started));
    }
}
