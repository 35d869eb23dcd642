//! The router's part of a request's timeline (docs/benchmarks.md, "Time to first token"): with
//! `KVPUSH_TIMELINE` set to a directory, each request's receipt, both legs' sending, D's response head,
//! P's answer and the first byte relayed to the client are appended as JSON lines —
//! `{"ns": <CLOCK_REALTIME ns>, "ev": "router_…", "tid": "<32 hex>", "attempt": 1, "pid": P}` — to
//! `<dir>/router-<pid>.jsonl`, read by `python -m kvpush.timeline` beside the engines' and connectors'.
//!
//! The root crate writes its own lines (`kvpush::engine::timeline`); this crate does not depend on it.
//! Off, [`record`] is one load of a `OnceLock`; on, one `write` per event. Never fails a request.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

static SINK: OnceLock<Option<Mutex<File>>> = OnceLock::new();

fn sink() -> Option<&'static Mutex<File>> {
    SINK.get_or_init(|| {
        let dir = std::env::var_os("KVPUSH_TIMELINE").filter(|v| !v.is_empty())?;
        let path = PathBuf::from(dir).join(format!("router-{}.jsonl", std::process::id()));
        let opened = std::fs::create_dir_all(path.parent()?)
            .and_then(|()| OpenOptions::new().create(true).append(true).open(&path));
        match opened {
            Ok(f) => Some(Mutex::new(f)),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "KVPUSH_TIMELINE: cannot open; not recording");
                None
            }
        }
    })
    .as_ref()
}

/// Whether the timeline is on (`KVPUSH_TIMELINE` names a directory that could be opened).
pub(crate) fn enabled() -> bool {
    sink().is_some()
}

/// Records `event` of transfer `tid` as having happened at `at` (an earlier instant of this process).
pub(crate) fn record_at(event: &'static str, tid: &str, at: Instant) {
    let Some(sink) = sink() else { return };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let ns = now.saturating_sub(at.elapsed().as_nanos());
    let line =
        format!("{{\"ns\":{ns},\"ev\":\"{event}\",\"tid\":\"{tid}\",\"attempt\":1,\"pid\":{}}}\n", std::process::id());
    // One write per line on an O_APPEND file: concurrent requests' lines never interleave.
    let _ = sink.lock().unwrap_or_else(PoisonError::into_inner).write_all(line.as_bytes());
}

/// Records `event` of transfer `tid` now.
pub(crate) fn record(event: &'static str, tid: &str) {
    record_at(event, tid, Instant::now());
}
