//! The grouped kernels on Intel AMX tiles, for batches of at least [`TILE_ROWS`] activation
//! rows: one `tdpbssd` multiplies sixteen activation rows' bytes, read in place, by a
//! column's expanded weights (eight words of four bytes per row: the layout the instruction
//! takes for its second operand), made signed so each product is the weight's true value
//! (`Q5_0`'s q − 16, `Q8_0`'s q). The i32 sums are exact and the float step is the VNNI
//! kernels' own, so the results are identical to theirs; smaller batches and the rows after
//! the last whole tile take the VNNI passes.
//!
//! The k-quant formats stay on the VNNI kernels: with tiles, a 7B-shape `Q4_K_M` prefill
//! of 64 tokens measured 15.5 tok/s against VNNI's 17.0.

use std::arch::asm;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::OnceLock;

use super::*;

/// Activation rows one tile product takes.
pub const TILE_ROWS: usize = 16;

/// Whether this CPU has AMX with 8-bit tiles and the kernel lets this process use them
/// (Linux asks each process to request the tile data state first).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let leaf7 = __cpuid_count(7, 0);
        let (tile, int8) = (leaf7.edx >> 24 & 1 == 1, leaf7.edx >> 25 & 1 == 1);
        super::available()
            && is_x86_feature_detected!("avx512dq")
            && tile
            && int8
            && request_tile_data()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request for a permission; it changes nothing else.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// The tile shapes, as `ldtilecfg` reads them (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// tmm0, tmm1: 16 activation rows × 8 weight rows of i32 sums; tmm2, tmm3: 16 activation
/// rows of 32 bytes; tmm4, tmm5: a column's 8 words × 8 rows × 4 bytes (two sets, so one
/// column's product runs while the next one's operands load).
const CONFIG: TileConfig = {
    let mut bytes_per_row = [0u16; 16];
    let mut rows = [0u8; 16];
    let shapes: [(u8, u16); 6] = [(16, 32), (16, 32), (16, 32), (16, 32), (8, 32), (8, 32)];
    let mut t = 0;
    while t < shapes.len() {
        rows[t] = shapes[t].0;
        bytes_per_row[t] = shapes[t].1;
        t += 1;
    }
    TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row,
        rows,
    }
};

/// Loads [`CONFIG`] on this thread once: the kernels are its only users of tiles, and
/// loading and releasing the shapes around every group cost about 100 ns each time.
fn configure_tiles() {
    thread_local! {
        static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    CONFIGURED.with(|configured| {
        if !configured.replace(true) {
            // SAFETY: `available` confirmed AMX and the permission; the config is valid.
            unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack)) };
        }
    });
}

/// One column's sums against 16 activation rows: `[activation][weight row]`.
type ColumnSums = [[i32; GROUP_ROWS]; TILE_ROWS];

/// The sums of a span's columns (at most [`EXPANDED_SPAN`]) for one tile of activation rows.
type SpanSums = [MaybeUninit<ColumnSums>; EXPANDED_SPAN];

/// One tile product: `$sums` (i32) = `$x` (16 rows of activation bytes, `{stride}` apart)
/// · `$q` (8 rows of 32 weight bytes), stored to `{sums}`.
macro_rules! tile_product {
    ($sums:literal, $x:literal, $q:literal) => {
        concat!(
            "tilezero ",
            $sums,
            "\n",
            "tileloadd ",
            $x,
            ", [{x} + {stride} * 1]\n",
            "tileloadd ",
            $q,
            ", [{q} + {row} * 1]\n",
            "tdpbssd ",
            $sums,
            ", ",
            $x,
            ", ",
            $q,
            "\n",
            "tilestored [{sums} + {row} * 1], ",
            $sums,
        )
    };
}

/// Σ q·x of 32-value column `b` (`q`: 8 words × 8 rows × 4 signed bytes) against 16
/// activation blocks `stride` bytes apart, into `sums`. Even and odd columns use tiles of
/// their own.
///
/// # Safety
/// The tiles must be configured; `q` must have 256 readable bytes, each of the 16
/// activation blocks from `x` 32, and `sums` must be writable.
#[inline(always)]
unsafe fn column_sums(b: usize, q: *const u8, x: *const i8, stride: usize, sums: *mut ColumnSums) {
    macro_rules! product {
        ($template:expr) => {
            // SAFETY: guaranteed by the caller.
            unsafe {
                asm!(
                    $template,
                    x = in(reg) x,
                    stride = in(reg) stride,
                    q = in(reg) q,
                    row = in(reg) 32usize,
                    sums = in(reg) sums,
                    options(nostack),
                )
            }
        };
    }
    if b.is_multiple_of(2) {
        product!(tile_product!("tmm0", "tmm2", "tmm4"))
    } else {
        product!(tile_product!("tmm1", "tmm3", "tmm5"))
    }
}

/// The sums of activation rows `a` and `a + 1`: row a's eight lanes, then row a + 1's.
#[inline]
#[target_feature(enable = "avx512f")]
fn sums_pair(sums: &ColumnSums, a: usize) -> __m512i {
    // SAFETY: rows a and a + 1 are 16 readable i32, one after the other.
    unsafe { _mm512_loadu_si512(sums[a..a + 2].as_ptr().cast()) }
}

// The float steps below take two activation rows in one 512-bit vector (lanes 0..8 the
// first row's, 8..16 the second's): each lane's operations are the 256-bit finish
// functions' own, in the same order, fused where they fuse, so the results are the same.

/// `v` in both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
fn twice(v: __m256) -> __m512 {
    _mm512_insertf32x8::<1>(_mm512_castps256_ps512(v), v)
}

/// `first` in the low half, `second` in the high half.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair(first: f32, second: f32) -> __m512 {
    _mm512_mask_mov_ps(_mm512_set1_ps(first), 0xff00, _mm512_set1_ps(second))
}

/// As [`q4_1_finish`], for two activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")]
fn q4_1_pair(e: &ExpandedQ4_1, x: [&BlockQ8Act; 2], sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(sum);
    *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(twice(e.d), pair(x[0].d, x[1].d)), *acc);
    *acc = _mm512_fmadd_ps(twice(e.m), pair(x[0].s, x[1].s), *acc);
}

/// As [`q5_0_finish`], for two activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")]
fn q5_0_pair(e: &ExpandedQ5_0, x: [&BlockQ8Act; 2], sum: __m512i, acc: &mut __m512) {
    let scaled = _mm512_mul_ps(
        _mm512_mul_ps(twice(e.d), pair(x[0].d, x[1].d)),
        _mm512_cvtepi32_ps(sum),
    );
    *acc = _mm512_add_ps(*acc, scaled);
}

/// As [`q5_1_finish`], for two activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")]
fn q5_1_pair(e: &ExpandedQ5_1, x: [&BlockQ8Act; 2], sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(sum);
    let scaled = _mm512_mul_ps(_mm512_mul_ps(twice(e.d), pair(x[0].d, x[1].d)), sum);
    let offset = _mm512_mul_ps(twice(e.m), pair(x[0].s, x[1].s));
    *acc = _mm512_add_ps(*acc, _mm512_add_ps(scaled, offset));
}

/// As [`q8_0_finish`], for two activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")]
fn q8_0_pair(e: &ExpandedQ8_0, x: [&BlockQ8Act; 2], sum: __m512i, acc: &mut __m512) {
    let sum = _mm512_cvtepi32_ps(sum);
    *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(twice(e.d), pair(x[0].d, x[1].d)), *acc);
}

/// What the tile passes need of an expanded column format.
trait TileFormat: Sized {
    /// The column's weights as the tile reads them: eight words of four signed bytes per
    /// row, each the weight's true value.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    unsafe fn signed_words(&self) -> [__m256i; 8];

    /// Adds the products over `span` of activation rows `a` and `a + 1` (`rows` are their
    /// blocks of the span) to `acc` (row a's lanes, then row a + 1's), column by column,
    /// from the span's sums.
    ///
    /// # Safety
    /// `sums` must have been written by [`span_sums`] for this span and format; the CPU
    /// must support the module's features.
    unsafe fn finish_pair(
        span: &[Self],
        rows: [&[BlockQ8Act]; 2],
        sums: &SpanSums,
        a: usize,
        acc: &mut __m512,
    );
}

/// The sums of every column of a span (`words`, from [`TileFormat::signed_words`])
/// against the 16 activation rows of `x` (blocks `blocks` of `nb` each).
///
/// # Safety
/// The tiles must be configured; `x` must hold 16 rows of `nb` blocks, and `words` at
/// most [`EXPANDED_SPAN`] columns.
#[inline(always)]
unsafe fn span_sums<E: TileFormat>(
    words: &[[__m256i; 8]],
    x: &[BlockQ8Act],
    nb: usize,
    blocks: &Range<usize>,
    sums: &mut SpanSums,
) {
    let stride = nb * std::mem::size_of::<BlockQ8Act>();
    for (b, words) in words.iter().enumerate() {
        let (q, x) = (words.as_ptr().cast(), x[blocks.start + b].qs.as_ptr());
        // SAFETY: the 16 activation rows of block b are in `x`, `stride` apart; a column's
        // words are 256 bytes; b < EXPANDED_SPAN.
        unsafe { column_sums(b, q, x, stride, sums[b].as_mut_ptr()) }
    }
}

/// A 32-value column format: its signed weight words and its float step.
macro_rules! tile_format {
    ($ty:ty, |$e:ident| $words:expr, $pair:ident) => {
        impl TileFormat for $ty {
            #[inline]
            #[target_feature(enable = "avx2")]
            unsafe fn signed_words(&self) -> [__m256i; 8] {
                let $e = self;
                $words
            }

            #[inline(always)]
            unsafe fn finish_pair(
                span: &[Self],
                rows: [&[BlockQ8Act]; 2],
                sums: &SpanSums,
                a: usize,
                acc: &mut __m512,
            ) {
                for (b, (e, sums)) in span.iter().zip(sums).enumerate() {
                    // SAFETY: written by `span_sums`; the caller guarantees the CPU features.
                    unsafe {
                        $pair(e, [&rows[0][b], &rows[1][b]], sums_pair(sums.assume_init_ref(), a), acc)
                    };
                }
            }
        }
    };
}

/// Each byte of `words` plus `by`, wrapping.
#[inline]
#[target_feature(enable = "avx2")]
fn add_bytes(mut words: [__m256i; 8], by: i8) -> [__m256i; 8] {
    for v in &mut words {
        *v = _mm256_add_epi8(*v, _mm256_set1_epi8(by));
    }
    words
}

tile_format!(ExpandedQ4_1, |e| e.nibbles, q4_1_pair);
tile_format!(ExpandedQ5_0, |e| add_bytes(e.q, -16), q5_0_pair);
tile_format!(ExpandedQ5_1, |e| e.q, q5_1_pair);
tile_format!(ExpandedQ8_0, |e| add_bytes(e.unsigned, i8::MIN), q8_0_pair);

/// The whole tiles of activation rows in `x` (`out.len()` rows, a multiple of 16) against
/// a span of expanded columns, added to `out`. The products of the next tile are issued
/// before the float steps of this one, so the tile unit and the vector pipes overlap.
///
/// # Safety
/// The tiles must be configured, the span at most [`EXPANDED_SPAN`] columns, and the CPU must
/// support the module's features.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")]
unsafe fn tile_passes<E: TileFormat>(
    span: &[E],
    x: &[BlockQ8Act],
    nb: usize,
    blocks: &Range<usize>,
    out: &mut [[f32; GROUP_ROWS]],
) {
    let tiles = out.len() / TILE_ROWS;
    if tiles == 0 {
        return;
    }
    let mut words = [const { MaybeUninit::<[__m256i; 8]>::uninit() }; EXPANDED_SPAN];
    for (words, e) in words.iter_mut().zip(span) {
        // SAFETY: the caller guarantees the CPU features.
        words.write(unsafe { e.signed_words() });
    }
    // SAFETY: the loop above wrote one entry per column of the span.
    let words =
        unsafe { std::slice::from_raw_parts(words.as_ptr() as *const [__m256i; 8], span.len()) };
    let mut sums = [
        [const { MaybeUninit::<ColumnSums>::uninit() }; EXPANDED_SPAN],
        [const { MaybeUninit::<ColumnSums>::uninit() }; EXPANDED_SPAN],
    ];
    let tile_rows = |t: usize| &x[t * TILE_ROWS * nb..];
    // SAFETY: guaranteed by the caller; tile 0's rows are in `x`.
    unsafe { span_sums::<E>(words, tile_rows(0), nb, blocks, &mut sums[0]) };
    for t in 0..tiles {
        let (even, odd) = sums.split_at_mut(1);
        let (this, next) = if t.is_multiple_of(2) {
            (&even[0], &mut odd[0])
        } else {
            (&odd[0], &mut even[0])
        };
        if t + 1 < tiles {
            // SAFETY: as above, for tile t + 1.
            unsafe { span_sums::<E>(words, tile_rows(t + 1), nb, blocks, next) };
        }
        let tile = &mut out[t * TILE_ROWS..(t + 1) * TILE_ROWS];
        for a in (0..TILE_ROWS).step_by(2) {
            let row = |a: usize| &x[(t * TILE_ROWS + a) * nb + blocks.start..];
            let out = tile[a..a + 2].as_mut_ptr().cast::<f32>();
            // SAFETY: output rows a and a + 1 are 16 f32, one after the other; `this` holds
            // tile t's sums.
            unsafe {
                let mut acc = _mm512_loadu_ps(out);
                E::finish_pair(span, [row(a), row(a + 1)], this, a, &mut acc);
                _mm512_storeu_ps(out, acc);
            }
        }
    }
}

/// A 32-value block format's tile kernel: each span of expanded columns takes
/// [`tile_passes`] for its whole tiles of activation rows and the VNNI `$pass` for the rest.
macro_rules! tile_kernel {
    ($(#[$doc:meta])* $gemm:ident, $block_ty:ty, $expand:ident, $pass:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The CPU must support the module's features, and [`available`] must be true.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")]
        pub unsafe fn $gemm(w: &[$block_ty], x: &[BlockQ8Act], out: &mut [[f32; GROUP_ROWS]]) {
            let nb = w.len() / GROUP_ROWS;
            if out.len() < TILE_ROWS || nb == 0 {
                // SAFETY: guaranteed by the caller.
                return unsafe { super::$gemm(w, x, out) };
            }
            out.fill([0.0; GROUP_ROWS]);
            let whole = out.len() / TILE_ROWS * TILE_ROWS;
            configure_tiles();
            over_expanded_spans(w, nb, |b| $expand(b), |span, blocks| {
                // SAFETY: the tiles are configured; spans are at most EXPANDED_SPAN columns.
                unsafe { tile_passes(span, x, nb, &blocks, &mut out[..whole]) };
                over_activation_rows!($pass, span, &x[whole * nb..], nb, blocks,
                    &mut out[whole..], 8, [7, 6, 5, 4, 3, 2, 1]);
            });
        }
    };
}

tile_kernel!(
    /// As [`super::gemm_q4_1_group`].
    gemm_q4_1_group, BlockQ4_1, expand_q4_1, q4_1_expanded
);
tile_kernel!(
    /// As [`super::gemm_q5_0_group`].
    gemm_q5_0_group, BlockQ5_0, expand_q5_0, q5_0_expanded
);
tile_kernel!(
    /// As [`super::gemm_q5_1_group`].
    gemm_q5_1_group, BlockQ5_1, expand_q5_1, q5_1_expanded
);
tile_kernel!(
    /// As [`super::gemm_q8_0_group`].
    gemm_q8_0_group, BlockQ8_0, expand_q8_0, q8_0_expanded
);
