//! The `kvpush` command: `kvpush demo` runs the main job (see `kvpush --help`).

mod doctor;
mod faults;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvpush::proto::layout::BlockOrder;
use kvpush::proto::Mode;
use kvpush_testkit::demo::{self, Topology, Workload};

#[derive(Parser, Debug)]
#[command(name = "kvpush", version, about = "Push-mode KV-cache transfer for disaggregated LLM serving")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a P engine and a D engine, push (and pull) a workload, verify every byte, and print a table
    /// per mode: in this process over the loopback transport (default), or as two processes over NIXL
    /// (`--transport nixl --processes 2`).
    Demo(DemoArgs),
    /// One engine of `kvpush demo --processes 2`, driven over stdin/stdout by the demo (internal).
    #[command(hide = true)]
    DemoWorker(demo::procs::WorkerSpec),
    /// Print what kvpush finds on this machine (NIXL and its plugins, the backends that start, the
    /// device KVPUSH_DEVICE resolves to, the side-channel port, EFA) and what to fix.
    Doctor(DoctorArgs),
    /// Attack a P/D pair (two processes, real NIXL, a secret set) from separate processes while it serves
    /// verified traffic, and report what each attack achieved (scripts/hostile.sh; docs/security.md).
    Hostile(HostileArgs),
    /// One attacker process of `kvpush hostile` (internal).
    #[command(hide = true)]
    HostileAttack(kvpush_testkit::hostile::attack::AttackArgs),
    /// Play every scenario of the fault suite (issue 16) and report corrupt, leaked and hung blocks
    /// and requests per scenario (scripts/faults.sh; docs/reliability.md).
    Faults(faults::FaultsArgs),
    /// Serve an OpenAI-compatible P/D router in front of prefill and decode servers: in push mode it sends
    /// both legs of every request at once (docs/router.md).
    Router(kvpush_router::RouterArgs),
}

#[derive(clap::Args, Debug)]
struct HostileArgs {
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Connections of the connection flood.
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Repetitions of each of the other attacks (the relays make at most 20).
    #[arg(long, default_value_t = 50)]
    rounds: usize,
    /// Show the engines' and attackers' log lines.
    #[arg(long)]
    verbose: bool,
}

#[derive(clap::Args, Debug)]
struct DoctorArgs {
    /// Side-channel host to check.
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    /// Side-channel port to check (5600 + rank by default).
    #[arg(long, default_value_t = 5600)]
    port: u16,
    /// Backends to try to start (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "UCX,LIBFABRIC")]
    backends: Vec<String>,
    /// Print the findings as JSON.
    #[arg(long)]
    json: bool,
    /// The other side of the P/D pair (its host or address): checks what a pair on one host needs.
    #[arg(long)]
    peer: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum ModeArg {
    Push,
    Pull,
    Both,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum TransportArg {
    /// In-process loopback transport (P and D in this process).
    Loopback,
    /// Real NIXL (P and D as two processes).
    Nixl,
}

/// `--layerwise`: how P hands its requests to the engine when it computes layer by layer.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum LayerwiseArg {
    /// The whole request after its last layer (`request_finished`).
    Off,
    /// Each layer as it is computed (`layers_ready`); the engine pushes every request layer by layer.
    On,
    /// Each layer as it is computed; the engine pushes small requests whole.
    Auto,
    /// The same requests twice: whole, then each layer as it is computed (engine setting
    /// `--layerwise-engine`); the JSON gains a `layerwise` comparison.
    Compare,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum OrderArg {
    Hnd,
    Nhd,
}

#[derive(clap::Args, Debug)]
struct DemoArgs {
    /// Which modes to run on the same workload.
    #[arg(long, value_enum, default_value = "both")]
    mode: ModeArg,
    /// The transport: loopback (in this process) or NIXL (P and D as two processes).
    #[arg(long, value_enum, default_value = "loopback")]
    transport: TransportArg,
    /// Processes to run P and D in: 1 (loopback) or 2 (nixl; the default with --transport nixl).
    #[arg(long)]
    processes: Option<u32>,
    /// NIXL backend plugin (--transport nixl): UCX, or LIBFABRIC for EFA.
    #[arg(long, default_value = "UCX")]
    nixl_backend: String,
    /// Number of requests.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Shortest prompt in tokens (lengths are log-uniform between min and max).
    #[arg(long, default_value_t = 32)]
    min_tokens: u64,
    /// Longest prompt in tokens.
    #[arg(long, default_value_t = 4096)]
    max_tokens: u64,
    /// Requests in flight at once at most.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Simulated prefill time per token, in nanoseconds.
    #[arg(long, default_value_t = 250)]
    prefill_ns_per_token: u64,
    /// Router delay between the legs, in microseconds.
    #[arg(long, default_value_t = 200)]
    relay_us: u64,
    /// Seed of the workload and the KV contents.
    #[arg(long, default_value_t = 0x6b76_7075_7368)]
    seed: u64,
    /// Model layers (default: 16 of Qwen3-32B's 64).
    #[arg(long, default_value_t = 16)]
    layers: u32,
    /// KV heads of the model (default: the 1 head a TP-8 rank of Qwen3-32B holds).
    #[arg(long, default_value_t = 1)]
    kv_heads: u32,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    /// Producer tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    p_tp: u16,
    /// Consumer tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    d_tp: u16,
    /// Producer block size in tokens.
    #[arg(long, default_value_t = 16)]
    p_block: u32,
    /// Consumer block size in tokens.
    #[arg(long, default_value_t = 16)]
    d_block: u32,
    /// Blocks per worker on each side.
    #[arg(long, default_value_t = 4096)]
    num_blocks: u32,
    /// Make every n-th layer a sliding-window layer (0: none).
    #[arg(long, default_value_t = 0)]
    window_every: u32,
    /// Sliding window in tokens.
    #[arg(long, default_value_t = 1024)]
    window_tokens: u32,
    /// Element order inside a block.
    #[arg(long, value_enum, default_value = "hnd")]
    order: OrderArg,
    /// Writer threads per worker.
    #[arg(long, default_value_t = 1)]
    writers: usize,
    /// Stage fragmented WRITEs through bounded slots on the device (auto: each WRITE the path measured faster, for GPU memory and for host memory over NIXL).
    #[arg(long, value_enum, default_value = "auto")]
    staging: kvpush_testkit::demo::StagingFlag,
    /// Staging slots per side (0: the default, 4).
    #[arg(long, default_value_t = 0)]
    staging_slots: usize,
    /// Staging slot size in KiB (0: the default, 32 MiB).
    #[arg(long, default_value_t = 0)]
    staging_slot_kib: u64,
    /// How the demo's block pools hand out ids: runs of consecutive ids (first fit), or a FIFO free
    /// queue like vLLM's (scattered ids after churn: one descriptor per block per layer).
    #[arg(long, value_enum, default_value = "runs")]
    allocator: kvpush_testkit::demo::AllocatorFlag,
    /// Simulated prefill compute per layer, in microseconds (after the per-token time): P's layer `l`
    /// is final `(l + 1) x N` µs into prefill. 0: no per-layer compute (needed by --layerwise).
    #[arg(long, default_value_t = 0)]
    prefill_us_per_layer: u64,
    /// Layer-wise push: how P reports its layers (needs --prefill-us-per-layer).
    #[arg(long, value_enum, default_value = "off")]
    layerwise: LayerwiseArg,
    /// Push every request registration-first (D registers at admission, as a push router sends both
    /// legs at once) instead of half of them blocks-first (D registers after P's prefill).
    #[arg(long)]
    registration_first: bool,
    /// The engine's layer-wise setting in the layer-wise pass of --layerwise compare.
    #[arg(long, value_enum, default_value = "auto")]
    layerwise_engine: kvpush_testkit::demo::LayerwiseFlag,
    /// P keeps its GPU busy for the whole run (back-to-back 8 MiB host-to-device copies on a thread of
    /// its own), as a real prefill's next layer does while the last one is posted; the simulated
    /// per-layer compute is a sleep that leaves the GPU idle. Needs --processes 2 and
    /// KVPUSH_DEVICE=cuda:N.
    #[arg(long)]
    prefill_gpu_busy: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Hide the progress bar.
    #[arg(long)]
    quiet: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVPUSH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Router(a) => kvpush_router::run(a),
        Command::Doctor(a) => {
            let opts = doctor::DoctorOptions { host: a.host, port: a.port, backends: a.backends, peer: a.peer };
            let findings = doctor::run(&opts);
            if a.json {
                match serde_json::to_string_pretty(&findings) {
                    Ok(s) => println!("{s}"),
                    Err(e) => eprintln!("kvpush doctor: {e}"),
                }
            } else {
                for f in &findings {
                    println!("{f}");
                }
            }
            let problems = findings.iter().filter(|f| f.level == doctor::Level::Problem).count();
            if problems > 0 {
                eprintln!("kvpush doctor: {problems} problem(s) found");
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Command::DemoWorker(spec) => match u8::try_from(demo::procs::worker_main(&spec)) {
            Ok(code) => ExitCode::from(code),
            Err(_) => ExitCode::FAILURE,
        },
        Command::HostileAttack(a) => match u8::try_from(kvpush_testkit::hostile::attack::attack_main(&a)) {
            Ok(code) => ExitCode::from(code),
            Err(_) => ExitCode::FAILURE,
        },
        Command::Hostile(a) => hostile_cmd(a),
        Command::Faults(a) => faults::run(a),
        Command::Demo(args) => match demo_cmd(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("kvpush demo: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// `kvpush hostile`: one line per attack as it ends, the table, the JSON; exit 1 if a target is missed.
fn hostile_cmd(a: HostileArgs) -> ExitCode {
    use kvpush_testkit::hostile::{self, AttackReport};
    let Some((exe, log)) = children("kvpush hostile", a.verbose) else { return ExitCode::FAILURE };
    let opts = hostile::Options { exe, connections: a.connections, rounds: a.rounds, log };
    let progress = |r: &AttackReport| {
        eprintln!(
            "kvpush hostile: {:<24} attempts {:>6}  accepted {}  served {} (failed {})  rss +{:.1} MiB  threads {}",
            r.name, r.attempts, r.accepted, r.served, r.served_failed, r.rss_growth_mib, r.threads_max
        );
    };
    let report = match hostile::run(&opts, &progress) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvpush hostile: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("| attack | attempts | accepted | served (failed) | RSS growth (MiB) | threads max |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &report.attacks {
        println!(
            "| {} | {} | {} | {} ({}) | {:.1} | {} |",
            r.name, r.attempts, r.accepted, r.served, r.served_failed, r.rss_growth_mib, r.threads_max
        );
    }
    let t = &report.totals;
    println!("| **total** | {} | {} | ({}) | | |", t.attempts, t.accepted, t.served_failed);
    let missed = report.missed();
    conclude("hostile", a.json.as_deref(), &report, &missed)
}

fn demo_cmd(a: DemoArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let processes = match (a.transport, a.processes) {
        (TransportArg::Loopback, None | Some(1)) => 1,
        (TransportArg::Loopback, Some(n)) => {
            return Err(format!(
                "--processes {n} needs --transport nixl: the loopback transport only connects engines inside one \
                 process"
            )
            .into())
        }
        (TransportArg::Nixl, None | Some(2)) => 2,
        (TransportArg::Nixl, Some(n)) => {
            return Err(format!(
                "--transport nixl runs P and D as two processes: use --processes 2 (got {n}; NIXL between two \
                 agents of one process is not what a deployment runs)"
            )
            .into())
        }
    };
    let topo = Topology {
        layers: a.layers,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        p_tp: a.p_tp,
        d_tp: a.d_tp,
        p_block: a.p_block,
        d_block: a.d_block,
        num_blocks: a.num_blocks,
        window_every: a.window_every,
        window_tokens: a.window_tokens,
        order: if a.order == OrderArg::Nhd { BlockOrder::Nhd } else { BlockOrder::Hnd },
        writers: a.writers,
        staging: a.staging,
        staging_slots: a.staging_slots,
        staging_slot_bytes: a.staging_slot_kib << 10,
        allocator: a.allocator,
        whole_blocks: false,
        layerwise: match a.layerwise {
            LayerwiseArg::Off => demo::LayerwiseFlag::Off,
            LayerwiseArg::On => demo::LayerwiseFlag::On,
            LayerwiseArg::Auto => demo::LayerwiseFlag::Auto,
            LayerwiseArg::Compare => a.layerwise_engine,
        },
        whole_block_bytes: false,
    };
    if a.layerwise != LayerwiseArg::Off && a.prefill_us_per_layer == 0 {
        return Err("--layerwise needs --prefill-us-per-layer N: without per-layer compute there is nothing to \
                    overlap"
            .into());
    }
    let compare = a.layerwise == LayerwiseArg::Compare;
    if a.prefill_gpu_busy && processes != 2 {
        return Err("--prefill-gpu-busy runs in P's child process: add --transport nixl --processes 2".into());
    }
    if compare && a.mode != ModeArg::Push {
        return Err("--layerwise compare runs push only: add --mode push".into());
    }
    let work = Workload {
        requests: a.requests,
        min_tokens: a.min_tokens,
        max_tokens: a.max_tokens,
        concurrency: a.concurrency,
        prefill_ns_per_token: a.prefill_ns_per_token,
        relay_us: a.relay_us,
        seed: a.seed,
        prefill_ns_per_layer: a.prefill_us_per_layer * 1000,
        layerwise: a.layerwise != LayerwiseArg::Off,
        registration_first: a.registration_first,
    };
    let modes = match a.mode {
        ModeArg::Push => vec![Mode::Push],
        ModeArg::Pull => vec![Mode::Pull],
        ModeArg::Both => vec![Mode::Push, Mode::Pull],
    };
    let runs = modes.len() * if compare { 2 } else { 1 };
    let bar = if a.quiet { ProgressBar::hidden() } else { ProgressBar::new((a.requests * runs) as u64) };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:40}] {pos}/{len} requests ({elapsed})")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    bar.set_message("push/pull demo");
    let play = |work: &Workload| -> Result<demo::Report, Box<dyn std::error::Error>> {
        Ok(if processes == 2 {
            let mut opts = demo::procs::Options::new()?;
            opts.backend = a.nixl_backend.clone();
            // The comparison is about latency; the bandwidth references would double the run.
            opts.references = !compare;
            // ...and it reports where the exposed time goes (the engines' timelines).
            opts.stages = compare.then(std::env::temp_dir);
            opts.prefill_gpu_busy = a.prefill_gpu_busy;
            let b = bar.clone();
            opts.log = Some(std::sync::Arc::new(move |line: &str| b.suspend(|| eprintln!("{line}"))));
            demo::procs::run(&topo, work, &modes, &opts, &|| bar.inc(1))?
        } else {
            demo::run(&topo, work, &modes, &|| bar.inc(1))?
        })
    };
    let mut whole_failed = 0;
    let report = if compare {
        let whole = play(&Workload { layerwise: false, ..work.clone() })?;
        let mut layered = play(&work)?;
        if let (Some(w), Some(l)) = (&whole.push, &layered.push) {
            whole_failed = w.failed;
            layered.layerwise = Some(demo::layerwise::compare(w, l));
        }
        layered
    } else {
        play(&work)?
    };
    bar.finish_and_clear();
    let how = if processes == 2 {
        format!("NIXL ({}) between 2 processes", a.nixl_backend)
    } else {
        "loopback transport in 1 process".to_string()
    };
    println!(
        "kvpush demo: {} requests of {}..{} tokens, {} layers x {} KV heads x {} dims (bf16), P TP {} / D TP {}, blocks {}/{}, {how}",
        a.requests, a.min_tokens, a.max_tokens, a.layers, a.kv_heads, a.head_dim, a.p_tp, a.d_tp, a.p_block, a.d_block
    );
    print!("{}", demo::table(&report));
    if let Some(l) = &report.layerwise {
        let ratio = l.ratio_p50.map_or("-".to_string(), |r| format!("{r:.3}"));
        println!(
            "layer-wise vs whole, P's last layer to D having the request: p50 {} vs {} µs, p99 {} vs {} µs, \
             ratio of medians at {}+ tokens {ratio} ({} requests)",
            l.exposed_us_p50,
            l.whole_exposed_us_p50,
            l.exposed_us_p99,
            l.whole_exposed_us_p99,
            demo::layerwise::LARGE_TOKENS,
            l.requests
        );
        println!(
            "  cost: P posted {} vs {} transfers; engine-thread time per request p50 {:.1} vs {:.1} µs",
            l.producer_posts, l.whole_producer_posts, l.engine_us_p50, l.whole_engine_us_p50
        );
        for (name, s) in [("layer-wise", &l.stages), ("whole", &l.whole_stages)] {
            if let Some(s) = s {
                println!(
                    "  {name} stages p50 (µs, {} requests): writer wake {}, post {}, WRITE + notification to D \
                     {}, D counts {}, outcome reported {} (P sees its WRITE done {} after the post)",
                    s.requests,
                    s.wake_us_p50,
                    s.post_us_p50,
                    s.notify_us_p50,
                    s.count_us_p50,
                    s.report_us_p50,
                    s.write_done_us_p50
                );
            }
        }
        for b in &l.by_tokens {
            let r = b.ratio_p50.map_or("-".to_string(), |r| format!("{r:.3}"));
            println!(
                "  {:>6}..{:<6} tokens: {:>4} requests, p50 {:>7} vs {:>7} µs, ratio {r}",
                b.min_tokens, b.max_tokens, b.requests, b.exposed_us_p50, b.whole_exposed_us_p50
            );
        }
    }
    if let Some(path) = a.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        println!("results written to {}", path.display());
    }
    let failed = report.push.iter().chain(report.pull.iter()).map(|m| m.failed).sum::<u64>() + whole_failed;
    if failed > 0 {
        eprintln!("kvpush demo: {failed} requests failed or arrived wrong");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `report` as pretty JSON (and a newline) to `path`; the error says which file.
/// The end of a `faults` or `hostile` run: writes `report` to `json` (if asked) and names each
/// target `missed`, prefixed with `kvpush {cmd}`; success only when the report was written and no
/// target was missed.
fn conclude(cmd: &str, json: Option<&std::path::Path>, report: &impl serde::Serialize, missed: &[String]) -> ExitCode {
    if let Some(path) = json {
        if let Err(e) = write_json(path, report) {
            eprintln!("kvpush {cmd}: {e}");
            return ExitCode::FAILURE;
        }
    }
    for m in missed {
        eprintln!("kvpush {cmd}: target missed: {m}");
    }
    if missed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn write_json(path: &std::path::Path, report: &impl serde::Serialize) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(report).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display())))
}

/// This executable (children run it) and where their log lines go (dropped unless `verbose`);
/// `None` after saying why on stderr, prefixed with `cmd`.
fn children(cmd: &str, verbose: bool) -> Option<(PathBuf, Option<kvpush_testkit::child::LogFn>)> {
    match std::env::current_exe() {
        Ok(exe) => {
            let log: Option<kvpush_testkit::child::LogFn> =
                if verbose { None } else { Some(std::sync::Arc::new(|_: &str| {})) };
            Some((exe, log))
        }
        Err(e) => {
            eprintln!("{cmd}: cannot find this executable: {e}");
            None
        }
    }
}
