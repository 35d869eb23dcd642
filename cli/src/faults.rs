//! `kvpush faults`: the fault suite of issue 16 (`kvpush_testkit::faults`), one line per scenario as
//! it ends, then the table and the JSON; exits 1 when a target is missed.

use std::path::PathBuf;
use std::process::ExitCode;

use kvpush_testkit::faults::{self, ScenarioReport};

#[derive(clap::Args, Debug)]
pub(crate) struct FaultsArgs {
    /// The CI setting: a tenth of the requests per scenario (at least 20), no floor on the total.
    #[arg(long)]
    ci: bool,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only the scenarios whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Show the engines' log lines (the process scenarios' children included).
    #[arg(long)]
    verbose: bool,
}

pub(crate) fn run(a: FaultsArgs) -> ExitCode {
    let Some((exe, log)) = super::children("kvpush faults", a.verbose) else { return ExitCode::FAILURE };
    let opts = faults::Options { exe, ci: a.ci, only: a.only, log };
    let progress = |r: &ScenarioReport| {
        eprintln!(
            "kvpush faults: {:<44} requests {:>5}  corrupt {}  leaked {}  hung {}  quarantined max {}  ({:.1} s)",
            r.name, r.requests, r.corrupt_blocks, r.leaked_blocks, r.hung, r.quarantined_max, r.seconds
        );
    };
    let report = faults::run(&opts, &progress);
    println!(
        "| scenario | requests | received | failed | corrupt blocks | leaked blocks | hung | quarantined max | s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &report.scenarios {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} |",
            r.name,
            r.requests,
            r.received,
            r.failed,
            r.corrupt_blocks,
            r.leaked_blocks,
            r.hung,
            r.quarantined_max,
            r.seconds
        );
    }
    let t = &report.totals;
    println!(
        "| **total ({} scenarios)** | {} | | | {} | {} | {} | | {:.1} |",
        report.scenarios.len(),
        t.requests,
        t.corrupt_blocks,
        t.leaked_blocks,
        t.hung,
        t.seconds
    );
    let missed = report.missed(opts.min_requests());
    super::conclude("faults", a.json.as_deref(), &report, &missed)
}
