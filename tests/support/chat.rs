//! Fake OpenAI-compatible chat providers: each answers a chat completion in
//! JSON mode, or drifts from the contract in a chosen way, optionally after
//! waiting at a gate or a barrier.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::Response;
use http_body_util::Full;
use tokio::sync::Barrier;

use super::upstream::{json_response, FakeUpstream, Gate, Recorded};

/// How a provider answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drift {
    /// Honours the contract.
    None,
    /// `created` a date string, not the integer the contract says.
    WrongType,
    /// `choices` is missing.
    MissingField,
    /// Prose instead of the JSON-mode answer.
    Prose,
    /// Valid JSON in the contract's shape, with the wrong answer (Lyon).
    WrongAnswer,
    /// Right on odd requests, wrong on even ones (counting every request
    /// it receives).
    Flapping,
    /// Right, but its prompt counts 400 tokens: the template rendered
    /// wrongly on its side.
    LongPrompt,
}

/// When a provider answers.
#[derive(Clone)]
pub enum Timing {
    Now,
    /// After the gate opens (only chat requests; probes answer at once).
    Gate(Gate),
    /// When every party of the barrier has a request in hand.
    Barrier(Arc<Barrier>),
}

pub struct Provider {
    pub upstream: FakeUpstream,
    drift: Arc<Mutex<Drift>>,
}

impl Provider {
    pub async fn start(name: &'static str, drift: Drift, timing: Timing) -> Provider {
        let drift = Arc::new(Mutex::new(drift));
        let upstream = {
            let drift = drift.clone();
            FakeUpstream::start(move |r: Recorded| {
                let drift = drift.clone();
                let timing = timing.clone();
                async move {
                    // Probes carry no idempotency key; they are answered at once.
                    if r.header("idempotency-key").is_some() {
                        match timing {
                            Timing::Now => {}
                            Timing::Gate(gate) => gate.pass().await,
                            Timing::Barrier(barrier) => {
                                barrier.wait().await;
                            }
                        }
                    }
                    let drift = *drift.lock().unwrap();
                    completion(name, &r, drift)
                }
            })
            .await
        };
        Provider { upstream, drift }
    }

    pub fn set(&self, drift: Drift) {
        *self.drift.lock().unwrap() = drift;
    }

    pub fn url(&self) -> String {
        self.upstream.url()
    }

    /// Chat requests received (probes not counted).
    pub fn calls(&self) -> Vec<Recorded> {
        self.upstream
            .recorded()
            .into_iter()
            .filter(|r| r.header("idempotency-key").is_some())
            .collect()
    }

    /// Probe requests received.
    pub fn probes(&self) -> usize {
        self.upstream.recorded().len() - self.calls().len()
    }
}

fn completion(name: &str, r: &Recorded, drift: Drift) -> Response<Full<Bytes>> {
    let wrong =
        drift == Drift::WrongAnswer || (drift == Drift::Flapping && r.hit.is_multiple_of(2));
    let city = if wrong { "Lyon" } else { "Paris" };
    let content = match drift {
        Drift::Prose => "The capital of France is Paris.".to_owned(),
        _ => serde_json::json!({"answer": format!("{city}, says {name}")}).to_string(),
    };
    let prompt_tokens = if drift == Drift::LongPrompt { 400 } else { 20 };
    let mut body = serde_json::json!({
        "id": format!("chatcmpl-{name}-{}", r.hit),
        "object": "chat.completion",
        "created": 1_764_000_000,
        "model": name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop"
        }],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5}
    });
    match drift {
        Drift::WrongType => body["created"] = serde_json::json!("2025-11-24T00:00:00Z"),
        Drift::MissingField => {
            body.as_object_mut().unwrap().remove("choices");
        }
        _ => {}
    }
    json_response(200, body)
}
