//! Whose key it is and what the gateway trusts: owners, defences, upstream TLS, its budget.

mod budget;
mod credentials;
mod defences;
mod http2_listener;
mod owners;
mod tls;
