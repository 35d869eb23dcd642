//! The C API from C: compiles `cpp/tests/c_api_test.c` with the system C compiler (`cc`, or `$CC`,
//! with `-Wall -Wextra -Werror -pedantic`) against the `libkvpush.so` built for this test run, and
//! runs it: push and pull transfers between a producer and a consumer in one process over the
//! loopback transport with every byte verified, aborts, and every error path the header promises
//! (bad layouts, null and non-UTF-8 arguments, unknown handles, incompatible peers); the same push
//! over real NIXL and the TCP side channel; and push and pull between engines whose regions are
//! framework memory of the fake libnrt (tests/neuron_fake), every byte verified.
//!
//! The ABI checks take the header as their oracle: they read every struct and every status code of
//! `cpp/include/kvpush.h`, compile a generated C program that prints each struct's size and each
//! field's offset and size, and compare with what Rust says of the same names (field lists written
//! out here, or, for the structs of `u64` counters, taken from serde). A field missing on one side,
//! misnamed or misplaced fails.

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::PathBuf;
use std::sync::OnceLock;

use kvpush::ffi::capi::{
    kvpush_block_list, kvpush_completion, kvpush_counters, kvpush_engine_config, kvpush_failures, kvpush_key,
    kvpush_kv_group, kvpush_latency, kvpush_layout, kvpush_stats, kvpush_status_name,
};
use kvpush::ffi::status;
use serde::Serialize;

use crate::ffi_support;
use ffi_support::{build, build_neuron, cdylib, root, run_nixl_ok, run_ok, stage};

/// The test program, built once per test binary.
fn program() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let dir = stage("ffi-c", &[cdylib()]);
        build(&dir, "c_api_test", &root().join("cpp/tests/c_api_test.c"), &[])
    })
}

#[test]
fn loopback_push_pull_aborts_and_error_paths() {
    let out = run_ok(program(), &["loopback"], "all C API checks passed");
    assert!(out.contains("push ok: 6 requests"), "{out}");
    assert!(out.contains("pull ok:"), "{out}");
    assert_eq!(out.matches("error ok: KVPUSH_ERR_LAYOUT").count(), 4, "{out}");
    assert!(out.contains("error ok: KVPUSH_ERR_INCOMPATIBLE"), "{out}");
}

#[test]
fn nixl_push_through_the_side_channel() {
    let Some(out) = run_nixl_ok(program, "all NIXL checks passed") else { return };
    assert!(out.contains("push ok: 4 requests"), "{out}");
}

/// The test program built with its Neuron mode and linked with the fake libnrt, and the library.
fn neuron_program() -> &'static (PathBuf, PathBuf) {
    static EXE: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    EXE.get_or_init(|| build_neuron("ffi-c-neuron", "cpp/tests/c_api_test.c", &[cdylib()], &[]))
}

/// Framework memory through the C API: the program starts the (fake) Neuron runtime and allocates
/// every KV region as a device tensor, as vllm-neuron does; kvpush, attached to that runtime, must
/// accept the regions by their addresses alone, move every byte by push and by pull, and refuse
/// host memory, a freed tensor, and owning a runtime the framework started.
#[test]
fn neuron_framework_memory_push_and_pull() {
    let (exe, lib) = neuron_program();
    let out = run_ok(exe, &["neuron", lib.to_str().unwrap()], "all C API Neuron checks passed");
    assert!(out.contains("push ok: 6 requests"), "{out}");
    assert!(out.contains("pull ok:"), "{out}");
    assert_eq!(out.matches("error ok: KVPUSH_ERR_DEVICE").count(), 3, "{out}");
    // Neuron P, host-memory D (Trainium P -> GPU D's shape through host memory): every byte on D.
    assert!(out.contains("push ok: 4 requests") && out.contains("mixed ok: Neuron P, host D"), "{out}");
}

#[test]
fn bench_mode_measures_every_request() {
    // A short run of the engine-thread bench (docs/benchmarks.md has the full one): each request
    // must finish (the program checks every outcome) and every figure must be printed.
    let out = run_ok(program(), &["bench", "50"], "bench done");
    for line in ["producer (request_finished + polls)", "consumer (blocks_allocated + polls)", "empty poll"] {
        assert!(out.contains(line), "{line} missing: {out}");
    }
}

/// One field of a struct: name, offset, size.
type Field = (String, usize, usize);

/// A struct's size and its fields in the order of their offsets.
type Layout = (usize, Vec<Field>);

/// The header's text without its comments.
fn header() -> String {
    let path = root().join("cpp/include/kvpush.h");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut out = String::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("/*") {
        out.push_str(&rest[..at]);
        let end = rest[at..].find("*/").expect("kvpush.h: a comment is not closed");
        rest = &rest[at + end + 2..];
    }
    out.push_str(rest);
    out
}

fn is_ident(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The body of `typedef <kind> NAME { BODY } NAME;` for each such definition in `h`, in order;
/// opaque declarations (`typedef struct NAME NAME;`) are passed over.
fn typedefs<'h>(h: &'h str, kind: &str) -> Vec<(&'h str, &'h str)> {
    let intro = format!("typedef {kind} ");
    let mut out = Vec::new();
    let mut rest = h;
    while let Some(at) = rest.find(&intro) {
        rest = &rest[at + intro.len()..];
        let open = match (rest.find('{'), rest.find(';')) {
            (Some(open), Some(semi)) if open < semi => open,
            _ => continue,
        };
        let name = rest[..open].trim();
        let close = rest.find('}').expect("kvpush.h: a body is not closed");
        let body = &rest[open + 1..close];
        assert!(is_ident(name) && !body.contains('{'), "kvpush.h: cannot read `typedef {kind} {name} {{`");
        let alias = rest[close + 1..].split(';').next().unwrap_or_default().trim();
        assert_eq!(alias, name, "kvpush.h: `typedef {kind} {name} {{ ... }}` names another type");
        out.push((name, body));
        rest = &rest[close..];
    }
    out
}

/// The field names of a struct body in the header's style: `TYPE a, b; const TYPE *p; TYPE c[N];`.
fn field_names(body: &str) -> Vec<String> {
    let mut names = Vec::new();
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        for (i, declarator) in decl.split(',').enumerate() {
            let d = declarator.split('[').next().unwrap_or_default().trim_end();
            // The first declarator follows the type: its name is the last word.
            let name =
                if i == 0 { d.rsplit([' ', '*']).next().unwrap_or_default() } else { d.trim_start_matches([' ', '*']) };
            assert!(is_ident(name), "kvpush.h: cannot read the field `{declarator}` in `{decl}`");
            names.push(name.to_owned());
        }
    }
    names
}

/// Every struct of kvpush.h as the C compiler lays it out: a C program generated from the header's
/// own definitions prints the size of each struct and the offset and size of each of its fields.
fn c_layouts() -> Vec<(String, Layout)> {
    let h = header();
    let structs: Vec<(&str, Vec<String>)> =
        typedefs(&h, "struct").into_iter().map(|(n, b)| (n, field_names(b))).collect();
    let mut c = String::from("#include <stddef.h>\n#include <stdio.h>\n\n#include \"kvpush.h\"\n\nint main(void) {\n");
    for (s, fields) in &structs {
        writeln!(c, "  printf(\"{s} - %zu 0\\n\", sizeof({s}));").expect("write");
        for f in fields {
            writeln!(c, "  printf(\"{s} {f} %zu %zu\\n\", offsetof({s}, {f}), sizeof((({s} *)0)->{f}));")
                .expect("write");
        }
    }
    c.push_str("  return 0;\n}\n");
    let dir = stage("ffi-abi", &[cdylib()]);
    let source = dir.join("abi.c");
    std::fs::write(&source, &c).expect("write abi.c");
    let out = run_ok(&build(&dir, "abi", &source, &[]), &[], " - ");
    let mut layouts: Vec<(String, Layout)> = structs.iter().map(|(s, _)| (s.to_string(), (0, Vec::new()))).collect();
    for line in out.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let (a, b) = (w[2].parse().expect("a number"), w[3].parse().expect("a number"));
        let layout = &mut layouts.iter_mut().find(|(s, _)| s == w[0]).expect("a struct of the header").1;
        if w[1] == "-" {
            layout.0 = a;
        } else {
            layout.1.push((w[1].to_owned(), a, b));
        }
    }
    layouts
}

fn size_of_field<T, F>(_: impl Fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// The size of `#[repr(C)]` struct `T` and the name, offset and size of each field listed. The
/// pattern `T { a: _, b: _ }` makes the list complete: it does not compile if `T` has a field that
/// is not listed.
macro_rules! fields {
    ($t:ident { $($f:ident),+ $(,)? }) => {{
        let _complete = |v: &$t| {
            let $t { $($f: _),+ } = v;
        };
        (size_of::<$t>(), vec![$((stringify!($f).to_owned(), offset_of!($t, $f), size_of_field(|v: &$t| &v.$f))),+])
    }};
}

/// The layout of a `#[repr(C)]` struct of `u64`s, with the field names its serde serialization
/// gives: the value whose `i`-th word is `i + 1`, serialized, says which field lies at word `i`.
///
/// # Safety
///
/// 1. Every field of `T` is a `u64` (any bit pattern is a valid `T`).
unsafe fn u64_fields<T: Serialize>() -> Layout {
    let n = size_of::<T>() / 8;
    assert_eq!((size_of::<T>() % 8, align_of::<T>()), (0, 8), "not a struct of u64s");
    let words: Vec<u64> = (1..=n as u64).collect();
    // SAFETY: `words` holds `size_of::<T>()` initialized bytes, read unaligned; they are a valid
    // `T` by the caller's contract (1).
    let value: T = unsafe { words.as_ptr().cast::<T>().read_unaligned() };
    let json = serde_json::to_value(&value).expect("serialize");
    let map = json.as_object().expect("a struct serializes to a JSON object");
    let mut fields: Vec<Field> = map
        .iter()
        .map(|(name, v)| {
            let word = v
                .as_u64()
                .filter(|w| (1..=n as u64).contains(w))
                .unwrap_or_else(|| panic!("field {name} serialized as {v}: not a u64 at one of the {n} words"));
            (name.clone(), (word as usize - 1) * 8, 8)
        })
        .collect();
    fields.sort_by_key(|f| f.1);
    let words_named: BTreeSet<usize> = fields.iter().map(|f| f.1).collect();
    assert_eq!(words_named.len(), n, "{n} words but fields {fields:?}: serde skips or repeats a field");
    (size_of::<T>(), fields)
}

/// Every struct of the C ABI as Rust lays it out. The structs of `u64`s take their field names from
/// serde (which Python and the JSON use too); the others list every field (checked complete).
fn rust_layouts() -> Vec<(String, Layout)> {
    // SAFETY: contract (1): `Counters` and `Failures` (src/engine/stats.rs, whose docs make all-`u64`
    // the rule for new fields) and `kvpush_latency` (src/ffi/capi.rs) have `u64` fields only.
    let (counters, failures, latency) =
        unsafe { (u64_fields::<kvpush_counters>(), u64_fields::<kvpush_failures>(), u64_fields::<kvpush_latency>()) };
    let layouts = [
        ("kvpush_key", fields!(kvpush_key { id_hi, id_lo, attempt })),
        ("kvpush_block_list", fields!(kvpush_block_list { ids, len })),
        ("kvpush_kv_group", fields!(kvpush_kv_group { window_tokens, layers, num_layers })),
        (
            "kvpush_layout",
            fields!(kvpush_layout {
                total_layers,
                kv_heads,
                head_dim,
                dtype,
                kv_kind,
                block_tokens,
                num_blocks,
                order,
                placement,
                tp_rank,
                tp_size,
                pp_rank,
                pp_size,
                block_stride,
                groups,
                num_groups,
                region_bases,
                num_regions,
                region_lens,
            }),
        ),
        (
            "kvpush_engine_config",
            fields!(kvpush_engine_config {
                engine_id,
                mode,
                transport,
                hub,
                device,
                writers,
                lease_ms,
                timeout_ms,
                agent_name,
                nixl_backend,
                listen,
                secret,
            }),
        ),
        ("kvpush_completion", fields!(kvpush_completion { key, outcome, release, message })),
        ("kvpush_counters", counters),
        ("kvpush_failures", failures),
        ("kvpush_latency", latency),
        (
            "kvpush_stats",
            fields!(kvpush_stats {
                counters,
                failures,
                wait_registration_first,
                wait_blocks_first,
                post,
                transfer,
                receive
            }),
        ),
    ];
    layouts
        .into_iter()
        .map(|(name, mut layout)| {
            layout.1.sort_by_key(|f| f.1);
            (name.to_owned(), layout)
        })
        .collect()
}

#[test]
fn c_structs_have_the_rust_layout() {
    let (c, rust) = (c_layouts(), rust_layouts());
    let names = |v: &[(String, Layout)]| v.iter().map(|(n, _)| n.clone()).collect::<BTreeSet<_>>();
    assert_eq!(names(&c), names(&rust), "kvpush.h and Rust define different structs");
    for (name, (size, fields)) in &c {
        let (rust_size, rust_fields) = &rust.iter().find(|(n, _)| n == name).expect("checked above").1;
        assert_eq!(fields, rust_fields, "{name}: the fields (name, offset, size) of C (left) and Rust (right) differ");
        assert_eq!(size, rust_size, "{name}: C and Rust disagree on the size");
        println!("{name}: {size} bytes, {} fields agree", fields.len());
    }
}

#[test]
fn status_names_are_the_headers() {
    let h = header();
    let (_, body) = typedefs(&h, "enum")
        .into_iter()
        .find(|(n, _)| *n == "kvpush_status")
        .expect("kvpush.h defines `typedef enum kvpush_status { ... } kvpush_status;`");
    let mut codes = BTreeSet::new();
    for entry in body.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, value) = entry.split_once('=').unwrap_or_else(|| panic!("kvpush.h: `{entry}` has no value"));
        let (name, code) = (name.trim(), value.trim().parse::<i32>().expect("a status code is a number"));
        assert!(name == "KVPUSH_OK" || name.starts_with("KVPUSH_ERR_"), "kvpush.h: status {name}");
        assert_eq!(status::name(code), name, "status::name({code})");
        // SAFETY: kvpush_status_name returns a static NUL-terminated string for any code.
        let c_name = unsafe { CStr::from_ptr(kvpush_status_name(code)) }.to_str().expect("ASCII");
        assert_eq!(c_name, name, "kvpush_status_name({code})");
        assert!(codes.insert(code), "kvpush.h: status {code} twice");
    }
    // And the other way: every code Rust names is in the header.
    let rust: BTreeSet<i32> = (-16..256).filter(|&c| status::name(c) != status::name(-1)).collect();
    assert_eq!(codes, rust, "status codes of kvpush.h (left) and of kvpush::ffi::status (right)");
    assert!(codes.contains(&status::PANIC), "{codes:?}");
}
