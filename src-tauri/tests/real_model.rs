//! The app's run path with a real conductor model (SmolLM2-135M-Instruct, the 98 MB GGUF that
//! `scripts/fetch-test-model` fetches): `ask` with no plan has the local conductor write one,
//! and the plan the history records ended at its closing fence, by the model's own end token;
//! a follow-up question reuses the prompt prefix the first plan computed.

#[path = "support/harness.rs"]
mod harness;

use harness::{app, invoke};
use serde_json::{Value, json};

fn ask(h: &harness::Harness, question: &str, conversation: &Value, n: u32) -> Value {
    let request = json!({ "question": question, "conversation_id": conversation, "workers": null, "plan": null });
    let args = json!({ "request": request, "onEvent": format!("__CHANNEL__:{n}"), "stopId": format!("run-{n}") });
    invoke(h, "ask", args).unwrap_or_else(|e| panic!("ask {question}: {e}"))
}

/// The fallback is off: with it, a plan its check rejects is asked for again, and the recorded
/// plan's tokens are then both attempts'; this test is about the one plan written per question.
#[test]
fn the_app_plans_with_a_real_model_and_records_a_plan_that_ended_at_its_fence() {
    let Some(model) = baton_tests::real_model() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(baton_testserver::TestServer::start()).unwrap();
    let base = server.base_url(baton_testserver::Wire::OpenAi);
    let dir = tempfile::tempdir().unwrap();
    let pool = format!(
        "[conductor]\nmodel = \"{}\"\ndevice = \"cpu\"\ntemperature = 0.0\nmax_reasoning_chars = 150\nmax_subtask_chars = 150\nfallback = false\n\n\
         [[worker]]\nname = \"math\"\nprovider = \"openai-compatible\"\nmodel = \"a\"\nbase_url = \"{base}\"\ndescription = \"strong at math\"\n\n\
         [[worker]]\nname = \"writer\"\nprovider = \"openai-compatible\"\nmodel = \"b\"\nbase_url = \"{base}\"\ndescription = \"a good writer\"\n",
        model.display()
    );
    std::fs::write(dir.path().join("pool.toml"), pool).unwrap();
    let h = app(dir.path(), "main");

    let first = ask(&h, "What is 12 squared?", &Value::Null, 1);
    assert_eq!(first["status"], "finished", "{first}");
    let second = ask(&h, "And 13 squared?", &first["conversation_id"], 2);
    assert_eq!(second["status"], "finished", "{second}");

    let mut cached = Vec::new();
    for result in [&first, &second] {
        let run = invoke(&h, "get_run", json!({ "id": result["run_id"] })).unwrap();
        let plan = &run["plans"][0];
        let raw = plan["raw"].as_str().expect("the conductor's text");
        assert!(raw.ends_with("\n```"), "{raw}");
        assert_eq!(plan["stop_reason"], "stop", "{plan}");
        let written = plan["usage"]["output_tokens"].as_u64().expect("tokens recorded");
        // Every token of text is at least one byte; the end token is the one more.
        assert!(written >= 1 && written <= raw.len() as u64 + 1, "{written} tokens for {} bytes", raw.len());
        cached.push(plan["usage"]["cached_input_tokens"].as_u64().expect("cached tokens recorded"));
        let events: Vec<baton_engine::RunEvent> = serde_json::from_value(run["events"].clone()).unwrap();
        baton_engine::event::check_sequence(&events).unwrap();
    }
    assert_eq!(cached[0], 0, "nothing was cached before the first plan");
    assert!(cached[1] > 500, "the follow-up reuses the system prompt and the first turn: {cached:?}");
}
