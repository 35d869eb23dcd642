//! Which producers a consumer's side channel may dial: an allow-list of networks and host names.
//!
//! Read [`DialPolicy`]. A consumer learns where a producer listens from the request
//! (`kv_transfer_params`' `remote_host`/`remote_port`), which whoever sends requests writes. Without
//! a policy a request could make every decode worker open TCP connections to any address it names
//! (a port scanner inside the cluster, or the cloud's metadata service on a link-local address). With a
//! secret set such a dial costs no metadata (nothing leaves before the peer proves the key), but it
//! should not happen at all: [`super::side::SideChannel::connect`] dials only an address the policy
//! allows, and refuses the rest before any socket is opened.
//!
//! The default, when neither the configuration nor `$KVPUSH_DIAL_ALLOW` names a list, is the
//! networks a serving cluster runs on: loopback and the private ranges (RFC 1918, carrier-grade NAT
//! `100.64.0.0/10`, IPv6 unique-local `fc00::/7`). Public addresses, link-local ones
//! (`169.254.0.0/16`, where cloud metadata services listen, `fe80::/10`), multicast and unspecified
//! addresses are refused. docs/security.md says how to narrow it to the prefill pool.
//!
//! What it must never do: dial first and check after, or allow a name because it resolves to an
//! allowed address when the name itself was not asked for (names are checked by what they resolve
//! to, each address on its own).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The environment variable holding the dial allow-list (comma-separated; see [`DialPolicy::parse`]).
pub const DIAL_ALLOW_ENV: &str = "KVPUSH_DIAL_ALLOW";

/// One allowed network: an address and how many of its leading bits must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Net {
    addr: IpAddr,
    prefix: u8,
}

impl Net {
    fn v4(a: [u8; 4], prefix: u8) -> Net {
        Net { addr: IpAddr::V4(Ipv4Addr::from(a)), prefix }
    }

    fn v6(first: u16, prefix: u8) -> Net {
        Net { addr: IpAddr::V6(Ipv6Addr::new(first, 0, 0, 0, 0, 0, 0, 0)), prefix }
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let bits = |a: u128, b: u128, width: u32| {
            let p = u32::from(self.prefix);
            p == 0 || (a ^ b) >> (width - p) == 0
        };
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => bits(u32::from(n).into(), u32::from(a).into(), 32),
            (IpAddr::V6(n), IpAddr::V6(a)) => bits(u128::from(n), u128::from(a), 128),
            _ => false,
        }
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// An entry of the list that is neither an address nor a network.
#[derive(Debug, thiserror::Error)]
#[error("dial allow-list entry {entry:?}: {reason}")]
pub struct BadEntry {
    /// The entry as written.
    pub entry: String,
    /// What is wrong with it.
    pub reason: String,
}

/// The producers a side channel may dial: networks (CIDR or single addresses) and host names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialPolicy {
    nets: Vec<Net>,
    /// Host names allowed as written (lower case); their addresses are not checked against `nets`.
    names: Vec<String>,
}

impl DialPolicy {
    /// Loopback and the private networks (see the module docs).
    pub fn cluster() -> Self {
        let nets = vec![
            Net::v4([127, 0, 0, 0], 8),
            Net::v4([10, 0, 0, 0], 8),
            Net::v4([172, 16, 0, 0], 12),
            Net::v4([192, 168, 0, 0], 16),
            Net::v4([100, 64, 0, 0], 10),
            Net { addr: IpAddr::V6(Ipv6Addr::LOCALHOST), prefix: 128 },
            Net::v6(0xfc00, 7),
        ];
        Self { nets, names: Vec::new() }
    }

    /// The list in `$KVPUSH_DIAL_ALLOW`, if the variable is set.
    pub fn from_env() -> Result<Option<Self>, BadEntry> {
        std::env::var(DIAL_ALLOW_ENV).ok().map(|v| Self::parse(&v)).transpose()
    }

    /// Parses a comma-separated list: `10.1.0.0/16`, `192.168.3.7`, `fd00::/8`, `::1`, or a host
    /// name (`prefill-0.serving.svc`), allowed as written. `0.0.0.0/0,::/0` allows every address
    /// (say so explicitly; an empty list allows nothing).
    pub fn parse(list: &str) -> Result<Self, BadEntry> {
        let mut policy = DialPolicy { nets: Vec::new(), names: Vec::new() };
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = |reason: &str| BadEntry { entry: entry.to_owned(), reason: reason.to_owned() };
            let (addr, prefix) = match entry.split_once('/') {
                Some((a, p)) => (a, Some(p)),
                None => (entry, None),
            };
            let addr = addr.trim_start_matches('[').trim_end_matches(']');
            match addr.parse::<IpAddr>() {
                Ok(ip) => {
                    let width = if ip.is_ipv4() { 32 } else { 128 };
                    let prefix = match prefix {
                        None => width,
                        Some(p) => p
                            .parse::<u8>()
                            .ok()
                            .filter(|p| *p <= width)
                            .ok_or_else(|| bad(&format!("the prefix length must be a number from 0 to {width}")))?,
                    };
                    policy.nets.push(Net { addr: ip.to_canonical(), prefix });
                }
                Err(_) if prefix.is_some() => return Err(bad("a network needs an IP address before the '/'")),
                Err(_) => {
                    let valid = entry.len() <= 253
                        && entry.split('.').all(|label| {
                            !label.is_empty()
                                && label.len() <= 63
                                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                        });
                    if !valid {
                        return Err(bad("not an IP address, a network (address/prefix) or a host name"));
                    }
                    policy.names.push(entry.to_ascii_lowercase());
                }
            }
        }
        Ok(policy)
    }

    /// Whether a dial to `host` (as the request named it), which resolved to `addr`, is allowed.
    pub fn allows(&self, host: &str, addr: &SocketAddr) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if self.names.iter().any(|n| n.eq_ignore_ascii_case(host)) {
            return true;
        }
        let ip = addr.ip().to_canonical();
        self.nets.iter().any(|n| n.contains(ip))
    }
}

impl fmt::Display for DialPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nets = self.nets.iter().map(ToString::to_string);
        let all: Vec<String> = nets.chain(self.names.iter().cloned()).collect();
        if all.is_empty() {
            return f.write_str("nothing");
        }
        f.write_str(&all.join(","))
    }
}

/// The host part of a `host:port` dial target (`[v6]:port` keeps its brackets off).
pub fn host_of(target: &str) -> &str {
    match target.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => {
            host.trim_start_matches('[').trim_end_matches(']')
        }
        _ => target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> SocketAddr {
        SocketAddr::new(s.parse().expect("an IP address"), 5600)
    }

    #[test]
    fn the_default_allows_the_cluster_networks_only() {
        let p = DialPolicy::cluster();
        for ok in ["127.0.0.1", "127.9.9.9", "10.2.3.4", "172.16.0.1", "172.31.255.255", "192.168.1.1", "100.64.0.1"] {
            assert!(p.allows(ok, &at(ok)), "{ok} is a cluster address");
        }
        for ok in ["::1", "fd12::1", "fc00::9", "::ffff:10.0.0.1"] {
            assert!(p.allows(ok, &at(ok)), "{ok} is a cluster address");
        }
        // Public, link-local (cloud metadata), just outside the ranges, multicast, unspecified.
        for no in [
            "8.8.8.8",
            "169.254.169.254",
            "172.32.0.1",
            "172.15.255.255",
            "192.169.0.1",
            "100.128.0.1",
            "224.0.0.1",
            "0.0.0.0",
            "fe80::1",
            "2001:db8::1",
            "::",
            "::ffff:8.8.8.8",
        ] {
            assert!(!p.allows(no, &at(no)), "{no} is not a cluster address");
        }
    }

    #[test]
    fn a_configured_list_allows_exactly_its_networks_and_names() {
        let p = DialPolicy::parse(" 10.1.0.0/16, 192.168.3.7 ,[fd00::]/8, prefill-0.Serving.svc ").expect("valid");
        assert!(p.allows("10.1.200.3", &at("10.1.200.3")));
        assert!(!p.allows("10.2.0.1", &at("10.2.0.1")), "outside the /16");
        assert!(p.allows("192.168.3.7", &at("192.168.3.7")));
        assert!(!p.allows("192.168.3.8", &at("192.168.3.8")), "a single address is a /32");
        assert!(p.allows("fd01::5", &at("fd01::5")));
        assert!(!p.allows("127.0.0.1", &at("127.0.0.1")), "loopback only when listed");
        // A listed name is allowed whatever it resolves to; an unlisted one only by its address.
        assert!(p.allows("PREFILL-0.serving.svc", &at("8.8.8.8")));
        assert!(!p.allows("evil.example", &at("8.8.8.8")));
        assert!(p.allows("evil.example", &at("10.1.0.1")));
        assert_eq!(p.to_string(), "10.1.0.0/16,192.168.3.7/32,fd00::/8,prefill-0.serving.svc");
        let any = DialPolicy::parse("0.0.0.0/0,::/0").expect("valid");
        assert!(any.allows("8.8.8.8", &at("8.8.8.8")) && any.allows("2001:db8::1", &at("2001:db8::1")));
        let none = DialPolicy::parse("").expect("valid");
        assert!(!none.allows("127.0.0.1", &at("127.0.0.1")));
        assert_eq!(none.to_string(), "nothing");
    }

    #[test]
    fn malformed_entries_are_refused_with_the_entry() {
        for bad in ["10.0.0.0/33", "::/129", "10.0.0.0/x", "host/8", "bad host", "a..b", "-x_y"] {
            let e = DialPolicy::parse(&format!("10.0.0.1,{bad}")).expect_err(bad);
            assert_eq!(e.entry, bad.trim());
        }
    }

    #[test]
    fn the_host_of_a_target_drops_its_port_and_brackets() {
        assert_eq!(host_of("10.0.0.1:5600"), "10.0.0.1");
        assert_eq!(host_of("[fd00::1]:5600"), "fd00::1");
        assert_eq!(host_of("prefill-0:5601"), "prefill-0");
        assert_eq!(host_of("prefill-0"), "prefill-0");
    }
}
