//! The router's counters and histograms, rendered in the Prometheus text exposition format (version
//! 0.0.4) on `GET /metrics`. Everything is a relaxed atomic: a scrape may see one request counted in one
//! family and not yet in another, never a torn value.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::upstream::Pool;

/// Why a request (or one of its legs) failed; the `kind` label of `kvpush_router_errors_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    BadRequest,
    PayloadTooLarge,
    NotFound,
    NoPrefillInstance,
    NoDecodeInstance,
    PrefillConnect,
    PrefillTimeout,
    PrefillStatus,
    PrefillBadResponse,
    PrefillBroken,
    DecodeConnect,
    DecodeTimeout,
    DecodeStatus,
    DecodeBroken,
    DecodeStreamIdle,
    /// D's first token differed from the one P answered and the client already has.
    FirstTokenMismatch,
    ClientDisconnect,
    BodyTimeout,
    TooManyConnections,
    Internal,
}

impl ErrorKind {
    const ALL: [ErrorKind; 20] = [
        ErrorKind::BadRequest,
        ErrorKind::PayloadTooLarge,
        ErrorKind::NotFound,
        ErrorKind::NoPrefillInstance,
        ErrorKind::NoDecodeInstance,
        ErrorKind::PrefillConnect,
        ErrorKind::PrefillTimeout,
        ErrorKind::PrefillStatus,
        ErrorKind::PrefillBadResponse,
        ErrorKind::PrefillBroken,
        ErrorKind::DecodeConnect,
        ErrorKind::DecodeTimeout,
        ErrorKind::DecodeStatus,
        ErrorKind::DecodeBroken,
        ErrorKind::DecodeStreamIdle,
        ErrorKind::FirstTokenMismatch,
        ErrorKind::ClientDisconnect,
        ErrorKind::BodyTimeout,
        ErrorKind::TooManyConnections,
        ErrorKind::Internal,
    ];

    /// The label value, also used as the `code` of an OpenAI-shaped error body.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::NotFound => "not_found",
            ErrorKind::NoPrefillInstance => "no_prefill_instance",
            ErrorKind::NoDecodeInstance => "no_decode_instance",
            ErrorKind::PrefillConnect => "prefill_connect",
            ErrorKind::PrefillTimeout => "prefill_timeout",
            ErrorKind::PrefillStatus => "prefill_status",
            ErrorKind::PrefillBadResponse => "prefill_bad_response",
            ErrorKind::PrefillBroken => "prefill_broken",
            ErrorKind::DecodeConnect => "decode_connect",
            ErrorKind::DecodeTimeout => "decode_timeout",
            ErrorKind::DecodeStatus => "decode_status",
            ErrorKind::DecodeBroken => "decode_broken",
            ErrorKind::DecodeStreamIdle => "decode_stream_idle",
            ErrorKind::FirstTokenMismatch => "first_token_mismatch",
            ErrorKind::ClientDisconnect => "client_disconnect",
            ErrorKind::BodyTimeout => "body_timeout",
            ErrorKind::TooManyConnections => "too_many_connections",
            ErrorKind::Internal => "internal",
        }
    }

    fn index(self) -> usize {
        ErrorKind::ALL.iter().position(|k| *k == self).unwrap_or(0)
    }
}

/// Upper bounds of the latency histograms' buckets, in seconds.
const BUCKETS: [f64; 20] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
    300.0, 600.0,
];

/// A fixed-bucket latency histogram.
#[derive(Debug)]
pub(crate) struct Histogram {
    /// Non-cumulative counts; the last one is the +Inf bucket.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new() -> Self {
        Histogram { counts: std::array::from_fn(|_| AtomicU64::new(0)), sum_ns: AtomicU64::new(0) }
    }

    pub(crate) fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS.iter().position(|b| s <= *b).unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cum = 0u64;
        for (i, b) in BUCKETS.iter().enumerate() {
            cum += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        cum += self.counts[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cum}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {sum}");
        let _ = writeln!(out, "{name}_count{braces} {cum}");
    }
}

/// The OpenAI endpoint a request came in on; the `endpoint` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// All of the router's metrics.
#[derive(Debug)]
pub(crate) struct Metrics {
    requests: [AtomicU64; 2],
    responses: Mutex<BTreeMap<u16, u64>>,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    in_flight: AtomicI64,
    retries: AtomicU64,
    first_token_recoveries: AtomicU64,
    pub(crate) prefill_leg: Histogram,
    pub(crate) decode_leg: Histogram,
    pub(crate) ttft: Histogram,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        Metrics {
            requests: std::array::from_fn(|_| AtomicU64::new(0)),
            responses: Mutex::new(BTreeMap::new()),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            in_flight: AtomicI64::new(0),
            retries: AtomicU64::new(0),
            first_token_recoveries: AtomicU64::new(0),
            prefill_leg: Histogram::new(),
            decode_leg: Histogram::new(),
            ttft: Histogram::new(),
        }
    }

    pub(crate) fn request(&self, e: Endpoint) {
        self.requests[e as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn response(&self, status: u16) {
        if let Ok(mut m) = self.responses.lock() {
            *m.entry(status).or_insert(0) += 1;
        }
    }

    pub(crate) fn error(&self, kind: ErrorKind) {
        self.errors[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// D's first token was not P's, which the client had: D's continuation of P's token replaced D's leg.
    pub(crate) fn first_token_recovery(&self) {
        self.first_token_recoveries.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn in_flight(&self, delta: i64) {
        self.in_flight.fetch_add(delta, Ordering::Relaxed);
    }

    /// The whole exposition, including the state of every upstream server.
    pub(crate) fn render(&self, pools: [&Pool; 2]) -> String {
        let mut out = String::with_capacity(8 << 10);
        family(&mut out, "kvpush_router_requests_total", "counter", "Client requests received, by endpoint.");
        for e in [Endpoint::Completions, Endpoint::ChatCompletions] {
            let n = self.requests[e as usize].load(Ordering::Relaxed);
            let _ = writeln!(out, "kvpush_router_requests_total{{endpoint=\"{}\"}} {n}", e.path());
        }
        family(&mut out, "kvpush_router_responses_total", "counter", "Responses sent to clients, by HTTP status.");
        if let Ok(m) = self.responses.lock() {
            for (code, n) in m.iter() {
                let _ = writeln!(out, "kvpush_router_responses_total{{code=\"{code}\"}} {n}");
            }
        }
        family(&mut out, "kvpush_router_errors_total", "counter", "Failed requests and legs, by kind.");
        for k in ErrorKind::ALL {
            let n = self.errors[k.index()].load(Ordering::Relaxed);
            let _ = writeln!(out, "kvpush_router_errors_total{{kind=\"{}\"}} {n}", k.as_str());
        }
        family(
            &mut out,
            "kvpush_router_retries_total",
            "counter",
            "Requests sent again to other servers after a leg could not connect.",
        );
        let _ = writeln!(out, "kvpush_router_retries_total {}", self.retries.load(Ordering::Relaxed));
        family(
            &mut out,
            "kvpush_router_first_token_recoveries_total",
            "counter",
            "Streams whose decode leg was replaced by its continuation of the prefill leg's token, after the decode leg's first token differed.",
        );
        let recoveries = self.first_token_recoveries.load(Ordering::Relaxed);
        let _ = writeln!(out, "kvpush_router_first_token_recoveries_total {recoveries}");
        family(&mut out, "kvpush_router_in_flight", "gauge", "Client requests being served now.");
        let _ = writeln!(out, "kvpush_router_in_flight {}", self.in_flight.load(Ordering::Relaxed));
        family(
            &mut out,
            "kvpush_router_leg_duration_seconds",
            "histogram",
            "Duration of successful legs: prefill until its whole response, decode until its last byte.",
        );
        self.prefill_leg.render(&mut out, "kvpush_router_leg_duration_seconds", "leg=\"prefill\"");
        self.decode_leg.render(&mut out, "kvpush_router_leg_duration_seconds", "leg=\"decode\"");
        family(
            &mut out,
            "kvpush_router_ttft_seconds",
            "histogram",
            "Time from the client's request to the first byte of the decode response's body.",
        );
        self.ttft.render(&mut out, "kvpush_router_ttft_seconds", "");
        family(&mut out, "kvpush_router_upstream_up", "gauge", "1 if the server is in rotation.");
        for p in pools {
            for i in p.instances() {
                let _ = writeln!(out, "kvpush_router_upstream_up{{{}}} {}", i.labels(), u8::from(i.is_up()));
            }
        }
        family(&mut out, "kvpush_router_upstream_outstanding", "gauge", "Requests outstanding at the server.");
        for p in pools {
            for i in p.instances() {
                let _ = writeln!(out, "kvpush_router_upstream_outstanding{{{}}} {}", i.labels(), i.outstanding());
            }
        }
        family(&mut out, "kvpush_router_upstream_requests_total", "counter", "Legs sent to the server.");
        for p in pools {
            for i in p.instances() {
                let _ = writeln!(out, "kvpush_router_upstream_requests_total{{{}}} {}", i.labels(), i.sent());
            }
        }
        out
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Escapes a Prometheus label value.
pub(crate) fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram::new();
        h.observe(Duration::from_micros(100));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(1000));
        let mut s = String::new();
        h.render(&mut s, "x", "leg=\"d\"");
        assert!(s.contains("x_bucket{leg=\"d\",le=\"0.0005\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{leg=\"d\",le=\"0.005\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{leg=\"d\",le=\"600\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{leg=\"d\",le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count{leg=\"d\"} 3\n"), "{s}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
