//! Host-bounce pairs over the loopback transport (docs/deployment.md §4): the fixture behind the
//! Neuron and CUDA bounce tests.
//!
//! [`pair`] makes P and D on two devices, each NIC an endpoint for host memory only, the side on
//! `bouncer` memory running the host bounce and the other plain staging with the bounce's policy;
//! [`push`] posts one WRITE and pumps both sides ([`pump`]) until it is done and its notification
//! delivered.
//! Nothing here checks bytes: that stays with the caller.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpush::device::{Device, DeviceKind, MemRegion};
use kvpush::transport::bounce::{bounce_geometry, host_bounce};
use kvpush::transport::loopback::Fabric;
use kvpush::transport::staged::{Staged, StagingConfig};
use kvpush::transport::{Desc, Notification, Op, Transport, XferId, XferState};

/// P (endpoint `p`) on `p_dev` and D (endpoint `d`) on `d_dev`, introduced to each other after the
/// caller registered their memory ([`push`] loads the metadata); the side whose device is of kind
/// `bouncer` runs [`host_bounce`].
pub fn pair(
    fabric: &Fabric,
    (p, p_dev): (&str, &Arc<dyn Device>),
    (d, d_dev): (&str, &Arc<dyn Device>),
    bouncer: DeviceKind,
    geometry: StagingConfig,
) -> (Staged, Staged) {
    let side = |name: &str, dev: &Arc<dyn Device>| -> Staged {
        let nic = Arc::new(fabric.endpoint(name).expect("endpoint"));
        if dev.kind() == bouncer {
            host_bounce(nic, dev.clone(), geometry).expect("host bounce")
        } else {
            Staged::new(nic, dev.as_ref(), bounce_geometry(geometry)).expect("staging").expect("host memory stages")
        }
    };
    (side(p, p_dev), side(d, d_dev))
}

/// `n` descriptors of 4 KiB from `from` to `to`, scattered over the first `blocks` 4 KiB blocks of
/// each (descriptor `i` reads block `37 i` and writes block `101 i`, modulo `blocks`): a fragmented
/// request, as a paged KV pool makes one.
pub fn scattered(from: &MemRegion, to: &MemRegion, n: u64, blocks: u64) -> Vec<Desc> {
    (0..n)
        .map(|i| Desc {
            local: from.addr + ((i * 37) % blocks) * 4096,
            remote: to.addr + ((i * 101) % blocks) * 4096,
            len: 4096,
        })
        .collect()
}

/// Loads each side's metadata into the other, posts `descs` from `p` to `d` with `notif`, and pumps
/// both until the WRITE is done and D delivered a notification (a panic after `limit`, with both
/// sides' staging counts). Returns what D delivered; P must deliver nothing (staging's own frames).
pub fn push(p: &Staged, d: &Staged, descs: &[Desc], notif: &[u8], limit: Duration) -> Vec<Notification> {
    let to = p.load_remote(&d.local_metadata().expect("D's metadata")).expect("P loads D");
    d.load_remote(&p.local_metadata().expect("P's metadata")).expect("D loads P");
    let id = p.post(Op::Write, &to, descs, Some(notif)).expect("post");
    pump(p, d, id, Instant::now() + limit, |_, _| {})
}

/// Pumps `p`, which posted transfer `id`, and `d` until the transfer is done and D delivered a
/// notification; `each` sees both sides after every round (a panic past `deadline`, with both sides'
/// staging counts). Returns what D delivered; P must deliver nothing (staging's own frames). Any
/// pair of [`Staged`] transports, over loopback or NIXL.
pub fn pump(
    p: &Staged,
    d: &Staged,
    id: XferId,
    deadline: Instant,
    mut each: impl FnMut(&Staged, &Staged),
) -> Vec<Notification> {
    let (mut done, mut seen) = (false, Vec::new());
    while !done || seen.is_empty() {
        if !done {
            done = p.poll(id).expect("the staged WRITE") == XferState::Done;
        }
        let mut mine = Vec::new();
        p.take_notifications(&mut mine).expect("P pumps");
        assert!(mine.is_empty(), "staging frames never reach the engine: {mine:?}");
        d.take_notifications(&mut seen).expect("D pumps");
        each(p, d);
        assert!(Instant::now() < deadline, "staged WRITE did not finish: {:?} {:?}", p.counts(), d.counts());
    }
    seen
}
