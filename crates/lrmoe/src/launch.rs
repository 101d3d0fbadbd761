//! `lrmoe launch --nproc N -- <args>`: starts this node's ranks, one process
//! per GPU, in the torchrun/SLURM convention.
//!
//! Each child gets `RANK = node_rank · nproc + local`, `WORLD_SIZE = nnodes ·
//! nproc`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
//! (a free local port when there is one node and none was given), and
//! `RAYON_NUM_THREADS` = cores / nproc unless already set, so CPU work in the
//! ranks does not oversubscribe the machine. The rest of the environment is
//! inherited (so `NCCL_*` settings reach NCCL). When a rank exits with a
//! failure, the others get `grace` to end on their own (their collectives
//! fail within their timeout), then are killed; the launcher returns an error
//! naming the first failing rank. It never waits on a dead group.
//!
//! Signals: each rank runs in its own process group, so a terminal's Ctrl-C
//! reaches the launcher alone. The launcher forwards the first SIGINT or
//! SIGTERM it gets (see [`LaunchOptions::stop`]) to every rank as SIGTERM —
//! training ranks then stop together at the next step boundary, checkpoint
//! and exit 0 — and kills every rank on the second.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Errors of the launcher.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The options cannot work.
    #[error("launch: {0}")]
    Config(String),
    /// A rank could not be started.
    #[error("launch: cannot start rank {rank} ({program}): {error}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// What was run.
        program: String,
        /// Why.
        error: std::io::Error,
    },
    /// A second signal: every rank was killed.
    #[error("launch: interrupted twice; every rank was killed")]
    Interrupted,
    /// A rank failed; the others were stopped.
    #[error("launch: rank {rank} {status}; the other ranks were stopped")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// How it ended.
        status: String,
    },
}

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// Processes (GPUs) on this node.
    pub nproc: usize,
    /// Nodes in the job.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Rank 0's host.
    pub master_addr: String,
    /// Rank 0's rendezvous port (`None`: a free local port; one node only).
    pub master_port: Option<u16>,
    /// Program to run (`None`: this executable).
    pub program: Option<PathBuf>,
    /// Its arguments.
    pub args: Vec<String>,
    /// Time the other ranks get to end on their own after one fails.
    pub grace: Duration,
    /// Raised by the launcher's signal handler: once forwards SIGTERM to
    /// every rank, twice kills them.
    pub stop: crate::stop::StopFlag,
}

fn free_port() -> Result<u16, LaunchError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| LaunchError::Config(format!("cannot find a free port: {e}")))
}

fn describe(status: ExitStatus) -> String {
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                if let Some(sig) = status.signal() {
                    return format!("was killed by signal {sig}");
                }
            }
            "ended abnormally".into()
        }
    }
}

/// Starts the ranks and waits for all of them.
pub fn launch(o: &LaunchOptions) -> Result<(), LaunchError> {
    if o.nproc == 0 || o.nnodes == 0 {
        return Err(LaunchError::Config(
            "--nproc and --nnodes must be at least 1".into(),
        ));
    }
    if o.node_rank >= o.nnodes {
        return Err(LaunchError::Config(format!(
            "--node-rank {} is outside {} node(s)",
            o.node_rank, o.nnodes
        )));
    }
    let port = match o.master_port {
        Some(p) => p,
        None if o.nnodes == 1 => free_port()?,
        None => {
            return Err(LaunchError::Config(
                "several nodes need an explicit --master-port (the same on every node)".into(),
            ))
        }
    };
    let program = match &o.program {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .map_err(|e| LaunchError::Config(format!("cannot find this executable: {e}")))?,
    };
    let world = o.nproc * o.nnodes;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .div_ceil(o.nproc)
        .max(1);
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(o.nproc);
    for local in 0..o.nproc {
        let rank = o.node_rank * o.nproc + local;
        let mut cmd = Command::new(&program);
        cmd.args(&o.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", o.nproc.to_string())
            .env("MASTER_ADDR", &o.master_addr)
            .env("MASTER_PORT", port.to_string());
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", threads.to_string());
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(error) => {
                stop(&mut children);
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.display().to_string(),
                    error,
                });
            }
        }
    }
    supervise(children, o.grace, &o.stop)
}

/// Sends SIGTERM to every rank still running.
fn forward_signal(children: &[(usize, Child)]) {
    #[cfg(unix)]
    for (rank, c) in children {
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        if let Err(e) = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM) {
            tracing::warn!(rank, error = %e, "could not forward the signal");
        }
    }
    #[cfg(not(unix))]
    let _ = children;
}

fn stop(children: &mut [(usize, Child)]) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn supervise(
    mut children: Vec<(usize, Child)>,
    grace: Duration,
    signals: &crate::stop::StopFlag,
) -> Result<(), LaunchError> {
    let mut failed: Option<(usize, String, Instant)> = None;
    let mut forwarded = 0;
    loop {
        let seen = signals.count();
        if seen >= 2 {
            stop(&mut children);
            return Err(LaunchError::Interrupted);
        }
        if seen > forwarded {
            tracing::info!("forwarding the stop to every rank; signal again to kill them");
            forward_signal(&children);
            forwarded = seen;
        }
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait() {
                Ok(Some(status)) => {
                    let (rank, _) = children.swap_remove(i);
                    if !status.success() && failed.is_none() {
                        failed = Some((rank, describe(status), Instant::now()));
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    let (rank, _) = children.swap_remove(i);
                    if failed.is_none() {
                        failed = Some((
                            rank,
                            format!("could not be waited on ({e})"),
                            Instant::now(),
                        ));
                    }
                }
            }
        }
        if children.is_empty() {
            return match failed {
                None => Ok(()),
                Some((rank, status, _)) => Err(LaunchError::RankFailed { rank, status }),
            };
        }
        if let Some((rank, status, at)) = &failed {
            if at.elapsed() >= grace {
                stop(&mut children);
                return Err(LaunchError::RankFailed {
                    rank: *rank,
                    status: status.clone(),
                });
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn sh(script: &str, nproc: usize) -> LaunchOptions {
        LaunchOptions {
            nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            program: Some("/bin/sh".into()),
            args: vec!["-c".into(), script.into()],
            grace: Duration::from_millis(300),
            stop: crate::stop::StopFlag::new(),
        }
    }

    #[test]
    fn a_signal_is_forwarded_once_then_ranks_are_killed() {
        let dir = std::env::temp_dir().join(format!("lrmoe-sig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Each rank writes a file when it gets SIGTERM and exits 0.
        let script = format!(
            "trap 'echo got > {}/r$RANK; exit 0' TERM; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; exit 7",
            dir.display()
        );
        let o = sh(&script, 2);
        let flag = o.stop.clone();
        let t = std::thread::spawn(move || launch(&o));
        std::thread::sleep(Duration::from_millis(500));
        let start = Instant::now();
        flag.raise();
        t.join().unwrap().unwrap();
        assert!(start.elapsed() < Duration::from_secs(10));
        for r in 0..2 {
            assert!(dir.join(format!("r{r}")).exists(), "rank {r} got no signal");
        }
        // Ranks that ignore the first signal are killed on the second.
        let o = sh("trap '' TERM; sleep 60", 2);
        let flag = o.stop.clone();
        let t = std::thread::spawn(move || launch(&o));
        std::thread::sleep(Duration::from_millis(300));
        flag.raise();
        std::thread::sleep(Duration::from_millis(300));
        flag.raise();
        let start = Instant::now();
        assert!(matches!(t.join().unwrap(), Err(LaunchError::Interrupted)));
        assert!(start.elapsed() < Duration::from_secs(10));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_rank_sees_the_torchrun_environment() {
        let dir = std::env::temp_dir().join(format!("lrmoe-launch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR > {}/r$RANK; test -n \"$MASTER_PORT\"",
            dir.display()
        );
        launch(&sh(&script, 3)).unwrap();
        for r in 0..3 {
            let line = std::fs::read_to_string(dir.join(format!("r{r}"))).unwrap();
            assert_eq!(line.trim(), format!("{r} 3 {r} 3 127.0.0.1"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn two_nodes_number_their_ranks_globally() {
        // Two launchers on one machine stand for two nodes of 2 GPUs each.
        let dir = std::env::temp_dir().join(format!("lrmoe-nodes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT > {}/r$RANK",
            dir.display()
        );
        std::thread::scope(|s| {
            for node in 0..2 {
                let script = script.clone();
                s.spawn(move || {
                    let o = LaunchOptions {
                        nnodes: 2,
                        node_rank: node,
                        master_addr: "node0.example".into(),
                        master_port: Some(29_555),
                        ..sh(&script, 2)
                    };
                    launch(&o).unwrap();
                });
            }
        });
        for rank in 0..4 {
            let line = std::fs::read_to_string(dir.join(format!("r{rank}"))).unwrap();
            assert_eq!(
                line.trim(),
                format!("{rank} 4 {} 2 node0.example 29555", rank % 2)
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failing_rank_stops_the_others_and_is_named() {
        let start = Instant::now();
        // Rank 1 fails at once; rank 0 would sleep for a minute.
        let err = launch(&sh("if [ $RANK = 1 ]; then exit 3; fi; sleep 60", 2)).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(10));
        let msg = err.to_string();
        assert!(msg.contains("rank 1") && msg.contains("status 3"), "{msg}");
    }

    #[test]
    fn bad_options_are_errors() {
        let mut o = sh("true", 0);
        assert!(matches!(launch(&o), Err(LaunchError::Config(_))));
        o.nproc = 1;
        o.nnodes = 2;
        assert!(matches!(launch(&o), Err(LaunchError::Config(_))));
        o.node_rank = 5;
        assert!(matches!(launch(&o), Err(LaunchError::Config(_))));
        let o = LaunchOptions {
            program: Some("/nonexistent/lrmoe".into()),
            ..sh("", 1)
        };
        assert!(matches!(launch(&o), Err(LaunchError::Spawn { .. })));
    }
}
