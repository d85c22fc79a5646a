//! [`Endpoint`]: `scheme://authority`.

use std::fmt;
use std::str::FromStr;

use super::TransportError;

/// Where to connect or listen: `tcp://host:port`, `mem://name`, `rdma://host:port`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    scheme: String,
    authority: String,
}

impl Endpoint {
    /// Builds an endpoint from its parts.
    pub fn new(scheme: &str, authority: &str) -> Result<Endpoint, TransportError> {
        format!("{scheme}://{authority}").parse()
    }

    /// The scheme, lower case (`tcp`).
    pub fn scheme(&self) -> &str {
        &self.scheme
    }

    /// What follows `://` (`127.0.0.1:50051`).
    pub fn authority(&self) -> &str {
        &self.authority
    }
}

impl FromStr for Endpoint {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Endpoint, TransportError> {
        let invalid = |reason| TransportError::InvalidEndpoint {
            endpoint: s.to_owned(),
            reason,
        };
        let (scheme, authority) = s
            .split_once("://")
            .ok_or_else(|| invalid("expected scheme://address, e.g. tcp://127.0.0.1:50051"))?;
        let authority = authority.strip_suffix('/').unwrap_or(authority);
        if scheme.is_empty()
            || !scheme
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'+')
        {
            return Err(invalid("the scheme must be letters and digits"));
        }
        if authority.is_empty() {
            return Err(invalid("the address after :// is empty"));
        }
        if authority.contains('/') || authority.chars().any(char::is_whitespace) {
            return Err(invalid("the address may not contain '/' or spaces"));
        }
        let scheme = scheme.to_ascii_lowercase();
        if HOST_PORT_SCHEMES.contains(&scheme.as_str()) {
            check_host_port(authority).map_err(invalid)?;
        }
        Ok(Endpoint {
            scheme,
            authority: authority.to_owned(),
        })
    }
}

/// Schemes whose address is a TCP `host:port` (rdma:// too: its set-up
/// exchange runs over TCP). Other schemes (`mem://name`, ones registered by
/// other crates) take any address.
const HOST_PORT_SCHEMES: &[&str] = &["tcp", "tls", "rdma"];

/// Checks `host:port` (`[v6]:port` for IPv6); the host is resolved later.
fn check_host_port(authority: &str) -> Result<(), &'static str> {
    let Some((host, port)) = authority.rsplit_once(':') else {
        return Err("expected host:port, e.g. 127.0.0.1:50051 (the port is missing)");
    };
    if port.parse::<u16>().is_err() {
        return Err("expected host:port, e.g. 127.0.0.1:50051 (the port is not a number 0-65535)");
    }
    if host.is_empty() {
        return Err("expected host:port, e.g. 127.0.0.1:50051 (the host is empty)");
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err("an IPv6 address goes in brackets, e.g. [::1]:50051");
    }
    Ok(())
}

impl TryFrom<&str> for Endpoint {
    type Error = TransportError;
    fn try_from(s: &str) -> Result<Endpoint, TransportError> {
        s.parse()
    }
}

impl TryFrom<String> for Endpoint {
    type Error = TransportError;
    fn try_from(s: String) -> Result<Endpoint, TransportError> {
        s.parse()
    }
}

impl TryFrom<&String> for Endpoint {
    type Error = TransportError;
    fn try_from(s: &String) -> Result<Endpoint, TransportError> {
        s.parse()
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let ep: Endpoint = "TCP://127.0.0.1:50051/".parse().unwrap();
        assert_eq!(ep.scheme(), "tcp");
        assert_eq!(ep.authority(), "127.0.0.1:50051");
        assert_eq!(ep.to_string(), "tcp://127.0.0.1:50051");
        for bad in ["127.0.0.1:1", "tcp://", "://x", "tcp://a/b", "t p://x"] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn tcp_and_rdma_addresses_are_host_port_and_say_what_is_wrong() {
        for good in [
            "tcp://localhost:1",
            "rdma://10.0.0.1:50051",
            "tcp://[::1]:0",
            "mem://anything",
        ] {
            assert!(good.parse::<Endpoint>().is_ok(), "{good}");
        }
        for (bad, says) in [
            ("rdma://nohost", "the port is missing"),
            ("tcp://host:http", "not a number"),
            ("tcp://host:70000", "not a number"),
            ("rdma://:50051", "the host is empty"),
            ("tcp://::1:50051", "IPv6 address goes in brackets"),
        ] {
            let error = bad.parse::<Endpoint>().unwrap_err().to_string();
            assert!(
                error.contains(bad) && error.contains(says),
                "{bad}: {error}"
            );
        }
    }
}
