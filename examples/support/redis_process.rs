//! A throwaway `redis-server` on a free loopback port, for the examples and benchmarks that
//! measure against a real Redis. Killed (by PID) when dropped. Tests use `tests/support/` instead.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `redis-server` started by this process.
pub struct RedisProcess {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl RedisProcess {
    /// Start one, with no persistence, and wait until it accepts connections.
    pub fn start() -> Result<RedisProcess, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot start redis-server (apt-get install redis-server): {e}")
            })?;
        let server = RedisProcess { child, port };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err("redis-server did not start".into())
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kill it now (SIGKILL; a paused process too).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
