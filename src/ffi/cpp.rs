//! The functions behind the cxx bridge ([`super::cxx`]): thin conversions onto [`FfiEngine`].
//!
//! Each fallible function runs inside [`run`], which catches panics and records the status code of
//! the error in a thread-local that the C++ shim reads ([`take_error_code`]) to build a
//! `kvpush::Error` with the same code as the C ABI returns. Block lists cross the bridge flattened
//! (all ids, then one length per KV group), so C++ passes slices without building Rust vectors.

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;

use super::capi::kvpush_stats;
use super::cxx::{Completion, EngineSpec, GroupSpec, Key, LayoutSpec};
use crate::embed::{key_of, key_parts, panic_message, FfiEngine, FfiError, Hub, TransportSpec};

thread_local! {
    static ERROR_CODE: Cell<i32> = const { Cell::new(0) };
}

/// The status code of the last error the bridge returned on this thread; resets it to 0.
pub(super) fn take_error_code() -> i32 {
    ERROR_CODE.try_with(|c| c.replace(0)).unwrap_or(0)
}

/// An error of a bridge function: the call and what went wrong. cxx turns its `Display` into the
/// C++ exception's `what()`; the status code travels beside it ([`take_error_code`]).
#[derive(Debug, thiserror::Error)]
#[error("{call}: {source}")]
pub struct BridgeError {
    /// The bridge function, as C++ calls it.
    pub call: &'static str,
    /// What went wrong (boxed: errors are rare, results are returned on every call).
    #[source]
    pub source: Box<FfiError>,
}

/// Runs `f` for the bridge function `call`: catches panics, records the error's code, and returns
/// the error (with the call's name) that becomes the C++ exception.
fn run<T>(call: &'static str, f: impl FnOnce() -> Result<T, FfiError>) -> Result<T, BridgeError> {
    let r = panic::catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|payload| Err(FfiError::Panic(panic_message(payload.as_ref()))));
    match r {
        Ok(v) => {
            let _ = ERROR_CODE.try_with(|c| c.set(0));
            Ok(v)
        }
        Err(e) => {
            let _ = ERROR_CODE.try_with(|c| c.set(e.code()));
            Err(BridgeError { call, source: Box::new(e) })
        }
    }
}

/// A hub as C++ holds it (`rust::Box<RustHub>`).
#[derive(Debug)]
pub struct RustHub(Arc<Hub>);

pub(super) fn new_hub() -> Box<RustHub> {
    Box::new(RustHub(Hub::new()))
}

/// An engine as C++ holds it (`rust::Box<RustEngine>`). Dropping it stops the engine; a panic while
/// stopping is caught, never unwound into C++.
#[derive(Debug)]
pub struct RustEngine(ManuallyDrop<FfiEngine>);

impl Drop for RustEngine {
    fn drop(&mut self) {
        // SAFETY: `self.0` is taken exactly once, here, and never used again.
        let inner = unsafe { ManuallyDrop::take(&mut self.0) };
        if let Err(p) = panic::catch_unwind(AssertUnwindSafe(move || drop(inner))) {
            tracing::error!(panic = %panic_message(p.as_ref()), "kvpush engine panicked while stopping");
        }
    }
}

fn none_if_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

fn engine_spec(s: &EngineSpec, transport: TransportSpec) -> crate::embed::EngineSpec {
    crate::embed::EngineSpec {
        engine_id: s.engine_id.clone(),
        mode: s.mode,
        device: none_if_empty(&s.device),
        writers: s.writers,
        lease_ms: s.lease_ms,
        timeout_ms: s.timeout_ms,
        transport,
        staging: crate::engine::Staging::Auto,
        layerwise: crate::engine::Layerwise::AUTO,
        // The C and C++ configs carry no memory offer (yet): direct only.
        memory: None,
    }
}

fn layout_spec(l: &LayoutSpec) -> crate::embed::LayoutSpec {
    let groups = l
        .groups
        .iter()
        .map(|g: &GroupSpec| crate::embed::GroupSpec { window_tokens: g.window_tokens, layers: g.layers.clone() })
        .collect();
    crate::embed::layout_spec_from_flat!(
        l,
        groups: groups,
        region_bases: l.region_bases.clone(),
        region_lens: l.region_lens.clone(),
    )
}

/// # Safety
///
/// [`FfiEngine::new`]'s contract for the regions of `layout`.
unsafe fn new_engine(spec: crate::embed::EngineSpec, layout: &LayoutSpec) -> Result<Box<RustEngine>, FfiError> {
    if layout.region_bases.is_empty() {
        return Err(FfiError::invalid("layout.region_bases", "is empty: a layout needs its region base addresses"));
    }
    // SAFETY: forwarded contract.
    let engine = unsafe { FfiEngine::new(&spec, &layout_spec(layout)) }?;
    Ok(Box::new(RustEngine(ManuallyDrop::new(engine))))
}

/// # Safety
///
/// [`FfiEngine::new`]'s contract for the regions of `layout`.
pub(super) unsafe fn new_loopback_engine(
    spec: &EngineSpec,
    layout: &LayoutSpec,
    hub: &RustHub,
) -> Result<Box<RustEngine>, BridgeError> {
    run("Engine (loopback)", || {
        let spec = engine_spec(spec, TransportSpec::Loopback(Arc::clone(&hub.0)));
        // SAFETY: forwarded contract.
        unsafe { new_engine(spec, layout) }
    })
}

/// # Safety
///
/// [`FfiEngine::new`]'s contract for the regions of `layout`.
pub(super) unsafe fn new_nixl_engine(spec: &EngineSpec, layout: &LayoutSpec) -> Result<Box<RustEngine>, BridgeError> {
    run("Engine (NIXL)", || {
        let transport = TransportSpec::Nixl {
            agent_name: none_if_empty(&spec.agent_name),
            backend: none_if_empty(&spec.nixl_backend),
            listen: none_if_empty(&spec.listen),
            // A default-constructed std::string is the only "unset" C++ can say here: empty means
            // unset ($KVPUSH_SECRET, then SideConfig's rules), never an empty key.
            secret: none_if_empty(&spec.secret).map(String::into_bytes),
            // Insecure mode only through $KVPUSH_INSECURE=1 (see SideConfig::insecure).
            insecure: false,
            peer_timeout_ms: 0,
            // The dial allow-list only through $KVPUSH_DIAL_ALLOW (see SideConfig::dial_allow).
            dial_allow: None,
        };
        // SAFETY: forwarded contract.
        unsafe { new_engine(engine_spec(spec, transport), layout) }
    })
}

/// Block lists from their flat form: `ids` holds the groups one after the other, `lens[g]` ids each.
fn lists(arg: &'static str, ids: &[u32], lens: &[usize]) -> Result<Vec<Vec<u32>>, FfiError> {
    let total = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
    if total != Some(ids.len()) {
        return Err(FfiError::invalid(
            arg,
            format!("the group lengths add up to {total:?}, but {} block ids were given", ids.len()),
        ));
    }
    let mut out = Vec::with_capacity(lens.len());
    let mut at = 0;
    for &l in lens {
        out.push(ids[at..at + l].to_vec());
        at += l;
    }
    Ok(out)
}

fn key(k: &Key) -> crate::proto::Key {
    key_of(k.id_hi, k.id_lo, k.attempt)
}

impl RustEngine {
    pub(super) fn handshake(&self) -> Result<Vec<u8>, BridgeError> {
        run("Engine::handshake", || self.0.handshake())
    }

    pub(super) fn add_peer(&self, handshake: &[u8]) -> Result<(), BridgeError> {
        run("Engine::add_peer", || self.0.add_peer(handshake))
    }

    pub(super) fn connect(&self, other: &RustEngine) -> Result<(), BridgeError> {
        run("Engine::connect", || self.0.connect(&other.0))
    }

    pub(super) fn connect_addr(&self, addr: &str) -> Result<(), BridgeError> {
        run("Engine::connect", || {
            if addr.is_empty() {
                return Err(FfiError::invalid("addr", "is empty"));
            }
            self.0.connect_addr(addr).map(drop)
        })
    }

    pub(super) fn listen_port(&self) -> Result<u16, BridgeError> {
        run("Engine::listen_port", || {
            self.0.listen_port().ok_or_else(|| FfiError::invalid("engine", "a loopback engine has no side channel"))
        })
    }

    pub(super) fn request_finished(
        &self,
        k: &Key,
        block_ids: &[u32],
        group_lens: &[usize],
        num_tokens: u64,
        consumer: &str,
    ) -> Result<(), BridgeError> {
        run("Engine::request_finished", || {
            let consumer = (!consumer.is_empty()).then_some(consumer);
            self.0.request_finished(key(k), lists("block_ids", block_ids, group_lens)?, num_tokens, consumer)
        })
    }

    pub(super) fn layers_ready(
        &self,
        k: &Key,
        block_ids: &[u32],
        group_lens: &[usize],
        num_tokens: u64,
        first_layer: u32,
        end_layer: u32,
    ) -> Result<(), BridgeError> {
        run("Engine::layers_ready", || {
            let lists = lists("block_ids", block_ids, group_lens)?;
            self.0.layers_ready(key(k), lists, num_tokens, first_layer..end_layer, None)
        })
    }

    pub(super) fn blocks_allocated(
        &self,
        k: &Key,
        producer: &str,
        block_ids: &[u32],
        group_lens: &[usize],
        num_tokens: u64,
    ) -> Result<(), BridgeError> {
        run("Engine::blocks_allocated", || {
            self.0.blocks_allocated(key(k), producer, lists("block_ids", block_ids, group_lens)?, num_tokens)
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_pull(
        &self,
        k: &Key,
        producer: &str,
        remote_ids: &[u32],
        remote_lens: &[usize],
        local_ids: &[u32],
        local_lens: &[usize],
        num_tokens: u64,
    ) -> Result<(), BridgeError> {
        run("Engine::start_pull", || {
            let remote = lists("remote", remote_ids, remote_lens)?;
            let local = lists("local", local_ids, local_lens)?;
            self.0.start_pull(key(k), producer, remote, None, local, num_tokens)
        })
    }

    pub(super) fn abort(&self, k: &Key) -> Result<(), BridgeError> {
        run("Engine::abort", || self.0.abort(key(k)))
    }

    pub(super) fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, BridgeError> {
        run("Engine::poll", || {
            Ok(self.0.poll(max, |o| {
                let (id_hi, id_lo, attempt) = key_parts(o.key);
                out.push(Completion {
                    key: Key { id_hi, id_lo, attempt },
                    outcome: o.outcome,
                    release: o.release,
                    message: o.message.into_owned(),
                });
            }))
        })
    }

    pub(super) fn stats(&self) -> Result<kvpush_stats, BridgeError> {
        run("Engine::stats", || Ok(self.0.stats().into()))
    }

    pub(super) fn stats_json(&self) -> Result<String, BridgeError> {
        run("Engine::stats_json", || {
            serde_json::to_string(&self.0.stats()).map_err(|e| FfiError::Panic(format!("serializing stats: {e}")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_lists_split_by_group_lengths() {
        assert_eq!(lists("x", &[1, 2, 3], &[2, 1]).expect("fits"), vec![vec![1, 2], vec![3]]);
        assert_eq!(lists("x", &[], &[0, 0]).expect("fits"), vec![Vec::<u32>::new(), Vec::new()]);
        let e = lists("x", &[1, 2, 3], &[2, 2]).expect_err("too long");
        assert!(e.to_string().contains("add up to Some(4), but 3 block ids"), "{e}");
        assert!(lists("x", &[1], &[usize::MAX, 2]).is_err());
    }

    #[test]
    fn errors_carry_their_code_once() {
        let r: Result<(), BridgeError> = run("t", || Err(FfiError::Null("p")));
        assert_eq!(r.expect_err("null").to_string(), "t: argument `p` is null");
        assert_eq!(take_error_code(), crate::embed::status::NULL);
        assert_eq!(take_error_code(), 0);
        let r: Result<(), BridgeError> = run("t", || panic!("boom"));
        assert!(r.expect_err("caught").to_string().contains("boom"));
        assert_eq!(take_error_code(), crate::embed::status::PANIC);
    }
}
