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
