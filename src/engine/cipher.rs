//! The side channel's AEAD under snow: AES-256-GCM with its key schedule built once per key, and
//! the check that this CPU runs AES-GCM in hardware.
//!
//! Read [`resolver`]. snow 0.10's own AES-GCM (`CipherAesGcm` in its default resolver) keeps the
//! raw key and builds an `aes_gcm::Aes256Gcm` for every record it seals or opens: the AES-256 key
//! expansion, GHASH's key (one AES block) and the run-time CPU detection, each time. [`KeptAesGcm`]
//! builds it when snow sets a key (during the handshake, then once per direction for the session)
//! and seals and opens every record with that one. The records are the same bytes (the same
//! primitive, nonce layout and tag place; a session with snow's own cipher on one end and this one on
//! the other checks it). X25519, BLAKE2s and the random source are snow's default resolver's.
//!
//! [`warn_if_software_aes`] warns once per process when the CPU lacks the instructions RustCrypto's
//! hardware backends need: AES-GCM then runs in constant-time software, about ten times slower per
//! frame (docs/security.md, "The AEAD").
//!
//! What it must never do: change a byte on the wire (a peer with snow's own cipher must read it), or
//! panic on a record from a peer (a short or forged record is `snow::Error::Decrypt`).

use aes_gcm::aead::AeadInPlace;
use aes_gcm::{Aes256Gcm, Key, KeyInit};
use snow::params::{CipherChoice, DHChoice, HashChoice};
use snow::resolvers::{BoxedCryptoResolver, CryptoResolver, DefaultResolver};
use snow::types::{Cipher, Dh, Hash, Random};

/// AES-GCM's tag.
const TAG_LEN: usize = 16;

/// snow's resolver for the side channel: snow's default one, with [`KeptAesGcm`] for AES-GCM.
/// `snow::Builder::with_resolver(params, resolver())` in place of `snow::Builder::new(params)`.
#[doc(hidden)]
pub fn resolver() -> BoxedCryptoResolver {
    Box::new(Resolver)
}

struct Resolver;

impl CryptoResolver for Resolver {
    fn resolve_rng(&self) -> Option<Box<dyn Random>> {
        DefaultResolver.resolve_rng()
    }

    fn resolve_dh(&self, choice: &DHChoice) -> Option<Box<dyn Dh>> {
        DefaultResolver.resolve_dh(choice)
    }

    fn resolve_hash(&self, choice: &HashChoice) -> Option<Box<dyn Hash>> {
        DefaultResolver.resolve_hash(choice)
    }

    fn resolve_cipher(&self, choice: &CipherChoice) -> Option<Box<dyn Cipher>> {
        match choice {
            CipherChoice::AESGCM => Some(Box::new(KeptAesGcm::default())),
            _ => DefaultResolver.resolve_cipher(choice),
        }
    }
}

/// AES-256-GCM as Noise uses it (a 96-bit nonce of four zero bytes and the 64-bit counter, big
/// endian; the tag after the ciphertext), with the cipher built once per key.
struct KeptAesGcm {
    aead: Aes256Gcm,
}

impl Default for KeptAesGcm {
    /// The all-zero key, as snow's own cipher starts (snow sets a key before it seals anything).
    fn default() -> Self {
        KeptAesGcm { aead: Aes256Gcm::new(&Key::<Aes256Gcm>::default()) }
    }
}

fn noise_nonce(n: u64) -> aes_gcm::Nonce<aes_gcm::aead::consts::U12> {
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&n.to_be_bytes());
    nonce.into()
}

impl Cipher for KeptAesGcm {
    fn name(&self) -> &'static str {
        "AESGCM"
    }

    fn set(&mut self, key: &[u8; 32]) {
        self.aead = Aes256Gcm::new(&(*key).into());
    }

    fn encrypt(&self, nonce: u64, authtext: &[u8], plaintext: &[u8], out: &mut [u8]) -> usize {
        // snow checks that `out` has room for the plaintext and the tag before it calls a cipher
        // (`TransportState::write_message`, `HandshakeState::write_message`): its own ciphers index
        // `out` the same way.
        let (body, tag) = out[..plaintext.len() + TAG_LEN].split_at_mut(plaintext.len());
        body.copy_from_slice(plaintext);
        // `encrypt_in_place_detached` fails only for a plaintext over 2^36 bytes; snow's messages
        // are at most 65,535.
        let t = self
            .aead
            .encrypt_in_place_detached(&noise_nonce(nonce), authtext, body)
            .expect("a Noise message is far below AES-GCM's length limit");
        tag.copy_from_slice(&t);
        plaintext.len() + TAG_LEN
    }

    fn decrypt(&self, nonce: u64, authtext: &[u8], ciphertext: &[u8], out: &mut [u8]) -> Result<usize, snow::Error> {
        // snow checks both lengths before it calls; checked again so that no record can panic here.
        let len = ciphertext.len().checked_sub(TAG_LEN).ok_or(snow::Error::Decrypt)?;
        let body = out.get_mut(..len).ok_or(snow::Error::Decrypt)?;
        let (sealed, tag) = ciphertext.split_at(len);
        body.copy_from_slice(sealed);
        self.aead
            .decrypt_in_place_detached(&noise_nonce(nonce), authtext, body, tag.into())
            .map(|()| len)
            .map_err(|_| snow::Error::Decrypt)
    }
}

/// The instructions RustCrypto's AES-GCM needs for its hardware backends that this CPU (or this
/// build) lacks, named as `/proc/cpuinfo` names them; empty when it has them all.
pub fn missing_aes_instructions() -> Vec<&'static str> {
    let mut missing = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if !std::arch::is_x86_feature_detected!("aes") {
            missing.push("aes");
        }
        if !std::arch::is_x86_feature_detected!("pclmulqdq") {
            missing.push("pclmulqdq");
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // RustCrypto uses them only when built with `--cfg aes_armv8 --cfg polyval_armv8`
        // (.cargo/config.toml sets both for aarch64).
        if !std::arch::is_aarch64_feature_detected!("aes") || !cfg!(aes_armv8) {
            missing.push("aes");
        }
        if !std::arch::is_aarch64_feature_detected!("pmull") || !cfg!(polyval_armv8) {
            missing.push("pmull");
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        missing.push("aes");
    }
    missing
}

/// The warning for a CPU that lacks `missing` (see [`missing_aes_instructions`]); `None` when
/// nothing is missing.
fn software_aes_warning(missing: &[&str]) -> Option<String> {
    if missing.is_empty() {
        return None;
    }
    Some(format!(
        "this CPU has no {} instructions (or this build does not use them): the side channel's AES-256-GCM runs in constant-time software, about 10x slower per control frame (4.5 µs instead of 0.4 µs to seal a small registration); docs/security.md, \"The AEAD\"",
        missing.join(" or ")
    ))
}

/// Warns once per process when AES-GCM runs in software on this CPU (called where a side channel
/// starts).
pub(crate) fn warn_if_software_aes() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let missing = missing_aes_instructions();
        if let Some(warning) = software_aes_warning(&missing) {
            tracing::warn!(missing = ?missing, "{warning}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: &str = "Noise_NNpsk0_25519_AESGCM_BLAKE2s";

    /// A session between an initiator and a responder built with the given resolvers, handshaken.
    fn pair(i: BoxedCryptoResolver, r: BoxedCryptoResolver) -> (snow::TransportState, snow::TransportState) {
        let psk = [9u8; 32];
        let build = |res| snow::Builder::with_resolver(PARAMS.parse().expect("params"), res).psk(0, &psk).expect("psk");
        let mut i = build(i).build_initiator().expect("initiator");
        let mut r = build(r).build_responder().expect("responder");
        let (mut m, mut p) = ([0u8; 256], [0u8; 256]);
        let n = i.write_message(b"hello", &mut m).expect("msg 1");
        assert_eq!(r.read_message(&m[..n], &mut p), Ok(5));
        let n = r.write_message(b"again", &mut m).expect("msg 2");
        assert_eq!(i.read_message(&m[..n], &mut p), Ok(5));
        (i.into_transport_mode().expect("transport"), r.into_transport_mode().expect("transport"))
    }

    fn default_resolver() -> BoxedCryptoResolver {
        Box::new(DefaultResolver)
    }

    #[test]
    fn records_are_what_snows_own_aes_gcm_seals_and_opens() {
        // Ours against ours, and ours against snow's own on either end: every record of either
        // size, each way, opens to what was sealed; and both implementations seal the same bytes.
        for (mine, theirs) in
            [(resolver(), default_resolver()), (default_resolver(), resolver()), (resolver(), resolver())]
        {
            let (mut i, mut r) = pair(mine, theirs);
            for len in [0usize, 1, 15, 16, 17, 1098, 65_535 - TAG_LEN] {
                let plain: Vec<u8> = (0..len).map(|k| (k * 7 + len) as u8).collect();
                let mut sealed = vec![0u8; len + TAG_LEN];
                let mut opened = vec![0u8; len];
                let n = i.write_message(&plain, &mut sealed).expect("seals");
                assert_eq!(r.read_message(&sealed[..n], &mut opened), Ok(len));
                assert_eq!(opened, plain);
                let n = r.write_message(&plain, &mut sealed).expect("seals");
                assert_eq!(i.read_message(&sealed[..n], &mut opened), Ok(len));
                assert_eq!(opened, plain);
            }
        }
        // The same key, nonce and plaintext through both ciphers: the same record.
        let mut mine = resolver().resolve_cipher(&CipherChoice::AESGCM).expect("AES-GCM");
        let mut theirs = DefaultResolver.resolve_cipher(&CipherChoice::AESGCM).expect("AES-GCM");
        let key = [0x5a; 32];
        mine.set(&key);
        theirs.set(&key);
        let plain = [0xc3u8; 1098];
        let (mut a, mut b) = (vec![0u8; 1098 + TAG_LEN], vec![0u8; 1098 + TAG_LEN]);
        assert_eq!(mine.encrypt(42, b"ad", &plain, &mut a), 1098 + TAG_LEN);
        assert_eq!(theirs.encrypt(42, b"ad", &plain, &mut b), 1098 + TAG_LEN);
        assert_eq!(a, b);
        // Rekeyed (Noise's default rekey: encrypt under nonce 2^64 − 1, then set), still equal.
        mine.rekey();
        theirs.rekey();
        assert_eq!(mine.encrypt(0, &[], &plain, &mut a), theirs.encrypt(0, &[], &plain, &mut b));
        assert_eq!(a, b);
    }

    #[test]
    fn forged_short_and_misplaced_records_are_refused_without_a_panic() {
        let mut c = KeptAesGcm::default();
        c.set(&[1; 32]);
        let plain = [7u8; 40];
        let mut sealed = [0u8; 40 + TAG_LEN];
        c.encrypt(3, &[], &plain, &mut sealed);
        let mut out = [0u8; 64];
        assert_eq!(c.decrypt(3, &[], &sealed, &mut out), Ok(40));
        // Another nonce, other associated data, a flipped bit, a short record, no room to open into.
        assert_eq!(c.decrypt(4, &[], &sealed, &mut out), Err(snow::Error::Decrypt));
        assert_eq!(c.decrypt(3, b"x", &sealed, &mut out), Err(snow::Error::Decrypt));
        let mut flipped = sealed;
        flipped[5] ^= 1;
        assert_eq!(c.decrypt(3, &[], &flipped, &mut out), Err(snow::Error::Decrypt));
        assert_eq!(c.decrypt(3, &[], &sealed[..TAG_LEN - 1], &mut out), Err(snow::Error::Decrypt));
        assert_eq!(c.decrypt(3, &[], &sealed, &mut out[..39]), Err(snow::Error::Decrypt));
    }

    #[test]
    fn the_cpu_check_agrees_with_proc_cpuinfo() {
        let missing = missing_aes_instructions();
        // The kernel's flags for the first CPU (x86-64: "flags", aarch64: "Features").
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else { return };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags") || l.starts_with("Features")) else { return };
        let flags: Vec<&str> = flags.split(':').nth(1).unwrap_or("").split_whitespace().collect();
        let checked: &[&str] = if cfg!(target_arch = "x86_64") {
            &["aes", "pclmulqdq"]
        } else if cfg!(target_arch = "aarch64") && cfg!(aes_armv8) && cfg!(polyval_armv8) {
            &["aes", "pmull"]
        } else {
            &[]
        };
        for feature in checked {
            assert_eq!(missing.contains(feature), !flags.contains(feature), "{feature}: {flags:?}");
        }
    }

    #[test]
    fn the_warning_names_what_is_missing_and_nothing_when_nothing_is() {
        assert_eq!(software_aes_warning(&[]), None);
        let w = software_aes_warning(&["aes"]).expect("a warning");
        assert!(w.contains("no aes instructions"), "{w}");
        assert!(w.contains("software") && w.contains("10x slower"), "{w}");
        let w = software_aes_warning(&["aes", "pclmulqdq"]).expect("a warning");
        assert!(w.contains("no aes or pclmulqdq instructions"), "{w}");
    }
}
