//! Multi-process ranks: the torchrun/SLURM environment, a TCP rendezvous
//! that hands rank 0's NCCL unique id to every rank, and [`NcclTransport`],
//! the [`Transport`] over NCCL (one process per GPU).
//!
//! ## Rendezvous protocol (TCP, `MASTER_ADDR:MASTER_PORT`)
//!
//! Rank 0 listens; every other rank connects (retrying until the deadline,
//! since rank 0 may start later) and sends `b"LRMOE1"`, its rank and the
//! world size (`u32` little-endian each). Rank 0 checks them (same world,
//! rank in range, no duplicates), and once all `world − 1` peers have
//! arrived sends each the 128-byte id. A peer that never connects ends rank 0
//! — and, by closing the sockets, every waiting peer — with
//! [`DistError::Timeout`] naming the missing ranks. Nothing here touches a
//! GPU, so CI tests it with threads on localhost.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kernels::comm::{NcclComm, ID_BYTES};
use kernels::KernelError;

use crate::transport::{Transport, TransportError};

/// Errors of the distributed set-up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DistError {
    /// An environment variable is missing or malformed.
    #[error("environment: {var} {message}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Peers did not arrive in time.
    #[error("rendezvous at {addr}: rank {rank} timed out after {timeout_ms} ms waiting for {waiting_for}")]
    Timeout {
        /// The rendezvous address.
        addr: String,
        /// The waiting rank.
        rank: usize,
        /// The timeout.
        timeout_ms: u64,
        /// Who was missing.
        waiting_for: String,
    },
    /// A peer sent something unexpected, or the socket failed.
    #[error("rendezvous at {addr}: rank {rank}: {message}")]
    Protocol {
        /// The rendezvous address.
        addr: String,
        /// This rank.
        rank: usize,
        /// What happened.
        message: String,
    },
    /// NCCL (or CUDA) failed to set up.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

/// Rank and world in the torchrun/SLURM convention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank (`RANK`).
    pub rank: usize,
    /// Number of ranks (`WORLD_SIZE`).
    pub world: usize,
    /// GPU index on this node (`LOCAL_RANK`, default `RANK`).
    pub local_rank: usize,
    /// Rank 0's host (`MASTER_ADDR`, default `127.0.0.1`).
    pub master_addr: String,
    /// Rank 0's rendezvous port (`MASTER_PORT`).
    pub master_port: u16,
}

impl DistEnv {
    /// `Some` when `WORLD_SIZE` is set (a launched rank), `None` otherwise.
    pub fn from_env() -> Result<Option<Self>, DistError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, DistError> {
        if get("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        fn num<T: std::str::FromStr>(
            get: &impl Fn(&str) -> Option<String>,
            var: &'static str,
            default: Option<T>,
        ) -> Result<T, DistError> {
            match get(var) {
                Some(v) => v.trim().parse().map_err(|_| DistError::Env {
                    var,
                    message: format!("is not a valid number: {v:?}"),
                }),
                None => default.ok_or(DistError::Env {
                    var,
                    message: "is not set (launch with `lrmoe launch`, torchrun or srun)".into(),
                }),
            }
        }
        let world: usize = num(&get, "WORLD_SIZE", None)?;
        let rank: usize = num(&get, "RANK", None)?;
        let local_rank: usize = num(&get, "LOCAL_RANK", Some(rank))?;
        let master_port: u16 = num(&get, "MASTER_PORT", None)?;
        if world == 0 {
            return Err(DistError::Env {
                var: "WORLD_SIZE",
                message: "is 0: a run needs at least one rank".into(),
            });
        }
        if rank >= world {
            return Err(DistError::Env {
                var: "RANK",
                message: format!("is {rank}, outside a world of {world}"),
            });
        }
        Ok(Some(Self {
            rank,
            world,
            local_rank,
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        }))
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

const MAGIC: &[u8; 6] = b"LRMOE1";

fn proto(env: &DistEnv, message: impl Into<String>) -> DistError {
    DistError::Protocol {
        addr: env.addr(),
        rank: env.rank,
        message: message.into(),
    }
}

/// Hands rank 0's id to every rank. Rank 0 calls `make_id` once all peers
/// have connected; every rank returns the same bytes.
pub fn rendezvous(
    env: &DistEnv,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], DistError>,
) -> Result<[u8; ID_BYTES], DistError> {
    let deadline = Instant::now() + timeout;
    if env.world == 1 {
        return make_id();
    }
    if env.rank == 0 {
        serve(env, deadline, timeout, make_id)
    } else {
        join(env, deadline, timeout)
    }
}

fn serve(
    env: &DistEnv,
    deadline: Instant,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], DistError>,
) -> Result<[u8; ID_BYTES], DistError> {
    let bind = format!("0.0.0.0:{}", env.master_port);
    let listener = TcpListener::bind(&bind)
        .map_err(|e| proto(env, format!("cannot listen on {bind}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| proto(env, e.to_string()))?;
    let mut peers: Vec<Option<TcpStream>> = (0..env.world).map(|_| None).collect();
    let mut arrived = 1;
    while arrived < env.world {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(Duration::from_secs(5))))
                    .map_err(|e| proto(env, e.to_string()))?;
                let mut hello = [0u8; 14];
                if s.read_exact(&mut hello).is_err() || &hello[..6] != MAGIC {
                    // Not one of ours (a port scan, a stale client): ignore.
                    continue;
                }
                let rank = u32::from_le_bytes([hello[6], hello[7], hello[8], hello[9]]) as usize;
                let world =
                    u32::from_le_bytes([hello[10], hello[11], hello[12], hello[13]]) as usize;
                if world != env.world {
                    return Err(proto(
                        env,
                        format!(
                            "rank {rank} says the world has {world} ranks, rank 0 says {}",
                            env.world
                        ),
                    ));
                }
                if rank == 0 || rank >= env.world || peers[rank].is_some() {
                    return Err(proto(
                        env,
                        format!("rank {rank} joined twice or is out of range"),
                    ));
                }
                peers[rank] = Some(s);
                arrived += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..env.world)
                        .filter(|&r| peers[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    return Err(DistError::Timeout {
                        addr: env.addr(),
                        rank: 0,
                        timeout_ms: timeout.as_millis() as u64,
                        waiting_for: format!("rank(s) {}", missing.join(", ")),
                    });
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(proto(env, format!("accept: {e}"))),
        }
    }
    let id = make_id()?;
    for s in peers.iter_mut().flatten() {
        s.write_all(&id)
            .map_err(|e| proto(env, format!("sending the id: {e}")))?;
    }
    Ok(id)
}

fn join(env: &DistEnv, deadline: Instant, timeout: Duration) -> Result<[u8; ID_BYTES], DistError> {
    let addr = env.addr();
    let timed_out = || DistError::Timeout {
        addr: addr.clone(),
        rank: env.rank,
        timeout_ms: timeout.as_millis() as u64,
        waiting_for: "rank 0".into(),
    };
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let target = addr
            .to_socket_addrs()
            .map_err(|e| proto(env, format!("cannot resolve MASTER_ADDR: {e}")))?
            .next()
            .ok_or_else(|| proto(env, "MASTER_ADDR resolves to nothing"))?;
        match TcpStream::connect_timeout(&target, left.min(Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(Duration::from_millis(50).min(left)),
        }
    };
    let mut hello = Vec::with_capacity(14);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world as u32).to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| proto(env, format!("greeting rank 0: {e}")))?;
    let left = deadline.saturating_duration_since(Instant::now());
    stream
        .set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(|e| proto(env, e.to_string()))?;
    let mut id = [0u8; ID_BYTES];
    match stream.read_exact(&mut id) {
        Ok(()) => Ok(id),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Err(DistError::Timeout {
                addr: env.addr(),
                rank: env.rank,
                timeout_ms: timeout.as_millis() as u64,
                waiting_for: "rank 0 to hand out the NCCL id (other ranks missing?)".into(),
            })
        }
        Err(e) => Err(proto(
            env,
            format!("rank 0 closed the rendezvous before sending the id ({e}): it failed or gave up waiting for a peer"),
        )),
    }
}

/// The [`Transport`] over NCCL: one process per GPU, collectives on host
/// bytes staged through device buffers.
#[derive(Debug)]
pub struct NcclTransport {
    comm: NcclComm,
    sent: AtomicU64,
}

impl NcclTransport {
    /// Rendezvous (TCP, `env`) and NCCL set-up on GPU `env.local_rank`.
    /// `timeout` bounds the rendezvous, the communicator set-up and every
    /// later collective.
    pub fn connect(env: &DistEnv, timeout: Duration) -> Result<Self, DistError> {
        if !kernels::comm::COMPILED {
            return Err(KernelError::NotCompiledWithNccl.into());
        }
        let id = rendezvous(env, timeout, || Ok(kernels::comm::unique_id()?))?;
        let comm = NcclComm::init(env.local_rank, env.rank, env.world, &id, timeout)?;
        Ok(Self {
            comm,
            sent: AtomicU64::new(0),
        })
    }

    /// The communicator, for device-resident collectives and benchmarks.
    pub fn comm(&self) -> &NcclComm {
        &self.comm
    }

    fn map(&self, e: KernelError) -> TransportError {
        match e {
            KernelError::CommTimeout { rank, timeout_ms } => {
                TransportError::Timeout { rank, timeout_ms }
            }
            KernelError::Shape { .. } => TransportError::BadCounts {
                rank: self.comm.rank(),
                message: e.to_string(),
            },
            other => TransportError::PeerFailed {
                rank: self.comm.rank(),
                reason: other.to_string(),
            },
        }
    }
}

impl Transport for NcclTransport {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_to_all_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>), TransportError> {
        let out = self
            .comm
            .all_to_all_host(send, send_counts)
            .map_err(|e| self.map(e))?;
        let me = self.rank();
        let off: usize = send_counts
            .iter()
            .enumerate()
            .filter(|&(d, _)| d != me)
            .map(|(_, &c)| c)
            .sum();
        self.sent.fetch_add(off as u64, Ordering::Relaxed);
        Ok(out)
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        self.comm.all_gather_host(local).map_err(|e| self.map(e))
    }

    fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), TransportError> {
        self.comm
            .all_reduce_sum_f32_host(buf)
            .map_err(|e| self.map(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(29_517)
    }

    #[test]
    fn env_is_read_in_the_torchrun_convention() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(DistEnv::from_lookup(vars(&[])), Ok(None));
        let e = DistEnv::from_lookup(vars(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                e.rank,
                e.world,
                e.local_rank,
                e.master_addr.as_str(),
                e.master_port
            ),
            (3, 4, 1, "node7", 29500)
        );
        for bad in [
            &[("WORLD_SIZE", "2"), ("MASTER_PORT", "1")][..],
            &[("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_PORT", "1")][..],
            &[("WORLD_SIZE", "0"), ("RANK", "0"), ("MASTER_PORT", "1")][..],
            &[("WORLD_SIZE", "x"), ("RANK", "0"), ("MASTER_PORT", "1")][..],
            &[("WORLD_SIZE", "2"), ("RANK", "0")][..],
        ] {
            let owned: Vec<(String, String)> = bad
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            let r = DistEnv::from_lookup(|k| {
                owned.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
            });
            assert!(matches!(r, Err(DistError::Env { .. })), "{bad:?}: {r:?}");
        }
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        for world in [1, 2, 4] {
            let port = free_port();
            let ids: Vec<_> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..world)
                    .map(|r| {
                        s.spawn(move || {
                            rendezvous(&env(r, world, port), Duration::from_secs(10), || {
                                Ok([7u8; ID_BYTES])
                            })
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(ids.iter().all(|i| i == &Ok([7u8; ID_BYTES])), "{world}");
        }
    }

    #[test]
    fn a_peer_that_never_connects_ends_every_rank_in_time() {
        let port = free_port();
        let start = Instant::now();
        // World of 3; rank 2 never starts.
        let res: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    s.spawn(move || {
                        rendezvous(&env(r, 3, port), Duration::from_millis(500), || {
                            Ok([1u8; ID_BYTES])
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        match &res[0] {
            Err(DistError::Timeout { waiting_for, .. }) => assert!(waiting_for.contains('2')),
            other => panic!("{other:?}"),
        }
        assert!(res[1].is_err());
        // A rank whose rank 0 never starts times out too.
        let r = rendezvous(&env(1, 2, free_port()), Duration::from_millis(300), || {
            Ok([0; ID_BYTES])
        });
        assert!(matches!(r, Err(DistError::Timeout { .. })), "{r:?}");
    }

    #[test]
    fn mismatched_worlds_are_refused() {
        let port = free_port();
        let res: Vec<_> = std::thread::scope(|s| {
            let a = s.spawn(move || {
                rendezvous(&env(0, 2, port), Duration::from_secs(5), || {
                    Ok([1; ID_BYTES])
                })
            });
            let b = s.spawn(move || {
                rendezvous(&env(1, 3, port), Duration::from_secs(5), || {
                    Ok([1; ID_BYTES])
                })
            });
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert!(
            matches!(&res[0], Err(DistError::Protocol { message, .. }) if message.contains("3 ranks"))
        );
        assert!(res[1].is_err());
    }

    #[test]
    fn without_nccl_connect_is_a_clear_error() {
        if kernels::comm::COMPILED {
            return;
        }
        // World of 2 with no peer: must fail at once, not wait for one.
        let start = Instant::now();
        let r = NcclTransport::connect(&env(0, 2, free_port()), Duration::from_secs(30));
        assert!(matches!(
            r,
            Err(DistError::Kernel(KernelError::NotCompiledWithNccl))
        ));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
