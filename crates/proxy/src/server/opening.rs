//! How a connection opens: HTTP/2 with prior knowledge sends the
//! connection preface (RFC 9113 §3.4) first, anything else is HTTP/1.
//!
//! The first bytes are peeked at, not consumed, which is all it takes when
//! they arrived together (nearly always). When only part of the preface has
//! arrived, the rest is *read* as it comes, waking only when the socket has
//! bytes: peeking again would find the same bytes at once and spin. What
//! was read is handed back to the protocol's reader first ([`Prefixed`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// HTTP/2's connection preface, which a client that knows the gateway
/// speaks HTTP/2 sends first.
pub(super) const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A connection whose protocol its first bytes showed.
pub(super) struct Opened {
    /// Whether it opened with the HTTP/2 preface.
    pub(super) http2: bool,
    /// The connection, with any bytes read to tell.
    pub(super) io: Prefixed,
}

/// Tells HTTP/2 from HTTP/1 by the first bytes of `stream`.
///
/// Peeking rather than reading in the common case: hyper-util's automatic
/// version detection reads the first bytes itself and hands them to the
/// HTTP/1 reader as a separate first read, which makes hyper grow its
/// connection's 8 KiB read buffer to 16 KiB for every HTTP/1 connection;
/// peeking leaves the whole request to one read (docs/performance.md,
/// item 11).
pub(super) async fn sniff(mut stream: TcpStream) -> io::Result<Opened> {
    let mut first = [0u8; PREFACE.len()];
    let n = stream.peek(&mut first).await?;
    if n == 0 || first[..n] != PREFACE[..n] {
        // HTTP/1 (or a closed connection, which hyper then sees).
        return Ok(Opened::new(false, Bytes::new(), stream));
    }
    if n == PREFACE.len() {
        return Ok(Opened::new(true, Bytes::new(), stream));
    }
    // Part of the preface: read the rest as it comes, never past it.
    let mut read = Vec::with_capacity(PREFACE.len());
    while read.len() < PREFACE.len() {
        let mut more = [0u8; PREFACE.len()];
        let wanted = PREFACE.len() - read.len();
        let got = stream.read(&mut more[..wanted]).await?;
        read.extend_from_slice(&more[..got]);
        if got == 0 || read[..] != PREFACE[..read.len()] {
            return Ok(Opened::new(false, read.into(), stream));
        }
    }
    Ok(Opened::new(true, read.into(), stream))
}

impl Opened {
    fn new(http2: bool, prefix: Bytes, inner: TcpStream) -> Self {
        Opened {
            http2,
            io: Prefixed { prefix, inner },
        }
    }
}

/// A connection whose first bytes were already read: they are read again
/// first.
pub(super) struct Prefixed {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.prefix.is_empty() {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let n = self.prefix.len().min(buf.remaining());
        buf.put_slice(&self.prefix[..n]);
        self.prefix.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    async fn read_some(io: &mut Prefixed, n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n];
        io.read_exact(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn an_http1_request_is_told_from_its_first_bytes_and_left_unread() {
        let (mut client, server) = pair().await;
        client
            .write_all(b"POST /v1/charges HTTP/1.1\r\n")
            .await
            .unwrap();
        let mut opened = sniff(server).await.unwrap();
        assert!(!opened.http2);
        assert!(opened.io.prefix.is_empty(), "nothing consumed");
        assert_eq!(read_some(&mut opened.io, 16).await, b"POST /v1/charges");
    }

    #[tokio::test]
    async fn a_preface_arriving_in_pieces_is_http2_and_read_again_whole() {
        let (mut client, server) = pair().await;
        client.write_all(&PREFACE[..9]).await.unwrap();
        let sniffing = tokio::spawn(sniff(server));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!sniffing.is_finished(), "half a preface decides nothing");
        client.write_all(&PREFACE[9..]).await.unwrap();
        client.write_all(b"\0\0\0\x04").await.unwrap();
        let mut opened = sniffing.await.unwrap().unwrap();
        assert!(opened.http2);
        let again = read_some(&mut opened.io, PREFACE.len() + 4).await;
        assert_eq!(&again[..PREFACE.len()], PREFACE, "the preface, then");
        assert_eq!(&again[PREFACE.len()..], b"\0\0\0\x04", "what followed it");
    }

    #[tokio::test]
    async fn a_start_like_the_preface_that_turns_out_http1_is_read_again() {
        let (mut client, server) = pair().await;
        client.write_all(b"PR").await.unwrap();
        let sniffing = tokio::spawn(sniff(server));
        tokio::time::sleep(Duration::from_millis(20)).await;
        client.write_all(b"OPFIND / HTTP/1.1\r\n").await.unwrap();
        let mut opened = sniffing.await.unwrap().unwrap();
        assert!(!opened.http2);
        assert_eq!(read_some(&mut opened.io, 10).await, b"PROPFIND /");
    }

    #[tokio::test]
    async fn a_connection_closed_before_a_byte_is_not_http2() {
        let (client, server) = pair().await;
        drop(client);
        assert!(!sniff(server).await.unwrap().http2);
    }
}
