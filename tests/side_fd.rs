//! A side-channel descriptor closed under the I/O thread by other code in the process (a double
//! close elsewhere in an engine's host, such as vLLM's): `poll(2)` then answers `POLLNVAL` for it at
//! once, every time. The connection must be reported lost once and at once, the I/O thread must not
//! spin on it, the side channel's other connections go on, and the number, no longer the
//! connection's, is never closed again (it may belong to another file by then).
//!
//! This binary holds one test: it closes a descriptor it does not own, and in a process running other
//! tests the number could be opened by one of them before the I/O thread polls it again.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use kvpush::engine::side::SideConfig;
use kvpush::proto::{Key, Mode};
use kvpush::transport::loopback::Fabric;
use kvpush_testkit::engines::{self, SideWorker};

/// Quiet connections: no heartbeat and no silence timeout within the test, so nothing but the I/O
/// thread's handling of the descriptor can notice the close.
fn quiet() -> SideConfig {
    let mut c = SideConfig::for_rank(0);
    c.listen = "127.0.0.1:0".into();
    c.secret = Some(b"0123456789abcdef0123456789abcdef".to_vec());
    c.heartbeat = Duration::from_secs(60);
    c.peer_timeout = Duration::from_secs(120);
    c.handshake_timeout = Duration::from_secs(5);
    c
}

fn worker(id: &str, mode: Mode, fabric: &Fabric) -> SideWorker {
    // SAFETY: precondition 2: no block of a registered request is written or reused here.
    unsafe { engines::side_worker(id, id, mode, fabric, quiet()) }
}

/// This process's TCP sockets connected to `peer`.
fn sockets_to(peer: SocketAddr) -> Vec<i32> {
    let SocketAddr::V4(peer) = peer else { panic!("the side channels listen on 127.0.0.1") };
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd") {
        let Some(fd) = entry.ok().and_then(|e| e.file_name().to_str()?.parse::<i32>().ok()) else { continue };
        // SAFETY: all-zero bytes are a valid sockaddr_in.
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: `addr` is a writable sockaddr_in of `len` bytes; getpeername writes at most `len`
        // bytes and fails harmlessly (ENOTSOCK, EBADF) on a descriptor that is not a connected socket.
        let r = unsafe { libc::getpeername(fd, std::ptr::addr_of_mut!(addr).cast(), &mut len) };
        if r == 0
            && i32::from(addr.sin_family) == libc::AF_INET
            && u16::from_be(addr.sin_port) == peer.port()
            && u32::from_be(addr.sin_addr.s_addr) == u32::from(*peer.ip())
        {
            out.push(fd);
        }
    }
    out
}

/// Whether `fd` is an open descriptor of this process.
fn is_open(fd: i32) -> bool {
    // SAFETY: F_GETFD reads the descriptor's flags; on a closed number it fails with EBADF.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    flags != -1
}

fn until(what: &str, limit: Duration, f: impl Fn() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    t0.elapsed()
}

#[test]
fn a_descriptor_closed_under_the_io_thread_is_one_lost_connection_no_spin_and_never_closed_again() {
    let fabric = Fabric::new();
    let (p1, p2) = (worker("prefill1", Mode::Push, &fabric), worker("prefill2", Mode::Push, &fabric));
    let d = worker("decode", Mode::Push, &fabric);
    d.side.connect(p1.side.local_addr()).expect("handshake with P1");
    d.side.connect(p2.side.local_addr()).expect("handshake with P2");
    let mine = sockets_to(p1.side.local_addr());
    assert_eq!(mine.len(), 1, "D's one connection to P1: {mine:?}");
    let fd = mine[0];
    std::thread::sleep(Duration::from_millis(300));
    let (c0, t0) = (engines::process_cpu_seconds(), Instant::now());

    // Other code closes D's descriptor; D's next turn of the I/O thread polls the closed number.
    // SAFETY: the number is D's connection's, whose stream will not be used by anyone but D's side
    // channel; this binary runs nothing else that opens a file until the I/O thread has polled it.
    assert_eq!(unsafe { libc::close(fd) }, 0);
    d.engine.blocks_allocated(Key::new(1, 1), "prefill2", vec![vec![1]], 16).expect("register with P2");

    let took = until("D reports P1 lost", Duration::from_secs(5), || d.side.stats().peers_lost >= 1);
    println!("D reported the connection lost {took:?} after the close");
    until("P1 hears the connection end", Duration::from_secs(5), || p1.side.stats().peers_lost == 1);
    std::thread::sleep(Duration::from_millis(700));
    let share = (engines::process_cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    println!("the process used {:.1}% of a core in the {:?} after the close", share * 100.0, t0.elapsed());
    assert!(share < 0.25, "the I/O thread spins on the closed descriptor: {:.0}% of a core", share * 100.0);
    assert_eq!(d.side.stats().peers_lost, 1, "reported once: {:?}", d.side.stats());

    // The other connection was not touched: P2 took the registration and still hears D.
    until("P2 took the registration", Duration::from_secs(5), || p2.engine.stats().counters.registrations == 1);
    assert_eq!(d.side.peers().len(), 1, "D's connection to P2 is gone: {:?}", d.side.peers());
    d.engine.blocks_allocated(Key::new(2, 1), "prefill2", vec![vec![2]], 16).expect("register with P2 again");
    until("P2 took the second registration", Duration::from_secs(5), || p2.engine.stats().counters.registrations == 2);
    assert_eq!(p2.side.stats().peers_lost, 0);

    // The number is free now: whatever opens it next owns it, and D's side channel going away must not
    // close it (a connection whose descriptor was closed under it leaves the number alone).
    let mut files = Vec::new();
    while files.len() < 256 && files.last().is_none_or(|f: &std::fs::File| f.as_raw_fd() != fd) {
        files.push(std::fs::File::open("/dev/null").expect("open /dev/null"));
    }
    assert_eq!(files.last().map(AsRawFd::as_raw_fd), Some(fd), "the closed number was not handed out again");
    drop(d);
    assert!(is_open(fd), "D's side channel closed a descriptor that was no longer its own");
}
