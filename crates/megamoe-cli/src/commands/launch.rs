//! `megamoe launch --gpus N -- <subcommand ...>`: one process per GPU on this host, each a rank
//! of an NCCL group.
//!
//! Rank `r` runs `megamoe <subcommand ...>` with `MEGAMOE_RANK=r`, `MEGAMOE_WORLD=N`,
//! `MEGAMOE_LOCAL_RANK=r`, `MEGAMOE_DEVICE=r` (its GPU), `MEGAMOE_NCCL_ID_FILE` (rank 0 writes the
//! NCCL unique id there, the others wait for it) and `NCCL_NVLS_ENABLE=0`; the subcommand picks
//! the NCCL transport with `--transport nccl`. When a rank fails, the others get `--grace-s`
//! seconds to end on their own (their NCCL exchanges fail or time out), then are killed; the exit
//! code is the first failing rank's. Several hosts: run one launcher per host with
//! `--ranks-offset` / `--world` and an id file on a shared filesystem (or give every rank
//! `MEGAMOE_*` from your own launcher; the library takes rank, world and id directly).

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Arguments of `megamoe launch`.
#[derive(clap::Args)]
pub struct Args {
    /// Processes (and GPUs) on this host.
    #[arg(long)]
    pub gpus: usize,
    /// Ranks in the whole group (default: --gpus); with several hosts, the sum over them.
    #[arg(long)]
    pub world: Option<usize>,
    /// The first rank on this host (several hosts).
    #[arg(long, default_value_t = 0)]
    pub ranks_offset: usize,
    /// Where rank 0 writes the NCCL id (default: a fresh file under the temp directory).
    #[arg(long)]
    pub id_file: Option<std::path::PathBuf>,
    /// Seconds the other ranks get to end after one fails, before they are killed.
    #[arg(long, default_value_t = 30.0)]
    pub grace_s: f64,
    /// The subcommand every rank runs (after `--`), e.g. `verify --backend cuda --ep 2 --transport nccl`.
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Runs the command.
pub fn run(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(a.gpus > 0, "--gpus must be at least 1");
    let world = a.world.unwrap_or(a.gpus);
    anyhow::ensure!(
        a.ranks_offset + a.gpus <= world,
        "ranks {}..{} do not fit a world of {world}",
        a.ranks_offset,
        a.ranks_offset + a.gpus
    );
    let id_file = match &a.id_file {
        Some(p) => p.clone(),
        None => std::env::temp_dir().join(format!("megamoe-nccl-id-{}", std::process::id())),
    };
    if a.ranks_offset == 0 {
        // A stale id from an earlier run would make the ranks join a dead group.
        let _ = std::fs::remove_file(&id_file);
    }
    let exe = std::env::current_exe()?;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(a.gpus);
    for local in 0..a.gpus {
        let rank = a.ranks_offset + local;
        let child = Command::new(&exe)
            .args(&a.command)
            .env("MEGAMOE_RANK", rank.to_string())
            .env("MEGAMOE_WORLD", world.to_string())
            .env("MEGAMOE_LOCAL_RANK", local.to_string())
            .env("MEGAMOE_DEVICE", local.to_string())
            .env("MEGAMOE_NCCL_ID_FILE", &id_file)
            .env("NCCL_NVLS_ENABLE", "0")
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting rank {rank} ({}): {e}", exe.display()))?;
        children.push((rank, child));
    }
    eprintln!("launch: {} rank(s) of {world} started: megamoe {}", a.gpus, a.command.join(" "));
    let code = supervise(children, Duration::from_secs_f64(a.grace_s.max(0.0)));
    if a.ranks_offset == 0 && a.id_file.is_none() {
        let _ = std::fs::remove_file(&id_file);
    }
    Ok(code)
}

/// Waits for every child; after the first failure, gives the others `grace`, then kills them.
fn supervise(mut children: Vec<(usize, Child)>, grace: Duration) -> i32 {
    let mut code = 0;
    let mut failed_at: Option<Instant> = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            let (rank, child) = &mut children[i];
            match child.try_wait() {
                Ok(Some(status)) => {
                    let c = status.code().unwrap_or(1);
                    if c != 0 {
                        eprintln!("launch: rank {rank} exited with {status}");
                        if code == 0 {
                            code = c;
                            failed_at = Some(Instant::now());
                        }
                    }
                    children.remove(i);
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("launch: waiting for rank {rank}: {e}");
                    code = code.max(1);
                    failed_at.get_or_insert_with(Instant::now);
                }
            }
            i += 1;
        }
        if failed_at.is_some_and(|t| t.elapsed() >= grace) {
            for (rank, child) in &mut children {
                eprintln!(
                    "launch: killing rank {rank} (another rank failed {:.0} s ago)",
                    grace.as_secs_f64()
                );
                let _ = child.kill();
                let _ = child.wait();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    code
}
