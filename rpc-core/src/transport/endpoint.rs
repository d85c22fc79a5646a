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

    /// The host of a `host:port` address, without the brackets of an IPv6
    /// address (`127.0.0.1`, `::1`, `example.com`); the whole address for
    /// schemes that are not `host:port` (`mem://name`).
    pub fn host(&self) -> &str {
        match self.authority.rsplit_once(':') {
            Some((host, port)) if port.parse::<u16>().is_ok() => host
                .strip_prefix('[')
                .and_then(|host| host.strip_suffix(']'))
                .unwrap_or(host),
            _ => &self.authority,
        }
    }

    /// The port of a `host:port` address.
    pub fn port(&self) -> Option<u16> {
        self.authority
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse().ok())
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
        if authority.contains(['/', '?', '#']) {
            return Err(invalid(
                "the address may not carry a path, query or fragment ('/', '?', '#')",
            ));
        }
        if authority.chars().any(char::is_whitespace) {
            return Err(invalid("the address may not contain spaces"));
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
const HOST_PORT_SCHEMES: &[&str] = &["tcp", "tls", "rdma", "rdma+tls"];

/// Checks `host:port` (`[v6]:port` for IPv6) as a URI authority would be
/// (RFC 3986, through [`http::uri::Authority`]), with no user info; the host
/// must be an IP address or a DNS name. It is resolved later.
fn check_host_port(authority: &str) -> Result<(), &'static str> {
    if authority.contains('@') {
        return Err("user info (user@) has no meaning here: expected host:port");
    }
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
    if authority.parse::<http::uri::Authority>().is_err() {
        return Err("not a valid URI authority (host:port)");
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return match v6.parse::<std::net::Ipv6Addr>() {
            Ok(_) => Ok(()),
            Err(_) => Err("the host in brackets is not an IPv6 address"),
        };
    }
    if host.parse::<std::net::Ipv4Addr>().is_ok() || valid_dns_name(host) {
        Ok(())
    } else {
        Err(
            "the host is neither an IP address nor a DNS name (letters, digits, '-', '_' in dot-separated labels of 1-63)",
        )
    }
}

/// A DNS name as resolvers take it: up to 253 bytes of labels of 1 to 63
/// letters, digits, '-' or '_', not starting or ending with '-', with an
/// optional final dot.
fn valid_dns_name(host: &str) -> bool {
    let name = host.strip_suffix('.').unwrap_or(host);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

impl TryFrom<http::Uri> for Endpoint {
    type Error = TransportError;
    /// `tcp://host:port` and the like, as an `http::Uri` (a path of `/` is
    /// allowed; any other path, or a query, is refused).
    fn try_from(uri: http::Uri) -> Result<Endpoint, TransportError> {
        uri.to_string().parse()
    }
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
        for bad in [
            "127.0.0.1:1",
            "tcp://",
            "://x",
            "tcp://a/b",
            "t p://x",
            "tcp://a:1?x=1",
            "tcp://a:1#top",
        ] {
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
            "rdma+tls://my_host.example.com.:443",
            "tls://[fe80::1]:1",
        ] {
            assert!(good.parse::<Endpoint>().is_ok(), "{good}");
        }
        for (bad, says) in [
            ("rdma://nohost", "the port is missing"),
            ("tcp://host:http", "not a number"),
            ("tcp://host:70000", "not a number"),
            ("rdma://:50051", "the host is empty"),
            ("tcp://::1:50051", "IPv6 address goes in brackets"),
            ("tcp://user@host:1", "user info"),
            ("tcp://[::zz]:1", "not an IPv6 address"),
            ("rdma://ho$t:1", "neither an IP address nor a DNS name"),
            ("rdma://-host:1", "neither an IP address nor a DNS name"),
            ("rdma://a..b:1", "neither an IP address nor a DNS name"),
            ("tcp://a:1?x", "query"),
        ] {
            let error = bad.parse::<Endpoint>().unwrap_err().to_string();
            assert!(
                error.contains(bad) && error.contains(says),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn host_and_port_come_apart_and_a_uri_converts() {
        let v6: Endpoint = "tls://[::1]:443".parse().unwrap();
        assert_eq!((v6.host(), v6.port()), ("::1", Some(443)));
        let name: Endpoint = "rdma://node-1.example:50051".parse().unwrap();
        assert_eq!((name.host(), name.port()), ("node-1.example", Some(50051)));
        let mem: Endpoint = "mem://svc".parse().unwrap();
        assert_eq!((mem.host(), mem.port()), ("svc", None));
        let uri: http::Uri = "tcp://127.0.0.1:7/".parse().unwrap();
        assert_eq!(
            Endpoint::try_from(uri).unwrap().to_string(),
            "tcp://127.0.0.1:7"
        );
        let uri: http::Uri = "tcp://127.0.0.1:7/svc?q".parse().unwrap();
        assert!(Endpoint::try_from(uri).is_err());
    }
}
