//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status its SDKs map to their error classes (400 `BadRequestError`, 401
//! `AuthenticationError`, 404 `NotFoundError`, 429 `RateLimitError`, …). Messages never carry
//! a key or a path on this machine.

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// One refusal or failure, as a client sees it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, …
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (429).
    pub retry_after: Option<u64>,
    /// Whether the same request may succeed later without spending twice: only when no run
    /// started (a full server). Otherwise the response says `x-should-retry: false`, which the
    /// official SDKs obey; by default they retry 408, 409, 429 and 5xx twice.
    pub retry: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None, retry: false }
    }

    /// 400: the request asks for something Baton does not do, or is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn bad_field(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_owned()), ..Self::bad_request(message) }
    }

    /// 401: no token, or not this server's.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message)
        }
    }

    /// 403: a request from a web page or a name this server does not answer to.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "permission_error", message)
    }

    /// 404: no such model (or route).
    pub fn not_found(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            param: param.map(str::to_owned),
            code: Some("model_not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }

    /// 405: the route exists, but not for this method (axum adds the `Allow` header).
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message)
    }

    /// 422: an `Idempotency-Key` sent again with another request.
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request_error", message)
    }

    /// 413: the body is over the server's limit.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", message)
    }

    /// 429: the server is full; the same request may go through after `retry_after` seconds.
    pub fn busy(message: impl Into<String>, retry_after: Option<u64>) -> Self {
        ApiError { retry_after, retry: true, ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message) }
    }

    /// 429: a spending cap is reached; the same request would be refused again (or, run
    /// again, spend again), so clients are told not to retry.
    pub fn capped(message: impl Into<String>, retry_after: Option<u64>) -> Self {
        ApiError { retry_after, ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message) }
    }

    /// 502: the run ended without an answer (its last step failed, the conductor failed).
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "server_error", message)
    }

    /// 504: the answer's step ran out of time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "server_error", message)
    }

    /// 500: Baton itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body (also sent as the last event of a stream that fails).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code }
        })
    }
}

impl ApiError {
    /// The response for this error with `body` (its [`ApiError::body`], plus whatever a
    /// caller adds) and its headers.
    pub fn into_response_with(self, body: serde_json::Value) -> Response {
        let mut response = (self.status, axum::Json(body)).into_response();
        let headers = response.headers_mut();
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        let retry = if self.retry { "true" } else { "false" };
        headers.insert(HeaderName::from_static("x-should-retry"), HeaderValue::from_static(retry));
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        self.into_response_with(body)
    }
}
