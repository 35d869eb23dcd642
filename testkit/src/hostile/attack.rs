//! One attacker process of the hostile probe (`kvpush hostile-attack`, internal): it holds no secret,
//! makes its attempts on loopback against the ports it is given, and reports on stdout, one JSON
//! object per line ([`Line`]): how many attempts it made and what it saw. What the attempts achieved is
//! measured on the victims by the parent ([`super::run`]); the attacker's view is only a note.
//!
//! The wire knowledge here is the side channel's public framing (docs/security.md): a cleartext
//! greeting, then records of `u16 big-endian length | bytes`; the proto codec's frames; and the
//! staging notifications of `transport/staged.rs`. Nothing here may read `$KVPUSH_SECRET`.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::child::hex;
use crate::demo::{model, Topology};
use kvpush::proto::codec;
use kvpush::proto::layout::{KvLayout, KvPlacement, Parallel};
use kvpush::proto::msg::{Abort, Completion, Failure, FailureKind, Heartbeat, Message, Registration};
use kvpush::proto::{Key, Rank};
use kvpush::transport::nixl::{NixlConfig, NixlTransport};
use kvpush::transport::Transport;

/// The flags of `kvpush hostile-attack` (hidden).
#[derive(Clone, Debug, clap::Args)]
pub struct AttackArgs {
    /// Which attack.
    #[arg(long)]
    pub attack: String,
    /// P's side-channel port.
    #[arg(long)]
    pub p_port: u16,
    /// D's side-channel port.
    #[arg(long)]
    pub d_port: u16,
    /// Keys of requests D registered (`<32 hex>#<attempt>`, comma-separated).
    #[arg(long, default_value = "")]
    pub keys: String,
    /// D's NIXL agent name.
    #[arg(long, default_value = "")]
    pub d_agent: String,
    /// D's NIXL agent metadata (hex), as a peer loads it.
    #[arg(long, default_value = "")]
    pub d_metadata: String,
    /// Connections of the flood.
    #[arg(long, default_value_t = 10_000)]
    pub connections: usize,
    /// Repetitions of the other attacks.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
}

impl AttackArgs {
    /// The command line after `kvpush hostile-attack`.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--attack".into(),
            self.attack.clone(),
            "--p-port".into(),
            self.p_port.to_string(),
            "--d-port".into(),
            self.d_port.to_string(),
            "--keys".into(),
            self.keys.clone(),
            "--d-agent".into(),
            self.d_agent.clone(),
            "--d-metadata".into(),
            self.d_metadata.clone(),
            "--connections".into(),
            self.connections.to_string(),
            "--rounds".into(),
            self.rounds.to_string(),
        ]
    }
}

/// Attacker → parent, one JSON object per line.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "line", rename_all = "snake_case")]
pub enum Line {
    /// The relay listens here (the victim is to dial it).
    Listening {
        /// The port.
        port: u16,
    },
    /// The attack is over.
    Done {
        /// Attempts made.
        attempts: u64,
        /// What the attacker saw.
        note: String,
    },
    /// The attack could not be carried out.
    Failed {
        /// Why.
        message: String,
    },
}

fn emit(l: &Line) {
    if let Ok(s) = serde_json::to_string(l) {
        println!("{s}");
    }
}

/// Runs `kvpush hostile-attack`; returns the exit code.
pub fn attack_main(args: &AttackArgs) -> i32 {
    let keys = match parse_keys(&args.keys) {
        Ok(k) => k,
        Err(message) => {
            emit(&Line::Failed { message });
            return 2;
        }
    };
    let p: SocketAddr = ([127, 0, 0, 1], args.p_port).into();
    let d: SocketAddr = ([127, 0, 0, 1], args.d_port).into();
    let r = match args.attack.as_str() {
        "trickled_header" => trickled_header(p, args.rounds.clamp(1, 64)),
        "connection_flood" => connection_flood(p, args.connections),
        "forged_registrations" => forged(p, "decode", args.rounds, &registrations(&keys)),
        "forged_aborts" => forged(p, "decode", args.rounds, &aborts(&keys)),
        "forged_completions" => forged(d, "prefill", args.rounds, &completions(&keys)),
        "oversized_registrations" => oversized(p, args.rounds),
        "forged_notifications" => notifications(args, &keys, false),
        "forged_staged_requests" => notifications(args, &keys, true),
        "relay" | "replayed_frames" | "reflected_frames" => relay(p, &args.attack, args.rounds),
        other => Err(format!("unknown attack {other}")),
    };
    match r {
        Ok((attempts, note)) => {
            emit(&Line::Done { attempts, note });
            0
        }
        Err(message) => {
            emit(&Line::Failed { message });
            1
        }
    }
}

fn parse_keys(s: &str) -> Result<Vec<Key>, String> {
    s.split(',')
        .filter(|k| !k.is_empty())
        .map(|k| {
            let (id, attempt) = k.split_once('#').ok_or_else(|| format!("bad key {k}"))?;
            let id = u128::from_str_radix(id, 16).map_err(|e| format!("bad key {k}: {e}"))?;
            Ok(Key::new(id, attempt.parse().map_err(|e| format!("bad key {k}: {e}"))?))
        })
        .collect()
}

/// A dialer's greeting (docs/security.md): magic, this build's version (so that an attack gets past
/// the version check to what it attacks), role 0, auth 1 (psk), rank, engine id.
fn greeting(engine_id: &str, role: u8) -> Vec<u8> {
    let mut g = b"KVPSIDE2".to_vec();
    g.extend_from_slice(&kvpush::engine::side::SIDE_VERSION.to_le_bytes());
    g.push(role);
    g.push(1);
    g.extend_from_slice(&0u16.to_le_bytes());
    g.extend_from_slice(&0u16.to_le_bytes());
    g.extend_from_slice(&(engine_id.len() as u16).to_le_bytes());
    g.extend_from_slice(engine_id.as_bytes());
    g
}

/// A side-channel record around `body`.
fn record(body: &[u8]) -> Vec<u8> {
    let mut r = (body.len().min(usize::from(u16::MAX)) as u16).to_be_bytes().to_vec();
    r.extend_from_slice(body);
    r
}

fn frame(msg: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = codec::encode(msg, &mut out);
    out
}

/// The demo's consumer layout, without memory (a registration's block ids are checked against it).
fn layout() -> KvLayout {
    let t = Topology { layers: 4, num_blocks: 1024, ..Topology::default() };
    let mut l = KvLayout {
        model: model(&t),
        block_tokens: t.d_block,
        order: t.order,
        placement: KvPlacement::Separate,
        block_stride: 0,
        num_blocks: t.num_blocks,
        parallel: Parallel { tp_rank: 0, tp_size: 1, pp_rank: 0, pp_size: 1 },
        region_bases: Vec::new(),
    };
    l.block_stride = l.part_bytes();
    l
}

const RANK0: Rank = Rank { tp: 0, pp: 0 };

fn registrations(keys: &[Key]) -> Vec<Vec<u8>> {
    let l = layout();
    let groups = l.model.groups.len();
    keys.iter()
        .filter_map(|&k| Registration::new(k, "decode".into(), RANK0, 64, vec![(0..4).collect(); groups], &l).ok())
        .map(|r| frame(&Message::Registration(r)))
        .collect()
}

fn aborts(keys: &[Key]) -> Vec<Vec<u8>> {
    keys.iter().map(|&key| frame(&Message::Abort(Abort { key, rank: RANK0, reason: "forged".into() }))).collect()
}

fn completions(keys: &[Key]) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> =
        keys.iter().map(|&key| frame(&Message::Completion(Completion { key, rank: RANK0 }))).collect();
    v.extend(keys.iter().map(|&key| {
        frame(&Message::Failure(Failure {
            key,
            rank: RANK0,
            kind: FailureKind::TransferFailed { status: -1 },
            detail: "forged".into(),
        }))
    }));
    v
}

fn connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    Ok(s)
}

/// Reads until the peer closes (or `limit`); bytes read.
fn read_to_close(s: &mut TcpStream, limit: Duration) -> u64 {
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 4096];
    let mut n = 0u64;
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    n
}

/// Forged frames after a greeting: as cleartext frames, and wrapped as records.
fn forged(addr: SocketAddr, claim: &str, rounds: usize, frames: &[Vec<u8>]) -> Result<(u64, String), String> {
    if frames.is_empty() {
        return Err("no frames to forge (no keys given?)".into());
    }
    let (mut attempts, mut answered) = (0u64, 0u64);
    for i in 0..rounds.max(1) {
        let f = &frames[i % frames.len()];
        let mut s = connect(addr)?;
        let mut bytes = greeting(claim, 0);
        if i % 2 == 0 {
            bytes.extend_from_slice(f);
        } else {
            bytes.extend_from_slice(&record(f));
        }
        // The peer may close before it read everything: that is the point.
        let _ = s.write_all(&bytes);
        attempts += 1;
        answered += read_to_close(&mut s, Duration::from_secs(2));
    }
    Ok((attempts, format!("{answered} bytes came back in all (the greetings)")))
}

/// Greetings and records over their limits.
fn oversized(addr: SocketAddr, rounds: usize) -> Result<(u64, String), String> {
    let l = layout();
    let groups = l.model.groups.len();
    let big: Vec<u32> = (0..l.num_blocks).cycle().take(1 << 20).collect();
    let huge = Registration::new(Key::new(1, 1), "decode".into(), RANK0, 1 << 24, vec![big; groups], &l)
        .ok()
        .map(|r| frame(&Message::Registration(r)))
        .unwrap_or_else(|| vec![0x4b; 8 << 20]);
    let mut attempts = 0u64;
    let mut closed_fast = 0u64;
    for i in 0..rounds.max(3) {
        let mut s = connect(addr)?;
        let mut bytes = Vec::new();
        match i % 3 {
            // A record far over the pre-authentication limit.
            0 => {
                bytes.extend_from_slice(&greeting("decode", 0));
                bytes.extend_from_slice(&[0xff, 0xff]);
                bytes.extend(std::iter::repeat_n(0x5a, 65_535));
            }
            // A greeting whose engine id claims 65,535 bytes.
            1 => {
                let mut g = greeting("decode", 0);
                let n = g.len();
                g[n - 8..n - 6].copy_from_slice(&u16::MAX.to_le_bytes());
                bytes.extend_from_slice(&g[..n - 6]);
                bytes.extend(std::iter::repeat_n(0x41, 65_535));
            }
            // A registration of a million block ids per group, as a cleartext frame.
            _ => {
                bytes.extend_from_slice(&greeting("decode", 0));
                bytes.extend_from_slice(&huge);
            }
        }
        let t0 = Instant::now();
        let _ = s.write_all(&bytes);
        attempts += 1;
        read_to_close(&mut s, Duration::from_secs(3));
        closed_fast += u64::from(t0.elapsed() < Duration::from_secs(2));
    }
    Ok((
        attempts,
        format!("{closed_fast} of {attempts} connections closed within 2 s; registration frame {} bytes", huge.len()),
    ))
}

/// Connections that send a greeting and a 16 MiB frame header one byte every 40 ms.
fn trickled_header(addr: SocketAddr, n: usize) -> Result<(u64, String), String> {
    let mut header = frame(&Message::Heartbeat(Heartbeat { seq: 0 }));
    header.truncate(codec::HEADER_LEN);
    header[5..9].copy_from_slice(&(16u32 << 20).to_le_bytes());
    let mut payload = greeting(&"d".repeat(256), 0);
    payload.extend_from_slice(&header);
    payload.extend(std::iter::repeat_n(0u8, 4096));
    let mut conns: Vec<(TcpStream, Instant, Option<Duration>)> = Vec::new();
    for _ in 0..n {
        let s = connect(addr)?;
        let _ = s.set_nonblocking(true);
        conns.push((s, Instant::now(), None));
    }
    let started = Instant::now();
    let mut pos = 0;
    let mut buf = [0u8; 512];
    while started.elapsed() < Duration::from_secs(20) && conns.iter().any(|c| c.2.is_none()) {
        for (s, t0, closed) in conns.iter_mut().filter(|c| c.2.is_none()) {
            let gone = match s.read(&mut buf) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
            };
            let gone = gone || (pos < payload.len() && s.write(&payload[pos..=pos]).is_err());
            if gone {
                *closed = Some(t0.elapsed());
            }
        }
        pos += 1;
        std::thread::sleep(Duration::from_millis(40));
    }
    let closed: Vec<f64> = conns.iter().filter_map(|c| c.2.map(|d| d.as_secs_f64())).collect();
    let max = closed.iter().copied().fold(0.0, f64::max);
    Ok((
        n as u64,
        format!(
            "{} of {n} connections closed by the victim (the last after {max:.1} s); {pos} bytes trickled to those left",
            closed.len()
        ),
    ))
}

/// `n` connections as fast as they go, at most 256 open at once, each sending half a greeting.
fn connection_flood(addr: SocketAddr, n: usize) -> Result<(u64, String), String> {
    let started = Instant::now();
    let mut open = std::collections::VecDeque::new();
    let (mut attempts, mut refused) = (0u64, 0u64);
    let half = &greeting("decode", 0)[..8];
    for _ in 0..n {
        attempts += 1;
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(mut s) => {
                let _ = s.write_all(half);
                open.push_back(s);
                if open.len() > 256 {
                    if let Some(s) = open.pop_front() {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                }
            }
            Err(_) => refused += 1,
        }
    }
    drop(open);
    Ok((attempts, format!("{refused} connects failed; {:.1} s", started.elapsed().as_secs_f64())))
}

/// A NIXL agent of the attacker's own, named after P's agent (`prefill/0`) and after nobody
/// (`mallory/0`), loads D's metadata and sends forged completions and failures as notifications, or
/// (staged) staging requests whose notification is a forged completion, and pieces nobody granted.
fn notifications(args: &AttackArgs, keys: &[Key], staged: bool) -> Result<(u64, String), String> {
    let md = hex::decode(&args.d_metadata).map_err(|e| format!("D's metadata: {e}"))?;
    let frames = completions(keys);
    let (mut attempts, mut errors, mut grants) = (0u64, 0u64, 0u64);
    let mut last_error = String::new();
    for name in ["prefill/0", "mallory/0"] {
        let agent = NixlTransport::new(&NixlConfig::new(name)).map_err(|e| format!("agent {name}: {e}"))?;
        let peer = agent.load_remote(&md).map_err(|e| format!("{name} loading D's metadata: {e}"))?;
        for i in 0..args.rounds.max(1) {
            let f = &frames[i % frames.len()];
            let msgs: Vec<Vec<u8>> = if staged {
                let tag = 1_000 + i as u64;
                let mut request = b"KS\x01".to_vec();
                request.extend_from_slice(&tag.to_le_bytes());
                request.extend_from_slice(&1u32.to_le_bytes());
                request.extend_from_slice(f);
                // Pieces nobody was granted, into each slot, with no entries: "all scattered".
                let mut out = vec![request];
                for slot in 0u32..2 {
                    let mut piece = b"KS\x03".to_vec();
                    piece.extend_from_slice(&tag.to_le_bytes());
                    for v in [0u32, slot, 0] {
                        piece.extend_from_slice(&v.to_le_bytes());
                    }
                    piece.extend_from_slice(&0u64.to_le_bytes());
                    out.push(piece);
                }
                out
            } else {
                vec![f.clone()]
            };
            for (k, m) in msgs.into_iter().enumerate() {
                if k == 1 {
                    // Give the receiver time to grant a slot to the name we claim.
                    std::thread::sleep(Duration::from_millis(20));
                }
                attempts += 1;
                if let Err(e) = agent.send_notification(&peer, &m) {
                    errors += 1;
                    last_error = e.to_string();
                }
            }
            let mut got = Vec::new();
            let _ = agent.take_notifications(&mut got);
            grants += got.iter().filter(|n| n.msg.starts_with(b"KS\x02")).count() as u64;
            std::thread::sleep(Duration::from_millis(5));
        }
        // Let the last notifications leave before the agent goes.
        for _ in 0..20 {
            let mut got = Vec::new();
            let _ = agent.take_notifications(&mut got);
            grants += got.iter().filter(|n| n.msg.starts_with(b"KS\x02")).count() as u64;
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok((attempts, format!("{errors} sends failed ({last_error}); {grants} staging grants came back")))
}

/// Greeting and record boundaries of one direction of a relayed connection.
#[derive(Default)]
struct Stream {
    buf: Vec<u8>,
    greeting: Option<Vec<u8>>,
    records: Vec<Vec<u8>>,
}

impl Stream {
    /// Takes what arrived; returns the complete records it finished (with their length prefix).
    fn feed(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(bytes);
        let mut done = Vec::new();
        if self.greeting.is_none() {
            if self.buf.len() < 18 {
                return done;
            }
            let n = 18 + usize::from(u16::from_le_bytes([self.buf[16], self.buf[17]]));
            if self.buf.len() < n {
                return done;
            }
            self.greeting = Some(self.buf.drain(..n).collect());
        }
        while self.buf.len() >= 2 {
            let n = 2 + usize::from(u16::from_be_bytes([self.buf[0], self.buf[1]]));
            if self.buf.len() < n {
                break;
            }
            let r: Vec<u8> = self.buf.drain(..n).collect();
            self.records.push(r.clone());
            done.push(r);
        }
        done
    }
}

/// The shared state of one relayed connection.
struct Relayed {
    to_p: TcpStream,
    dialer: Stream,
    listener: Stream,
}

/// A relay between the victim (dialing here) and P. `relay` forwards and then injects forged
/// records towards P; `replayed_frames` sends the victim's first frame again (twice) and, on a fresh
/// connection, the whole first connection's dialer side; `reflected_frames` sends P's own records
/// back to P, and P's greeting back to P on a fresh connection.
fn relay(p: SocketAddr, mode: &str, rounds: usize) -> Result<(u64, String), String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    emit(&Line::Listening { port });
    let _ = listener.set_nonblocking(true);
    let attempts = Arc::new(AtomicU64::new(0));
    let first: Arc<Mutex<Option<Vec<u8>>>> = Arc::new(Mutex::new(None));
    let mut threads = Vec::new();
    let mut served = 0;
    let mut idle_since = Instant::now();
    while served < rounds && idle_since.elapsed() < Duration::from_secs(30) {
        let victim = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(format!("accept: {e}")),
        };
        let _ = victim.set_nonblocking(false);
        served += 1;
        idle_since = Instant::now();
        let to_p = connect(p)?;
        let (attempts, first, mode) = (Arc::clone(&attempts), Arc::clone(&first), mode.to_owned());
        threads.push(std::thread::spawn(move || relay_one(victim, to_p, p, &mode, &attempts, &first)));
    }
    for t in threads {
        let _ = t.join();
    }
    Ok((attempts.load(Ordering::Relaxed), format!("{served} connections relayed")))
}

fn relay_one(
    victim: TcpStream,
    to_p: TcpStream,
    p: SocketAddr,
    mode: &str,
    attempts: &AtomicU64,
    first: &Mutex<Option<Vec<u8>>>,
) {
    let (Ok(victim_r), Ok(p_r), Ok(victim_w)) = (victim.try_clone(), to_p.try_clone(), victim.try_clone()) else {
        return;
    };
    let state = Arc::new(Mutex::new(Relayed { to_p, dialer: Stream::default(), listener: Stream::default() }));
    let lock = |s: &Arc<Mutex<Relayed>>| Arc::clone(s);
    // P → victim: forwarded as is, records remembered (for reflection).
    let st = lock(&state);
    let back = std::thread::spawn(move || {
        let (mut from, mut to) = (p_r, victim_w);
        let mut buf = vec![0u8; 65_536];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            st.lock().unwrap_or_else(std::sync::PoisonError::into_inner).listener.feed(&buf[..n]);
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
    });
    // Victim → P: forwarded, then tampered with after the handshake (the dialer's 4th record).
    let mut from = victim_r;
    let mut buf = vec![0u8; 65_536];
    let mut all = Vec::new();
    let mut tampered = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut g = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if all.len() < 1 << 20 {
            all.extend_from_slice(&buf[..n]);
        }
        let done = g.dialer.feed(&buf[..n]);
        if g.to_p.write_all(&buf[..n]).is_err() {
            break;
        }
        if tampered || g.dialer.records.len() < 4 {
            continue;
        }
        tampered = true;
        let frame_rec = done.last().cloned().unwrap_or_default();
        match mode {
            "relay" => {
                // A record of the right size whose bytes nobody sealed, then a cleartext frame.
                let forged = record(&vec![0x5a; frame_rec.len().saturating_sub(2).max(17)]);
                let _ = g.to_p.write_all(&forged);
                let hb = record(&frame(&Message::Heartbeat(Heartbeat { seq: 7 })));
                let _ = g.to_p.write_all(&hb);
                attempts.fetch_add(2, Ordering::Relaxed);
            }
            "replayed_frames" => {
                let _ = g.to_p.write_all(&frame_rec);
                let _ = g.to_p.write_all(&frame_rec);
                attempts.fetch_add(2, Ordering::Relaxed);
                let mut f = first.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                match f.as_ref() {
                    None => *f = Some(all.clone()),
                    Some(old) => {
                        // A whole earlier connection's dialer side, on a fresh connection.
                        if let Ok(mut s) = connect(p) {
                            let _ = s.write_all(old);
                            attempts.fetch_add(1, Ordering::Relaxed);
                            read_to_close(&mut s, Duration::from_secs(2));
                        }
                    }
                }
            }
            _ => {
                // P's own records back to P, then P's greeting to P as a dialer's.
                let own: Vec<Vec<u8>> = g.listener.records.iter().skip(1).cloned().collect();
                for r in &own {
                    let _ = g.to_p.write_all(r);
                    attempts.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(greet) = g.listener.greeting.clone() {
                    if let Ok(mut s) = connect(p) {
                        let _ = s.write_all(&greet);
                        let _ = s.write_all(&g.listener.records.first().cloned().unwrap_or_default());
                        attempts.fetch_add(1, Ordering::Relaxed);
                        read_to_close(&mut s, Duration::from_secs(2));
                    }
                }
            }
        }
    }
    let g = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let _ = g.to_p.shutdown(Shutdown::Both);
    drop(g);
    let _ = victim.shutdown(Shutdown::Both);
    let _ = back.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_relay_splits_greetings_and_records_however_bytes_arrive() {
        let mut wire = greeting("decode", 0);
        wire.extend_from_slice(&record(&[1, 2, 3]));
        wire.extend_from_slice(&record(&[9; 300]));
        for cut in 0..wire.len() {
            let mut s = Stream::default();
            let mut done = s.feed(&wire[..cut]);
            done.extend(s.feed(&wire[cut..]));
            assert_eq!(s.greeting.as_deref(), Some(&greeting("decode", 0)[..]), "cut {cut}");
            assert_eq!(done, vec![record(&[1, 2, 3]), record(&[9; 300])], "cut {cut}");
        }
    }

    #[test]
    fn keys_parse_as_the_probe_prints_them() {
        let k = Key::new(0xabc, 3);
        assert_eq!(parse_keys(&format!("{k},{k}")).unwrap(), vec![k, k]);
        assert!(parse_keys("").unwrap().is_empty());
        assert!(parse_keys("xyz#1").is_err());
    }

    #[test]
    fn forged_frames_are_real_codec_frames() {
        let keys = [Key::new(7, 1)];
        for f in registrations(&keys).iter().chain(&aborts(&keys)).chain(&completions(&keys)) {
            assert!(codec::decode(f, Some(&layout())).is_ok());
        }
        assert_eq!(registrations(&keys).len(), 1);
    }
}
