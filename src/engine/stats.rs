//! Engine statistics: counters and latency histograms, read with [`super::Engine::stats`].
//!
//! The writer threads record into a [`Stats`] behind a mutex (uncontended: one writer per shard,
//! read rarely); [`StatsSnapshot`] is the serializable view with percentiles.

use hdrhistogram::Histogram;
use serde::Serialize;

/// A latency histogram in microseconds (1 µs to 1 hour, 3 significant digits).
#[derive(Clone, Debug)]
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        // Invariant: low 1 >= 1, high >= 2 * low, 3 significant figures <= 5: always valid bounds.
        Self(Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds"))
    }
}

impl Latency {
    /// Records one value (clamped into range).
    pub fn record(&mut self, micros: u64) {
        self.0.saturating_record(micros.max(1));
    }

    /// Merges another histogram into this one.
    pub fn add(&mut self, other: &Latency) {
        let _ = self.0.add(&other.0);
    }

    /// Summary with percentiles.
    pub fn summary(&self) -> LatencySummary {
        let h = &self.0;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
            mean_us: h.mean(),
        }
    }
}

/// Percentiles of a [`Latency`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Values recorded.
    pub count: u64,
    /// Median (µs).
    pub p50_us: u64,
    /// 90th percentile (µs).
    pub p90_us: u64,
    /// 99th percentile (µs).
    pub p99_us: u64,
    /// Largest (µs).
    pub max_us: u64,
    /// Mean (µs).
    pub mean_us: f64,
}

/// Failures by kind.
///
/// The C ABI uses this struct as it is (`kvpush_failures` in `cpp/include/kvpush.h`, the field
/// `failures` of `kvpush_stats`): it is `#[repr(C)]` and every field is a `u64`. Adding a kind is
/// done as for [`Counters`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Failures {
    /// Posting a transfer failed.
    pub post: u64,
    /// A posted transfer failed.
    pub transfer: u64,
    /// Planning failed.
    pub plan: u64,
    /// Leases or registration waits that ran out (producer).
    pub lease_expired: u64,
    /// Requests that timed out waiting for their parts (consumer).
    pub timeout: u64,
    /// Failure notifications received from a peer (consumer).
    pub remote: u64,
    /// Frames that could not be decoded or were out of range.
    pub malformed: u64,
    /// Frames or transfers concerning unknown peers.
    pub unknown_peer: u64,
    /// Control-link sends that failed.
    pub link: u64,
    /// Writer threads that panicked (each failed its shard's requests and refuses new ones).
    pub writer_panic: u64,
    /// Transfers this engine posted that had not ended when its shutdown fence gave up (their
    /// memory may still be touched after `stop`; logged with the peer and request).
    pub shutdown_unfenced: u64,
    /// Quarantined blocks released by the time bound, without every producer's final word or a
    /// fence (`CompletionConfig::quarantine_us`; logged).
    pub quarantine_expired: u64,
}

/// Everything the writers record.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Counters.
    pub counters: Counters,
    /// Failures by kind.
    pub failures: Failures,
    /// Producer: how long a registration waited for prefill.
    pub wait_registration_first: Latency,
    /// Producer: how long finished blocks waited for the registration.
    pub wait_blocks_first: Latency,
    /// Time to post one transfer (plan + merge + post call).
    pub post: Latency,
    /// Time from post to transfer done.
    pub transfer: Latency,
    /// Consumer: time from registration to every part received.
    pub receive: Latency,
    /// Transfers finished since [`super::Engine::take_transfers`] last took them (not merged by
    /// [`Stats::add`]: each is taken once).
    pub recent: Recent,
}

/// One transfer a writer posted and saw end (a WRITE in push mode, a READ in pull mode): what
/// vLLM's KV-connector metrics observe per transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TransferRecord {
    /// Bytes it moved.
    pub bytes: u64,
    /// Descriptors posted (after merging).
    pub descriptors: u64,
    /// Time to post it: plan, merge and the post call (µs).
    pub post_us: u64,
    /// Time from post to its end (µs).
    pub transfer_us: u64,
    /// Whether it ended well.
    pub ok: bool,
}

/// The finished transfers a writer keeps until they are taken: at most [`Recent::CAP`]; older ones
/// are dropped (and counted) so that an embedder that never takes them costs bounded memory.
#[derive(Clone, Debug, Default)]
pub struct Recent {
    records: std::collections::VecDeque<TransferRecord>,
    /// Records dropped because nobody took them in time.
    pub dropped: u64,
}

impl Recent {
    /// Records kept per writer at most.
    pub const CAP: usize = 4096;

    /// Keeps `r`, dropping the oldest record when full.
    pub fn push(&mut self, r: TransferRecord) {
        if self.records.len() >= Self::CAP {
            self.records.pop_front();
            self.dropped += 1;
        }
        self.records.push_back(r);
    }

    /// Moves every record into `out`, oldest first.
    pub fn take_into(&mut self, out: &mut Vec<TransferRecord>) {
        out.extend(self.records.drain(..));
    }
}

/// Monotonic counters.
///
/// One source for every binding: the C ABI uses this struct as it is (`kvpush_counters` in
/// `cpp/include/kvpush.h`, the field `counters` of `kvpush_stats`, which C++ sees as
/// `kvpush::Stats`), and Python and the JSON of `kvpush_engine_stats_json` get it through serde. So
/// it is `#[repr(C)]` and every field is a `u64`.
///
/// Adding a counter touches two files: a field here (and its line in [`Stats::add`]), and the same
/// field at the same place in `kvpush_counters` in `kvpush.h`. `tests/ffi/ffi_c.rs` fails until the
/// two agree in every field's name and offset.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counters {
    /// Registrations sent (consumer) or received (producer).
    pub registrations: u64,
    /// Transfers matched by the rendezvous.
    pub matches: u64,
    /// Transfers posted.
    pub posts: u64,
    /// Copies before merging.
    pub descriptors_unmerged: u64,
    /// Descriptors posted.
    pub descriptors_posted: u64,
    /// Bytes posted.
    pub bytes: u64,
    /// Producer: requests whose blocks were released.
    pub released: u64,
    /// Consumer: requests received.
    pub received: u64,
    /// Consumer: requests failed (blocks reported invalid).
    pub failed: u64,
    /// Aborts handled.
    pub aborted: u64,
    /// Consumer: requests whose end was reported while their blocks stayed quarantined
    /// ([`super::Finished::Quarantined`]; a lost or silent producer might still write into them).
    pub quarantined: u64,
}

/// Serializable view of [`Stats`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StatsSnapshot {
    /// Counters.
    pub counters: Counters,
    /// Failures by kind.
    pub failures: Failures,
    /// See [`Stats::wait_registration_first`].
    pub wait_registration_first: LatencySummary,
    /// See [`Stats::wait_blocks_first`].
    pub wait_blocks_first: LatencySummary,
    /// See [`Stats::post`].
    pub post: LatencySummary,
    /// See [`Stats::transfer`].
    pub transfer: LatencySummary,
    /// See [`Stats::receive`].
    pub receive: LatencySummary,
}

impl Stats {
    /// Adds `other` into `self` (to combine shards).
    pub fn add(&mut self, other: &Stats) {
        macro_rules! sum {
            ($a:expr, $b:expr, $($f:ident),*) => { $( $a.$f += $b.$f; )* };
        }
        sum!(
            self.counters,
            other.counters,
            registrations,
            matches,
            posts,
            descriptors_unmerged,
            descriptors_posted,
            bytes,
            released,
            received,
            failed,
            aborted,
            quarantined
        );
        sum!(
            self.failures,
            other.failures,
            post,
            transfer,
            plan,
            lease_expired,
            timeout,
            remote,
            malformed,
            unknown_peer,
            link,
            writer_panic,
            shutdown_unfenced,
            quarantine_expired
        );
        self.wait_registration_first.add(&other.wait_registration_first);
        self.wait_blocks_first.add(&other.wait_blocks_first);
        self.post.add(&other.post);
        self.transfer.add(&other.transfer);
        self.receive.add(&other.receive);
    }

    /// The serializable view.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            counters: self.counters,
            failures: self.failures,
            wait_registration_first: self.wait_registration_first.summary(),
            wait_blocks_first: self.wait_blocks_first.summary(),
            post: self.post.summary(),
            transfer: self.transfer.summary(),
            receive: self.receive.summary(),
        }
    }
}
