//! The side channel: TCP connections between workers of different engines, carrying the handshake
//! and then the control frames (registrations, failures, aborts, pull grants, heartbeats).
//!
//! Read [`SideChannel`], then docs/security.md (the threat model and why Noise). Each worker
//! listens on one TCP port (default 5600 + TP rank); a consumer worker dials each producer worker it
//! needs ([`SideChannel::connect`], called off the engine loop). A connection starts like this:
//!
//! ```text
//! both send   greeting: "KVPSIDE2" | version u16 (3) | role (0 dialer, 1 listener) | auth (1 psk, 0 none)
//!             | rank tp u16 | rank pp u16 | engine id length u16 | engine id   (cleartext, little-endian)
//! Noise       Noise_NNpsk0_25519_AESGCM_BLAKE2s (Noise_NN_… in insecure mode), prologue =
//!             "kvpush side channel v3" | dialer's greeting | listener's greeting;
//!             dialer → "psk, e" ; listener → "e, ee"
//! dialer      → hello: 16-byte incarnation | 32-byte data-path key | Handshake frame (agent
//!               metadata, layout)                                                      (encrypted)
//! listener    → hello                                                                  (encrypted)
//! both        → verdict: 0, or 1 + the reason (UTF-8)                                  (encrypted)
//! ```
//!
//! Every byte after the greetings is a Noise transport message: a record is `u16 big-endian length |
//! ciphertext` (at most 65,535 bytes), whose plaintext is one flag byte (1: the message continues in
//! the next record) and a chunk of a message. Messages after the verdicts are the proto codec's
//! frames, unchanged. Noise's nonces make a replayed, reordered, reflected or forged record fail to
//! decrypt; the connection then closes and the failure is counted. The psk and the prologue bind the
//! session to the shared secret, both roles and both engine ids: a relay that splices two handshakes
//! or reflects one gets no session. The agent metadata travels only inside the channel, and the
//! listener sends its own only after the dialer's hello proved the dialer holds the session keys.
//! The data-path key in a hello is the one its sender verifies the peer's NIXL notifications with
//! (drawn per connection; [`crate::transport::trust`]).
//!
//! What must never happen here: an unauthenticated peer costing more than a handshake slot, a
//! thread and a few hundred bytes for at most the handshake deadline; a frame from a peer reaching
//! the engine before its handshake was accepted; a peer that restarted (new incarnation) inheriting
//! the registrations of its previous process; the I/O thread waiting on anything but `poll` (one
//! slow peer or a full engine would stall every connection).
//!
//! Threads: a fixed set per side channel, whatever its number of connections. One accept thread;
//! one thread per handshake in progress (at most [`SideLimits::max_handshakes`] for accepted
//! connections; a dialer handshakes on the caller's thread); and one I/O thread (`io_loop`) that
//! drives every established connection over non-blocking sockets with `poll(2)`: it reads into a
//! fixed buffer of one record, opens every whole record in it (a record that does not verify, or a
//! frame the engine refuses, closes the connection and is counted; silence counts from the last
//! record that verified), delivers frames, writes what senders left queued and sends a heartbeat
//! when a connection is idle. Senders seal and write on their own thread; a frame the engine has no
//! room for is parked and its connection not read until it fits (backpressure). A peer that closes,
//! errs or stays silent past the peer timeout is lost: the engine fails everything in flight with it.

use std::collections::HashMap;
use std::fmt;
use std::io::{Read, Write};
use std::mem::ManuallyDrop;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use snow::{HandshakeState, TransportState};

use super::cipher;
use super::dial::{self, DialPolicy};
use super::link::{ControlLink, LinkError, PeerAddr};
use super::EngineError;
use crate::proto::codec::{self, HEADER_LEN};
use crate::proto::compat;
use crate::proto::msg::{Handshake, Heartbeat, Message, MAX_ENGINE_ID};
use crate::proto::Rank;
use crate::sync::lock;
use crate::transport::trust::DataKeys;

/// The greeting's magic. It stays `KVPSIDE2` across versions, so that a build of another version
/// reads the version field after it and names both versions, instead of "bad greeting".
const MAGIC: &[u8; 8] = b"KVPSIDE2";
/// Version of the side channel's framing and cipher (not the proto codec's, which the handshake
/// checks). 3: AES-256-GCM (2 was ChaCha20-Poly1305, with the same greeting and records); a build
/// of version 2 and one of 3 refuse each other at the greeting, each naming both versions.
pub const SIDE_VERSION: u16 = 3;
const PROLOGUE_LABEL: &[u8] = b"kvpush side channel v3";
/// The Noise protocol of a channel with a secret (public so that `benches/side_channel.rs` measures
/// the channel's own cipher; docs/security.md says why these primitives: AES-GCM, AES-NI and
/// CLMUL picked at run time, where the CPU has them).
pub const NOISE_PSK: &str = "Noise_NNpsk0_25519_AESGCM_BLAKE2s";
/// The same without the secret (insecure mode): the same cipher, so that the two modes cost alike.
pub const NOISE_INSECURE: &str = "Noise_NN_25519_AESGCM_BLAKE2s";
const PSK_LABEL: &[u8] = b"kvpush side-channel psk v1\0";
/// The greeting's fixed part: magic, version, role, auth, rank, engine id length.
const GREETING_FIXED: usize = 8 + 2 + 1 + 1 + 4 + 2;
/// Longest greeting (the longest engine id).
pub const MAX_GREETING: usize = GREETING_FIXED + MAX_ENGINE_ID;
/// Longest record before the Noise handshake completed: its messages are an ephemeral key (32
/// bytes) and a tag (16), with an empty payload.
pub const MAX_PRE_AUTH_RECORD: usize = 96;
/// Longest Noise message (snow's limit).
const MAX_RECORD: usize = 65_535;
const TAG_LEN: usize = 16;
/// Plaintext per record: the record, less the tag and the continuation flag.
const MAX_CHUNK: usize = MAX_RECORD - TAG_LEN - 1;
/// Longest hello: incarnation, data-path key and the largest Handshake frame the codec accepts.
const MAX_HELLO: usize = 16 + 32 + HEADER_LEN + codec::MAX_HANDSHAKE_PAYLOAD as usize;
/// Longest verdict (a refusal reason is cut to fit).
const MAX_VERDICT: usize = 4096;
/// Longest control frame after the handshake.
const MAX_FRAME: usize = HEADER_LEN + codec::MAX_PAYLOAD as usize;

/// What the side channel needs from the engine it serves.
pub trait Endpoint: Send + Sync {
    /// This worker's address.
    fn me(&self) -> PeerAddr;
    /// This worker's handshake.
    fn local_handshake(&self) -> Result<Handshake, EngineError>;
    /// Accepts a peer whose handshake passed the checks (loads its transport metadata). A known
    /// peer that comes back with another `incarnation` restarted: what was in flight with its
    /// previous process fails.
    /// `keys` tag the peer's notifications on the data path (each side drew its receive key and sent
    /// it in its hello). `conn`: the connection this handshake came over; the same incarnation may
    /// handshake again over another one (a reconnection), and only the connection that is lost is.
    fn add_peer(
        &self,
        peer: &Handshake,
        incarnation: Incarnation,
        conn: ConnId,
        keys: DataKeys,
    ) -> Result<PeerAddr, EngineError>;
    /// Takes one control frame from the peer's `incarnation`; refuses it if the peer has since come
    /// back as another. Never blocks: while the engine's writers are behind it refuses with
    /// [`EngineError::Overloaded`], and the side channel offers the frame again (not reading that
    /// peer meanwhile: backpressure) for up to [`Endpoint::control_wait`].
    fn deliver(&self, from: &PeerAddr, incarnation: Incarnation, frame: &[u8]) -> Result<(), EngineError>;
    /// How long a frame refused as [`EngineError::Overloaded`] may wait for room before its
    /// connection is closed as overloaded.
    fn control_wait(&self) -> Duration;
    /// Connection `conn` to `incarnation` of `peer` went away: fail what is in flight with it,
    /// unless the same incarnation has handshaken again over another connection since (then the
    /// peer is not lost: nothing of its process went away). Returns whether the peer was lost.
    fn peer_lost(&self, peer: &PeerAddr, incarnation: Incarnation, conn: ConnId, reason: &str) -> bool;
}

/// A random id each side channel draws when it starts: a peer that handshakes again with another
/// one is a new process, not a reconnection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Incarnation(pub u128);

/// A connection's number on its side channel (drawn from a counter per side channel, never reused):
/// which connection of a peer's incarnation a handshake came over, and which one was lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnId(pub u64);

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Limits on what peers, and strangers, may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SideLimits {
    /// Handshakes of accepted connections in progress at once (each holds one thread for at most
    /// the handshake deadline); more connections are closed at once.
    pub max_handshakes: usize,
    /// Handshakes in progress at once from one IP address.
    pub max_handshakes_per_address: usize,
    /// Established connections (dialed and accepted; all served by the one I/O thread).
    pub max_connections: usize,
    /// Established connections with one IP address.
    pub max_connections_per_address: usize,
    /// Frames queued for sending to one peer.
    pub send_queue_frames: usize,
    /// Bytes queued for sending to one peer.
    pub send_queue_bytes: usize,
}

impl Default for SideLimits {
    fn default() -> Self {
        Self {
            max_handshakes: 8,
            max_handshakes_per_address: 4,
            max_connections: 64,
            max_connections_per_address: 32,
            send_queue_frames: 4096,
            send_queue_bytes: 64 << 20,
        }
    }
}

/// Side-channel configuration.
#[derive(Clone)]
pub struct SideConfig {
    /// Address to listen on (default `0.0.0.0:5600`; add the TP rank to the port per worker).
    pub listen: String,
    /// Shared secret both sides prove (Noise's pre-shared key is derived from it); default
    /// `$KVPUSH_SECRET`. Empty is an error. Unset: a loopback listener uses a random per-process key
    /// (peers in the same process only); any other listener refuses to start unless `insecure`.
    pub secret: Option<Vec<u8>>,
    /// No authentication at all (Noise without a key): anyone who reaches the port can register
    /// transfers. Default `$KVPUSH_INSECURE=1`. Warned about at every start; refused with a secret.
    pub insecure: bool,
    /// Heartbeat interval on idle connections.
    pub heartbeat: Duration,
    /// A peer silent for this long is lost.
    pub peer_timeout: Duration,
    /// Limit for connecting and for the whole handshake (one deadline, not per read).
    pub handshake_timeout: Duration,
    /// Connection, handshake and queue limits.
    pub limits: SideLimits,
    /// Which addresses [`SideChannel::connect`] may dial (None: `$KVPUSH_DIAL_ALLOW`, else
    /// [`DialPolicy::cluster`], loopback and the private networks; see [`super::dial`]).
    pub dial_allow: Option<DialPolicy>,
}

impl fmt::Debug for SideConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideConfig")
            .field("listen", &self.listen)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("insecure", &self.insecure)
            .field("heartbeat", &self.heartbeat)
            .field("peer_timeout", &self.peer_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("limits", &self.limits)
            .field("dial_allow", &self.dial_allow)
            .finish()
    }
}

/// The environment variable holding the side channel's shared secret.
pub const SECRET_ENV: &str = "KVPUSH_SECRET";
/// The environment variable that, set to `1`, turns authentication off.
pub const INSECURE_ENV: &str = "KVPUSH_INSECURE";

impl SideConfig {
    /// Defaults for TP rank `rank`: port 5600 + rank on all interfaces, the secret from
    /// `$KVPUSH_SECRET` and insecure mode from `$KVPUSH_INSECURE`, heartbeat 1 s, peer lost after 5
    /// s of silence, handshake deadline 10 s.
    pub fn for_rank(rank: u16) -> Self {
        Self {
            listen: format!("0.0.0.0:{}", 5600 + u32::from(rank)),
            secret: std::env::var_os(SECRET_ENV).map(|s| s.into_encoded_bytes()),
            insecure: std::env::var(INSECURE_ENV).is_ok_and(|v| v == "1"),
            heartbeat: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
            limits: SideLimits::default(),
            dial_allow: None,
        }
    }
}

/// What went wrong on the side channel.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SideError {
    /// Socket error, with what was being done.
    #[error("side channel {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is unsafe or contradictory; nothing was started.
    #[error("side channel on {listen}: {reason}")]
    Config {
        /// The listen address.
        listen: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The peer did not prove the shared secret (or this side did not prove it to the peer).
    #[error("{peer} failed authentication: {detail}")]
    Auth {
        /// The peer.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// The handshake was refused (by this side or the peer); the reason says why.
    #[error("handshake with {peer} refused: {reason}")]
    Refused {
        /// The peer (address, or its engine and rank when known).
        peer: String,
        /// Why.
        reason: String,
    },
    /// The peer does not speak the side-channel protocol.
    #[error("{peer} is not a kvpush side channel: {detail}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// A frame or record is longer than the connection's state allows; it was not read.
    #[error("{peer} sent {len} bytes {state}; at most {max} are allowed")]
    TooLarge {
        /// The peer.
        peer: String,
        /// The connection's state.
        state: &'static str,
        /// The announced length.
        len: usize,
        /// The limit in that state.
        max: usize,
    },
    /// The handshake did not complete before its deadline.
    #[error("handshake with {peer} timed out after {after:?} while {what}")]
    TimedOut {
        /// The peer.
        peer: String,
        /// What was being done.
        what: String,
        /// The handshake deadline.
        after: Duration,
    },
    /// A connection limit is reached.
    #[error("side channel: {what} (limit {limit})")]
    Busy {
        /// Which limit.
        what: String,
        /// Its value.
        limit: usize,
    },
    /// The dial target is not on the allow-list ([`SideConfig::dial_allow`]); nothing was sent.
    #[error("side channel: not dialing {target} ({addrs}): the dial allow-list ({policy}) does not include it; add its network to ${env} (the connector's `dial_allow`)", env = dial::DIAL_ALLOW_ENV)]
    NotAllowed {
        /// The target as asked for.
        target: String,
        /// What it resolved to.
        addrs: String,
        /// The allow-list.
        policy: String,
    },
    /// The engine is gone.
    #[error("the engine behind this side channel has shut down")]
    Closed,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SideError {
    let what = what.into();
    move |source| SideError::Io { what, source }
}

/// Counters of the side channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SideStats {
    /// Handshakes completed.
    pub handshakes: u64,
    /// Handshakes refused (either side: compatibility, identity).
    pub refused: u64,
    /// Peers that failed authentication, and records that did not verify after it (each closed
    /// its connection).
    pub auth_failures: u64,
    /// Handshakes that ran past their deadline.
    pub timeouts: u64,
    /// Records or frames longer than their state allows (each closed its connection unread).
    pub oversized: u64,
    /// Connections closed at once because a limit was reached.
    pub over_limit: u64,
    /// Handshakes of accepted connections in progress now.
    pub pending_handshakes: u64,
    /// Frames received.
    pub frames_in: u64,
    /// Frames sent.
    pub frames_out: u64,
    /// Malformed or refused frames (each closed its connection).
    pub malformed: u64,
    /// Peers lost (closed, failed or silent).
    pub peers_lost: u64,
    /// Peers that came back as a new process (their previous one's state was dropped).
    pub restarts: u64,
    /// Dials refused because the target is not on the allow-list.
    pub dial_refused: u64,
    /// Bytes sealed for peers and not yet written (now).
    pub queued_out: u64,
    /// Bytes read from peers and not yet opened (now).
    pub unopened_in: u64,
}

#[derive(Default)]
struct Counters {
    handshakes: AtomicU64,
    refused: AtomicU64,
    auth_failures: AtomicU64,
    timeouts: AtomicU64,
    oversized: AtomicU64,
    over_limit: AtomicU64,
    frames_in: AtomicU64,
    frames_out: AtomicU64,
    malformed: AtomicU64,
    peers_lost: AtomicU64,
    restarts: AtomicU64,
    dial_refused: AtomicU64,
}

impl Counters {
    /// Counts `e` under its kind, and hands it back.
    fn count(&self, e: SideError) -> SideError {
        let c = match e {
            SideError::Refused { .. } => &self.refused,
            SideError::Auth { .. } => &self.auth_failures,
            SideError::TimedOut { .. } => &self.timeouts,
            SideError::TooLarge { .. } => &self.oversized,
            SideError::Busy { .. } => &self.over_limit,
            SideError::NotAllowed { .. } => &self.dial_refused,
            _ => return e,
        };
        c.fetch_add(1, Ordering::Relaxed);
        e
    }
}

/// How peers prove themselves.
#[derive(Clone)]
enum Auth {
    /// Noise with this pre-shared key; `process_local` when it is this process's random key.
    Psk { key: [u8; 32], process_local: bool },
    /// Noise without a key: encryption against a passive observer, no authentication.
    Insecure,
}

impl Auth {
    fn wire(&self) -> u8 {
        match self {
            Auth::Psk { .. } => 1,
            Auth::Insecure => 0,
        }
    }

    /// Noise with the pre-shared key derived from `secret`.
    fn from_secret(secret: &[u8]) -> Auth {
        let mut h = Sha256::new();
        h.update(PSK_LABEL);
        h.update(secret);
        Auth::Psk { key: h.finalize().into(), process_local: false }
    }

    /// Resolves the configured secret (see [`SideConfig::secret`]) for a listener bound to `local`.
    fn resolve(config: &SideConfig, local: SocketAddr) -> Result<Auth, SideError> {
        let fail = |reason: String| SideError::Config { listen: config.listen.clone(), reason };
        match (&config.secret, config.insecure) {
            (Some(s), _) if s.is_empty() => {
                Err(fail(format!("the shared secret is empty; set a random one (e.g. 32 hex bytes) in ${SECRET_ENV}")))
            }
            (Some(_), true) => {
                Err(fail(format!("both a shared secret and insecure mode are set (${INSECURE_ENV}); choose one")))
            }
            (Some(s), false) => {
                if s.len() < 16 {
                    tracing::warn!(listen = %config.listen, len = s.len(), "side-channel secret shorter than 16 bytes: a recorded handshake lets anyone guess it offline; use 32 random bytes");
                }
                Ok(Auth::from_secret(s))
            }
            (None, true) => {
                tracing::warn!(listen = %config.listen, "side channel in INSECURE mode: peers are not authenticated; anyone who reaches this port can register transfers and read KV metadata");
                Ok(Auth::Insecure)
            }
            (None, false) if local.ip().is_loopback() => {
                tracing::info!(listen = %local, "no side-channel secret: a per-process key on loopback; peers in other processes need ${SECRET_ENV}");
                Ok(Auth::Psk { key: *process_key()?, process_local: true })
            }
            (None, false) => Err(fail(format!(
                "no shared secret for a listener reachable from the network; set ${SECRET_ENV} (the connector's `secret`) on every engine, or set ${INSECURE_ENV}=1 (`insecure: true`) to run without authentication"
            ))),
        }
    }

    /// Runs the Noise handshake on `stream` (after the greetings) and returns the session.
    fn authenticate(&self, wire: &mut Wire<'_>, role: Role, prologue: &[u8]) -> Result<TransportState, SideError> {
        let peer = wire.peer.to_owned();
        let noise_err = |e: snow::Error| SideError::Protocol { peer: peer.clone(), detail: format!("noise: {e}") };
        let builder = match self {
            Auth::Psk { key, .. } => {
                snow::Builder::with_resolver(NOISE_PSK.parse().map_err(noise_err)?, cipher::resolver())
                    .psk(0, key)
                    .map_err(noise_err)?
            }
            Auth::Insecure => {
                snow::Builder::with_resolver(NOISE_INSECURE.parse().map_err(noise_err)?, cipher::resolver())
            }
        }
        .prologue(prologue)
        .map_err(noise_err)?;
        let mut hs: HandshakeState = match role {
            Role::Dialer => builder.build_initiator(),
            Role::Listener => builder.build_responder(),
        }
        .map_err(noise_err)?;
        let mut msg = [0u8; MAX_PRE_AUTH_RECORD];
        let mut payload = [0u8; MAX_PRE_AUTH_RECORD];
        let hint = match self {
            Auth::Psk { process_local: true, .. } => format!(
                "this side has no secret configured (a per-process key, for peers in this process only): set the same ${SECRET_ENV} on both sides"
            ),
            _ => "the shared secrets differ (or one side is in insecure mode)".to_owned(),
        };
        let auth_failed = |detail: String| SideError::Auth { peer: peer.clone(), detail };
        match role {
            Role::Dialer => {
                let n = hs.write_message(&[], &mut msg).map_err(noise_err)?;
                wire.write_record(&msg[..n], "sending the first handshake message")?;
                let r = match wire.read_record(&mut msg, MAX_PRE_AUTH_RECORD, "before authentication") {
                    Err(SideError::Io { source, .. }) if source.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Err(auth_failed(format!("the peer closed the connection: {hint}")))
                    }
                    r => r?,
                };
                hs.read_message(r, &mut payload)
                    .map_err(|e| auth_failed(format!("the peer's handshake message does not verify ({e}): {hint}")))?;
            }
            Role::Listener => {
                let r = wire.read_record(&mut msg, MAX_PRE_AUTH_RECORD, "before authentication")?;
                hs.read_message(r, &mut payload)
                    .map_err(|e| auth_failed(format!("the peer's handshake message does not verify ({e}): {hint}")))?;
                let n = hs.write_message(&[], &mut msg).map_err(noise_err)?;
                wire.write_record(&msg[..n], "sending the second handshake message")?;
            }
        }
        hs.into_transport_mode().map_err(noise_err)
    }
}

fn random<const N: usize>(what: &str) -> Result<[u8; N], SideError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b)
        .map_err(|e| SideError::Io { what: format!("drawing {what}"), source: std::io::Error::other(e.to_string()) })?;
    Ok(b)
}

/// A fresh random secret (64 hex digits) for a run whose processes a parent starts: it hands the
/// same one to each child in `$KVPUSH_SECRET`.
pub fn random_secret() -> Result<String, SideError> {
    Ok(random::<32>("a secret")?.iter().map(|b| format!("{b:02x}")).collect())
}

/// This process's random pre-shared key for loopback listeners without a secret.
fn process_key() -> Result<&'static [u8; 32], SideError> {
    static KEY: OnceLock<[u8; 32]> = OnceLock::new();
    if let Some(k) = KEY.get() {
        return Ok(k);
    }
    let k = random::<32>("the per-process side-channel key")?;
    Ok(KEY.get_or_init(|| k))
}

/// One handshaken connection.
///
/// Its socket is non-blocking. Senders (the engine's writer threads) seal and write on their own
/// thread ([`Conn::queue`]); what the socket does not take at once waits in `out` for the I/O
/// thread. Only the I/O thread reads (`inbound`).
struct Conn {
    peer: PeerAddr,
    /// The IP address the connection is with.
    ip: IpAddr,
    incarnation: Incarnation,
    /// This connection's number (what the engine knows it by).
    id: ConnId,
    /// Closed when the connection is dropped, unless `fd_gone`.
    stream: Socket,
    /// `poll` found the descriptor closed (`POLLNVAL`): other code in this process closed it under
    /// the I/O thread, so its number is no longer this connection's and may already be reused for
    /// another file. It is then neither shut down, written, nor closed again.
    fd_gone: AtomicBool,
    /// The session: both directions' keys and nonces (sealing and opening take turns on it).
    noise: Mutex<TransportState>,
    out: Mutex<Outbound>,
    inbound: Mutex<Inbound>,
    closed: AtomicBool,
}

/// Records sealed for the peer and not yet written, in the order they were sealed.
struct Outbound {
    /// Sealed records; `buf[at..]` is not written yet.
    buf: Vec<u8>,
    at: usize,
    /// Frames sealed since `buf` was last empty (the bound on frames queued).
    frames: usize,
    scratch: Vec<u8>,
    /// When a frame was last queued: a heartbeat is due `heartbeat` after it.
    last_sent: Instant,
    heartbeat_seq: u64,
    /// A write failed on a sender's thread: the I/O thread closes the connection with this reason.
    failed: Option<String>,
}

impl Outbound {
    fn new() -> Self {
        Self {
            buf: Vec::new(),
            at: 0,
            frames: 0,
            scratch: Vec::new(),
            last_sent: Instant::now(),
            heartbeat_seq: 0,
            failed: None,
        }
    }

    fn pending(&self) -> usize {
        self.buf.len() - self.at
    }

    /// Seals `frame` after what is already queued.
    fn seal(&mut self, noise: &Mutex<TransportState>, frame: &[u8]) -> Result<(), snow::Error> {
        if self.pending() == 0 {
            self.buf.clear();
            self.at = 0;
            self.frames = 0;
        }
        seal(&mut lock(noise), frame, &mut self.buf, &mut self.scratch)?;
        self.frames += 1;
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Writes what the socket takes now (all of it on a blocking socket).
    fn flush(&mut self, mut stream: impl Write) -> std::io::Result<()> {
        while self.at < self.buf.len() {
            match stream.write(&self.buf[self.at..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => self.at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if self.pending() == 0 {
            self.buf.clear();
            self.at = 0;
            self.frames = 0;
        } else if self.at > self.buf.len() / 2 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        Ok(())
    }
}

/// What the I/O thread keeps of a connection's incoming side.
struct Inbound {
    opener: Opener,
    msg: Vec<u8>,
    /// A frame the engine had no room for (control budget spent), and since when: delivered again
    /// before anything more is read from the socket, so TCP's window fills and the peer's sends
    /// fail with [`LinkError::Full`] instead of memory growing here.
    parked: Option<(Vec<u8>, Instant)>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if !*self.fd_gone.get_mut() {
            // SAFETY: the socket is dropped here only, once, as the connection itself is dropped; it
            // is never used after. With `fd_gone` it is leaked instead: its number is not ours to close.
            unsafe { ManuallyDrop::drop(&mut self.stream.0) };
        }
    }
}

/// A connection's socket, closed only by [`Conn`]'s `Drop` (which may leave it open: `fd_gone`).
struct Socket(ManuallyDrop<TcpStream>);

impl std::ops::Deref for Socket {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        &self.0
    }
}

impl Read for &Socket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl Write for &Socket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (&*self.0).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        (&*self.0).flush()
    }
}

impl Conn {
    /// Shuts the connection down both ways (the peer reads its end), unless its descriptor is gone.
    fn shut(&self) {
        if !self.fd_gone.load(Ordering::SeqCst) {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
    }

    /// Seals `frame` and writes what the socket takes on the caller's thread; whether bytes are left
    /// for the I/O thread. Refused past the send-queue limits.
    fn queue(&self, frame: &[u8], limits: &SideLimits) -> Result<bool, LinkError> {
        let mut out = lock(&self.out);
        if self.closed.load(Ordering::SeqCst) || out.failed.is_some() {
            return Err(LinkError::Closed(self.peer.clone()));
        }
        if out.pending() + frame.len() > limits.send_queue_bytes {
            return Err(LinkError::Full {
                peer: self.peer.clone(),
                what: format!("{} bytes queued", limits.send_queue_bytes),
            });
        }
        if out.pending() > 0 && out.frames >= limits.send_queue_frames {
            return Err(LinkError::Full {
                peer: self.peer.clone(),
                what: format!("{} frames queued", limits.send_queue_frames),
            });
        }
        if let Err(e) = out.seal(&self.noise, frame) {
            out.failed = Some(format!("cannot encrypt a frame: {e}"));
            return Err(LinkError::Closed(self.peer.clone()));
        }
        if let Err(e) = out.flush(&self.stream) {
            out.failed = Some(format!("write failed: {e}"));
            return Err(LinkError::Closed(self.peer.clone()));
        }
        Ok(out.pending() > 0)
    }
}

/// Handshakes in progress on accepted connections, by address.
#[derive(Default)]
struct Admission {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// A handshake slot; given back when dropped.
struct Slot {
    inner: Weak<Inner>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            let mut a = lock(&inner.admission);
            a.total = a.total.saturating_sub(1);
            if let Some(n) = a.per_address.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    a.per_address.remove(&self.ip);
                }
            }
        }
    }
}

struct Inner {
    config: SideConfig,
    auth: Auth,
    /// What [`SideChannel::connect`] may dial.
    dial: DialPolicy,
    incarnation: Incarnation,
    /// The next connection's number.
    next_conn: AtomicU64,
    endpoint: RwLock<Option<Weak<dyn Endpoint>>>,
    local: SocketAddr,
    conns: Mutex<HashMap<PeerAddr, Arc<Conn>>>,
    admission: Mutex<Admission>,
    counters: Counters,
    shutdown: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Wakes the I/O thread (a byte on a socket pair it polls).
    wake: UnixStream,
}

/// A worker's side channel: listener, connections, and the [`ControlLink`] over them.
pub struct SideChannel {
    inner: Arc<Inner>,
}

impl fmt::Debug for SideChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideChannel").field("listening", &self.inner.local).finish_non_exhaustive()
    }
}

impl SideChannel {
    /// Binds the listener (it accepts once [`SideChannel::serve`] gave it an endpoint). Refuses an
    /// empty secret, a secret together with insecure mode, and a listener reachable from the
    /// network with neither (see [`SideConfig::secret`]).
    pub fn bind(config: SideConfig) -> Result<SideChannel, SideError> {
        let listener = TcpListener::bind(&config.listen).map_err(io(format!("listening on {}", config.listen)))?;
        let local = listener.local_addr().map_err(io("reading the listening address"))?;
        let auth = Auth::resolve(&config, local)?;
        cipher::warn_if_software_aes();
        let dial = match &config.dial_allow {
            Some(p) => p.clone(),
            None => DialPolicy::from_env()
                .map_err(|e| SideError::Config {
                    listen: config.listen.clone(),
                    reason: format!("${}: {e}", dial::DIAL_ALLOW_ENV),
                })?
                .unwrap_or_else(DialPolicy::cluster),
        };
        let incarnation = Incarnation(u128::from_le_bytes(random::<16>("an incarnation id")?));
        let (wake, woken) = UnixStream::pair().map_err(io("creating the I/O thread's wake-up"))?;
        for s in [&wake, &woken] {
            s.set_nonblocking(true).map_err(io("creating the I/O thread's wake-up"))?;
        }
        let inner = Arc::new(Inner {
            config,
            auth,
            dial,
            incarnation,
            next_conn: AtomicU64::new(1),
            endpoint: RwLock::new(None),
            local,
            conns: Mutex::new(HashMap::new()),
            admission: Mutex::new(Admission::default()),
            counters: Counters::default(),
            shutdown: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            wake,
        });
        let weak = Arc::downgrade(&inner);
        let accept = std::thread::Builder::new()
            .name(accept_thread_name(local.port()))
            .spawn(move || accept_loop(listener, weak))
            .map_err(io("starting the accept thread"))?;
        lock(&inner.threads).push(accept);
        let weak = Arc::downgrade(&inner);
        let io_thread = std::thread::Builder::new()
            .name(io_thread_name(local.port()))
            .spawn(move || io_loop(&weak, &woken))
            .map_err(io("starting the I/O thread"))?;
        lock(&inner.threads).push(io_thread);
        Ok(SideChannel { inner })
    }

    /// Starts serving `endpoint` (held weakly). Connections accepted before are refused.
    pub fn serve(&self, endpoint: Weak<dyn Endpoint>) {
        *self.inner.endpoint.write().unwrap_or_else(|p| p.into_inner()) = Some(endpoint);
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local
    }

    /// This side channel's incarnation (drawn at [`SideChannel::bind`]).
    pub fn incarnation(&self) -> Incarnation {
        self.inner.incarnation
    }

    /// Dials a peer worker and handshakes; returns its address once both sides accepted. Blocks up to
    /// the handshake timeout: call it off the engine loop. Only an address the dial allow-list
    /// ([`SideConfig::dial_allow`]) allows is dialed; otherwise [`SideError::NotAllowed`] (counted in
    /// [`SideStats::dial_refused`]) before any socket is opened.
    pub fn connect(&self, addr: impl ToSocketAddrs + fmt::Display) -> Result<PeerAddr, SideError> {
        let name = addr.to_string();
        let resolved: Vec<SocketAddr> = addr.to_socket_addrs().map_err(io(format!("resolving {name}")))?.collect();
        if resolved.is_empty() {
            return Err(SideError::Protocol { peer: name, detail: "resolves to no address".into() });
        }
        let host = dial::host_of(&name);
        let allowed: Vec<SocketAddr> = resolved.iter().filter(|a| self.inner.dial.allows(host, a)).copied().collect();
        if allowed.is_empty() {
            let addrs = resolved.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
            let e = SideError::NotAllowed { target: name, addrs, policy: self.inner.dial.to_string() };
            tracing::warn!(error = %e, "side-channel dial refused");
            return Err(self.inner.counters.count(e));
        }
        let deadline = Instant::now() + self.inner.config.handshake_timeout;
        let mut connected = Err(std::io::ErrorKind::NotConnected.into());
        for target in &allowed {
            connected = TcpStream::connect_timeout(target, self.inner.config.handshake_timeout);
            if connected.is_ok() {
                break;
            }
        }
        let stream = connected.map_err(io(format!("connecting to {name}")))?;
        Inner::establish(&self.inner, stream, &name, Role::Dialer, deadline).map_err(|e| self.inner.counters.count(e))
    }

    /// Peers with an open connection.
    pub fn peers(&self) -> Vec<PeerAddr> {
        lock(&self.inner.conns).keys().cloned().collect()
    }

    /// Closes the connection to `peer` (it is reported lost).
    pub fn disconnect(&self, peer: &PeerAddr) {
        let conn = lock(&self.inner.conns).get(peer).cloned();
        if let Some(c) = conn {
            Inner::lost(&self.inner, &c, "disconnected locally");
        }
    }

    fn conns_sum(&self, f: impl Fn(&Conn) -> usize) -> u64 {
        let conns: Vec<Arc<Conn>> = lock(&self.inner.conns).values().cloned().collect();
        conns.iter().map(|c| f(c) as u64).sum()
    }

    /// Counters so far.
    pub fn stats(&self) -> SideStats {
        let c = &self.inner.counters;
        SideStats {
            handshakes: c.handshakes.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            auth_failures: c.auth_failures.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            oversized: c.oversized.load(Ordering::Relaxed),
            over_limit: c.over_limit.load(Ordering::Relaxed),
            pending_handshakes: lock(&self.inner.admission).total as u64,
            frames_in: c.frames_in.load(Ordering::Relaxed),
            frames_out: c.frames_out.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            peers_lost: c.peers_lost.load(Ordering::Relaxed),
            restarts: c.restarts.load(Ordering::Relaxed),
            dial_refused: c.dial_refused.load(Ordering::Relaxed),
            queued_out: self.conns_sum(|c| lock(&c.out).pending()),
            unopened_in: self.conns_sum(|c| {
                let i = lock(&c.inbound);
                i.opener.end - i.opener.start
            }),
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.wake_io();
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.inner.local, Duration::from_millis(200));
        let conns: Vec<Arc<Conn>> = lock(&self.inner.conns).drain().map(|(_, c)| c).collect();
        if !conns.is_empty() {
            // The peers see these connections end with nothing lost on this side: say why here.
            tracing::info!(
                listen = %self.inner.local,
                connections = conns.len(),
                "side channel stopping with its engine: closing its connections"
            );
        }
        for c in conns {
            c.closed.store(true, Ordering::SeqCst);
            c.shut();
        }
        let threads: Vec<JoinHandle<()>> = lock(&self.inner.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl ControlLink for SideChannel {
    fn send(&self, _from: &PeerAddr, to: &PeerAddr, frame: Vec<u8>) -> Result<(), LinkError> {
        let conn = lock(&self.inner.conns).get(to).cloned().ok_or_else(|| LinkError::UnknownPeer(to.clone()))?;
        let queued = conn.queue(&frame, &self.inner.config.limits);
        if matches!(queued, Ok(true) | Err(LinkError::Closed(_))) {
            // Bytes for the I/O thread to write, or a failure for it to report.
            self.inner.wake_io();
        }
        queued?;
        self.inner.counters.frames_out.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn accept_loop(listener: TcpListener, inner: Weak<Inner>) {
    for stream in listener.incoming() {
        let Some(inner) = inner.upgrade() else { return };
        if inner.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let Ok(addr) = stream.peer_addr() else { continue };
        // A stranger holds at most a slot (and its thread) until the handshake deadline; past the
        // limits the connection is closed before a byte is read or sent.
        let Some(slot) = Inner::admit(&inner, addr.ip()) else { continue };
        let deadline = Instant::now() + inner.config.handshake_timeout;
        let weak = Arc::downgrade(&inner);
        let peer = addr.to_string();
        let spawned = std::thread::Builder::new().name(handshake_thread_name(inner.local.port())).spawn(move || {
            let _slot = slot;
            if let Some(inner) = weak.upgrade() {
                if let Err(e) = Inner::establish(&inner, stream, &peer, Role::Listener, deadline) {
                    let e = inner.counters.count(e);
                    tracing::warn!(%peer, error = %e, "side-channel handshake failed");
                }
            }
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a handshake thread");
        }
    }
}

/// The name of the handshake threads of the listener on `port` (at most 15 bytes: what Linux keeps
/// of a thread's name, so tools and tests can count them per listener).
pub fn handshake_thread_name(port: u16) -> String {
    format!("kvside-hs-{port}")
}

/// Which end of the connection this side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Dialed the peer (Noise initiator).
    Dialer,
    /// Accepted the connection (Noise responder).
    Listener,
}

impl Role {
    fn wire(self) -> u8 {
        match self {
            Role::Dialer => 0,
            Role::Listener => 1,
        }
    }
}

/// What a peer said in its greeting (authenticated only once the Noise handshake completes, through
/// the prologue).
struct Greeting {
    bytes: Vec<u8>,
    auth: u8,
    rank: Rank,
    engine: String,
}

fn greeting(role: Role, auth: &Auth, me: &PeerAddr) -> Vec<u8> {
    // An engine id is at most MAX_ENGINE_ID bytes (checked when the engine is configured); a
    // longer one would be refused by the peer.
    let id = me.engine.as_bytes();
    let mut g = Vec::with_capacity(GREETING_FIXED + id.len());
    g.extend_from_slice(MAGIC);
    g.extend_from_slice(&SIDE_VERSION.to_le_bytes());
    g.push(role.wire());
    g.push(auth.wire());
    g.extend_from_slice(&me.rank.tp.to_le_bytes());
    g.extend_from_slice(&me.rank.pp.to_le_bytes());
    g.extend_from_slice(&u16::try_from(id.len()).unwrap_or(u16::MAX).to_le_bytes());
    g.extend_from_slice(id);
    g
}

/// A socket with one deadline for everything read and written on it.
struct Wire<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
    timeout: Duration,
    peer: &'a str,
}

impl Wire<'_> {
    fn remaining(&self, what: &str) -> Result<Duration, SideError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(SideError::TimedOut { peer: self.peer.to_owned(), what: what.to_owned(), after: self.timeout });
        }
        Ok(left)
    }

    fn read_exact(&mut self, buf: &mut [u8], what: &str) -> Result<(), SideError> {
        let mut got = 0;
        while got < buf.len() {
            let left = self.remaining(what)?;
            self.stream.set_read_timeout(Some(left)).map_err(io("setting a timeout"))?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(SideError::Io {
                        what: format!("{what} from {}", self.peer),
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    })
                }
                Ok(n) => got += n,
                Err(e) if is_retry(&e) => {}
                Err(e) => return Err(io(format!("{what} from {}", self.peer))(e)),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, mut buf: &[u8], what: &str) -> Result<(), SideError> {
        while !buf.is_empty() {
            let left = self.remaining(what)?;
            self.stream.set_write_timeout(Some(left)).map_err(io("setting a timeout"))?;
            match self.stream.write(buf) {
                Ok(0) => {
                    return Err(SideError::Io {
                        what: format!("{what} to {}", self.peer),
                        source: std::io::ErrorKind::WriteZero.into(),
                    })
                }
                Ok(n) => buf = &buf[n..],
                Err(e) if is_retry(&e) => {}
                Err(e) => return Err(io(format!("{what} to {}", self.peer))(e)),
            }
        }
        Ok(())
    }

    fn read_greeting(&mut self) -> Result<Greeting, SideError> {
        let protocol = |detail: String| SideError::Protocol { peer: self.peer.to_owned(), detail };
        let mut fixed = [0u8; GREETING_FIXED];
        self.read_exact(&mut fixed, "reading the greeting")?;
        if &fixed[..8] != MAGIC {
            return Err(protocol("bad greeting".into()));
        }
        let version = u16::from_le_bytes([fixed[8], fixed[9]]);
        if version != SIDE_VERSION {
            return Err(protocol(format!("side-channel version {version}, this side speaks {SIDE_VERSION}")));
        }
        let mut bytes = fixed.to_vec();
        let id_len = usize::from(u16::from_le_bytes([fixed[16], fixed[17]]));
        if id_len > MAX_ENGINE_ID {
            return Err(SideError::TooLarge {
                peer: self.peer.to_owned(),
                state: "as an engine id in the greeting",
                len: id_len,
                max: MAX_ENGINE_ID,
            });
        }
        let mut id = vec![0u8; id_len];
        self.read_exact(&mut id, "reading the greeting")?;
        bytes.extend_from_slice(&id);
        let engine = String::from_utf8(id).map_err(|_| protocol("the engine id is not UTF-8".into()))?;
        let rank = Rank::new(u16::from_le_bytes([fixed[12], fixed[13]]), u16::from_le_bytes([fixed[14], fixed[15]]));
        Ok(Greeting { bytes, auth: fixed[11], rank, engine })
    }

    /// Reads one record of at most `max` bytes into `buf`; a longer one is refused unread.
    fn read_record<'b>(&mut self, buf: &'b mut [u8], max: usize, state: &'static str) -> Result<&'b [u8], SideError> {
        let mut len = [0u8; 2];
        self.read_exact(&mut len, "reading a record")?;
        let len = usize::from(u16::from_be_bytes(len));
        let max = max.min(buf.len());
        if len > max {
            return Err(SideError::TooLarge { peer: self.peer.to_owned(), state, len, max });
        }
        self.read_exact(&mut buf[..len], "reading a record")?;
        Ok(&buf[..len])
    }

    fn write_record(&mut self, body: &[u8], what: &str) -> Result<(), SideError> {
        let mut out = Vec::with_capacity(2 + body.len());
        out.extend_from_slice(&(body.len() as u16).to_be_bytes());
        out.extend_from_slice(body);
        self.write_all(&out, what)
    }
}

fn is_retry(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted)
}

/// Encrypts `msg` into records appended to `out`.
fn seal(noise: &mut TransportState, msg: &[u8], out: &mut Vec<u8>, scratch: &mut Vec<u8>) -> Result<(), snow::Error> {
    let mut rest = msg;
    loop {
        let n = rest.len().min(MAX_CHUNK);
        let (chunk, tail) = rest.split_at(n);
        scratch.clear();
        scratch.push(u8::from(!tail.is_empty()));
        scratch.extend_from_slice(chunk);
        let at = out.len();
        out.resize(at + 2 + scratch.len() + TAG_LEN, 0);
        let len = noise.write_message(scratch, &mut out[at + 2..])?;
        // `len` is at most MAX_RECORD (one flag byte, MAX_CHUNK bytes and the tag), which fits u16.
        out[at..at + 2].copy_from_slice(&(len as u16).to_be_bytes());
        out.truncate(at + 2 + len);
        rest = tail;
        if rest.is_empty() {
            return Ok(());
        }
    }
}

/// The per-connection buffers of an authenticated channel: bytes read and not yet opened
/// (`inbound[start..end]`; after [`Opener::fill`] compacts them, at most one partial record), and one
/// record's plaintext. Both are allocated once, when the peer has proven the key.
struct Opener {
    inbound: Vec<u8>,
    start: usize,
    end: usize,
    plain: Vec<u8>,
    /// When a record last verified: the peer's last sign of life.
    last_record: Instant,
}

impl Opener {
    fn new() -> Self {
        Self {
            inbound: vec![0u8; 2 + MAX_RECORD],
            start: 0,
            end: 0,
            plain: vec![0u8; MAX_RECORD],
            last_record: Instant::now(),
        }
    }

    /// Reads what the socket has (one `read`) after the bytes not yet opened; `Ok(0)`: closed.
    fn fill(&mut self, stream: &mut impl Read) -> std::io::Result<usize> {
        if self.start > 0 {
            self.inbound.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        // What is left is less than one whole record (2 + MAX_RECORD bytes), so there is room.
        let n = stream.read(&mut self.inbound[self.end..])?;
        self.end += n;
        Ok(n)
    }

    /// Whether a whole record waits in the buffer, read and not yet opened.
    fn has_record(&self) -> bool {
        let avail = &self.inbound[self.start..self.end];
        avail.first_chunk::<2>().is_some_and(|&[hi, lo]| avail.len() >= 2 + usize::from(u16::from_be_bytes([hi, lo])))
    }

    /// Opens the whole records already read, appending their chunks to `msg`, until a message is
    /// complete (`true`) or no whole record is left (`false`): what a connection's reader does between
    /// reads. One `read` usually brings a whole frame, so a frame costs one system call here.
    fn open_buffered(
        &mut self,
        noise: &Mutex<TransportState>,
        msg: &mut Vec<u8>,
        peer: &str,
    ) -> Result<bool, SideError> {
        loop {
            let avail = &self.inbound[self.start..self.end];
            let Some(&[hi, lo]) = avail.first_chunk::<2>() else { return Ok(false) };
            let len = usize::from(u16::from_be_bytes([hi, lo]));
            if avail.len() < 2 + len {
                return Ok(false);
            }
            let record = self.start + 2..self.start + 2 + len;
            self.start = record.end;
            if self.open(noise, record, msg, MAX_FRAME, peer, "in a frame")? {
                return Ok(true);
            }
        }
    }

    /// Decrypts one record (`self.inbound[record]`) and appends its chunk to `msg`, refusing to grow
    /// `msg` past `max`. Returns whether the message is complete.
    fn open(
        &mut self,
        noise: &Mutex<TransportState>,
        record: std::ops::Range<usize>,
        msg: &mut Vec<u8>,
        max: usize,
        peer: &str,
        state: &'static str,
    ) -> Result<bool, SideError> {
        let n = lock(noise).read_message(&self.inbound[record], &mut self.plain).map_err(|e| SideError::Auth {
            peer: peer.to_owned(),
            detail: format!("a record does not verify ({e}): forged, replayed, reflected or out of order"),
        })?;
        self.last_record = Instant::now();
        let Some((&more, chunk)) = self.plain[..n].split_first() else {
            return Err(SideError::Protocol { peer: peer.to_owned(), detail: "an empty record".into() });
        };
        if msg.len() + chunk.len() > max {
            return Err(SideError::TooLarge { peer: peer.to_owned(), state, len: msg.len() + chunk.len(), max });
        }
        msg.extend_from_slice(chunk);
        Ok(more == 0)
    }
}

/// An authenticated, encrypted connection during the rest of the handshake.
struct Channel<'a> {
    wire: Wire<'a>,
    noise: Mutex<TransportState>,
    opener: Opener,
    scratch: Vec<u8>,
}

impl Channel<'_> {
    fn send(&mut self, msg: &[u8], what: &str) -> Result<(), SideError> {
        let mut out = Vec::with_capacity(msg.len() + 64);
        seal(&mut lock(&self.noise), msg, &mut out, &mut self.scratch).map_err(|e| SideError::Protocol {
            peer: self.wire.peer.to_owned(),
            detail: format!("cannot encrypt: {e}"),
        })?;
        self.wire.write_all(&out, what)
    }

    fn recv(&mut self, max: usize, state: &'static str) -> Result<Vec<u8>, SideError> {
        let mut msg = Vec::new();
        loop {
            // Exact reads: nothing past the handshake's last record is taken from the socket here.
            let len = self.wire.read_record(&mut self.opener.inbound, MAX_RECORD, state)?.len();
            if self.opener.open(&self.noise, 0..len, &mut msg, max, self.wire.peer, state)? {
                return Ok(msg);
            }
        }
    }
}

impl Inner {
    fn endpoint(&self) -> Result<Arc<dyn Endpoint>, SideError> {
        self.endpoint
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
            .ok_or(SideError::Closed)
    }

    /// Whether a connection to `addr` at `ip` fits the connection limits (a peer that reconnects
    /// replaces its connection, so it needs no room).
    fn room_for(&self, addr: &PeerAddr, ip: IpAddr) -> Result<(), SideError> {
        let limits = &self.config.limits;
        let conns = lock(&self.conns);
        if conns.contains_key(addr) {
            return Ok(());
        }
        if conns.len() >= limits.max_connections {
            return Err(SideError::Busy {
                what: format!("too many connections, refusing {addr}"),
                limit: limits.max_connections,
            });
        }
        if conns.values().filter(|c| c.ip == ip).count() >= limits.max_connections_per_address {
            return Err(SideError::Busy {
                what: format!("too many connections with {ip}, refusing {addr}"),
                limit: limits.max_connections_per_address,
            });
        }
        Ok(())
    }

    /// A handshake slot for a connection from `ip`, or `None` (counted) past the limits.
    fn admit(this: &Arc<Inner>, ip: IpAddr) -> Option<Slot> {
        let limits = &this.config.limits;
        let mut a = lock(&this.admission);
        let from_ip = a.per_address.get(&ip).copied().unwrap_or(0);
        if a.total >= limits.max_handshakes || from_ip >= limits.max_handshakes_per_address {
            drop(a);
            this.counters.over_limit.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%ip, "side-channel connection closed: handshake limit reached");
            return None;
        }
        a.total += 1;
        *a.per_address.entry(ip).or_insert(0) += 1;
        Some(Slot { inner: Arc::downgrade(this), ip })
    }

    /// Handshakes on `stream` (greetings, Noise, hellos, verdicts) before `deadline` and, if both
    /// sides accept, hands the connection to the I/O thread.
    fn establish(
        this: &Arc<Inner>,
        mut stream: TcpStream,
        name: &str,
        role: Role,
        deadline: Instant,
    ) -> Result<PeerAddr, SideError> {
        let endpoint = this.endpoint()?;
        stream.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
        let ip = stream.peer_addr().map_err(io("reading the peer's address"))?.ip();
        let me = endpoint.me();
        let refused = |reason: String| SideError::Refused { peer: name.to_owned(), reason };
        let mut wire = Wire { stream: &mut stream, deadline, timeout: this.config.handshake_timeout, peer: name };

        // 1. Greetings, in the clear: nothing in them but the protocol, the roles and the ids.
        let mine = greeting(role, &this.auth, &me);
        wire.write_all(&mine, "greeting")?;
        let theirs = wire.read_greeting()?;
        let expected = match role {
            Role::Dialer => Role::Listener,
            Role::Listener => Role::Dialer,
        };
        if theirs.bytes[10] != expected.wire() {
            return Err(SideError::Protocol {
                peer: name.to_owned(),
                detail: "the peer claims this side's role (a reflected connection?)".into(),
            });
        }
        match (this.auth.wire(), theirs.auth) {
            (1, 0) => {
                return Err(SideError::Auth {
                    peer: name.to_owned(),
                    detail: "this side requires a shared secret and the peer runs in insecure mode".into(),
                })
            }
            (0, 1) => {
                return Err(SideError::Auth {
                    peer: name.to_owned(),
                    detail: "the peer requires a shared secret and this side runs in insecure mode".into(),
                })
            }
            _ => {}
        }
        let mut prologue = PROLOGUE_LABEL.to_vec();
        let (first, second) = match role {
            Role::Dialer => (&mine, &theirs.bytes),
            Role::Listener => (&theirs.bytes, &mine),
        };
        prologue.extend_from_slice(first);
        prologue.extend_from_slice(second);

        // 2. Noise: both prove the key, bound to both greetings.
        let noise = this.auth.authenticate(&mut wire, role, &prologue)?;
        let mut ch = Channel { wire, noise: Mutex::new(noise), opener: Opener::new(), scratch: Vec::new() };

        // 3. Hellos. The listener reads the dialer's first (proof that the dialer holds the session
        // keys, not a replay of its first message) before it sends its own metadata.
        let local = endpoint.local_handshake().map_err(|e| refused(e.to_string()))?;
        let frame = codec::to_vec(&Message::Handshake(Box::new(local.clone())))
            .map_err(|e| refused(format!("cannot encode our handshake: {e}")))?;
        let recv_key = random::<32>("a data-path key")?;
        let mut hello = this.incarnation.0.to_le_bytes().to_vec();
        hello.extend_from_slice(&recv_key);
        hello.extend_from_slice(&frame);
        let peer_hello = match role {
            Role::Dialer => {
                ch.send(&hello, "sending our handshake")?;
                ch.recv(MAX_HELLO, "in the handshake")?
            }
            Role::Listener => {
                let h = ch.recv(MAX_HELLO, "in the handshake")?;
                ch.send(&hello, "sending our handshake")?;
                h
            }
        };

        // 4. Verdicts: identity (the engine id and rank of the greeting), decoding, compatibility.
        let verdict: Result<(Handshake, Incarnation, DataKeys), String> = (|| {
            let Some((inc, rest)) = peer_hello.split_first_chunk::<16>() else {
                return Err("the peer's hello is truncated".into());
            };
            let Some((send_key, frame)) = rest.split_first_chunk::<32>() else {
                return Err("the peer's hello is truncated".into());
            };
            let hs = match codec::decode(frame, None) {
                Ok(Message::Handshake(h)) => *h,
                Ok(_) => return Err("the peer sent another message instead of its handshake".into()),
                Err(e) => return Err(format!("the peer's handshake is malformed: {e}")),
            };
            if hs.engine_id != theirs.engine || hs.layout.parallel.rank() != theirs.rank {
                return Err(format!(
                    "the peer greeted as {}[{}] but its handshake says {}[{}]",
                    theirs.engine,
                    theirs.rank,
                    hs.engine_id,
                    hs.layout.parallel.rank()
                ));
            }
            compat::check(&local, &hs).map_err(|e| e.to_string())?;
            // Past a connection limit the peer is told why, not just closed after its verdict.
            this.room_for(&PeerAddr { engine: hs.engine_id.clone(), rank: hs.layout.parallel.rank() }, ip)
                .map_err(|e| e.to_string())?;
            Ok((hs, Incarnation(u128::from_le_bytes(*inc)), DataKeys { send: *send_key, recv: recv_key }))
        })();
        let mut v = Vec::new();
        match &verdict {
            Ok(_) => v.push(0u8),
            Err(reason) => {
                v.push(1);
                let mut cut = reason.len().min(MAX_VERDICT - 1);
                while !reason.is_char_boundary(cut) {
                    cut -= 1;
                }
                v.extend_from_slice(&reason.as_bytes()[..cut]);
            }
        }
        ch.send(&v, "sending our verdict")?;
        let theirs_v = ch.recv(MAX_VERDICT, "in the verdict")?;
        let theirs_ok = match theirs_v.split_first() {
            Some((0, _)) => Ok(()),
            Some((_, reason)) => Err(format!("the peer refused: {}", String::from_utf8_lossy(reason))),
            None => Err("the peer's verdict is empty".to_owned()),
        };
        let (hs, incarnation, keys) = verdict.map_err(refused)?;
        theirs_ok.map_err(refused)?;
        let Channel { noise, opener, .. } = ch;

        // 5. The connection: within the limits (again: another handshake may have finished since
        // the verdict), then the engine, then the I/O thread.
        this.room_for(&PeerAddr { engine: hs.engine_id.clone(), rank: hs.layout.parallel.rank() }, ip)?;
        let known = lock(&this.conns)
            .get(&PeerAddr { engine: hs.engine_id.clone(), rank: hs.layout.parallel.rank() })
            .map(|c| c.incarnation);
        let id = ConnId(this.next_conn.fetch_add(1, Ordering::Relaxed));
        let peer = endpoint.add_peer(&hs, incarnation, id, keys).map_err(|e| refused(e.to_string()))?;
        if known.is_some_and(|k| k != incarnation) {
            this.counters.restarts.fetch_add(1, Ordering::Relaxed);
        }
        this.counters.handshakes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(me = %me, %peer, via = %name, %incarnation, conn = id.0, "side channel connected");
        if let Err(e) = Inner::start(this, stream, peer.clone(), incarnation, id, noise, opener) {
            // The engine knows the peer by this connection, which never ran: it is lost.
            let _ = endpoint.peer_lost(&peer, incarnation, id, &e.to_string());
            return Err(e);
        }
        Ok(peer)
    }

    /// Hands an established connection to the I/O thread.
    fn start(
        this: &Arc<Inner>,
        stream: TcpStream,
        peer: PeerAddr,
        incarnation: Incarnation,
        id: ConnId,
        noise: Mutex<TransportState>,
        opener: Opener,
    ) -> Result<(), SideError> {
        stream.set_nonblocking(true).map_err(io("making the socket non-blocking"))?;
        let conn = Arc::new(Conn {
            peer: peer.clone(),
            ip: stream.peer_addr().map_err(io("reading the peer's address"))?.ip(),
            incarnation,
            id,
            stream: Socket(ManuallyDrop::new(stream)),
            fd_gone: AtomicBool::new(false),
            noise,
            out: Mutex::new(Outbound::new()),
            inbound: Mutex::new(Inbound { opener, msg: Vec::new(), parked: None }),
            closed: AtomicBool::new(false),
        });
        if let Some(old) = lock(&this.conns).insert(peer, conn) {
            // The peer reconnected (or restarted: the engine has already failed its old state): the
            // old connection is over. Marked closed first, it is not reported lost: the engine
            // knows the peer by the new connection already.
            old.closed.store(true, Ordering::SeqCst);
            old.shut();
        }
        this.wake_io();
        Ok(())
    }

    /// Makes the I/O thread look at its connections again.
    fn wake_io(&self) {
        // A full socket pair already holds a wake-up: nothing is lost by ignoring the error.
        let _ = (&self.wake).write(&[1]);
    }

    /// Closes `conn` and reports its peer lost, once, and only if it is still the peer's connection
    /// (the engine then decides whether the peer is lost: it is not if the same incarnation has
    /// handshaken again over a connection not yet started here).
    fn lost(this: &Arc<Inner>, conn: &Arc<Conn>, reason: &str) {
        if conn.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        conn.shut();
        let current = {
            let mut conns = lock(&this.conns);
            let is_current = conns.get(&conn.peer).is_some_and(|c| Arc::ptr_eq(c, conn));
            if is_current {
                conns.remove(&conn.peer);
            }
            is_current
        };
        if current && !this.shutdown.load(Ordering::SeqCst) {
            let lost = this.endpoint().map_or(true, |ep| ep.peer_lost(&conn.peer, conn.incarnation, conn.id, reason));
            if lost {
                this.counters.peers_lost.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer = %conn.peer, conn = conn.id.0, %reason, "side-channel peer lost");
            } else {
                tracing::info!(peer = %conn.peer, conn = conn.id.0, %reason, "side-channel connection closed; the peer reconnected");
            }
        }
    }
}

/// The name of the accept thread of the side channel listening on `port` (at most 15 bytes).
pub fn accept_thread_name(port: u16) -> String {
    format!("kvside-ac-{port}")
}

/// The name of the I/O thread of the side channel listening on `port` (at most 15 bytes).
pub fn io_thread_name(port: u16) -> String {
    format!("kvside-io-{port}")
}

/// Frames one connection may deliver per turn of the I/O thread before the others get theirs.
const FRAMES_PER_TURN: usize = 64;
/// How often a connection whose frame waits for room in the engine's budget tries again.
const PARKED_RETRY: Duration = Duration::from_millis(1);

/// The I/O thread: one `poll(2)` over every established connection (and the wake-up socket).
/// It reads and opens records and delivers frames, writes what senders left queued, sends
/// heartbeats on idle connections and closes connections that fail or fall silent. It never blocks
/// but in `poll`: a frame the engine has no room for is parked on its connection, which is then not
/// read until the frame is taken (or the engine's wait runs out and the connection is closed).
fn io_loop(inner: &Weak<Inner>, woken: &UnixStream) {
    let mut conns: Vec<Arc<Conn>> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        let timeout = {
            let Some(this) = inner.upgrade() else { return };
            if this.shutdown.load(Ordering::SeqCst) {
                return;
            }
            conns.clear();
            conns.extend(lock(&this.conns).values().cloned());
            fds.clear();
            fds.push(libc::pollfd { fd: woken.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            let now = Instant::now();
            let mut timeout = this.config.heartbeat;
            for c in &conns {
                let (parked, buffered) = {
                    let inb = lock(&c.inbound);
                    (inb.parked.is_some(), inb.opener.has_record())
                };
                let (pending, heartbeat_at) = {
                    let out = lock(&c.out);
                    (out.pending() > 0 || out.failed.is_some(), out.last_sent + this.config.heartbeat)
                };
                let mut events = 0;
                if buffered && !parked {
                    // A whole record already read (its turn ended at FRAMES_PER_TURN): no new byte
                    // may come to make the socket readable.
                    timeout = Duration::ZERO;
                }
                if !parked {
                    events |= libc::POLLIN;
                    let silent_at = lock(&c.inbound).opener.last_record + this.config.peer_timeout;
                    timeout = timeout.min(silent_at.saturating_duration_since(now));
                } else {
                    timeout = timeout.min(PARKED_RETRY);
                }
                if pending {
                    // Writable is what it waits for; a heartbeat goes only after the queue.
                    events |= libc::POLLOUT;
                } else {
                    timeout = timeout.min(heartbeat_at.saturating_duration_since(now));
                }
                fds.push(libc::pollfd { fd: c.stream.as_raw_fd(), events, revents: 0 });
            }
            timeout
        };
        // Whole milliseconds, rounded up: a deadline is never polled for before it is due.
        let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfd structs, each
        // with a descriptor owned by `woken` or by a connection in `conns`, which hold them open
        // for the call; poll(2) writes only their `revents`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "side-channel poll failed");
                std::thread::sleep(PARKED_RETRY);
            }
            continue;
        }
        if fds[0].revents != 0 {
            let mut sink = [0u8; 64];
            while matches!((&*woken).read(&mut sink), Ok(n) if n > 0) {}
        }
        let Some(this) = inner.upgrade() else { return };
        for (c, fd) in conns.iter().zip(&fds[1..]) {
            if c.closed.load(Ordering::SeqCst) {
                continue;
            }
            if fd.revents & libc::POLLNVAL != 0 {
                // Polled again, it would answer POLLNVAL at once, for ever: a spinning thread, and a
                // peer that hears nothing until it declares us silent.
                c.fd_gone.store(true, Ordering::SeqCst);
                tracing::error!(
                    peer = %c.peer,
                    conn = c.id.0,
                    fd = fd.fd,
                    "side-channel descriptor closed under the I/O thread by other code in this process (POLLNVAL); \
                     the connection is lost and its number left alone"
                );
                Inner::lost(&this, c, "descriptor closed by other code in this process (POLLNVAL)");
                continue;
            }
            service(&this, c, fd.revents);
        }
    }
}

/// One connection's turn on the I/O thread.
fn service(this: &Arc<Inner>, c: &Arc<Conn>, revents: libc::c_short) {
    // Writes first: a sender's failure, then what senders left queued, then a heartbeat if idle.
    let written = {
        let mut out = lock(&c.out);
        match out.failed.take() {
            Some(reason) => Err(reason),
            None => {
                let mut r = out.flush(&c.stream).map_err(|e| format!("write failed: {e}"));
                if r.is_ok() && out.pending() == 0 && out.last_sent.elapsed() >= this.config.heartbeat {
                    out.heartbeat_seq += 1;
                    let hb = Message::Heartbeat(Heartbeat { seq: out.heartbeat_seq });
                    r = codec::to_vec(&hb)
                        .map_err(|e| format!("cannot encode a heartbeat: {e}"))
                        .and_then(|f| out.seal(&c.noise, &f).map_err(|e| format!("cannot encrypt a frame: {e}")))
                        .and_then(|()| out.flush(&c.stream).map_err(|e| format!("write failed: {e}")));
                    if r.is_ok() {
                        this.counters.frames_out.fetch_add(1, Ordering::Relaxed);
                    }
                }
                r
            }
        }
    };
    if let Err(reason) = written {
        Inner::lost(this, c, &reason);
        return;
    }
    let mut inb = lock(&c.inbound);
    let readable = revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 || inb.opener.has_record();
    if (readable || inb.parked.is_some()) && !receive(this, c, &mut inb) {
        return;
    }
    if inb.parked.is_none() {
        let silent = inb.opener.last_record.elapsed();
        if silent > this.config.peer_timeout {
            drop(inb);
            Inner::lost(this, c, &format!("silent for {silent:?}"));
        }
    }
}

/// Hands `frame` to the engine: `Ok(true)` taken, `Ok(false)` no room yet (the caller parks it),
/// `Err` the connection is to be closed for this reason (counted).
fn hand_over(this: &Arc<Inner>, c: &Conn, frame: &[u8], waiting_since: Instant) -> Result<bool, String> {
    let ep = this.endpoint().map_err(|e| e.to_string())?;
    match ep.deliver(&c.peer, c.incarnation, frame) {
        Ok(()) => Ok(true),
        Err(EngineError::Overloaded { .. }) if waiting_since.elapsed() < ep.control_wait() => Ok(false),
        Err(e) => {
            // Still no room after the engine's wait: the peer sends faster than this engine works.
            let counter = match e {
                EngineError::Overloaded { .. } => &this.counters.over_limit,
                _ => &this.counters.malformed,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %c.peer, error = %e, "frame refused; closing the connection");
            Err(format!("malformed frame: {e}"))
        }
    }
}

/// Reads and delivers what `c` has (a parked frame first), up to [`FRAMES_PER_TURN`] frames;
/// `false` if the connection was closed.
fn receive(this: &Arc<Inner>, c: &Arc<Conn>, inb: &mut Inbound) -> bool {
    let close = |reason: &str| {
        Inner::lost(this, c, reason);
        false
    };
    if let Some((frame, since)) = inb.parked.take() {
        if let Some(open) = offer(this, c, inb, frame, since) {
            return open;
        }
    }
    let peer_name = c.peer.to_string();
    let mut frames = 0;
    while frames < FRAMES_PER_TURN {
        match inb.opener.open_buffered(&c.noise, &mut inb.msg, &peer_name) {
            Ok(true) => {}
            Ok(false) => match inb.opener.fill(&mut &c.stream) {
                Ok(0) => return close("connection closed"),
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return close(&format!("read failed: {e}")),
            },
            Err(e) => {
                let e = this.counters.count(e);
                tracing::warn!(peer = %peer_name, error = %e, "side-channel record refused; closing the connection");
                return close(&e.to_string());
            }
        }
        let frame = std::mem::take(&mut inb.msg);
        frames += 1;
        this.counters.frames_in.fetch_add(1, Ordering::Relaxed);
        if frame.len() > 4 && frame[4] == codec::Kind::Heartbeat as u8 {
            continue;
        }
        if let Some(open) = offer(this, c, inb, frame, Instant::now()) {
            return open;
        }
    }
    true
}

/// Offers `frame` (waiting for room since `since`) to the engine: `None` if it was taken, else what
/// [`receive`] returns (`true`: parked, `false`: the connection was closed).
fn offer(this: &Arc<Inner>, c: &Arc<Conn>, inb: &mut Inbound, frame: Vec<u8>, since: Instant) -> Option<bool> {
    match hand_over(this, c, &frame, since) {
        Ok(true) => {
            // Time spent waiting for the engine (backpressure) is not the peer's silence.
            inb.opener.last_record = Instant::now();
            None
        }
        Ok(false) => {
            inb.parked = Some((frame, since));
            Some(true)
        }
        Err(reason) => {
            Inner::lost(this, c, &reason);
            Some(false)
        }
    }
}

/// One authenticated session over a loopback TCP connection, for measuring what the channel costs
/// per frame (`benches/side_channel.rs`): the real Noise handshake with a pre-shared key, then frames
/// sealed and written as a connection's writer thread does, read and opened as its reader thread
/// does, both ends on the calling thread. Not a way to talk to peers.
#[doc(hidden)]
pub struct LoopbackSession {
    tx: TcpStream,
    tx_noise: Mutex<TransportState>,
    out: Outbound,
    rx: TcpStream,
    rx_noise: Mutex<TransportState>,
    opener: Opener,
    msg: Vec<u8>,
}

impl fmt::Debug for LoopbackSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackSession").finish_non_exhaustive()
    }
}

impl LoopbackSession {
    /// Connects two sockets on loopback and runs the handshake between them with `secret`.
    pub fn new(secret: &[u8]) -> Result<LoopbackSession, SideError> {
        let timeout = Duration::from_secs(10);
        let listener = TcpListener::bind("127.0.0.1:0").map_err(io("listening on loopback"))?;
        let addr = listener.local_addr().map_err(io("reading the listening address"))?;
        let mut tx = TcpStream::connect(addr).map_err(io("connecting on loopback"))?;
        let (rx, _) = listener.accept().map_err(io("accepting on loopback"))?;
        for s in [&tx, &rx] {
            s.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
        }
        let auth = Auth::from_secret(secret);
        let (listener_auth, deadline) = (auth.clone(), Instant::now() + timeout);
        let responder = std::thread::spawn(move || {
            let mut rx = rx;
            let mut wire = Wire { stream: &mut rx, deadline, timeout, peer: "the bench's dialer" };
            listener_auth.authenticate(&mut wire, Role::Listener, PROLOGUE_LABEL).map(|n| (rx, n))
        });
        let mut wire = Wire { stream: &mut tx, deadline, timeout, peer: "the bench's listener" };
        let tx_noise = auth.authenticate(&mut wire, Role::Dialer, PROLOGUE_LABEL)?;
        let (rx, rx_noise) = responder.join().map_err(|_| SideError::Closed)??;
        Ok(LoopbackSession {
            tx,
            tx_noise: Mutex::new(tx_noise),
            out: Outbound::new(),
            rx,
            rx_noise: Mutex::new(rx_noise),
            opener: Opener::new(),
            msg: Vec::new(),
        })
    }

    /// Seals `frame` and writes it to the dialer's socket, as a sender does on a connection.
    pub fn send(&mut self, frame: &[u8]) -> Result<(), SideError> {
        let detail = |e: String| SideError::Protocol { peer: "the bench's listener".into(), detail: e };
        self.out.seal(&self.tx_noise, frame).map_err(|e| detail(format!("cannot encrypt a frame: {e}")))?;
        self.out.flush(&self.tx).map_err(io("writing a frame"))
    }

    /// Reads the next message on the listener's socket, verifies and decrypts it.
    pub fn recv(&mut self) -> Result<&[u8], SideError> {
        self.msg.clear();
        while !self.opener.open_buffered(&self.rx_noise, &mut self.msg, "the bench's dialer")? {
            if self.opener.fill(&mut self.rx).map_err(io("reading a record"))? == 0 {
                return Err(SideError::Io {
                    what: "reading a record".into(),
                    source: std::io::ErrorKind::UnexpectedEof.into(),
                });
            }
        }
        Ok(&self.msg)
    }
}
