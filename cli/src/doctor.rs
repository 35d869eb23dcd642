//! `kvpush doctor`: what kvpush finds on this machine, and what to fix.
//!
//! Each check yields a [`Finding`]: what was looked at, what was found, and — when it is not fine —
//! the fix. Checks never abort the process (NIXL is probed through `is_stub` before any call).
//!
//! On a machine with a Neuron runtime (libnrt loads), [`neuron_checks`] adds what serving from
//! Neuron memory over EFA needs: `NEURON_RT_MAP_HBM`, the runtime's version and optional calls, one
//! EFA NIC per Neuron device, and `FI_EFA_ENABLE_SHM_TRANSFER=0` when P and D share the host.

use std::fmt;
use std::net::TcpListener;
use std::path::{Path, PathBuf};

use serde::Serialize;

use kvpush::device;
use kvpush::device::neuron::{NeuronConfig, NeuronDevice, RuntimeMode, ENV_MAP_HBM};
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
    /// The other side's host (D for P, P for D), where known: decides whether P and D share this host.
    pub peer: Option<String>,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        Self { host: "0.0.0.0".into(), port: 5600, backends: vec!["UCX".into(), "LIBFABRIC".into()], peer: None }
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
    out.extend(neuron_checks(opts, &efa_pci_devices(Path::new("/"))));
    out
}

/// The oldest libnrt whose `nrt_get_attached_efa_bdf` NIXL's LIBFABRIC backend uses to pick each
/// Neuron device's EFA NIC (older: it registers Neuron memory on every rail).
const MIN_RUNTIME: (u64, u64) = (2, 31);

/// The environment variable that must be 0 for P and D on one host (libfabric's EFA provider would
/// otherwise hand same-host transfers to its shared-memory path, which does not carry Neuron memory).
const ENV_EFA_SHM: &str = "FI_EFA_ENABLE_SHM_TRANSFER";

/// Whether `NEURON_RT_MAP_HBM`'s value turns the mapping on (as the runtime and torch-neuronx read
/// it: `1`, `true`, or another positive integer).
fn map_hbm_on(v: &str) -> bool {
    let v = v.trim();
    v.eq_ignore_ascii_case("true") || v.parse::<u64>().is_ok_and(|n| n > 0)
}

/// Whether `host` is an address of this machine (binding to it succeeds), resolving names.
fn is_local(host: &str) -> bool {
    use std::net::ToSocketAddrs;
    (host, 0).to_socket_addrs().is_ok_and(|mut addrs| addrs.any(|a| TcpListener::bind((a.ip(), 0)).is_ok()))
}

/// EFA devices under `root` (`/` on a real machine): PCI address → InfiniBand device name, from
/// `sys/class/infiniband/<dev>/device`, for devices bound to the `efa` driver (or named `efa*`).
fn efa_pci_devices(root: &Path) -> std::collections::BTreeMap<String, String> {
    let class = root.join("sys/class/infiniband");
    let mut out = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&class).into_iter().flatten().flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
        let dev = entry.path().join("device");
        let driver = std::fs::read_link(dev.join("driver")).ok();
        let is_efa = name.contains("efa") || driver.as_deref().and_then(Path::file_name).is_some_and(|d| d == "efa");
        let bdf = std::fs::read_link(&dev).ok().and_then(|l| l.file_name().and_then(|n| n.to_str()).map(str::to_owned));
        if let (true, Some(bdf)) = (is_efa, bdf) {
            out.insert(bdf, name);
        }
    }
    out
}

/// The Neuron checks (see the module docs), given the EFA devices of this machine. A machine without
/// a Neuron runtime gets one note.
fn neuron_checks(opts: &DoctorOptions, efa: &std::collections::BTreeMap<String, String>) -> Vec<Finding> {
    let mut cfg = match NeuronConfig::from_env() {
        Ok(c) => c,
        Err(e) => return vec![finding("Neuron", Level::Problem, e.to_string(), "fix the variable named")],
    };
    // The doctor is its own process: no framework started the runtime, so it starts one to probe.
    cfg.mode = RuntimeMode::Own;
    let map_hbm = std::env::var(ENV_MAP_HBM).ok();
    let dev = match NeuronDevice::open(&cfg) {
        Ok(d) => d,
        Err(e) if e.is_absent() => {
            return vec![finding("Neuron", Level::Note, format!("no Neuron runtime here ({e})"), "")];
        }
        Err(e) => {
            let fix = "a Neuron runtime is here but kvpush cannot use its device memory: fix what the message \
                       names (the serving processes need the same)";
            return vec![
                finding("Neuron device", Level::Problem, e.to_string(), fix),
                map_hbm_finding(map_hbm.as_deref()),
            ];
        }
    };
    let mut out = vec![map_hbm_finding(map_hbm.as_deref())];
    let info = dev.info();
    out.push(match info.version_number {
        Some(v) if v >= MIN_RUNTIME => finding(
            "Neuron runtime",
            Level::Ok,
            format!("libnrt {} ({})", info.version.unwrap_or_default(), info.library.display()),
            "",
        ),
        Some(_) | None => finding(
            "Neuron runtime",
            Level::Problem,
            format!(
                "libnrt {} ({}) is older than {}.{}",
                info.version.unwrap_or_else(|| "of unknown version (no nrt_get_version)".into()),
                info.library.display(),
                MIN_RUNTIME.0,
                MIN_RUNTIME.1
            ),
            "upgrade the Neuron runtime (aws-neuronx-runtime-lib) to 2.31 or later: NIXL's LIBFABRIC backend picks \
             each Neuron device's EFA NIC through nrt_get_attached_efa_bdf",
        ),
    });
    if !info.missing_optional.is_empty() {
        out.push(finding(
            "Neuron runtime calls",
            Level::Problem,
            format!("this libnrt lacks {}", info.missing_optional.join(", ")),
            "upgrade the Neuron runtime: libfabric registers Neuron memory through nrt_get_dmabuf_fd, and NIXL \
             picks the EFA NIC through nrt_get_attached_efa_bdf",
        ));
    }
    out.extend(efa_per_device(&dev, efa));
    out.push(shm_finding(opts.peer.as_deref(), std::env::var(ENV_EFA_SHM).ok().as_deref()));
    out
}

fn map_hbm_finding(value: Option<&str>) -> Finding {
    match value {
        Some(v) if map_hbm_on(v) => finding(ENV_MAP_HBM, Level::Ok, format!("{v} (device memory mapped)"), ""),
        _ => finding(
            ENV_MAP_HBM,
            Level::Problem,
            format!(
                "{} here: device addresses (a tensor's data_ptr) are not usable by EFA",
                value.map(|v| format!("{v:?}")).unwrap_or_else(|| "unset".into())
            ),
            format!(
                "export {ENV_MAP_HBM}=1 before the Neuron runtime starts in every P and D process (vllm-neuron 0.24 \
                 sets it in its worker)"
            ),
        ),
    }
}

/// One finding per EFA device the Neuron devices name, or per NeuronCore libnrt names none for.
fn efa_per_device(dev: &NeuronDevice, efa: &std::collections::BTreeMap<String, String>) -> Vec<Finding> {
    let mut by_nic: std::collections::BTreeMap<String, Vec<u32>> = std::collections::BTreeMap::new();
    let mut out = Vec::new();
    for (core, nic) in dev.efa_per_core() {
        match nic {
            Ok(bdf) => by_nic.entry(bdf).or_default().push(core),
            Err(e) => out.push(finding(
                &format!("EFA of NeuronCore {core}"),
                Level::Problem,
                format!("libnrt names no EFA device: {e}"),
                "NIXL's LIBFABRIC backend needs one EFA NIC per Neuron device (instances without one, such as \
                 trn2.3xlarge, cannot register Neuron memory); use an instance size with EFA on every device",
            )),
        }
    }
    for (bdf, cores) in by_nic {
        let cores = cores.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        out.push(match efa.get(&bdf) {
            Some(ib) => finding(&format!("EFA of NeuronCores {cores}"), Level::Ok, format!("{bdf} ({ib})"), ""),
            None => finding(
                &format!("EFA of NeuronCores {cores}"),
                Level::Problem,
                format!("libnrt names {bdf}, which is not an EFA device of this machine"),
                "install the EFA driver (AWS EFA installer) and check that every Neuron device's EFA NIC is enabled \
                 (/sys/class/infiniband)",
            ),
        });
    }
    out
}

/// `FI_EFA_ENABLE_SHM_TRANSFER` for a P/D pair whose other side is `peer`.
fn shm_finding(peer: Option<&str>, value: Option<&str>) -> Finding {
    let off = value.is_some_and(|v| v.trim() == "0");
    let shown = value.map(|v| format!("{ENV_EFA_SHM}={v}")).unwrap_or_else(|| format!("{ENV_EFA_SHM} unset"));
    let fix = format!(
        "export {ENV_EFA_SHM}=0 in P and D: the EFA provider's shared-memory path does not carry Neuron device memory"
    );
    match peer {
        Some(p) if is_local(p) && !off => {
            finding(ENV_EFA_SHM, Level::Problem, format!("{shown}, and the peer {p} is this host"), fix)
        }
        Some(p) if is_local(p) => finding(ENV_EFA_SHM, Level::Ok, format!("{shown} (the peer {p} is this host)"), ""),
        Some(p) => finding(ENV_EFA_SHM, Level::Ok, format!("{shown} (the peer {p} is another host)"), ""),
        None if off => finding(ENV_EFA_SHM, Level::Ok, shown, ""),
        None => finding(
            ENV_EFA_SHM,
            Level::Note,
            format!("{shown}; pass --peer HOST to check a P/D pair"),
            format!("if P and D share this host, {fix}"),
        ),
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn efa_devices_are_read_from_sysfs_by_driver_or_name() {
        let root = std::env::temp_dir().join(format!("kvpush-doctor-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let pci = root.join("sys/devices/pci0000:00");
        let class = root.join("sys/class/infiniband");
        std::fs::create_dir_all(&class).unwrap();
        for (ib, bdf, driver) in [
            ("rdmap16s28", "0000:10:1c.0", "efa"),
            ("efa_1", "0000:11:1c.0", "other"),
            ("mlx5_0", "0000:20:00.0", "mlx5_core"),
        ] {
            let dev = pci.join(bdf);
            std::fs::create_dir_all(dev.join("drivers-dir").join(driver)).unwrap();
            std::os::unix::fs::symlink(dev.join("drivers-dir").join(driver), dev.join("driver")).unwrap();
            std::fs::create_dir_all(class.join(ib)).unwrap();
            std::os::unix::fs::symlink(&dev, class.join(ib).join("device")).unwrap();
        }
        let found = efa_pci_devices(&root);
        std::fs::remove_dir_all(&root).unwrap();
        let want: Vec<(&str, &str)> = vec![("0000:10:1c.0", "rdmap16s28"), ("0000:11:1c.0", "efa_1")];
        assert_eq!(found.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect::<Vec<_>>(), want);
    }

    #[test]
    fn shm_transfer_must_be_off_only_for_a_pair_on_one_host() {
        let same = shm_finding(Some("127.0.0.1"), None);
        assert_eq!(same.level, Level::Problem, "{same}");
        assert!(same.fix.contains("FI_EFA_ENABLE_SHM_TRANSFER=0"), "{same}");
        assert_eq!(shm_finding(Some("127.0.0.1"), Some("0")).level, Level::Ok);
        assert_eq!(shm_finding(Some("127.0.0.1"), Some("1")).level, Level::Problem);
        // TEST-NET-1 (RFC 5737) is never an address of this machine.
        assert_eq!(shm_finding(Some("192.0.2.1"), None).level, Level::Ok);
        assert_eq!(shm_finding(None, None).level, Level::Note);
        assert!(map_hbm_on("1") && map_hbm_on("true") && map_hbm_on("2"));
        assert!(!map_hbm_on("0") && !map_hbm_on("") && !map_hbm_on("yes"));
    }
}
