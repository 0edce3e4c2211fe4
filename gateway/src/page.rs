//! Cursor pagination of the API's listings (`?limit=N&cursor=C` -> `next_cursor`), as a pure
//! function of the items, their sort key and the query.
//!
//! A page is the items whose key sorts after the cursor's, in key order: the cursor is the
//! last key handed out, so items created or ended between two calls neither repeat nor push
//! others off a page (a new item with a later key shows up on a later page). The cursor is
//! opaque to clients (hex of the listing's kind and the key): one listing's cursor given to
//! another, or a cursor that was edited, is a 400, never a silent restart from the top.

use http_util::ApiError;

/// Items a page holds unless the query asks for fewer: every listing's whole answer before
/// pagination existed stayed under it in practice, so callers that never page see no change.
pub(crate) const DEFAULT_LIMIT: usize = 1000;
/// Most items one page may ask for: an answer stays a few MB at most.
pub(crate) const MAX_LIMIT: usize = 1000;

/// `?limit=&cursor=` of a listing with no other parameters.
#[derive(serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct PageQuery {
    /// Items per page, 1-1000 (default 1000).
    #[serde(default)]
    pub limit: Option<usize>,
    /// The `next_cursor` of the previous page.
    #[serde(default)]
    pub cursor: Option<String>,
}

impl PageQuery {
    pub(crate) fn page(&self, kind: Kind) -> Result<Page, ApiError> {
        Page::parse(kind, self.limit, self.cursor.as_deref())
    }
}

/// Which listing a cursor belongs to (a cursor only resumes its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Sessions,
    Functions,
    Templates,
    EgressPolicies,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::Sessions => "sessions",
            Kind::Functions => "functions",
            Kind::Templates => "templates",
            Kind::EgressPolicies => "egress",
        }
    }
}

/// A validated `limit` and `cursor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Page {
    pub limit: usize,
    /// The last key of the previous page.
    pub after: Option<String>,
}

impl Page {
    /// Checks a query's `limit` (1..=MAX_LIMIT) and `cursor` (one this listing handed out).
    pub(crate) fn parse(kind: Kind, limit: Option<usize>, cursor: Option<&str>) -> Result<Page, ApiError> {
        let limit = match limit {
            None => DEFAULT_LIMIT,
            Some(n) if (1..=MAX_LIMIT).contains(&n) => n,
            Some(n) => return Err(ApiError::bad_request(format!("limit: {n} is not within 1..={MAX_LIMIT}"))),
        };
        let after = match cursor {
            None => None,
            Some(c) => Some(decode(kind, c).ok_or_else(|| {
                ApiError::bad_request("cursor: not a cursor of this listing (pass the next_cursor it answered)")
            })?),
        };
        Ok(Page { limit, after })
    }

    /// The page of `items` (any order) by `key`, and the cursor of the next page if any
    /// items remain after it. Keys must be unique within a listing.
    pub(crate) fn take<T>(
        &self,
        kind: Kind,
        mut items: Vec<T>,
        key: impl Fn(&T) -> String,
    ) -> (Vec<T>, Option<String>) {
        let mut keyed: Vec<(String, T)> = items.drain(..).map(|t| (key(&t), t)).collect();
        if let Some(after) = &self.after {
            keyed.retain(|(k, _)| k > after);
        }
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        let more = keyed.len() > self.limit;
        keyed.truncate(self.limit);
        let next = if more { keyed.last().map(|(k, _)| encode(kind, k)) } else { None };
        (keyed.into_iter().map(|(_, t)| t).collect(), next)
    }
}

fn encode(kind: Kind, key: &str) -> String {
    let raw = format!("{}\u{1f}{key}", kind.tag());
    raw.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode(kind: Kind, cursor: &str) -> Option<String> {
    if !cursor.len().is_multiple_of(2) || cursor.len() > 2048 {
        return None;
    }
    let bytes: Option<Vec<u8>> =
        (0..cursor.len()).step_by(2).map(|i| u8::from_str_radix(cursor.get(i..i + 2)?, 16).ok()).collect();
    let raw = String::from_utf8(bytes?).ok()?;
    let (tag, key) = raw.split_once('\u{1f}')?;
    (tag == kind.tag()).then(|| key.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("f{i:03}")).rev().collect()
    }

    #[test]
    fn pages_walk_every_item_once_in_key_order() {
        let mut cursor: Option<String> = None;
        let mut seen = Vec::new();
        loop {
            let page = Page::parse(Kind::Functions, Some(7), cursor.as_deref()).unwrap();
            let (items, next) = page.take(Kind::Functions, names(20), |s| s.clone());
            assert!(items.len() <= 7);
            seen.extend(items);
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        let mut want = names(20);
        want.sort();
        assert_eq!(seen, want);
    }

    #[test]
    fn an_item_ended_or_added_between_pages_moves_no_other() {
        let page = Page::parse(Kind::Sessions, Some(3), None).unwrap();
        let (first, next) = page.take(Kind::Sessions, names(6), |s| s.clone());
        assert_eq!(first, ["f000", "f001", "f002"]);
        // f001 ends, f004 ends, f999 appears: the next page starts after f002 regardless.
        let now: Vec<String> = ["f000", "f002", "f003", "f005", "f999"].map(String::from).to_vec();
        let page = Page::parse(Kind::Sessions, Some(3), next.as_deref()).unwrap();
        let (second, next) = page.take(Kind::Sessions, now, |s| s.clone());
        assert_eq!(second, ["f003", "f005", "f999"]);
        assert_eq!(next, None, "a full last page says there is no more");
    }

    #[test]
    fn bad_limits_and_cursors_are_refused() {
        for limit in [0, MAX_LIMIT + 1] {
            let e = Page::parse(Kind::Sessions, Some(limit), None).unwrap_err();
            assert!(e.message.contains("limit"), "{}", e.message);
        }
        let (_, next) =
            Page::parse(Kind::Functions, Some(1), None).unwrap().take(Kind::Functions, names(2), |s| s.clone());
        let other_listing = next.unwrap();
        for cursor in ["zz", "abc", "", "00ff", other_listing.as_str()] {
            let e = Page::parse(Kind::Sessions, None, Some(cursor)).unwrap_err();
            assert!(e.message.contains("cursor"), "{cursor}: {}", e.message);
        }
        assert_eq!(Page::parse(Kind::Sessions, None, None).unwrap().limit, DEFAULT_LIMIT);
    }
}
