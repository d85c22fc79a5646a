//! Each source address's share of a server's connections
//! ([`super::Server::max_connections_per_address`]): one host cannot hold
//! every connection slot, so clients from other addresses still get in.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

/// Connections open per source address, against a limit.
#[derive(Debug)]
pub(crate) struct AddressShares {
    limit: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl AddressShares {
    pub(crate) fn new(limit: usize) -> Arc<AddressShares> {
        Arc::new(AddressShares {
            limit,
            open: Mutex::new(HashMap::new()),
        })
    }

    /// A place for a connection from `peer` (a transport's peer string):
    /// `Ok(None)` when the peer has no IP address (in-memory), `Err(ip)` when
    /// that address holds its whole share.
    pub(crate) fn take(self: &Arc<Self>, peer: &str) -> Result<Option<AddressShare>, IpAddr> {
        let Some(ip) = source_address(peer) else {
            return Ok(None);
        };
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(ip).or_default();
        if *count >= self.limit {
            if *count == 0 {
                open.remove(&ip);
            }
            return Err(ip);
        }
        *count += 1;
        Ok(Some(AddressShare {
            shares: self.clone(),
            ip,
        }))
    }
}

/// One connection's place in its address's share; freed when dropped.
#[derive(Debug)]
pub(crate) struct AddressShare {
    shares: Arc<AddressShares>,
    ip: IpAddr,
}

impl Drop for AddressShare {
    fn drop(&mut self) {
        let mut open = self.shares.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// The IP address in a transport's peer string (`ip:port`, or
/// `scheme://ip:port`); `None` for peers without one (`mem://`).
pub(crate) fn source_address(peer: &str) -> Option<IpAddr> {
    let address = peer.split_once("://").map_or(peer, |(_, rest)| rest);
    address
        .parse::<SocketAddr>()
        .map(|addr| addr.ip())
        .or_else(|_| address.parse::<IpAddr>())
        .ok()
        .map(|ip| ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_counted_by_address_not_port() {
        let shares = AddressShares::new(2);
        let a = shares.take("10.0.0.1:1000").unwrap().unwrap();
        let _b = shares.take("rdma://10.0.0.1:1001").unwrap().unwrap();
        assert_eq!(
            shares.take("[::ffff:10.0.0.1]:1002").unwrap_err(),
            IpAddr::from([10, 0, 0, 1]),
            "an IPv4-mapped address is the same host"
        );
        assert!(shares.take("10.0.0.2:1000").unwrap().is_some());
        assert!(shares.take("mem-client-7").unwrap().is_none(), "no address");
        drop(a);
        assert!(shares.take("10.0.0.1:1003").unwrap().is_some());
    }
}
