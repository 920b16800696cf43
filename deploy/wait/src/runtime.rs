//! Set-up shared by a process (or a test binary's tests), run once on a runtime of its own.

use std::future::Future;

/// Runs `future` to completion on a new thread with its own single-threaded runtime, for a
/// `static` set up once per test binary: whichever test asks first may be inside any runtime,
/// and what the future starts must outlive that test's runtime.
pub fn block_on_own_thread<T: Send + 'static>(
    future: impl Future<Output = T> + Send + 'static,
) -> T {
    std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(future)
    })
    .join()
    .expect("set-up thread")
}
