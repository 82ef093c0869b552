//! HTTP/2 on a raw socket, frame by frame: enough to open a connection the
//! way a client with prior knowledge does and watch what the server sends
//! (settings, pings, GOAWAY) without a client library answering for it.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
const ACK: u8 = 0x1;

/// One frame: its type, flags and payload.
#[derive(Debug)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub payload: Vec<u8>,
}

/// A frame's header and payload, as bytes.
fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend_from_slice(&[kind, flags, 0, 0, 0, 0]);
    out.extend_from_slice(payload);
    out
}

/// A connection that sent the preface and its (empty) settings.
pub struct RawH2 {
    pub stream: TcpStream,
}

impl RawH2 {
    /// Connects to `authority`, sends the preface and empty settings, and
    /// settles: acknowledges the server's settings and sees its
    /// acknowledgement of ours (10 s at most).
    pub async fn open(authority: &str) -> RawH2 {
        let mut stream = TcpStream::connect(authority).await.unwrap();
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, &[]));
        stream.write_all(&hello).await.unwrap();
        let mut conn = RawH2 { stream };
        let settle = async {
            let (mut theirs, mut acked) = (false, false);
            while !(theirs && acked) {
                let f = conn
                    .frame()
                    .await
                    .expect("the server closed while settling");
                if f.kind == SETTINGS && f.flags & ACK == 0 {
                    conn.stream
                        .write_all(&frame(SETTINGS, ACK, &[]))
                        .await
                        .unwrap();
                    theirs = true;
                }
                acked |= f.kind == SETTINGS && f.flags & ACK != 0;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), settle)
            .await
            .expect("HTTP/2 settings not exchanged within 10 s");
        conn
    }

    /// The next frame; `None` once the server has closed the connection.
    pub async fn frame(&mut self) -> Option<Frame> {
        let mut head = [0u8; 9];
        if self.stream.read_exact(&mut head).await.is_err() {
            return None;
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload).await.ok()?;
        Some(Frame {
            kind: head[3],
            flags: head[4],
            payload,
        })
    }

    /// Every frame until the server closes the connection, within `limit`
    /// (panics if it is still open then).
    pub async fn until_closed(&mut self, limit: Duration) -> Vec<Frame> {
        let read = async {
            let mut frames = Vec::new();
            while let Some(f) = self.frame().await {
                frames.push(f);
            }
            frames
        };
        tokio::time::timeout(limit, read)
            .await
            .unwrap_or_else(|_| panic!("the server kept the connection open past {limit:?}"))
    }
}
