//! `kvpush doctor`: what kvpush finds on this machine, and what to fix.
//!
//! Each check yields a [`Finding`]: what was looked at, what was found, and — when it is not fine —
//! the fix. Checks never abort the process (NIXL is probed through `is_stub` before any call).

use std::fmt;
use std::net::TcpListener;
use std::path::{Path, PathBuf};

use serde::Serialize;

use kvpush::device;
use kvpush::transport::nixl::{self, NixlConfig, NixlTransport};

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Level {
    /// Works.
    Ok,
    /// Works, or is not needed here, but worth knowing.
    Note,
    /// Does not work; the fix says what to do.
    Problem,
}

/// One check's result.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// What was checked.
    pub check: String,
    /// How it came out.
    pub level: Level,
    /// What was found.
    pub found: String,
    /// What to do about it (empty when fine).
    pub fix: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.level {
            Level::Ok => "ok     ",
            Level::Note => "note   ",
            Level::Problem => "PROBLEM",
        };
        write!(f, "[{tag}] {:<28} {}", self.check, self.found)?;
        if !self.fix.is_empty() {
            write!(f, "\n          fix: {}", self.fix)?;
        }
        Ok(())
    }
}

fn finding(check: &str, level: Level, found: impl Into<String>, fix: impl Into<String>) -> Finding {
    Finding { check: check.to_owned(), level, found: found.into(), fix: fix.into() }
}

/// The path of a loaded shared object whose file name starts with `stem`, from /proc/self/maps.
fn loaded(stem: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| Path::new(p).file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(stem)))
        .map(PathBuf::from)
}

/// Options of the doctor run.
#[derive(Clone, Debug)]
pub struct DoctorOptions {
    /// Side-channel host to check.
    pub host: String,
    /// Side-channel port to check.
    pub port: u16,
    /// Backends to try to start.
    pub backends: Vec<String>,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        Self { host: "0.0.0.0".into(), port: 5600, backends: vec!["UCX".into(), "LIBFABRIC".into()] }
    }
}

/// Runs every check.
pub fn run(opts: &DoctorOptions) -> Vec<Finding> {
    let mut out = vec![finding(
        "kvpush",
        Level::Ok,
        format!(
            "{} (wire protocol {}, nixl-sys 1.5.2 with stub-api)",
            env!("CARGO_PKG_VERSION"),
            kvpush::proto::codec::PROTOCOL_VERSION
        ),
        "",
    )];
    out.extend(nixl_checks(opts));
    out.push(match device::from_env() {
        Ok(d) => finding(
            "device (KVPUSH_DEVICE)",
            Level::Ok,
            format!(
                "{} (KVPUSH_DEVICE={})",
                d.kind(),
                std::env::var("KVPUSH_DEVICE").unwrap_or_else(|_| "unset: auto".into())
            ),
            "",
        ),
        Err(e) => finding(
            "device (KVPUSH_DEVICE)",
            Level::Problem,
            e.to_string(),
            "set KVPUSH_DEVICE to a backend this machine has (host works everywhere)",
        ),
    });
    let addr = format!("{}:{}", opts.host, opts.port);
    out.push(match TcpListener::bind(&addr) {
        Ok(_) => finding("side-channel port", Level::Ok, format!("{addr} is free"), ""),
        Err(e) => finding(
            "side-channel port",
            Level::Problem,
            format!("cannot listen on {addr}: {e}"),
            "stop what holds the port or configure another (the side channel uses 5600 + rank by default)",
        ),
    });
    out.push(efa_check());
    out
}

fn nixl_checks(opts: &DoctorOptions) -> Vec<Finding> {
    let mut out = Vec::new();
    if !nixl::available() {
        out.push(finding(
            "NIXL library",
            Level::Problem,
            "libnixl_capi.so cannot be loaded",
            "run `. scripts/nixl.sh` (fetches the nixl-cu12 wheel's libraries) or install NIXL, and put its \
             library directory on LD_LIBRARY_PATH",
        ));
        return out;
    }
    let path = loaded("libnixl_capi").map(|p| p.display().to_string()).unwrap_or_else(|| "loaded".into());
    let version = loaded("libnixl_capi")
        .and_then(|p| std::fs::read_to_string(p.parent()?.parent()?.join("VERSION")).ok())
        .map(|v| format!(", NIXL {}", v.trim()))
        .unwrap_or_default();
    out.push(finding("NIXL library", Level::Ok, format!("{path}{version}"), ""));
    match std::env::var("NIXL_PLUGIN_DIR") {
        Ok(dir) => {
            let plugins: Vec<String> = std::fs::read_dir(&dir)
                .map(|rd| {
                    rd.filter_map(|e| e.ok())
                        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                        .filter_map(|n| {
                            n.strip_prefix("libplugin_").and_then(|n| n.strip_suffix(".so")).map(str::to_owned)
                        })
                        .collect()
                })
                .unwrap_or_default();
            let level = if plugins.is_empty() { Level::Problem } else { Level::Ok };
            out.push(finding(
                "NIXL plugins",
                level,
                format!("{dir}: {}", if plugins.is_empty() { "none".into() } else { plugins.join(", ") }),
                if plugins.is_empty() { "point NIXL_PLUGIN_DIR at the directory holding libplugin_*.so" } else { "" },
            ));
        }
        Err(_) => out.push(finding(
            "NIXL plugins",
            Level::Note,
            "NIXL_PLUGIN_DIR is not set (NIXL looks next to its library)",
            "set NIXL_PLUGIN_DIR if backends fail to start",
        )),
    }
    for (i, b) in opts.backends.iter().enumerate() {
        let mut c = NixlConfig::new(format!("kvpush-doctor-{}-{i}", std::process::id()));
        c.backend = b.clone();
        out.push(match NixlTransport::new(&c) {
            Ok(_) => finding(&format!("backend {b}"), Level::Ok, "starts", ""),
            Err(e) => finding(
                &format!("backend {b}"),
                if b == "UCX" { Level::Problem } else { Level::Note },
                e.to_string(),
                if b == "LIBFABRIC" {
                    "needed only for EFA: install libfabric with the EFA provider (AWS EFA installer)"
                } else {
                    "check NIXL_PLUGIN_DIR and that UCX's libraries are on LD_LIBRARY_PATH"
                },
            ),
        });
    }
    if let Some(ucp) = loaded("libucp") {
        out.push(finding("UCX", Level::Ok, ucp.display().to_string(), ""));
    }
    out
}

fn efa_check() -> Finding {
    let devices: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().to_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    let efa: Vec<&String> = devices.iter().filter(|d| d.contains("efa")).collect();
    let fi_info = std::process::Command::new("fi_info").args(["-p", "efa"]).output();
    match (efa.is_empty(), fi_info) {
        (false, Ok(o)) if o.status.success() => {
            finding("EFA (for LIBFABRIC)", Level::Ok, format!("devices {efa:?}; fi_info -p efa lists the provider"), "")
        }
        (false, _) => finding(
            "EFA (for LIBFABRIC)",
            Level::Problem,
            format!("devices {efa:?} but `fi_info -p efa` does not list the provider"),
            "install the AWS EFA software (libfabric with the efa provider)",
        ),
        (true, _) => finding(
            "EFA (for LIBFABRIC)",
            Level::Note,
            "no EFA device on this machine (UCX over TCP/shared memory is used)",
            "",
        ),
    }
}
