//! Fake P and D servers for the router tests: real HTTP/1.1 on 127.0.0.1 with ephemeral ports, a
//! scripted handler per server, a log of what each server received, and probes that can be told to fail.

#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{HeaderMap, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

/// What a fake server received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub headers: HeaderMap,
    pub json: Value,
    pub at: Instant,
}

/// A fake server's response body: all at once, or chunks pushed through a channel (the sender's
/// `send` fails once the router has closed the connection).
pub enum FakeBody {
    Full(Option<Bytes>),
    Chan(mpsc::Receiver<Bytes>),
}

impl http_body::Body for FakeBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut *self {
            FakeBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            FakeBody::Chan(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }
}

pub type Reply = Response<FakeBody>;
pub type Handler = Arc<dyn Fn(Seen) -> Pin<Box<dyn Future<Output = Reply> + Send>> + Send + Sync>;

/// Wraps an async closure as a [`Handler`].
pub fn handler<F, Fut>(f: F) -> Handler
where
    F: Fn(Seen) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    Arc::new(move |s| Box::pin(f(s)))
}

/// A handler that tells `seen` of each request, then answers it only after 30 s, with `body` (JSON,
/// status 200), reporting on `tx` whether the request was dropped before then (see [`DropProbe`]).
pub fn hanging(tx: mpsc::UnboundedSender<bool>, body: Value, seen: impl Fn(&Seen) + Send + Sync + 'static) -> Handler {
    handler(move |s: Seen| {
        seen(&s);
        let probe = DropProbe::new(tx.clone());
        let body = body.clone();
        async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            probe.done();
            json_reply(200, &body)
        }
    })
}

pub fn json_reply(status: u16, v: &Value) -> Reply {
    let mut r = Response::new(FakeBody::Full(Some(Bytes::from(v.to_string()))));
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    r.headers_mut().insert(CONTENT_TYPE, "application/json".parse().unwrap());
    r
}

pub fn text_reply(status: u16, text: &str) -> Reply {
    let mut r = Response::new(FakeBody::Full(Some(Bytes::from(text.to_owned()))));
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    r.headers_mut().insert(CONTENT_TYPE, "text/plain".parse().unwrap());
    r
}

/// An SSE response whose chunks the caller pushes through the returned sender.
pub fn sse_reply() -> (Reply, mpsc::Sender<Bytes>) {
    let (tx, rx) = mpsc::channel(16);
    let mut r = Response::new(FakeBody::Chan(rx));
    r.headers_mut().insert(CONTENT_TYPE, "text/event-stream".parse().unwrap());
    (r, tx)
}

pub fn sse_event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// A completion response in the OpenAI shape.
pub fn completion(text: &str) -> Value {
    serde_json::json!({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]})
}

/// How a fake answers `GET /health`.
pub const HEALTH_OK: u8 = 0;
pub const HEALTH_503: u8 = 1;
pub const HEALTH_HANG: u8 = 2;

/// A running fake server. Dropping it closes the listener and every connection.
pub struct Fake {
    pub addr: SocketAddr,
    pub url: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub health: Arc<AtomicU8>,
    /// `GET /health` requests answered so far (whatever the answer).
    pub probes: Arc<AtomicUsize>,
    tasks: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Fake {
    /// Starts a fake on an ephemeral port; `info` is served on `GET /v1/kvpush/info` (404 when None).
    pub async fn start(info: Option<Value>, h: Handler) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Fake::serve(listener, info, h)
    }

    /// Starts a fake on a given address (to bring a "dead" server back on its port).
    pub async fn start_at(addr: SocketAddr, info: Option<Value>, h: Handler) -> Fake {
        let listener = TcpListener::bind(addr).await.unwrap();
        Fake::serve(listener, info, h)
    }

    fn serve(listener: TcpListener, info: Option<Value>, h: Handler) -> Fake {
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let health = Arc::new(AtomicU8::new(HEALTH_OK));
        let probes = Arc::new(AtomicUsize::new(0));
        let tasks: Arc<Mutex<Vec<AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let (seen2, health2, probes2, tasks2) = (seen.clone(), health.clone(), probes.clone(), tasks.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let _ = stream.set_nodelay(true);
                let (seen, health, probes, info, h) =
                    (seen2.clone(), health2.clone(), probes2.clone(), info.clone(), h.clone());
                let conn = tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (seen, health, probes, info, h) =
                            (seen.clone(), health.clone(), probes.clone(), info.clone(), h.clone());
                        async move {
                            let (parts, body) = req.into_parts();
                            let raw = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
                            let path = parts.uri.path().to_owned();
                            if parts.method == Method::GET && path == "/health" {
                                probes.fetch_add(1, Ordering::SeqCst);
                                match health.load(Ordering::SeqCst) {
                                    HEALTH_OK => return Ok::<_, Infallible>(text_reply(200, "")),
                                    HEALTH_503 => return Ok(text_reply(503, "unhealthy")),
                                    _ => std::future::pending::<()>().await,
                                }
                            }
                            if parts.method == Method::GET && path == "/v1/kvpush/info" {
                                return Ok(match &info {
                                    Some(v) => json_reply(200, v),
                                    None => text_reply(404, "Not Found"),
                                });
                            }
                            let s = Seen {
                                method: parts.method,
                                path,
                                headers: parts.headers,
                                json: serde_json::from_slice(&raw).unwrap_or(Value::Null),
                                at: Instant::now(),
                            };
                            seen.lock().unwrap().push(s.clone());
                            Ok(h(s).await)
                        }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
                tasks2.lock().unwrap().push(conn.abort_handle());
            }
        });
        tasks.lock().unwrap().push(accept.abort_handle());
        Fake { addr, url: format!("http://{addr}"), seen, health, probes, tasks }
    }

    pub fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        for t in self.tasks.lock().unwrap().iter() {
            t.abort();
        }
    }
}

/// Sends `true` through the channel when dropped before [`DropProbe::done`] — a handler future holding
/// one learns that the router cancelled its request (hyper drops the future when the connection closes).
pub struct DropProbe(Option<mpsc::UnboundedSender<bool>>);

impl DropProbe {
    pub fn new(tx: mpsc::UnboundedSender<bool>) -> Self {
        DropProbe(Some(tx))
    }
    pub fn done(mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(false);
        }
    }
}

impl Drop for DropProbe {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(true);
        }
    }
}

/// A plain HTTP client for the tests.
pub type TestClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    client_with_pool(32)
}

/// A client keeping up to `idle` connections per host (TCP_NODELAY, as the router's own client).
pub fn client_with_pool(idle: usize) -> TestClient {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_max_idle_per_host(idle).build(connector)
}

pub async fn post(c: &TestClient, url: &str, body: impl Into<Bytes>) -> Response<Incoming> {
    let req = Request::post(url).header(CONTENT_TYPE, "application/json").body(Full::new(body.into())).unwrap();
    c.request(req).await.unwrap()
}

pub async fn get(c: &TestClient, url: &str) -> (StatusCode, HeaderMap, String) {
    let req = Request::get(url).body(Full::new(Bytes::new())).unwrap();
    let resp = c.request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, String::from_utf8_lossy(&bytes).into_owned())
}

pub async fn read_all(resp: Response<Incoming>) -> (StatusCode, HeaderMap, Bytes) {
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, bytes)
}

/// Awaits `f` for at most `secs` seconds, failing the test with `what` otherwise.
pub async fn within<T>(secs: f64, what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs_f64(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {secs} s waiting for: {what}"),
    }
}

/// Polls `cond` every 20 ms until it holds, for at most `secs` seconds.
pub async fn eventually(secs: f64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {secs} s waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
