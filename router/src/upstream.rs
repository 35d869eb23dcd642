//! The P and D servers behind the router: their rotation state, least-outstanding selection, the HTTP
//! client that sends legs to them, and the probes (`/v1/kvpush/info` at start, `/health` every interval)
//! that take a server out of rotation and bring it back.
//!
//! A server leaves the rotation when a leg cannot connect to it, when a leg times out, or when a health
//! probe fails; it comes back when a health probe passes and (for a server that left) its info probe
//! still agrees with the router's mode. Nothing here holds a lock across an await.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::Deserialize;
use tracing::{error, info, warn};

use super::config::{Config, InstanceConfig, TransferMode, DEFAULT_SIDE_CHANNEL_PORT};
use super::metrics::label_value;

/// Largest probe or prefill response body read, in bytes.
pub(crate) const MAX_UPSTREAM_JSON: usize = 16 << 20;

/// The HTTP client every leg and probe goes through.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn client(config: &Config) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(config.connect_timeout));
    connector.set_nodelay(true);
    connector.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(4096)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector)
}

/// Which side of the pair a server is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// What a server says about itself on `GET /v1/kvpush/info` (every field optional).
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct ServerInfo {
    pub(crate) mode: Option<String>,
    pub(crate) engine_id: Option<String>,
    pub(crate) side_channel_host: Option<String>,
    pub(crate) side_channel_port: Option<u16>,
    pub(crate) tp_size: Option<u32>,
    pub(crate) pp_size: Option<u32>,
    pub(crate) ranks: Option<Vec<String>>,
}

/// Where D finds P's KV in push mode: the `remote_*` fields of D's kv_transfer_params.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PushTarget {
    pub(crate) engine_id: String,
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) tp_size: u32,
    pub(crate) pp_size: u32,
    /// Each rank's side-channel `host:port` (`remote_ranks`); empty: rank r at `port + r`.
    pub(crate) ranks: Vec<String>,
}

#[derive(Debug, Default)]
struct InstanceState {
    /// Why the server is out of rotation (None while in rotation).
    down_reason: Option<String>,
    info: Option<ServerInfo>,
}

/// One P or D server.
#[derive(Debug)]
pub(crate) struct Instance {
    pub(crate) role: Role,
    pub(crate) config: InstanceConfig,
    pub(crate) base: String,
    url_host: String,
    outstanding: AtomicUsize,
    sent: AtomicU64,
    up: AtomicBool,
    /// Failed health probes in a row.
    probe_failures: AtomicU32,
    state: Mutex<InstanceState>,
}

impl Instance {
    fn new(role: Role, config: InstanceConfig) -> Self {
        Instance {
            role,
            base: config.base(),
            url_host: config.url_host(),
            config,
            outstanding: AtomicUsize::new(0),
            sent: AtomicU64::new(0),
            up: AtomicBool::new(true),
            probe_failures: AtomicU32::new(0),
            state: Mutex::new(InstanceState::default()),
        }
    }

    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub(crate) fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub(crate) fn down_reason(&self) -> Option<String> {
        self.state.lock().ok().and_then(|s| s.down_reason.clone())
    }

    pub(crate) fn labels(&self) -> String {
        format!("role=\"{}\",url=\"{}\"", self.role.as_str(), label_value(&self.base))
    }

    /// Takes the server out of rotation (logged once per transition).
    pub(crate) fn mark_down(&self, reason: &str) {
        let was_up = self.up.swap(false, Ordering::AcqRel);
        if let Ok(mut s) = self.state.lock() {
            s.down_reason = Some(reason.to_owned());
        }
        if was_up {
            warn!(role = self.role.as_str(), url = %self.base, %reason, "server taken out of rotation");
        }
    }

    fn mark_up(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.down_reason = None;
        }
        if !self.up.swap(true, Ordering::AcqRel) {
            info!(role = self.role.as_str(), url = %self.base, "server back in rotation");
        }
    }

    /// The server's KV engine id: configured (`engine_id=`), else what its /v1/kvpush/info reported.
    pub(crate) fn engine_id(&self) -> Option<String> {
        let reported = || self.state.lock().ok().and_then(|s| s.info.as_ref().and_then(|i| i.engine_id.clone()));
        self.config.engine_id.clone().or_else(reported)
    }

    /// P's KV coordinates for D: the configuration first, then what the server reported, then defaults.
    /// None without an engine id.
    pub(crate) fn push_target(&self) -> Option<PushTarget> {
        let engine_id = self.engine_id()?;
        let info = self.state.lock().ok().and_then(|s| s.info.clone()).unwrap_or_default();
        let c = &self.config;
        Some(PushTarget {
            engine_id,
            host: c.side_channel_host.clone().or(info.side_channel_host).unwrap_or_else(|| self.url_host.clone()),
            port: c.side_channel_port.or(info.side_channel_port).unwrap_or(DEFAULT_SIDE_CHANNEL_PORT),
            tp_size: c.tp_size.or(info.tp_size).unwrap_or(1),
            pp_size: c.pp_size.or(info.pp_size).unwrap_or(1),
            ranks: c.ranks.clone().or(info.ranks).unwrap_or_default(),
        })
    }
}

/// A leg's claim on a server: counts as outstanding until dropped.
#[derive(Debug)]
pub(crate) struct Lease(Arc<Instance>);

impl Lease {
    pub(crate) fn instance(&self) -> &Arc<Instance> {
        &self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The servers of one role.
#[derive(Debug)]
pub(crate) struct Pool {
    role: Role,
    mode: TransferMode,
    instances: Vec<Arc<Instance>>,
    cursor: AtomicUsize,
}

impl Pool {
    pub(crate) fn new(role: Role, mode: TransferMode, configs: &[InstanceConfig]) -> Self {
        Pool {
            role,
            mode,
            instances: configs.iter().map(|c| Arc::new(Instance::new(role, c.clone()))).collect(),
            cursor: AtomicUsize::new(0),
        }
    }

    pub(crate) fn role(&self) -> Role {
        self.role
    }

    pub(crate) fn instances(&self) -> &[Arc<Instance>] {
        &self.instances
    }

    /// The in-rotation server with the fewest outstanding requests (ties go round-robin), leased.
    pub(crate) fn pick(&self) -> Option<Lease> {
        let n = self.instances.len();
        if n == 0 {
            return None;
        }
        let start = self.cursor.fetch_add(1, Ordering::Relaxed) % n;
        let mut best: Option<(usize, &Arc<Instance>)> = None;
        for k in 0..n {
            let inst = &self.instances[(start + k) % n];
            if !inst.is_up() {
                continue;
            }
            let o = inst.outstanding();
            if best.is_none_or(|(b, _)| o < b) {
                best = Some((o, inst));
            }
        }
        let (_, inst) = best?;
        inst.outstanding.fetch_add(1, Ordering::AcqRel);
        inst.sent.fetch_add(1, Ordering::Relaxed);
        Some(Lease(Arc::clone(inst)))
    }

    pub(crate) fn any_up(&self) -> bool {
        self.instances.iter().any(|i| i.is_up())
    }

    /// What a server must satisfy to serve in this role and mode, given its info probe.
    fn admit(&self, inst: &Instance, info: &InfoOutcome) -> Result<(), String> {
        if let InfoOutcome::Reported(i) = info {
            if let Some(m) = &i.mode {
                if !m.eq_ignore_ascii_case(&self.mode.to_string()) {
                    return Err(format!(
                        "mode mismatch: the router runs in {} mode but {} server {} reports mode `{m}`",
                        self.mode,
                        self.role.as_str(),
                        inst.base
                    ));
                }
            }
        }
        if self.role == Role::Prefill && self.mode == TransferMode::Push && inst.push_target().is_none() {
            return Err(format!(
                "prefill server {} has no engine id: push mode hands it to D as remote_engine_id; configure it \
                 (--prefill {},engine_id=ID) or serve it on /v1/kvpush/info",
                inst.base, inst.config.url
            ));
        }
        Ok(())
    }
}

/// Result of `GET /v1/kvpush/info`.
#[derive(Debug)]
pub(crate) enum InfoOutcome {
    /// The server answered with a JSON object.
    Reported(ServerInfo),
    /// The server answered, but not with usable info (e.g. 404): its mode cannot be checked.
    NotCheckable(String),
    /// No answer at all.
    Unreachable(String),
}

async fn get_with_timeout(client: &HttpClient, url: &str, timeout: Duration) -> Result<(StatusCode, Bytes), String> {
    let uri: Uri = url.parse().map_err(|e| format!("bad URL {url}: {e}"))?;
    let req = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("bad request to {url}: {e}"))?;
    let fut = async {
        let resp = client.request(req).await.map_err(|e| error_chain(&e))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_UPSTREAM_JSON)
            .collect()
            .await
            .map_err(|e| format!("reading the body: {e}"))?
            .to_bytes();
        Ok((status, body))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {:.1} s", timeout.as_secs_f64())),
    }
}

pub(crate) async fn probe_info(client: &HttpClient, inst: &Instance, timeout: Duration) -> InfoOutcome {
    let url = format!("{}/v1/kvpush/info", inst.base);
    match get_with_timeout(client, &url, timeout).await {
        Err(e) => InfoOutcome::Unreachable(e),
        Ok((status, _)) if !status.is_success() => {
            InfoOutcome::NotCheckable(format!("GET /v1/kvpush/info answered {status}"))
        }
        Ok((_, body)) => match serde_json::from_slice::<ServerInfo>(&body) {
            Ok(info) => {
                if let Ok(mut s) = inst.state.lock() {
                    s.info = Some(info.clone());
                }
                InfoOutcome::Reported(info)
            }
            Err(e) => InfoOutcome::NotCheckable(format!("GET /v1/kvpush/info is not the expected JSON: {e}")),
        },
    }
}

/// Probes every server's info at start. Mismatched modes and push-mode P servers without an engine id
/// are errors (all of them are reported); unreachable servers start out of rotation.
pub(crate) async fn startup_check(
    client: &HttpClient,
    pools: [&Pool; 2],
    timeout: Duration,
) -> Result<(), Vec<String>> {
    let mut set = tokio::task::JoinSet::new();
    for pool in pools {
        for inst in pool.instances() {
            let (client, inst) = (client.clone(), Arc::clone(inst));
            set.spawn(async move {
                let outcome = probe_info(&client, &inst, timeout).await;
                (inst, outcome)
            });
        }
    }
    let mut errors = Vec::new();
    while let Some(joined) = set.join_next().await {
        let Ok((inst, outcome)) = joined else {
            errors.push("a startup probe task failed".to_owned());
            continue;
        };
        let pool = if inst.role == Role::Prefill { pools[0] } else { pools[1] };
        match &outcome {
            InfoOutcome::Unreachable(e) => {
                inst.mark_down(&format!("unreachable at start (out of rotation until its /health answers): {e}"));
                continue;
            }
            InfoOutcome::NotCheckable(why) => {
                warn!(role = inst.role.as_str(), url = %inst.base, %why,
                    "mode not checkable (no /v1/kvpush/info); trusting the configuration");
            }
            InfoOutcome::Reported(i) if i.mode.is_none() => {
                warn!(role = inst.role.as_str(), url = %inst.base, "mode not checkable (/v1/kvpush/info has no mode)");
            }
            InfoOutcome::Reported(_) => {}
        }
        if let Err(e) = pool.admit(&inst, &outcome) {
            errors.push(e);
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        errors.sort();
        Err(errors)
    }
}

/// Health-probes every server once: one that failed `unhealthy_after` probes in a row leaves the rotation,
/// a passing one that was out comes back if its info still admits it.
pub(crate) async fn probe_round(client: &HttpClient, pools: [&Pool; 2], timeout: Duration, unhealthy_after: u32) {
    let mut set = tokio::task::JoinSet::new();
    for pool in pools {
        for inst in pool.instances() {
            let (client, inst) = (client.clone(), Arc::clone(inst));
            set.spawn(async move {
                let health = get_with_timeout(&client, &format!("{}/health", inst.base), timeout).await;
                let outcome = match &health {
                    Ok((s, _)) if s.is_success() && !inst.is_up() => Some(probe_info(&client, &inst, timeout).await),
                    _ => None,
                };
                (inst, health, outcome)
            });
        }
    }
    while let Some(joined) = set.join_next().await {
        let Ok((inst, health, outcome)) = joined else { continue };
        let pool = if inst.role == Role::Prefill { pools[0] } else { pools[1] };
        let failed = match &health {
            Err(e) => Some(format!("health probe failed: {e}")),
            Ok((s, _)) if !s.is_success() => Some(format!("health probe answered {s}")),
            Ok(_) => None,
        };
        if let Some(reason) = failed {
            let in_a_row = inst.probe_failures.fetch_add(1, Ordering::AcqRel).saturating_add(1);
            if in_a_row >= unhealthy_after || !inst.is_up() {
                inst.mark_down(&format!("{reason} ({in_a_row} in a row)"));
            } else {
                warn!(role = inst.role.as_str(), url = %inst.base, %reason, in_a_row, unhealthy_after, "health probe failed; still in rotation");
            }
            continue;
        }
        inst.probe_failures.store(0, Ordering::Release);
        if let Some(outcome) = outcome {
            match pool.admit(&inst, &outcome) {
                Ok(()) => inst.mark_up(),
                Err(e) => {
                    if inst.down_reason().as_deref() != Some(e.as_str()) {
                        error!(role = inst.role.as_str(), url = %inst.base, error = %e, "server kept out of rotation");
                    }
                    inst.mark_down(&e);
                }
            }
        }
    }
}

/// Why a leg failed.
#[derive(Debug)]
pub(crate) enum LegError {
    /// The server could not be connected to (it has been taken out of rotation).
    Connect { url: String, detail: String },
    /// The server did not answer in time (it has been taken out of rotation).
    Timeout { url: String, after: Duration },
    /// The server answered with a non-2xx status.
    Status { status: StatusCode, content_type: Option<HeaderValue>, body: Bytes },
    /// The server's 2xx answer is unusable (e.g. not JSON, no kv_transfer_params in pull mode).
    BadResponse { url: String, detail: String },
    /// The connection broke during the exchange.
    Broken { url: String, detail: String },
}

impl LegError {
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, LegError::Connect { .. })
    }
}

/// Request headers a proxy must not forward (hop-by-hop, or set by the router itself).
const DROPPED_REQUEST_HEADERS: [&str; 14] = [
    // The router reads P's body and may add an SSE event to D's: both must come uncompressed.
    "accept-encoding",
    "expect",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "x-request-id",
];

/// Response headers a proxy must not forward.
const DROPPED_RESPONSE_HEADERS: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

pub(crate) fn forwardable_request_headers(h: &HeaderMap) -> HeaderMap {
    filter_headers(h, &DROPPED_REQUEST_HEADERS)
}

pub(crate) fn forwardable_response_headers(h: &HeaderMap) -> HeaderMap {
    filter_headers(h, &DROPPED_RESPONSE_HEADERS)
}

/// `h` without the `dropped` headers and without every header that a `Connection` header names (those
/// are hop-by-hop too, RFC 9110 §7.6.1, whatever their name).
fn filter_headers(h: &HeaderMap, dropped: &[&str]) -> HeaderMap {
    let named: Vec<String> = h
        .get_all(hyper::header::CONNECTION)
        .iter()
        .flat_map(|v| {
            let tokens = String::from_utf8_lossy(v.as_bytes()).to_ascii_lowercase();
            tokens.split(',').map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect::<Vec<_>>()
        })
        .collect();
    let mut out = HeaderMap::with_capacity(h.len());
    for (name, value) in h {
        let name_str = name.as_str();
        if !dropped.contains(&name_str) && !named.iter().any(|n| n == name_str) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// One leg's request, before it is addressed to a server.
#[derive(Debug)]
pub(crate) struct LegRequest<'a> {
    pub(crate) method: Method,
    pub(crate) path: &'a str,
    /// Client headers to forward (already filtered).
    pub(crate) headers: &'a HeaderMap,
    /// Sent as `X-Request-Id` (both legs of a request carry the same one).
    pub(crate) request_id: &'a str,
    pub(crate) body: Bytes,
}

/// Sends one leg and waits for the response head (within `timeout`). A connect error or a timeout takes
/// the server out of rotation.
pub(crate) async fn send(
    client: &HttpClient,
    inst: &Instance,
    leg: LegRequest<'_>,
    timeout: Duration,
) -> Result<Response<Incoming>, LegError> {
    let url = format!("{}{}", inst.base, leg.path);
    let uri: Uri = url
        .parse()
        .map_err(|e| LegError::BadResponse { url: url.clone(), detail: format!("bad upstream URL: {e}") })?;
    let mut req = Request::new(Full::new(leg.body));
    *req.method_mut() = leg.method;
    *req.uri_mut() = uri;
    *req.headers_mut() = leg.headers.clone();
    req.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Ok(v) = HeaderValue::from_str(leg.request_id) {
        req.headers_mut().insert(HeaderName::from_static("x-request-id"), v);
    }
    match tokio::time::timeout(timeout, client.request(req)).await {
        Err(_) => {
            inst.mark_down(&format!("no response head within {:.1} s", timeout.as_secs_f64()));
            Err(LegError::Timeout { url, after: timeout })
        }
        Ok(Err(e)) if e.is_connect() => {
            let detail = error_chain(&e);
            inst.mark_down(&format!("connect failed: {detail}"));
            Err(LegError::Connect { url, detail })
        }
        Ok(Err(e)) => Err(LegError::Broken { url, detail: error_chain(&e) }),
        Ok(Ok(resp)) => Ok(resp),
    }
}

/// An error and its sources, joined with ": ".
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let t = inner.to_string();
        if !s.ends_with(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = inner.source();
    }
    s
}
