//! The answer a job commits: what is stored, replayed to every duplicate,
//! and never changed once committed.

use bytes::Bytes;

/// A response as it is committed and replayed: status, end-to-end headers
/// (hop-by-hop ones already removed) and the whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Header names (lower case) and raw values, in upstream order.
    pub headers: Vec<(String, Bytes)>,
    /// The body bytes, exactly as the upstream sent them.
    pub body: Bytes,
}
