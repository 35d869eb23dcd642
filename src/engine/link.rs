//! The control link: how engines send protocol frames (registrations, failures, aborts, pull
//! grants) to each other's workers.
//!
//! [`ControlLink`] is the sending half; the receiving half is [`super::Engine::handle_frame`], which
//! whoever receives a frame calls. [`LocalHub`] connects engines in one process (the demo and the
//! tests); the TCP side channel connects engines in different processes. Completion notifications
//! do not use the link: they ride on the transport's WRITE, so they arrive after the data.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, RwLock, Weak};

use crate::proto::Rank;

/// A worker of an engine: the address of a control-link endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerAddr {
    /// Engine id.
    pub engine: String,
    /// Worker rank in that engine.
    pub rank: Rank,
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.engine, self.rank)
    }
}

/// Why a frame could not be sent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// No endpoint with that address is attached or connected.
    #[error("no control link to {0}")]
    UnknownPeer(PeerAddr),
    /// The connection to the peer is closed.
    #[error("control link to {0} is closed")]
    Closed(PeerAddr),
    /// The peer's send queue is full (it does not read fast enough); the frame was not queued.
    #[error("control link to {peer} is full: {what}")]
    Full {
        /// The peer.
        peer: PeerAddr,
        /// Which limit.
        what: String,
    },
    /// The peer's engine refused the frame (an in-process link hands back the peer's error).
    #[error("control link to {peer}: the peer refused the frame")]
    Refused {
        /// The peer.
        peer: PeerAddr,
        /// The peer engine's error.
        #[source]
        source: Box<super::EngineError>,
    },
}

/// The sending half of a control link.
pub trait ControlLink: Send + Sync + fmt::Debug {
    /// Sends one encoded frame from worker `from` to worker `to`. Must not block on the network for
    /// long (implementations queue).
    fn send(&self, from: &PeerAddr, to: &PeerAddr, frame: Vec<u8>) -> Result<(), LinkError>;
}

/// Receives frames for one attached worker (implemented by the engine).
pub trait FrameSink: Send + Sync {
    /// Takes one frame sent by `from`.
    fn deliver(&self, from: &PeerAddr, frame: &[u8]) -> Result<(), super::EngineError>;
}

/// In-process control link: engines attach their workers and frames are handed over directly.
#[derive(Default)]
pub struct LocalHub {
    sinks: RwLock<HashMap<PeerAddr, Weak<dyn FrameSink>>>,
}

impl fmt::Debug for LocalHub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.sinks.read().map(|s| s.len()).unwrap_or(0);
        f.debug_struct("LocalHub").field("attached", &n).finish()
    }
}

impl LocalHub {
    /// An empty hub.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Attaches a worker so frames addressed to `addr` reach `sink` (held weakly: a dropped engine
    /// simply becomes unreachable).
    pub fn attach(&self, addr: PeerAddr, sink: Weak<dyn FrameSink>) {
        self.sinks.write().unwrap_or_else(|p| p.into_inner()).insert(addr, sink);
    }

    /// Detaches a worker (it went away).
    pub fn detach(&self, addr: &PeerAddr) {
        self.sinks.write().unwrap_or_else(|p| p.into_inner()).remove(addr);
    }
}

impl ControlLink for LocalHub {
    fn send(&self, from: &PeerAddr, to: &PeerAddr, frame: Vec<u8>) -> Result<(), LinkError> {
        let sink = self.sinks.read().unwrap_or_else(|p| p.into_inner()).get(to).and_then(Weak::upgrade);
        let sink = sink.ok_or_else(|| LinkError::UnknownPeer(to.clone()))?;
        sink.deliver(from, &frame).map_err(|e| LinkError::Refused { peer: to.clone(), source: Box::new(e) })
    }
}
