//! Templates made from images (`POST /v1/templates`, read, list, delete) and the image corpus
//! on the nodes (`POST /v1/images:prefetch`, `GET /v1/images`). A template is resolved to its
//! image's digest when it is made (a node asks the registry), so a tag that moves later never
//! changes what it runs; the node that first needs the image pulls it.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{Method, StatusCode};
use http_util::{ApiError, Json, Query};
use ledger::Cost;
use wire::images::{
    CreateTemplate, ImagePull, ImageTemplate, ImagesView, NodeImages, PUBLIC_NAMESPACE, PrefetchRequest, Prefetched,
};
use wire::internal::{PullImages, PullStates, ResolveImage, ResolvedImage};
use wire::{ErrorCode, TemplateInfo, TemplateList};

use crate::errors;
use crate::nodes::{NodeRequest, call_json};
use crate::page::{Kind, PageQuery};
use crate::quotas;
use crate::{AppState, Caller};

/// Asking a registry for a digest: quick, or it is down.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(30);
/// Starting pulls answers at once (they run on in the node).
const PULL_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The namespace of the templates `caller` makes: its principal path, or `public` for admins.
fn namespace(caller: &Caller) -> &str {
    if caller.admin { PUBLIC_NAMESPACE } else { &caller.tenant }
}

/// Whether `caller` may use (and see) the template made from an image `t`.
fn visible(caller: &Caller, t: &ImageTemplate) -> bool {
    t.owner.as_ref().is_none_or(|o| *o == caller.tenant)
}

/// The template a sandbox of `t` runs (`None` if its base left the config).
fn runs(s: &AppState, t: &ImageTemplate) -> Option<config::Template> {
    Some(config::Template::from_image(s.config.templates.get(&t.base)?, t))
}

/// The template made from an image `name` that `caller` may use, with what its sandboxes run;
/// `None`: no such template for this caller.
pub(crate) async fn usable(
    s: &AppState,
    caller: &Caller,
    name: &str,
) -> Result<Option<(ImageTemplate, config::Template)>, ApiError> {
    let t = s.ledger.image_template(name).await.map_err(errors::ledger)?;
    Ok(t.filter(|t| visible(caller, t)).and_then(|t| {
        let run = runs(s, &t)?;
        Some((t, run))
    }))
}

/// A template made from an image as the API shows it: what it runs, whose, made from what.
fn info(t: &ImageTemplate, run: config::Template) -> TemplateInfo {
    TemplateInfo { owner: t.owner.clone(), source: Some(t.source.clone()), ..run.info() }
}

#[utoipa::path(post, path = "/v1/templates", tag = "templates", operation_id = "create_template", summary = "Make a template from an image", request_body = wire::images::CreateTemplate, responses((status = 201, description = "The template, its image pinned to the digest its registry has now. A tenant's is private (`<principal>/<name>`), an admin's public (`public/<name>`).", body = wire::TemplateInfo)))]
pub(crate) async fn create(
    caller: Caller,
    State(s): State<AppState>,
    Json(req): Json<CreateTemplate>,
) -> Result<(StatusCode, Json<TemplateInfo>), ApiError> {
    wire::images::valid_reference(&req.image).map_err(|e| ApiError::bad_request(format!("image: {e}")))?;
    allowed_registry(&s, &caller, &req.image)?;
    let name_part = match &req.name {
        Some(n) if wire::images::valid_name(n) => n.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(format!(
                "name: must be 1-{} characters of a-z, 0-9, '-' and '_'",
                wire::images::MAX_TEMPLATE_NAME
            )));
        }
        None => format!("img-{:016x}", rand::random::<u64>()),
    };
    let base_name = req.base.clone().unwrap_or_else(|| s.config.images.base.clone());
    let Some(base) = s.config.templates.get(&base_name) else {
        return Err(ApiError::new(ErrorCode::UnknownTemplate, format!("base: no configured template {base_name:?}")));
    };
    // A base's runtime, user and network become the template's: tenants start from the bases
    // the operator offers them.
    if !caller.admin && !s.config.images.bases.contains(&base_name) {
        return Err(ApiError::bad_request(format!(
            "base: {base_name:?} is not one of images.bases ({})",
            s.config.images.bases.join(", ")
        )));
    }
    if base.egress.is_some() {
        return Err(ApiError::bad_request(format!("base: {base_name:?} uses named egress; pick another base")));
    }
    if req.beyond_base && !caller.admin {
        return Err(ApiError::forbidden("beyond_base: going past the base's envelope needs the admin scope"));
    }
    // Every node keeps every template in memory and every gateway lists them: bounded.
    crate::limits::template(&req)?;
    let granted = config::envelope::grant(base, &req, req.beyond_base)
        .map_err(|r| ApiError::bad_request(format!("{}: {}", r.field, r.message)))?;
    let name = format!("{}/{name_part}", namespace(&caller));
    if s.ledger.image_template(&name).await.map_err(errors::ledger)?.is_some() {
        return Err(ApiError::new(ErrorCode::Conflict, format!("name: a template {name:?} exists; delete it first")));
    }

    // A tenant's template holds one unit of its `private_templates` quota while it exists.
    let lease = ledger::image_template_lease(&name);
    let owner = (!caller.admin).then(|| caller.tenant.clone());
    if owner.is_some() {
        let cost = Cost { private_templates: 1, ..Cost::default() };
        quotas::admit(&s, &caller, &lease, cost, false, RESOLVE_TIMEOUT.as_millis() as u64, 0).await?;
    }
    let made = async {
        let image = resolve(&s, &req.image, owner.as_deref()).await?;
        let t = ImageTemplate {
            name: name.clone(),
            owner: owner.clone(),
            base: base_name.clone(),
            source: req.image.clone(),
            image,
            cpus: granted.cpus,
            cpu_period_ms: granted.cpu_period.as_millis() as u64,
            memory_mb: granted.memory_mb,
            disk_mb: granted.disk_mb,
            pids: granted.pids,
            workdir: granted.workdir,
            env: req.env.clone(),
            network: granted.network,
            ports: granted.ports,
            created_ms: s.ledger.now_ms().await.map_err(errors::ledger)?,
            beyond_base: req.beyond_base,
        };
        if !s.ledger.put_image_template(&t).await.map_err(errors::ledger)? {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("name: a template {name:?} exists; delete it first"),
            ));
        }
        Ok(t)
    };
    let t = match made.await {
        Ok(t) => t,
        Err(e) => {
            // A conflict lost a race with a create of the same name: the lease (named by the
            // template, admission is idempotent) is the winner's now, not ours to give back.
            if owner.is_some() && e.code != ErrorCode::Conflict {
                quotas::give_back(&s, &caller, &lease).await;
            }
            return Err(e);
        }
    };
    tracing::info!(tenant = %caller.tenant, template = %t.name, image = %t.image, "template made from an image");
    // The base was checked above; a config without it would not have started.
    let run = config::Template::from_image(base, &t);
    Ok((StatusCode::CREATED, Json(info(&t, run))))
}

/// A tenant names only what the config allows it (`images.allowed_registries` and the scopes
/// on its path): nodes contact whatever host a reference names, with the credentials of the
/// tenant's scope. Anything else answers as an image that does not exist.
fn allowed_registry(s: &AppState, caller: &Caller, reference: &str) -> Result<(), ApiError> {
    if caller.admin || s.config.images.may_name(&caller.tenant, reference) {
        return Ok(());
    }
    Err(ApiError::new(ErrorCode::ImageNotFound, wire::images::not_found_message(reference)))
}

/// `reference` pinned to the digest its registry has now, asked through a node (which holds
/// the registry credentials).
async fn resolve(s: &AppState, reference: &str, principal: Option<&str>) -> Result<String, ApiError> {
    let nodes = s.nodes.ids().await?;
    let Some(node) = nodes.first() else {
        return Err(ApiError::unavailable("no node has registered yet", 2));
    };
    let call = NodeRequest::new(Method::POST, "/internal/v1/images:resolve".into(), RESOLVE_TIMEOUT)
        .json(&ResolveImage { image: reference.to_string(), principal: principal.map(String::from) })?;
    let r: ResolvedImage = call_json(s.nodes.as_ref(), node, call).await?;
    Ok(r.image)
}

/// The templates the caller can create sessions from: configured ones, public ones made from
/// images, and its own.
#[utoipa::path(get, path = "/v1/templates", tag = "templates", operation_id = "list_templates", summary = "List templates", params(PageQuery), responses((status = 200, description = "A page of the configured templates, public templates made from images, and the caller's own, by name; `next_cursor` when more follow.", body = TemplateList)))]
pub(crate) async fn list(
    caller: Caller,
    State(s): State<AppState>,
    Query(q): Query<PageQuery>,
) -> Result<Json<TemplateList>, ApiError> {
    let page = q.page(Kind::Templates)?;
    let mut templates: Vec<TemplateInfo> = s.config.templates.values().map(|t| t.info()).collect();
    let (_, made) = s.ledger.image_templates().await.map_err(errors::ledger)?;
    templates.extend(made.iter().filter(|t| visible(&caller, t)).filter_map(|t| Some(info(t, runs(&s, t)?))));
    let (templates, next_cursor) = page.take(Kind::Templates, templates, |t| t.name.clone());
    Ok(Json(TemplateList { templates, next_cursor }))
}

#[utoipa::path(get, path = "/v1/templates/{*name}", tag = "templates", operation_id = "get_template", summary = "Read a template", params(("name" = String, Path, description = "A template's name (`<namespace>/<name>` for one made from an image; may contain slashes).")), responses((status = 200, description = "The template.", body = wire::TemplateInfo)))]
pub(crate) async fn get(
    caller: Caller,
    State(s): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<TemplateInfo>, ApiError> {
    if let Some(t) = s.config.templates.get(&name) {
        return Ok(Json(t.info()));
    }
    let found = usable(&s, &caller, &name).await?;
    found.map(|(t, run)| Json(info(&t, run))).ok_or_else(|| ApiError::not_found(format!("no template {name:?}")))
}

/// Deletes a template made from an image (its owner, or an admin for public ones). Sessions
/// that run it go on; its image goes when the node's disk budget needs the room.
pub(crate) async fn delete(s: &AppState, caller: &Caller, name: &str) -> Result<(), ApiError> {
    let t = s.ledger.image_template(name).await.map_err(errors::ledger)?;
    let allowed = t.as_ref().is_some_and(|t| match &t.owner {
        Some(o) => *o == caller.tenant,
        None => caller.admin,
    });
    if !allowed {
        // Public templates are visible to all, but deleting one needs the admin scope.
        return match t {
            Some(t) if visible(caller, &t) => Err(ApiError::forbidden("public templates are deleted by an admin")),
            _ => Err(ApiError::not_found(format!("no template {name:?}"))),
        };
    }
    if let Some(t) = s.ledger.delete_image_template(name).await.map_err(errors::ledger)?
        && t.owner.is_some()
    {
        quotas::give_back(s, caller, &ledger::image_template_lease(name)).await;
    }
    tracing::info!(tenant = %caller.tenant, template = %name, "template made from an image deleted");
    Ok(())
}

#[utoipa::path(post, path = "/v1/images:prefetch", tag = "templates", operation_id = "prefetch_images", summary = "Pull images onto nodes ahead of their sessions", request_body = wire::images::PrefetchRequest, responses((status = 202, description = "The pulls run on in the nodes; each image's state on its node now.", body = wire::images::Prefetched)))]
pub(crate) async fn prefetch(
    caller: Caller,
    State(s): State<AppState>,
    Json(req): Json<PrefetchRequest>,
) -> Result<(StatusCode, Json<Prefetched>), ApiError> {
    if req.templates.len() + req.images.len() > wire::images::MAX_PREFETCH {
        return Err(ApiError::bad_request(format!("at most {} templates and images", wire::images::MAX_PREFETCH)));
    }
    if !req.images.is_empty() {
        caller
            .require_admin()
            .map_err(|_| ApiError::forbidden("images: naming images needs the admin scope; name templates"))?;
    }
    let mut images = Vec::new();
    for name in &req.templates {
        images.push(template_image(&s, &caller, name).await?);
    }
    for r in &req.images {
        wire::images::valid_reference(r).map_err(|e| ApiError::bad_request(format!("images: {r:?}: {e}")))?;
        images.push(resolve(&s, r, None).await?);
    }
    images.sort();
    images.dedup();
    let pulls = pull_onto_nodes(&s, &images, req.nodes.as_deref()).await?;
    Ok((StatusCode::ACCEPTED, Json(Prefetched { pulls })))
}

/// The image of a template made from an image that `caller` may use (400 for a configured one:
/// its image is the operator's, on every node already).
pub(crate) async fn template_image(s: &AppState, caller: &Caller, name: &str) -> Result<String, ApiError> {
    let unknown = || ApiError::new(ErrorCode::UnknownTemplate, format!("templates: no template named {name:?}"));
    if s.config.templates.contains_key(name) {
        return Err(ApiError::bad_request(format!(
            "templates: {name:?} is configured; its image is on every node already"
        )));
    }
    usable(s, caller, name).await?.map(|(t, _)| t.image).ok_or_else(unknown)
}

/// Starts pulls of `images`: onto `nodes` if named, else each onto one node: one that holds it
/// already, or its place by rendezvous hashing (so images spread over the nodes, and the same
/// image goes to the same node every time).
pub(crate) async fn pull_onto_nodes(
    s: &AppState,
    images: &[String],
    nodes: Option<&[String]>,
) -> Result<Vec<ImagePull>, ApiError> {
    let live = s.nodes.ids().await?;
    if live.is_empty() {
        return Err(ApiError::unavailable("no node has registered yet", 2));
    }
    if let Some(bad) = nodes.and_then(|ns| ns.iter().find(|n| !live.contains(n))) {
        return Err(ApiError::bad_request(format!("nodes: no node {bad:?} is registered")));
    }
    let mut per_node: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for image in images {
        let targets: Vec<String> = match nodes {
            Some(ns) => ns.to_vec(),
            None => {
                let holding = s.ledger.holding(&live, image).await.map_err(errors::ledger)?;
                match live.iter().zip(holding).find(|(_, h)| *h) {
                    Some((n, _)) => vec![n.clone()],
                    None => vec![wire::images::rendezvous(&live, image).unwrap_or_default().to_string()],
                }
            }
        };
        for n in targets {
            per_node.entry(n).or_default().push(image.clone());
        }
    }
    let mut out = Vec::new();
    for (node, images) in per_node {
        let call = NodeRequest::new(Method::POST, "/internal/v1/images:pull".into(), PULL_CALL_TIMEOUT)
            .json(&PullImages { images })?;
        let states: PullStates = call_json(s.nodes.as_ref(), &node, call).await?;
        out.extend(states.images);
    }
    Ok(out)
}

#[utoipa::path(get, path = "/v1/images", tag = "operations", operation_id = "list_images", summary = "The pulled images each node holds (admin)", responses((status = 200, description = "Per node, the images of templates made from images that it holds.", body = wire::images::ImagesView)))]
pub(crate) async fn images(caller: Caller, State(s): State<AppState>) -> Result<Json<ImagesView>, ApiError> {
    caller.require_admin()?;
    let mut ids = s.nodes.ids().await?;
    ids.sort();
    let mut nodes = Vec::new();
    for node in ids {
        let images = s.ledger.node_images(&node).await.map_err(errors::ledger)?;
        nodes.push(NodeImages { node, images });
    }
    Ok(Json(ImagesView { nodes }))
}
