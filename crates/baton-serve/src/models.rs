//! `GET /v1/models` and `GET /v1/models/{id}`, in OpenAI's shape.
//!
//! A worker's model id is `baton/` and its name as the pool spells it; in a URL path (only
//! `GET /v1/models/{id}` puts one there) it is percent-encoded like any other path text.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use serde_json::{Value, json};

use crate::{ApiError, Service};

fn model(service: &Service, id: &str) -> Value {
    json!({ "id": id, "object": "model", "created": service.created, "owned_by": "baton" })
}

pub async fn list(State(service): State<Arc<Service>>) -> Json<Value> {
    let data: Vec<Value> = service.model_ids().iter().map(|id| model(&service, id)).collect();
    Json(json!({ "object": "list", "data": data }))
}

pub async fn one(State(service): State<Arc<Service>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    service.target(&id)?;
    Ok(Json(model(&service, &id)))
}
