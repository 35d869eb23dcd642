//! `kvpush router` against fake P and D servers (real HTTP on 127.0.0.1, ephemeral ports): push and pull
//! mode, both legs provably concurrent in push mode, kv_transfer_params on both legs, SSE passthrough
//! chunk by chunk, status and error passthrough, a failed leg cancelling the other, client disconnects
//! aborting both legs, dead and hung servers leaving the rotation and coming back, least-outstanding
//! selection, /health, /metrics, the startup mode check, the configuration and the CLI help.

#![allow(clippy::unwrap_used)]

#[path = "router/fake.rs"]
mod fake;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fake::*;
use http_body_util::BodyExt;
use kvpush_router::{self as router, Config, InstanceConfig, RouterArgs, RouterError, RouterHandle, TransferMode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify, Semaphore};

/// Transfer ids whose decode leg reached the fake D, so a fake P can wait for its D.
#[derive(Default)]
struct Arrivals {
    ids: Mutex<HashSet<String>>,
    notify: Notify,
}

impl Arrivals {
    fn arrive(&self, s: &Seen) {
        self.ids.lock().unwrap().insert(tid(s));
        self.notify.notify_waiters();
    }

    /// Waits until D saw `id` (false after 5 s).
    async fn wait(&self, id: &str) -> bool {
        let fut = async {
            loop {
                let n = self.notify.notified();
                if self.ids.lock().unwrap().contains(id) {
                    return;
                }
                n.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), fut).await.is_ok()
    }
}

fn tid(s: &Seen) -> String {
    s.json["kv_transfer_params"]["transfer_id"].as_str().unwrap_or_default().to_owned()
}

fn p_instance(f: &Fake) -> InstanceConfig {
    InstanceConfig {
        url: f.url.clone(),
        engine_id: Some("p-engine-0".into()),
        side_channel_host: Some("p0.example".into()),
        side_channel_port: Some(5601),
        tp_size: Some(2),
        pp_size: Some(1),
        ranks: None,
    }
}

fn config(mode: TransferMode, p: &[&Fake], d: &[&Fake]) -> Config {
    let mut c = Config::new(
        mode,
        p.iter().map(|f| p_instance(f)).collect(),
        d.iter().map(|f| InstanceConfig::new(f.url.clone())).collect(),
    );
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.health_interval = Duration::from_millis(100);
    c.probe_timeout = Duration::from_millis(500);
    c.connect_timeout = Duration::from_millis(500);
    c
}

async fn start(c: Config) -> (RouterHandle, String) {
    let h = router::start(c).await.expect("router starts");
    let base = format!("http://{}", h.local_addr());
    (h, base)
}

fn body_json(b: &Bytes) -> Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(b)))
}

/// A fake P that answers only after the fake D saw the same transfer id (500 after 5 s otherwise), and
/// records when it answered.
fn waiting_prefill(arrivals: Arc<Arrivals>, answered: Arc<Mutex<Vec<Instant>>>) -> Handler {
    handler(move |s: Seen| {
        let (arrivals, answered) = (arrivals.clone(), answered.clone());
        async move {
            if !arrivals.wait(&tid(&s)).await {
                return json_reply(500, &json!({"error": {"message": "the decode leg never arrived"}}));
            }
            answered.lock().unwrap().push(Instant::now());
            json_reply(200, &json!({"choices": [{"text": "x"}], "kv_transfer_params": null}))
        }
    })
}

/// A fake D that records arrivals and answers a completion.
fn recording_decode(arrivals: Arc<Arrivals>, text: &'static str) -> Handler {
    handler(move |s: Seen| {
        let arrivals = arrivals.clone();
        async move {
            arrivals.arrive(&s);
            json_reply(200, &completion(text))
        }
    })
}

async fn metrics(base: &str) -> String {
    get(&client(), &format!("{base}/metrics")).await.2
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_sends_both_legs_at_once_with_their_kv_transfer_params() {
    let arrivals = Arc::new(Arrivals::default());
    let answered = Arc::new(Mutex::new(Vec::new()));
    let p = Fake::start(None, waiting_prefill(arrivals.clone(), answered.clone())).await;
    let d = Fake::start(None, recording_decode(arrivals.clone(), "decoded")).await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let c = client();

    for (path, req) in [
        ("/v1/completions", json!({"model": "m", "prompt": "hello", "max_tokens": 20, "min_tokens": 2})),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20}),
        ),
    ] {
        let resp = within(10.0, "the response", post(&c, &format!("{base}{path}"), req.to_string())).await;
        let (status, _, body) = read_all(resp).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(body_json(&body), completion("decoded"), "the client gets D's response");
    }

    let (ps, ds) = (p.requests(), d.requests());
    assert_eq!((ps.len(), ds.len()), (2, 2));
    let answered = answered.lock().unwrap().clone();
    for i in 0..2 {
        let (pr, dr) = (&ps[i], &ds[i]);
        assert_eq!(pr.path, dr.path);
        // Concurrency: D received its request before P answered (P waited for exactly that).
        assert!(dr.at < answered[i], "D's request arrived after P answered");
        let id = tid(pr);
        assert_eq!(id.len(), 32, "128-bit hex transfer id: {id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(pr.json["kv_transfer_params"], json!({"do_remote_decode": true, "transfer_id": id}));
        assert_eq!(pr.json["max_tokens"], 1);
        assert_eq!(pr.json["stream"], false);
        // P's vLLM request id up to the random suffix its engine adds (stock vLLM's push D needs it).
        let remote_request_id =
            if pr.path == "/v1/chat/completions" { format!("chatcmpl-{id}") } else { format!("cmpl-{id}-0") };
        assert_eq!(
            dr.json["kv_transfer_params"],
            json!({
                "do_remote_prefill": true, "transfer_id": id, "remote_request_id": remote_request_id,
                "remote_engine_id": "p-engine-0", "remote_host": "p0.example", "remote_port": 5601,
                "tp_size": 2, "pp_size": 1,
            })
        );
        // Both legs carry the same X-Request-Id (stock vLLM pairs push legs by it).
        assert_eq!(pr.headers["x-request-id"], dr.headers["x-request-id"]);
    }
    assert_eq!(ps[0].json["prompt"], "hello");
    assert!(ps[0].json.get("min_tokens").is_none(), "min_tokens would conflict with max_tokens 1 on P");
    assert_eq!(ds[0].json["max_tokens"], 20);
    assert_eq!(ds[0].json["min_tokens"], 2);
    assert_eq!(ps[1].json["max_completion_tokens"], 1);
    assert_eq!(ds[1].json["max_completion_tokens"], 20);
    assert_ne!(tid(&ps[0]), tid(&ps[1]), "a fresh transfer id per request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_streams_sse_chunks_through_as_they_arrive() {
    let arrivals = Arc::new(Arrivals::default());
    let answered = Arc::new(Mutex::new(Vec::new()));
    let p = Fake::start(None, waiting_prefill(arrivals.clone(), answered)).await;
    // D sends chunk i, then waits for the test to confirm the client got it before sending chunk i+1.
    let (ack_tx, ack_rx) = mpsc::unbounded_channel::<usize>();
    let ack_rx = Arc::new(tokio::sync::Mutex::new(ack_rx));
    let d = Fake::start(
        None,
        handler(move |s: Seen| {
            let (arrivals, ack_rx) = (arrivals.clone(), ack_rx.clone());
            async move {
                arrivals.arrive(&s);
                let (reply, tx) = sse_reply();
                tokio::spawn(async move {
                    let mut acks = ack_rx.lock().await;
                    for i in 0..3 {
                        tx.send(sse_event(&json!({"choices": [{"text": format!("tok{i}")}]}))).await.unwrap();
                        assert_eq!(acks.recv().await, Some(i));
                    }
                    tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.unwrap();
                });
                reply
            }
        }),
    )
    .await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let req = json!({"model": "m", "prompt": "hello", "max_tokens": 3, "stream": true});
    let resp =
        within(10.0, "the response head", post(&client(), &format!("{base}/v1/completions"), req.to_string())).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    let mut text = String::new();
    for i in 0..3 {
        while !text.contains(&format!("tok{i}")) {
            let frame = within(5.0, &format!("chunk {i} before D finished"), body.frame()).await.unwrap().unwrap();
            text.push_str(&String::from_utf8_lossy(frame.data_ref().unwrap()));
        }
        if i == 0 {
            assert_eq!(metric(&metrics(&base).await, "kvpush_router_in_flight"), 1.0, "a stream is in flight");
        }
        ack_tx.send(i).unwrap();
    }
    let rest = within(5.0, "the end of the stream", body.collect()).await.unwrap().to_bytes();
    text.push_str(&String::from_utf8_lossy(&rest));
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(p.requests()[0].json["stream"], false);
    assert_eq!(d.requests()[0].json["stream"], true);
}

/// P's answer to a greedy one-token leg: `text`, token `tok`, stopped for length.
fn p_token_answer(text: &str, tok: u32) -> Value {
    json!({"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "finish_reason": "length", "stop_reason": null,
                        "logprobs": {"tokens": [format!("token_id:{tok}")], "token_logprobs": [-0.5],
                                     "top_logprobs": [{}], "text_offset": [0]},
                        "prompt_token_ids": [1, 2, 3], "token_ids": [tok]}],
           "kv_transfer_params": {"remote_engine_id": "p"}})
}

/// One of D's stream events: `text` made of the tokens `toks`.
fn d_token_event(text: &str, toks: &[u32], finish: Value) -> Bytes {
    let tokens: Vec<String> = toks.iter().map(|t| format!("token_id:{t}")).collect();
    sse_event(&json!({"id": "cmpl-a", "object": "text_completion", "choices": [{"index": 0, "text": text,
        "finish_reason": finish, "logprobs": {"tokens": tokens, "token_logprobs": vec![-0.5; toks.len()],
        "top_logprobs": vec![json!({}); toks.len()], "text_offset": vec![0; toks.len()]}}]}))
}

/// The text and token strings of an SSE body's events, and its error events' codes.
fn sse_tokens(body: &str) -> (String, Vec<String>, Vec<String>) {
    let (mut text, mut toks, mut errors) = (String::new(), Vec::new(), Vec::new());
    for ev in body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(ev).unwrap();
        if let Some(code) = v["error"]["code"].as_str() {
            errors.push(code.to_owned());
            continue;
        }
        text.push_str(v["choices"][0]["text"].as_str().unwrap());
        for t in v["choices"][0]["logprobs"]["tokens"].as_array().unwrap() {
            toks.push(t.as_str().unwrap().to_owned());
        }
    }
    (text, toks, errors)
}

/// A pair whose P answers at once with " the" (token 5, prompt [1, 2, 3]) and whose D streams the
/// events `d_events`, or `cont_events` for a continuation of P's token (prompt [1, 2, 3, 5]); a leg
/// with `kv_transfer_params` only once `go` is notified (a push continuation has none: it answers at
/// once). With `from_prefill` off the router is told to leave the first token to D.
async fn first_token_pair(
    mode: TransferMode,
    d_events: Vec<Bytes>,
    cont_events: Vec<Bytes>,
    go: Arc<Notify>,
    from_prefill: bool,
) -> (Fake, Fake, RouterHandle, String) {
    let p = Fake::start(None, handler(|_s: Seen| async { json_reply(200, &p_token_answer(" the", 5)) })).await;
    let d = Fake::start(
        None,
        handler(move |s: Seen| {
            let cont = s.json["prompt"] == json!([1, 2, 3, 5]);
            let events = if cont { cont_events.clone() } else { d_events.clone() };
            let wait = s.json.get("kv_transfer_params").is_some();
            let go = go.clone();
            async move {
                let (reply, tx) = sse_reply();
                tokio::spawn(async move {
                    if wait {
                        go.notified().await;
                    }
                    for e in events {
                        tx.send(e).await.unwrap();
                    }
                    tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.unwrap();
                });
                reply
            }
        }),
    )
    .await;
    let mut c = config(mode, &[&p], &[&d]);
    c.first_token_from_prefill = from_prefill;
    let (r, base) = start(c).await;
    (p, d, r, base)
}

fn greedy_stream() -> String {
    json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": true, "temperature": 0.0, "logprobs": 1})
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_stream_gets_its_first_token_from_prefill_before_decode_sends_anything() {
    for mode in [TransferMode::Push, TransferMode::Pull] {
        let go = Arc::new(Notify::new());
        let d_events = vec![
            d_token_event(" the", &[5], Value::Null),
            d_token_event(" cat", &[9], Value::Null),
            d_token_event(" sat", &[4], json!("length")),
        ];
        let cont_events = d_events[1..].to_vec();
        let (p, d, _r, base) = first_token_pair(mode, d_events, cont_events, go.clone(), true).await;
        let resp = within(10.0, "the head", post(&client(), &format!("{base}/v1/completions"), greedy_stream())).await;
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        // D has sent nothing yet: the first event can only be P's token.
        let frame = within(5.0, "P's token while D is silent", body.frame()).await.unwrap().unwrap();
        let first = String::from_utf8_lossy(frame.data_ref().unwrap()).into_owned();
        assert_eq!(sse_tokens(&first).0, " the", "{mode:?}: {first}");
        assert!(first.contains("cmpl-a") && first.contains("\"finish_reason\":null"), "{first}");
        go.notify_one();
        let rest = within(5.0, "D's stream", body.collect()).await.unwrap().to_bytes();
        let all = format!("{first}{}", String::from_utf8_lossy(&rest));
        let (text, toks, errors) = sse_tokens(&all);
        assert_eq!(text, " the cat sat", "{mode:?}: P's token once, then D's without its first: {all}");
        assert_eq!(toks, ["token_id:5", "token_id:9", "token_id:4"], "{mode:?}");
        assert!(errors.is_empty() && all.ends_with("data: [DONE]\n\n"), "{all}");
        assert_eq!((p.count(), d.count()), (1, 1));
        let d_leg = &d.requests()[0].json;
        if mode == TransferMode::Pull {
            // Pull: D continues from P's token, with P's KV of the whole prompt.
            assert_eq!((&d_leg["prompt"], &d_leg["max_tokens"]), (&json!([1, 2, 3, 5]), &json!(2)), "{d_leg}");
            assert_eq!(d_leg["kv_transfer_params"]["remote_engine_id"], "p");
        } else {
            assert_eq!((&d_leg["prompt"], &d_leg["max_tokens"]), (&json!([1, 2, 3]), &json!(3)), "{d_leg}");
        }
        assert_eq!(p.requests()[0].json["return_token_ids"], true, "the continuation is made of P's ids");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_first_token_unlike_prefill_s_is_replaced_by_d_s_continuation_of_p_s() {
    let go = Arc::new(Notify::new());
    // D's own first token is " a" (a near-tie P and D broke differently); its continuation of P's " the"
    // says " cat sat".
    let d_events = vec![d_token_event(" a", &[6], Value::Null), d_token_event(" cat", &[9], Value::Null)];
    let cont_events = vec![d_token_event(" cat", &[9], Value::Null), d_token_event(" sat", &[4], json!("length"))];
    let (_p, d, _r, base) = first_token_pair(TransferMode::Push, d_events, cont_events, go.clone(), true).await;
    let resp = within(10.0, "the head", post(&client(), &format!("{base}/v1/completions"), greedy_stream())).await;
    let mut body = resp.into_body();
    let frame = within(5.0, "P's token", body.frame()).await.unwrap().unwrap();
    let first = String::from_utf8_lossy(frame.data_ref().unwrap()).into_owned();
    go.notify_one();
    let rest = within(5.0, "the continuation", body.collect()).await.unwrap().to_bytes();
    let all = format!("{first}{}", String::from_utf8_lossy(&rest));
    let (text, toks, errors) = sse_tokens(&all);
    assert_eq!((text.as_str(), errors.len()), (" the cat sat", 0), "P's token, then the continuation's: {all}");
    assert_eq!(toks, ["token_id:5", "token_id:9", "token_id:4"]);
    assert!(all.ends_with("data: [DONE]\n\n") && !all.contains(" a"), "nothing of D's first leg: {all}");
    let legs = d.requests();
    assert_eq!(legs.len(), 2, "D's leg, then its continuation");
    let cont = &legs[1].json;
    assert_eq!((&cont["prompt"], &cont["max_tokens"]), (&json!([1, 2, 3, 5]), &json!(2)), "{cont}");
    assert!(cont.get("kv_transfer_params").is_none(), "the prompt's KV is D's own (cached or recomputed)");
    let m = metrics(&base).await;
    assert_eq!(metric(&m, "kvpush_router_first_token_recoveries_total"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_errors_total{kind=\"first_token_mismatch\"}"), 0.0);
}

/// An event stream that sends `events`, then `[DONE]`.
fn sse_events(events: Vec<Bytes>) -> Reply {
    let (reply, tx) = sse_reply();
    tokio::spawn(async move {
        for e in events {
            tx.send(e).await.unwrap();
        }
        tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.unwrap();
    });
    reply
}

/// A push pair whose P answers " the" (token 5) only once `p_go` is notified and whose D streams
/// `d_events` at once, behind a router with `push_decode_after_prefill` on.
async fn after_prefill_pair(
    p_go: Arc<Notify>,
    d_events: Vec<Bytes>,
    cont_events: Vec<Bytes>,
) -> (Fake, Fake, RouterHandle, String) {
    after_prefill_pair_answering(p_go, p_token_answer(" the", 5), d_events, cont_events, false).await
}

/// `after_prefill_pair` with P's `answer`, and a D that answers 503 when `d_fails`.
async fn after_prefill_pair_answering(
    p_go: Arc<Notify>,
    answer: Value,
    d_events: Vec<Bytes>,
    cont_events: Vec<Bytes>,
    d_fails: bool,
) -> (Fake, Fake, RouterHandle, String) {
    let p = Fake::start(
        None,
        handler(move |_s: Seen| {
            let (p_go, answer) = (p_go.clone(), answer.clone());
            async move {
                p_go.notified().await;
                json_reply(200, &answer)
            }
        }),
    )
    .await;
    let d = Fake::start(
        None,
        handler(move |s: Seen| {
            let events = if s.json["prompt"] == json!([1, 2, 3, 5]) { cont_events.clone() } else { d_events.clone() };
            async move {
                if d_fails {
                    return json_reply(503, &json!({"error": {"message": "D is full", "code": 503}}));
                }
                sse_events(events)
            }
        }),
    )
    .await;
    let mut c = config(TransferMode::Push, &[&p], &[&d]);
    c.push_decode_after_prefill = true;
    let (r, base) = start(c).await;
    (p, d, r, base)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_after_prefill_sends_d_its_leg_only_once_p_answered() {
    let d_events = vec![
        d_token_event(" the", &[5], Value::Null),
        d_token_event(" cat", &[9], Value::Null),
        d_token_event(" sat", &[4], json!("length")),
    ];
    let p_go = Arc::new(Notify::new());
    let (p, d, _r, base) = after_prefill_pair(p_go.clone(), d_events.clone(), d_events[1..].to_vec()).await;
    let url = format!("{base}/v1/completions");
    let sent = tokio::spawn(async move { post(&client(), &url, greedy_stream()).await });
    within(5.0, "P's leg", async {
        while p.count() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(d.count(), 0, "D's leg waits for P's answer");
    p_go.notify_one();
    let resp = within(10.0, "the head", sent).await.unwrap();
    assert_eq!(resp.status(), 200);
    let all = within(5.0, "the stream", resp.into_body().collect()).await.unwrap().to_bytes();
    let all = String::from_utf8_lossy(&all).into_owned();
    let (text, toks, errors) = sse_tokens(&all);
    assert_eq!(text, " the cat sat", "P's token once, then D's without its first: {all}");
    assert_eq!(toks, ["token_id:5", "token_id:9", "token_id:4"]);
    assert!(errors.is_empty() && all.ends_with("data: [DONE]\n\n"), "{all}");
    assert_eq!(d.count(), 1);
    let d_leg = &d.requests()[0].json;
    // D's leg is the client's request, pushed into: P's coordinates, the whole prompt, every token.
    assert_eq!((&d_leg["prompt"], &d_leg["max_tokens"]), (&json!([1, 2, 3]), &json!(3)), "{d_leg}");
    assert_eq!(d_leg["kv_transfer_params"]["do_remote_prefill"], true, "{d_leg}");
    assert_eq!(tid(&d.requests()[0]), tid(&p.requests()[0]), "one transfer id on both legs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_after_prefill_relays_d_as_sent_when_p_stopped_and_ends_the_stream_when_d_fails() {
    // P's token is a stop: it cannot stand for the first token, so D's leg leaves then and its stream
    // goes through untouched (D's own first token included).
    let mut stopped = p_token_answer(" the", 5);
    stopped["choices"][0]["finish_reason"] = json!("stop");
    let d_events = vec![d_token_event(" the", &[5], json!("stop"))];
    let p_go = Arc::new(Notify::new());
    p_go.notify_one();
    let (p, d, _r, base) = after_prefill_pair_answering(p_go, stopped, d_events, vec![], false).await;
    let resp = within(10.0, "the head", post(&client(), &format!("{base}/v1/completions"), greedy_stream())).await;
    assert_eq!(resp.status(), 200);
    let all = within(5.0, "D's stream", resp.into_body().collect()).await.unwrap().to_bytes();
    let all = String::from_utf8_lossy(&all).into_owned();
    assert_eq!(sse_tokens(&all).0, " the", "D's stream as D sent it: {all}");
    assert_eq!((p.count(), d.count()), (1, 1));
    // D refuses after P's token went out: the stream (200, P's event) ends with D's error event.
    let p_go = Arc::new(Notify::new());
    p_go.notify_one();
    let (_p, d, _r, base) = after_prefill_pair_answering(p_go, p_token_answer(" the", 5), vec![], vec![], true).await;
    let resp = within(10.0, "the head", post(&client(), &format!("{base}/v1/completions"), greedy_stream())).await;
    assert_eq!(resp.status(), 200, "the stream began with P's token");
    let all = within(5.0, "the stream", resp.into_body().collect()).await.unwrap().to_bytes();
    let all = String::from_utf8_lossy(&all).into_owned();
    let (text, _, errors) = sse_tokens(&all);
    assert_eq!(text, " the", "P's token only: {all}");
    assert_eq!(errors.len(), 1, "D's failure as one error event: {all}");
    assert!(all.contains("D is full"), "D's message reaches the client: {all}");
    assert_eq!(d.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_after_prefill_recovers_a_decode_token_unlike_p_s_and_leaves_sampled_requests_alone() {
    // D's first token differs from P's: its continuation of P's token replaces it, as in push at once.
    let d_events = vec![d_token_event(" a", &[6], Value::Null), d_token_event(" cat", &[9], Value::Null)];
    let cont_events = vec![d_token_event(" cat", &[9], Value::Null), d_token_event(" sat", &[4], json!("length"))];
    let p_go = Arc::new(Notify::new());
    p_go.notify_one();
    let (p, d, _r, base) = after_prefill_pair(p_go.clone(), d_events, cont_events).await;
    let resp = within(10.0, "the head", post(&client(), &format!("{base}/v1/completions"), greedy_stream())).await;
    let all = within(5.0, "the stream", resp.into_body().collect()).await.unwrap().to_bytes();
    let all = String::from_utf8_lossy(&all).into_owned();
    let (text, _, errors) = sse_tokens(&all);
    assert_eq!((text.as_str(), errors.len()), (" the cat sat", 0), "{all}");
    assert_eq!(d.count(), 2, "D's leg, then its continuation");
    // A sampled request's first token is D's: both legs leave at once, P still held.
    let sampled =
        json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": true, "temperature": 1.0}).to_string();
    let url = format!("{base}/v1/completions");
    let sent = tokio::spawn(async move { post(&client(), &url, sampled).await });
    within(5.0, "D's leg while P is held", async {
        while d.count() < 3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(p.count(), 2);
    p_go.notify_one();
    let resp = within(10.0, "the head", sent).await.unwrap();
    assert_eq!(resp.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_sends_p_token_before_d_answers_and_a_failing_d_ends_the_stream_with_its_error() {
    for d_fails in [false, true] {
        let p = Fake::start(None, handler(|_s: Seen| async { json_reply(200, &p_token_answer(" the", 5)) })).await;
        let head_go = Arc::new(Notify::new());
        let go = head_go.clone();
        let d = Fake::start(
            None,
            handler(move |_s: Seen| {
                let go = go.clone();
                async move {
                    // D's head only once the client already has P's token.
                    go.notified().await;
                    if d_fails {
                        return json_reply(503, &json!({"error": {"message": "D is full", "code": 503}}));
                    }
                    sse_events(vec![d_token_event(" cat", &[9], Value::Null), d_token_event("", &[], json!("length"))])
                }
            }),
        )
        .await;
        let mut c = config(TransferMode::Pull, &[&p], &[&d]);
        c.first_token_from_prefill = true;
        let (_r, base) = start(c).await;
        let resp =
            within(5.0, "the head before D's", post(&client(), &format!("{base}/v1/completions"), greedy_stream()))
                .await;
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let mut body = resp.into_body();
        let frame = within(5.0, "P's token before D answered", body.frame()).await.unwrap().unwrap();
        let first = String::from_utf8_lossy(frame.data_ref().unwrap()).into_owned();
        assert_eq!(sse_tokens(&first).0, " the");
        // The router sends D's leg after P answered; it may reach D just after the client has P's token.
        eventually(5.0, "D's leg is out, its answer held", || d.count() == 1).await;
        head_go.notify_one();
        let rest = within(5.0, "D's stream", body.collect()).await.unwrap().to_bytes();
        let all = format!("{first}{}", String::from_utf8_lossy(&rest));
        let (text, toks, errors) = sse_tokens(&all);
        if d_fails {
            assert_eq!((text.as_str(), errors), (" the", vec!["decode_status".to_owned()]), "{all}");
            assert!(all.contains("D is full") && all.ends_with("data: [DONE]\n\n"), "D's own message: {all}");
        } else {
            assert_eq!((text.as_str(), toks.len(), errors.len()), (" the cat", 2, 0), "{all}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_or_switched_off_streams_wait_for_decode_s_first_token() {
    let sampled = json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "stream": true, "logprobs": 1});
    for (body, from_prefill) in [(sampled.to_string(), true), (greedy_stream(), false)] {
        let go = Arc::new(Notify::new());
        let d_events = vec![d_token_event(" the", &[5], Value::Null), d_token_event(" cat", &[9], json!("length"))];
        let (_p, _d, _r, base) = first_token_pair(TransferMode::Push, d_events, vec![], go.clone(), from_prefill).await;
        let resp = within(10.0, "the head", post(&client(), &format!("{base}/v1/completions"), body)).await;
        let mut body = resp.into_body();
        let early = tokio::time::timeout(Duration::from_millis(300), body.frame()).await;
        assert!(early.is_err(), "nothing before D's first event (from_prefill {from_prefill})");
        go.notify_one();
        let all = within(5.0, "D's stream", body.collect()).await.unwrap().to_bytes();
        let (text, toks, _) = sse_tokens(&String::from_utf8_lossy(&all));
        assert_eq!((text.as_str(), toks.len()), (" the cat", 2), "D's stream as D sent it");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_sends_prefill_first_then_decode_with_the_params_prefill_returned() {
    let p_params = json!({
        "do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p-e", "remote_block_ids": [3, 4],
        "remote_host": "p0.example", "remote_port": 5600, "remote_request_id": "r1", "tp_size": 1,
    });
    let answered = Arc::new(Mutex::new(Vec::new()));
    let answered2 = answered.clone();
    let pp = p_params.clone();
    let p = Fake::start(
        None,
        handler(move |_s| {
            let (answered, pp) = (answered2.clone(), pp.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                answered.lock().unwrap().push(Instant::now());
                json_reply(200, &json!({"choices": [{"text": "x"}], "kv_transfer_params": pp}))
            }
        }),
    )
    .await;
    let d = Fake::start(
        None,
        handler(|s: Seen| async move {
            if s.json["stream"] == true {
                let (reply, tx) = sse_reply();
                tokio::spawn(async move {
                    tx.send(sse_event(&json!({"choices": [{"text": "a"}]}))).await.unwrap();
                    tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.unwrap();
                });
                reply
            } else {
                json_reply(200, &completion("pulled"))
            }
        }),
    )
    .await;
    let (_r, base) = start(config(TransferMode::Pull, &[&p], &[&d])).await;
    let c = client();
    let req = json!({"model": "m", "prompt": "hello", "max_tokens": 20});
    let (status, _, body) = read_all(post(&c, &format!("{base}/v1/completions"), req.to_string()).await).await;
    assert_eq!(status, 200);
    assert_eq!(body_json(&body), completion("pulled"));
    let (pr, dr) = (&p.requests()[0], &d.requests()[0]);
    assert!(dr.at > answered.lock().unwrap()[0], "pull: D only after P answered");
    let id = tid(pr);
    assert_eq!(pr.json["kv_transfer_params"], json!({"do_remote_decode": true, "transfer_id": id}));
    assert_eq!(pr.json["max_tokens"], 1);
    let mut expected = p_params.clone();
    expected["transfer_id"] = json!(id);
    assert_eq!(dr.json["kv_transfer_params"], expected, "D gets what P returned");
    assert_eq!(dr.json["max_tokens"], 20);

    let req = json!({"model": "m", "prompt": "hello", "stream": true});
    let (status, headers, body) = read_all(post(&c, &format!("{base}/v1/completions"), req.to_string()).await).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert!(String::from_utf8_lossy(&body).ends_with("data: [DONE]\n\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_without_kv_transfer_params_from_prefill_is_a_clear_error() {
    let p = Fake::start(None, handler(|_s| async { json_reply(200, &json!({"choices": [{"text": "x"}]})) })).await;
    let d = Fake::start(None, handler(|_s| async { json_reply(200, &completion("never")) })).await;
    let (_r, base) = start(config(TransferMode::Pull, &[&p], &[&d])).await;
    let (status, headers, body) =
        read_all(post(&client(), &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
    assert_eq!(status, 502);
    assert_eq!(headers["x-kvpush-failed-leg"], "prefill");
    let v = body_json(&body);
    assert!(v["error"]["message"].as_str().unwrap().contains("no kv_transfer_params"), "{v}");
    assert_eq!(v["error"]["code"], "prefill_bad_response");
    assert_eq!(d.count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_error_status_and_body_pass_through_and_cancel_prefill() {
    let (cancel_tx, mut cancel_rx) = mpsc::unbounded_channel();
    // D answers only once P has the request, so that there is a P request to cancel.
    let p_arrivals = Arc::new(Arrivals::default());
    let pa = p_arrivals.clone();
    let p = Fake::start(None, hanging(cancel_tx, json!({}), move |s| pa.arrive(s))).await;
    let err = json!({"object": "error", "message": "This model's maximum context length is 16 tokens",
                     "type": "BadRequestError", "param": null, "code": 400});
    let err2 = err.clone();
    let d = Fake::start(
        None,
        handler(move |s: Seen| {
            let (err, p_arrivals) = (err2.clone(), p_arrivals.clone());
            async move {
                p_arrivals.wait(&tid(&s)).await;
                json_reply(400, &err)
            }
        }),
    )
    .await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let resp = within(10.0, "response", post(&client(), &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#)).await;
    let (status, _, body) = read_all(resp).await;
    assert_eq!(status, 400);
    assert_eq!(body_json(&body), err, "D's error body passes through unchanged");
    assert_eq!(within(5.0, "P's request cancelled", cancel_rx.recv()).await, Some(true));
    assert!(metric(&metrics(&base).await, "kvpush_router_errors_total{kind=\"decode_status\"}") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_prefill_cancels_decode_with_a_clear_error() {
    let arrivals = Arc::new(Arrivals::default());
    let a2 = arrivals.clone();
    let p = Fake::start(
        None,
        handler(move |s: Seen| {
            let arrivals = a2.clone();
            async move {
                arrivals.wait(&tid(&s)).await;
                if s.json["prompt"] == "json" {
                    json_reply(500, &json!({"error": {"message": "prefill exploded", "type": "InternalServerError"}}))
                } else {
                    text_reply(503, "overloaded")
                }
            }
        }),
    )
    .await;
    let (cancel_tx, mut cancel_rx) = mpsc::unbounded_channel();
    let d = Fake::start(None, hanging(cancel_tx, completion("late"), move |s| arrivals.arrive(s))).await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let c = client();

    let resp = within(10.0, "response", post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"json"}"#)).await;
    let (status, headers, body) = read_all(resp).await;
    assert_eq!(status, 500);
    assert_eq!(headers["x-kvpush-failed-leg"], "prefill");
    assert_eq!(body_json(&body)["error"]["message"], "prefill exploded", "P's JSON error passes through");
    assert_eq!(within(5.0, "D's request cancelled", cancel_rx.recv()).await, Some(true));

    let resp = within(10.0, "response", post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"text"}"#)).await;
    let (status, _, body) = read_all(resp).await;
    assert_eq!(status, 503);
    let v = body_json(&body);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("prefill leg failed") && msg.contains("overloaded"), "{v}");
    assert_eq!(v["error"]["code"], "prefill_status");
    assert_eq!(v["error"]["type"], "server_error");
    assert_eq!(within(5.0, "D's request cancelled", cancel_rx.recv()).await, Some(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_failing_after_the_decode_stream_started_ends_it_with_an_sse_error() {
    // P fails only once the client holds D's response head (the router relays it as soon as it has it).
    let fail_now = Arc::new(Notify::new());
    let f2 = fail_now.clone();
    let p = Fake::start(
        None,
        handler(move |_s| {
            let fail_now = f2.clone();
            async move {
                fail_now.notified().await;
                text_reply(500, "prefill worker died")
            }
        }),
    )
    .await;
    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel();
    let d = Fake::start(
        None,
        handler(move |_s| {
            let closed_tx = closed_tx.clone();
            async move {
                let (reply, tx) = sse_reply();
                tokio::spawn(async move {
                    tx.closed().await;
                    let _ = closed_tx.send(());
                });
                reply
            }
        }),
    )
    .await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let req = r#"{"prompt":"x","stream":true}"#;
    let resp = within(10.0, "response", post(&client(), &format!("{base}/v1/completions"), req)).await;
    assert_eq!(resp.status(), 200);
    eventually(5.0, "P has the request", || p.count() == 1).await;
    fail_now.notify_one();
    let (_, _, body) = within(10.0, "the stream's end", read_all(resp)).await;
    let text = String::from_utf8_lossy(&body);
    assert!(text.starts_with("data: {\"error\""), "{text}");
    assert!(text.contains("prefill leg failed") && text.contains("the decode leg was cancelled"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    within(5.0, "D's stream closed", closed_rx.recv()).await;
}

/// Sends a raw HTTP/1.1 POST and returns the open socket.
async fn raw_post(base_addr: SocketAddr, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(base_addr).await.unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_aborts_both_legs() {
    let (p_tx, mut p_rx) = mpsc::unbounded_channel();
    let p = Fake::start(None, hanging(p_tx, json!({}), |_| {})).await;
    let (d_tx, mut d_rx) = mpsc::unbounded_channel();
    let d = Fake::start(
        None,
        handler(move |_s| {
            let d_tx = d_tx.clone();
            async move {
                let (reply, tx) = sse_reply();
                tokio::spawn(async move {
                    for i in 0..1000 {
                        if tx.send(sse_event(&json!({"choices": [{"text": i}]}))).await.is_err() {
                            let _ = d_tx.send(i);
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
                reply
            }
        }),
    )
    .await;
    let (r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let mut s = raw_post(r.local_addr(), r#"{"prompt":"x","stream":true}"#).await;
    let mut buf = vec![0u8; 4096];
    let mut got = String::new();
    while !got.contains("data:") {
        let n = within(5.0, "the first chunk", s.read(&mut buf)).await.unwrap();
        assert!(n > 0);
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    eventually(5.0, "P has the request", || p.count() == 1).await;
    drop(s);
    assert_eq!(within(5.0, "P's request dropped", p_rx.recv()).await, Some(true));
    let sent = within(5.0, "D's stream closed", d_rx.recv()).await.unwrap();
    assert!(sent < 500, "D kept streaming to nobody ({sent} chunks)");
    let m = metrics(&base).await;
    assert!(metric(&m, "kvpush_router_errors_total{kind=\"client_disconnect\"}") >= 1.0, "{m}");
    let mut ok = false;
    for _ in 0..100 {
        let m = metrics(&base).await;
        if m.lines().filter(|l| l.starts_with("kvpush_router_upstream_outstanding")).all(|l| l.ends_with(" 0"))
            && metric(&m, "kvpush_router_in_flight") == 0.0
        {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "outstanding counts and in-flight requests return to 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_before_any_answer_aborts_both_legs() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let p = Fake::start(None, hanging(tx.clone(), json!({}), |_| {})).await;
    let d = Fake::start(None, hanging(tx, json!({}), |_| {})).await;
    for mode in [TransferMode::Push, TransferMode::Pull] {
        let (r, _base) = start(config(mode, &[&p], &[&d])).await;
        let before = p.count() + d.count();
        let legs = if mode == TransferMode::Push { 2 } else { 1 };
        let s = raw_post(r.local_addr(), r#"{"prompt":"x"}"#).await;
        eventually(5.0, "the legs arrive", || p.count() + d.count() == before + legs).await;
        drop(s);
        for _ in 0..legs {
            assert_eq!(within(5.0, "a leg dropped", rx.recv()).await, Some(true), "{mode}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_400_and_send_no_leg() {
    let p = Fake::start(None, handler(|_s| async { json_reply(200, &json!({})) })).await;
    let d = Fake::start(None, handler(|_s| async { json_reply(200, &completion("x")) })).await;
    let mut cfg = config(TransferMode::Push, &[&p], &[&d]);
    cfg.max_body_bytes = 1024;
    let (_r, base) = start(cfg).await;
    let c = client();
    let url = format!("{base}/v1/completions");
    for (body, needle) in [
        ("{\"prompt\": ", "not valid JSON"),
        ("[1, 2]", "must be a JSON object, not an array"),
        ("\"text\"", "not a string"),
        ("", "not valid JSON"),
    ] {
        let (status, _, b) = read_all(post(&c, &url, body.to_owned()).await).await;
        assert_eq!(status, 400, "{body}");
        let v = body_json(&b);
        assert!(v["error"]["message"].as_str().unwrap().contains(needle), "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (status, _, b) = read_all(post(&c, &url, vec![0xffu8, 0x00, 0x7b]).await).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(2000));
    let (status, _, b) = read_all(post(&c, &url, big).await).await;
    assert_eq!(status, 413);
    assert_eq!(body_json(&b)["error"]["code"], "payload_too_large");
    let (status, _, body) = get(&c, &url).await;
    assert_eq!(status, 405, "{body}");
    let (status, _, body) = get(&c, &format!("{base}/v2/nothing")).await;
    assert_eq!(status, 404);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], "not_found");
    assert_eq!(p.count() + d.count(), 0, "no leg was sent");
    let m = metrics(&base).await;
    assert_eq!(metric(&m, "kvpush_router_errors_total{kind=\"bad_request\"}"), 5.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_server_leaves_the_rotation_and_is_probed_back_in() {
    let p = Fake::start(None, handler(|_s| async { json_reply(200, &json!({})) })).await;
    let ok = || handler(|_s| async { json_reply(200, &completion("ok")) });
    let d0 = Fake::start(None, ok()).await;
    let d1 = Fake::start(None, ok()).await;
    let d1_addr = d1.addr;
    let mut cfg = config(TransferMode::Push, &[&p], &[&d0, &d1]);
    cfg.health_interval = Duration::from_millis(1500);
    let (_r, base) = start(cfg).await;
    let c = client();
    drop(d1);
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..4 {
        let (status, _, body) = read_all(post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
        assert_eq!(status, 200, "requests keep succeeding: {}", String::from_utf8_lossy(&body));
    }
    assert_eq!(d0.count(), 4);
    let m = metrics(&base).await;
    assert!(metric(&m, "kvpush_router_errors_total{kind=\"decode_connect\"}") >= 1.0, "{m}");
    assert!(metric(&m, "kvpush_router_retries_total") >= 1.0, "{m}");
    let d1_series = format!("kvpush_router_upstream_up{{role=\"decode\",url=\"http://{d1_addr}\"}}");
    assert_eq!(metric(&m, &d1_series), 0.0);
    let (status, _, health) = get(&c, &format!("{base}/health")).await;
    assert_eq!(status, 200, "one D is enough to serve");
    let h: Value = serde_json::from_str(&health).unwrap();
    assert_eq!(h["decode"][1]["up"], false);
    assert!(h["decode"][1]["reason"].as_str().unwrap().contains("connect"), "{h}");

    // Bring it back on the same port: the health probe puts it back in rotation.
    let d1 = Fake::start_at(d1_addr, None, ok()).await;
    let start_wait = Instant::now();
    loop {
        let (_, _, health) = get(&c, &format!("{base}/health")).await;
        if serde_json::from_str::<Value>(&health).unwrap()["decode"][1]["up"] == true {
            break;
        }
        assert!(start_wait.elapsed() < Duration::from_secs(5), "not probed back in: {health}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for _ in 0..4 {
        let (status, _, _) = read_all(post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
        assert_eq!(status, 200);
    }
    assert!(d1.count() >= 1, "the revived server gets traffic again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_prefill_server_times_out_leaves_the_rotation_and_comes_back() {
    // Like real push, D finishes only after P answered the same transfer id.
    let p_done = Arc::new(Arrivals::default());
    let hung = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let prefill = |hung: Option<Arc<std::sync::atomic::AtomicBool>>, done: Arc<Arrivals>| {
        handler(move |s: Seen| {
            let (hung, done) = (hung.clone(), done.clone());
            async move {
                if hung.is_some_and(|h| h.load(std::sync::atomic::Ordering::SeqCst)) {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                }
                done.arrive(&s);
                json_reply(200, &json!({}))
            }
        })
    };
    let p0 = Fake::start(None, prefill(Some(hung.clone()), p_done.clone())).await;
    p0.health.store(HEALTH_HANG, std::sync::atomic::Ordering::SeqCst);
    let p1 = Fake::start(None, prefill(None, p_done.clone())).await;
    let d = Fake::start(
        None,
        handler(move |s: Seen| {
            let p_done = p_done.clone();
            async move {
                p_done.wait(&tid(&s)).await;
                json_reply(200, &completion("ok"))
            }
        }),
    )
    .await;
    let mut cfg = config(TransferMode::Push, &[&p0, &p1], &[&d]);
    cfg.prefill_timeout = Duration::from_millis(300);
    cfg.probe_timeout = Duration::from_millis(200);
    cfg.health_interval = Duration::from_millis(2000);
    // The hung server answers /v1/kvpush/info (404) at start, then neither completions nor /health.
    let (_r, base) = start(cfg).await;
    let c = client();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let resp = within(10.0, "response", post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#)).await;
        let (status, headers, body) = read_all(resp).await;
        if status == 504 {
            assert_eq!(headers["x-kvpush-failed-leg"], "prefill");
            let v = body_json(&body);
            assert_eq!(v["error"]["code"], "prefill_timeout", "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(&p0.url), "{v}");
        }
        statuses.push(status.as_u16());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 504).count(), 1, "one request hit the hung server: {statuses:?}");
    assert_eq!(metric(&metrics(&base).await, "kvpush_router_errors_total{kind=\"prefill_timeout\"}"), 1.0);
    let (_, _, health) = get(&c, &format!("{base}/health")).await;
    assert_eq!(serde_json::from_str::<Value>(&health).unwrap()["prefill"][0]["up"], false, "{health}");

    hung.store(false, std::sync::atomic::Ordering::SeqCst);
    p0.health.store(HEALTH_OK, std::sync::atomic::Ordering::SeqCst);
    let before = p0.count();
    let t = Instant::now();
    loop {
        let (status, _, _) = read_all(post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
        assert_eq!(status, 200);
        if p0.count() > before {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(8), "P0 never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_are_chosen_by_least_outstanding_requests() {
    let p = Fake::start(None, handler(|_s| async { json_reply(200, &json!({})) })).await;
    let gated = |gate: Arc<Semaphore>| {
        handler(move |_s| {
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                json_reply(200, &completion("ok"))
            }
        })
    };
    let (g0, g1) = (Arc::new(Semaphore::new(0)), Arc::new(Semaphore::new(0)));
    let d0 = Fake::start(None, gated(g0.clone())).await;
    let d1 = Fake::start(None, gated(g1.clone())).await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d0, &d1])).await;
    let c = client();
    let url = format!("{base}/v1/completions");
    let send = |n: usize| {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            let (status, _, _) = read_all(post(&c, &url, format!("{{\"prompt\":\"{n}\"}}")).await).await;
            status
        })
    };
    let mut tasks = Vec::new();
    for n in 0..4 {
        tasks.push(send(n));
        eventually(5.0, "the request reaches a D", || d0.count() + d1.count() == n + 1).await;
        let (a, b) = (d0.count(), d1.count());
        assert!(a.abs_diff(b) <= 1, "balanced while all are outstanding: {a} vs {b}");
    }
    assert_eq!((d0.count(), d1.count()), (2, 2));
    // D1 finishes its two; D0 still holds two: the next two both go to D1.
    g1.add_permits(2);
    // Wait until D1's responses are fully relayed (its outstanding count drops to 0).
    let d1_series = format!("kvpush_router_upstream_outstanding{{role=\"decode\",url=\"{}\"}}", d1.url);
    let t = Instant::now();
    while metric(&metrics(&base).await, &d1_series) != 0.0 {
        assert!(t.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t5 = send(5);
    eventually(5.0, "request 5 arrives", || d0.count() + d1.count() == 5).await;
    let t6 = send(6);
    eventually(5.0, "request 6 arrives", || d0.count() + d1.count() == 6).await;
    assert_eq!((d0.count(), d1.count()), (2, 4), "both new requests went to the less loaded D1");
    g0.add_permits(10);
    g1.add_permits(10);
    for t in tasks {
        assert_eq!(within(5.0, "a request completes", t).await.unwrap(), 200);
    }
    assert_eq!(t5.await.unwrap(), 200);
    assert_eq!(t6.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics_report_the_router_and_its_servers() {
    let arrivals = Arc::new(Arrivals::default());
    let p = Fake::start(None, waiting_prefill(arrivals.clone(), Arc::new(Mutex::new(Vec::new())))).await;
    let d = Fake::start(None, recording_decode(arrivals, "ok")).await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let c = client();
    let (status, headers, body) = get(&c, &format!("{base}/health")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/json");
    let h: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["mode"], "push");
    assert_eq!(h["prefill"][0]["url"], p.url.as_str());
    assert_eq!(h["decode"][0]["up"], true);

    let (status, _, _) = read_all(post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
    assert_eq!(status, 200);
    let (status, _, _) = read_all(post(&c, &format!("{base}/v1/chat/completions"), "nope").await).await;
    assert_eq!(status, 400);

    let (status, headers, m) = get(&c, &format!("{base}/metrics")).await;
    assert_eq!(status, 200);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/plain; version=0.0.4"));
    assert_eq!(metric(&m, "kvpush_router_requests_total{endpoint=\"/v1/completions\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_requests_total{endpoint=\"/v1/chat/completions\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_responses_total{code=\"200\"}"), 2.0, "{m}"); // + the /health above
    assert_eq!(metric(&m, "kvpush_router_responses_total{code=\"400\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_errors_total{kind=\"bad_request\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_errors_total{kind=\"prefill_timeout\"}"), 0.0);
    assert_eq!(metric(&m, "kvpush_router_leg_duration_seconds_count{leg=\"prefill\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_leg_duration_seconds_count{leg=\"decode\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_leg_duration_seconds_bucket{leg=\"decode\",le=\"+Inf\"}"), 1.0);
    assert_eq!(metric(&m, "kvpush_router_ttft_seconds_count"), 1.0);
    assert!(metric(&m, "kvpush_router_ttft_seconds_sum") > 0.0);
    assert_eq!(metric(&m, "kvpush_router_in_flight"), 0.0);
    let up = format!("kvpush_router_upstream_up{{role=\"prefill\",url=\"{}\"}}", p.url);
    assert_eq!(metric(&m, &up), 1.0);
    for family in ["requests_total", "errors_total", "leg_duration_seconds", "ttft_seconds", "upstream_up"] {
        assert!(m.contains(&format!("# TYPE kvpush_router_{family} ")), "{family}");
    }

    // With every D failing its health probe, /health turns 503 and requests get a clear 503.
    d.health.store(HEALTH_503, std::sync::atomic::Ordering::SeqCst);
    let t = Instant::now();
    loop {
        let (status, _, body) = get(&c, &format!("{base}/health")).await;
        if status == 503 {
            assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["status"], "unavailable");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _, body) = read_all(post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
    assert_eq!(status, 503);
    let v = body_json(&body);
    assert_eq!(v["error"]["code"], "no_decode_instance");
    assert!(v["error"]["message"].as_str().unwrap().contains("health probe answered 503"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stays_in_rotation_until_unhealthy_after_probes_failed_in_a_row() {
    // A busy server that misses a probe or two keeps serving; only `unhealthy_after` failures in a row
    // take it out (the default is 3).
    assert_eq!(Config::new(TransferMode::Push, vec![], vec![]).unhealthy_after, 3);
    let p = Fake::start(None, handler(|_s| async { json_reply(200, &json!({})) })).await;
    let d = Fake::start(None, handler(|_s| async { json_reply(200, &completion("ok")) })).await;
    let mut cfg = config(TransferMode::Push, &[&p], &[&d]);
    cfg.health_interval = Duration::from_millis(50);
    cfg.unhealthy_after = 1_000_000;
    let (_r, base) = start(cfg).await;
    let c = client();
    let before = d.probes.load(std::sync::atomic::Ordering::SeqCst);
    d.health.store(HEALTH_503, std::sync::atomic::Ordering::SeqCst);
    // Wait until the router has really probed it and been refused many times in a row.
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.probes.load(std::sync::atomic::Ordering::SeqCst) < before + 10 {
        assert!(Instant::now() < deadline, "the router did not probe D ten times within 10 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, _, health) = get(&c, &format!("{base}/health")).await;
    assert_eq!(status, 200, "{health}");
    assert_eq!(serde_json::from_str::<Value>(&health).unwrap()["decode"][0]["up"], true, "{health}");
    let (status, _, body) = read_all(post(&c, &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_checks_the_mode_and_takes_push_coordinates_from_the_info_endpoint() {
    let ok = || handler(|_s| async { json_reply(200, &json!({})) });
    let d = Fake::start(Some(json!({"mode": "push"})), handler(|_s| async { json_reply(200, &completion("x")) })).await;

    // A P that reports pull mode: refused at start, naming the server and both modes.
    let p_pull = Fake::start(Some(json!({"mode": "pull"})), ok()).await;
    let err = router::start(config(TransferMode::Push, &[&p_pull], &[&d])).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, RouterError::Startup(_)), "{msg}");
    assert!(msg.contains("mode mismatch") && msg.contains(&p_pull.url) && msg.contains("`pull`"), "{msg}");

    // A push-mode P with no engine id configured and no info endpoint: refused.
    let p_bare = Fake::start(None, ok()).await;
    let mut cfg = config(TransferMode::Push, &[&p_bare], &[&d]);
    cfg.prefill[0].engine_id = None;
    let msg = router::start(cfg).await.unwrap_err().to_string();
    assert!(msg.contains("no engine id") && msg.contains("engine_id=ID"), "{msg}");

    // The same P is fine in pull mode (the engine id travels in P's response there); D says push -> refused.
    let msg = router::start(config(TransferMode::Pull, &[&p_bare], &[&d])).await.unwrap_err().to_string();
    assert!(msg.contains("decode server") && msg.contains("`push`"), "{msg}");

    // Coordinates from the info endpoint when the configuration has none.
    let info = json!({"mode": "push", "engine_id": "from-info", "side_channel_host": "p9.example",
                      "side_channel_port": 7777, "tp_size": 4, "pp_size": 2});
    let p_info = Fake::start(Some(info), ok()).await;
    let mut cfg = config(TransferMode::Push, &[&p_info], &[&d]);
    cfg.prefill[0] = InstanceConfig::new(p_info.url.clone());
    let (_r, base) = start(cfg).await;
    let (status, _, _) = read_all(post(&client(), &format!("{base}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
    assert_eq!(status, 200);
    let params = &d.requests()[0].json["kv_transfer_params"];
    assert_eq!(params["remote_engine_id"], "from-info");
    assert_eq!(params["remote_host"], "p9.example");
    assert_eq!(params["remote_port"], 7777);
    assert_eq!((params["tp_size"].clone(), params["pp_size"].clone()), (json!(4), json!(2)));

    // Each rank's address, for P's ranks on several hosts, goes to D as remote_ranks.
    let spec = "engine_id=p-engine-0,host=h0,port=5600,tp=2,ranks=h0:5600;[fd00::2]:7000";
    let mut cfg = config(TransferMode::Push, &[&p_bare], &[&d]);
    cfg.prefill[0] = InstanceConfig::parse_spec(&format!("{},{spec}", p_bare.url)).unwrap();
    let (_r2, base2) = start(cfg).await;
    let (status, _, _) = read_all(post(&client(), &format!("{base2}/v1/completions"), r#"{"prompt":"x"}"#).await).await;
    assert_eq!(status, 200);
    let legs = d.requests();
    let params = &legs.last().expect("D's leg").json["kv_transfer_params"];
    assert_eq!(params["remote_ranks"], json!(["h0:5600", "[fd00::2]:7000"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_down_at_start_joins_later_only_if_its_mode_matches() {
    let reserve = |()| async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let (a_addr, b_addr) = (reserve(()).await, reserve(()).await);
    let d = Fake::start(None, handler(|_s| async { json_reply(200, &completion("x")) })).await;
    let mut cfg = config(TransferMode::Pull, &[], &[&d]);
    cfg.prefill =
        vec![InstanceConfig::new(format!("http://{a_addr}")), InstanceConfig::new(format!("http://{b_addr}"))];
    let (_r, base) = start(cfg).await;
    let c = client();
    let (status, _, body) = get(&c, &format!("{base}/health")).await;
    assert_eq!(status, 503, "no P reachable yet: {body}");

    let ok = || handler(|_s| async { json_reply(200, &json!({"kv_transfer_params": {"remote_block_ids": [1]}})) });
    let _a = Fake::start_at(a_addr, Some(json!({"mode": "push"})), ok()).await;
    let _b = Fake::start_at(b_addr, Some(json!({"mode": "pull"})), ok()).await;
    let t = Instant::now();
    let h = loop {
        let (_, _, body) = get(&c, &format!("{base}/health")).await;
        let h: Value = serde_json::from_str(&body).unwrap();
        if h["prefill"][1]["up"] == true && h["prefill"][0]["reason"].as_str().unwrap_or("").contains("mismatch") {
            break h;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "{h}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(h["prefill"][0]["up"], false, "the push-mode server stays out of a pull router: {h}");
}

/// Reads from a raw socket until `needle` appears or the peer closes; the text read.
async fn read_until(s: &mut TcpStream, needle: &str) -> String {
    let mut buf = vec![0u8; 4096];
    let mut got = String::new();
    while !got.contains(needle) {
        let n = s.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        got.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trickles_its_body_gets_408_and_no_leg_is_sent() {
    let p = Fake::start(None, handler(|_| async { json_reply(200, &json!({})) })).await;
    let d = Fake::start(None, handler(|_| async { json_reply(200, &completion("x")) })).await;
    let mut c = config(TransferMode::Push, &[&p], &[&d]);
    c.body_timeout = Duration::from_millis(300);
    let (r, base) = start(c).await;
    let mut s = TcpStream::connect(r.local_addr()).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n";
    s.write_all(head.as_bytes()).await.unwrap();
    // One byte every 100 ms: each read makes progress, the whole body never comes.
    let trickle = async {
        for _ in 0..100 {
            if s.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    within(5.0, "the trickle to be cut off", trickle).await;
    let got = within(5.0, "the answer", read_until(&mut s, "}}")).await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("body_timeout"), "{got}");
    assert_eq!(p.count() + d.count(), 0, "no leg for a body that never came");
    assert_eq!(metric(&metrics(&base).await, "kvpush_router_errors_total{kind=\"body_timeout\"}"), 1.0);
    // A client that never finishes its request head is cut off too.
    let mut s = TcpStream::connect(r.local_addr()).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: r").await.unwrap();
    let mut buf = [0u8; 256];
    let closed = within(5.0, "a slow head to be cut off", async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_get_503_at_once_and_slots_come_back() {
    let p = Fake::start(None, handler(|_| async { json_reply(200, &json!({})) })).await;
    let d = Fake::start(None, handler(|_| async { json_reply(200, &completion("ok")) })).await;
    let mut c = config(TransferMode::Push, &[&p], &[&d]);
    c.max_connections = 4;
    let (r, base) = start(c).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(r.local_addr()).await.unwrap());
    }
    // The idle connections are accepted (and hold their slots) before the next one arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let mut over = raw_post(r.local_addr(), r#"{"prompt":"x"}"#).await;
    let got = within(2.0, "the refusal", read_until(&mut over, "}}")).await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(got.contains("too_many_connections"), "{got}");
    assert!(started.elapsed() < Duration::from_secs(1), "refused in {:?}", started.elapsed());
    assert_eq!(p.count() + d.count(), 0);
    drop(held);
    // Freed slots serve again.
    let mut ok = false;
    for _ in 0..50 {
        let req = hyper::Request::post(format!("{base}/v1/completions"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(br#"{"prompt":"x"}"#)))
            .unwrap();
        // Until the router saw the idle connections close, the answer is a 503 (maybe before the request
        // was even written, which the client reports as an error).
        if client().request(req).await.is_ok_and(|r| r.status() == 200) {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ok, "a request is served once the idle connections left");
    assert!(metric(&metrics(&base).await, "kvpush_router_errors_total{kind=\"too_many_connections\"}") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_named_in_connection_are_stripped_both_ways() {
    let p = Fake::start(None, handler(|_| async { json_reply(200, &json!({})) })).await;
    let d = Fake::start(
        None,
        handler(|_| async {
            let mut r = json_reply(200, &completion("ok"));
            let h = r.headers_mut();
            h.insert("connection", "x-d-hop".parse().unwrap());
            h.insert("x-d-hop", "1".parse().unwrap());
            h.insert("x-d-end", "1".parse().unwrap());
            r
        }),
    )
    .await;
    let (r, _base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    let mut s = TcpStream::connect(r.local_addr()).await.unwrap();
    let body = r#"{"prompt":"x"}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
         Connection: keep-alive, X-Secret-Hop\r\nX-Secret-Hop: 1\r\nX-End: 2\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let got = within(5.0, "the response", read_until(&mut s, "\"ok\"")).await.to_ascii_lowercase();
    assert!(got.starts_with("http/1.1 200"), "{got}");
    assert!(got.contains("x-d-end: 1"), "{got}");
    assert!(!got.contains("x-d-hop"), "a header D named in Connection reached the client:\n{got}");
    for (name, f) in [("P", &p), ("D", &d)] {
        let seen = &f.requests()[0];
        assert_eq!(seen.headers["x-end"], "2", "{name}");
        assert!(!seen.headers.contains_key("x-secret-hop"), "{name} got a header the client named in Connection");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_ids_never_reach_the_client() {
    // D and P answer as vLLM does: request ids made of X-Request-Id, echoed in a header and the body.
    fn echo(s: &Seen) -> String {
        s.headers["x-request-id"].to_str().unwrap().to_owned()
    }
    let p = Fake::start(None, handler(|_| async { json_reply(200, &json!({})) })).await;
    let d = Fake::start(
        None,
        handler(|s: Seen| async move {
            let rid = echo(&s);
            let mut r = if s.json["stream"] == true {
                let (r, tx) = sse_reply();
                tokio::spawn(async move {
                    for i in 0..3 {
                        let ev = sse_event(&json!({"id": format!("cmpl-{rid}-0"), "choices": [{"text": i}]}));
                        // Split each event mid-id, as a TCP stream may.
                        let cut = ev.len() / 3;
                        tx.send(ev.slice(..cut)).await.unwrap();
                        tx.send(ev.slice(cut..)).await.unwrap();
                    }
                    tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await.unwrap();
                });
                r
            } else {
                json_reply(200, &json!({"id": format!("cmpl-{rid}-0"), "kv_transfer_params": {"transfer_id": rid}}))
            };
            r.headers_mut().insert("x-request-id", echo(&s).parse().unwrap());
            r
        }),
    )
    .await;
    let (_r, base) = start(config(TransferMode::Push, &[&p], &[&d])).await;
    for stream in [false, true] {
        let req = json!({"prompt": "x", "stream": stream});
        let resp = post(&client(), &format!("{base}/v1/completions"), req.to_string()).await;
        let (status, headers, body) = within(5.0, "the response", read_all(resp)).await;
        let body = String::from_utf8_lossy(&body).into_owned();
        let tid = tid(d.requests().last().unwrap());
        assert_eq!(tid.len(), 32);
        assert_eq!(status, 200, "{body}");
        let public = headers["x-request-id"].to_str().unwrap().to_owned();
        assert_ne!(public, tid);
        assert_eq!(public.len(), 32);
        assert!(!body.contains(&tid), "the transfer id reached the client: {body}");
        assert!(body.contains(&format!("cmpl-{public}-0")), "{body}");
        for (_, v) in &headers {
            assert!(!v.to_str().unwrap_or_default().contains(&tid), "{headers:?}");
        }
    }
    // An error P passes through names P's request the same way.
    let p_err = Fake::start(
        None,
        handler(|s: Seen| async move {
            let msg = format!("request cmpl-{}-0 is invalid", echo(&s));
            json_reply(400, &json!({"error": {"message": msg}}))
        }),
    )
    .await;
    // (Pull mode: P answers before D is asked, so P's error is what the client gets.)
    let (_r2, base2) = start(config(TransferMode::Pull, &[&p_err], &[&d])).await;
    let resp = post(&client(), &format!("{base2}/v1/completions"), r#"{"prompt":"x"}"#).await;
    let (status, _, body) = within(5.0, "the error", read_all(resp)).await;
    let body = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(status, 400, "{body}");
    let tid = tid(p_err.requests().last().unwrap());
    assert!(body.contains("is invalid") && !body.contains(&tid), "{body}");
}

#[test]
fn config_file_and_flags_resolve_with_flags_winning() {
    let dir = std::env::temp_dir().join(format!("kvpush-router-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.json");
    std::fs::write(
        &path,
        r#"{"listen": "0.0.0.0:9000", "mode": "pull", "health_interval_s": 2.5, "connect_retries": 5,
            "prefill": [{"url": "http://p0.example:8100", "engine_id": "p0", "side_channel_port": 5601, "tp_size": 8},
                        "http://p1.example:8100,engine_id=p1"],
            "decode": ["http://d0.example:8200"]}"#,
    )
    .unwrap();
    let args = RouterArgs { config: Some(path.clone()), ..Default::default() };
    let c = Config::from_args(&args).unwrap();
    assert_eq!(c.listen, "0.0.0.0:9000".parse().unwrap());
    assert_eq!(c.mode, TransferMode::Pull);
    assert_eq!(c.health_interval, Duration::from_millis(2500));
    assert_eq!(c.connect_retries, 5);
    assert_eq!(c.prefill[0].tp_size, Some(8));
    assert_eq!(c.prefill[1].engine_id.as_deref(), Some("p1"));
    assert_eq!(c.decode[0].url, "http://d0.example:8200");
    assert_eq!(c.prefill_timeout, Duration::from_secs(600), "default");

    let args = RouterArgs {
        config: Some(path.clone()),
        mode: Some(TransferMode::Push),
        listen: Some("127.0.0.1:8001".parse().unwrap()),
        decode: vec!["http://127.0.0.1:8300".into(), "http://127.0.0.1:8301/".into()],
        health_interval_s: Some(0.25),
        ..Default::default()
    };
    let c = Config::from_args(&args).unwrap();
    assert_eq!((c.mode, c.listen.port(), c.health_interval), (TransferMode::Push, 8001, Duration::from_millis(250)));
    assert_eq!(c.decode.len(), 2, "flags replace the file's list");
    assert_eq!(c.prefill.len(), 2, "the file's list stays where no flag is given");

    let spec = InstanceConfig::parse_spec("http://[::1]:8100,engine_id=e,host=h,port=7,tp=2,pp=3").unwrap();
    assert_eq!(
        (
            spec.engine_id.as_deref(),
            spec.side_channel_host.as_deref(),
            spec.side_channel_port,
            spec.tp_size,
            spec.pp_size
        ),
        (Some("e"), Some("h"), Some(7), Some(2), Some(3))
    );
    for (bad, needle) in [
        ("http://h:1,port=x", "not a port"),
        ("http://h:1,color=red", "unknown key"),
        ("http://h:1,tp", "not key=value"),
        ("https://h:1", "only http"),
        ("h:1", "scheme"),
        ("http://h:1,tp=0", "at least 1"),
        ("http://h:1,tp=2,ranks=a:1", "ranks names 1 addresses, tp × pp is 2"),
        ("http://h:1,ranks=a", "`a` is not host:port"),
        ("http://h:1,ranks=a:0", "`a:0` is not host:port"),
    ] {
        let e = InstanceConfig::parse_spec(bad).unwrap_err().to_string();
        assert!(e.contains(needle), "{bad}: {e}");
    }

    std::fs::write(&path, r#"{"mode": "push", "prefil": []}"#).unwrap();
    let e = Config::from_args(&RouterArgs { config: Some(path.clone()), ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("unknown field `prefil`"), "{e}");
    std::fs::write(&path, "{not json").unwrap();
    let e = Config::from_args(&RouterArgs { config: Some(path.clone()), ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("router.json"), "{e}");
    let e = Config::from_args(&RouterArgs { decode: vec!["http://h:1".into()], ..Default::default() }).unwrap_err();
    assert!(e.to_string().contains("no prefill server"), "{e}");
    let e = Config::from_args(&RouterArgs {
        prefill: vec!["http://h:1".into()],
        decode: vec!["http://h:2".into()],
        health_interval_s: Some(-1.0),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("health_interval_s"), "{e}");
    let e = Config::from_args(&RouterArgs {
        prefill: vec!["http://h:1".into()],
        decode: vec!["http://h:2".into()],
        unhealthy_after: Some(0),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("unhealthy_after"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_cli_option_is_explained_in_help() {
    use clap::{CommandFactory, Parser};
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: RouterArgs,
    }
    let cmd = Cli::command();
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if id == "help" {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        assert!(help.len() > 20, "--{id} has no real help text: {help:?}");
    }
    let help = Cli::command().render_long_help().to_string();
    for flag in ["--config", "--mode", "--prefill", "--decode", "--health-interval-s", "--listen"] {
        assert!(help.contains(flag), "{flag}");
    }
}

/// Issue #16, window 8: P is told which decode engine the request is for (`consumer_engine_id`), from
/// the `--decode` spec's engine_id or else D's /v1/kvpush/info, so that another engine holding the
/// secret cannot take the KV; a D whose engine id is unknown gets none (P serves the first engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_names_the_chosen_decode_engine_to_p() {
    let arrivals = Arc::new(Arrivals::default());
    let answered = Arc::new(Mutex::new(Vec::new()));
    let p = Fake::start(None, waiting_prefill(arrivals.clone(), answered.clone())).await;
    let d_conf = Fake::start(None, recording_decode(arrivals.clone(), "decoded")).await;
    let d_info = Fake::start(Some(json!({"engine_id": "d-info"})), recording_decode(arrivals.clone(), "decoded")).await;
    let d_none = Fake::start(None, recording_decode(arrivals.clone(), "decoded")).await;
    let mut c = config(TransferMode::Push, &[&p], &[&d_conf, &d_info, &d_none]);
    c.decode[0].engine_id = Some("d-conf".into());
    let (_r, base) = start(c).await;
    let cl = client();
    for _ in 0..3 {
        let req = json!({"model": "m", "prompt": "hello", "max_tokens": 4});
        let resp = within(10.0, "the response", post(&cl, &format!("{base}/v1/completions"), req.to_string())).await;
        let (status, _, body) = read_all(resp).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    // Each D got one request (least outstanding, ties round-robin); P's leg named that D's engine.
    let by_tid: std::collections::HashMap<String, Option<String>> = p
        .requests()
        .iter()
        .map(|pr| (tid(pr), pr.json["kv_transfer_params"]["consumer_engine_id"].as_str().map(str::to_owned)))
        .collect();
    for (d, want) in [(&d_conf, Some("d-conf")), (&d_info, Some("d-info")), (&d_none, None)] {
        let seen = d.requests();
        assert_eq!(seen.len(), 1, "each D gets one request");
        let id = seen[0].json["kv_transfer_params"]["transfer_id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(by_tid.get(&id).cloned().flatten().as_deref(), want, "P's consumer for D {}", d.url);
    }
}
