//! Named egress policies by API: the config's are listed read-only beside those an admin
//! defines here (kept in the ledger, read by every node once a second). A template's
//! `egress_allowed` may name a policy that only the API defines; a session switches to it once
//! it exists. Changing or removing a policy applies to the sessions under it within that
//! second (a removed policy allows nothing to the sessions still under it).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use http_util::{ApiError, Json, Query};
use wire::{EgressPolicy, EgressPolicyList, EgressPolicyRules, ErrorCode};

use crate::errors;
use crate::page::{Kind, PageQuery};
use crate::{AppState, Caller};

/// Most rules one policy may hold.
const MAX_RULES: usize = 1024;

fn not_config(s: &AppState, name: &str) -> Result<(), ApiError> {
    if s.config.egress.policies.contains_key(name) {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("egress policy {name:?} is defined by the config (deny-all is built in): change it there"),
        ));
    }
    Ok(())
}

/// `GET /v1/egress/policies`: every policy, the config's and the API's, by name.
#[utoipa::path(get, path = "/v1/egress/policies", tag = "egress", operation_id = "list_egress_policies", summary = "List egress policies", params(PageQuery), responses((status = 200, description = "A page of the named egress policies, by name; `next_cursor` when more follow.", body = wire::EgressPolicyList)))]
pub(crate) async fn list(
    _caller: Caller,
    State(s): State<AppState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<EgressPolicyList>, ApiError> {
    let page = q.page(Kind::EgressPolicies)?;
    let mut policies: Vec<EgressPolicy> = s
        .config
        .egress
        .policies
        .values()
        .map(|p| EgressPolicy { name: p.name.clone(), allow: p.allow.clone(), source: "config".into() })
        .collect();
    for (name, allow) in s.ledger.egress_policies().await.map_err(errors::ledger)? {
        if !s.config.egress.policies.contains_key(&name) {
            policies.push(EgressPolicy { name, allow, source: "api".into() });
        }
    }
    let (policies, next_cursor) = page.take(Kind::EgressPolicies, policies, |p| p.name.clone());
    Ok(Json(EgressPolicyList { policies, next_cursor }))
}

/// `PUT /v1/egress/policies/{name}` (admin): defines or replaces a policy.
#[utoipa::path(put, path = "/v1/egress/policies/{name}", tag = "egress", operation_id = "set_egress_policy", summary = "Define an egress policy (admin)", params(("name" = String, Path, description = "1-64 characters of a-z, 0-9, '-' and '_'.")), request_body = wire::EgressPolicyRules, responses((status = 200, description = "The policy as stored.", body = wire::EgressPolicy)))]
pub(crate) async fn put(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
    Json(body): Json<EgressPolicyRules>,
) -> Result<Json<EgressPolicy>, ApiError> {
    caller.require_admin()?;
    if !config::egress::is_policy_name(&name) {
        return Err(ApiError::bad_request("name: 1-64 characters of a-z, 0-9, '-' and '_'"));
    }
    not_config(&s, &name)?;
    if body.allow.len() > MAX_RULES {
        return Err(ApiError::bad_request(format!("allow: at most {MAX_RULES} rules")));
    }
    config::egress::Policy::new(&name, &body.allow).map_err(|e| ApiError::bad_request(format!("allow: {e}")))?;
    s.ledger.set_egress_policy(&name, &body.allow).await.map_err(errors::ledger)?;
    tracing::info!(by = %caller.tenant, policy = %name, allow = ?body.allow, "egress policy set");
    Ok(Json(EgressPolicy { name, allow: body.allow, source: "api".into() }))
}

/// `DELETE /v1/egress/policies/{name}` (admin): sessions still under it reach nothing.
#[utoipa::path(delete, path = "/v1/egress/policies/{name}", tag = "egress", operation_id = "delete_egress_policy", summary = "Remove an egress policy (admin)", params(("name" = String, Path, description = "An API-defined policy.")), responses((status = 204, description = "Removed.")))]
pub(crate) async fn delete(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin()?;
    not_config(&s, &name)?;
    if !s.ledger.delete_egress_policy(&name).await.map_err(errors::ledger)? {
        return Err(ApiError::not_found(format!("no egress policy {name:?}")));
    }
    tracing::info!(by = %caller.tenant, policy = %name, "egress policy removed");
    Ok(StatusCode::NO_CONTENT)
}
