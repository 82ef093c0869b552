//! Whose key it is and what the gateway trusts: owners, defences, upstream TLS, its budget.

mod budget;
mod credentials;
mod defences;
mod evidence;
mod forwarded;
mod http2_listener;
mod jwt_claims;
mod owners;
mod send_timeout;
mod tls;
