//! What every command prints with `--json` goes through here, so that each object carries the
//! `version` of its shape. docs/json.md documents every shape and the rules that keep them
//! stable; a test runs each command and checks its output against the tables there.
//!
//! The version is a field of every object printed, first, beside the object's own fields: on
//! every line of a JSON-lines output (`ask --json` prints events, one a line), so that each line
//! stands alone for a reader that filters, tails or splits the stream.

use serde::Serialize;

/// The version of every shape docs/json.md documents. A shape that changes in a way a reader
/// could trip on (a field moved, renamed, retyped or removed) gets a version of its own, passed
/// to [`versioned_line`]; new fields need none. The plan's shape is versioned by
/// [`baton_plan::JSON_VERSION`], since `Plan` reads it back.
pub const VERSION: u32 = 1;

/// `body`'s fields after `version`. `body` must serialize as an object (a struct, a map, or an
/// internally tagged enum such as `RunEvent`).
#[derive(Serialize)]
struct Versioned<'a, T: ?Sized> {
    version: u32,
    #[serde(flatten)]
    body: &'a T,
}

/// `body` as one line of JSON with `"version": 1` first, without the newline.
pub fn line<T: Serialize + ?Sized>(body: &T) -> String {
    versioned_line(VERSION, body)
}

/// `body` as one line of JSON with `"version": version` first.
pub fn versioned_line<T: Serialize + ?Sized>(version: u32, body: &T) -> String {
    // Only a body that is not an object fails, which no command prints.
    serde_json::to_string(&Versioned { version, body }).unwrap_or_default()
}

/// `body` indented, with `"version": 1` first and a final newline (`history export`).
pub fn pretty<T: Serialize + ?Sized>(body: &T) -> String {
    serde_json::to_string_pretty(&Versioned { version: VERSION, body }).unwrap_or_default() + "\n"
}

/// A plan as `plan --json` and `plan parse` print it; `baton ask --plan` and `plan parse` read it
/// back.
pub fn plan_line(plan: &baton_plan::Plan) -> String {
    versioned_line(baton_plan::JSON_VERSION, plan)
}

#[cfg(test)]
mod tests {
    use baton_engine::{RunEvent, Totals};
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn the_version_comes_first_beside_the_fields_of_any_object() {
        let event = RunEvent::RunCancelled { totals: Totals::default() };
        let printed = line(&event);
        assert!(printed.starts_with(r#"{"version":1,"type":"run_cancelled","totals":{"#), "{printed}");
        let read: RunEvent = serde_json::from_str(&printed).expect("the event reads back; version is extra");
        assert_eq!(read, event);
        let printed = line(&json!({"id": 3, "deleted": true}));
        assert!(printed.starts_with(r#"{"version":1,""#), "{printed}");
        assert_eq!(
            serde_json::from_str::<Value>(&printed).expect("json"),
            json!({"version": 1, "id": 3, "deleted": true})
        );
        let pretty: Value = serde_json::from_str(&pretty(&json!({"format": "baton-run/1"}))).expect("json");
        assert_eq!(pretty, json!({"version": 1, "format": "baton-run/1"}));
    }

    #[test]
    fn a_printed_plan_reads_back_and_a_newer_one_is_refused() {
        let plan = baton_plan::parse(
            "model_id = [1, 0]\nsubtasks = ['a', 'b']\naccess_list = [[], 'all']",
            &Default::default(),
        )
        .expect("plan");
        let printed = plan_line(&plan);
        assert_eq!(printed, r#"{"version":1,"model_id":[1,0],"subtasks":["a","b"],"access_list":[[],"all"]}"#);
        assert_eq!(serde_json::from_str::<baton_plan::Plan>(&printed).expect("reads back"), plan);
        let newer = printed.replace(r#""version":1"#, r#""version":2"#);
        let e = serde_json::from_str::<baton_plan::Plan>(&newer).expect_err("refused");
        assert!(e.to_string().contains("newer than this Baton reads (version 1): upgrade Baton"), "{e}");
    }
}
