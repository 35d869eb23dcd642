//! The one child-process harness: a parent spawns workers (usually its own executable), sends them
//! commands as JSON lines on their stdin and reads their replies as tagged JSON lines on their
//! stdout; everything else a child prints is forwarded as log lines and its last lines are kept for
//! error messages. Dropping a [`Child`] kills and reaps the process. `kvpush demo --processes 2`
//! (`demo::procs`) and the GPU bench (`benches/gpu_push.rs`) both run on it.
//!
//! Read [`Child::spawn`] (the parent's side), then [`Channel`] (the child's side). A reply is one
//! line, [`TAG`] followed by a JSON object; [`Channel::open`] keeps the child's original stdout for
//! replies alone and points file descriptor 1 at stderr, so what libraries print (UCX logs through C
//! stdio, which can interleave mid-line) never mixes with the protocol. One clock for every process
//! on a host: [`now_ns`] (`CLOCK_MONOTONIC`, system-wide on Linux). Bytes travel as [`hex`].

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// The prefix of a reply line on a child's stdout.
pub const TAG: &str = "@kvpush ";

/// How many of a child's last non-protocol lines are kept for error messages.
const TAIL_LINES: usize = 400;

/// Nanoseconds on the host's monotonic clock: comparable between processes of one host.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Microseconds on the same clock as [`now_ns`].
pub fn now_us() -> u64 {
    now_ns() / 1000
}

/// Bytes as lowercase hex digits, and back.
pub mod hex {
    /// `bytes` as two lowercase hex digits each.
    pub fn encode(bytes: &[u8]) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            s.push(char::from(DIGITS[usize::from(b >> 4)]));
            s.push(char::from(DIGITS[usize::from(b & 15)]));
        }
        s
    }

    /// Why a string is not hex.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
    pub enum HexError {
        /// An odd number of digits.
        #[error("odd number of hex digits ({0})")]
        OddLength(usize),
        /// A character that is not a hex digit, at this byte offset.
        #[error("not a hex digit at offset {0}")]
        BadDigit(usize),
    }

    /// The bytes of `s` (upper or lower case digits).
    pub fn decode(s: &str) -> Result<Vec<u8>, HexError> {
        let digits = s.as_bytes();
        if !digits.len().is_multiple_of(2) {
            return Err(HexError::OddLength(digits.len()));
        }
        let value = |i: usize| -> Result<u8, HexError> {
            match digits[i] {
                c @ b'0'..=b'9' => Ok(c - b'0'),
                c @ b'a'..=b'f' => Ok(c - b'a' + 10),
                c @ b'A'..=b'F' => Ok(c - b'A' + 10),
                _ => Err(HexError::BadDigit(i)),
            }
        };
        (0..digits.len()).step_by(2).map(|i| Ok(value(i)? << 4 | value(i + 1)?)).collect()
    }
}

/// What a child's reader thread passes on, tagged with the child's name.
#[derive(Debug)]
pub enum Incoming<R> {
    /// A reply.
    Reply(R),
    /// A tagged line that does not parse as a reply (the text says why).
    Garbled(String),
    /// The child closed its stdout (it exited or is exiting).
    Closed,
}

/// Where a child's log lines go (e.g. around a progress bar).
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// A running child. Dropping it closes its stdin, kills it and reaps it.
pub struct Child {
    name: String,
    child: std::process::Child,
    stdin: Option<ChildStdin>,
    tail: Arc<Mutex<VecDeque<String>>>,
    muted: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Child {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Child").field("name", &self.name).field("pid", &self.child.id()).finish_non_exhaustive()
    }
}

fn remember(tail: &Mutex<VecDeque<String>>, line: String) {
    let mut t = tail.lock().unwrap_or_else(PoisonError::into_inner);
    if t.len() == TAIL_LINES {
        t.pop_front();
    }
    t.push_back(line);
}

impl Child {
    /// Starts `cmd` with piped standard streams. Its replies (`R`) go to `tx` tagged with `id`; its
    /// other lines, prefixed with `[name]`, go to `log` (default: this process's stderr) and into
    /// the tail kept for [`Child::tail`].
    pub fn spawn<I, R>(
        mut cmd: std::process::Command,
        name: &str,
        id: I,
        tx: Sender<(I, Incoming<R>)>,
        log: Option<LogFn>,
    ) -> std::io::Result<Child>
    where
        I: Clone + Send + 'static,
        R: DeserializeOwned + Send + 'static,
    {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let muted = Arc::new(AtomicBool::new(false));
        let log: LogFn = log.unwrap_or_else(|| Arc::new(|l: &str| eprintln!("{l}")));
        let mut threads = Vec::new();
        if let Some(out) = child.stdout.take() {
            let (tail, log, muted, name) = (Arc::clone(&tail), Arc::clone(&log), Arc::clone(&muted), name.to_owned());
            threads.push(std::thread::Builder::new().name(format!("kvpush-{name}-stdout")).spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    let incoming = match line.find(TAG).map(|i| &line[i + TAG.len()..]) {
                        Some(json) => match serde_json::from_str::<R>(json) {
                            Ok(r) => Incoming::Reply(r),
                            Err(e) => Incoming::Garbled(format!("{json:?}: {e}")),
                        },
                        None => {
                            if !line.trim().is_empty() {
                                let l = format!("[{name} stdout] {line}");
                                if !muted.load(Ordering::Relaxed) {
                                    log(&l);
                                }
                                remember(&tail, l);
                            }
                            continue;
                        }
                    };
                    if tx.send((id.clone(), incoming)).is_err() {
                        return;
                    }
                }
                let _ = tx.send((id, Incoming::Closed));
            })?);
        }
        if let Some(err) = child.stderr.take() {
            let (tail, muted, name) = (Arc::clone(&tail), Arc::clone(&muted), name.to_owned());
            threads.push(std::thread::Builder::new().name(format!("kvpush-{name}-stderr")).spawn(move || {
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    let l = format!("[{name}] {line}");
                    if !muted.load(Ordering::Relaxed) {
                        log(&l);
                    }
                    remember(&tail, l);
                }
            })?);
        }
        Ok(Child { name: name.to_owned(), child, stdin, tail, muted, threads })
    }

    /// The name given to [`Child::spawn`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one command as a JSON line.
    pub fn send<C: Serialize>(&mut self, cmd: &C) -> std::io::Result<()> {
        let stdin = self.stdin.as_mut().ok_or_else(|| std::io::Error::other("stdin already closed"))?;
        let mut line = serde_json::to_vec(cmd).map_err(std::io::Error::other)?;
        line.push(b'\n');
        stdin.write_all(&line)?;
        stdin.flush()
    }

    /// Stops forwarding the child's log lines (they are still kept for [`Child::tail`]): for a
    /// normal shutdown, where each side logs its peers going away.
    pub fn mute(&self) {
        self.muted.store(true, Ordering::Relaxed);
    }

    /// The child's last log lines.
    pub fn tail(&self) -> Vec<String> {
        self.tail.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect()
    }

    /// Its exit status, if it exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kills the child at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        if let Some(s) = self.try_wait() {
            return Some(s);
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// Closes the child's stdin: a well-behaved child exits. [`Child::close`] then waits for it.
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// Closes the child's stdin (a well-behaved child exits), waits up to `grace`, then kills it;
    /// reaps it either way.
    pub fn close(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.stdin.take();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        tracing::warn!(child = %self.name, pid = self.pid(), "did not exit after its stdin closed; killing it");
        self.kill()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stdin.take();
        self.kill();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A child's side of the protocol: replies go out on the original stdout, alone.
#[derive(Debug)]
pub struct Channel {
    out: File,
    broken: bool,
}

impl Channel {
    /// Keeps this process's stdout for replies and points file descriptor 1 at stderr. Call it first
    /// in the child, before any library starts.
    pub fn open() -> std::io::Result<Channel> {
        use std::os::fd::FromRawFd;
        // SAFETY: dup on this process's own standard output; the result is checked below.
        let fd = unsafe { libc::dup(1) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns; the File closes it.
        let out = unsafe { File::from_raw_fd(fd) };
        // SAFETY: dup2 of this process's own stderr onto its stdout; fd 1 stays open (a copy of fd 2)
        // for anyone who writes to it.
        if unsafe { libc::dup2(2, 1) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Channel { out, broken: false })
    }

    /// Sends one reply. A write error means the parent is gone: it is remembered ([`Channel::broken`])
    /// and later replies are dropped.
    pub fn emit<T: Serialize>(&mut self, reply: &T) {
        if self.broken {
            return;
        }
        let line = match serde_json::to_string(reply) {
            Ok(json) => format!("{TAG}{json}\n"),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a reply");
                return;
            }
        };
        if self.out.write_all(line.as_bytes()).and_then(|()| self.out.flush()).is_err() {
            self.broken = true;
        }
    }

    /// Whether a reply could not be written (the parent is gone).
    pub fn broken(&self) -> bool {
        self.broken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_names_what_is_wrong() {
        let bytes: Vec<u8> = (0..=255).collect();
        let text = hex::encode(&bytes);
        assert_eq!(&text[..8], "00010203");
        assert_eq!(&text[text.len() - 4..], "feff");
        assert_eq!(hex::decode(&text), Ok(bytes));
        assert_eq!(hex::decode("ABcd"), Ok(vec![0xab, 0xcd]));
        assert_eq!(hex::decode("abc"), Err(hex::HexError::OddLength(3)));
        assert_eq!(hex::decode("0g"), Err(hex::HexError::BadDigit(1)));
    }

    #[test]
    fn the_clock_is_monotonic_and_in_nanoseconds() {
        let a = now_ns();
        std::thread::sleep(Duration::from_millis(5));
        let b = now_ns();
        assert!(b - a >= 5_000_000 && b - a < 5_000_000_000, "{a} -> {b}");
    }

    #[test]
    fn a_child_replies_logs_and_is_killed_on_drop() {
        // A shell stands in for a worker: one reply, one log line on each stream, then it waits.
        let mut cmd = std::process::Command::new("sh");
        cmd.args([
            "-c",
            &format!("echo '{TAG}{{\"n\":7}}'; echo noise; echo oops >&2; echo '{TAG}not json'; exec sleep 30"),
        ]);
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct Reply {
            n: u32,
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        let log: LogFn =
            Arc::new(move |l: &str| sink.lock().unwrap_or_else(PoisonError::into_inner).push(l.to_owned()));
        let child = Child::spawn::<_, Reply>(cmd, "fake", 1u8, tx, Some(log)).expect("spawn sh");
        let first = rx.recv_timeout(Duration::from_secs(10)).expect("a reply");
        assert!(matches!(first, (1, Incoming::Reply(Reply { n: 7 }))), "{first:?}");
        let second = rx.recv_timeout(Duration::from_secs(10)).expect("the garbled line");
        assert!(matches!(&second, (1, Incoming::Garbled(why)) if why.contains("not json")), "{second:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while child.tail().len() < 2 {
            assert!(Instant::now() < deadline, "log lines: {:?}", child.tail());
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut tail = child.tail();
        tail.sort();
        assert_eq!(tail, ["[fake stdout] noise", "[fake] oops"]);
        let pid = child.pid();
        drop(child);
        // Killed and reaped: the pid no longer names a live process of ours.
        // SAFETY: kill with signal 0 only checks whether the process exists.
        assert_ne!(unsafe { libc::kill(pid as libc::pid_t, 0) }, 0, "pid {pid} still alive after drop");
        assert!(matches!(rx.recv_timeout(Duration::from_secs(10)), Ok((1, Incoming::Closed))));
    }
}
