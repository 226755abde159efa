//! A token budget for an LLM gateway: a request's cost (the tokens it will generate) is known
//! only after the response. Reserve, then settle:
//!
//! - each request reserves its `max_tokens` (the `x-max-tokens` header, default 256) from the
//!   tenant's budget of 10,000 tokens a minute, before it runs; a request asking for more than
//!   the budget is a 413;
//! - the handler reports the tokens it generated in `x-tokens-used`;
//! - after the response the reservation is settled at that count: the unused tokens go back
//!   through the reservation's receipt, so the budget counts exactly the tokens generated and is
//!   never passed (a reservation is the most a request can cost);
//! - a process that dies mid-request leaves its reservation spent: never more than the budget.
//!
//! ```text
//! cargo run --example llm_tokens
//! curl -i -H 'x-api-key: tenant-1' -H 'x-max-tokens: 500' -d 'tell me a story' http://127.0.0.1:3004/v1/completions
//! ```

use std::net::SocketAddr;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::{routing::post, Router};
use fleetlimit::layer::{Scope, Settle};
use fleetlimit::{
    key, ConfigError, HeaderStyle, Limiter, MemoryStore, Quota, RateLimitLayer, Rule, Store,
};

/// Tokens a request reserves when it does not say.
pub const DEFAULT_MAX_TOKENS: u64 = 256;

/// The most tokens a request may generate: its `x-max-tokens`.
fn max_tokens(headers: &HeaderMap) -> u64 {
    headers
        .get("x-max-tokens")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(DEFAULT_MAX_TOKENS)
}

/// The model: as many tokens as the prompt has bytes, times three, at most `max_tokens`
/// (a stand-in: any count known only once the answer is written).
async fn complete(headers: HeaderMap, prompt: String) -> impl IntoResponse {
    let used = (prompt.len() as u64 * 3).min(max_tokens(&headers));
    (
        StatusCode::OK,
        [("x-tokens-used", used.to_string())],
        format!("{used} tokens\n"),
    )
}

/// The gateway, with each tenant's token budget on `store`.
pub fn app<S: Store + fleetlimit::InfallibleStore>(
    store: S,
) -> Result<(Router, Limiter), ConfigError> {
    let limiter = Limiter::builder(store)
        .rule(Rule::new("tokens", Quota::per_minute(10_000).build()?)?)
        .build()?;
    let layer = RateLimitLayer::builder(limiter.clone())
        .key(key::header("x-api-key"))
        .scope(
            "tokens",
            Scope::new()
                .cost(|parts| max_tokens(&parts.headers))
                .settle(Settle::header("x-tokens-used")),
        )
        .cost_exceeds_limit_status(StatusCode::PAYLOAD_TOO_LARGE)
        .headers(HeaderStyle::Ietf)
        .build()?;
    let app = Router::new()
        .route("/v1/completions", post(complete))
        .layer(layer);
    Ok((app, limiter))
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let (app, _) = app(MemoryStore::new()).map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3004")
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "listening on http://{}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await
    .map_err(|e| e.to_string())
}
