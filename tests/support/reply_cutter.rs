//! A TCP relay in front of PostgreSQL that loses one reply: the first
//! statement whose bytes carry a marker reaches the server and runs, and
//! so does the rest of its transaction; the reply that ends the
//! transaction (a `ReadyForQuery` saying the session is idle again: the
//! statement's own, outside a transaction, or the `COMMIT`'s) is dropped
//! and the connection closed. What a gateway sees when the network fails
//! between a commit and its reply.
//!
//! Plain connections only (`sslmode=disable`): the relay reads the
//! server's messages to find the end of the transaction. A transaction
//! that ends in a rollback is cut and counted the same way, so a test also
//! checks what was written.
//!
//! It can also refuse a write: while [`ReplyCutter::refuse`] is set, a
//! connection that sends bytes carrying its marker is closed before they
//! are forwarded, so that write never reaches the server (a store down for
//! that write alone). And it can hold one: while [`ReplyCutter::hold`] is
//! set, bytes carrying its marker wait, unforwarded, until
//! [`ReplyCutter::let_through`] (a statement on its way for as long as a
//! test needs). And it can fail a commit before it reaches the server
//! and stay down ([`ReplyCutter::fail_after`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The marker still to match, and how many more times.
type Armed = Arc<Mutex<Option<(Vec<u8>, usize)>>>;

/// The marker of the writes refused, and how many were; the marker after
/// whose write its connection's next is refused, and whether, since, every
/// write is (the network down).
#[derive(Clone, Default)]
struct Refusing {
    marker: Arc<Mutex<Option<Vec<u8>>>>,
    refused: Arc<AtomicUsize>,
    after: Arc<Mutex<Option<Vec<u8>>>>,
    down: Arc<AtomicBool>,
    /// Whether the write refused after the marker was a `COMMIT`.
    refused_commit: Arc<AtomicBool>,
}

/// The marker of the writes held, how many were, and whether they may go.
#[derive(Clone)]
struct Holding {
    marker: Arc<Mutex<Option<Vec<u8>>>>,
    held: Arc<AtomicUsize>,
    open: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Default for Holding {
    fn default() -> Self {
        Holding {
            marker: Arc::default(),
            held: Arc::default(),
            open: Arc::new(tokio::sync::watch::Sender::new(true)),
        }
    }
}

pub struct ReplyCutter {
    pub port: u16,
    marker: Armed,
    cuts: Arc<AtomicUsize>,
    refusing: Refusing,
    holding: Holding,
    task: tokio::task::JoinHandle<()>,
}

impl ReplyCutter {
    /// Relays to the PostgreSQL server at `server` (`host:port`).
    pub async fn start(server: String) -> ReplyCutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let marker: Armed = Arc::default();
        let cuts = Arc::new(AtomicUsize::new(0));
        let refusing = Refusing::default();
        let holding = Holding::default();
        let task = tokio::spawn({
            let (marker, cuts) = (marker.clone(), cuts.clone());
            let (refusing, holding) = (refusing.clone(), holding.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(&server).await else {
                        continue;
                    };
                    let (marker, cuts) = (marker.clone(), cuts.clone());
                    let (refusing, holding) = (refusing.clone(), holding.clone());
                    tokio::spawn(relay(client, server, marker, cuts, refusing, holding));
                }
            }
        });
        ReplyCutter {
            port,
            marker,
            cuts,
            refusing,
            holding,
            task,
        }
    }

    /// A relay in front of `db`'s server, and the store that reaches the
    /// database through it.
    pub async fn relay(db: &super::TestDb) -> (ReplyCutter, super::TestStore) {
        let config: tokio_postgres::Config = db.url.parse().unwrap();
        let server = match &config.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(host) => format!("{host}:{}", config.get_ports()[0]),
            other => panic!("a TCP server, not {other:?}"),
        };
        let cutter = ReplyCutter::start(server.clone()).await;
        let relayed = format!(
            "{}?sslmode=disable",
            db.url
                .replace(&server, &format!("127.0.0.1:{}", cutter.port))
        );
        (cutter, super::TestStore::external(relayed))
    }

    /// Refuses every write on any connection from now on, until
    /// [`ReplyCutter::heal`]: the gateway cut off from the database.
    pub fn go_down(&self) {
        self.refusing.down.store(true, Ordering::SeqCst);
    }

    /// Loses the reply to the next statement carrying `marker`, once.
    pub fn arm(&self, marker: &[u8]) {
        self.arm_times(marker, 1);
    }

    /// Loses the replies to the next `times` statements carrying `marker`.
    pub fn arm_times(&self, marker: &[u8], times: usize) {
        // Matched with `windows`, which an empty marker would panic in the
        // relay's task, far from the test that armed it.
        assert!(!marker.is_empty(), "a marker to arm must not be empty");
        *self.marker.lock().unwrap() = Some((marker.to_vec(), times));
    }

    /// Replies lost so far.
    pub fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }

    /// Refuses every write carrying `marker` (or none, with `None`) from
    /// now on: its connection is closed before the bytes are forwarded.
    pub fn refuse(&self, marker: Option<&[u8]>) {
        assert!(marker != Some(&[]), "a marker to refuse must not be empty");
        *self.refusing.marker.lock().unwrap() = marker.map(<[u8]>::to_vec);
    }

    /// Lets the next write carrying `marker` through, then refuses the
    /// next write on its connection (a transaction's `COMMIT`, after the
    /// statement carrying the marker), and every write on any connection
    /// from then on, new ones' first included, until [`ReplyCutter::heal`]:
    /// the network failing before a commit reaches the server, and staying
    /// down a while.
    pub fn fail_after(&self, marker: &[u8]) {
        assert!(
            !marker.is_empty(),
            "a marker to fail after must not be empty"
        );
        *self.refusing.after.lock().unwrap() = Some(marker.to_vec());
    }

    /// Whether the write [`ReplyCutter::fail_after`] refused was a
    /// transaction's `COMMIT`.
    pub fn refused_a_commit(&self) -> bool {
        self.refusing.refused_commit.load(Ordering::SeqCst)
    }

    /// Whether the network is down since a [`ReplyCutter::fail_after`].
    pub fn is_down(&self) -> bool {
        self.refusing.down.load(Ordering::SeqCst)
    }

    /// Ends the failure [`ReplyCutter::fail_after`] or
    /// [`ReplyCutter::go_down`] began.
    pub fn heal(&self) {
        self.refusing.down.store(false, Ordering::SeqCst);
    }

    /// Writes refused so far.
    pub fn refused(&self) -> usize {
        self.refusing.refused.load(Ordering::SeqCst)
    }

    /// Holds every write carrying `marker` from now on: its bytes wait,
    /// unforwarded, until [`ReplyCutter::let_through`].
    pub fn hold(&self, marker: &[u8]) {
        assert!(!marker.is_empty(), "a marker to hold must not be empty");
        self.holding.open.send_replace(false);
        *self.holding.marker.lock().unwrap() = Some(marker.to_vec());
    }

    /// Writes held so far.
    pub fn held(&self) -> usize {
        self.holding.held.load(Ordering::SeqCst)
    }

    /// Forwards the writes held, and holds no more.
    pub fn let_through(&self) {
        *self.holding.marker.lock().unwrap() = None;
        self.holding.open.send_replace(true);
    }
}

impl Drop for ReplyCutter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    marker: Armed,
    cuts: Arc<AtomicUsize>,
    refusing: Refusing,
    holding: Holding,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let cut = Arc::new(AtomicBool::new(false));
    let upward = {
        let cut = cut.clone();
        async move {
            // The last bytes of the previous read, so a marker split
            // across two reads is still seen.
            let mut tail: Vec<u8> = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            // Whether this connection carried the marker to fail after.
            let mut failing = false;
            loop {
                let n = match client_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if failing {
                    // A simple query (`Q`) that commits.
                    let commit = buf[0] == b'Q' && buf[..n].windows(6).any(|w| w == b"COMMIT");
                    refusing.refused_commit.store(commit, Ordering::SeqCst);
                }
                if failing || refusing.down.load(Ordering::SeqCst) {
                    refusing.down.store(true, Ordering::SeqCst);
                    refusing.refused.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                let before = tail.len();
                tail.extend_from_slice(&buf[..n]);
                {
                    let mut after = refusing.after.lock().unwrap();
                    if let Some(m) = after.as_deref() {
                        let from = before.saturating_sub(m.len().saturating_sub(1));
                        if tail[from..].windows(m.len()).any(|w| w == m) {
                            failing = true;
                            *after = None;
                        }
                    }
                }
                if let Some(m) = refusing.marker.lock().unwrap().as_deref() {
                    let from = before.saturating_sub(m.len().saturating_sub(1));
                    if tail[from..].windows(m.len()).any(|w| w == m) {
                        refusing.refused.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                }
                let held = holding.marker.lock().unwrap().clone();
                if let Some(m) = held {
                    let from = before.saturating_sub(m.len().saturating_sub(1));
                    if tail[from..].windows(m.len()).any(|w| w == m) {
                        holding.held.fetch_add(1, Ordering::SeqCst);
                        let mut open = holding.open.subscribe();
                        let _ = open.wait_for(|open| *open).await;
                    }
                }
                {
                    let mut armed = marker.lock().unwrap();
                    if let Some((m, times)) = armed.as_mut() {
                        // Only a match that takes in bytes read now: what
                        // was sent before the relay was armed never counts.
                        let from = before.saturating_sub(m.len().saturating_sub(1));
                        if tail[from..].windows(m.len()).any(|w| w == m.as_slice()) {
                            // Set before the statement is forwarded: the
                            // server cannot answer it before this.
                            cut.store(true, Ordering::SeqCst);
                            *times -= 1;
                            if *times == 0 {
                                *armed = None;
                            }
                        }
                    }
                }
                let keep = tail.len().saturating_sub(256);
                tail.drain(..keep);
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let downward = async move {
        // Whole messages only: a type byte, then a length that counts
        // itself. Once cut, the replies are held back until each
        // `ReadyForQuery`: passed on while the transaction is still open,
        // dropped (and the connection closed) once it has ended.
        let mut pending: Vec<u8> = Vec::new();
        let mut held: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_rx.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            pending.extend_from_slice(&buf[..n]);
            while pending.len() >= 5 {
                let len = u32::from_be_bytes(pending[1..5].try_into().unwrap()) as usize;
                if pending.len() < 1 + len {
                    break;
                }
                let message: Vec<u8> = pending.drain(..1 + len).collect();
                let forward = if cut.load(Ordering::SeqCst) {
                    held.extend_from_slice(&message);
                    if message[0] != b'Z' {
                        continue;
                    }
                    if message[5] == b'I' {
                        // The transaction ended, its commit included: the
                        // reply is lost with the connection.
                        cuts.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    std::mem::take(&mut held)
                } else {
                    message
                };
                if client_tx.write_all(&forward).await.is_err() {
                    return;
                }
            }
        }
    };
    // Whichever side ends first ends the connection: both halves drop.
    tokio::select! {
        _ = upward => {}
        _ = downward => {}
    }
}
