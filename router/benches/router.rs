//! Router overhead per request: the latency `kvpush router` adds, at 200 concurrent client streams,
//! against fake P and D servers on loopback (the same fakes as router/tests/router.rs).
//!
//! Two phases in the same run, alternated twice: **direct** — every stream sends its requests straight
//! to the fake D; **router** — the same requests through a push-mode router, which sends each one to the
//! fake P (`max_tokens: 1`, a small JSON answer) and the fake D (an SSE stream of 8 events) at once and
//! relays D's stream. Each stream sends its requests one after another; a request's latency runs from
//! sending it to reading the last byte of the response (TTFB: to its first body frame). Added latency =
//! router percentile − direct percentile. Everything shares one tokio runtime on this machine's cores,
//! so the router's CPU cost shows up as added latency, as it would on a loaded host.
//!
//! `cargo bench --bench router` (needs `. scripts/nixl.sh` for the build only). Environment:
//! `KVPUSH_BENCH_STREAMS` (default 200), `KVPUSH_BENCH_REQUESTS` per stream and phase (default 50).
//! Without `--bench` (as `cargo test --all-targets` runs it) it makes one short pass.

#![allow(clippy::unwrap_used)]

#[path = "../tests/router/fake.rs"]
mod fake;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fake::*;
use http_body_util::{BodyExt, Full};
use hyper::header::CONTENT_TYPE;
use hyper::Request;
use kvpush_router::{self as router, Config, InstanceConfig, TransferMode};
use serde_json::json;

const CHUNKS: usize = 8;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Default)]
struct Samples {
    total_us: Vec<f64>,
    ttfb_us: Vec<f64>,
    wall: Duration,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn phase(client: &TestClient, url: &str, streams: usize, per_stream: usize, pace_ms: u64) -> Samples {
    let body = json!({"model": "m", "prompt": "x ".repeat(256), "max_tokens": 8, "stream": true, "x_pace_ms": pace_ms});
    let body = Bytes::from(body.to_string());
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(streams);
    // Paced streams start staggered over one stream's length, as independent clients would.
    let stagger = Duration::from_millis(pace_ms * (CHUNKS as u64 - 1)) / streams.max(1) as u32;
    for i in 0..streams {
        let (client, url, body) = (client.clone(), url.to_owned(), body.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(stagger * i as u32).await;
            let mut out = Vec::with_capacity(per_stream);
            for _ in 0..per_stream {
                let req =
                    Request::post(&url).header(CONTENT_TYPE, "application/json").body(Full::new(body.clone())).unwrap();
                let t = Instant::now();
                let resp = client.request(req).await.unwrap();
                assert_eq!(resp.status(), 200);
                let mut b = resp.into_body();
                let mut ttfb = None;
                let mut n = 0;
                while let Some(f) = b.frame().await {
                    let f = f.unwrap();
                    if let Some(d) = f.data_ref() {
                        ttfb.get_or_insert_with(|| t.elapsed());
                        n += d.len();
                    }
                }
                assert!(n > 0);
                out.push((t.elapsed(), ttfb.unwrap_or_default()));
            }
            out
        }));
    }
    let mut s = Samples::default();
    for t in tasks {
        for (total, ttfb) in t.await.unwrap() {
            s.total_us.push(total.as_secs_f64() * 1e6);
            s.ttfb_us.push(ttfb.as_secs_f64() * 1e6);
        }
    }
    s.wall = start.elapsed();
    s
}

fn merge(a: &mut Samples, b: Samples) {
    a.total_us.extend(b.total_us);
    a.ttfb_us.extend(b.ttfb_us);
    a.wall += b.wall;
}

fn report(scenario: &str, pace_ms: u64, direct: &mut Samples, routed: &mut Samples) {
    for s in [&mut *direct, &mut *routed] {
        s.total_us.sort_by(f64::total_cmp);
        s.ttfb_us.sort_by(f64::total_cmp);
    }
    let rate = |s: &Samples| s.total_us.len() as f64 / s.wall.as_secs_f64();
    let what = if pace_ms == 0 {
        "D sends its events back to back: a closed loop at full CPU".to_owned()
    } else {
        format!("D sends an event every {pace_ms} ms")
    };
    println!("\n{scenario}: {what}");
    println!("{:<16} {:>10} {:>10} {:>10} {:>10} {:>10}", "", "p50 ms", "p99 ms", "TTFB p50", "TTFB p99", "req/s");
    for (name, s) in [("direct to D", &*direct), ("through router", &*routed)] {
        println!(
            "{name:<16} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>10.0}",
            pct(&s.total_us, 0.5) / 1e3,
            pct(&s.total_us, 0.99) / 1e3,
            pct(&s.ttfb_us, 0.5) / 1e3,
            pct(&s.ttfb_us, 0.99) / 1e3,
            rate(s)
        );
    }
    let p = |s: &Samples, q| pct(&s.total_us, q);
    let t = |s: &Samples, q| pct(&s.ttfb_us, q);
    println!(
        "{:<16} {:>+10.3} {:>+10.3} {:>+10.3} {:>+10.3}   (router / direct: p50 x{:.2}, p99 x{:.2}, throughput x{:.2})",
        "added",
        (p(routed, 0.5) - p(direct, 0.5)) / 1e3,
        (p(routed, 0.99) - p(direct, 0.99)) / 1e3,
        (t(routed, 0.5) - t(direct, 0.5)) / 1e3,
        (t(routed, 0.99) - t(direct, 0.99)) / 1e3,
        p(routed, 0.5) / p(direct, 0.5),
        p(routed, 0.99) / p(direct, 0.99),
        rate(routed) / rate(direct)
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("router: bench");
        return;
    }
    let full = std::env::args().any(|a| a == "--bench") && std::env::var("KVPUSH_BENCH_QUICK").is_err();
    let streams = env_usize("KVPUSH_BENCH_STREAMS", if full { 200 } else { 20 });
    let per_stream = env_usize("KVPUSH_BENCH_REQUESTS", if full { 50 } else { 4 });
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let p = Fake::start(None, handler(|_s| async { json_reply(200, &json!({"choices": [{"text": "x"}]})) })).await;
        let d = Fake::start(
            None,
            handler(|s: Seen| async move {
                // D paces its events by the request's `x_pace_ms` (the router passes the field through).
                let pace = Duration::from_millis(s.json["x_pace_ms"].as_u64().unwrap_or(0));
                let (reply, tx) = sse_reply();
                tokio::spawn(async move {
                    for i in 0..CHUNKS {
                        if i > 0 && !pace.is_zero() {
                            tokio::time::sleep(pace).await;
                        }
                        let ev = json!({"id": "cmpl-1", "object": "text_completion",
                                        "choices": [{"index": 0, "text": format!(" tok{i}")}]});
                        if tx.send(sse_event(&ev)).await.is_err() {
                            return;
                        }
                    }
                    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                });
                reply
            }),
        )
        .await;
        let mut cfg = Config::new(
            TransferMode::Push,
            vec![InstanceConfig { engine_id: Some("p0".into()), ..InstanceConfig::new(p.url.clone()) }],
            vec![InstanceConfig::new(d.url.clone())],
        );
        cfg.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let r = router::start(cfg).await.unwrap();
        let client = client_with_pool(4 * streams.max(1));
        let direct_url = format!("{}/v1/completions", d.url);
        let router_url = format!("http://{}/v1/completions", r.local_addr());

        // Warm-up: open the connections on every path.
        phase(&client, &direct_url, streams, 2, 0).await;
        phase(&client, &router_url, streams, 2, 0).await;
        println!(
            "router/overhead: {streams} concurrent client streams, {} requests each per path and scenario, SSE of \
             {CHUNKS} events, push mode, fake P and D on loopback, {} cores",
            2 * per_stream.div_ceil(2),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        for (scenario, pace_ms) in [("paced", 20), ("saturated", 0)] {
            let (mut direct, mut routed) = (Samples::default(), Samples::default());
            // Alternate the two paths so that drift on a shared machine hits both alike.
            for _ in 0..2 {
                merge(&mut direct, phase(&client, &direct_url, streams, per_stream.div_ceil(2), pace_ms).await);
                merge(&mut routed, phase(&client, &router_url, streams, per_stream.div_ceil(2), pace_ms).await);
            }
            report(scenario, pace_ms, &mut direct, &mut routed);
        }
        drop(r);
    });
}
