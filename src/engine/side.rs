//! The side channel: TCP connections between workers of different engines, carrying the handshake
//! and then the control frames (registrations, failures, aborts, pull grants, heartbeats).
//!
//! Read [`SideChannel`]. Each worker listens on one TCP port (default 5600 + TP rank); a consumer
//! worker dials each producer worker it needs ([`SideChannel::connect`], called off the engine loop).
//! A connection starts with a handshake, the same on both ends:
//!
//! ```text
//! both send   "KVPSIDE1" + 16-byte random nonce
//! both send   Handshake frame (proto codec) + 1 byte "secret in use" + 32-byte HMAC-SHA256(secret,
//!             "kvpush-side-v1" | sender nonce | receiver nonce | frame)       (zeros without a secret)
//! both check  the MAC (a configured secret must be proven by the peer) and proto's compatibility check
//! both send   verdict: 0 = accepted, or 1 + the reason (u32 length + UTF-8), and read the peer's
//! ```
//!
//! so a refusal (mode, model, secret) is reported on both sides with the same reason. A stranger
//! without the secret can neither handshake nor, therefore, register for a transfer: frames are only
//! accepted on handshaken connections. After the handshake each connection has a reader thread (one
//! frame at a time, size-limited by the codec's header; a malformed frame closes the connection and
//! is counted) and a writer thread (queued frames, and a heartbeat when idle). A peer that closes,
//! errs or stays silent past the peer timeout is lost: the engine fails everything in flight with it.
//! A restarted peer simply connects and handshakes again.

use std::collections::HashMap;
use std::fmt;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, RecvTimeoutError, Sender};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::link::{ControlLink, LinkError, PeerAddr};
use super::EngineError;
use crate::proto::codec::{self, frame_len, HEADER_LEN};
use crate::proto::compat;
use crate::proto::msg::{Handshake, Heartbeat, Message};
use crate::sync::lock;

const MAGIC: &[u8; 8] = b"KVPSIDE1";
const MAC_LABEL: &[u8] = b"kvpush-side-v1";
/// Longest refusal reason accepted from a peer.
const MAX_REASON: usize = 64 * 1024;

/// What the side channel needs from the engine it serves.
pub trait Endpoint: Send + Sync {
    /// This worker's address.
    fn me(&self) -> PeerAddr;
    /// This worker's handshake.
    fn local_handshake(&self) -> Result<Handshake, EngineError>;
    /// Accepts a peer whose handshake passed the checks (loads its transport metadata).
    fn add_peer(&self, peer: &Handshake) -> Result<PeerAddr, EngineError>;
    /// Takes one control frame from a handshaken peer.
    fn deliver(&self, from: &PeerAddr, frame: &[u8]) -> Result<(), EngineError>;
    /// A peer went away: fail what is in flight with it.
    fn peer_lost(&self, peer: &PeerAddr, reason: &str);
}

/// Side-channel configuration.
#[derive(Clone)]
pub struct SideConfig {
    /// Address to listen on (default `0.0.0.0:5600`; add the TP rank to the port per worker).
    pub listen: String,
    /// Shared secret peers must prove (HMAC over the handshake). `None`: no authentication.
    pub secret: Option<Vec<u8>>,
    /// Heartbeat interval on idle connections.
    pub heartbeat: Duration,
    /// A peer silent for this long is lost.
    pub peer_timeout: Duration,
    /// Limit for connecting and for the handshake.
    pub handshake_timeout: Duration,
}

impl fmt::Debug for SideConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SideConfig")
            .field("listen", &self.listen)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("heartbeat", &self.heartbeat)
            .field("peer_timeout", &self.peer_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish()
    }
}

impl SideConfig {
    /// Defaults for TP rank `rank`: port 5600 + rank on all interfaces, heartbeat 1 s, peer lost
    /// after 5 s of silence.
    pub fn for_rank(rank: u16) -> Self {
        Self {
            listen: format!("0.0.0.0:{}", 5600 + u32::from(rank)),
            secret: None,
            heartbeat: Duration::from_secs(1),
            peer_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(10),
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
    /// Handshakes refused (either side).
    pub refused: u64,
    /// Frames received.
    pub frames_in: u64,
    /// Frames sent.
    pub frames_out: u64,
    /// Malformed frames (each closed its connection).
    pub malformed: u64,
    /// Peers lost (closed, failed or silent).
    pub peers_lost: u64,
}

#[derive(Default)]
struct Counters {
    handshakes: AtomicU64,
    refused: AtomicU64,
    frames_in: AtomicU64,
    frames_out: AtomicU64,
    malformed: AtomicU64,
    peers_lost: AtomicU64,
}

/// One handshaken connection.
struct Conn {
    peer: PeerAddr,
    tx: Sender<Vec<u8>>,
    stream: TcpStream,
    closed: AtomicBool,
}

struct Inner {
    config: SideConfig,
    endpoint: RwLock<Option<Weak<dyn Endpoint>>>,
    local: SocketAddr,
    conns: Mutex<HashMap<PeerAddr, Arc<Conn>>>,
    counters: Counters,
    shutdown: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
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

fn nonce() -> Result<[u8; 16], SideError> {
    let mut n = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut n)).map_err(io("reading /dev/urandom"))?;
    Ok(n)
}

fn mac(secret: &[u8], sender: &[u8; 16], receiver: &[u8; 16], frame: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(MAC_LABEL);
    m.update(sender);
    m.update(receiver);
    m.update(frame);
    m
}

fn read_frame(stream: &mut TcpStream, peer: &str) -> Result<Vec<u8>, SideError> {
    let mut buf = vec![0u8; HEADER_LEN];
    stream.read_exact(&mut buf).map_err(io(format!("reading a frame header from {peer}")))?;
    let total = frame_len(&buf)
        .map_err(|e| SideError::Protocol { peer: peer.to_owned(), detail: e.to_string() })?
        .unwrap_or(HEADER_LEN);
    buf.resize(total, 0);
    stream.read_exact(&mut buf[HEADER_LEN..]).map_err(io(format!("reading a frame from {peer}")))?;
    Ok(buf)
}

impl SideChannel {
    /// Binds the listener (it accepts once [`SideChannel::serve`] gave it an endpoint).
    pub fn bind(config: SideConfig) -> Result<SideChannel, SideError> {
        let listener = TcpListener::bind(&config.listen).map_err(io(format!("listening on {}", config.listen)))?;
        let local = listener.local_addr().map_err(io("reading the listening address"))?;
        let inner = Arc::new(Inner {
            config,
            endpoint: RwLock::new(None),
            local,
            conns: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            shutdown: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
        });
        let weak = Arc::downgrade(&inner);
        let accept = std::thread::Builder::new()
            .name(format!("kvpush-side-accept-{}", local.port()))
            .spawn(move || accept_loop(listener, weak))
            .map_err(io("starting the accept thread"))?;
        lock(&inner.threads).push(accept);
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

    /// Dials a peer worker and handshakes; returns its address once both sides accepted. Blocks up to
    /// the handshake timeout: call it off the engine loop.
    pub fn connect(&self, addr: impl ToSocketAddrs + fmt::Display) -> Result<PeerAddr, SideError> {
        let name = addr.to_string();
        let target = addr
            .to_socket_addrs()
            .map_err(io(format!("resolving {name}")))?
            .next()
            .ok_or_else(|| SideError::Protocol { peer: name.clone(), detail: "resolves to no address".into() })?;
        let stream = TcpStream::connect_timeout(&target, self.inner.config.handshake_timeout)
            .map_err(io(format!("connecting to {name}")))?;
        Inner::establish(&self.inner, stream, &name)
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

    /// Counters so far.
    pub fn stats(&self) -> SideStats {
        let c = &self.inner.counters;
        SideStats {
            handshakes: c.handshakes.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            frames_in: c.frames_in.load(Ordering::Relaxed),
            frames_out: c.frames_out.load(Ordering::Relaxed),
            malformed: c.malformed.load(Ordering::Relaxed),
            peers_lost: c.peers_lost.load(Ordering::Relaxed),
        }
    }
}

impl Drop for SideChannel {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.inner.local, Duration::from_millis(200));
        let conns: Vec<Arc<Conn>> = lock(&self.inner.conns).drain().map(|(_, c)| c).collect();
        for c in conns {
            c.closed.store(true, Ordering::SeqCst);
            let _ = c.stream.shutdown(Shutdown::Both);
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
        conn.tx.send(frame).map_err(|_| LinkError::Closed(to.clone()))
    }
}

fn accept_loop(listener: TcpListener, inner: Weak<Inner>) {
    for stream in listener.incoming() {
        let Some(inner) = inner.upgrade() else { return };
        if inner.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "unknown".into());
        // Handshakes run on their own thread: a slow or hostile peer cannot stall the listener.
        let weak = Arc::downgrade(&inner);
        let spawned = std::thread::Builder::new().name("kvpush-side-handshake".into()).spawn(move || {
            if let Some(inner) = weak.upgrade() {
                if let Err(e) = Inner::establish(&inner, stream, &peer) {
                    tracing::warn!(%peer, error = %e, "side-channel handshake failed");
                }
            }
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a handshake thread");
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

    /// Handshakes on `stream` and, if both sides accept, starts the connection's threads.
    fn establish(this: &Arc<Inner>, mut stream: TcpStream, name: &str) -> Result<PeerAddr, SideError> {
        let endpoint = this.endpoint()?;
        let limit = Some(this.config.handshake_timeout);
        stream.set_read_timeout(limit).map_err(io("setting a timeout"))?;
        stream.set_write_timeout(limit).map_err(io("setting a timeout"))?;
        stream.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
        let refused = |reason: String| SideError::Refused { peer: name.to_owned(), reason };
        let count_refusal = |e: SideError| {
            if matches!(e, SideError::Refused { .. }) {
                this.counters.refused.fetch_add(1, Ordering::Relaxed);
            }
            e
        };

        // 1. Nonces.
        let mine = nonce()?;
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&mine);
        stream.write_all(&hello).map_err(io(format!("greeting {name}")))?;
        let mut theirs_hello = [0u8; 24];
        stream.read_exact(&mut theirs_hello).map_err(io(format!("reading the greeting of {name}")))?;
        if &theirs_hello[..8] != MAGIC {
            return Err(SideError::Protocol { peer: name.to_owned(), detail: "bad greeting".into() });
        }
        let mut theirs = [0u8; 16];
        theirs.copy_from_slice(&theirs_hello[8..]);

        // 2. Handshakes with their MACs.
        let local = endpoint.local_handshake().map_err(|e| refused(e.to_string()))?;
        let frame = codec::to_vec(&Message::Handshake(Box::new(local.clone())))
            .map_err(|e| refused(format!("cannot encode our handshake: {e}")))?;
        let secret = this.config.secret.as_deref();
        let tag: [u8; 32] = match secret {
            Some(s) => mac(s, &mine, &theirs, &frame).finalize().into_bytes().into(),
            None => [0; 32],
        };
        let mut out = frame;
        out.push(u8::from(secret.is_some()));
        out.extend_from_slice(&tag);
        stream.write_all(&out).map_err(io(format!("sending our handshake to {name}")))?;
        let peer_frame = read_frame(&mut stream, name)?;
        let mut trailer = [0u8; 33];
        stream.read_exact(&mut trailer).map_err(io(format!("reading the handshake of {name}")))?;

        // 3. Verdict: authentication, decoding, compatibility.
        let verdict: Result<Handshake, String> = (|| {
            match (secret, trailer[0]) {
                (Some(s), 1) => mac(s, &theirs, &mine, &peer_frame)
                    .verify_slice(&trailer[1..])
                    .map_err(|_| "the peer's handshake MAC does not match: the shared secrets differ".to_string())?,
                (Some(_), _) => return Err("this side requires a shared secret and the peer proved none".into()),
                (None, 1) => return Err("the peer requires a shared secret and this side has none configured".into()),
                (None, _) => {}
            }
            let hs = match codec::decode(&peer_frame, None) {
                Ok(Message::Handshake(h)) => *h,
                Ok(_) => return Err("the peer sent another message instead of its handshake".into()),
                Err(e) => return Err(format!("the peer's handshake is malformed: {e}")),
            };
            compat::check(&local, &hs).map_err(|e| e.to_string())?;
            Ok(hs)
        })();
        let mut v = Vec::new();
        match &verdict {
            Ok(_) => v.push(0u8),
            Err(reason) => {
                v.push(1);
                v.extend_from_slice(&(reason.len() as u32).to_le_bytes());
                v.extend_from_slice(reason.as_bytes());
            }
        }
        stream.write_all(&v).map_err(io(format!("sending our verdict to {name}")))?;
        let mut head = [0u8; 1];
        stream.read_exact(&mut head).map_err(io(format!("reading the verdict of {name}")))?;
        let theirs_ok = if head[0] == 0 {
            Ok(())
        } else {
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).map_err(io(format!("reading the verdict of {name}")))?;
            let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON);
            let mut reason = vec![0u8; len];
            stream.read_exact(&mut reason).map_err(io(format!("reading the verdict of {name}")))?;
            Err(format!("the peer refused: {}", String::from_utf8_lossy(&reason)))
        };
        let hs = verdict.map_err(refused).map_err(count_refusal)?;
        theirs_ok.map_err(refused).map_err(count_refusal)?;
        let peer = endpoint.add_peer(&hs).map_err(|e| refused(e.to_string())).map_err(count_refusal)?;
        this.counters.handshakes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(me = %endpoint.me(), %peer, via = %name, "side channel connected");

        // 4. The connection's threads.
        stream.set_read_timeout(Some(this.config.heartbeat)).map_err(io("setting a timeout"))?;
        stream.set_write_timeout(Some(this.config.peer_timeout)).map_err(io("setting a timeout"))?;
        let (tx, rx) = unbounded::<Vec<u8>>();
        let conn = Arc::new(Conn {
            peer: peer.clone(),
            tx,
            stream: stream.try_clone().map_err(io("cloning the socket"))?,
            closed: AtomicBool::new(false),
        });
        if let Some(old) = lock(&this.conns).insert(peer.clone(), Arc::clone(&conn)) {
            // The peer restarted (or reconnected): the old connection is over.
            old.closed.store(true, Ordering::SeqCst);
            let _ = old.stream.shutdown(Shutdown::Both);
        }
        let mut writer = stream.try_clone().map_err(io("cloning the socket"))?;
        let (w_inner, w_conn) = (Arc::downgrade(this), Arc::clone(&conn));
        let heartbeat = this.config.heartbeat;
        let wt = std::thread::Builder::new().name("kvpush-side-tx".into()).spawn(move || {
            let mut seq = 0u64;
            loop {
                let waited_from = Instant::now();
                let frame = match rx.recv_timeout(heartbeat) {
                    Ok(f) => f,
                    Err(RecvTimeoutError::Timeout) => {
                        // A heartbeat due after `heartbeat` that comes much later means this process
                        // was not scheduled: the peer may be about to call us lost. Say so here, where
                        // the cause is.
                        let late = waited_from.elapsed();
                        if late > heartbeat * 2 + Duration::from_millis(500) {
                            tracing::warn!(peer = %w_conn.peer, waited = ?late, "side-channel heartbeat late: this process was not scheduled (host overloaded or paused?)");
                        }
                        seq += 1;
                        match codec::to_vec(&Message::Heartbeat(Heartbeat { seq })) {
                            Ok(f) => f,
                            Err(_) => continue,
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                };
                if w_conn.closed.load(Ordering::SeqCst) {
                    return;
                }
                let sending_from = Instant::now();
                if let Err(e) = writer.write_all(&frame) {
                    if let Some(inner) = w_inner.upgrade() {
                        Inner::lost(&inner, &w_conn, &format!("write failed: {e}"));
                    }
                    return;
                }
                let took = sending_from.elapsed();
                if took > heartbeat {
                    tracing::warn!(peer = %w_conn.peer, ?took, bytes = frame.len(), "side-channel write slow: the peer is not reading");
                }
                if let Some(inner) = w_inner.upgrade() {
                    inner.counters.frames_out.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let (r_inner, r_conn) = (Arc::downgrade(this), Arc::clone(&conn));
        let rt =
            std::thread::Builder::new().name("kvpush-side-rx".into()).spawn(move || read_loop(stream, r_inner, r_conn));
        let mut threads = lock(&this.threads);
        threads.retain(|t| !t.is_finished());
        for t in [wt, rt] {
            threads.push(t.map_err(io("starting connection threads"))?);
        }
        Ok(peer)
    }

    /// Closes `conn` and reports its peer lost, once, and only if it is still the peer's connection.
    fn lost(this: &Arc<Inner>, conn: &Arc<Conn>, reason: &str) {
        if conn.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = conn.stream.shutdown(Shutdown::Both);
        let current = {
            let mut conns = lock(&this.conns);
            let is_current = conns.get(&conn.peer).is_some_and(|c| Arc::ptr_eq(c, conn));
            if is_current {
                conns.remove(&conn.peer);
            }
            is_current
        };
        if current && !this.shutdown.load(Ordering::SeqCst) {
            this.counters.peers_lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %conn.peer, %reason, "side-channel peer lost");
            if let Ok(ep) = this.endpoint() {
                ep.peer_lost(&conn.peer, reason);
            }
        }
    }
}

fn read_loop(mut stream: TcpStream, inner: Weak<Inner>, conn: Arc<Conn>) {
    let mut last_seen = Instant::now();
    let mut buf = vec![0u8; HEADER_LEN];
    let peer_name = conn.peer.to_string();
    loop {
        let Some(this) = inner.upgrade() else { return };
        if conn.closed.load(Ordering::SeqCst) {
            return;
        }
        let timeout = this.config.peer_timeout;
        buf.resize(HEADER_LEN, 0);
        match read_exact_or_timeout(&mut stream, &mut buf[..HEADER_LEN]) {
            Ok(true) => {}
            Ok(false) => {
                if last_seen.elapsed() > timeout {
                    Inner::lost(&this, &conn, &format!("silent for {:?}", last_seen.elapsed()));
                    return;
                }
                continue;
            }
            Err(e) => {
                Inner::lost(&this, &conn, &format!("read failed: {e}"));
                return;
            }
        }
        let total = match frame_len(&buf) {
            Ok(Some(n)) => n,
            Ok(None) | Err(_) => {
                this.counters.malformed.fetch_add(1, Ordering::Relaxed);
                Inner::lost(&this, &conn, "malformed frame header");
                return;
            }
        };
        buf.resize(total, 0);
        if let Err(e) = read_body(&mut stream, &mut buf[HEADER_LEN..], timeout) {
            Inner::lost(&this, &conn, &format!("read failed: {e}"));
            return;
        }
        last_seen = Instant::now();
        this.counters.frames_in.fetch_add(1, Ordering::Relaxed);
        if buf[4] == codec::Kind::Heartbeat as u8 {
            continue;
        }
        let Ok(ep) = this.endpoint() else { return };
        if let Err(e) = ep.deliver(&conn.peer, &buf) {
            this.counters.malformed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %peer_name, error = %e, "frame refused; closing the connection");
            Inner::lost(&this, &conn, &format!("malformed frame: {e}"));
            return;
        }
    }
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` if the read timed out before the first byte.
fn read_exact_or_timeout(stream: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed")),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if got == 0 {
                    return Ok(false);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads the rest of a frame, giving up after `limit` without progress.
fn read_body(stream: &mut TcpStream, buf: &mut [u8], limit: Duration) -> std::io::Result<()> {
    let mut got = 0;
    let mut since = Instant::now();
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed")),
            Ok(n) => {
                got += n;
                since = Instant::now();
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if since.elapsed() > limit {
                    return Err(e);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
