//! Arbitrary bytes as a GGUF model file: header, metadata and tensor directory, with the
//! memory parsing holds bounded by the file's size. See `npufleet_worker::fuzz`.

#![no_main]

#[global_allocator]
static ALLOCATOR: npufleet_worker::fuzz::CountingAllocator =
    npufleet_worker::fuzz::CountingAllocator;

libfuzzer_sys::fuzz_target!(|data: &[u8]| npufleet_worker::fuzz::gguf_directory(data));
