//! Known label sets start at 0: each role registers, when it starts, the series whose labels
//! it can name ahead (its node, the configured templates, closed sets such as error causes and
//! refusal codes), so a dashboard panel shows 0 rather than "No data" and an alert on a rate
//! of errors can tell "none" from "not scraped". Registering a series records nothing: a
//! counter or gauge another caller already moved keeps its value, a histogram its samples.

use crate::names::{CATALOG, Kind};

/// Registers every combination of `sets` (label, values) as a series of `name`, at 0.
///
/// Panics if `name` is not in the catalog or the labels are not the catalog's: both are
/// programming errors the roles' start-up (run by every end-to-end test) finds at once.
pub fn zeros(name: &'static str, sets: &[(&'static str, &[&str])]) {
    let metric = CATALOG.iter().find(|m| m.name == name).unwrap_or_else(|| panic!("{name} is not in the catalog"));
    let given: Vec<&str> = sets.iter().map(|(l, _)| *l).collect();
    assert_eq!(given, metric.labels, "{name}: zeros must name the catalog's labels in its order");
    for labels in combinations(sets) {
        let labels: Vec<metrics::Label> = labels.into_iter().map(|(k, v)| metrics::Label::new(k, v)).collect();
        match metric.kind {
            Kind::Counter => drop(metrics::counter!(name, labels)),
            Kind::Gauge => drop(metrics::gauge!(name, labels)),
            Kind::Histogram => drop(metrics::histogram!(name, labels)),
        }
    }
}

/// Every combination of one value of each set, in the sets' order.
fn combinations(sets: &[(&'static str, &[&str])]) -> Vec<Vec<(&'static str, String)>> {
    let mut out: Vec<Vec<(&'static str, String)>> = vec![Vec::new()];
    for (label, values) in sets {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                values.iter().map(move |v| {
                    let mut next = prefix.clone();
                    next.push((*label, (*v).to_string()));
                    next
                })
            })
            .collect();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names;

    #[test]
    fn every_combination_renders_at_zero_and_a_moved_series_keeps_its_value() {
        let handle = crate::metrics::install();
        metrics::counter!(names::CREATE_FAILURES, "node" => "t-zeros", "template" => "a", "cause" => "pull")
            .increment(2);
        let causes: &[&str] = &["pull", "other"];
        zeros(names::CREATE_FAILURES, &[("node", &["t-zeros"]), ("template", &["a", "b"]), ("cause", causes)]);
        zeros(names::SESSION_QUEUE_WAIT, &[("template", &["t-zeros"])]);
        let page = handle.render();
        for (series, value) in [
            (r#"{node="t-zeros",template="a",cause="pull"}"#, 2),
            (r#"{node="t-zeros",template="a",cause="other"}"#, 0),
            (r#"{node="t-zeros",template="b",cause="pull"}"#, 0),
            (r#"{node="t-zeros",template="b",cause="other"}"#, 0),
        ] {
            let line = format!("sandpool_sandbox_create_failures_total{series} {value}");
            assert!(page.lines().any(|l| l == line), "{line} not in:\n{page}");
        }
        assert!(
            page.lines().any(|l| l == r#"sandpool_session_queue_wait_seconds_count{template="t-zeros"} 0"#),
            "{page}"
        );
    }

    #[test]
    #[should_panic(expected = "catalog's labels")]
    fn labels_other_than_the_catalogs_are_refused() {
        zeros(names::CREATE_FAILURES, &[("template", &["a"])]);
    }
}
