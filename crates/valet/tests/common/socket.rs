//! Reads socket options of another process's accepted connections: the server side of
//! a connection is found by its addresses in `/proc/<pid>/net/tcp`, its descriptor by
//! inode in `/proc/<pid>/fd`, and a duplicate taken with `pidfd_getfd(2)`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, pidfd_getfd, pidfd_open};

/// The inode of the socket in `pid`'s network namespace whose local address is `local`
/// and remote address `remote`.
fn inode_of(pid: u32, local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
    table.lines().skip(1).find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (l, r, inode) = (cols.get(1)?, cols.get(2)?, cols.get(9)?);
        (parse_v4(l)? == local && parse_v4(r)? == remote).then(|| inode.parse().ok())?
    })
}

/// `0100007F:1F90` (address in host order, port big-endian) as `127.0.0.1:8080`.
fn parse_v4(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let ip = u32::from_str_radix(ip, 16).ok()?;
    let port = u16::from_str_radix(port, 16).ok()?;
    Some(SocketAddr::new(
        IpAddr::V4(Ipv4Addr::from(ip.to_le_bytes())),
        port,
    ))
}

fn fd_of(pid: u32, inode: u64) -> Option<i32> {
    let want = format!("socket:[{inode}]");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(Result::ok)
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy() == want))
        .and_then(|e| e.file_name().to_str()?.parse().ok())
}

/// Whether `TCP_NODELAY` is set on the socket process `pid` accepted for the
/// connection from `client` to `server`; `None` while that socket is not (yet) one of
/// the process's descriptors.
pub fn accepted_nodelay(pid: u32, server: SocketAddr, client: SocketAddr) -> Option<bool> {
    let inode = inode_of(pid, server, client)?;
    let fd = fd_of(pid, inode)?;
    let pidfd = pidfd_open(Pid::from_raw(pid as i32)?, PidfdFlags::empty()).ok()?;
    let dup = pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()).ok()?;
    rustix::net::sockopt::tcp_nodelay(&dup).ok()
}

/// TCP keepalive (on, idle time) and `TCP_USER_TIMEOUT` (ms) of the socket process
/// `pid` accepted for the connection from `client` to `server`; `None` while that
/// socket is not (yet) one of the process's descriptors.
pub fn accepted_keepalive(
    pid: u32,
    server: SocketAddr,
    client: SocketAddr,
) -> Option<(bool, std::time::Duration, u32)> {
    let inode = inode_of(pid, server, client)?;
    let fd = fd_of(pid, inode)?;
    let pidfd = pidfd_open(Pid::from_raw(pid as i32)?, PidfdFlags::empty()).ok()?;
    let dup = pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()).ok()?;
    Some((
        rustix::net::sockopt::socket_keepalive(&dup).ok()?,
        rustix::net::sockopt::tcp_keepidle(&dup).ok()?,
        rustix::net::sockopt::tcp_user_timeout(&dup).ok()?,
    ))
}
