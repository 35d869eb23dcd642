//! The engine's part of a request's timeline (docs/benchmarks.md, "Time to first token"): with
//! `KVPUSH_TIMELINE` set to a directory, writer threads append one JSON line per event —
//! `{"ns": <CLOCK_REALTIME ns>, "ev": "eng_…", "tid": "<32 hex>", "attempt": N, "pid": P}` — to
//! `<dir>/engine-<pid>.jsonl`, which `python -m kvpush.timeline` reads beside the router's and the
//! connector's lines.
//!
//! Off (the variable unset or empty), [`record`] is one load of a `OnceLock`. On, an event is one
//! formatted line and one `write` under a lock: a handful per request, cheap enough to leave on in
//! benchmarks. It never fails a transfer: a directory that cannot be opened is logged once and the
//! timeline stays off; a line that cannot be written is dropped.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::proto::Key;

/// The environment variable naming the directory the timeline goes to.
pub const ENV: &str = "KVPUSH_TIMELINE";

static SINK: OnceLock<Option<Mutex<File>>> = OnceLock::new();

fn open() -> Option<Mutex<File>> {
    let dir = std::env::var_os(ENV).filter(|v| !v.is_empty())?;
    let path = PathBuf::from(dir).join(format!("engine-{}.jsonl", std::process::id()));
    let opened =
        std::fs::create_dir_all(path.parent()?).and_then(|()| OpenOptions::new().create(true).append(true).open(&path));
    match opened {
        Ok(f) => Some(Mutex::new(f)),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "{ENV}: cannot open the timeline; not recording");
            None
        }
    }
}

/// Nanoseconds since the Unix epoch (CLOCK_REALTIME: the one clock every process of a host shares).
fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// Records `event` of `key` now, when the timeline is on. (`kvpush-router` has its own copy of this
/// writer, `router/src/timeline.rs`: it does not depend on this crate.)
pub(crate) fn record(event: &'static str, key: Key) {
    let Some(sink) = SINK.get_or_init(open) else { return };
    let line = format!(
        "{{\"ns\":{},\"ev\":\"{event}\",\"tid\":\"{}\",\"attempt\":{},\"pid\":{}}}\n",
        now_ns(),
        key.transfer_id,
        key.attempt,
        std::process::id()
    );
    // One write per line on an O_APPEND file: lines of several threads never interleave.
    let _ = crate::sync::lock(sink).write_all(line.as_bytes());
}
