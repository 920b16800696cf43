//! GGUF files: header, metadata and tensor directory parsed from a memory map, and a writer
//! for the small test models.
//!
//! Layout (little endian): magic `GGUF`, version (2 or 3), tensor count, metadata count, the
//! metadata key/value pairs, the tensor infos (name, dims with the fastest-varying first,
//! type, offset), then the tensor data at an aligned offset.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};

use crate::backend::Blocks;
use crate::backend::blocks::FileLayout;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// The least a tensor info takes: name length, dimension count, one dimension, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;
/// The least a metadata entry takes: key length, value type, a one-byte value.
const MIN_METADATA_ENTRY_BYTES: usize = 8 + 4 + 1;

/// The least one metadata value of type `ty` takes in the file (1 for a type the reader will
/// refuse anyway).
fn encoded_size_at_least(ty: u32) -> usize {
    match ty {
        2 | 3 => 2,
        4..=6 => 4,
        // A string's length; an array's item type and count.
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => 1,
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
}

/// The ggml tensor types this engine reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    Bf16,
}

impl TensorType {
    fn from_id(id: u32) -> Option<TensorType> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            6 => TensorType::Q5_0,
            7 => TensorType::Q5_1,
            8 => TensorType::Q8_0,
            12 => TensorType::Q4K,
            13 => TensorType::Q5K,
            14 => TensorType::Q6K,
            30 => TensorType::Bf16,
            _ => return None,
        })
    }

    fn id(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q4_0 => 2,
            TensorType::Q4_1 => 3,
            TensorType::Q5_0 => 6,
            TensorType::Q5_1 => 7,
            TensorType::Q8_0 => 8,
            TensorType::Q4K => 12,
            TensorType::Q5K => 13,
            TensorType::Q6K => 14,
            TensorType::Bf16 => 30,
        }
    }

    /// (elements per block, bytes per block)
    pub fn block(self) -> (usize, usize) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::Bf16 => (1, 2),
            TensorType::Q4_0 => (32, 18),
            TensorType::Q4_1 => (32, 20),
            TensorType::Q5_0 => (32, 22),
            TensorType::Q5_1 => (32, 24),
            TensorType::Q8_0 => (32, 34),
            TensorType::Q4K => (256, 144),
            TensorType::Q5K => (256, 176),
            TensorType::Q6K => (256, 210),
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` varies fastest (the columns of a matrix).
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

pub struct GgufFile {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Shared with the weights read in place from it, which keep it mapped.
    mmap: Arc<memmap2::Mmap>,
}

/// Everything in front of the tensor data: the version, the metadata and where each tensor
/// lies, checked against the file's size. A model file is untrusted input: any malformed file
/// gives an error naming what is wrong.
#[derive(Debug)]
pub struct Directory {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .with_context(|| {
                format!(
                    "file truncated at byte {} (needed {n} more bytes)",
                    self.pos
                )
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of elements that each take at least `min_bytes` in the file. A count the rest
    /// of the file cannot hold is corrupt, and refusing it here keeps every allocation sized
    /// by a count within the bytes that back it.
    fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let n = self.u64()?;
        let remaining = self.buf.len() - self.pos;
        ensure!(
            n <= (remaining / min_bytes) as u64,
            "{what} count {n} does not fit in the {remaining} bytes left in the file"
        );
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.count("string length", 1)?;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).context("string is not valid UTF-8")
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                ensure!(depth < 4, "metadata arrays nested too deeply");
                let item_ty = self.u32()?;
                let n = self.count("array", encoded_size_at_least(item_ty))?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => bail!("unknown metadata value type {other}"),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the file is mapped read-only; the engine never writes model files, and a
        // model replaced while mapped is outside what a serving worker supports. Weights read
        // in place keep the mapping for the model's lifetime, so the file must stay as it is
        // (replacing it by a rename is fine; truncating it in place is not).
        let mmap = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("mapping {}", path.display()))?;
        Self::parse(mmap).with_context(|| format!("reading GGUF file {}", path.display()))
    }

    fn parse(mmap: memmap2::Mmap) -> Result<GgufFile> {
        let Directory {
            version,
            metadata,
            tensors,
        } = parse_directory(&mmap)?;
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            mmap: Arc::new(mmap),
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[info.start..info.start + info.len]
    }

    /// A tensor's values read in place from the mapping where that is sound, else decoded
    /// from its bytes by `decode`.
    pub fn tensor_blocks<T: FileLayout>(
        &self,
        info: &TensorInfo,
        decode: impl FnOnce(&[u8]) -> Vec<T>,
    ) -> Blocks<T> {
        Blocks::mapped(&self.mmap, info.start..info.start + info.len)
            .unwrap_or_else(|| decode(self.tensor_bytes(info)).into())
    }
}

/// Parses the [`Directory`] of the GGUF file whose bytes are `file`.
pub fn parse_directory(file: &[u8]) -> Result<Directory> {
    let mut r = Reader { buf: file, pos: 0 };
    ensure!(
        r.take(4).ok() == Some(MAGIC.as_slice()),
        "not a GGUF file (bad magic)"
    );
    let version = r.u32()?;
    ensure!(
        matches!(version, 2 | 3),
        "unsupported GGUF version {version}"
    );
    let n_tensors = r.count("tensor", MIN_TENSOR_INFO_BYTES)?;
    let n_kv = r.count("metadata", MIN_METADATA_ENTRY_BYTES)?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r
            .value(ty, 0)
            .with_context(|| format!("metadata key {key}"))?;
        ensure!(
            !metadata.contains_key(&key),
            "metadata key {key} appears twice"
        );
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        Some(v) => v
            .as_u64()
            .filter(|a| a.is_power_of_two())
            .context("general.alignment is not a power of two")?,
        None => DEFAULT_ALIGNMENT,
    };
    let mut infos = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string()?;
        let n_dims = r.u32()?;
        ensure!(
            (1..=4).contains(&n_dims),
            "tensor {name}: {n_dims} dimensions"
        );
        let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
        let ty_id = r.u32()?;
        let ty = TensorType::from_id(ty_id)
            .with_context(|| format!("tensor {name}: unsupported ggml type {ty_id}"))?;
        let offset = r.u64()?;
        infos.push((name, dims, ty, offset));
    }
    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = BTreeMap::new();
    for (name, dims, ty, offset) in infos {
        let elements = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .with_context(|| format!("tensor {name}: element count overflows"))?;
        let (block, block_bytes) = ty.block();
        ensure!(
            elements.is_multiple_of(block as u64) && dims[0].is_multiple_of(block as u64),
            "tensor {name}: row length {} is not a multiple of the {ty:?} block size",
            dims[0]
        );
        let len = (elements / block as u64)
            .checked_mul(block_bytes as u64)
            .with_context(|| format!("tensor {name}: byte length overflows"))?;
        let start = data_start
            .checked_add(offset)
            .context("tensor offset overflows")?;
        ensure!(
            start
                .checked_add(len)
                .is_some_and(|e| e <= file.len() as u64),
            "tensor {name}: data lies beyond the end of the file"
        );
        ensure!(!tensors.contains_key(&name), "tensor {name} appears twice");
        tensors.insert(
            name.clone(),
            TensorInfo {
                name,
                dims,
                ty,
                start: start as usize,
                len: len as usize,
            },
        );
    }
    Ok(Directory {
        version,
        metadata,
        tensors,
    })
}

/// A tensor to write: ggml dims (fastest first), type and the already-encoded bytes.
pub struct WriteTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: TensorType,
    pub data: Vec<u8>,
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            let ty = items.first().map_or(4, Value::type_id);
            ensure!(
                items.iter().all(|i| i.type_id() == ty),
                "mixed-type metadata array"
            );
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item)?;
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
    Ok(())
}

/// Writes a GGUF v3 file.
pub fn write(path: &Path, metadata: &[(String, Value)], tensors: &[WriteTensor]) -> Result<()> {
    let align = |n: usize| n.div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize;
    let mut head = Vec::new();
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        write_string(&mut head, key);
        head.extend_from_slice(&value.type_id().to_le_bytes());
        write_value(&mut head, value)?;
    }
    let mut offset = 0usize;
    for t in tensors {
        write_string(&mut head, &t.name);
        head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&t.ty.id().to_le_bytes());
        head.extend_from_slice(&(offset as u64).to_le_bytes());
        offset = align(offset + t.data.len());
    }
    head.resize(align(head.len()), 0);
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    file.write_all(&head)?;
    for t in tensors {
        file.write_all(&t.data)?;
        file.write_all(&vec![0u8; align(t.data.len()) - t.data.len()])?;
    }
    file.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A header declaring `tensors` and `metadata` entries, followed by `body`.
    fn file(tensors: u64, metadata: u64, body: &[u8]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&tensors.to_le_bytes());
        out.extend_from_slice(&metadata.to_le_bytes());
        out.extend_from_slice(body);
        out
    }

    fn tensor_info(out: &mut Vec<u8>, name: &str, dims: &[u64], ty: TensorType, offset: u64) {
        string(out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
    }

    fn error(bytes: &[u8]) -> String {
        format!("{:#}", parse_directory(bytes).unwrap_err())
    }

    #[test]
    fn reads_back_what_the_writer_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String("llama".into()),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
            ),
        ];
        let tensors = [WriteTensor {
            name: "w".into(),
            dims: vec![4, 2],
            ty: TensorType::F32,
            data: vec![0; 32],
        }];
        write(&path, &metadata, &tensors).unwrap();
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(
            file.get("general.architecture").and_then(Value::as_str),
            Some("llama")
        );
        let w = &file.tensors["w"];
        assert_eq!((w.dims.as_slice(), w.len), (&[4u64, 2][..], 32));
        assert_eq!(file.tensor_bytes(w).len(), 32);
    }

    #[test]
    fn a_tensor_whose_byte_length_overflows_is_an_error_not_a_wrap() {
        let mut body = Vec::new();
        // 2^32 × 2^31 f32 elements: the element count fits in 64 bits, the bytes do not.
        tensor_info(&mut body, "huge", &[1 << 32, 1 << 31], TensorType::F32, 0);
        assert!(error(&file(1, 0, &body)).contains("tensor huge: byte length overflows"));
    }

    #[test]
    fn counts_the_rest_of_the_file_cannot_hold_are_refused_before_allocating() {
        // 2^40 tensors in a 24-byte file.
        let err = error(&file(1 << 40, 0, &[]));
        assert!(
            err.contains("tensor count 1099511627776 does not fit"),
            "{err}"
        );
        // A u32 array of 16 items has 64 bytes of items; only 16 bytes follow.
        let mut body = Vec::new();
        string(&mut body, "k");
        body.extend_from_slice(&9u32.to_le_bytes());
        body.extend_from_slice(&4u32.to_le_bytes());
        body.extend_from_slice(&16u64.to_le_bytes());
        body.extend_from_slice(&[0; 16]);
        let err = error(&file(0, 1, &body));
        assert!(
            err.contains("array count 16 does not fit in the 16 bytes"),
            "{err}"
        );
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut body = Vec::new();
        for _ in 0..2 {
            string(&mut body, "general.name");
            body.extend_from_slice(&0u32.to_le_bytes());
            body.push(1);
        }
        assert!(error(&file(0, 2, &body)).contains("metadata key general.name appears twice"));

        let mut body = Vec::new();
        for _ in 0..2 {
            tensor_info(&mut body, "w", &[8], TensorType::F32, 0);
        }
        let mut bytes = file(2, 0, &body);
        bytes.resize(bytes.len().div_ceil(32) * 32 + 32, 0);
        assert!(error(&bytes).contains("tensor w appears twice"));
    }

    #[test]
    fn names_what_is_wrong_with_a_malformed_file() {
        let cases: [(&[u8], &str); 3] = [
            (b"GGML", "not a GGUF file"),
            (b"GGUF\x07\0\0\0", "unsupported GGUF version 7"),
            (b"GGUF\x03\0\0\0\0\0", "file truncated at byte 8"),
        ];
        for (bytes, expected) in cases {
            let err = error(bytes);
            assert!(err.contains(expected), "{err}");
        }
        let mut body = Vec::new();
        tensor_info(&mut body, "w", &[8], TensorType::F32, 64);
        assert!(
            error(&file(1, 0, &body)).contains("tensor w: data lies beyond the end of the file")
        );
    }

    /// A k-quant tensor `dims` whose file holds `data` bytes of tensor data.
    fn kquant_file(dims: &[u64], ty: TensorType, data: usize) -> Vec<u8> {
        let mut body = Vec::new();
        tensor_info(&mut body, "blk.0.ffn_down.weight", dims, ty, 0);
        let mut bytes = file(1, 0, &body);
        bytes.resize(bytes.len().div_ceil(32) * 32 + data, 0);
        bytes
    }

    #[test]
    fn k_quant_tensors_must_be_whole_super_blocks() {
        for (ty, block_bytes) in [
            (TensorType::Q4K, 144),
            (TensorType::Q5K, 176),
            (TensorType::Q6K, 210),
        ] {
            assert_eq!(TensorType::from_id(ty.id()), Some(ty));
            // Two rows of 512 values: four super-blocks.
            let whole = kquant_file(&[512, 2], ty, 4 * block_bytes);
            let dir = parse_directory(&whole).unwrap();
            assert_eq!(dir.tensors["blk.0.ffn_down.weight"].len, 4 * block_bytes);
            // SmolLM2's 576-wide rows are 2.25 super-blocks.
            let err = error(&kquant_file(&[576, 2], ty, 5 * block_bytes));
            assert!(
                err.contains("tensor blk.0.ffn_down.weight: row length 576 is not a multiple"),
                "{err}"
            );
            let err = error(&kquant_file(&[512, 2], ty, 4 * block_bytes - 1));
            assert!(
                err.contains("tensor blk.0.ffn_down.weight: data lies beyond the end"),
                "{err}"
            );
        }
    }
}
