//! Router configuration: the `kvpush router` flags ([`RouterArgs`]), the JSON config file, and the
//! resolved [`Config`] the router runs with. Flags override the file; the file overrides the defaults.
//!
//! An instance is given on the command line as `URL[,key=value...]` (see [`InstanceConfig::parse_spec`])
//! and in the file as an object with the same keys spelled out.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper::Uri;
use serde::{Deserialize, Serialize};

/// Default address the router listens on.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8000";
/// Default side-channel port of a prefill instance (kvpush's and vLLM's NIXL default).
pub const DEFAULT_SIDE_CHANNEL_PORT: u16 = 5600;

/// How the KV cache moves from P to D, which decides how the router sends the two legs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// P writes into blocks D registered: the router sends both legs at the same time.
    Push,
    /// D reads from P's blocks: the router sends P first, then D with the kv_transfer_params P returned.
    Pull,
}

impl fmt::Display for TransferMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferMode::Push => "push",
            TransferMode::Pull => "pull",
        })
    }
}

/// The `kvpush router` command line. Every option may also come from the `--config` file (same name with
/// underscores, e.g. `health_interval_s`); a flag given here wins over the file.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RouterArgs {
    /// JSON config file with any of the keys below (`listen`, `mode`, `prefill`, `decode`, `health_interval_s`,
    /// ...; see docs/router.md). Flags given on the command line override its values.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Address to serve OpenAI clients on [default: 127.0.0.1:8000].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Transfer mode: `push` sends P and D their requests at the same time; `pull` sends P first, then D with
    /// the kv_transfer_params P returned. Checked at start against each server's /v1/kvpush/info where
    /// served [default: push].
    #[arg(long, value_enum)]
    pub mode: Option<TransferMode>,
    /// A prefill (P) server: `URL[,engine_id=ID][,host=HOST][,port=PORT][,tp=N][,pp=N][,ranks=H:P;...]`, e.g.
    /// `http://10.0.0.5:8100,engine_id=p0,port=5600,tp=8`. engine_id, host, port, tp and pp are P's KV
    /// engine id, side-channel host and port, TP and PP sizes, handed to D in push mode (defaults: from
    /// P's /v1/kvpush/info, else host of the URL, port 5600, tp 1, pp 1; push needs an engine id from one of
    /// the two); ranks, each rank's side-channel host:port (rank pp·tp + tp), for P's ranks on several hosts
    /// (default: rank r at port + r). Repeat for more servers; replaces the config file's list.
    #[arg(long = "prefill", value_name = "SPEC")]
    pub prefill: Vec<String>,
    /// A decode (D) server: `URL[,engine_id=ID]`. engine_id is D's KV engine id, sent to P as
    /// `consumer_engine_id` in push mode so that P serves the KV to that engine only (default: from D's
    /// /v1/kvpush/info, else none: P serves the first engine that registers). Other keys are accepted
    /// but unused. Repeat for more servers; replaces the config file's list.
    #[arg(long = "decode", value_name = "SPEC")]
    pub decode: Vec<String>,
    /// Seconds between GET /health probes of every server; a server that fails `--unhealthy-after` probes in
    /// a row leaves the rotation, one that answers again comes back [default: 5].
    #[arg(long, value_name = "SECONDS")]
    pub health_interval_s: Option<f64>,
    /// Timeout of one health or info probe, in seconds [default: 2].
    #[arg(long, value_name = "SECONDS")]
    pub probe_timeout_s: Option<f64>,
    /// TCP connect timeout to a server, in seconds; a server that cannot be connected to leaves the rotation
    /// and the request is retried on another [default: 2].
    #[arg(long, value_name = "SECONDS")]
    pub connect_timeout_s: Option<f64>,
    /// Longest time the prefill leg may take (its whole response, max_tokens 1), in seconds; past it the
    /// request fails with 504 and P leaves the rotation until its health probe passes [default: 600].
    #[arg(long, value_name = "SECONDS")]
    pub prefill_timeout_s: Option<f64>,
    /// Longest wait for the decode leg's response headers, in seconds (for a non-streaming request this is
    /// the whole generation); past it the request fails with 504 and D leaves the rotation [default: 600].
    #[arg(long, value_name = "SECONDS")]
    pub decode_timeout_s: Option<f64>,
    /// Longest silence between two chunks of the decode response, in seconds; past it the stream ends with
    /// an error and D leaves the rotation [default: 600].
    #[arg(long, value_name = "SECONDS")]
    pub stream_idle_timeout_s: Option<f64>,
    /// Largest request body accepted from a client, in bytes; larger ones get 413 [default: 67108864].
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Send a streamed greedy completion's first token from P's answer, then D's continuation of it
    /// (docs/router.md, "The first token from P") [default: true].
    #[arg(long, value_name = "BOOL")]
    pub first_token_from_prefill: Option<bool>,
    /// Push: where the client's first token comes from P's answer, send D its leg only once P answered
    /// (P's blocks wait for D's registration), so that D's admission does not compete with P's prefill
    /// for the CPUs they share (docs/router.md, "D's leg after P's answer") [default: false].
    #[arg(long, value_name = "BOOL")]
    pub push_decode_after_prefill: Option<bool>,
    /// Longest time a client may take to send its request head or body, in seconds; past it the client
    /// gets 408 (a slow body) or its connection is closed (a slow head), and no leg is sent [default: 30].
    #[arg(long, value_name = "SECONDS")]
    pub body_timeout_s: Option<f64>,
    /// Most client connections served at once; one more is answered 503 at once and closed [default: 1024].
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// How many times a request whose leg could not connect is retried on other servers (with a fresh
    /// transfer id) before the client gets 502 [default: 2].
    #[arg(long, value_name = "N")]
    pub connect_retries: Option<u32>,
    /// Failed /health probes in a row (no answer within the probe timeout, or an error status) after which a
    /// server leaves the rotation: one slow answer from a busy server does not [default: 3].
    #[arg(long, value_name = "N")]
    pub unhealthy_after: Option<u32>,
    /// Print the resolved configuration as JSON and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// One P or D server as configured. Only `url` is required; the other keys describe a prefill instance's
/// KV side channel for push mode and override what its /v1/kvpush/info reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstanceConfig {
    /// Base URL of the OpenAI server, `http://host:port` (an optional path prefix is kept).
    pub url: String,
    /// The KV engine id (vLLM's `kv_transfer_config.engine_id`), sent to D as `remote_engine_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_id: Option<String>,
    /// Side-channel host, sent to D as `remote_host` (default: the URL's host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_channel_host: Option<String>,
    /// Side-channel port, sent to D as `remote_port` (default 5600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_channel_port: Option<u16>,
    /// Tensor-parallel size, sent to D as `tp_size` (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// Pipeline-parallel size, sent to D as `pp_size` (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u32>,
    /// Each rank's side-channel `host:port`, indexed `pp_rank × tp + tp_rank`, sent to D as
    /// `remote_ranks` (for an engine whose ranks span hosts; default: none, D dials rank r at
    /// `port + r` on `host`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<Vec<String>>,
}

impl InstanceConfig {
    /// An instance with only a URL.
    pub fn new(url: impl Into<String>) -> Self {
        InstanceConfig { url: url.into(), ..Default::default() }
    }

    /// Parses `URL[,key=value...]` with keys `engine_id`, `host` (or `side_channel_host`), `port` (or
    /// `side_channel_port`), `tp` (or `tp_size`), `pp` (or `pp_size`) and `ranks` (`host:port;...`).
    pub fn parse_spec(spec: &str) -> Result<Self, ConfigError> {
        let mut parts = spec.split(',');
        let url = parts.next().unwrap_or_default().trim();
        let mut inst = InstanceConfig::new(url);
        for part in parts {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let Some((key, value)) = part.split_once('=') else {
                return Err(ConfigError::Spec { spec: spec.to_owned(), detail: format!("`{part}` is not key=value") });
            };
            let (key, value) = (key.trim(), value.trim());
            let bad = |what: &str| ConfigError::Spec { spec: spec.to_owned(), detail: format!("{key}: {what}") };
            match key {
                "engine_id" => inst.engine_id = Some(value.to_owned()),
                "host" | "side_channel_host" => inst.side_channel_host = Some(value.to_owned()),
                "port" | "side_channel_port" => {
                    inst.side_channel_port = Some(value.parse().map_err(|_| bad("not a port number"))?)
                }
                "tp" | "tp_size" => inst.tp_size = Some(value.parse().map_err(|_| bad("not a positive integer"))?),
                "pp" | "pp_size" => inst.pp_size = Some(value.parse().map_err(|_| bad("not a positive integer"))?),
                "ranks" => inst.ranks = Some(value.split(';').map(|r| r.trim().to_owned()).collect()),
                _ => {
                    return Err(ConfigError::Spec {
                        spec: spec.to_owned(),
                        detail: format!("unknown key `{key}` (known: engine_id, host, port, tp, pp, ranks)"),
                    })
                }
            }
        }
        inst.validate()?;
        Ok(inst)
    }

    /// Checks the URL (`http://host:port[/prefix]`) and the sizes.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |detail: String| ConfigError::Url { url: self.url.clone(), detail };
        let uri: Uri = self.url.parse().map_err(|e| bad(format!("{e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => return Err(bad(format!("scheme `{other}` is not supported (only http://)"))),
            None => return Err(bad("missing scheme (write http://host:port)".to_owned())),
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(bad("missing host".to_owned()));
        }
        if uri.query().is_some() {
            return Err(bad("a query string is not allowed".to_owned()));
        }
        if self.tp_size == Some(0) || self.pp_size == Some(0) {
            return Err(bad("tp_size and pp_size must be at least 1".to_owned()));
        }
        if self.engine_id.as_deref().is_some_and(str::is_empty) {
            return Err(bad("engine_id is empty".to_owned()));
        }
        if let Some(ranks) = &self.ranks {
            let all = self.tp_size.unwrap_or(1) as usize * self.pp_size.unwrap_or(1) as usize;
            if ranks.len() != all {
                return Err(bad(format!("ranks names {} addresses, tp × pp is {all}", ranks.len())));
            }
            for r in ranks {
                let ok =
                    r.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
                if !ok {
                    return Err(bad(format!("ranks: `{r}` is not host:port")));
                }
            }
        }
        Ok(())
    }

    /// The URL without a trailing slash; request paths are appended to it.
    pub(crate) fn base(&self) -> String {
        self.url.trim_end_matches('/').to_owned()
    }

    /// The host part of the URL, without IPv6 brackets.
    pub(crate) fn url_host(&self) -> String {
        self.url
            .parse::<Uri>()
            .ok()
            .and_then(|u| u.host().map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned()))
            .unwrap_or_default()
    }
}

/// The JSON config file: every key optional, unknown keys refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    mode: Option<TransferMode>,
    prefill: Option<Vec<FileInstance>>,
    decode: Option<Vec<FileInstance>>,
    health_interval_s: Option<f64>,
    probe_timeout_s: Option<f64>,
    connect_timeout_s: Option<f64>,
    prefill_timeout_s: Option<f64>,
    decode_timeout_s: Option<f64>,
    stream_idle_timeout_s: Option<f64>,
    max_body_bytes: Option<usize>,
    first_token_from_prefill: Option<bool>,
    push_decode_after_prefill: Option<bool>,
    body_timeout_s: Option<f64>,
    max_connections: Option<usize>,
    connect_retries: Option<u32>,
    unhealthy_after: Option<u32>,
}

/// An instance in the file: an object, or a string in the command-line spec syntax.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum FileInstance {
    Spec(String),
    Full(InstanceConfig),
}

/// The resolved configuration the router runs with. [`Config::new`] gives the defaults.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    /// Address to serve clients on (port 0 picks a free port; see [`super::RouterHandle::local_addr`]).
    pub listen: SocketAddr,
    /// Transfer mode.
    pub mode: TransferMode,
    /// Prefill servers.
    pub prefill: Vec<InstanceConfig>,
    /// Decode servers.
    pub decode: Vec<InstanceConfig>,
    /// Interval of the /health probes.
    #[serde(serialize_with = "secs")]
    pub health_interval: Duration,
    /// Timeout of one probe.
    #[serde(serialize_with = "secs")]
    pub probe_timeout: Duration,
    /// TCP connect timeout to a server.
    #[serde(serialize_with = "secs")]
    pub connect_timeout: Duration,
    /// Longest prefill leg.
    #[serde(serialize_with = "secs")]
    pub prefill_timeout: Duration,
    /// Longest wait for the decode leg's response headers.
    #[serde(serialize_with = "secs")]
    pub decode_timeout: Duration,
    /// Longest silence between two chunks of the decode response.
    #[serde(serialize_with = "secs")]
    pub stream_idle_timeout: Duration,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// A streamed greedy completion's first token comes from P's answer.
    pub first_token_from_prefill: bool,
    /// Push: D's leg leaves once P answered, where P's answer is the client's first token.
    pub push_decode_after_prefill: bool,
    /// Longest time a client may take to send its request head or its body.
    #[serde(serialize_with = "secs")]
    pub body_timeout: Duration,
    /// Most client connections served at once (one more is refused with 503).
    pub max_connections: usize,
    /// Retries of a request whose leg could not connect.
    pub connect_retries: u32,
    /// Failed health probes in a row that take a server out of the rotation.
    pub unhealthy_after: u32,
}

fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl Config {
    /// The defaults, with these servers.
    pub fn new(mode: TransferMode, prefill: Vec<InstanceConfig>, decode: Vec<InstanceConfig>) -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            mode,
            prefill,
            decode,
            health_interval: Duration::from_secs(5),
            probe_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            prefill_timeout: Duration::from_secs(600),
            decode_timeout: Duration::from_secs(600),
            stream_idle_timeout: Duration::from_secs(600),
            max_body_bytes: 64 << 20,
            first_token_from_prefill: true,
            push_decode_after_prefill: false,
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            connect_retries: 2,
            unhealthy_after: 3,
        }
    }

    /// Reads the config file (if any), applies the flags over it, and validates the result.
    pub fn from_args(args: &RouterArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let instances =
            |flags: &[String], file: Option<Vec<FileInstance>>| -> Result<Vec<InstanceConfig>, ConfigError> {
                if !flags.is_empty() {
                    return flags.iter().map(|s| InstanceConfig::parse_spec(s)).collect();
                }
                file.unwrap_or_default()
                    .into_iter()
                    .map(|i| match i {
                        FileInstance::Spec(s) => InstanceConfig::parse_spec(&s),
                        FileInstance::Full(c) => c.validate().map(|()| c),
                    })
                    .collect()
            };
        let prefill = instances(&args.prefill, file.prefill)?;
        let decode = instances(&args.decode, file.decode)?;
        let mut c = Config::new(args.mode.or(file.mode).unwrap_or(TransferMode::Push), prefill, decode);
        if let Some(listen) = args.listen.or(file.listen) {
            c.listen = listen;
        }
        let dur = |name: &'static str, flag: Option<f64>, file: Option<f64>, default: Duration| match flag.or(file) {
            None => Ok(default),
            Some(s) => Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or(ConfigError::Value { key: name, detail: format!("{s} is not a positive number of seconds") }),
        };
        c.health_interval =
            dur("health_interval_s", args.health_interval_s, file.health_interval_s, c.health_interval)?;
        c.probe_timeout = dur("probe_timeout_s", args.probe_timeout_s, file.probe_timeout_s, c.probe_timeout)?;
        c.connect_timeout =
            dur("connect_timeout_s", args.connect_timeout_s, file.connect_timeout_s, c.connect_timeout)?;
        c.prefill_timeout =
            dur("prefill_timeout_s", args.prefill_timeout_s, file.prefill_timeout_s, c.prefill_timeout)?;
        c.decode_timeout = dur("decode_timeout_s", args.decode_timeout_s, file.decode_timeout_s, c.decode_timeout)?;
        c.stream_idle_timeout = dur(
            "stream_idle_timeout_s",
            args.stream_idle_timeout_s,
            file.stream_idle_timeout_s,
            c.stream_idle_timeout,
        )?;
        if let Some(n) = args.max_body_bytes.or(file.max_body_bytes) {
            c.max_body_bytes = n;
        }
        if let Some(b) = args.first_token_from_prefill.or(file.first_token_from_prefill) {
            c.first_token_from_prefill = b;
        }
        if let Some(b) = args.push_decode_after_prefill.or(file.push_decode_after_prefill) {
            c.push_decode_after_prefill = b;
        }
        c.body_timeout = dur("body_timeout_s", args.body_timeout_s, file.body_timeout_s, c.body_timeout)?;
        if let Some(n) = args.max_connections.or(file.max_connections) {
            c.max_connections = n;
        }
        if let Some(n) = args.connect_retries.or(file.connect_retries) {
            c.connect_retries = n;
        }
        if let Some(n) = args.unhealthy_after.or(file.unhealthy_after) {
            c.unhealthy_after = n;
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks that there is at least one server of each role and that every instance is well formed.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.prefill.is_empty() {
            return Err(ConfigError::NoInstances { role: "prefill", flag: "--prefill" });
        }
        if self.decode.is_empty() {
            return Err(ConfigError::NoInstances { role: "decode", flag: "--decode" });
        }
        for i in self.prefill.iter().chain(&self.decode) {
            i.validate()?;
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError::Value { key: "max_body_bytes", detail: "must be at least 1".to_owned() });
        }
        if self.max_connections == 0 {
            return Err(ConfigError::Value { key: "max_connections", detail: "must be at least 1".to_owned() });
        }
        if self.unhealthy_after == 0 {
            return Err(ConfigError::Value { key: "unhealthy_after", detail: "must be at least 1".to_owned() });
        }
        for (key, d) in [
            ("health_interval_s", self.health_interval),
            ("probe_timeout_s", self.probe_timeout),
            ("connect_timeout_s", self.connect_timeout),
            ("prefill_timeout_s", self.prefill_timeout),
            ("decode_timeout_s", self.decode_timeout),
            ("stream_idle_timeout_s", self.stream_idle_timeout),
            ("body_timeout_s", self.body_timeout),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Value { key, detail: "must be positive".to_owned() });
            }
        }
        Ok(())
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::File { path: path.to_owned(), detail: e.to_string() })?;
    serde_json::from_str(&text).map_err(|e| ConfigError::File { path: path.to_owned(), detail: e.to_string() })
}

/// What is wrong with a router configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file cannot be read or is not valid JSON of the documented shape.
    #[error("config file {}: {detail}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong (with line and column for a parse error).
        detail: String,
    },
    /// An instance spec `URL[,key=value...]` is malformed.
    #[error("instance `{spec}`: {detail}")]
    Spec {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        detail: String,
    },
    /// An instance URL is not `http://host:port[/prefix]`.
    #[error("instance URL `{url}`: {detail}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        detail: String,
    },
    /// No server of a role was configured.
    #[error("no {role} server configured (give at least one with {flag} or in the config file)")]
    NoInstances {
        /// `prefill` or `decode`.
        role: &'static str,
        /// The flag that adds one.
        flag: &'static str,
    },
    /// A setting has an invalid value.
    #[error("{key}: {detail}")]
    Value {
        /// The setting's name in the config file.
        key: &'static str,
        /// What is wrong with its value.
        detail: String,
    },
}
