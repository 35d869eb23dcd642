//! Where a request's exposed time goes (`kvpush demo --layerwise compare`, issue #21): its stages,
//! from the engines' timelines.
//!
//! The two-process demo runs its children with `KVPUSH_TIMELINE` set (src/engine/timeline.rs): each
//! writer appends `eng_…` events, one JSON line each, on the wall clock both processes share. For a
//! request, [`split`] takes the *last* of each event (layer by layer, the last layer's; with several
//! ranks, the slowest rank's) between P's ready (the demo's timestamp just before the last
//! `layers_ready` or `request_finished` call) and D's outcome (the demo's timestamp when its engine
//! reported the request; both moved from the demo's monotonic clock onto the wall clock by the
//! caller), and cuts that window into consecutive stages:
//!
//! | stage | from → to | what waits there |
//! |---|---|---|
//! | `wake_us` | P's call → P's writer handles it (`eng_layers_ready` / `eng_blocks_ready`) | the writer's wake-up |
//! | `post_us` | → the WRITE posted (`eng_write_post`) | planning and posting |
//! | `notify_us` | → D's writer takes the notification (`eng_layers_notified` / `eng_notified`) | the data and its notification on the wire, and D's notification poll |
//! | `count_us` | → D counts the request complete (`eng_received`) | D's completion counting |
//! | `report_us` | → D's serving engine has the outcome (the demo's timestamp) | the outbox and the engine loop's poll |
//!
//! `write_done_us` (the WRITE posted → P's writer sees it complete, `eng_write_done`) runs beside
//! `notify_us`, not after it: it is P's completion poll, which holds P's blocks but not D's request.
//! It must never decide anything: it reads files the engines wrote and reports medians.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use kvpush::proto::Key;

use super::pct;

/// One request's stages (µs; see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stages {
    /// P's call → P's writer handles it.
    pub wake_us: u64,
    /// → the (last) WRITE posted.
    pub post_us: u64,
    /// → D's writer takes the (last) notification.
    pub notify_us: u64,
    /// → D counts the request complete.
    pub count_us: u64,
    /// → D's serving engine has the outcome.
    pub report_us: u64,
    /// The WRITE posted → P's writer sees it complete (beside `notify_us`).
    pub write_done_us: u64,
}

/// The medians and 99th percentiles of [`Stages`] over a run's requests (µs): the `"stages"`
/// objects of the demo's JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StageSplit {
    /// Requests whose timeline had every stage.
    pub requests: u64,
    /// P's call → P's writer handles it.
    pub wake_us_p50: u64,
    /// The WRITE posted.
    pub post_us_p50: u64,
    /// D's writer takes the notification.
    pub notify_us_p50: u64,
    /// D counts the request complete.
    pub count_us_p50: u64,
    /// D's serving engine has the outcome.
    pub report_us_p50: u64,
    /// P sees its WRITE complete (after the post; beside `notify_us`).
    pub write_done_us_p50: u64,
    /// 99th percentiles of the same.
    pub wake_us_p99: u64,
    /// ...
    pub post_us_p99: u64,
    /// ...
    pub notify_us_p99: u64,
    /// ...
    pub count_us_p99: u64,
    /// ...
    pub report_us_p99: u64,
    /// ...
    pub write_done_us_p99: u64,
}

/// One line of an engine's timeline.
#[derive(Deserialize)]
struct Line {
    ns: u128,
    ev: String,
    tid: String,
    attempt: u32,
}

/// The last time (ns) of each event of each request in one process's timeline.
#[derive(Debug, Default)]
pub struct Timeline {
    last: HashMap<(String, u32, String), u128>,
}

impl Timeline {
    /// Reads `<dir>/engine-<pid>.jsonl` (empty when the file is not there: an engine that recorded
    /// nothing); lines that do not parse are skipped.
    pub fn read(dir: &Path, pid: u32) -> std::io::Result<Timeline> {
        match std::fs::read_to_string(dir.join(format!("engine-{pid}.jsonl"))) {
            Ok(text) => Ok(Timeline::parse(&text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Timeline::default()),
            Err(e) => Err(e),
        }
    }

    /// A timeline from its JSON lines.
    pub fn parse(text: &str) -> Timeline {
        let mut t = Timeline::default();
        for line in text.lines() {
            let Ok(l) = serde_json::from_str::<Line>(line) else { continue };
            let slot = t.last.entry((l.tid, l.attempt, l.ev)).or_insert(0);
            *slot = (*slot).max(l.ns);
        }
        t
    }

    /// The last of `events` recorded for `key` (µs since the epoch).
    fn last_us(&self, key: Key, events: &[&str]) -> Option<u64> {
        let tid = key.transfer_id.to_string();
        events
            .iter()
            .filter_map(|ev| self.last.get(&(tid.clone(), key.attempt.0, (*ev).to_owned())))
            .max()
            .map(|ns| (ns / 1000) as u64)
    }
}

/// The stages of `key`, P's call at `ready_us` and D's outcome at `outcome_us` (µs since the epoch);
/// `None` when a stage's event is missing or one engine's events are out of order. D may take the
/// notification before P's writer records the post that sent it (the event is stamped when
/// `postXferReq` returns, and the notification can land first): `notify_us` is then 0. The two
/// marks come from another clock, mapped onto the wall clock within a few µs: a mark that lands up
/// to [`MAPPING_SLACK_US`] on the wrong side of its engine event counts as a stage of 0.
pub fn split(p: &Timeline, d: &Timeline, key: Key, ready_us: u64, outcome_us: u64) -> Option<Stages> {
    let handled = p.last_us(key, &["eng_layers_ready", "eng_blocks_ready"])?;
    let posted = p.last_us(key, &["eng_write_post"])?;
    let done = p.last_us(key, &["eng_write_done"])?;
    let notified = d.last_us(key, &["eng_layers_notified", "eng_notified"])?;
    let counted = d.last_us(key, &["eng_received"])?;
    if posted < handled
        || counted < notified
        || done < posted
        || ready_us > handled + MAPPING_SLACK_US
        || counted > outcome_us + MAPPING_SLACK_US
    {
        return None;
    }
    Some(Stages {
        wake_us: handled.saturating_sub(ready_us),
        post_us: posted - handled,
        notify_us: notified.saturating_sub(posted),
        count_us: counted - notified,
        report_us: outcome_us.saturating_sub(counted),
        write_done_us: done - posted,
    })
}

/// How far the demo's marks may land on the wrong side of the engine events around them (µs): the
/// error of mapping its monotonic clock onto the wall clock ([`wall_offset_us`]).
pub const MAPPING_SLACK_US: u64 = 20;

/// Wall clock minus `monotonic_us` (both µs; pass the clock the marks were taken on), read so that
/// a preemption between the two reads does not skew it: the tightest of a few bracketed reads.
pub fn wall_offset_us(monotonic_us: impl Fn() -> u64) -> u64 {
    let wall =
        || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    let mut best = (u64::MAX, 0);
    for _ in 0..16 {
        let before = monotonic_us();
        let w = wall();
        let after = monotonic_us();
        let width = after.saturating_sub(before);
        if width < best.0 {
            best = (width, w.saturating_sub(before + width / 2));
        }
    }
    best.1
}

/// Medians and 99th percentiles of `stages`.
pub fn summarize(stages: &[Stages]) -> StageSplit {
    let q = |f: fn(&Stages) -> u64| {
        let mut v: Vec<u64> = stages.iter().map(f).collect();
        v.sort_unstable();
        (pct(&v, 0.5), pct(&v, 0.99))
    };
    let (wake_us_p50, wake_us_p99) = q(|s| s.wake_us);
    let (post_us_p50, post_us_p99) = q(|s| s.post_us);
    let (notify_us_p50, notify_us_p99) = q(|s| s.notify_us);
    let (count_us_p50, count_us_p99) = q(|s| s.count_us);
    let (report_us_p50, report_us_p99) = q(|s| s.report_us);
    let (write_done_us_p50, write_done_us_p99) = q(|s| s.write_done_us);
    StageSplit {
        requests: stages.len() as u64,
        wake_us_p50,
        post_us_p50,
        notify_us_p50,
        count_us_p50,
        report_us_p50,
        write_done_us_p50,
        wake_us_p99,
        post_us_p99,
        notify_us_p99,
        count_us_p99,
        report_us_p99,
        write_done_us_p99,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(us: u64, ev: &str, key: Key) -> String {
        format!(
            "{{\"ns\":{},\"ev\":\"{ev}\",\"tid\":\"{}\",\"attempt\":{},\"pid\":1}}\n",
            u128::from(us) * 1000 + 7,
            key.transfer_id,
            key.attempt.0
        )
    }

    #[test]
    fn stages_take_the_last_layer_and_cut_the_window() {
        let key = Key::new(0xabc, 1);
        let other = Key::new(0xabc, 2);
        // Two layers on P; the second's events are the ones that count.
        let p: String = [
            line(100, "eng_layers_ready", key),
            line(110, "eng_write_post", key),
            line(150, "eng_write_done", key),
            line(1000, "eng_layers_ready", key),
            line(1030, "eng_write_post", key),
            line(1090, "eng_write_done", key),
            // Another attempt of the same transfer, later: not this request's.
            line(9000, "eng_write_post", other),
        ]
        .concat();
        let d: String = [
            line(130, "eng_layers_notified", key),
            line(1200, "eng_layers_notified", key),
            line(1210, "eng_received", key),
            "not json\n".to_owned(),
        ]
        .concat();
        let (p, d) = (Timeline::parse(&p), Timeline::parse(&d));
        let s = split(&p, &d, key, 990, 1250).expect("every stage");
        assert_eq!(
            s,
            Stages { wake_us: 10, post_us: 30, notify_us: 170, count_us: 10, report_us: 40, write_done_us: 60 }
        );
        // A ready stamped after P's writer handled the call: within the mapping's slack a wake of 0,
        // beyond it out of order (no split).
        assert_eq!(split(&p, &d, key, 1010, 1250).map(|s| s.wake_us), Some(0));
        assert_eq!(split(&p, &d, key, 1000 + MAPPING_SLACK_US + 1, 1250), None);
        // D took the notification before P stamped the post: a notification stage of 0.
        let early =
            Timeline::parse(&[line(1020, "eng_layers_notified", key), line(1210, "eng_received", key)].concat());
        assert_eq!(split(&p, &early, key, 990, 1250).map(|s| (s.notify_us, s.count_us)), Some((0, 190)));
        // D never counted it: no split.
        assert_eq!(split(&p, &Timeline::parse(&line(1200, "eng_layers_notified", key)), key, 990, 1250), None);
        // The offset of a clock to the wall clock: a clock 5 s behind maps to within a few ms.
        let behind = || wall_offset_us(|| 0) - 5_000_000;
        let off = wall_offset_us(behind);
        assert!((4_999_000..=5_001_000).contains(&off), "{off}");
        let sum = summarize(&[s, Stages { notify_us: 500, ..s }, Stages { notify_us: 300, ..s }]);
        assert_eq!((sum.requests, sum.notify_us_p50, sum.notify_us_p99, sum.wake_us_p50), (3, 300, 500, 10));
    }
}
