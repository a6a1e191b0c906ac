//! Child processes that die with the test process.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, and test threads come and
//! go, so every child is forked from one thread that lives as long as the process.

use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

type Request = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("child-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn the child-spawner thread");
        Mutex::new(tx)
    })
}

/// Spawns `cmd` so that it receives SIGKILL if this process dies, however it dies.
pub fn spawn_tied(mut cmd: Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, tx))
        .map_err(|_| std::io::Error::other("child-spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| std::io::Error::other("child-spawner thread is gone"))?
}

/// Sends `signal` to a child (no-op when it has exited).
pub fn signal(child: &Child, signal: i32) {
    let Ok(pid) = i32::try_from(child.id()) else {
        return;
    };
    // SAFETY: plain syscall on a pid we own.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// The parent of every process, from `/proc/<pid>/stat`.
fn parents() -> Vec<(u32, u32)> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
            let rest = &stat[stat.rfind(')')? + 1..];
            let ppid = rest.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, ppid))
        })
        .collect()
}

/// SIGKILLs `root` and every process descended from it, as a container runtime kills a whole
/// container: a killed agent's `mount` or `mkfs` must not finish after it. The tree is stopped
/// (SIGSTOP) while it is read, so nothing forks away, then killed at once; returns when every
/// process of it has ended (bounded). The caller reaps `root`.
pub fn kill_tree(root: u32) {
    let send = |pid: u32, sig: i32| {
        if let Ok(p) = i32::try_from(pid) {
            // SAFETY: plain syscall.
            unsafe {
                libc::kill(p, sig);
            }
        }
    };
    send(root, libc::SIGSTOP);
    let mut tree = vec![root];
    loop {
        let known = tree.len();
        for (pid, ppid) in parents() {
            if tree.contains(&ppid) && !tree.contains(&pid) {
                send(pid, libc::SIGSTOP);
                tree.push(pid);
            }
        }
        if tree.len() == known {
            break;
        }
    }
    for &pid in &tree {
        send(pid, libc::SIGKILL);
    }
    // A system call in progress (a mount) completes before the signal takes effect: wait, bounded,
    // until every process of the tree is gone or a zombie, so its work is over when this returns.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let over = |pid: u32| match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| {
                stat[i + 1..]
                    .split_whitespace()
                    .next()
                    .map(|st| st == "Z" || st == "X")
            })
            .unwrap_or(true),
    };
    while std::time::Instant::now() < deadline && !tree.iter().all(|&p| over(p)) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// SIGTERM, a grace period, then SIGKILL; always reaps.
pub fn stop(child: &mut Child, grace: std::time::Duration) {
    signal(child, libc::SIGTERM);
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A free loopback TCP port (bound and released; the tiny race is accepted by the callers' retries).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind an ephemeral loopback port")
}

#[cfg(test)]
mod tests {
    #[test]
    fn kill_tree_takes_the_grandchildren_too() {
        // A shell that starts a long sleep and waits for it: the sleep is a grandchild of ours.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 300 & echo $! ; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        super::kill_tree(child.id());
        let _ = child.wait();
        // Reaped by init once killed; poll (bounded) until it is gone.
        let gone = (0..100).any(|_| {
            // SAFETY: signal 0 only checks existence.
            let alive = unsafe { libc::kill(grandchild, 0) } == 0
                && std::fs::read_to_string(format!("/proc/{grandchild}/stat"))
                    .map(|s| !s.contains(") Z "))
                    .unwrap_or(false);
            if alive {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            !alive
        });
        assert!(gone, "the grandchild {grandchild} survived");
    }
}
