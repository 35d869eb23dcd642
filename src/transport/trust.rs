//! Data-path trust: a notification counts only when it comes from an agent whose metadata this
//! engine loaded after an authenticated handshake, and carries the tag of the key that handshake
//! agreed for it.
//!
//! Read [`Trusted`] first, then docs/security.md ("Data path"). NIXL names a notification's sender
//! by what the sender wrote into the message: the UCX backend serializes its own agent name next to
//! the message (`notifSendPriv`) and the receiver takes the name as given (`notifAmCb`), whichever
//! endpoint the message came in on. Any process that reaches the UCX worker can therefore claim to be
//! any agent. [`Trusted`] wraps the transport the engine was given (below staging, so staging's own
//! REQUEST, GRANT and PIECE messages are covered too) and
//!
//! * appends to every notification it sends to a keyed peer a 16-byte BLAKE2s MAC of the message
//!   under that peer's send key ([`DataKeys`], drawn and exchanged inside the encrypted side-channel
//!   handshake);
//! * passes on a received notification only if its claimed sender is a peer it was told to trust
//!   ([`Trusted::trust`]) and, for a keyed peer, its tag verifies under the receive key (the tag is
//!   removed). Anything else is dropped and counted ([`DataPathCounts`]) and never reaches staging
//!   or the engine.
//!
//! What it must never do: pass a notification it could not attribute; send a keyed peer an
//! untagged notification. It decides nothing about the protocol: a dropped notification is as if it
//! was lost, and the engine's timeouts and failure paths handle that.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use blake2::digest::{KeyInit, Mac};
use blake2::Blake2sMac;

use super::{Desc, Fence, Notification, Op, Transport, TransportError, Units, Waker, XferId, XferState};
use crate::device::MemRegion;
use crate::proto::plan::Grid;
use crate::sync::lock;

/// Bytes of the tag appended to a keyed peer's notifications.
pub const TAG_LEN: usize = 16;

type Tagger = Blake2sMac<blake2::digest::consts::U16>;

/// The keys of one peer's data path, agreed in an authenticated side-channel handshake: each side
/// draws the key it receives with and sends it to the peer inside the encrypted channel.
#[derive(Clone, PartialEq, Eq)]
pub struct DataKeys {
    /// Tags what this side sends to the peer (the peer's receive key).
    pub send: [u8; 32],
    /// Verifies what the peer sends to this side (drawn by this side).
    pub recv: [u8; 32],
}

impl fmt::Debug for DataKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataKeys(<redacted>)")
    }
}

/// How much a peer is trusted on the data path.
#[derive(Clone, Debug)]
enum PeerTrust {
    /// Learned through an authenticated side channel: its notifications carry tags.
    Keyed(DataKeys),
    /// Added by the application in this process (an in-process hub): trusted by name.
    Vouched,
}

/// Notifications [`Trusted`] dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DataPathCounts {
    /// From an agent no authenticated peer owns (a name this engine never loaded, or dropped).
    pub unknown_sender: u64,
    /// From a keyed peer's name, with a tag that does not verify (forged, or too short to carry one).
    pub bad_tag: u64,
}

impl DataPathCounts {
    /// Every notification dropped as unauthenticated.
    pub fn unauthenticated(&self) -> u64 {
        self.unknown_sender + self.bad_tag
    }
}

/// A transport whose notifications are attributed to authenticated peers only. See the module docs.
pub struct Trusted {
    inner: Arc<dyn Transport>,
    peers: RwLock<HashMap<String, PeerTrust>>,
    unknown_sender: AtomicU64,
    bad_tag: AtomicU64,
    raw: Mutex<Vec<Notification>>,
}

impl fmt::Debug for Trusted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trusted").field("inner", &self.inner).field("counts", &self.counts()).finish_non_exhaustive()
    }
}

fn tag(key: &[u8; 32], msg: &[u8]) -> Tagger {
    // BLAKE2s in keyed mode (RFC 7693), with the full 32-byte key.
    let mut mac = <Tagger as KeyInit>::new(key.into());
    mac.update(msg);
    mac
}

impl Trusted {
    /// Wraps `inner`; no peer is trusted yet.
    pub fn new(inner: Arc<dyn Transport>) -> Trusted {
        Trusted {
            inner,
            peers: RwLock::new(HashMap::new()),
            unknown_sender: AtomicU64::new(0),
            bad_tag: AtomicU64::new(0),
            raw: Mutex::new(Vec::new()),
        }
    }

    /// Trusts agent `agent` (a name [`Transport::load_remote`] returned): with `keys` when its
    /// handshake was authenticated, by name alone (`None`) when the application added it in this
    /// process. Replaces what was known of that name.
    pub fn trust(&self, agent: &str, keys: Option<DataKeys>) {
        let t = keys.map_or(PeerTrust::Vouched, PeerTrust::Keyed);
        self.peers.write().unwrap_or_else(|p| p.into_inner()).insert(agent.to_owned(), t);
    }

    /// What was dropped so far.
    pub fn counts(&self) -> DataPathCounts {
        DataPathCounts {
            unknown_sender: self.unknown_sender.load(Ordering::Relaxed),
            bad_tag: self.bad_tag.load(Ordering::Relaxed),
        }
    }

    /// `msg` as `peer` must receive it: tagged for a keyed peer.
    fn seal<'a>(&self, peer: &str, msg: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        match self.peers.read().unwrap_or_else(|p| p.into_inner()).get(peer) {
            Some(PeerTrust::Keyed(k)) => {
                let mut v = Vec::with_capacity(msg.len() + TAG_LEN);
                v.extend_from_slice(msg);
                v.extend_from_slice(&tag(&k.send, msg).finalize().into_bytes());
                std::borrow::Cow::Owned(v)
            }
            // Unknown peers: the inner transport refuses the post or the notification itself.
            Some(PeerTrust::Vouched) | None => std::borrow::Cow::Borrowed(msg),
        }
    }

    /// Counts a dropped notification; logs the first and then every power of two (a flood of
    /// forgeries must not become a flood of log lines).
    fn drop_one(&self, counter: &AtomicU64, from: &str, why: &str) {
        let n = counter.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(agent = %from, dropped = n, "notification dropped: {why}");
        }
    }
}

impl Transport for Trusted {
    fn name(&self) -> &str {
        self.inner.name()
    }
    unsafe fn register(&self, region: &MemRegion) -> Result<(), TransportError> {
        // SAFETY: this wrapper adds nothing to the memory's use; the caller's guarantees (1) and (2)
        // for `register` are passed on unchanged.
        unsafe { self.inner.register(region) }
    }
    fn deregister(&self, region: &MemRegion) -> Result<(), TransportError> {
        self.inner.deregister(region)
    }
    fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.inner.local_metadata()
    }
    fn load_remote(&self, metadata: &[u8]) -> Result<String, TransportError> {
        self.inner.load_remote(metadata)
    }
    fn revoke_peer(&self, peer: &str) -> Fence {
        self.inner.revoke_peer(peer)
    }
    fn drop_peer(&self, peer: &str) {
        self.peers.write().unwrap_or_else(|p| p.into_inner()).remove(peer);
        self.inner.drop_peer(peer);
    }
    fn prepare(&self, peer: Option<&str>, units: &[Units]) -> Result<(), TransportError> {
        self.inner.prepare(peer, units)
    }
    fn post(&self, op: Op, peer: &str, descs: &[Desc], notif: Option<&[u8]>) -> Result<XferId, TransportError> {
        let notif = notif.map(|m| self.seal(peer, m));
        self.inner.post(op, peer, descs, notif.as_deref())
    }
    fn post_grid(&self, peer: &str, grid: &Grid, notif: Option<&[u8]>) -> Option<Result<XferId, TransportError>> {
        let notif = notif.map(|m| self.seal(peer, m));
        self.inner.post_grid(peer, grid, notif.as_deref())
    }
    fn cancel(&self, id: XferId) {
        self.inner.cancel(id);
    }
    fn stop_incoming(&self, completes: &dyn Fn(&str, &[u8]) -> bool) -> usize {
        self.inner.stop_incoming(completes)
    }
    fn poll(&self, id: XferId) -> Result<XferState, TransportError> {
        self.inner.poll(id)
    }
    fn take_notifications(&self, out: &mut Vec<Notification>) -> Result<usize, TransportError> {
        let mut raw = lock(&self.raw);
        raw.clear();
        self.inner.take_notifications(&mut raw)?;
        let peers = self.peers.read().unwrap_or_else(|p| p.into_inner());
        let mut n = 0;
        for mut note in raw.drain(..) {
            match peers.get(&note.from) {
                None => self.drop_one(&self.unknown_sender, &note.from, "the sender is not an authenticated peer"),
                Some(PeerTrust::Vouched) => {
                    out.push(note);
                    n += 1;
                }
                Some(PeerTrust::Keyed(k)) => {
                    let Some(at) = note.msg.len().checked_sub(TAG_LEN) else {
                        self.drop_one(&self.bad_tag, &note.from, "too short to carry a tag");
                        continue;
                    };
                    if tag(&k.recv, &note.msg[..at]).verify_slice(&note.msg[at..]).is_err() {
                        self.drop_one(&self.bad_tag, &note.from, "its tag does not verify (forged?)");
                        continue;
                    }
                    note.msg.truncate(at);
                    out.push(note);
                    n += 1;
                }
            }
        }
        Ok(n)
    }
    fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<(), TransportError> {
        self.inner.send_notification(peer, &self.seal(peer, msg))
    }
    fn set_waker(&self, waker: Waker) {
        self.inner.set_waker(waker);
    }
    fn needs_polling(&self) -> bool {
        self.inner.needs_polling()
    }
    fn busy(&self) -> bool {
        self.inner.busy()
    }
    fn costly_host_descriptors(&self) -> bool {
        self.inner.costly_host_descriptors()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::loopback::Fabric;

    fn keys(a: u8, b: u8) -> DataKeys {
        DataKeys { send: [a; 32], recv: [b; 32] }
    }

    /// Two wrapped endpoints that loaded each other's metadata, and each's name for the other.
    fn pair(fabric: &Fabric) -> (Trusted, Trusted, String, String) {
        let a = Trusted::new(Arc::new(fabric.endpoint("a").expect("a")));
        let b = Trusted::new(Arc::new(fabric.endpoint("b").expect("b")));
        let b_name = a.load_remote(&b.local_metadata().expect("md")).expect("load b");
        let a_name = b.load_remote(&a.local_metadata().expect("md")).expect("load a");
        (a, b, a_name, b_name)
    }

    fn take(t: &Trusted, want: usize) -> Vec<Notification> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut out = Vec::new();
        while std::time::Instant::now() < deadline {
            t.take_notifications(&mut out).expect("take");
            let c = t.counts();
            if out.len() + c.unauthenticated() as usize >= want {
                return out;
            }
            std::thread::yield_now();
        }
        panic!("{} of {want} notifications seen: {out:?}, {:?}", out.len(), t.counts());
    }

    #[test]
    fn keyed_peers_exchange_tagged_notifications_and_the_tag_is_removed() {
        let fabric = Fabric::new();
        let (a, b, a_name, b_name) = pair(&fabric);
        a.trust(&b_name, Some(keys(1, 2)));
        b.trust(&a_name, Some(keys(2, 1)));
        a.send_notification(&b_name, b"KPhello").expect("send");
        let got = take(&b, 1);
        assert_eq!(got, vec![Notification { from: a_name, msg: b"KPhello".to_vec() }]);
        assert_eq!(b.counts(), DataPathCounts::default());
    }

    #[test]
    fn an_untrusted_sender_and_a_wrong_key_are_dropped_and_counted() {
        let fabric = Fabric::new();
        let (a, b, a_name, b_name) = pair(&fabric);
        // b has not been told to trust a: whatever a sends is dropped.
        a.send_notification(&b_name, b"KPone").expect("send");
        assert!(take(&b, 1).is_empty());
        assert_eq!(b.counts(), DataPathCounts { unknown_sender: 1, bad_tag: 0 });
        // Keys that do not match (a tags with 3, b verifies with 1): dropped as a bad tag.
        a.trust(&b_name, Some(keys(3, 2)));
        b.trust(&a_name, Some(keys(2, 1)));
        a.send_notification(&b_name, b"KPtwo").expect("send");
        assert!(take(&b, 2).is_empty());
        assert_eq!(b.counts(), DataPathCounts { unknown_sender: 1, bad_tag: 1 });
        // A vouched sender (the application's own in-process peer) is passed on untouched.
        let raw = fabric.endpoint("c").expect("c");
        let c_name = b.load_remote(&raw.local_metadata().expect("md")).expect("load c");
        raw.load_remote(&b.local_metadata().expect("md")).expect("load b");
        b.trust(&c_name, None);
        raw.send_notification(&b_name, b"KPthree").expect("send");
        assert_eq!(take(&b, 3), vec![Notification { from: c_name, msg: b"KPthree".to_vec() }]);
    }
}
