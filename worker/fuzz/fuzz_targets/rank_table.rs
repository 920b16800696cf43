//! Arbitrary bytes as a mounted `hccl.json`: the contract's parser and a worker's use of a
//! completed table. See `npufleet_worker::fuzz`.

#![no_main]

#[global_allocator]
static ALLOCATOR: npufleet_worker::fuzz::CountingAllocator =
    npufleet_worker::fuzz::CountingAllocator;

libfuzzer_sys::fuzz_target!(|data: &[u8]| npufleet_worker::fuzz::rank_table(data));
