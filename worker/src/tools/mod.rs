//! What the worker binary offers besides serving, kept out of the serving layers so that
//! each layer only calls the one below it: the engine benchmark beside llama.cpp, the
//! collective and tensor-parallel benchmarks and the Ascend self-test. Tools may call any
//! layer; no layer calls a tool. The test-model generator the tests use is not shipped: it
//! lives in the `npufleet-worker-testkit` crate beside this one.

pub mod ascend_selftest;
pub mod bench;
pub mod collective_bench;
pub mod tp_bench;

/// Each rank thread's result, in rank order; a thread that panicked is an error.
fn join_ranks<T>(
    handles: Vec<std::thread::ScopedJoinHandle<'_, anyhow::Result<T>>>,
) -> Vec<anyhow::Result<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank thread panicked")))
        })
        .collect()
}
