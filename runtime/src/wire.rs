//! The link layer's wire format: versioned envelopes in length-prefixed rmp-serde frames.
//!
//! A frame is a 4-byte big-endian payload length followed by one MessagePack-encoded
//! [`Envelope`]. Decoding never trusts the peer: the length is checked against the configured
//! limit before anything is allocated, and every failure is a [`WireError`] (the caller counts
//! it and closes the stream). Nothing here does I/O; [`FrameDecoder`] is fed bytes and hands
//! back whole envelopes, so the same code is used by the link and by the property tests.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The newest envelope format this build speaks (what it writes to a peer that speaks it too).
/// Version 2 added [`Envelope::tracestate`].
pub const WIRE_VERSION: u16 = 2;
/// The first version whose envelopes carry [`Envelope::tracestate`]; older peers cannot read
/// it, so frames of older versions are written without it.
pub const TRACESTATE_SINCE: u16 = 2;
/// The oldest envelope format this build still reads and writes. Two builds link when their
/// ranges overlap and then use the newest version both speak (see [`Versions::negotiate`]), so
/// a rolling upgrade runs old and new nodes side by side; a peer outside the range is refused.
pub const WIRE_VERSION_MIN: u16 = 1;
/// The version of the handshake's envelopes (`link.hello` and its answer), frozen forever: any
/// two builds can tell each other which versions they speak, and why they do not link.
pub const HANDSHAKE_VERSION: u16 = 1;
/// Test-only: `MIN-MAX` (or `MAX`, from [`WIRE_VERSION_MIN`]) makes this process speak another
/// range, as a later build would. Tests of rolling upgrades run "two builds" with it.
pub const TEST_VERSIONS_ENV: &str = "DUET_TEST_WIRE_VERSIONS";

/// The wire versions a node speaks: the oldest it still reads and writes, and its newest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Versions {
    /// The oldest.
    pub min: u16,
    /// The newest.
    pub max: u16,
}

impl Versions {
    /// What this build speaks.
    pub const BUILD: Versions = Versions {
        min: WIRE_VERSION_MIN,
        max: WIRE_VERSION,
    };

    /// What a peer that names no range speaks: version 1 alone.
    pub fn legacy() -> Versions {
        Versions { min: 1, max: 1 }
    }

    /// What this process speaks: [`Versions::BUILD`], unless [`TEST_VERSIONS_ENV`] says
    /// otherwise (a malformed value is reported by [`Versions::from_env`] at node start).
    pub fn spoken() -> Versions {
        static SPOKEN: std::sync::OnceLock<Versions> = std::sync::OnceLock::new();
        *SPOKEN.get_or_init(|| Versions::from_env().unwrap_or(Versions::BUILD))
    }

    /// The range [`TEST_VERSIONS_ENV`] sets, or [`Versions::BUILD`] when it is unset.
    pub fn from_env() -> Result<Versions, String> {
        match std::env::var(TEST_VERSIONS_ENV) {
            Ok(v) => Versions::parse(&v).ok_or_else(|| {
                format!("{TEST_VERSIONS_ENV}=`{v}`: expected MAX or MIN-MAX, 1 <= MIN <= MAX")
            }),
            Err(_) => Ok(Versions::BUILD),
        }
    }

    fn parse(v: &str) -> Option<Versions> {
        let (min, max) = match v.split_once('-') {
            Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
            None => (WIRE_VERSION_MIN, v.trim().parse().ok()?),
        };
        (1 <= min && min <= max).then_some(Versions { min, max })
    }

    /// Whether `version` is in the range.
    pub fn contains(&self, version: u16) -> bool {
        (self.min..=self.max).contains(&version)
    }

    /// The version a link between `self` and `theirs` uses: the newest both speak; `None`
    /// when the ranges do not overlap (the builds cannot talk, and the link is refused).
    pub fn negotiate(self, theirs: Versions) -> Option<u16> {
        let v = self.max.min(theirs.max);
        (v >= self.min && v >= theirs.min).then_some(v)
    }
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{} to {}", self.min, self.max)
        }
    }
}
/// Bytes of the length prefix.
pub const FRAME_HEADER_LEN: usize = 4;

/// One message between nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Wire format version ([`WIRE_VERSION`]).
    pub version: u16,
    /// What the body is, such as `membership.ping`; the target decodes the body by it.
    pub kind: String,
    /// One-way, request (with its deadline), or the answer to a request.
    pub flow: Flow,
    /// `NODE/actor` that sent it; checked against the authenticated peer on receipt.
    pub sender: String,
    /// Name of the service on the receiving node that handles it.
    pub target: String,
    /// Correlates a response with its request; unique per sending link.
    pub request_id: u64,
    /// W3C trace context (`00-<trace>-<span>-<flags>`), when the sender is traced.
    pub traceparent: Option<String>,
    /// The message itself, rmp-serde encoded by the sender.
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    /// W3C `tracestate` (vendors' entries that travel with the trace), from version
    /// [`TRACESTATE_SINCE`]. Last and left out when empty, so a version-1 envelope has the
    /// version-1 layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// How an envelope relates to others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Flow {
    /// Fire and forget (the sender still learns whether it was written to the link).
    OneWay,
    /// Expects exactly one [`Flow::Response`] or [`Flow::Failure`] within `deadline_ms`.
    Request {
        /// Time the receiver has to answer, counted from receipt.
        deadline_ms: u32,
    },
    /// A successful answer; `request_id` names the request.
    Response,
    /// A failed answer; the body is a [`RemoteFailure`].
    Failure,
}

/// Why a request failed on the remote side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFailure {
    /// Human-readable cause.
    pub message: String,
    /// Nothing was there to take the request: no actor under its target, or one being
    /// restarted. Asking again shortly is likely to work; nothing refused the request itself.
    #[serde(default)]
    pub unavailable: bool,
}

impl Envelope {
    /// A one-way envelope with the current wire version.
    pub fn one_way(kind: &str, sender: &str, target: &str, body: Vec<u8>) -> Envelope {
        Envelope {
            version: WIRE_VERSION,
            kind: kind.to_string(),
            flow: Flow::OneWay,
            sender: sender.to_string(),
            target: target.to_string(),
            request_id: 0,
            traceparent: None,
            body,
            tracestate: None,
        }
    }

    /// The node part of `sender` (`NODE/actor` -> `NODE`).
    pub fn sender_node(&self) -> &str {
        self.sender.split('/').next().unwrap_or_default()
    }
}

/// A frame that could not be decoded. The stream it came from is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The length prefix is above the configured limit.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    Oversized {
        /// Declared payload length.
        len: u64,
        /// Configured `link.max_frame_bytes`.
        max: u32,
    },
    /// A zero-length frame, which no sender produces.
    #[error("empty frame")]
    Empty,
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame: {got} of {expected} bytes")]
    Truncated {
        /// Bytes the frame needed.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// The payload is not a valid envelope.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// The envelope is from a wire version this node does not speak.
    #[error("wire version {got} is not supported (this node speaks {speaks})")]
    UnsupportedVersion {
        /// Version in the envelope.
        got: u16,
        /// What this node speaks ([`Versions::spoken`]).
        speaks: Versions,
    },
}

impl WireError {
    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            WireError::Oversized { .. } => "oversized",
            WireError::Empty => "empty",
            WireError::Truncated { .. } => "truncated",
            WireError::Malformed(_) => "malformed",
            WireError::UnsupportedVersion { .. } => "version",
        }
    }
}

/// Encodes `env` as one frame (length prefix included).
pub fn encode_frame(env: &Envelope) -> Vec<u8> {
    if env.version < TRACESTATE_SINCE && env.tracestate.is_some() {
        // A peer of an older version refuses an envelope with a field it does not know.
        let older = Envelope {
            tracestate: None,
            ..env.clone()
        };
        return encode_frame(&older);
    }
    let mut out = vec![0u8; FRAME_HEADER_LEN];
    // Serializing an owned struct of plain fields into a Vec cannot fail.
    if let Err(e) = rmp_serde::encode::write(&mut out, env) {
        unreachable!("rmp-serde failed to encode an envelope into memory: {e}");
    }
    let len = (out.len() - FRAME_HEADER_LEN) as u32;
    out[..FRAME_HEADER_LEN].copy_from_slice(&len.to_be_bytes());
    out
}

/// Reads the length prefix and checks it against `max`.
pub fn frame_len(header: [u8; FRAME_HEADER_LEN], max: u32) -> Result<usize, WireError> {
    let len = u32::from_be_bytes(header);
    if len == 0 {
        return Err(WireError::Empty);
    }
    if len > max {
        return Err(WireError::Oversized {
            len: u64::from(len),
            max,
        });
    }
    Ok(len as usize)
}

/// Decodes one payload (without its length prefix).
pub fn decode_payload(payload: &[u8]) -> Result<Envelope, WireError> {
    let env: Envelope =
        rmp_serde::from_slice(payload).map_err(|e| WireError::Malformed(e.to_string()))?;
    let speaks = Versions::spoken();
    let handshake = env.version == HANDSHAKE_VERSION && env.kind.starts_with("link.");
    if !speaks.contains(env.version) && !handshake {
        return Err(WireError::UnsupportedVersion {
            got: env.version,
            speaks,
        });
    }
    Ok(env)
}

/// Encodes a message body.
pub fn encode_body<T: Serialize>(body: &T) -> Vec<u8> {
    // Bodies are our own plain structs; encoding into memory has no failure mode.
    rmp_serde::to_vec(body).unwrap_or_else(|e| unreachable!("rmp-serde failed to encode: {e}"))
}

/// Decodes a message body that came from a peer.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    rmp_serde::from_slice(body).map_err(|e| WireError::Malformed(e.to_string()))
}

/// Turns a byte stream into envelopes. Feed it with [`FrameDecoder::push`], then drain
/// [`FrameDecoder::next_frame`] until it returns `Ok(None)`.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    max: u32,
}

impl FrameDecoder {
    /// A decoder that refuses frames above `max` payload bytes.
    pub fn new(max: u32) -> FrameDecoder {
        FrameDecoder {
            buf: Vec::new(),
            max,
        }
    }

    /// Appends bytes read from the stream.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole envelope, `None` when more bytes are needed.
    pub fn next_frame(&mut self) -> Result<Option<Envelope>, WireError> {
        let Some(header) = self.buf.first_chunk::<FRAME_HEADER_LEN>() else {
            return Ok(None);
        };
        let len = frame_len(*header, self.max)?;
        let end = FRAME_HEADER_LEN + len;
        if self.buf.len() < end {
            return Ok(None);
        }
        let env = decode_payload(&self.buf[FRAME_HEADER_LEN..end]);
        self.buf.drain(..end);
        env.map(Some)
    }

    /// Call at end of stream: a partial frame left over is an error.
    pub fn finish(&self) -> Result<(), WireError> {
        match self.buf.first_chunk::<FRAME_HEADER_LEN>() {
            None if self.buf.is_empty() => Ok(()),
            None => Err(WireError::Truncated {
                expected: FRAME_HEADER_LEN,
                got: self.buf.len(),
            }),
            Some(header) => Err(WireError::Truncated {
                expected: FRAME_HEADER_LEN + frame_len(*header, self.max)?,
                got: self.buf.len(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample(body: Vec<u8>) -> Envelope {
        Envelope {
            version: WIRE_VERSION,
            kind: "echo.ping".into(),
            flow: Flow::Request { deadline_ms: 500 },
            sender: "p0/bench".into(),
            target: "echo".into(),
            request_id: 42,
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into()),
            body,
            tracestate: Some("congo=t61rcWkgMzE".into()),
        }
    }

    /// The envelope of builds that speak version 1 alone, as they decode it.
    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct EnvelopeV1 {
        version: u16,
        kind: String,
        flow: Flow,
        sender: String,
        target: String,
        request_id: u64,
        traceparent: Option<String>,
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
    }

    #[test]
    fn a_version_1_frame_is_what_version_1_builds_read() {
        let mut env = sample(vec![7]);
        // Version 2 carries the tracestate; a version-1 build could not read that frame.
        let frame = encode_frame(&env);
        assert_eq!(decode_payload(&frame[FRAME_HEADER_LEN..]), Ok(env.clone()));
        assert!(rmp_serde::from_slice::<EnvelopeV1>(&frame[FRAME_HEADER_LEN..]).is_err());
        // On a version-1 link the same envelope goes without it, in the old layout.
        env.version = 1;
        let frame = encode_frame(&env);
        let old: EnvelopeV1 = rmp_serde::from_slice(&frame[FRAME_HEADER_LEN..]).expect("v1");
        assert_eq!((old.request_id, old.body), (42, vec![7]));
        let new = decode_payload(&frame[FRAME_HEADER_LEN..]).expect("read back");
        assert_eq!(new.tracestate, None);
        assert_eq!(new.traceparent, env.traceparent);
    }

    #[test]
    fn round_trips_through_frames() {
        let env = sample(vec![1, 2, 3]);
        let mut dec = FrameDecoder::new(1 << 20);
        let frame = encode_frame(&env);
        dec.push(&frame[..3]);
        assert_eq!(dec.next_frame(), Ok(None));
        dec.push(&frame[3..]);
        dec.push(&frame);
        assert_eq!(dec.next_frame(), Ok(Some(env.clone())));
        assert_eq!(dec.next_frame(), Ok(Some(env)));
        assert_eq!(dec.next_frame(), Ok(None));
        assert_eq!(dec.finish(), Ok(()));
    }

    #[test]
    fn refuses_oversized_before_reading_the_payload() {
        let mut dec = FrameDecoder::new(1024);
        dec.push(&(1025u32).to_be_bytes());
        assert_eq!(
            dec.next_frame(),
            Err(WireError::Oversized {
                len: 1025,
                max: 1024
            })
        );
    }

    #[test]
    fn refuses_other_versions() {
        let mut env = sample(vec![]);
        env.version = 9;
        let frame = encode_frame(&env);
        assert_eq!(
            decode_payload(&frame[FRAME_HEADER_LEN..]),
            Err(WireError::UnsupportedVersion {
                got: 9,
                speaks: Versions::BUILD
            })
        );
        // The handshake's envelopes are read whatever the range, so two builds can say why
        // they do not link.
        env.kind = "link.hello".into();
        env.version = HANDSHAKE_VERSION;
        let frame = encode_frame(&env);
        assert!(decode_payload(&frame[FRAME_HEADER_LEN..]).is_ok());
    }

    #[test]
    fn links_use_the_newest_version_both_speak() {
        let v = |min, max| Versions { min, max };
        assert_eq!(v(1, 1).negotiate(v(1, 1)), Some(1));
        // A rolling upgrade: the new build still speaks the old version.
        assert_eq!(v(1, 2).negotiate(v(1, 1)), Some(1));
        assert_eq!(v(1, 1).negotiate(v(1, 2)), Some(1));
        assert_eq!(v(1, 2).negotiate(v(1, 3)), Some(2));
        assert_eq!(v(2, 3).negotiate(v(1, 2)), Some(2));
        // Ranges that do not overlap never link.
        assert_eq!(v(1, 1).negotiate(v(2, 3)), None);
        assert_eq!(v(3, 4).negotiate(v(1, 2)), None);
        assert_eq!(Versions::parse("2"), Some(v(WIRE_VERSION_MIN, 2)));
        assert_eq!(Versions::parse("3-3"), Some(v(3, 3)));
        for bad in ["", "0", "3-2", "x", "1-", "0-1"] {
            assert_eq!(Versions::parse(bad), None, "{bad}");
        }
        assert_eq!(v(1, 2).to_string(), "1 to 2");
    }

    #[test]
    fn truncated_stream_is_an_error() {
        let frame = encode_frame(&sample(vec![7; 100]));
        let mut dec = FrameDecoder::new(1 << 20);
        dec.push(&frame[..frame.len() - 1]);
        assert_eq!(dec.next_frame(), Ok(None));
        assert!(matches!(dec.finish(), Err(WireError::Truncated { .. })));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Random bytes never panic and never yield an envelope that was not sent.
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let mut dec = FrameDecoder::new(1 << 16);
            dec.push(&bytes);
            for _ in 0..64 {
                match dec.next_frame() {
                    Ok(Some(env)) => prop_assert!(Versions::BUILD.contains(env.version) || env.kind.starts_with("link.")),
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = dec.finish();
        }

        /// Any truncation of a valid stream yields a prefix of the envelopes, then either
        /// "need more" or a typed error; never a wrong envelope.
        #[test]
        fn truncated_frames_yield_a_prefix(
            bodies in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..6),
            cut in any::<prop::sample::Index>(),
        ) {
            let sent: Vec<Envelope> = bodies.into_iter().map(sample).collect();
            let stream: Vec<u8> = sent.iter().flat_map(encode_frame).collect();
            let cut = cut.index(stream.len());
            let mut dec = FrameDecoder::new(1 << 16);
            dec.push(&stream[..cut]);
            let mut got = Vec::new();
            while let Ok(Some(env)) = dec.next_frame() {
                got.push(env);
            }
            prop_assert!(got.len() <= sent.len());
            prop_assert_eq!(&got[..], &sent[..got.len()]);
            let consumed: usize = sent[..got.len()].iter().map(|e| encode_frame(e).len()).sum();
            prop_assert_eq!(dec.finish().is_ok(), consumed == cut);
        }

        /// Corrupting bytes inside a valid frame gives a typed error or a valid envelope.
        #[test]
        fn corrupted_frames_are_typed_errors(
            body in proptest::collection::vec(any::<u8>(), 0..200),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        ) {
            let mut frame = encode_frame(&sample(body));
            for (at, byte) in flips {
                let i = at.index(frame.len());
                frame[i] = byte;
            }
            let mut dec = FrameDecoder::new(1 << 12);
            dec.push(&frame);
            match dec.next_frame() {
                Ok(Some(env)) => prop_assert!(Versions::BUILD.contains(env.version) || env.kind.starts_with("link.")),
                Ok(None) => prop_assert!(dec.finish().is_err()),
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
        }

        /// Declared lengths above the limit are refused whatever follows.
        #[test]
        fn oversized_lengths_are_refused(len in 1025u32.., tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut dec = FrameDecoder::new(1024);
            dec.push(&len.to_be_bytes());
            dec.push(&tail);
            prop_assert_eq!(dec.next_frame(), Err(WireError::Oversized { len: u64::from(len), max: 1024 }));
        }
    }
}
