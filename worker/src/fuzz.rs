//! Entry points for the fuzz targets in `worker/fuzz/`, one per kind of untrusted input the
//! worker reads. Each takes arbitrary bytes and returns normally whether they are valid or
//! not: a panic, a hang or an allocation out of proportion to the input is a bug. The corpus
//! replay test (`tests/fuzz_corpus.rs`) feeds the committed corpus to the same functions, so
//! `cargo test` keeps every input the fuzzer once found interesting passing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use npufleet_contract::proto::inference::ModelInferRequest;
use npufleet_contract::rank_table::{self, PodIdentity, TableStatus};
use prost::Message;

use crate::model::gguf;
use crate::server::{oip, openai};

/// A fuzz target's entry: takes any bytes, panics only on a bug.
pub type Entry = fn(&[u8]);

/// The fuzz targets, by the name of their binary and corpus directory.
pub const TARGETS: &[(&str, Entry)] = &[
    ("decode_infer_request", decode_infer_request),
    ("gguf_directory", gguf_directory),
    ("rank_table", rank_table),
    ("openai_request", openai_request),
];

/// Parsing a GGUF directory may hold at most this many bytes per byte of the file (plus
/// [`GGUF_FIXED_ALLOWANCE`]). The largest ratio is a metadata array of one-byte values, each
/// held as a 32-byte [`gguf::Value`]; every count the file states is checked against the
/// bytes that remain, so no allocation is sized by a claim the file's bytes do not back.
pub const GGUF_BYTES_PER_FILE_BYTE: usize = 48;
pub const GGUF_FIXED_ALLOWANCE: usize = 16 * 1024;

/// An OIP `ModelInferRequest` as it arrives over gRPC: protobuf decoding, then the decoder's
/// validation, then building the response it would answer with.
pub fn decode_infer_request(data: &[u8]) {
    let Ok(request) = ModelInferRequest::decode(data) else {
        return;
    };
    if let Ok(decoded) = oip::decode_infer_request(&request) {
        let response = oip::build_response("m", &decoded, "text", &[1, 2, 3], Default::default());
        assert_eq!(
            response.outputs.len(),
            usize::from(decoded.outputs.text) + usize::from(decoded.outputs.ids)
        );
    }
    for raw in &request.raw_input_contents {
        let _ = oip::split_raw_bytes(raw);
    }
}

/// The same bytes as a `/v1/completions` and as a `/v1/chat/completions` body. A body is
/// either a validated request or the client's mistake (a 4xx), never a server error.
pub fn openai_request(data: &[u8]) {
    for (endpoint, validate) in [
        (
            "completions",
            openai::validate_completion_body as fn(_, _) -> _,
        ),
        ("chat", openai::validate_chat_body),
    ] {
        match validate(data, "m") {
            Ok(request) => {
                if endpoint == "completions" {
                    assert!(request.params.max_tokens.is_some(), "no default max_tokens");
                }
            }
            Err(err) => assert!(
                err.http_status().is_client_error(),
                "{endpoint}: a request body gave a {} error: {err}",
                err.http_status()
            ),
        }
    }
}

/// A GGUF file's header, metadata and tensor directory. Every tensor it accepts lies inside
/// the file, and parsing holds memory in proportion to the file's size.
pub fn gguf_directory(data: &[u8]) {
    let (parsed, peak) = peak_allocation(|| gguf::parse_directory(data));
    let bound = GGUF_BYTES_PER_FILE_BYTE * data.len() + GGUF_FIXED_ALLOWANCE;
    assert!(
        peak <= bound,
        "parsing a {}-byte file held {peak} bytes (bound {bound})",
        data.len()
    );
    let Ok(directory) = parsed else { return };
    for tensor in directory.tensors.values() {
        let end = tensor.start.checked_add(tensor.len);
        assert!(
            end.is_some_and(|end| end <= data.len()),
            "tensor {} ({} bytes at {}) accepted beyond the {}-byte file",
            tensor.name,
            tensor.len,
            tensor.start,
            data.len()
        );
        let elements: u64 = tensor.dims.iter().product();
        let (block, block_bytes) = tensor.ty.block();
        assert_eq!(
            elements / block as u64 * block_bytes as u64,
            tensor.len as u64,
            "tensor {}: length disagrees with its dims {:?}",
            tensor.name,
            tensor.dims
        );
    }
}

/// A mounted `hccl.json`, and what a worker does with a completed one: find its ranks and the
/// ring's endpoints.
pub fn rank_table(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(TableStatus::Completed(table)) = rank_table::parse(text) else {
        return;
    };
    let _ = table.ring_endpoints(29650);
    let _ = table.ring_endpoints(u16::MAX);
    for server in &table.servers {
        for pod_ip in [
            &server.container_ip,
            &server.host_ip,
            &Some(server.server_id.clone()),
        ] {
            let identity = PodIdentity {
                pod_ip: pod_ip.clone(),
                ..PodIdentity::default()
            };
            if let Ok(ranks) = table.local_ranks(&identity) {
                assert!(ranks.iter().all(|&r| r < table.world_size()));
            }
        }
    }
    for rank in [0, table.world_size(), usize::MAX] {
        let identity = PodIdentity {
            rank_override: Some(rank),
            ..PodIdentity::default()
        };
        let _ = table.find_rank(&identity);
    }
}

thread_local! {
    static LIVE_BYTES: Cell<usize> = const { Cell::new(0) };
    static PEAK_BYTES: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, counting per thread the bytes allocated and not yet freed, for
/// [`peak_allocation`]. A fuzz target or test binary installs it with `#[global_allocator]`.
pub struct CountingAllocator;

fn allocated(bytes: usize) {
    let live = LIVE_BYTES.get().saturating_add(bytes);
    LIVE_BYTES.set(live);
    PEAK_BYTES.set(PEAK_BYTES.get().max(live));
}

fn freed(bytes: usize) {
    // Memory freed on another thread than the one that allocated it only lowers this
    // thread's count, never below zero.
    LIVE_BYTES.set(LIVE_BYTES.get().saturating_sub(bytes));
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are plain
// thread-locals with const initialisers and no destructors, so updating them never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            allocated(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed` is passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            allocated(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc` is passed on.
        unsafe { System.dealloc(ptr, layout) };
        freed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc` is passed on.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            freed(layout.size());
            allocated(new_size);
        }
        new
    }
}

/// Runs `f` and returns its result with the most bytes it held allocated at once on this
/// thread. Without [`CountingAllocator`] installed the figure is always 0.
pub fn peak_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE_BYTES.get();
    PEAK_BYTES.set(start);
    let result = f();
    (result, PEAK_BYTES.get() - start)
}
