//! Size bounds on what a tenant stores, as HTTP answers: a size over its bound is 413
//! `payload_too_large`, a bad name or count 400, each naming the field and the bound
//! (`wire::limits` holds the bounds, so every route checks them the same way).

use std::collections::BTreeMap;

use http_util::ApiError;
use wire::ErrorCode;

/// An env of a function: names, count, bytes per variable and in all.
pub(crate) fn env(env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    answer(wire::limits::env_problem(env))
}

/// What a template made from an image stores: its env and workdir.
pub(crate) fn template(t: &wire::images::CreateTemplate) -> Result<(), ApiError> {
    answer(wire::limits::template_problem(t))
}

fn answer(problem: Option<wire::limits::EnvProblem>) -> Result<(), ApiError> {
    match problem {
        None => Ok(()),
        Some(p) if p.too_large => Err(ApiError::new(ErrorCode::PayloadTooLarge, p.message)),
        Some(p) => Err(ApiError::bad_request(p.message)),
    }
}

/// A stored object's size against its bound: 413 naming `field` and the bound.
pub(crate) fn size(field: &str, bytes: usize, max: usize) -> Result<(), ApiError> {
    if bytes > max {
        return Err(ApiError::new(ErrorCode::PayloadTooLarge, format!("{field}: at most {max} bytes ({bytes} given)")));
    }
    Ok(())
}
