//! Arbitrary bytes as an OpenAI `/v1/completions` and `/v1/chat/completions` body: JSON
//! parsing and the validation into an engine request. See `npufleet_worker::fuzz`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| npufleet_worker::fuzz::openai_request(data));
