//! `kvpush router`: the OpenAI-compatible proxy in front of prefill (P) and decode (D) servers that, in
//! push mode, sends both legs of a request **at the same time** — push only pays when D can register its
//! blocks while P is still computing.
//!
//! Read first: `proxy.rs` (the two legs in push and pull mode), then `body` (how D's response reaches
//! the client and how cancellation travels), then `upstream` (server rotation, least-outstanding
//! selection, probes). docs/router.md describes the behaviour and the configuration for users.
//!
//! Embedding: [`start`] binds and runs a router on the caller's tokio runtime and returns a
//! [`RouterHandle`]; [`run`] is the command (`kvpush router`) with its own runtime.
//!
//! It must never panic on anything a client or a server sends, never hold a lock across an await, and
//! never leave a leg running that nobody will read (a dropped request drops both legs).

mod body;
pub mod config;
mod first_token;
mod metrics;
mod proxy;
mod timeline;
mod upstream;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::StatusCode;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

pub use body::ProxyBody;
pub use config::{Config, ConfigError, InstanceConfig, RouterArgs, TransferMode};

use metrics::{ErrorKind, Metrics};
use upstream::{HttpClient, Pool, Role};

/// State shared by every request of one router.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) prefill: Pool,
    pub(crate) decode: Pool,
    pub(crate) client: HttpClient,
    pub(crate) metrics: Metrics,
}

/// Why a router did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listen address cannot be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Servers disagree with the configuration (a mode mismatch, a push-mode P without an engine id).
    #[error("startup check failed:\n  {}", .0.join("\n  "))]
    Startup(Vec<String>),
}

/// A running router; dropping it (or [`RouterHandle::shutdown`]) stops accepting connections and probing.
#[derive(Debug)]
pub struct RouterHandle {
    addr: SocketAddr,
    tasks: Vec<JoinHandle<()>>,
}

impl RouterHandle {
    /// The address the router listens on (with the port the OS picked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections and probing; requests already being served run to their end.
    pub fn shutdown(self) {}
}

impl Drop for RouterHandle {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Checks the servers (mode, P's engine id), binds the listen address, and serves on the current tokio
/// runtime. Servers that cannot be reached yet start out of rotation and join when their /health answers.
pub async fn start(config: Config) -> Result<RouterHandle, RouterError> {
    config.validate()?;
    let client = upstream::client(&config);
    let prefill = Pool::new(Role::Prefill, config.mode, &config.prefill);
    let decode = Pool::new(Role::Decode, config.mode, &config.decode);
    upstream::startup_check(&client, [&prefill, &decode], config.probe_timeout).await.map_err(RouterError::Startup)?;
    let listener =
        TcpListener::bind(config.listen).await.map_err(|source| RouterError::Bind { addr: config.listen, source })?;
    let addr = listener.local_addr().map_err(|source| RouterError::Bind { addr: config.listen, source })?;
    let shared = Arc::new(Shared { config, prefill, decode, client, metrics: Metrics::new() });
    let accept = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
    let probe = tokio::spawn(probe_loop(shared));
    Ok(RouterHandle { addr, tasks: vec![accept, probe] })
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let slots = Arc::new(Semaphore::new(shared.config.max_connections));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Over the cap: answer at once and close, rather than queue a client nobody will serve.
            shared.metrics.error(ErrorKind::TooManyConnections);
            shared.metrics.response(StatusCode::SERVICE_UNAVAILABLE.as_u16());
            tokio::spawn(refuse(stream, shared.config.max_connections, shared.config.body_timeout));
            continue;
        };
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let _slot = slot;
            let head_timeout = shared.config.body_timeout;
            let svc = service_fn(move |req| proxy::handle(Arc::clone(&shared), req));
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(head_timeout)
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                debug!(%peer, error = %e, "client connection ended with an error");
            }
        });
    }
}

/// Answers a connection over the cap with `503` and closes it. What the client sent is read and dropped
/// for up to a second after the answer (at most 64 KiB), so that closing does not reset the connection
/// before the client read its answer.
async fn refuse(mut stream: TcpStream, cap: usize, timeout: std::time::Duration) {
    let message = format!("the router serves at most {cap} client connections at once; retry later");
    let body = proxy::error_json(&message, "server_error", ErrorKind::TooManyConnections.as_str());
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    let answer = async {
        stream.write_all(&out).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        while drained < 64 << 10 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        Ok::<(), std::io::Error>(())
    };
    let linger = timeout.min(std::time::Duration::from_secs(1));
    if let Ok(Err(e)) = tokio::time::timeout(linger, answer).await {
        debug!(error = %e, "refusing a connection over the cap");
    }
}

async fn probe_loop(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.config.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let c = &shared.config;
        upstream::probe_round(&shared.client, [&shared.prefill, &shared.decode], c.probe_timeout, c.unhealthy_after)
            .await;
    }
}

/// `kvpush router`: resolves the configuration, starts the router on its own multi-threaded tokio
/// runtime, and serves until SIGINT or SIGTERM. Exit code 2 for a bad configuration, 1 for a failed start.
pub fn run(args: RouterArgs) -> ExitCode {
    let config = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvpush router: {e}");
            return ExitCode::from(2);
        }
    };
    if args.print_config {
        match serde_json::to_string_pretty(&config) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("kvpush router: {e}"),
        }
        return ExitCode::SUCCESS;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("kvpush-router").build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvpush router: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let mode = config.mode;
        let (np, nd) = (config.prefill.len(), config.decode.len());
        let handle = match start(config).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("kvpush router: {e}");
                return ExitCode::FAILURE;
            }
        };
        eprintln!(
            "kvpush router: {mode} mode, {np} prefill and {nd} decode server(s), listening on http://{}",
            handle.local_addr()
        );
        shutdown_signal().await;
        eprintln!("kvpush router: shutting down");
        handle.shutdown();
        ExitCode::SUCCESS
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
