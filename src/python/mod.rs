//! The native half of the Python package: `kvpush._native`, a PyO3 module (feature `python`).
//!
//! Read [`Worker`] first: one engine worker (one TP rank of a vLLM server) over NIXL and a TCP side
//! channel, built from a plain `dict` config (docs/vllm.md lists every key). The vLLM connector in
//! `python/kvpush/vllm.py` is glue around it: it hands block ids, token counts and transfer ids to
//! these methods and turns [`Worker::poll`]'s outcomes into vLLM's finished sets. Everything the
//! protocol decides (rendezvous, leases, planning, completion counting) happens in the engine.
//!
//! A consumer learns where its producer listens only from the request (`remote_host`,
//! `remote_port`): the first request for a producer dials it on a background thread, so no call here
//! waits on the network; requests for a producer still being dialed wait in order and go out once the
//! handshake is done (or fail, reported by `poll`, if it is refused). Every call releases the GIL.
//! For tests, `transport: "loopback"` with a `hub` name puts workers of one process on the loopback
//! transport instead ([`Worker::connect`] joins two), with everything else as over NIXL.
//! Errors become exceptions of a small hierarchy rooted at `kvpush.KvpushError`; no panic reaches
//! Python (PyO3 turns one into `PanicException`, and the engine never panics on bad input).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use pyo3::conversion::FromPyObjectOwned;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::embed::{self, EngineSpec, FfiEngine, FfiError, GroupSpec, LayoutSpec, ProducerAt, TransportSpec};
use crate::proto::layout::Parallel;
use crate::proto::Key;
use crate::sync::lock;

create_exception!(_native, KvpushError, PyException, "Base class of every kvpush error.");
create_exception!(_native, ConfigError, KvpushError, "A configuration value or argument is invalid.");
create_exception!(_native, TransportError, KvpushError, "NIXL or the side channel failed (or is missing).");
create_exception!(_native, IncompatibleError, KvpushError, "A peer's handshake does not match this worker's.");
create_exception!(_native, ClosedError, KvpushError, "The worker has shut down.");

fn py_err(e: FfiError) -> PyErr {
    let text = e.to_string();
    match e.code() {
        embed::status::INCOMPATIBLE => IncompatibleError::new_err(text),
        embed::status::TRANSPORT | embed::status::SIDE_CHANNEL => TransportError::new_err(text),
        embed::status::CLOSED => ClosedError::new_err(text),
        embed::status::NULL
        | embed::status::INVALID_ARGUMENT
        | embed::status::LAYOUT
        | embed::status::BLOCKS
        | embed::status::WRONG_MODE
        | embed::status::DEVICE => ConfigError::new_err(text),
        _ => KvpushError::new_err(text),
    }
}

/// The transfer key of a router-minted transfer id (32 hex digits) and attempt.
fn key_of(transfer_id: &str, attempt: u32) -> PyResult<Key> {
    let id = u128::from_str_radix(transfer_id, 16)
        .ok()
        .filter(|_| transfer_id.len() == 32)
        .ok_or_else(|| ConfigError::new_err(format!("transfer id {transfer_id:?} is not 32 hex digits")))?;
    Ok(Key::new(id, attempt))
}

fn transfer_id_of(key: Key) -> String {
    format!("{:032x}", key.transfer_id.0)
}

/// A request waiting for its producer's handshake.
#[derive(Clone)]
enum Queued {
    Push {
        key: Key,
        blocks: Vec<Vec<u32>>,
        tokens: u64,
    },
    Pull {
        key: Key,
        remote: Vec<Vec<u32>>,
        /// Tokens per block of the ids in `remote` (the producer's serving-engine blocks); None:
        /// they are the producer's engine blocks.
        remote_tokens: Option<u32>,
        local: Vec<Vec<u32>>,
        tokens: u64,
    },
    /// A request dropped before it was allocated: its producer is told (no outcome follows).
    Drop {
        key: Key,
    },
    /// A request still queued for blocks: its producer keeps holding its own (no outcome follows).
    Hold {
        key: Key,
    },
}

impl Queued {
    /// Whether it hands the engine blocks (an outcome follows), rather than only telling the producer.
    fn registers(&self) -> bool {
        matches!(self, Queued::Push { .. } | Queued::Pull { .. })
    }

    fn key(&self) -> Key {
        match self {
            Queued::Push { key, .. } | Queued::Pull { key, .. } | Queued::Drop { key } | Queued::Hold { key } => *key,
        }
    }
}

/// Where a producer engine stands with this worker.
enum ProducerState {
    /// Being dialed; requests wait here in order.
    Dialing(Vec<Queued>),
    /// Handshaken with every rank that writes into this worker.
    Ready,
}

/// An outcome for Python: (kind, transfer id, attempt, message, invalid block ids per group).
type PyOutcome = (&'static str, String, u32, String, Vec<Vec<u32>>);

struct Inner {
    engine: FfiEngine,
    /// This worker's TP/PP position and model (for which producer ranks write into it).
    parallel: Parallel,
    model: crate::proto::layout::ModelShape,
    producers: Mutex<HashMap<String, ProducerState>>,
    /// Outcomes produced here rather than by the engine (a producer that cannot be reached).
    local: Mutex<VecDeque<PyOutcome>>,
    /// Reused buffer for the engine's outcomes.
    scratch: Mutex<Vec<crate::engine::Finished>>,
}

impl Inner {
    /// Hands a request to the engine now.
    fn submit(&self, producer: &str, q: Queued) -> Result<(), FfiError> {
        match q {
            Queued::Push { key, blocks, tokens } => self.engine.blocks_allocated(key, producer, blocks, tokens),
            Queued::Pull { key, remote, remote_tokens, local, tokens } => {
                self.engine.start_pull(key, producer, remote, remote_tokens, local, tokens)
            }
            Queued::Drop { key } => self.engine.abort_producer(key, producer),
            Queued::Hold { key } => self.engine.hold(key, producer),
        }
    }

    fn fail(&self, q: &Queued, why: String) {
        let key = q.key();
        let invalid = match q {
            Queued::Push { blocks, .. } => blocks.clone(),
            Queued::Pull { local, .. } => local.clone(),
            // Nothing was handed over for it: no outcome is owed (P's lease ends its blocks).
            Queued::Drop { .. } | Queued::Hold { .. } => return,
        };
        lock(&self.local).push_back(("failed", transfer_id_of(key), key.attempt.0, why, invalid));
    }

    /// The side-channel addresses of the producer ranks this worker dials
    /// ([`embed::producer_addrs`]).
    fn producer_addrs(&self, at: &ProducerAt<'_>) -> Result<Vec<String>, FfiError> {
        embed::producer_addrs(&self.model, self.parallel, at)
    }

    /// Sends `q` now if `producer` is handshaken; else queues it and, the first time, dials it on a
    /// background thread.
    fn route(self: &Arc<Self>, producer: &str, at: &ProducerAt<'_>, q: Queued) -> PyResult<()> {
        let mut producers = lock(&self.producers);
        match producers.get_mut(producer) {
            Some(ProducerState::Ready) if self.engine.engine().knows_engine(producer) => {
                drop(producers);
                return self.submit(producer, q).map_err(py_err);
            }
            // Handshaken once, lost since (connection or heartbeat): dial it afresh below.
            Some(ProducerState::Ready) => {}
            // Connected in-process (`connect`, loopback): nothing to dial.
            None if self.engine.engine().knows_engine(producer) => {
                drop(producers);
                return self.submit(producer, q).map_err(py_err);
            }
            Some(ProducerState::Dialing(waiting)) => {
                waiting.push(q);
                return Ok(());
            }
            None => {}
        }
        let addrs = self.producer_addrs(at).map_err(py_err)?;
        producers.insert(producer.to_owned(), ProducerState::Dialing(vec![q]));
        drop(producers);
        let me = Arc::clone(self);
        let producer = producer.to_owned();
        let spawned = std::thread::Builder::new().name("kvpush-dial".into()).spawn(move || me.dial(&producer, &addrs));
        if let Err(e) = spawned {
            return Err(TransportError::new_err(format!("cannot start a thread to dial {}: {e}", at.host)));
        }
        Ok(())
    }

    /// Dials every address of `producer`, then releases (or fails) the requests that waited.
    fn dial(&self, producer: &str, addrs: &[String]) {
        let mut error = None;
        for addr in addrs {
            match self.engine.connect_addr(addr) {
                Ok(peer) => tracing::info!(%producer, %addr, %peer, "producer handshaken"),
                Err(e) => {
                    error = Some(format!("cannot reach producer {producer} at {addr}: {e}"));
                    break;
                }
            }
        }
        let waiting = {
            let mut producers = lock(&self.producers);
            let waiting = match producers.remove(producer) {
                Some(ProducerState::Dialing(w)) => w,
                _ => Vec::new(),
            };
            if error.is_none() {
                producers.insert(producer.to_owned(), ProducerState::Ready);
            }
            waiting
        };
        for q in waiting {
            match &error {
                Some(why) => self.fail(&q, why.clone()),
                // Once submitted, the engine reports the outcome.
                None => {
                    if let Err(e) = self.submit(producer, q.clone()) {
                        self.fail(&q, e.to_string());
                    }
                }
            }
        }
    }
}

fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>> {
    match d.get_item(key)? {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => v.extract::<T>().map(Some).map_err(|e| {
            let e: PyErr = e.into();
            ConfigError::new_err(format!("config key {key:?}: {e}"))
        }),
    }
}

fn need<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    get(d, key)?.ok_or_else(|| ConfigError::new_err(format!("config key {key:?} is required")))
}

fn pick(key: &str, value: &str, names: &[&str]) -> PyResult<u32> {
    names.iter().position(|n| n.eq_ignore_ascii_case(value)).map(|i| i as u32).ok_or_else(|| {
        ConfigError::new_err(format!("config key {key:?} is {value:?}; expected one of {}", names.join(", ")))
    })
}

/// Builds the layout spec from the config dict's layout keys (docs/vllm.md).
fn layout_spec(d: &Bound<'_, PyDict>) -> PyResult<LayoutSpec> {
    let dtype = pick(
        "dtype",
        &need::<String>(d, "dtype")?,
        &["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2", "uint8"],
    )?;
    let order = pick("order", &get::<String>(d, "order")?.unwrap_or_else(|| "hnd".into()), &["hnd", "nhd"])?;
    let placement = pick(
        "placement",
        &need::<String>(d, "placement")?,
        &["separate", "joint", "single", "head_joint", "cell_joint"],
    )?;
    let kv_kind =
        pick("kv_kind", &get::<String>(d, "kv_kind")?.unwrap_or_else(|| "key_value".into()), &["key_value", "latent"])?;
    let groups: Vec<(Vec<u32>, u32)> = get(d, "groups")?.unwrap_or_default();
    let parallel = Parallel {
        tp_rank: get(d, "tp_rank")?.unwrap_or(0),
        tp_size: get(d, "tp_size")?.unwrap_or(1),
        pp_rank: get(d, "pp_rank")?.unwrap_or(0),
        pp_size: get(d, "pp_size")?.unwrap_or(1),
    };
    let layout = LayoutSpec {
        total_layers: need(d, "total_layers")?,
        kv_heads: need(d, "kv_heads")?,
        head_dim: need(d, "head_dim")?,
        dtype,
        kv_kind,
        block_tokens: need(d, "block_tokens")?,
        num_blocks: need(d, "num_blocks")?,
        order,
        placement,
        parallel,
        block_stride: get(d, "block_stride")?.unwrap_or(0),
        groups: groups.into_iter().map(|(layers, window_tokens)| GroupSpec { window_tokens, layers }).collect(),
        region_bases: need(d, "region_bases")?,
        region_lens: get(d, "region_lens")?.unwrap_or_default(),
    };
    Ok(layout)
}

/// Builds the engine and layout specs from the config dict (keys documented in docs/vllm.md).
fn specs(d: &Bound<'_, PyDict>) -> PyResult<(EngineSpec, LayoutSpec)> {
    let mode = pick("mode", &need::<String>(d, "mode")?, &["push", "pull"])?;
    let layout = layout_spec(d)?;
    let parallel = layout.parallel;
    let host: String = get(d, "side_channel_host")?.unwrap_or_else(|| "0.0.0.0".into());
    let base: u32 = get(d, "side_channel_port")?.unwrap_or(5600);
    let port = embed::rank_port(base, get(d, "dp_index")?.unwrap_or(0), parallel).map_err(py_err)?;
    let listen = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    let engine_id: String = need(d, "engine_id")?;
    let spec = EngineSpec {
        engine_id: engine_id.clone(),
        mode,
        device: get(d, "device")?,
        writers: get(d, "writers")?.unwrap_or(1),
        lease_ms: get(d, "lease_ms")?.unwrap_or(0),
        timeout_ms: get(d, "timeout_ms")?.unwrap_or(0),
        staging: match get::<String>(d, "staging")? {
            Some(s) => crate::engine::Staging::parse(&s).map_err(|e| ConfigError::new_err(e.to_string()))?,
            None => crate::engine::Staging::Auto,
        },
        layerwise: match get::<String>(d, "layerwise")? {
            Some(s) => crate::engine::Layerwise::parse(&s).map_err(|e| ConfigError::new_err(e.to_string()))?,
            None => crate::engine::Layerwise::AUTO,
        },
        memory: match get::<String>(d, "memory_offer")? {
            Some(s) => {
                Some(crate::proto::bounce::MemoryOffer::parse(&s).map_err(|e| ConfigError::new_err(e.to_string()))?)
            }
            None => None,
        },
        transport: match get::<String>(d, "transport")?.as_deref() {
            None | Some("nixl") => TransportSpec::Nixl {
                agent_name: get(d, "agent_name")?,
                backend: get(d, "nixl_backend")?,
                listen: Some(listen),
                secret: get::<String>(d, "secret")?.map(String::into_bytes),
                insecure: get::<bool>(d, "insecure")?.unwrap_or(false),
                peer_timeout_ms: get(d, "peer_timeout_ms")?.unwrap_or(0),
                dial_allow: get(d, "dial_allow")?,
            },
            Some("loopback") => TransportSpec::Loopback(loopback_hub(&need::<String>(d, "hub")?)),
            Some(other) => {
                return Err(ConfigError::new_err(format!("transport {other:?} is not one of nixl, loopback")))
            }
        },
    };
    Ok((spec, layout))
}

/// The in-process hub named `name` (`transport: "loopback"`): workers of one process that name the
/// same hub reach each other through it once [`Worker::connect`]ed. Kept while a worker uses it.
fn loopback_hub(name: &str) -> Arc<embed::Hub> {
    static HUBS: Mutex<Vec<(String, std::sync::Weak<embed::Hub>)>> = Mutex::new(Vec::new());
    let mut hubs = lock(&HUBS);
    hubs.retain(|(_, w)| w.strong_count() > 0);
    if let Some(hub) = hubs.iter().find(|(n, _)| n == name).and_then(|(_, w)| w.upgrade()) {
        return hub;
    }
    let hub = embed::Hub::new();
    hubs.push((name.to_owned(), Arc::downgrade(&hub)));
    hub
}

/// One engine worker (one rank) over NIXL. See the module docs.
#[pyclass(module = "kvpush._native", frozen)]
pub struct Worker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("engine", &self.inner.engine).finish_non_exhaustive()
    }
}

#[pymethods]
impl Worker {
    /// Starts a worker: validates the layout, registers its regions with NIXL and listens on its
    /// side channel (`side_channel_port` + rank).
    ///
    /// The regions must stay allocated (and be left alone while transfers use them, as the
    /// connector's contract with vLLM ensures) until `close()`.
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let (spec, layout) = specs(config)?;
        let built = layout.build().map_err(py_err)?;
        let (parallel, model) = (built.parallel, built.model.clone());
        let engine = py
            .detach(|| {
                // SAFETY: the caller (the vLLM connector) passes the KV cache tensors' memory, which
                // vLLM keeps allocated for the worker's life and closes this worker before freeing;
                // vLLM reads or writes a request's blocks only outside the windows the engine's
                // contract names (the connector holds P's blocks until `sent`, and D's request
                // waits in WAITING_FOR_REMOTE_KVS until `received` or `failed`).
                unsafe { FfiEngine::new(&spec, &layout) }
            })
            .map_err(py_err)?;
        let inner = Inner {
            engine,
            parallel,
            model,
            producers: Mutex::new(HashMap::new()),
            local: Mutex::new(VecDeque::new()),
            scratch: Mutex::new(Vec::new()),
        };
        Ok(Worker { inner: Arc::new(inner) })
    }

    /// The side channel's port.
    #[getter]
    fn side_channel_port(&self) -> Option<u16> {
        self.inner.engine.listen_port()
    }

    /// Loopback transport (`transport: "loopback"`, P and D in one process, for tests): connects this
    /// worker and `other` (same hub) both ways, as a side-channel handshake would; requests for
    /// `other`'s engine then go to it without dialing.
    fn connect(&self, py: Python<'_>, other: &Worker) -> PyResult<()> {
        py.detach(|| self.inner.engine.connect(&other.inner.engine)).map_err(py_err)
    }

    /// Producer: prefill of the transfer finished; its KV sits in `block_ids` (per KV group) until
    /// `poll` reports it `sent`.
    /// `consumer_engine_id`: the decode engine the router chose; only it receives the KV (or a
    /// grant to read it), another engine's registration is refused. `None`: the first to register.
    #[pyo3(signature = (transfer_id, attempt, block_ids, num_tokens, consumer_engine_id=None))]
    fn request_finished(
        &self,
        py: Python<'_>,
        transfer_id: &str,
        attempt: u32,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        consumer_engine_id: Option<&str>,
    ) -> PyResult<()> {
        let key = key_of(transfer_id, attempt)?;
        py.detach(|| self.inner.engine.request_finished(key, block_ids, num_tokens, consumer_engine_id)).map_err(py_err)
    }

    /// Producer, push: layers `first_layer..end_layer` of the transfer are final in `block_ids` (the
    /// whole prompt's blocks, the same on every call); the first call holds them until `poll`
    /// reports it `sent`. Per the config's `layerwise` (auto, on, off), each range is written at once
    /// or the request goes whole once every layer is final. `consumer_engine_id` as in
    /// `request_finished` (the first call's counts).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (transfer_id, attempt, block_ids, num_tokens, first_layer, end_layer, consumer_engine_id=None))]
    fn layers_ready(
        &self,
        py: Python<'_>,
        transfer_id: &str,
        attempt: u32,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        first_layer: u32,
        end_layer: u32,
        consumer_engine_id: Option<&str>,
    ) -> PyResult<()> {
        let key = key_of(transfer_id, attempt)?;
        let layers = first_layer..end_layer;
        py.detach(|| self.inner.engine.layers_ready(key, block_ids, num_tokens, layers, consumer_engine_id))
            .map_err(py_err)
    }

    /// Consumer, push: blocks are allocated; registers them with the producer ranks that write into
    /// this worker (dialing the producer at `host:port` the first time). `producer_pp` is the
    /// producer's PP size; `producer_ranks` each of its ranks' `host:port` (index `pp_rank × TP +
    /// tp_rank`) where it published them, else rank `r` is dialed at `host:port + r`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (transfer_id, attempt, producer, host, port, producer_tp, block_ids, num_tokens, producer_pp=1, producer_ranks=Vec::new()))]
    fn blocks_allocated(
        &self,
        py: Python<'_>,
        transfer_id: &str,
        attempt: u32,
        producer: &str,
        host: &str,
        port: u16,
        producer_tp: u16,
        block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        producer_pp: u16,
        producer_ranks: Vec<String>,
    ) -> PyResult<()> {
        let key = key_of(transfer_id, attempt)?;
        let q = Queued::Push { key, blocks: block_ids, tokens: num_tokens };
        let at = ProducerAt { host, port, tp: producer_tp, pp: producer_pp, ranks: &producer_ranks };
        py.detach(|| self.inner.route(producer, &at, q))
    }

    /// Consumer, pull: reads the producer's `remote_block_ids` into `local_block_ids`
    /// (`producer_pp`, `producer_ranks`: as for `blocks_allocated`). `remote_block_tokens`: the
    /// tokens per block of `remote_block_ids` where they are the producer's serving-engine blocks
    /// (vLLM's block ids), which its engine may split into smaller kernel blocks; None: they are
    /// the producer's engine blocks (`Engine::start_pull_logical`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (transfer_id, attempt, producer, host, port, producer_tp, remote_block_ids, local_block_ids, num_tokens, producer_pp=1, producer_ranks=Vec::new(), remote_block_tokens=None))]
    fn start_pull(
        &self,
        py: Python<'_>,
        transfer_id: &str,
        attempt: u32,
        producer: &str,
        host: &str,
        port: u16,
        producer_tp: u16,
        remote_block_ids: Vec<Vec<u32>>,
        local_block_ids: Vec<Vec<u32>>,
        num_tokens: u64,
        producer_pp: u16,
        producer_ranks: Vec<String>,
        remote_block_tokens: Option<u32>,
    ) -> PyResult<()> {
        let key = key_of(transfer_id, attempt)?;
        let q = Queued::Pull {
            key,
            remote: remote_block_ids,
            remote_tokens: remote_block_tokens,
            local: local_block_ids,
            tokens: num_tokens,
        };
        let at = ProducerAt { host, port, tp: producer_tp, pp: producer_pp, ranks: &producer_ranks };
        py.detach(|| self.inner.route(producer, &at, q))
    }

    /// Consumer, about a request that has no blocks here yet: `word` `"drop"` (it was dropped
    /// before its blocks were allocated: the producer ranks that write into this worker release
    /// theirs now) or `"hold"` (it still waits in the serving engine's queue: they restart their
    /// lease of its blocks). Dials the producer at `host:port` the first time. No outcome follows
    /// from `poll` (`producer_pp`, `producer_ranks`: as for `blocks_allocated`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (word, transfer_id, attempt, producer, host, port, producer_tp, producer_pp=1, producer_ranks=Vec::new()))]
    fn tell_producer(
        &self,
        py: Python<'_>,
        word: &str,
        transfer_id: &str,
        attempt: u32,
        producer: &str,
        host: &str,
        port: u16,
        producer_tp: u16,
        producer_pp: u16,
        producer_ranks: Vec<String>,
    ) -> PyResult<()> {
        let key = key_of(transfer_id, attempt)?;
        let q = match word {
            "drop" => Queued::Drop { key },
            "hold" => Queued::Hold { key },
            other => return Err(ConfigError::new_err(format!("tell_producer: word {other:?} is not drop or hold"))),
        };
        let at = ProducerAt { host, port, tp: producer_tp, pp: producer_pp, ranks: &producer_ranks };
        py.detach(|| self.inner.route(producer, &at, q))
    }

    /// Aborts the transfer on this worker, in whatever state it is; peers are told. Its outcome
    /// (`sent` with the blocks released, or `ended`/`failed`) still comes out of `poll`.
    fn abort(&self, py: Python<'_>, transfer_id: &str, attempt: u32) -> PyResult<()> {
        let key = key_of(transfer_id, attempt)?;
        // A request still waiting for its producer's handshake is dropped from the queue.
        {
            let mut producers = lock(&self.inner.producers);
            for state in producers.values_mut() {
                if let ProducerState::Dialing(w) = state {
                    if let Some(i) = w.iter().position(|q| q.key() == key && q.registers()) {
                        w.remove(i);
                        drop(producers);
                        let tid = transfer_id_of(key);
                        lock(&self.inner.local).push_back(("ended", tid, attempt, "aborted".into(), Vec::new()));
                        return Ok(());
                    }
                }
            }
        }
        py.detach(|| self.inner.engine.abort(key)).map_err(py_err)
    }

    /// Blocks (without the GIL) until `poll()` has an outcome to return or `timeout_s` seconds
    /// have passed; returns whether it has. At once when one is already there.
    fn wait(&self, py: Python<'_>, timeout_s: f64) -> PyResult<bool> {
        if !timeout_s.is_finite() || timeout_s < 0.0 {
            return Err(ConfigError::new_err(format!("wait: timeout_s must be a finite number >= 0, got {timeout_s}")));
        }
        if !lock(&self.inner.local).is_empty() {
            return Ok(true);
        }
        let timeout = std::time::Duration::from_secs_f64(timeout_s);
        Ok(py.detach(|| self.inner.engine.engine().wait(timeout)))
    }

    /// Finished outcomes since the last call: a list of `(kind, transfer_id, attempt, message,
    /// invalid_block_ids)` with kind one of `sent` (producer: blocks may be freed), `received`
    /// (consumer: the KV landed), `failed` (consumer: it will not; `invalid_block_ids` per group),
    /// `ended` (consumer: aborted or superseded).
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out: Vec<PyOutcome> = py.detach(|| {
            let mut out: Vec<PyOutcome> = lock(&self.inner.local).drain(..).collect();
            let mut scratch = lock(&self.inner.scratch);
            scratch.clear();
            self.inner.engine.engine().poll(&mut scratch);
            for f in scratch.drain(..) {
                use crate::engine::Finished;
                out.push(match f {
                    Finished::Sent { key, reason } => {
                        ("sent", transfer_id_of(key), key.attempt.0, format!("{reason:?}"), Vec::new())
                    }
                    Finished::Received { key } => {
                        ("received", transfer_id_of(key), key.attempt.0, String::new(), Vec::new())
                    }
                    Finished::Failed { key, reason, invalid_blocks } => {
                        ("failed", transfer_id_of(key), key.attempt.0, reason, invalid_blocks)
                    }
                    Finished::Ended { key } => ("ended", transfer_id_of(key), key.attempt.0, String::new(), Vec::new()),
                    // Failed or ended, but the blocks stay out of use until "released".
                    Finished::Quarantined { key, reason, blocks, .. } => {
                        ("quarantined", transfer_id_of(key), key.attempt.0, reason, blocks)
                    }
                    Finished::Released { key } => {
                        ("released", transfer_id_of(key), key.attempt.0, String::new(), Vec::new())
                    }
                });
            }
            out
        });
        PyList::new(py, out)
    }

    /// The transfers this worker finished well since the last call, oldest first: a list of
    /// `(bytes, descriptors, post_us, transfer_us)` (what vLLM's connector metrics observe per
    /// transfer; failed ones are counted in `stats()["failures"]`).
    fn take_transfers(&self, py: Python<'_>) -> Vec<(u64, u64, u64, u64)> {
        py.detach(|| {
            let mut records = Vec::new();
            self.inner.engine.take_transfers(&mut records);
            records.into_iter().filter(|r| r.ok).map(|r| (r.bytes, r.descriptors, r.post_us, r.transfer_us)).collect()
        })
    }

    /// Statistics of this worker, as nested dicts: `counters`, `failures` and the latency summaries
    /// (the same names and shape as the C API's `kvpush_stats` and the JSON of `stats_json`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.inner.engine.stats());
        let value = serde_json::to_value(&s).map_err(|e| KvpushError::new_err(e.to_string()))?;
        json_to_py(py, &value)
    }
}

/// A JSON value as the Python object `json.loads` would give.
fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(json_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let d = PyDict::new(py);
            for (k, item) in map {
                d.set_item(k, json_to_py(py, item)?)?;
            }
            d.into_any()
        }
    })
}

/// Validates the layout keys of a worker config (the same keys and checks as `Worker`'s, without
/// starting anything) and returns what the engine makes of them: `placement`, `order`, `kv_kind`,
/// `block_tokens`, `num_blocks`, `block_stride`, `part_bytes` (one K, V or latent part of a block),
/// `local_heads`, `head_dim`, `regions` and `region_len` (bytes each region must hold).
#[pyfunction]
fn check_layout<'py>(py: Python<'py>, config: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    let l = layout_spec(config)?.build().map_err(py_err)?;
    let out = PyDict::new(py);
    let name = |v: &dyn std::fmt::Debug| {
        let text = format!("{v:?}");
        // CamelCase → snake_case, as the config spells them.
        let mut snake = String::new();
        for (i, c) in text.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                snake.push('_');
            }
            snake.push(c.to_ascii_lowercase());
        }
        snake
    };
    out.set_item("placement", name(&l.placement))?;
    out.set_item("order", name(&l.order))?;
    out.set_item("kv_kind", name(&l.model.kind))?;
    out.set_item("block_tokens", l.block_tokens)?;
    out.set_item("num_blocks", l.num_blocks)?;
    out.set_item("block_stride", l.block_stride)?;
    out.set_item("part_bytes", l.part_bytes())?;
    out.set_item("local_heads", l.local_heads())?;
    out.set_item("head_dim", l.model.head_dim)?;
    out.set_item("regions", l.num_regions())?;
    out.set_item("distinct_regions", l.distinct_regions().len())?;
    out.set_item("region_len", l.region_len())?;
    Ok(out)
}

/// Whether the NIXL library can be loaded in this process.
#[pyfunction]
fn nixl_available() -> bool {
    crate::transport::nixl::available()
}

/// The kvpush version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Routes the engine's logs (`KVPUSH_LOG`, default `warn`) to stderr, once per process.
#[pyfunction]
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVPUSH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Worker>()?;
    m.add_function(wrap_pyfunction!(nixl_available, m)?)?;
    m.add_function(wrap_pyfunction!(check_layout, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add("KvpushError", py.get_type::<KvpushError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("TransportError", py.get_type::<TransportError>())?;
    m.add("IncompatibleError", py.get_type::<IncompatibleError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    Ok(())
}
