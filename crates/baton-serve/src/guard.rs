//! Who may use the server. It spends the user's provider keys, and loopback is reachable by
//! every user and process on the machine and, through the browser, by any web page: so every
//! request needs the server's token, a web page (a request with an `Origin`) is refused unless
//! the user named it, and the `Host` header must be a name this server was bound as, which
//! stops DNS rebinding (a page whose own name resolves to 127.0.0.1).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, Service};

/// The rules one server applies to every request.
#[derive(Debug, Clone)]
pub struct Guard {
    /// The bearer token every request must carry; `None` only on loopback (`--no-token`).
    pub token: Option<String>,
    /// The `Host` values accepted; `None` accepts any (a wildcard bind, which needs a token).
    pub hosts: Option<Vec<String>>,
    /// Web origins allowed to call (`--allow-origin`), with CORS headers on their responses.
    pub origins: Vec<String>,
}

/// Whether `host` is a loopback address or name.
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost") || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether `host` binds every interface.
pub fn is_wildcard(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified())
}

/// The `Host` values a server bound to `host:port` answers to: that name, and on loopback the
/// usual names of loopback. `None` for a wildcard bind (any name; the token guards it).
pub fn allowed_hosts(host: &str, port: u16) -> Option<Vec<String>> {
    if is_wildcard(host) {
        return None;
    }
    let with_port = |h: &str| {
        let h = if h.contains(':') && !h.starts_with('[') { format!("[{h}]") } else { h.to_owned() };
        format!("{h}:{port}")
    };
    let mut names = vec![with_port(host)];
    if is_loopback(host) {
        names.extend(["localhost", "127.0.0.1", "::1"].iter().map(|h| with_port(h)));
    }
    names.sort();
    names.dedup();
    Some(names)
}

/// Refuses a bind that would let others spend the keys: no token off loopback.
pub fn check_bind(host: &str, token: bool) -> Result<(), String> {
    if !token && !is_loopback(host) {
        return Err(format!(
            "refusing to serve on {host} without a token: anyone who reaches it could spend your provider keys. \
             Leave out --no-token (Baton keeps a token in the keychain: `baton serve token`), or give one with --token-env VAR"
        ));
    }
    Ok(())
}

/// The fewest characters a token must have on a server that others can reach (off loopback):
/// the keychain's own token has 43 (32 random bytes); a short one chosen by hand could be
/// guessed by anyone who reaches the server.
pub const MIN_TOKEN_CHARS: usize = 32;

/// Refuses a token shorter than [`MIN_TOKEN_CHARS`] on `host` when it is not loopback.
pub fn check_token(host: &str, token: &str) -> Result<(), String> {
    if !is_loopback(host) && token.chars().count() < MIN_TOKEN_CHARS {
        return Err(format!(
            "refusing to serve on {host} with a token of {} characters: off this machine a token needs at least {MIN_TOKEN_CHARS}, or anyone who reaches it could guess it and spend your provider keys. \
             Use the keychain's token (leave out --token-env and [serve] token_env; `baton serve token` prints it), or put a longer one in the variable",
            token.chars().count()
        ));
    }
    Ok(())
}

/// Tokens compared in time that depends neither on where they differ nor on their lengths:
/// their digests are compared, every byte.
fn same(a: &str, b: &str) -> bool {
    use sha2::{Digest, Sha256};
    let (a, b) = (Sha256::digest(a.as_bytes()), Sha256::digest(b.as_bytes()));
    a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token of an `Authorization: Bearer TOKEN` header; the scheme's case does not matter
/// (RFC 9110 §11.1), so `bearer` and `BEARER` are the same.
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// An origin as a browser sends it: no trailing slash, scheme and host in lower case. What the
/// user wrote (`--allow-origin`, `[serve] allow_origins`) is compared in this form.
pub fn normalize_origin(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

fn header(headers: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

pub async fn check(State(service): State<Arc<Service>>, request: Request, next: Next) -> Response {
    let guard = &service.guard;
    let headers = request.headers();
    if let Some(hosts) = &guard.hosts {
        let host = header(headers, header::HOST).unwrap_or_default();
        if !hosts.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return ApiError::forbidden(format!(
                "this server does not answer to the host name {host:?}; call it as {}",
                hosts.first().map_or("its address", String::as_str)
            ))
            .into_response();
        }
    }
    let origin = header(headers, header::ORIGIN).map(str::to_owned);
    if let Some(origin) = &origin {
        if !guard.origins.iter().any(|o| *o == normalize_origin(origin)) {
            return ApiError::forbidden(format!(
                "requests from web pages are refused (Origin {origin}); start the server with --allow-origin {origin} to let that client in"
            ))
            .into_response();
        }
        if request.method() == Method::OPTIONS {
            let mut preflight = cors(StatusCode::NO_CONTENT.into_response(), origin);
            // A client's own headers (the official SDKs send `x-stainless-…` ones) are its
            // business: an origin the user allowed may send whichever it asks for.
            if let Some(asked) = headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS) {
                preflight.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
            }
            preflight.headers_mut().insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
            return preflight;
        }
    }
    if let Some(token) = &guard.token {
        let given = header(headers, header::AUTHORIZATION).and_then(bearer);
        match given {
            None => {
                return ApiError::unauthorized(
                    "no token: send the header `Authorization: Bearer TOKEN` (`baton serve token` prints this server's token)",
                )
                .into_response();
            }
            Some(given) if !same(given, token) => {
                return ApiError::unauthorized("the token is not this server's (`baton serve token` prints it)")
                    .into_response();
            }
            Some(_) => {}
        }
    }
    let response = next.run(request).await;
    match &origin {
        Some(origin) => cors(response, origin),
        None => response,
    }
}

/// CORS headers for an allowed web client.
fn cors(mut response: Response, origin: &str) -> Response {
    let h = response.headers_mut();
    if let Ok(origin) = HeaderValue::from_str(origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    }
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static(
            "authorization, content-type, x-baton-conversation, x-baton-max-cost-usd, x-baton-max-tokens",
        ),
    );
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("x-baton-run-id, x-baton-cost-usd, x-should-retry, retry-after"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_binds_answer_to_loopback_names_only() {
        let hosts = allowed_hosts("127.0.0.1", 8765).unwrap();
        assert!(hosts.contains(&"localhost:8765".to_owned()) && hosts.contains(&"[::1]:8765".to_owned()));
        assert!(!hosts.iter().any(|h| h.starts_with("evil")));
        assert_eq!(allowed_hosts("0.0.0.0", 8765), None);
        assert_eq!(allowed_hosts("192.168.1.5", 80).unwrap(), vec!["192.168.1.5:80".to_owned()]);
    }

    #[test]
    fn no_token_is_for_loopback_only() {
        assert!(check_bind("127.0.0.1", false).is_ok());
        assert!(check_bind("::1", false).is_ok());
        let refused = check_bind("0.0.0.0", false).unwrap_err();
        assert!(refused.contains("--no-token") && refused.contains("--token-env"), "{refused}");
        assert!(check_bind("0.0.0.0", true).is_ok());
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd") && !same("abc", "ab") && !same("", "a") && !same("abc", "abcd"));
    }

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        assert_eq!(bearer("Bearer tok"), Some("tok"));
        assert_eq!(bearer("bearer tok"), Some("tok"));
        assert_eq!(bearer("BEARER  tok "), Some("tok"));
        assert_eq!(bearer("Basic dG9r"), None);
        assert_eq!(bearer("Bearertok"), None);
    }

    #[test]
    fn origins_are_compared_as_browsers_send_them() {
        assert_eq!(normalize_origin("https://x.example/"), "https://x.example");
        assert_eq!(normalize_origin(" HTTP://LocalHost:3000 "), "http://localhost:3000");
    }
}
