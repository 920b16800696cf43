//! Arbitrary bytes as an OIP `ModelInferRequest`: protobuf decoding, the decoder's validation
//! and the response built from it. See `npufleet_worker::fuzz`.

#![no_main]

#[global_allocator]
static ALLOCATOR: npufleet_worker::fuzz::CountingAllocator =
    npufleet_worker::fuzz::CountingAllocator;

libfuzzer_sys::fuzz_target!(|data: &[u8]| npufleet_worker::fuzz::decode_infer_request(data));
