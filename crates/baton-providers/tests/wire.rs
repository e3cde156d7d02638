//! The clients against loopback servers that speak each provider's wire format, over real HTTP.

use std::sync::Arc;
use std::time::Duration;

use baton_providers::{
    ApiKey, ChatEvent, ChatModel, ChatRequest, ErrorKind, HttpModel, Message, ModelSettings, ProviderError,
    ProviderKind, Usage,
};
use baton_testserver::{TestServer, Wire};
use futures::StreamExt;

const KINDS: [(ProviderKind, Wire); 3] = [
    (ProviderKind::OpenAi, Wire::OpenAi),
    (ProviderKind::Anthropic, Wire::Anthropic),
    (ProviderKind::Gemini, Wire::Gemini),
];

fn model(server: &TestServer, kind: ProviderKind, wire: Wire, settings: ModelSettings) -> HttpModel {
    let key = Arc::new(|| Ok(Some(ApiKey::new("test-key-123"))));
    HttpModel::new(kind, &server.base_url(wire), settings, key, HttpModel::http_client())
}

fn request() -> ChatRequest {
    ChatRequest {
        system: Some("Be brief.".into()),
        messages: vec![
            Message::user("Solve 2+2."),
            Message::assistant("4"),
            Message::user("Check the solution above."),
        ],
        ..ChatRequest::default()
    }
}

struct Answer {
    text: String,
    pieces: usize,
    usage: Usage,
    stop: Option<String>,
}

async fn call(m: &HttpModel) -> Result<Answer, ProviderError> {
    let mut stream = m.stream(request()).await?;
    let mut answer = Answer { text: String::new(), pieces: 0, usage: Usage::default(), stop: None };
    let mut done = false;
    while let Some(event) = stream.next().await {
        match event? {
            ChatEvent::Text(t) => {
                assert!(!done, "text after Done");
                answer.pieces += 1;
                answer.text.push_str(&t);
            }
            ChatEvent::Usage(_) => assert!(!done, "usage after Done"),
            ChatEvent::Done { usage, stop_reason } => {
                done = true;
                answer.usage = usage;
                answer.stop = stop_reason;
            }
        }
    }
    assert!(done, "stream ended without Done");
    Ok(answer)
}

fn settings(model: &str, stream: bool) -> ModelSettings {
    ModelSettings { stream, max_tokens: 512, temperature: Some(0.2), ..ModelSettings::new(model) }
}

#[tokio::test]
async fn streamed_and_whole_answers_with_usage_in_every_format() {
    let server = TestServer::start().await.expect("server");
    for (kind, wire) in KINDS {
        for stream in [true, false] {
            let m = model(&server, kind, wire, settings("checker", stream));
            let a = call(&m).await.unwrap_or_else(|e| panic!("{kind} stream={stream}: {e}"));
            assert_eq!(a.text, "checker (saw 1 earlier answers) answers: Check the solution above.", "{kind}");
            if stream {
                assert!(a.pieces > 3, "{kind}: streamed in pieces, got {}", a.pieces);
            } else {
                assert_eq!(a.pieces, 1, "{kind}");
            }
            assert!(a.usage.input_tokens > 0 && a.usage.output_tokens > 0, "{kind} stream={stream}: {:?}", a.usage);
            assert!(a.stop.is_some(), "{kind}");
        }
    }
}

/// Prompt caching as each provider reports it: OpenAI's `prompt_tokens_details.cached_tokens`,
/// Gemini's `cachedContentTokenCount` (both automatic), Anthropic's `cache_read_input_tokens` and
/// `cache_creation_input_tokens` at the `cache_control` breakpoints Baton sets on a long prefix.
#[tokio::test]
async fn cached_prompt_tokens_are_read_from_every_format() {
    let server = TestServer::start().await.expect("server");
    let long = "The measured figures, in full. ".repeat(200);
    let first = ChatRequest { messages: vec![Message::user(long.clone())], ..request() };
    let mut second = first.clone();
    second.messages.push(Message::assistant("Noted."));
    second.messages.push(Message::user("Now the summary."));
    for (kind, wire) in KINDS {
        for stream in [true, false] {
            let name = format!("cache-{kind}-{stream}");
            let m = model(&server, kind, wire, settings(&name, stream));
            let mut m1 = Answer { text: String::new(), pieces: 0, usage: Usage::default(), stop: None };
            let mut s1 = m.stream(first.clone()).await.expect("first");
            while let Some(e) = s1.next().await {
                if let ChatEvent::Done { usage, .. } = e.expect("event") {
                    m1.usage = usage;
                }
            }
            assert_eq!(m1.usage.cached_input_tokens, 0, "{kind} stream={stream}: nothing cached yet");
            let mut s2 = m.stream(second.clone()).await.expect("second");
            let mut usage = Usage::default();
            while let Some(e) = s2.next().await {
                if let ChatEvent::Done { usage: u, .. } = e.expect("event") {
                    usage = u;
                }
            }
            let prefix = ((long.len() + "Be brief.".len()) / 4) as u64;
            assert_eq!(usage.cached_input_tokens, prefix, "{kind} stream={stream}: {usage:?}");
            assert!(usage.input_tokens > usage.cached_input_tokens, "{kind}: cached tokens are part of the input");
            if kind == ProviderKind::Anthropic {
                assert_eq!(m1.usage.cache_write_input_tokens, prefix, "{kind}: the first call wrote the prefix");
                assert!(usage.cache_write_input_tokens > 0, "{kind}: the second wrote its own longer prefix");
            }
        }
    }
    let anthropic: Vec<_> = server.requests().into_iter().filter(|r| r.wire == Wire::Anthropic).collect();
    let last_turn = &anthropic[1].body["messages"][2]["content"];
    assert_eq!(last_turn[0]["cache_control"]["type"], "ephemeral", "a breakpoint on the last turn: {last_turn}");
    assert_eq!(
        anthropic[1].body["messages"][1]["content"][0]["cache_control"]["type"], "ephemeral",
        "and on the one before"
    );
    assert!(anthropic[1].body["messages"][0]["content"].is_string(), "two breakpoints at most: {}", anthropic[1].body);
}

#[tokio::test]
async fn headers_and_bodies_follow_each_providers_reference() {
    let server = TestServer::start().await.expect("server");
    for (kind, wire) in KINDS {
        call(&model(&server, kind, wire, settings("m", true))).await.expect("answer");
    }
    let reqs = server.requests();
    assert_eq!(reqs.len(), 3);

    let openai = &reqs[0];
    assert_eq!(openai.path, "/v1/chat/completions");
    assert_eq!(openai.headers["authorization"], "Bearer test-key-123");
    assert_eq!(openai.body["stream"], true);
    assert_eq!(openai.body["stream_options"]["include_usage"], true);
    assert_eq!(openai.body["max_completion_tokens"], 512, "OpenAI itself takes max_completion_tokens");
    assert!(openai.body.get("max_tokens").is_none());
    assert_eq!(openai.body["messages"][0]["role"], "system");
    assert_eq!(openai.body["messages"][2]["role"], "assistant");
    assert_eq!(openai.body["messages"].as_array().map(Vec::len), Some(4));

    let anthropic = &reqs[1];
    assert_eq!(anthropic.path, "/v1/messages");
    assert_eq!(anthropic.headers["x-api-key"], "test-key-123");
    assert_eq!(anthropic.headers["anthropic-version"], "2023-06-01");
    assert!(!anthropic.headers.contains_key("authorization"));
    assert_eq!(anthropic.body["system"], "Be brief.");
    assert_eq!(anthropic.body["max_tokens"], 512);
    assert_eq!(anthropic.body["messages"].as_array().map(Vec::len), Some(3));
    assert_eq!(anthropic.body["messages"][0]["role"], "user");

    let gemini = &reqs[2];
    assert_eq!(gemini.path, "/v1beta/models/m:streamGenerateContent");
    assert_eq!(gemini.headers["x-goog-api-key"], "test-key-123");
    assert_eq!(gemini.body["systemInstruction"]["parts"][0]["text"], "Be brief.");
    assert_eq!(gemini.body["contents"][1]["role"], "model");
    assert_eq!(gemini.body["generationConfig"]["maxOutputTokens"], 512);
    let t = gemini.body["generationConfig"]["temperature"].as_f64().expect("temperature");
    assert!((t - 0.2).abs() < 1e-6);
}

#[tokio::test]
async fn compatible_servers_get_max_tokens_and_no_key_when_none_is_set() {
    let server = TestServer::start().await.expect("server");
    let m = HttpModel::new(
        ProviderKind::OpenAiCompatible,
        &server.base_url(Wire::OpenAi),
        settings("llama", true),
        Arc::new(|| Ok(None)),
        HttpModel::http_client(),
    );
    call(&m).await.expect("answer");
    let req = &server.requests()[0];
    assert_eq!(req.body["max_tokens"], 512);
    assert!(req.body.get("max_completion_tokens").is_none());
    assert!(!req.headers.contains_key("authorization"));
}

#[tokio::test]
async fn reasoning_parameters_pass_through_and_thoughts_stay_out_of_the_answer() {
    let server = TestServer::start().await.expect("server");
    for (kind, wire) in KINDS {
        for stream in [true, false] {
            let s = ModelSettings {
                reasoning_effort: (kind == ProviderKind::OpenAi).then(|| "high".to_owned()),
                thinking_budget: (kind != ProviderKind::OpenAi).then_some(1024),
                ..settings("thinker;reply=four", stream)
            };
            let a = call(&model(&server, kind, wire, s)).await.expect("answer");
            assert_eq!(a.text, "four", "{kind} stream={stream}");
            assert!(a.usage.output_tokens >= 7, "{kind}: thinking tokens count as output: {:?}", a.usage);
        }
    }
    let reqs = server.requests();
    assert_eq!(reqs[0].body["reasoning_effort"], "high");
    assert_eq!(reqs[2].body["thinking"]["type"], "enabled");
    assert_eq!(reqs[2].body["thinking"]["budget_tokens"], 1024);
    assert!(reqs[2].body["max_tokens"].as_u64() > Some(1024));
    assert!(reqs[2].body.get("temperature").is_none(), "Anthropic rejects temperature with thinking");
    assert_eq!(reqs[4].body["generationConfig"]["thinkingConfig"]["thinkingBudget"], 1024);
}

async fn error_of(
    server: &TestServer,
    kind: ProviderKind,
    wire: Wire,
    model_name: &str,
    stream: bool,
) -> ProviderError {
    match call(&model(server, kind, wire, settings(model_name, stream))).await {
        Ok(a) => panic!("{kind} {model_name}: expected an error, got {:?}", a.text),
        Err(e) => e,
    }
}

#[tokio::test]
async fn error_bodies_map_to_one_taxonomy() {
    let server = TestServer::start().await.expect("server");
    for (kind, wire) in KINDS {
        let e = error_of(&server, kind, wire, "m;fail=401", true).await;
        assert_eq!(e.kind, ErrorKind::Auth, "{kind}: {e}");
        assert!(!e.is_retryable());

        let e = error_of(&server, kind, wire, "m;fail=429;retry_after=7", true).await;
        assert_eq!(e.kind, ErrorKind::RateLimited, "{kind}: {e}");
        assert_eq!(e.retry_after, Some(Duration::from_secs(7)), "{kind}");
        assert_eq!(e.status, Some(429));

        let e = error_of(&server, kind, wire, "m;fail=500", false).await;
        assert_eq!(e.kind, ErrorKind::Overloaded, "{kind}: {e}");
        assert!(e.is_retryable());

        let e = error_of(&server, kind, wire, "m;fail=400", true).await;
        assert_eq!(e.kind, ErrorKind::ContextTooLong, "{kind}: {e}");

        let e = error_of(&server, kind, wire, "m;fail=404", true).await;
        assert_eq!(e.kind, ErrorKind::BadRequest, "{kind}: {e}");

        let e = error_of(&server, kind, wire, "m;garbage=99", false).await;
        assert_eq!(e.kind, ErrorKind::MalformedResponse, "{kind}: {e}");
        let e = error_of(&server, kind, wire, "m;garbage=99", true).await;
        assert_eq!(e.kind, ErrorKind::MalformedResponse, "{kind}: {e}");

        let e = error_of(&server, kind, wire, "m;cut=99", true).await;
        assert_eq!(e.kind, ErrorKind::Network, "{kind}: {e}");
        assert!(e.is_retryable());

        let e = error_of(&server, kind, wire, "m;stream_error=99", true).await;
        assert_eq!(e.kind, ErrorKind::Overloaded, "{kind}: {e}");
    }
    let e = error_of(&server, ProviderKind::Anthropic, Wire::Anthropic, "m;fail=529", true).await;
    assert_eq!(e.kind, ErrorKind::Overloaded);
    assert!(e.message.contains("Overloaded"));
}

#[tokio::test]
async fn a_wrong_key_is_an_auth_error_in_every_format() {
    let server = baton_testserver::TestServer::start_with(baton_testserver::Options {
        key: Some("right".into()),
        ..Default::default()
    })
    .await
    .expect("server");
    for (kind, wire) in KINDS {
        let e = error_of(&server, kind, wire, "m", true).await;
        assert_eq!(e.kind, ErrorKind::Auth, "{kind}: {e}");
        assert!(!e.to_string().contains("test-key-123"), "the key must not appear in errors");
        if kind == ProviderKind::OpenAi {
            // This server echoes the key it got, as some proxies do; Baton cuts it out.
            assert!(e.message.contains("Incorrect API key provided: <redacted>"), "{}", e.message);
        }
    }
}

#[tokio::test]
async fn silence_mid_stream_is_a_timeout() {
    let server = TestServer::start().await.expect("server");
    for (kind, wire) in KINDS {
        let s = ModelSettings { idle_timeout: Duration::from_millis(100), ..settings("m;latency=3000;chunks=2", true) };
        let e = call(&model(&server, kind, wire, s)).await.err().expect("times out");
        assert_eq!(e.kind, ErrorKind::Timeout, "{kind}: {e}");
    }
}

#[tokio::test]
async fn an_unreachable_server_is_a_network_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let m = HttpModel::new(
        ProviderKind::OpenAi,
        &format!("http://{addr}/v1"),
        settings("m", true),
        Arc::new(|| Ok(Some(ApiKey::new("k")))),
        HttpModel::http_client(),
    );
    let e = call(&m).await.err().expect("fails");
    assert_eq!(e.kind, ErrorKind::Network, "{e}");
}

/// A loopback server that answers every request on `listener` with `response` and reports
/// each request's head on `seen`.
fn raw_server(listener: std::net::TcpListener, response: String, seen: std::sync::mpsc::Sender<String>) {
    use std::io::{BufRead, BufReader, Write};
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut head = String::new();
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                head.push_str(&line);
            }
            let _ = seen.send(head);
            let _ = stream.write_all(response.as_bytes());
        }
    });
}

#[tokio::test]
async fn a_redirect_to_another_host_is_not_followed_so_the_key_stays_home() {
    let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let other_port = other.local_addr().unwrap().port();
    let (other_seen, other_heard) = std::sync::mpsc::channel();
    raw_server(other, "HTTP/1.1 500 Oops\r\ncontent-length: 0\r\n\r\n".into(), other_seen);
    let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://127.0.0.1:{}/v1", first.local_addr().unwrap().port());
    let (first_seen, first_heard) = std::sync::mpsc::channel();
    // "localhost" names the same machine, but not the host the key was given for.
    let redirect = format!(
        "HTTP/1.1 307 Temporary Redirect\r\nlocation: http://localhost:{other_port}/v1/elsewhere\r\ncontent-length: 0\r\n\r\n"
    );
    raw_server(first, redirect, first_seen);

    for kind in [ProviderKind::OpenAi, ProviderKind::Anthropic, ProviderKind::Gemini] {
        let key = Arc::new(|| Ok(Some(ApiKey::new("canary-key-that-must-stay-home"))));
        let model = HttpModel::new(kind, &base, ModelSettings::new("m"), key, HttpModel::http_client());
        let err = match model.stream(request()).await {
            Ok(_) => panic!("{kind}: a redirect is not an answer"),
            Err(e) => e,
        };
        assert_eq!(err.kind, ErrorKind::BadRequest, "{kind}: {err}");
        assert!(err.message.contains("redirected") && err.message.contains("localhost"), "{kind}: {err}");
        let head = first_heard.recv_timeout(Duration::from_secs(5)).expect("the first host was asked");
        assert!(head.contains("canary-key-that-must-stay-home"), "{kind}: the key went to its own host:\n{head}");
    }
    assert!(
        other_heard.recv_timeout(Duration::from_millis(300)).is_err(),
        "the other host must never be contacted (it would have received the key header)"
    );
}
