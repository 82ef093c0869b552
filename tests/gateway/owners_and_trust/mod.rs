//! Whose key it is and what the gateway trusts: owners, defences of its listeners (HTTP/1 and HTTP/2), TLS to upstreams, and its memory budget.

mod budget;
mod defences;
mod http2_listener;
mod owners;
mod tls;
