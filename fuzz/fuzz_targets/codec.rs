//! Fuzzes `kvpush::proto::codec`: arbitrary bytes must decode to a message or a typed error, never a
//! panic; whatever decodes must re-encode to a frame that decodes to the same message; and
//! `frame_len` must agree with `decode` about the header.

#![no_main]

use std::sync::OnceLock;

use kvpush::proto::codec::{decode, frame_len, to_vec, DecodeError, HEADER_LEN};
use kvpush::proto::layout::KvLayout;
use libfuzzer_sys::fuzz_target;

fn peer() -> &'static KvLayout {
    static PEER: OnceLock<KvLayout> = OnceLock::new();
    PEER.get_or_init(kvpush_testkit::corpus::peer_layout)
}

fn check(data: &[u8], peer: Option<&KvLayout>) {
    let header = frame_len(data);
    let decoded = decode(data, peer);
    // frame_len and decode read the same header: they must agree on its faults and on the length.
    match &header {
        Ok(None) => {
            assert!(data.len() < HEADER_LEN);
            assert!(matches!(decoded, Err(DecodeError::Truncated { .. })), "short input gave {decoded:?}");
        }
        Ok(Some(len)) => {
            if *len != data.len() {
                let e = decoded.as_ref().expect_err("a frame of the wrong length decoded");
                assert!(
                    matches!(e, DecodeError::Truncated { .. } | DecodeError::TrailingBytes { .. }),
                    "frame_len {len} for {} bytes, decode gave {e:?}",
                    data.len()
                );
            }
        }
        Err(e) => assert_eq!(decoded.as_ref().err(), Some(e), "frame_len and decode disagree"),
    }
    let Ok(msg) = decoded else { return };
    assert_eq!(header, Ok(Some(data.len())), "a decoded frame's header must name its whole length");
    let again = to_vec(&msg).unwrap_or_else(|e| panic!("decoded {msg:?} does not re-encode: {e}"));
    let back = decode(&again, peer).unwrap_or_else(|e| panic!("re-encoded {msg:?} does not decode: {e}"));
    assert_eq!(back, msg, "re-encoding changed the message");
    // The encoder's frame is canonical: it re-encodes to itself. (Not necessarily the shortest: a
    // block-id list may be cut into runs other than the encoder's greedy cut, docs/protocol.md §1.)
    let third = to_vec(&back).unwrap_or_else(|e| panic!("{back:?} does not re-encode: {e}"));
    assert_eq!(third, again, "re-encoding is not a fixed point");
}

fuzz_target!(|data: &[u8]| {
    check(data, None);
    check(data, Some(peer()));
});
