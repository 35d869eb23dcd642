//! Shared by tests/ffi/ffi_c.rs and tests/ffi/ffi_cpp.rs: finds the `libkvpush.so` cargo built for this test
//! run, stages it (and anything else to link) in a private directory under `CARGO_TARGET_TMPDIR` so a
//! concurrent rebuild cannot swap it mid-test, compiles a test program with the system compiler
//! ([`build`]) and runs it under a time limit.
//!
//! A missing compiler is a failure, never a skip: CI has gcc and g++, and so must a developer
//! machine (or set `CC` / `CXX`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use kvpush_testkit::neuron_fake::{self, Variant};
use std::time::{Duration, Instant};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The cdylib built with this test: next to the test executable (target/<profile>/deps) or one
/// directory up (target/<profile>).
pub fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("the test executable has a directory");
    let candidates = [deps.join("libkvpush.so"), deps.join("../libkvpush.so")];
    candidates.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| {
        panic!("libkvpush.so not found at {candidates:?}: the crate's cdylib must be built with the tests")
    })
}

/// A fresh directory for `name` holding `files` (the cdylib first): hard links where possible (a
/// rebuild writes a new file, the link keeps the one this run built), copies otherwise. Directories
/// left by earlier runs whose process is gone are removed.
pub fn stage(name: &str, files: &[PathBuf]) -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let prefix = format!("{name}-");
    for entry in std::fs::read_dir(tmp).into_iter().flatten().flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let dir = tmp.join(format!("{prefix}{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the staging directory");
    for f in files {
        let to = dir.join(f.file_name().expect("a file name"));
        if std::fs::hard_link(f, &to).is_err() {
            std::fs::copy(f, &to).unwrap_or_else(|e| panic!("copy {} to {}: {e}", f.display(), to.display()));
        }
    }
    dir
}

/// Runs a compiler command line; panics with its output if it fails or cannot start.
fn compile(mut cmd: Command, what: &str) {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run the compiler `{program}` for {what}: {e} (install gcc and g++, or set CC / CXX)")
    });
    assert!(
        out.status.success(),
        "compiling {what} failed: {cmd:?}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A compiler: the environment variable that names it, the program to use without it, and flags.
struct Compiler {
    var: &'static str,
    default: &'static str,
    flags: &'static [&'static str],
}

/// The C compiler (`$CC`, else `cc`) and the flags every C test program is built with.
const C: Compiler =
    Compiler { var: "CC", default: "cc", flags: &["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-g"] };

/// The C++ compiler (`$CXX`, else `c++`) and the flags every C++ test program is built with.
const CXX: Compiler =
    Compiler { var: "CXX", default: "c++", flags: &["-std=c++17", "-Wall", "-Wextra", "-Werror", "-g", "-pthread"] };

/// Compiles `source` (C for `.c`, else C++) against the headers of `cpp/include` into `dir/name`, linked
/// with the static libraries `archives` (file names in `dir`) and then the `libkvpush.so` that
/// [`stage`] put in `dir` (found there at run time through an rpath). Returns the executable.
/// An archive may be a shared library too (the fake libnrt), linked by its path.
pub fn build(dir: &Path, name: &str, source: &Path, archives: &[&str]) -> PathBuf {
    build_with(dir, name, source, archives, &[])
}

/// [`build`] with `extra` compiler arguments before the source (defines, include directories).
fn build_with(dir: &Path, name: &str, source: &Path, archives: &[&str], extra: &[OsString]) -> PathBuf {
    let compiler = if source.extension().is_some_and(|e| e == "c") { C } else { CXX };
    let exe = dir.join(name);
    let mut cmd = Command::new(tool(compiler.var, compiler.default));
    cmd.args(compiler.flags).arg("-I").arg(root().join("cpp/include")).args(extra).arg(source);
    for a in archives {
        cmd.arg(dir.join(a));
    }
    cmd.arg("-L").arg(dir).arg("-lkvpush").arg(format!("-Wl,-rpath,{}", dir.display())).arg("-o").arg(&exe);
    compile(cmd, &source.display().to_string());
    exe
}

/// Builds `source` with its Neuron mode (`-DKVPUSH_TEST_NEURON`, the fake's `nrt/nrt.h`) into a
/// directory staged as `name` holding `files` and the fake libnrt, linked with `archives` and then
/// the fake (the program plays a framework linked with libnrt). Returns the executable and the
/// fake's staged path, which the program hands kvpush as `KVPUSH_LIBNRT`: one library, one runtime.
pub fn build_neuron(name: &str, source: &str, files: &[PathBuf], archives: &[&str]) -> (PathBuf, PathBuf) {
    static FAKE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let fake = FAKE
        .get_or_init(|| {
            neuron_fake::build(&Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffi-neuron-fake"), Variant::Full)
        })
        .clone();
    let lib = fake.file_name().expect("a file name").to_owned();
    let dir = stage(name, &[files, &[fake]].concat());
    let include = neuron_fake::source_dir().join("include");
    let extra = ["-DKVPUSH_TEST_NEURON".into(), "-I".into(), include.into_os_string()];
    let lib_name = lib.to_str().expect("a UTF-8 name");
    let archives = [archives, &[lib_name]].concat();
    let exe = build_with(&dir, &format!("{name}-test"), &root().join(source), &archives, &extra);
    (exe, dir.join(lib))
}

/// The compiler named by `var` (e.g. `CC`), else `default`.
fn tool(var: &str, default: &str) -> String {
    std::env::var(var).ok().filter(|s| !s.is_empty()).unwrap_or_else(|| default.to_owned())
}

/// Runs `exe args`, killing it after `limit`; returns its output.
pub fn run(exe: &Path, args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", exe.display()));
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait for the test program").is_some() {
            break;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!(
                "{} {args:?} ran past {limit:?}\nstdout:\n{}\nstderr:\n{}",
                exe.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("collect output")
}

/// Runs `exe args` and asserts it succeeded and printed `marker`; returns its stdout.
pub fn run_ok(exe: &Path, args: &[&str], marker: &str) -> String {
    let out = run(exe, args, Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(marker),
        "{} {args:?} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        exe.display(),
        out.status
    );
    print!("{stdout}");
    stdout
}

/// Whether the NIXL tests must run: NIXL loads, or we are under CI (where its absence is a failure).
pub fn nixl_or_skip() -> bool {
    if kvpush::transport::nixl::available() {
        return true;
    }
    let msg = "NIXL is not available: run `. scripts/nixl.sh` first (scripts/test.sh does)";
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{msg}");
    }
    eprintln!("SKIPPED (not under CI): {msg}");
    false
}

/// Runs the test program that `program` builds with the argument `nixl`, as [`run_ok`] does, and
/// returns its stdout; `None` where NIXL is not available (see [`nixl_or_skip`]), without building it.
pub fn run_nixl_ok(program: fn() -> &'static PathBuf, marker: &str) -> Option<String> {
    nixl_or_skip().then(|| run_ok(program(), &["nixl"], marker))
}
