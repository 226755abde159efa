//! A TCP relay on a free loopback port, for what a store does when the network fails rather
//! than Redis: it forwards each new connection to its current target, and can point new
//! connections elsewhere (a stable address whose server changed, as a failover behind a VIP or
//! a DNS name) or stop forwarding on the connections it already has (a half-open link: bytes
//! go nowhere, and nothing is closed). Its tasks end when it is dropped.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

struct Shared {
    target: Mutex<SocketAddr>,
    /// Connections accepted so far; those numbered below `cut` forward nothing more.
    accepted: AtomicU64,
    cut: AtomicU64,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Relay {
    /// A relay to `target`, listening on a free loopback port.
    pub async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            accepted: AtomicU64::new(0),
            cut: AtomicU64::new(0),
            tasks: Mutex::new(Vec::new()),
        });
        let accepting = {
            let shared = shared.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let number = shared.accepted.fetch_add(1, Ordering::SeqCst);
                    let target = *shared.target.lock().unwrap();
                    let Ok(server) = TcpStream::connect(target).await else {
                        continue;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let up = tokio::spawn(pipe(client_read, server_write, shared.clone(), number));
                    let down =
                        tokio::spawn(pipe(server_read, client_write, shared.clone(), number));
                    shared.tasks.lock().unwrap().extend([up, down]);
                }
            })
        };
        shared.tasks.lock().unwrap().push(accepting);
        Relay { addr, shared }
    }

    /// The relay's address as a Redis URL.
    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// New connections go to `target` from now on; the ones already made stay where they are.
    pub fn point_at(&self, target: SocketAddr) {
        *self.shared.target.lock().unwrap() = target;
    }

    /// The connections made so far forward nothing more, and stay open.
    pub fn cut_existing(&self) {
        let accepted = self.shared.accepted.load(Ordering::SeqCst);
        self.shared.cut.store(accepted, Ordering::SeqCst);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for task in self.shared.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

/// Copy `from` to `to` until either ends; once connection `number` is cut, read and drop.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    number: u64,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if number < shared.cut.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
