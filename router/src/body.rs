//! The body the router sends to clients: either a small body it made itself (errors, /health, /metrics)
//! or the decode leg's body relayed frame by frame as it arrives ([`Relay`]).
//!
//! The relay is also where the push-mode request ends: it watches the prefill leg still running beside
//! the decode stream (a prefill failure before D's first byte ends the stream with an error), times D's
//! silences, records TTFT and the decode leg's duration, and — when the client goes away and hyper drops
//! the body — aborts the prefill leg and, by dropping D's body, closes the decode connection. For a
//! streamed greedy completion it sends P's token first and D's stream without it (`first_token`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use serde_json::{Map, Value};
use tokio::task::JoinHandle;
use tokio::time::Sleep;
use tracing::warn;

use super::first_token::{self, Continuation, Fixup, Sent, Step};
use super::metrics::ErrorKind;
use super::timeline;
use super::upstream::{Lease, LegError};
use super::Shared;

/// Error type of [`ProxyBody`]: ends the client's connection abruptly (used only where no in-band error
/// can be sent).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the prefill task returns: P's parsed JSON response, or why the leg failed.
pub(crate) type PrefillResult = Result<Value, LegError>;

/// The response body type of every router response.
#[derive(Debug)]
pub struct ProxyBody(Inner);

#[derive(Debug)]
enum Inner {
    Full(Option<Bytes>),
    Relay(Box<Relay>),
    Early(Box<Early>),
}

/// What the decode leg of a response that began with P's token became: D's stream to relay, or the
/// error event that ends the client's stream.
pub(crate) type DecodeThen = Result<Relay, Bytes>;

/// A pull-mode stream that began before D answered (`first_token`): P's token, then D's relay once
/// D's response head is in.
pub(crate) struct Early {
    shared: Arc<Shared>,
    received: Instant,
    first: Option<Bytes>,
    decode: Pin<Box<dyn Future<Output = DecodeThen> + Send>>,
    done: bool,
    flight: Option<InFlight>,
    mask: Option<IdMask>,
    timeline_id: Option<String>,
}

impl std::fmt::Debug for Early {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Early").field("first", &self.first).field("done", &self.done).finish_non_exhaustive()
    }
}

impl Early {
    pub(crate) fn new(
        shared: Arc<Shared>,
        received: Instant,
        first: Bytes,
        decode: Pin<Box<dyn Future<Output = DecodeThen> + Send>>,
        timeline_id: Option<String>,
    ) -> Self {
        Early { shared, received, first: Some(first), decode, done: false, flight: None, mask: None, timeline_id }
    }
}

impl Drop for Early {
    fn drop(&mut self) {
        if !self.done {
            // The client went away before D's stream took over: D's leg is cancelled as it drops.
            self.shared.metrics.error(ErrorKind::ClientDisconnect);
        }
    }
}

impl ProxyBody {
    pub(crate) fn full(b: impl Into<Bytes>) -> Self {
        let b = b.into();
        ProxyBody(Inner::Full(if b.is_empty() { None } else { Some(b) }))
    }

    pub(crate) fn relay(r: Relay) -> Self {
        ProxyBody(Inner::Relay(Box::new(r)))
    }

    pub(crate) fn early(e: Early) -> Self {
        ProxyBody(Inner::Early(Box::new(e)))
    }

    /// Rewrites the transfer id to the public id in this body (see [`IdMask`]).
    pub(crate) fn mask(&mut self, mask: IdMask) {
        match &mut self.0 {
            Inner::Full(Some(b)) => *b = Bytes::from(mask.replace_all(b)),
            Inner::Full(None) => {}
            Inner::Relay(r) => r.mask = Some(mask),
            Inner::Early(e) => e.mask = Some(mask),
        }
    }

    /// Keeps `flight` alive as long as a relayed body is (a small body drops it at once).
    pub(crate) fn hold(&mut self, flight: InFlight) {
        match &mut self.0 {
            Inner::Relay(r) => r.flight = Some(flight),
            Inner::Early(e) => e.flight = Some(flight),
            Inner::Full(_) => {}
        }
    }
}

/// Counts a client request in `kvpush_router_in_flight` while alive.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<Shared>);

impl InFlight {
    pub(crate) fn new(s: Arc<Shared>) -> Self {
        s.metrics.in_flight(1);
        InFlight(s)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.metrics.in_flight(-1);
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.0 {
            Inner::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Relay(r) => r.poll_frame(cx),
            Inner::Early(e) => {
                if let Some(first) = e.first.take() {
                    let first = match e.mask.as_mut() {
                        Some(m) => m.push(&first),
                        None => first,
                    };
                    e.shared.metrics.ttft.observe(e.received.elapsed());
                    if let Some(tid) = &e.timeline_id {
                        timeline::record("router_p_token", tid);
                        timeline::record("router_first_byte", tid);
                    }
                    return Poll::Ready(Some(Ok(Frame::data(first))));
                }
                if e.done {
                    return Poll::Ready(None);
                }
                match e.decode.as_mut().poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(Err(end)) => {
                        e.done = true;
                        e.flight = None;
                        Poll::Ready(Some(Ok(Frame::data(end))))
                    }
                    Poll::Ready(Ok(mut relay)) => {
                        e.done = true;
                        relay.first_byte = true;
                        relay.mask = e.mask.take();
                        relay.flight = e.flight.take();
                        self.0 = Inner::Relay(Box::new(relay));
                        self.poll_frame(cx)
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Inner::Full(b) => b.is_none(),
            Inner::Relay(r) => r.state == State::Done,
            Inner::Early(e) => e.done && e.first.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Inner::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::Relay(r) if !r.sse => r.upstream.as_ref().map(Body::size_hint).unwrap_or_default(),
            Inner::Relay(_) | Inner::Early(_) => SizeHint::default(),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    Streaming,
    Done,
}

/// The decode leg's body on its way to the client.
#[derive(Debug)]
pub(crate) struct Relay {
    shared: Arc<Shared>,
    /// D's body; None while a continuation replaces it (`recovering`).
    upstream: Option<Incoming>,
    /// D's continuation on its way after D's first token was not P's (push): its body, lease and when
    /// it was sent, or the error event that ends the stream.
    recovering: Option<DecodeLeg>,
    /// The response is an SSE stream: errors are sent in band as a `data: {"error": ...}` event.
    sse: bool,
    /// When the router received the client's request (TTFT is measured from here).
    received: Instant,
    /// When the decode leg was sent.
    decode_sent: Instant,
    first_byte: bool,
    idle: Duration,
    idle_timer: Pin<Box<Sleep>>,
    /// The prefill leg still running (push mode, D answered first).
    prefill: Option<JoinHandle<PrefillResult>>,
    /// D's outstanding count, held until the body ends or is dropped.
    lease: Option<Lease>,
    /// Whether D's 2xx response counts toward the decode leg histogram.
    success: bool,
    state: State,
    /// The body ended (normally or with an error already counted): dropping it is no disconnect.
    finished: bool,
    flight: Option<InFlight>,
    /// Hides the transfer id from the client.
    mask: Option<IdMask>,
    /// The transfer id, where the request timeline is on (its first byte to the client is recorded).
    pub(crate) timeline_id: Option<String>,
    /// Whether the client's first token comes from P's answer (`first_token`).
    first: First,
    /// P's answer, when it came before this relay was made (pull; push when P answered before D's head).
    answered: Option<Value>,
}

/// Where the client's first token comes from (`first_token`).
#[derive(Debug)]
pub(crate) enum First {
    /// From D's stream, as D sends it.
    FromDecode,
    /// From P's answer, if it comes before D's first bytes (push: D's leg has the client's request,
    /// which a continuation is made of if D's first token is not P's).
    Eligible(Box<Resend>),
    /// P's token went out: D's stream is held until its first token event, which goes out without it;
    /// if that token is not P's, D's leg is replaced by the continuation (`Resend`).
    Sent(Sent, Option<(Box<Resend>, Continuation)>),
    /// P's token went out and D's stream is its continuation, rewritten on its way (`Fixup`).
    Continued(Fixup),
}

/// What sending D a continuation takes beside its body: the client's request, and the leg's path,
/// headers and transfer id.
#[derive(Debug)]
pub(crate) struct Resend {
    pub(crate) request: Map<String, Value>,
    pub(crate) path: &'static str,
    pub(crate) headers: HeaderMap,
    pub(crate) tid: String,
}

/// D's leg of a stream that began with P's token, on its way: D's event-stream body, its lease and when
/// it was sent, or the error event that ends the client's stream.
pub(crate) type DecodeStream = Result<(Incoming, Lease, Instant), Bytes>;

/// A decode leg being sent (the future of a [`DecodeStream`]).
pub(crate) struct DecodeLeg(pub(crate) Pin<Box<dyn Future<Output = DecodeStream> + Send>>);

impl std::fmt::Debug for DecodeLeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DecodeLeg")
    }
}

impl Relay {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: Arc<Shared>,
        upstream: Incoming,
        sse: bool,
        received: Instant,
        decode_sent: Instant,
        prefill: Option<JoinHandle<PrefillResult>>,
        lease: Lease,
        success: bool,
        first: First,
        answered: Option<Value>,
    ) -> Self {
        let idle = shared.config.stream_idle_timeout;
        Relay {
            shared,
            upstream: Some(upstream),
            recovering: None,
            sse,
            received,
            decode_sent,
            first_byte: false,
            idle,
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            prefill,
            lease: Some(lease),
            success,
            state: State::Streaming,
            finished: false,
            flight: None,
            mask: None,
            timeline_id: None,
            first,
            answered,
        }
    }

    /// P's answer: the client's first token when it may be (`first_token`), else nothing to send.
    fn prefill_answered(&mut self, answer: &Value) -> Option<Bytes> {
        let First::Eligible(resend) = std::mem::replace(&mut self.first, First::FromDecode) else {
            return None;
        };
        let pre = first_token::from_prefill(answer, &resend.request)?;
        self.first = First::Sent(pre.sent, Some((resend, pre.continuation)));
        if let Some(tid) = &self.timeline_id {
            timeline::record("router_p_token", tid);
        }
        Some(pre.event)
    }

    /// D's first token was not P's (push): D's leg is cancelled (its body and lease dropped) and its
    /// continuation from P's token sent instead; the client sees nothing of it. False when there is no
    /// continuation to send.
    fn recover(&mut self) -> bool {
        let First::Sent(_, Some((resend, cont))) = std::mem::replace(&mut self.first, First::FromDecode) else {
            return false;
        };
        self.shared.metrics.first_token_recovery();
        warn!("decode leg's first token was not prefill's; continuing from prefill's token instead");
        self.upstream = None;
        self.lease = None;
        let Resend { path, headers, tid, .. } = *resend;
        let body = Bytes::from(serde_json::to_vec(&cont.request).unwrap_or_default());
        let leg = super::proxy::decode_stream(Arc::clone(&self.shared), path, headers, tid, body);
        self.recovering = Some(DecodeLeg(Box::pin(leg)));
        self.first = First::Continued(cont.fixup);
        true
    }

    /// Sends `data` to the client: the transfer id masked, the first byte recorded.
    fn send(&mut self, data: Bytes, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let data = match &mut self.mask {
            Some(mask) => mask.push(&data),
            None => data,
        };
        if data.is_empty() {
            // Nothing to send yet (all of it held back): look again at once.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if !self.first_byte {
            self.first_byte = true;
            self.shared.metrics.ttft.observe(self.received.elapsed());
            if let Some(tid) = &self.timeline_id {
                timeline::record("router_first_byte", tid);
            }
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.state == State::Done {
            return Poll::Ready(None);
        }
        if let Some(task) = &mut self.prefill {
            if let Poll::Ready(joined) = Pin::new(task).poll(cx) {
                self.prefill = None;
                let result = joined.unwrap_or_else(|e| {
                    Err(LegError::Broken { url: "prefill task".to_owned(), detail: e.to_string() })
                });
                match result {
                    Ok(answer) => {
                        if let Some(event) = self.prefill_answered(&answer) {
                            return self.send(event, cx);
                        }
                    }
                    Err(e) => {
                        if self.first_byte {
                            warn!(error = ?e, "prefill leg failed after the decode leg's first byte; stream kept");
                        } else {
                            let (_, message) = super::proxy::leg_error_message(super::proxy::Leg::Prefill, &e);
                            return self.fail(None, format!("{message}; the decode leg was cancelled"));
                        }
                    }
                }
            }
        }
        if let Some(answer) = self.answered.take() {
            if let Some(event) = self.prefill_answered(&answer) {
                return self.send(event, cx);
            }
        }
        if let Some(leg) = &mut self.recovering {
            match leg.0.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(end)) => {
                    self.recovering = None;
                    self.finished = true;
                    self.state = State::Done;
                    self.flight = None;
                    return self.send(end, cx);
                }
                Poll::Ready(Ok((body, lease, sent))) => {
                    self.recovering = None;
                    self.upstream = Some(body);
                    self.lease = Some(lease);
                    self.decode_sent = sent;
                    self.idle_timer.as_mut().reset(tokio::time::Instant::now() + self.idle);
                }
            }
        }
        let Some(upstream) = self.upstream.as_mut() else {
            return self.fail(Some(ErrorKind::Internal), "the decode stream is missing".into());
        };
        match Pin::new(upstream).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let idle = self.idle;
                self.idle_timer.as_mut().reset(tokio::time::Instant::now() + idle);
                let data = match frame.into_data() {
                    Ok(d) => d,
                    // Trailers: nothing to mask or count.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                };
                let data = match &mut self.first {
                    First::FromDecode => data,
                    First::Eligible(_) => {
                        // D's stream began before P answered: it goes through as D sends it.
                        self.first = First::FromDecode;
                        data
                    }
                    First::Continued(fixup) => fixup.data(&data),
                    First::Sent(sent, _) => match sent.decode_data(&data) {
                        Ok(Step::Hold) => {
                            cx.waker().wake_by_ref();
                            return Poll::Pending;
                        }
                        Ok(Step::Done(rest)) => {
                            self.first = First::FromDecode;
                            rest
                        }
                        Err(m) => {
                            if self.recover() {
                                cx.waker().wake_by_ref();
                                return Poll::Pending;
                            }
                            return self.fail(Some(ErrorKind::FirstTokenMismatch), m.0);
                        }
                    },
                };
                return self.send(data, cx);
            }
            Poll::Ready(Some(Err(e))) => {
                let url = self.lease.as_ref().map(|l| l.instance().base.clone()).unwrap_or_default();
                let detail = super::upstream::error_chain(&e);
                return self.fail(Some(ErrorKind::DecodeBroken), format!("decode stream from {url} broke: {detail}"));
            }
            Poll::Ready(None) => {
                let held = match &mut self.first {
                    First::Sent(sent, _) => sent.finish(),
                    First::Continued(fixup) => fixup.finish(),
                    First::FromDecode | First::Eligible(_) => None,
                };
                self.first = First::FromDecode;
                if let Some(held) = held {
                    return self.send(held, cx);
                }
                if let Some(rest) = self.mask.as_mut().and_then(IdMask::finish) {
                    return Poll::Ready(Some(Ok(Frame::data(rest))));
                }
                if self.success {
                    self.shared.metrics.decode_leg.observe(self.decode_sent.elapsed());
                }
                self.finished = true;
                self.state = State::Done;
                self.lease = None;
                self.flight = None;
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        if self.idle_timer.as_mut().poll(cx).is_ready() {
            let secs = self.idle.as_secs_f64();
            let url = match &self.lease {
                Some(l) => {
                    l.instance().mark_down(&format!("decode stream silent for {secs:.1} s"));
                    l.instance().base.clone()
                }
                None => String::new(),
            };
            return self
                .fail(Some(ErrorKind::DecodeStreamIdle), format!("decode stream from {url} silent for {secs:.1} s"));
        }
        Poll::Pending
    }

    /// Ends the stream with an error: an SSE error event (then `[DONE]`) for an event stream, an aborted
    /// connection otherwise. Counts `kind` (a prefill failure was counted by its leg).
    fn fail(&mut self, kind: Option<ErrorKind>, message: String) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(k) = kind {
            self.shared.metrics.error(k);
        }
        warn!(%message, "decode stream ended with an error");
        self.finished = true;
        self.lease = None;
        self.flight = None;
        self.state = State::Done;
        if let Some(task) = self.prefill.take() {
            task.abort();
        }
        if self.sse {
            let code = kind.map_or("prefill_failed", ErrorKind::as_str);
            Poll::Ready(Some(Ok(Frame::data(error_event(&message, code)))))
        } else {
            Poll::Ready(Some(Err(message.into())))
        }
    }
}

/// An SSE error event, then `[DONE]`: how an event stream that already began ends with an error.
pub(crate) fn error_event(message: &str, code: &str) -> Bytes {
    let err = super::proxy::error_json(message, "server_error", code);
    let mut event = Vec::with_capacity(err.len() + 32);
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(&err);
    event.extend_from_slice(b"\n\ndata: [DONE]\n\n");
    Bytes::from(event)
}

impl Drop for Relay {
    fn drop(&mut self) {
        if !self.finished {
            // The client went away mid-body: the decode leg closes as `upstream` drops with us.
            self.shared.metrics.error(ErrorKind::ClientDisconnect);
            if let Some(task) = self.prefill.take() {
                task.abort();
            }
        }
        // A prefill leg still running after a complete decode response is left to finish on its own: its
        // KV was already used, and it ends within the prefill timeout.
    }
}

/// Replaces the transfer id in what goes back to the client by the request's public id (as long as the
/// transfer id, so a `content-length` stays true): vLLM names a request after its `X-Request-Id`, which
/// is the transfer id, so D's response ids and echoed headers carry it, and a client must never learn a
/// transfer id (it names the KV of a request in flight). Bodies are rewritten as they stream: the longest
/// tail of a frame that could begin the id is held back until the next frame (or the end) decides.
#[derive(Debug)]
pub(crate) struct IdMask {
    secret: Box<[u8]>,
    public: Box<[u8]>,
    carry: Vec<u8>,
}

impl IdMask {
    /// None when the two ids differ in length or the transfer id is empty.
    pub(crate) fn new(secret: &str, public: &str) -> Option<Self> {
        (!secret.is_empty() && secret.len() == public.len()).then(|| IdMask {
            secret: secret.as_bytes().into(),
            public: public.as_bytes().into(),
            carry: Vec::new(),
        })
    }

    /// The public id.
    pub(crate) fn public(&self) -> &[u8] {
        &self.public
    }

    /// `bytes` with every whole occurrence of the transfer id replaced (no carry involved).
    pub(crate) fn replace_all(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let n = self.secret.len();
        let mut i = 0;
        while i + n <= out.len() {
            if out[i..i + n] == *self.secret {
                out[i..i + n].copy_from_slice(&self.public);
                i += n;
            } else {
                i += 1;
            }
        }
        out
    }

    /// The next chunk of a streamed body, rewritten; bytes that might begin the id are held back.
    pub(crate) fn push(&mut self, chunk: &[u8]) -> Bytes {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let buf = self.replace_all(&buf);
        let hold = (1..self.secret.len()).rev().find(|&k| buf.ends_with(&self.secret[..k])).unwrap_or(0);
        let cut = buf.len() - hold;
        self.carry = buf[cut..].to_vec();
        Bytes::copy_from_slice(&buf[..cut])
    }

    /// What was held back, at the end of the body (None when nothing was).
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        (!self.carry.is_empty()).then(|| Bytes::from(std::mem::take(&mut self.carry)))
    }
}

#[cfg(test)]
mod tests {
    use super::IdMask;

    #[test]
    fn the_transfer_id_is_replaced_even_when_split_across_frames() {
        let secret = "0123456789abcdef0123456789abcdef";
        let public = "ffffffffffffffffffffffffffffffff";
        let body = format!("data: {{\"id\":\"cmpl-{secret}-0\"}}\n\ndata: {secret}{secret}0123\n\n");
        for split in 0..=body.len() {
            let mut m = IdMask::new(secret, public).unwrap();
            let mut out = m.push(&body.as_bytes()[..split]).to_vec();
            out.extend_from_slice(&m.push(&body.as_bytes()[split..]));
            out.extend_from_slice(&m.finish().unwrap_or_default());
            let out = String::from_utf8(out).unwrap();
            assert_eq!(out, body.replace(secret, public), "split at {split}");
        }
        assert!(IdMask::new("ab", "abc").is_none());
        assert!(IdMask::new("", "").is_none());
    }
}
