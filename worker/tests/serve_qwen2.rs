//! The real worker binary serving a small random-weight Qwen2 GGUF file over the OpenAI
//! chat API: the answer is the model's greedy continuation of the chat-templated prompt, and
//! under the DeepSeek-R1 template (which opens `<think>` in the prompt) it is split at the
//! `</think>` the model emits into `reasoning_content` and `content`, whole and streamed,
//! unless `--reasoning-parser none` is given.

mod model_support;
mod serve_support;

use std::path::{Path, PathBuf};

use model_support::{greedy, load, messages, reference_script, write_qwen2_model};
use npufleet_worker::model::{ChatMessage, PrecisionPolicy, WeightPrecision};
use serde_json::{Value, json};
use serve_support::{MODEL_NAME, Worker, post, post_stream};

const MAX_TOKENS: usize = 12;

fn qwen2_model(dir: &Path, template: &str) -> PathBuf {
    let template = reference_script(&format!("templates/{template}"));
    write_qwen2_model(
        &dir.join("qwen2.gguf"),
        &[
            "--weights",
            "q8_0",
            "--template",
            template.to_str().unwrap(),
        ],
    )
}

/// The prompt's token count, the greedy answer and its finish reason, computed in this
/// process.
fn expected_answer(model_path: &Path, messages: &[ChatMessage]) -> (usize, String, &'static str) {
    let model = load(model_path, PrecisionPolicy::Fp32);
    let prompt = model
        .tokenizer()
        .apply_chat_template(messages, true)
        .unwrap();
    let ids = model.tokenizer().encode(&prompt);
    let (tokens, _) = greedy(&model, &ids, MAX_TOKENS, WeightPrecision::Full);
    let eos = &model.config().eos_token_ids;
    let end = tokens.iter().position(|t| eos.contains(t));
    let finish = if end.is_some() { "stop" } else { "length" };
    let answer = model
        .tokenizer()
        .decode(&tokens[..end.unwrap_or(tokens.len())]);
    (ids.len(), answer, finish)
}

fn request(messages: &[ChatMessage], stream: bool) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    json!({
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    })
}

async fn chat(worker: &Worker, body: Value) -> Value {
    let url = format!("{}/v1/chat/completions", worker.http);
    let (status, answer) = post(&reqwest::Client::new(), &url, body).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

/// The chunks of a streamed chat answer, without the closing `[DONE]`.
async fn chat_stream(worker: &Worker, messages: &[ChatMessage]) -> Vec<Value> {
    let url = format!("{}/v1/chat/completions", worker.http);
    post_stream(&reqwest::Client::new(), &url, &request(messages, true))
        .await
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

fn concat(chunks: &[Value], field: &str) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"][field].as_str())
        .collect()
}

#[tokio::test]
async fn chat_completion_is_the_greedy_answer_to_the_chatml_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen2_model(dir.path(), "qwen2.5-instruct.jinja");
    let conversation = messages(&[
        ("system", "be brief"),
        ("user", "hello world, what is 12 + 34?"),
    ]);
    let (prompt_tokens, answer, finish) = expected_answer(&model, &conversation);
    let distinct: std::collections::HashSet<char> = answer.chars().collect();
    assert!(
        distinct.len() > 4,
        "a repetitive answer proves little: {answer:?}"
    );
    let worker = Worker::spawn_model(&model, &["--precision", "fp32"], &[]);
    worker.wait_ready().await;

    let body = chat(&worker, request(&conversation, false)).await;
    let message = &body["choices"][0]["message"];
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["content"], answer.as_str(), "{body}");
    assert!(
        message.get("reasoning_content").is_none(),
        "a ChatML prompt opens no reasoning: {body}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], finish);
    assert_eq!(body["usage"]["prompt_tokens"], prompt_tokens);
    eprintln!("qwen2 chat answer over HTTP: {answer:?} ({finish}, {prompt_tokens} prompt tokens)");

    let chunks = chat_stream(&worker, &conversation).await;
    assert_eq!(concat(&chunks, "content"), answer);
}

#[tokio::test]
async fn deepseek_r1_prompt_returns_the_answer_as_reasoning_content() {
    let dir = tempfile::tempdir().unwrap();
    let model = qwen2_model(dir.path(), "deepseek-r1-distill-qwen.jinja");
    // The random model's greedy answer to this question closes the `<think>` block the
    // prompt opened, a few tokens in.
    let conversation = messages(&[("user", "the quick brown fox")]);
    let (_, answer, _) = expected_answer(&model, &conversation);
    let (reasoning, content) = answer
        .split_once("</think>")
        .unwrap_or_else(|| panic!("the answer closes no <think> block: {answer:?}"));
    assert!(!reasoning.is_empty() && !content.is_empty(), "{answer:?}");

    let worker = Worker::spawn_model(&model, &["--precision", "fp32"], &[]);
    worker.wait_ready().await;
    let body = chat(&worker, request(&conversation, false)).await;
    let message = &body["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], reasoning, "{body}");
    assert_eq!(message["content"], content, "{body}");
    let chunks = chat_stream(&worker, &conversation).await;
    assert_eq!(concat(&chunks, "reasoning_content"), reasoning);
    assert_eq!(concat(&chunks, "content"), content);
    eprintln!("deepseek-r1 template: reasoning {reasoning:?}, content {content:?}");

    let plain = Worker::spawn_model(
        &model,
        &["--precision", "fp32", "--reasoning-parser", "none"],
        &[],
    );
    plain.wait_ready().await;
    let body = chat(&plain, request(&conversation, false)).await;
    let message = &body["choices"][0]["message"];
    assert_eq!(message["content"], answer.as_str(), "{body}");
    assert!(message.get("reasoning_content").is_none(), "{body}");
}
