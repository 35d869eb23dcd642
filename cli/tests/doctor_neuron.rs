//! `kvpush doctor`'s Neuron checks against the fake libnrt (tests/neuron_fake, built by
//! `kvpush_testkit::neuron_fake`): the binary runs with `KVPUSH_LIBNRT` pointing at the fake and
//! prints its findings as JSON; every Neuron check must say what it found and, when it is a
//! problem, what to fix.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use kvpush_testkit::neuron_fake::{self, Variant};
use serde_json::Value;

fn fake(variant: Variant) -> PathBuf {
    static BUILT: [OnceLock<PathBuf>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    BUILT[variant as usize]
        .get_or_init(|| neuron_fake::build(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("doctor-neuron"), variant))
        .clone()
}

/// Runs `kvpush doctor --json --backends UCX` with the fake as libnrt and `env`; returns the
/// findings by check name (check, level, found, fix).
fn doctor(variant: Variant, env: &[(&str, &str)], args: &[&str]) -> Vec<(String, String, String, String)> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpush"));
    cmd.args(["doctor", "--json", "--backends", "UCX", "--port", "0"]).args(args);
    for v in ["NEURON_RT_MAP_HBM", "FI_EFA_ENABLE_SHM_TRANSFER", "KVPUSH_NEURON_RUNTIME", "KVPUSH_DEVICE"] {
        cmd.env_remove(v);
    }
    cmd.env("KVPUSH_LIBNRT", fake(variant)).envs(env.iter().copied());
    let out = cmd.output().unwrap();
    let json: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor printed no JSON ({e}):\n{}", String::from_utf8_lossy(&out.stderr)));
    json.as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().unwrap().to_owned();
            (s("check"), s("level"), s("found"), s("fix"))
        })
        .collect()
}

fn get<'a>(findings: &'a [(String, String, String, String)], check: &str) -> &'a (String, String, String, String) {
    findings.iter().find(|f| f.0 == check).unwrap_or_else(|| panic!("no finding {check:?} in {findings:#?}"))
}

#[test]
fn a_misconfigured_neuron_host_is_told_what_to_fix() {
    let f = doctor(Variant::Full, &[], &["--peer", "127.0.0.1"]);
    let hbm = get(&f, "NEURON_RT_MAP_HBM");
    assert_eq!(hbm.1, "Problem", "{hbm:?}");
    assert!(hbm.2.contains("unset") && hbm.3.contains("export NEURON_RT_MAP_HBM=1"), "{hbm:?}");
    let rt = get(&f, "Neuron runtime");
    assert_eq!((rt.1.as_str(), rt.2.contains("libnrt 2.99.7.0")), ("Ok", true), "{rt:?}");
    // The fake names EFA 0000:10:1c.0 for cores 0 and 1, which this machine does not have.
    let efa = get(&f, "EFA of NeuronCores 0,1");
    assert_eq!(efa.1, "Problem", "{efa:?}");
    assert!(efa.2.contains("0000:10:1c.0, which is not an EFA device") && efa.3.contains("EFA driver"), "{efa:?}");
    let shm = get(&f, "FI_EFA_ENABLE_SHM_TRANSFER");
    assert_eq!(shm.1, "Problem", "{shm:?}");
    assert!(shm.2.contains("the peer 127.0.0.1 is this host") && shm.3.contains("FI_EFA_ENABLE_SHM_TRANSFER=0"));
}

#[test]
fn a_configured_pair_on_one_host_passes_the_settings_checks() {
    let env = [("NEURON_RT_MAP_HBM", "1"), ("FI_EFA_ENABLE_SHM_TRANSFER", "0"), ("FAKE_NRT_NC_COUNT", "4")];
    let f = doctor(Variant::Full, &env, &["--peer", "127.0.0.1"]);
    assert_eq!(get(&f, "NEURON_RT_MAP_HBM").1, "Ok");
    assert_eq!(get(&f, "FI_EFA_ENABLE_SHM_TRANSFER").1, "Ok");
    // Two Neuron devices, each with its own EFA device (cores 0-1 and 2-3).
    assert!(get(&f, "EFA of NeuronCores 2,3").2.contains("0000:11:1c.0"));
    assert!(!f.iter().any(|x| x.0 == "Neuron runtime calls"), "the fake has every optional call: {f:#?}");
}

#[test]
fn unmapped_memory_and_missing_calls_are_problems() {
    // The runtime does not map device memory: opening the device fails and says what to set.
    let f = doctor(Variant::Full, &[("NEURON_RT_MAP_HBM", "1"), ("FAKE_NRT_NO_MAP_HBM", "1")], &[]);
    let dev = get(&f, "Neuron device");
    assert_eq!(dev.1, "Problem", "{dev:?}");
    assert!(dev.2.contains("nrt_tensor_get_va returned NULL"), "{dev:?}");
    // A libnrt without nrt_get_dmabuf_fd: libfabric could not register its memory.
    let f = doctor(Variant::NoDmabuf, &[("NEURON_RT_MAP_HBM", "1")], &[]);
    let calls = get(&f, "Neuron runtime calls");
    assert_eq!(calls.1, "Problem", "{calls:?}");
    assert!(calls.2.contains("nrt_get_dmabuf_fd") && calls.3.contains("upgrade the Neuron runtime"), "{calls:?}");
}
