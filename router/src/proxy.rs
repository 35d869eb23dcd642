//! Request handling: routing, the two legs of a P/D request in push and pull mode, and the error
//! responses.
//!
//! Push: both legs leave at once — P gets the request with `max_tokens: 1` and `kv_transfer_params:
//! {do_remote_decode, transfer_id}`, D the original request with `{do_remote_prefill, transfer_id,
//! remote_engine_id, remote_host, remote_port, tp_size, pp_size}` — and whichever answers first decides:
//! a failed P cancels D; D's response head goes to the client as soon as it arrives while P is watched by
//! the relay. Pull: P first, then D with the kv_transfer_params P returned.
//!
//! Cancellation is by dropping: a dropped leg future or relay closes its upstream connection, which is
//! how vLLM learns to abort a request. Nothing here may panic on client input.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};
use tracing::debug;

use super::body::{error_event, DecodeStream, Early, First, IdMask, InFlight, PrefillResult, ProxyBody, Relay, Resend};
use super::config::TransferMode;
use super::first_token;
use super::metrics::{Endpoint, ErrorKind};
use super::timeline;
use super::upstream::{self, Instance, Lease, LegError, LegRequest, PushTarget, MAX_UPSTREAM_JSON};
use super::Shared;

/// Which leg failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Leg {
    Prefill,
    Decode,
}

/// The router's service: every request gets a response, never an error (a panic-free `Infallible`).
pub(crate) async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
    let resp = route(&shared, req).await;
    shared.metrics.response(resp.status().as_u16());
    Ok(resp)
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<ProxyBody> {
    let path = req.uri().path();
    let endpoint = match path {
        "/v1/completions" => Some(Endpoint::Completions),
        "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
        _ => None,
    };
    match (req.method(), endpoint, path) {
        (&Method::POST, Some(e), _) => {
            shared.metrics.request(e);
            let flight = InFlight::new(Arc::clone(shared));
            let mut resp = completion(shared, e, req).await;
            // A relayed body keeps the request in flight until its last byte (or the client leaves).
            resp.body_mut().hold(flight);
            resp
        }
        (_, Some(_), _) => error_response(StatusCode::METHOD_NOT_ALLOWED, ErrorKind::BadRequest, "use POST"),
        (&Method::GET, None, "/health") => health(shared),
        (&Method::GET, None, "/metrics") => {
            let text = shared.metrics.render([&shared.prefill, &shared.decode]);
            let mut r = Response::new(ProxyBody::full(text));
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
            r
        }
        (&Method::GET, None, "/v1/models") => models(shared, req.headers()).await,
        _ => {
            shared.metrics.error(ErrorKind::NotFound);
            let msg = format!("no route for {} {path}", req.method());
            error_response(StatusCode::NOT_FOUND, ErrorKind::NotFound, &msg)
        }
    }
}

/// Counts a client disconnect if the handler is dropped before it produced a response.
struct DisconnectGuard<'a>(Option<&'a Shared>);

impl Drop for DisconnectGuard<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.0 {
            s.metrics.error(ErrorKind::ClientDisconnect);
        }
    }
}

/// A spawned prefill leg that is aborted when dropped (unless handed on with [`AbortOnDrop::take`]).
struct AbortOnDrop(Option<tokio::task::JoinHandle<PrefillResult>>);

impl AbortOnDrop {
    fn take(&mut self) -> Option<tokio::task::JoinHandle<PrefillResult>> {
        self.0.take()
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

async fn completion(shared: &Arc<Shared>, endpoint: Endpoint, req: Request<Incoming>) -> Response<ProxyBody> {
    let received = Instant::now();
    let mut guard = DisconnectGuard(Some(shared));
    let resp = completion_inner(shared, endpoint, req, received).await;
    guard.0 = None;
    resp
}

async fn completion_inner(
    shared: &Arc<Shared>,
    endpoint: Endpoint,
    req: Request<Incoming>,
    received: Instant,
) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let limit = shared.config.body_timeout;
    let Ok(collected) = tokio::time::timeout(limit, Limited::new(body, shared.config.max_body_bytes).collect()).await
    else {
        shared.metrics.error(ErrorKind::BodyTimeout);
        let msg = format!("the request body did not arrive within {:.1} s", limit.as_secs_f64());
        let mut r = error_response(StatusCode::REQUEST_TIMEOUT, ErrorKind::BodyTimeout, &msg);
        // The rest of the body may still be on its way: this connection cannot serve another request.
        r.headers_mut().insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
        return r;
    };
    let bytes = match collected {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            shared.metrics.error(ErrorKind::PayloadTooLarge);
            let msg = format!("request body larger than {} bytes", shared.config.max_body_bytes);
            return error_response(StatusCode::PAYLOAD_TOO_LARGE, ErrorKind::PayloadTooLarge, &msg);
        }
        Err(e) => {
            shared.metrics.error(ErrorKind::BadRequest);
            let msg = format!("cannot read the request body: {e}");
            return error_response(StatusCode::BAD_REQUEST, ErrorKind::BadRequest, &msg);
        }
    };
    let request = match parse_request(&bytes) {
        Ok(r) => r,
        Err(msg) => {
            shared.metrics.error(ErrorKind::BadRequest);
            return error_response(StatusCode::BAD_REQUEST, ErrorKind::BadRequest, &msg);
        }
    };
    let headers = upstream::forwardable_request_headers(&parts.headers);
    let proxied = Proxied { path: endpoint.path(), headers: &headers, request: &request, received };
    let mut attempt = 0;
    loop {
        let (tid, public) = match (transfer_id(shared), transfer_id(shared)) {
            (Ok(t), Ok(p)) => (t, p),
            (Err(r), _) | (_, Err(r)) => return r.into_response(),
        };
        let outcome = match shared.config.mode {
            TransferMode::Push => push(shared, proxied, &tid).await,
            TransferMode::Pull => pull(shared, proxied, &tid).await,
        };
        match outcome {
            Outcome::Response(r) => return hide_transfer_id(r, &tid, &public),
            Outcome::Retry(leg, e) if attempt < shared.config.connect_retries => {
                attempt += 1;
                shared.metrics.retry();
                debug!(?leg, error = ?e, attempt, "leg could not connect; retrying on other servers");
            }
            Outcome::Retry(leg, e) => return leg_error_response(leg, &e),
        }
    }
}

/// The client's request as every attempt relays it (a retry sends the same again).
#[derive(Clone, Copy)]
struct Proxied<'a> {
    path: &'static str,
    headers: &'a HeaderMap,
    request: &'a Map<String, Value>,
    received: Instant,
}

/// The value of a `Result<_, Reject>`, or, from the enclosing `Outcome` handler, the rejection's
/// response.
macro_rules! or_reject {
    ($result:expr) => {
        match $result {
            Ok(v) => v,
            Err(r) => return Outcome::Response(r.into_response()),
        }
    };
}

enum Outcome {
    Response(Response<ProxyBody>),
    /// A leg could not connect: nothing reached a server that matters, so the request may go again.
    Retry(Leg, LegError),
}

/// Parses a client's request body: a JSON object, or a clear message why not.
pub(crate) fn parse_request(bytes: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(format!("the request body must be a JSON object, not {}", json_kind(&other))),
        Err(e) => Err(format!("the request body is not valid JSON: {e}")),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A 128-bit random transfer id, 32 lowercase hex digits.
pub(crate) fn mint_transfer_id() -> Result<String, getrandom::Error> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// P's request: one token, not streamed, asked to keep its KV for a remote decode. `consumer` is the
/// KV engine id of the D chosen for the request when known: P then serves its KV to that engine only
/// (`consumer_engine_id`; another engine holding the secret that registers the transfer is refused).
/// `token_ids`: P is asked for its prompt's token ids and its token's id (`return_token_ids`), which
/// D's continuation of P's token is made of (`first_token`).
pub(crate) fn prefill_body(
    request: &Map<String, Value>,
    transfer_id: &str,
    consumer: Option<&str>,
    token_ids: bool,
) -> Map<String, Value> {
    let mut m = request.clone();
    if token_ids {
        m.insert("return_token_ids".into(), json!(true));
    }
    m.insert("max_tokens".into(), json!(1));
    if m.contains_key("max_completion_tokens") {
        m.insert("max_completion_tokens".into(), json!(1));
    }
    m.remove("min_tokens");
    m.insert("stream".into(), json!(false));
    m.remove("stream_options");
    let mut params = json!({ "do_remote_decode": true, "transfer_id": transfer_id });
    if let (Some(c), Some(p)) = (consumer, params.as_object_mut()) {
        p.insert("consumer_engine_id".into(), json!(c));
    }
    m.insert("kv_transfer_params".into(), params);
    m
}

/// D's request in push mode: the client's request, told where the KV comes from.
///
/// `remote_request_id` is P's vLLM request id as far as a proxy can know it: vLLM names a request
/// `cmpl-<X-Request-Id>-<prompt index>` (`chatcmpl-<X-Request-Id>` for chat) before its engine adds a
/// random suffix, and both legs carry `X-Request-Id` = the transfer id. kvpush's connector does not
/// need it; vLLM's own push connector on D requires the key (it names P's request in its heartbeats
/// and logs), so with it stock vLLM runs behind this router unmodified.
pub(crate) fn push_decode_body(
    request: &Map<String, Value>,
    path: &str,
    transfer_id: &str,
    p: &PushTarget,
) -> Map<String, Value> {
    let remote_request_id = if path == Endpoint::ChatCompletions.path() {
        format!("chatcmpl-{transfer_id}")
    } else {
        format!("cmpl-{transfer_id}-0")
    };
    let mut m = request.clone();
    let mut params = json!({
            "do_remote_prefill": true,
            "transfer_id": transfer_id,
            "remote_request_id": remote_request_id,
            "remote_engine_id": p.engine_id,
            "remote_host": p.host,
            "remote_port": p.port,
            "tp_size": p.tp_size,
            "pp_size": p.pp_size,
    });
    if !p.ranks.is_empty() {
        params["remote_ranks"] = json!(p.ranks);
    }
    m.insert("kv_transfer_params".into(), params);
    m
}

fn to_bytes(m: &Map<String, Value>) -> Bytes {
    // Serializing a map with string keys cannot fail.
    Bytes::from(serde_json::to_vec(m).unwrap_or_default())
}

/// A response decided before any leg was sent.
struct Reject {
    status: StatusCode,
    kind: ErrorKind,
    message: String,
}

impl Reject {
    fn into_response(self) -> Response<ProxyBody> {
        error_response(self.status, self.kind, &self.message)
    }
}

fn pick(shared: &Shared, leg: Leg) -> Result<Lease, Reject> {
    let (pool, kind) = match leg {
        Leg::Prefill => (&shared.prefill, ErrorKind::NoPrefillInstance),
        Leg::Decode => (&shared.decode, ErrorKind::NoDecodeInstance),
    };
    pool.pick().ok_or_else(|| {
        shared.metrics.error(kind);
        let reasons: Vec<String> = pool
            .instances()
            .iter()
            .map(|i| format!("{} ({})", i.base, i.down_reason().unwrap_or_else(|| "not ready".into())))
            .collect();
        let message = format!("no {} server in rotation: {}", pool.role().as_str(), reasons.join(", "));
        Reject { status: StatusCode::SERVICE_UNAVAILABLE, kind, message }
    })
}

fn transfer_id(shared: &Shared) -> Result<String, Reject> {
    mint_transfer_id().map_err(|e| {
        shared.metrics.error(ErrorKind::Internal);
        let message = format!("no randomness for a transfer id: {e}");
        Reject { status: StatusCode::INTERNAL_SERVER_ERROR, kind: ErrorKind::Internal, message }
    })
}

/// Runs the prefill leg to its end: the whole response, parsed as JSON. Counts its outcome.
async fn prefill_leg(
    shared: Arc<Shared>,
    lease: Lease,
    path: &'static str,
    headers: HeaderMap,
    tid: String,
    body: Bytes,
) -> PrefillResult {
    let inst = Arc::clone(lease.instance());
    let started = Instant::now();
    let timeout = shared.config.prefill_timeout;
    let fut = async {
        let leg = LegRequest { method: Method::POST, path, headers: &headers, request_id: &tid, body };
        timeline::record("router_p_sent", &tid);
        let resp = upstream::send(&shared.client, &inst, leg, timeout).await?;
        let status = resp.status();
        let content_type = resp.headers().get(CONTENT_TYPE).cloned();
        let url = format!("{}{path}", inst.base);
        let body = Limited::new(resp.into_body(), MAX_UPSTREAM_JSON)
            .collect()
            .await
            .map_err(|e| LegError::Broken { url: url.clone(), detail: format!("reading the response: {e}") })?
            .to_bytes();
        if !status.is_success() {
            return Err(LegError::Status { status, content_type, body });
        }
        serde_json::from_slice::<Value>(&body)
            .map_err(|e| LegError::BadResponse { url, detail: format!("response is not JSON: {e}") })
    };
    let result = match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => {
            inst.mark_down(&format!("prefill leg took longer than {:.1} s", timeout.as_secs_f64()));
            Err(LegError::Timeout { url: format!("{}{path}", inst.base), after: timeout })
        }
    };
    timeline::record("router_p_done", &tid);
    match &result {
        Ok(_) => shared.metrics.prefill_leg.observe(started.elapsed()),
        Err(e) => shared.metrics.error(leg_error_kind(Leg::Prefill, e)),
    }
    drop(lease);
    result
}

async fn push(shared: &Arc<Shared>, proxied: Proxied<'_>, tid: &str) -> Outcome {
    let Proxied { path, headers, request, received } = proxied;
    let p_lease = or_reject!(pick(shared, Leg::Prefill));
    let d_lease = or_reject!(pick(shared, Leg::Decode));
    timeline::record_at("router_recv", tid, received);
    let Some(target) = p_lease.instance().push_target() else {
        // Admission guarantees an engine id for an in-rotation push-mode P; be explicit anyway.
        shared.metrics.error(ErrorKind::Internal);
        let msg = format!("prefill server {} has no engine id", p_lease.instance().base);
        return Outcome::Response(error_response(StatusCode::INTERNAL_SERVER_ERROR, ErrorKind::Internal, &msg));
    };
    let consumer = d_lease.instance().engine_id();
    let first = first_from_prefill(shared, proxied, tid);
    let p_body = to_bytes(&prefill_body(request, tid, consumer.as_deref(), !matches!(first, First::FromDecode)));
    let d_body = to_bytes(&push_decode_body(request, path, tid, &target));
    if shared.config.push_decode_after_prefill {
        if let First::Eligible(resend) = first {
            return push_after_prefill(shared, proxied, tid, p_lease, d_lease, p_body, d_body, resend).await;
        }
    }
    let d_inst = Arc::clone(d_lease.instance());

    // Both legs leave now: P on its own task, D right here.
    let mut p_task = AbortOnDrop(Some(tokio::spawn(prefill_leg(
        Arc::clone(shared),
        p_lease,
        path,
        headers.clone(),
        tid.to_owned(),
        p_body,
    ))));
    let decode_sent = Instant::now();
    let timeout = shared.config.decode_timeout;
    let d_leg = LegRequest { method: Method::POST, path, headers, request_id: tid, body: d_body };
    timeline::record("router_d_sent", tid);
    let d_fut = upstream::send(&shared.client, &d_inst, d_leg, timeout);
    tokio::pin!(d_fut);

    let Some(p_handle) = p_task.0.as_mut() else {
        return Outcome::Response(internal("prefill task missing"));
    };
    let mut answered = None;
    let d_result = tokio::select! {
        joined = p_handle => {
            p_task.0 = None;
            let result = joined.unwrap_or_else(|e| Err(LegError::Broken { url: "prefill task".into(), detail: e.to_string() }));
            match result {
                Err(e) if e.is_connect() => return Outcome::Retry(Leg::Prefill, e),
                Err(e) => return Outcome::Response(leg_error_response(Leg::Prefill, &e)),
                Ok(v) => {
                    answered = Some(v);
                    d_fut.await
                }
            }
        }
        d = &mut d_fut => d,
    };
    match d_result {
        Err(e) => {
            shared.metrics.error(leg_error_kind(Leg::Decode, &e));
            if e.is_connect() {
                Outcome::Retry(Leg::Decode, e)
            } else {
                Outcome::Response(leg_error_response(Leg::Decode, &e))
            }
        }
        Ok(resp) => {
            timeline::record("router_d_head", tid);
            let status = resp.status();
            let prefill = if status.is_success() {
                p_task.take()
            } else {
                // D refused the request: P's work would be wasted; p_task aborts it when dropped.
                shared.metrics.error(ErrorKind::DecodeStatus);
                None
            };
            let head = RelayHead { tid, received, decode_sent, prefill, first, answered };
            Outcome::Response(relay(shared, resp, head, d_lease))
        }
    }
}

/// Push with D's leg sent once P answered (`push_decode_after_prefill`): P's answer is the client's first
/// token at once, then D's stream of the client's request relayed with its first token checked against
/// P's (`First::Sent`: a different token makes D continue from P's). P's blocks wait for D's
/// registration under P's lease; D's admission no longer competes with P's prefill for shared CPUs. An
/// answer that cannot stand for the first token sends D's leg then, relayed as D sends it.
#[allow(clippy::too_many_arguments)]
async fn push_after_prefill(
    shared: &Arc<Shared>,
    proxied: Proxied<'_>,
    tid: &str,
    p_lease: Lease,
    d_lease: Lease,
    p_body: Bytes,
    d_body: Bytes,
    resend: Box<Resend>,
) -> Outcome {
    let Proxied { path, headers, request, received } = proxied;
    // Run inline: a client that goes away drops this future, and with it P's request.
    let p_json = match prefill_leg(Arc::clone(shared), p_lease, path, headers.clone(), tid.to_owned(), p_body).await {
        Ok(v) => v,
        Err(e) if e.is_connect() => return Outcome::Retry(Leg::Prefill, e),
        Err(e) => return Outcome::Response(leg_error_response(Leg::Prefill, &e)),
    };
    let Some(pre) = first_token::from_prefill(&p_json, request) else {
        let decode_sent = Instant::now();
        return match send_decode(shared, d_lease.instance(), path, headers, tid, d_body).await {
            Ok(resp) => {
                let head =
                    RelayHead { tid, received, decode_sent, prefill: None, first: First::FromDecode, answered: None };
                Outcome::Response(relay(shared, resp, head, d_lease))
            }
            Err(e) => Outcome::Response(leg_error_response(Leg::Decode, &e)),
        };
    };
    let (shared2, headers, tid2) = (Arc::clone(shared), headers.clone(), tid.to_owned());
    let first = First::Sent(pre.sent, Some((resend, pre.continuation)));
    let decode = async move {
        let timeline_id = timeline::enabled().then(|| tid2.clone());
        let decode_sent = Instant::now();
        let sent = send_decode(&shared2, d_lease.instance(), path, &headers, &tid2, d_body).await;
        let (body, lease, decode_sent) = event_stream(path, sent.map(|r| (r, d_lease, decode_sent))).await?;
        let mut relay = Relay::new(shared2, body, true, received, decode_sent, None, lease, true, first, None);
        relay.timeline_id = timeline_id;
        Ok(relay)
    };
    let tl_id = timeline::enabled().then(|| tid.to_owned());
    let early = Early::new(Arc::clone(shared), received, pre.event, Box::pin(decode), tl_id);
    let mut out = Response::new(ProxyBody::early(early));
    out.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    Outcome::Response(out)
}

/// Sends D's leg to `inst` with the timeline's marks; an error status or a failed leg is counted.
async fn send_decode(
    shared: &Shared,
    inst: &Instance,
    path: &'static str,
    headers: &HeaderMap,
    tid: &str,
    body: Bytes,
) -> Result<Response<Incoming>, LegError> {
    let d_leg = LegRequest { method: Method::POST, path, headers, request_id: tid, body };
    timeline::record("router_d_sent", tid);
    let sent = upstream::send(&shared.client, inst, d_leg, shared.config.decode_timeout).await;
    match &sent {
        Ok(resp) => {
            timeline::record("router_d_head", tid);
            if !resp.status().is_success() {
                shared.metrics.error(ErrorKind::DecodeStatus);
            }
        }
        Err(e) => shared.metrics.error(leg_error_kind(Leg::Decode, e)),
    }
    sent
}

/// Whether the client's first token may come from P's answer (`first_token`).
fn first_from_prefill(shared: &Shared, proxied: Proxied<'_>, tid: &str) -> First {
    if shared.config.first_token_from_prefill && first_token::eligible(proxied.request, proxied.path) {
        let Proxied { path, headers, request, .. } = proxied;
        First::Eligible(Box::new(Resend { request: request.clone(), path, headers: headers.clone(), tid: tid.into() }))
    } else {
        First::FromDecode
    }
}

async fn pull(shared: &Arc<Shared>, proxied: Proxied<'_>, tid: &str) -> Outcome {
    let Proxied { path, headers, request, received } = proxied;
    let p_lease = or_reject!(pick(shared, Leg::Prefill));
    timeline::record_at("router_recv", tid, received);
    // D is chosen after P answers (and may be retried on another D): P is not told a consumer.
    let eligible = shared.config.first_token_from_prefill && first_token::eligible(request, path);
    let p_body = to_bytes(&prefill_body(request, tid, None, eligible));
    let p_url = format!("{}{path}", p_lease.instance().base);
    // Run inline: a client that goes away drops this future, and with it P's request.
    let p_json = match prefill_leg(Arc::clone(shared), p_lease, path, headers.clone(), tid.to_owned(), p_body).await {
        Ok(v) => v,
        Err(e) if e.is_connect() => return Outcome::Retry(Leg::Prefill, e),
        Err(e) => return Outcome::Response(leg_error_response(Leg::Prefill, &e)),
    };
    let mut params = match p_json.get("kv_transfer_params") {
        Some(Value::Object(m)) => m.clone(),
        _ => {
            let e = LegError::BadResponse {
                url: p_url,
                detail: "the prefill response has no kv_transfer_params object (is P's KV connector a producer?)"
                    .into(),
            };
            shared.metrics.error(ErrorKind::PrefillBadResponse);
            return Outcome::Response(leg_error_response(Leg::Prefill, &e));
        }
    };
    params.entry("transfer_id").or_insert_with(|| json!(tid));
    if let Some(pre) = eligible.then(|| first_token::from_prefill(&p_json, request)).flatten() {
        // The client's stream begins now, with P's token; D continues from it (loading the KV of P's
        // whole prompt and computing only the position after P's token) once its head is in.
        let first_token::Continuation { request: mut d_req, fixup } = pre.continuation;
        d_req.insert("kv_transfer_params".into(), Value::Object(params));
        return Outcome::Response(early_pull(shared, proxied, tid, to_bytes(&d_req), pre.event, fixup));
    }
    let mut d_req = request.clone();
    d_req.insert("kv_transfer_params".into(), Value::Object(params));
    let d_body = to_bytes(&d_req);
    match pull_decode(shared, path, headers, tid, d_body).await {
        Ok((resp, d_lease, decode_sent)) => {
            let head =
                RelayHead { tid, received, decode_sent, prefill: None, first: First::FromDecode, answered: None };
            Outcome::Response(relay(shared, resp, head, d_lease))
        }
        Err(DecodeFailed::Reject(r)) => Outcome::Response(r.into_response()),
        Err(DecodeFailed::Leg(e)) => Outcome::Response(leg_error_response(Leg::Decode, &e)),
    }
}

/// Why pull's decode leg has no response to relay.
enum DecodeFailed {
    /// No D in rotation.
    Reject(Reject),
    /// The leg failed (after the retries a connect failure gets).
    Leg(LegError),
}

/// Pull's decode leg, sent again to a D picked anew while it cannot connect (P's KV stays readable by
/// any D): D's response head (error statuses counted), its lease and when it was sent.
async fn pull_decode(
    shared: &Arc<Shared>,
    path: &'static str,
    headers: &HeaderMap,
    tid: &str,
    d_body: Bytes,
) -> Result<(Response<Incoming>, Lease, Instant), DecodeFailed> {
    let mut tries = 0;
    loop {
        let d_lease = pick(shared, Leg::Decode).map_err(DecodeFailed::Reject)?;
        let d_inst = Arc::clone(d_lease.instance());
        let decode_sent = Instant::now();
        match send_decode(shared, &d_inst, path, headers, tid, d_body.clone()).await {
            Ok(resp) => return Ok((resp, d_lease, decode_sent)),
            Err(e) => {
                if e.is_connect() && tries < shared.config.connect_retries {
                    tries += 1;
                    shared.metrics.retry();
                    continue;
                }
                return Err(DecodeFailed::Leg(e));
            }
        }
    }
}

/// A decode leg whose body goes on a stream that began already (with P's token): D's event-stream body,
/// its lease and when it was sent; anything else — no D, a failed leg, an error status, a body that is
/// not an event stream — is the error event that ends the client's stream (the status is sent already).
pub(crate) async fn decode_stream(
    shared: Arc<Shared>,
    path: &'static str,
    headers: HeaderMap,
    tid: String,
    d_body: Bytes,
) -> DecodeStream {
    let (resp, lease, decode_sent) = match pull_decode(&shared, path, &headers, &tid, d_body).await {
        Ok(r) => r,
        Err(DecodeFailed::Reject(r)) => return Err(error_event(&r.message, r.kind.as_str())),
        Err(DecodeFailed::Leg(e)) => return Err(decode_error_event(&e)),
    };
    event_stream(path, Ok((resp, lease, decode_sent))).await
}

/// The error event that ends a client's stream begun already, for D's failed leg.
fn decode_error_event(e: &LegError) -> Bytes {
    let (_, message) = leg_error_message(Leg::Decode, e);
    error_event(&message, leg_error_kind(Leg::Decode, e).as_str())
}

/// D's answer on a stream begun already: its event-stream body, lease and when it was sent; a failed
/// leg, an error status or a body that is not an event stream is the error event that ends the stream.
async fn event_stream(
    path: &'static str,
    sent: Result<(Response<Incoming>, Lease, Instant), LegError>,
) -> DecodeStream {
    let (resp, lease, decode_sent) = match sent {
        Ok(r) => r,
        Err(e) => return Err(decode_error_event(&e)),
    };
    let (parts, body) = resp.into_parts();
    if !parts.status.is_success() || !is_sse(&parts.headers) {
        let url = format!("{}{path}", lease.instance().base);
        let got = Limited::new(body, MAX_UPSTREAM_JSON).collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let content_type = parts.headers.get(CONTENT_TYPE).cloned();
        let e = if parts.status.is_success() {
            LegError::BadResponse { url, detail: "the decode response is not an event stream".into() }
        } else {
            LegError::Status { status: parts.status, content_type, body: got }
        };
        let (_, message) = leg_error_message(Leg::Decode, &e);
        return Err(error_event(&message, leg_error_kind(Leg::Decode, &e).as_str()));
    }
    Ok((body, lease, decode_sent))
}

/// Pull with P's token first (`first_token`): a `200` event stream that sends P's token at once and
/// then D's continuation of it; whatever goes wrong on D's side after that ends the stream with an
/// error event (the status is sent already).
fn early_pull(
    shared: &Arc<Shared>,
    proxied: Proxied<'_>,
    tid: &str,
    d_body: Bytes,
    event: Bytes,
    fixup: first_token::Fixup,
) -> Response<ProxyBody> {
    let Proxied { path, headers, received, .. } = proxied;
    let (shared2, headers, tid2) = (Arc::clone(shared), headers.clone(), tid.to_owned());
    let decode = async move {
        let timeline_id = timeline::enabled().then(|| tid2.clone());
        let (body, lease, decode_sent) = decode_stream(Arc::clone(&shared2), path, headers, tid2, d_body).await?;
        let first = First::Continued(fixup);
        let mut relay = Relay::new(shared2, body, true, received, decode_sent, None, lease, true, first, None);
        relay.timeline_id = timeline_id;
        Ok(relay)
    };
    let tl_id = timeline::enabled().then(|| tid.to_owned());
    let early = Early::new(Arc::clone(shared), received, event, Box::pin(decode), tl_id);
    let mut out = Response::new(ProxyBody::early(early));
    out.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    out
}

fn is_sse(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}

/// The client's response with the transfer id replaced by the request's public id everywhere: in its
/// headers, in its body (D's response ids, an error passed through), and as its `x-request-id`.
fn hide_transfer_id(mut resp: Response<ProxyBody>, tid: &str, public: &str) -> Response<ProxyBody> {
    let Some(mask) = IdMask::new(tid, public) else {
        return resp;
    };
    for value in resp.headers_mut().values_mut() {
        if value.as_bytes().windows(tid.len()).any(|w| w == tid.as_bytes()) {
            if let Ok(v) = HeaderValue::from_bytes(&mask.replace_all(value.as_bytes())) {
                *value = v;
            }
        }
    }
    if let Ok(v) = HeaderValue::from_bytes(mask.public()) {
        resp.headers_mut().insert(HeaderName::from_static("x-request-id"), v);
    }
    resp.body_mut().mask(mask);
    resp
}

/// What the relay of D's response needs of the request beside D's response.
struct RelayHead<'a> {
    tid: &'a str,
    received: Instant,
    decode_sent: Instant,
    /// P's leg still running (push).
    prefill: Option<tokio::task::JoinHandle<PrefillResult>>,
    first: First,
    /// P's answer, if it came already.
    answered: Option<Value>,
}

/// Hands D's response to the client: status and headers now, the body frame by frame.
fn relay(shared: &Arc<Shared>, resp: Response<Incoming>, head: RelayHead<'_>, lease: Lease) -> Response<ProxyBody> {
    let RelayHead { tid, received, decode_sent, prefill, first, answered } = head;
    let (parts, body) = resp.into_parts();
    let sse = is_sse(&parts.headers);
    let success = parts.status.is_success();
    // Only into a successful event stream: an error status or a JSON body goes through as D sent it.
    let first = if success && sse { first } else { First::FromDecode };
    let mut relay =
        Relay::new(Arc::clone(shared), body, sse, received, decode_sent, prefill, lease, success, first, answered);
    if timeline::enabled() {
        relay.timeline_id = Some(tid.to_owned());
    }
    let mut out = Response::new(ProxyBody::relay(relay));
    *out.status_mut() = parts.status;
    *out.headers_mut() = upstream::forwardable_response_headers(&parts.headers);
    out
}

fn health(shared: &Shared) -> Response<ProxyBody> {
    let list = |pool: &upstream::Pool| -> Vec<Value> {
        pool.instances()
            .iter()
            .map(|i| {
                json!({
                    "url": i.base,
                    "up": i.is_up(),
                    "outstanding": i.outstanding(),
                    "reason": i.down_reason(),
                })
            })
            .collect()
    };
    let ok = shared.prefill.any_up() && shared.decode.any_up();
    let body = json!({
        "status": if ok { "ok" } else { "unavailable" },
        "mode": shared.config.mode.to_string(),
        "prefill": list(&shared.prefill),
        "decode": list(&shared.decode),
    });
    let mut r = Response::new(ProxyBody::full(body.to_string()));
    *r.status_mut() = if ok { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// `GET /v1/models`, answered by a decode server (P and D serve the same model).
async fn models(shared: &Arc<Shared>, headers: &HeaderMap) -> Response<ProxyBody> {
    let lease = match pick(shared, Leg::Decode) {
        Ok(l) => l,
        Err(r) => return r.into_response(),
    };
    let inst = Arc::clone(lease.instance());
    let headers = upstream::forwardable_request_headers(headers);
    let timeout = shared.config.probe_timeout.max(std::time::Duration::from_secs(10));
    let leg = LegRequest {
        method: Method::GET,
        path: "/v1/models",
        headers: &headers,
        request_id: "models",
        body: Bytes::new(),
    };
    match upstream::send(&shared.client, &inst, leg, timeout).await {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            let bytes = match Limited::new(body, MAX_UPSTREAM_JSON).collect().await {
                Ok(c) => c.to_bytes(),
                Err(e) => {
                    let msg = format!("reading /v1/models from {}: {e}", inst.base);
                    return error_response(StatusCode::BAD_GATEWAY, ErrorKind::DecodeBroken, &msg);
                }
            };
            let mut r = Response::new(ProxyBody::full(bytes));
            *r.status_mut() = parts.status;
            *r.headers_mut() = upstream::forwardable_response_headers(&parts.headers);
            r
        }
        Err(e) => leg_error_response(Leg::Decode, &e),
    }
}

/// The metrics kind of a leg's failure.
pub(crate) fn leg_error_kind(leg: Leg, e: &LegError) -> ErrorKind {
    match (leg, e) {
        (Leg::Prefill, LegError::Connect { .. }) => ErrorKind::PrefillConnect,
        (Leg::Prefill, LegError::Timeout { .. }) => ErrorKind::PrefillTimeout,
        (Leg::Prefill, LegError::Status { .. }) => ErrorKind::PrefillStatus,
        (Leg::Prefill, LegError::BadResponse { .. }) => ErrorKind::PrefillBadResponse,
        (Leg::Prefill, LegError::Broken { .. }) => ErrorKind::PrefillBroken,
        (Leg::Decode, LegError::Connect { .. }) => ErrorKind::DecodeConnect,
        (Leg::Decode, LegError::Timeout { .. }) => ErrorKind::DecodeTimeout,
        (Leg::Decode, LegError::Status { .. }) => ErrorKind::DecodeStatus,
        (Leg::Decode, LegError::BadResponse { .. } | LegError::Broken { .. }) => ErrorKind::DecodeBroken,
    }
}

/// HTTP status and a one-line message for a leg's failure.
pub(crate) fn leg_error_message(leg: Leg, e: &LegError) -> (StatusCode, String) {
    let name = match leg {
        Leg::Prefill => "prefill",
        Leg::Decode => "decode",
    };
    match e {
        LegError::Connect { url, detail } => {
            (StatusCode::BAD_GATEWAY, format!("{name} leg failed: cannot connect to {url}: {detail}"))
        }
        LegError::Timeout { url, after } => (
            StatusCode::GATEWAY_TIMEOUT,
            format!("{name} leg failed: {url} did not answer within {:.1} s", after.as_secs_f64()),
        ),
        LegError::Status { status, body, .. } => {
            let text = String::from_utf8_lossy(&body[..body.len().min(1024)]).into_owned();
            (*status, format!("{name} leg failed: the {name} server answered {status}: {text}"))
        }
        LegError::BadResponse { url, detail } => {
            (StatusCode::BAD_GATEWAY, format!("{name} leg failed: bad response from {url}: {detail}"))
        }
        LegError::Broken { url, detail } => {
            (StatusCode::BAD_GATEWAY, format!("{name} leg failed: connection to {url} broke: {detail}"))
        }
    }
}

/// The client's response for a failed leg (the other leg is cancelled by the caller). An upstream error
/// status passes through with its body when that body is JSON; everything else is an OpenAI-shaped error.
/// The `x-kvpush-failed-leg` header names the leg.
pub(crate) fn leg_error_response(leg: Leg, e: &LegError) -> Response<ProxyBody> {
    let leg_name = HeaderValue::from_static(if leg == Leg::Prefill { "prefill" } else { "decode" });
    let mut r = match e {
        LegError::Status { status, content_type, body } if serde_json::from_slice::<Value>(body).is_ok() => {
            let mut r = Response::new(ProxyBody::full(body.clone()));
            *r.status_mut() = *status;
            let ct = content_type.clone().unwrap_or(HeaderValue::from_static("application/json"));
            r.headers_mut().insert(CONTENT_TYPE, ct);
            r
        }
        _ => {
            let (status, msg) = leg_error_message(leg, e);
            error_response(status, leg_error_kind(leg, e), &msg)
        }
    };
    r.headers_mut().insert("x-kvpush-failed-leg", leg_name);
    r
}

/// `{"error": {"message", "type", "param": null, "code"}}`, OpenAI's error shape.
pub(crate) fn error_json(message: &str, kind: &str, code: &str) -> Vec<u8> {
    let v = json!({ "error": { "message": message, "type": kind, "param": null, "code": code } });
    v.to_string().into_bytes()
}

pub(crate) fn error_response(status: StatusCode, kind: ErrorKind, message: &str) -> Response<ProxyBody> {
    let ty = if status.is_client_error() { "invalid_request_error" } else { "server_error" };
    let mut r = Response::new(ProxyBody::full(error_json(message, ty, kind.as_str())));
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn internal(msg: &str) -> Response<ProxyBody> {
    error_response(StatusCode::INTERNAL_SERVER_ERROR, ErrorKind::Internal, msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_ids_are_128_bit_hex_and_differ() {
        let a = mint_transfer_id().unwrap();
        let b = mint_transfer_id().unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
    }

    #[test]
    fn bad_bodies_get_clear_messages() {
        assert!(parse_request(b"{").unwrap_err().contains("not valid JSON"));
        assert!(parse_request(b"[1]").unwrap_err().contains("not an array"));
        assert!(parse_request(&[0xff, 0xfe]).unwrap_err().contains("not valid JSON"));
        let deep = "[".repeat(100_000);
        assert!(parse_request(deep.as_bytes()).is_err());
        assert!(parse_request(b"{\"prompt\": \"x\"}").is_ok());
    }

    #[test]
    fn prefill_body_asks_for_one_token_without_streaming() {
        let req = parse_request(
            br#"{"prompt":"hi","max_tokens":50,"max_completion_tokens":50,"min_tokens":5,"stream":true,
                "stream_options":{"include_usage":true},"kv_transfer_params":{"evil":1}}"#,
        )
        .unwrap();
        let p = prefill_body(&req, "t1", None, false);
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(!p.contains_key("min_tokens") && !p.contains_key("stream_options"));
        assert_eq!(p["kv_transfer_params"], json!({"do_remote_decode": true, "transfer_id": "t1"}));
        assert_eq!(p["prompt"], "hi");
    }

    #[test]
    fn prefill_body_names_the_consumer_engine_when_known() {
        let req = parse_request(br#"{"prompt":"hi","kv_transfer_params":{"consumer_engine_id":"evil"}}"#).unwrap();
        let p = prefill_body(&req, "t1", Some("d-engine-0"), false);
        let want = json!({"do_remote_decode": true, "transfer_id": "t1", "consumer_engine_id": "d-engine-0"});
        assert_eq!(p["kv_transfer_params"], want);
        // The client's own kv_transfer_params never reach P, with or without a known consumer.
        let p = prefill_body(&req, "t1", None, false);
        assert_eq!(p["kv_transfer_params"], json!({"do_remote_decode": true, "transfer_id": "t1"}));
    }
}
