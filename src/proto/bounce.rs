//! Where a transfer's bytes go through host memory: from both workers' memory offers and the mode,
//! one answer — direct, a bounce on P, a bounce on D, or refused — that both sides compute alike.
//!
//! Read [`decide`] first. Each worker's handshake may carry a [`MemoryOffer`]: the kind of memory its
//! KV lives in and which RDMA operations its NIC performs on that memory and on host memory
//! ([`RdmaOps`]). A transfer moves device to device only when the mode's operation reaches both
//! memories (push: P initiates a WRITE of its memory into D's; pull: D initiates a READ of P's memory
//! into its own). Otherwise one side stages through a bounded ring of host slots — the side whose
//! device memory the operation cannot reach — and a pair that cannot move bytes even so is refused
//! at the handshake, naming both offers (docs/deployment.md §4, "Trainium P → GPU D").
//!
//! A handshake without an offer (an older peer, or a worker that was not told about its NIC) reads as
//! [`MemoryOffer::DIRECT_ONLY`]: its NIC performs every operation on its memory, and it runs no bounce
//! of its own. Like all of `proto`, this does no I/O and reads no clock.

use core::fmt;

use serde::{Deserialize, Serialize};

use super::msg::Mode;

/// The kind of memory a worker's KV cache lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Host DRAM.
    Host,
    /// NVIDIA GPU memory.
    Cuda,
    /// AWS Neuron device memory (HBM).
    Neuron,
    /// Not said (a handshake without an offer).
    Unknown,
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
            MemoryKind::Neuron => "neuron",
            MemoryKind::Unknown => "unknown",
        })
    }
}

/// The RDMA operations a worker's NIC performs on one kind of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RdmaOps {
    /// It initiates a WRITE whose source is this memory.
    pub write: bool,
    /// It initiates a READ whose destination is this memory.
    pub read: bool,
    /// This memory may be the target of a peer's WRITE or READ.
    pub target: bool,
}

impl RdmaOps {
    /// Every operation.
    pub const ALL: RdmaOps = RdmaOps { write: true, read: true, target: true };
    /// No operation.
    pub const NONE: RdmaOps = RdmaOps { write: false, read: false, target: false };
}

impl fmt::Display for RdmaOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [(self.write, "write"), (self.read, "read"), (self.target, "target")]
            .iter()
            .filter_map(|&(on, name)| on.then_some(name))
            .collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join("+"))
        }
    }
}

/// What one worker says about its memory in its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryOffer {
    /// Where the KV cache lives.
    pub kind: MemoryKind,
    /// What the NIC performs on that memory (for [`MemoryKind::Host`], the same as `host`).
    pub device: RdmaOps,
    /// What the NIC performs on host memory: what a bounce through this worker's host ring uses.
    pub host: RdmaOps,
}

impl MemoryOffer {
    /// What a handshake without an offer reads as: every operation reaches the memory, and the
    /// worker runs no bounce (it never needs one).
    pub const DIRECT_ONLY: MemoryOffer =
        MemoryOffer { kind: MemoryKind::Unknown, device: RdmaOps::ALL, host: RdmaOps::ALL };

    /// The offer a handshake carries, or [`MemoryOffer::DIRECT_ONLY`] where it carries none.
    pub fn or_direct(offer: Option<&MemoryOffer>) -> MemoryOffer {
        offer.copied().unwrap_or(MemoryOffer::DIRECT_ONLY)
    }
}

/// A memory offer's text that [`MemoryOffer::parse`] refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("memory offer {text:?}: {why} (expected KIND[,device=OPS][,host=OPS] with KIND host, cuda or neuron and OPS all, none or write+read+target)")]
pub struct ParseOfferError {
    /// The text given.
    pub text: String,
    /// What is wrong with it.
    pub why: String,
}

impl RdmaOps {
    /// Parses `all`, `none`, or operation names joined by `+` (`write`, `read`, `target`).
    fn parse(s: &str) -> Option<RdmaOps> {
        match s {
            "all" => return Some(RdmaOps::ALL),
            "none" => return Some(RdmaOps::NONE),
            _ => {}
        }
        let mut ops = RdmaOps::NONE;
        for name in s.split('+') {
            match name {
                "write" if !ops.write => ops.write = true,
                "read" if !ops.read => ops.read = true,
                "target" if !ops.target => ops.target = true,
                _ => return None,
            }
        }
        Some(ops)
    }
}

impl MemoryOffer {
    /// Parses an offer as an operator writes it: `KIND[,device=OPS][,host=OPS]`, e.g.
    /// `neuron,device=none` (a NIC that reaches no Neuron memory: every WRITE goes through host
    /// slots) or `cuda,device=target` (a GPU the peer may write into but this NIC cannot read).
    /// What is not said is `all`; for `host` memory `device` and `host` are the same and must agree.
    pub fn parse(text: &str) -> Result<MemoryOffer, ParseOfferError> {
        let bad = |why: &str| ParseOfferError { text: text.to_owned(), why: why.to_owned() };
        let lower = text.trim().to_ascii_lowercase();
        let mut parts = lower.split(',').map(str::trim);
        let kind = match parts.next().unwrap_or_default() {
            "host" => MemoryKind::Host,
            "cuda" => MemoryKind::Cuda,
            "neuron" => MemoryKind::Neuron,
            other => return Err(bad(&format!("unknown memory kind {other:?}"))),
        };
        let (mut device, mut host) = (None, None);
        for part in parts {
            let (name, value) = part.split_once('=').ok_or_else(|| bad(&format!("{part:?} is not NAME=OPS")))?;
            let ops = RdmaOps::parse(value.trim()).ok_or_else(|| bad(&format!("unknown operations {value:?}")))?;
            let slot = match name.trim() {
                "device" => &mut device,
                "host" => &mut host,
                other => return Err(bad(&format!("unknown field {other:?}"))),
            };
            if slot.replace(ops).is_some() {
                return Err(bad(&format!("{name} given twice")));
            }
        }
        let (device, host) = (device.unwrap_or(RdmaOps::ALL), host.unwrap_or(RdmaOps::ALL));
        if kind == MemoryKind::Host && device != host {
            return Err(bad("host memory's device and host operations differ"));
        }
        Ok(MemoryOffer { kind, device, host })
    }
}

impl fmt::Display for MemoryOffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == MemoryOffer::DIRECT_ONLY {
            return f.write_str("no offer (direct only)");
        }
        write!(f, "{} memory, NIC on it: {}, on host memory: {}", self.kind, self.device, self.host)
    }
}

/// Which side stages through host memory, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// The mode's own operation reaches both memories: no staging.
    Direct,
    /// P copies its KV into host slots; the operation moves the slots.
    BounceOnP,
    /// The operation moves bytes into (push) or out of (pull) D's host slots; D copies them to and
    /// from its KV.
    BounceOnD,
    /// No way to move bytes with a bounce on at most one side.
    Refused(Refusal),
}

/// Why a pair cannot move bytes: both offers and the missing operations, for an operator.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{mode} from P ({p}) to D ({d}) cannot move bytes: {why}")]
pub struct Refusal {
    /// The mode.
    pub mode: Mode,
    /// P's offer.
    pub p: MemoryOffer,
    /// D's offer.
    pub d: MemoryOffer,
    /// What is missing.
    pub why: String,
}

/// Whether a NIC's operations on a memory serve one side of a transfer.
pub type Serves = fn(&RdmaOps) -> bool;

/// What the mode needs of P's NIC and of D's on the memory they move: push, P initiates a WRITE
/// from it and D's is its target; pull, P's is the target of a READ that D initiates into its own.
pub fn needs(mode: Mode) -> (Serves, Serves) {
    match mode {
        Mode::Push => (|o| o.write, |o| o.target),
        Mode::Pull => (|o| o.target, |o| o.read),
    }
}

/// The route for `mode` between P's offer and D's (`None`: the handshake carried none). Both sides
/// call this with the same arguments (P's offer first whichever side runs it) and get the same answer.
///
/// 1. the mode's operation reaches both device memories: [`Route::Direct`];
/// 2. else the bounce goes on the side whose device memory the operation cannot reach, if the
///    operation reaches that side's host memory and the other side's device memory;
/// 3. else (neither device memory reachable, or host memory not reachable either):
///    [`Route::Refused`], naming both offers. A side without an offer never needs a bounce (its
///    memory reads as reachable by every operation), so it is never asked to run one.
pub fn decide(mode: Mode, p: Option<&MemoryOffer>, d: Option<&MemoryOffer>) -> Route {
    let (po, dof) = (MemoryOffer::or_direct(p), MemoryOffer::or_direct(d));
    let (p_side, d_side) = needs(mode);
    let (op, p_role, d_role) = match mode {
        Mode::Push => ("WRITE", "initiate a WRITE from", "be the target of a WRITE into"),
        Mode::Pull => ("READ", "be the target of a READ from", "initiate a READ into"),
    };
    let (p_dev, d_dev) = (p_side(&po.device), d_side(&dof.device));
    let refuse = |why: String| Route::Refused(Refusal { mode, p: po, d: dof, why });
    match (p_dev, d_dev) {
        (true, true) => Route::Direct,
        (false, true) if p_side(&po.host) => Route::BounceOnP,
        (false, true) => refuse(format!("P's NIC can {p_role} neither its {} memory nor its host memory", po.kind)),
        (true, false) if d_side(&dof.host) => Route::BounceOnD,
        (true, false) => refuse(format!("D's NIC can {d_role} neither its {} memory nor its host memory", dof.kind)),
        (false, false) => refuse(format!(
            "the {op} reaches neither P's {} memory nor D's {} memory, and a bounce on both sides is not built",
            po.kind, dof.kind
        )),
    }
}

/// [`decide`], less what kvpush does not run: a bounce moves WRITEs only (the staged transport), so
/// a pull that needs one is refused too. What the engine checks at the handshake.
pub fn decide_built(mode: Mode, p: Option<&MemoryOffer>, d: Option<&MemoryOffer>) -> Route {
    match decide(mode, p, d) {
        Route::BounceOnP | Route::BounceOnD if mode == Mode::Pull => Route::Refused(Refusal {
            mode,
            p: MemoryOffer::or_direct(p),
            d: MemoryOffer::or_direct(d),
            why: "only a host bounce would move the bytes, and kvpush bounces push WRITEs only (not pull READs)"
                .to_owned(),
        }),
        route => route,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_parse_as_operators_write_them_and_bad_ones_say_why() {
        let neuron = MemoryOffer::parse("neuron,device=none").expect("parses");
        assert_eq!(neuron, MemoryOffer { kind: MemoryKind::Neuron, device: RdmaOps::NONE, host: RdmaOps::ALL });
        let cuda = MemoryOffer::parse(" CUDA , device=target, host=write+read+target ").expect("parses");
        let target_only = RdmaOps { write: false, read: false, target: true };
        assert_eq!(cuda, MemoryOffer { kind: MemoryKind::Cuda, device: target_only, host: RdmaOps::ALL });
        assert_eq!(MemoryOffer::parse("host").expect("parses").device, RdmaOps::ALL);
        for (text, why) in [
            ("tpu", "unknown memory kind"),
            ("neuron,device", "is not NAME=OPS"),
            ("neuron,device=fly", "unknown operations"),
            ("neuron,device=write+write", "unknown operations"),
            ("neuron,nic=all", "unknown field"),
            ("neuron,device=none,device=all", "given twice"),
            ("host,device=none", "differ"),
        ] {
            let e = MemoryOffer::parse(text).expect_err(text);
            assert!(e.to_string().contains(why), "{text}: {e}");
        }
    }

    const NO_WRITE: RdmaOps = RdmaOps { write: false, ..RdmaOps::ALL };
    const NO_READ: RdmaOps = RdmaOps { read: false, ..RdmaOps::ALL };
    const NO_TARGET: RdmaOps = RdmaOps { target: false, ..RdmaOps::ALL };

    fn offer(kind: MemoryKind, device: RdmaOps) -> MemoryOffer {
        MemoryOffer { kind, device, host: RdmaOps::ALL }
    }

    fn refusal(r: Route) -> Refusal {
        match r {
            Route::Refused(why) => why,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn both_memories_reachable_is_direct() {
        let (n, c) = (offer(MemoryKind::Neuron, RdmaOps::ALL), offer(MemoryKind::Cuda, RdmaOps::ALL));
        for mode in [Mode::Push, Mode::Pull] {
            assert_eq!(decide(mode, Some(&n), Some(&c)), Route::Direct);
            assert_eq!(decide(mode, None, None), Route::Direct, "older peers on both sides: as today");
            assert_eq!(decide(mode, Some(&n), None), Route::Direct);
        }
        // Push needs only P's WRITE and D's target; pull only D's READ and P's target.
        let p = offer(MemoryKind::Neuron, RdmaOps { write: true, read: false, target: false });
        let d = offer(MemoryKind::Cuda, RdmaOps { write: false, read: false, target: true });
        assert_eq!(decide(Mode::Push, Some(&p), Some(&d)), Route::Direct);
        assert!(matches!(decide(Mode::Pull, Some(&p), Some(&d)), Route::Refused(_)));
    }

    #[test]
    fn the_bounce_goes_where_the_device_memory_is_unreachable() {
        let trn = offer(MemoryKind::Neuron, NO_WRITE);
        let gpu = offer(MemoryKind::Cuda, RdmaOps::ALL);
        assert_eq!(decide(Mode::Push, Some(&trn), Some(&gpu)), Route::BounceOnP, "P's NIC cannot read Neuron");
        assert_eq!(decide(Mode::Push, Some(&trn), None), Route::BounceOnP, "D an older peer");
        let trn = offer(MemoryKind::Neuron, RdmaOps::ALL);
        let gpu = offer(MemoryKind::Cuda, NO_TARGET);
        assert_eq!(decide(Mode::Push, Some(&trn), Some(&gpu)), Route::BounceOnD, "D's NIC cannot write CUDA");
        // Pull: D READs P's memory.
        let trn = offer(MemoryKind::Neuron, NO_TARGET);
        assert_eq!(decide(Mode::Pull, Some(&trn), Some(&offer(MemoryKind::Cuda, RdmaOps::ALL))), Route::BounceOnP);
        let gpu = offer(MemoryKind::Cuda, NO_READ);
        assert_eq!(decide(Mode::Pull, Some(&offer(MemoryKind::Neuron, RdmaOps::ALL)), Some(&gpu)), Route::BounceOnD);
    }

    #[test]
    fn pairs_that_cannot_move_bytes_are_refused_naming_both_offers() {
        // Neither device memory reachable: one bounce is not enough.
        let trn = offer(MemoryKind::Neuron, NO_WRITE);
        let gpu = offer(MemoryKind::Cuda, NO_TARGET);
        let r = refusal(decide(Mode::Push, Some(&trn), Some(&gpu)));
        let text = r.to_string();
        assert!(text.contains("neuron memory, NIC on it: read+target"), "{text}");
        assert!(text.contains("cuda memory, NIC on it: write+read"), "{text}");
        assert!(text.contains("neither P's neuron memory nor D's cuda memory"), "{text}");
        // The bouncing side's NIC cannot use host memory either.
        let trn = MemoryOffer { kind: MemoryKind::Neuron, device: NO_WRITE, host: NO_WRITE };
        let text = refusal(decide(Mode::Push, Some(&trn), None)).to_string();
        assert!(text.contains("neither its neuron memory nor its host memory"), "{text}");
        assert!(text.contains("D (no offer (direct only))"), "{text}");
        let gpu = MemoryOffer { kind: MemoryKind::Cuda, device: NO_TARGET, host: RdmaOps::NONE };
        let text = refusal(decide(Mode::Push, None, Some(&gpu))).to_string();
        assert!(text.contains("D's NIC can be the target of a WRITE into neither"), "{text}");
        assert!(text.contains("on host memory: none"), "{text}");
    }

    #[test]
    fn a_pull_that_needs_a_bounce_is_not_built() {
        let trn = offer(MemoryKind::Neuron, NO_TARGET);
        assert_eq!(decide(Mode::Pull, Some(&trn), None), Route::BounceOnP);
        let text = refusal(decide_built(Mode::Pull, Some(&trn), None)).to_string();
        assert!(text.contains("pull from P (neuron memory, NIC on it: write+read"), "{text}");
        assert!(text.contains("push WRITEs only"), "{text}");
        let trn = offer(MemoryKind::Neuron, NO_WRITE);
        assert_eq!(decide_built(Mode::Push, Some(&trn), None), Route::BounceOnP, "push bounces are built");
        assert_eq!(decide_built(Mode::Pull, Some(&trn), None), Route::Direct, "pull needs no WRITE from P");
    }

    /// Every combination of offers: the answer follows the rules, and a bounce's own path works.
    #[test]
    fn every_combination_follows_the_rules() {
        let all_ops: Vec<RdmaOps> =
            (0u8..8).map(|b| RdmaOps { write: b & 1 != 0, read: b & 2 != 0, target: b & 4 != 0 }).collect();
        let mut offers: Vec<Option<MemoryOffer>> = vec![None];
        for &device in &all_ops {
            for &host in &all_ops {
                offers.push(Some(MemoryOffer { kind: MemoryKind::Neuron, device, host }));
            }
        }
        let mut seen = [0usize; 4];
        for mode in [Mode::Push, Mode::Pull] {
            for p in &offers {
                for d in &offers {
                    let (po, dof) = (MemoryOffer::or_direct(p.as_ref()), MemoryOffer::or_direct(d.as_ref()));
                    let (pf, df) = needs(mode);
                    let route = decide(mode, p.as_ref(), d.as_ref());
                    match &route {
                        Route::Direct => {
                            seen[0] += 1;
                            assert!(pf(&po.device) && df(&dof.device));
                        }
                        Route::BounceOnP => {
                            seen[1] += 1;
                            assert!(p.is_some() && !pf(&po.device) && pf(&po.host) && df(&dof.device));
                        }
                        Route::BounceOnD => {
                            seen[2] += 1;
                            assert!(d.is_some() && !df(&dof.device) && df(&dof.host) && pf(&po.device));
                        }
                        Route::Refused(r) => {
                            seen[3] += 1;
                            assert_eq!((r.p, r.d, r.mode), (po, dof, mode));
                            let p_bounce = p.is_some() && pf(&po.host) && df(&dof.device);
                            let d_bounce = d.is_some() && df(&dof.host) && pf(&po.device);
                            let direct = pf(&po.device) && df(&dof.device);
                            assert!(!(direct || p_bounce || d_bounce), "{r}");
                        }
                    }
                    assert_eq!(route, decide(mode, p.as_ref(), d.as_ref()), "deterministic");
                }
            }
        }
        assert!(seen.iter().all(|&n| n > 0), "every route occurs: {seen:?}");
    }
}
