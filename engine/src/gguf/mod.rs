//! GGUF files: metadata and tensors, parsed without trusting the file.
//!
//! Every length and offset is checked against the file before it is used; anything wrong is a
//! [`GgufError`] naming what was being read. The whole file is read into memory once and
//! quantized tensors are used from that buffer as they are (no copy, no dequantized copy).

#[cfg(any(test, feature = "tiny"))]
pub mod writer;

use std::collections::BTreeMap;
use std::path::Path;

/// `GGUF` read as a little-endian u32.
pub const MAGIC: u32 = 0x4655_4747;
/// Default tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A tensor element type this engine can compute with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// Blocks of 32: f16 scale, 4-bit values centred on 8.
    Q4_0,
    /// Blocks of 32: f16 scale and f16 minimum, 4-bit values.
    Q4_1,
    /// Blocks of 32: f16 scale, 8-bit signed values.
    Q8_0,
}

impl TensorType {
    /// The GGML type id.
    pub fn id(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q4_0 => 2,
            TensorType::Q4_1 => 3,
            TensorType::Q8_0 => 8,
        }
    }

    /// From a GGML type id, if supported.
    pub fn from_id(id: u32) -> Option<TensorType> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            8 => TensorType::Q8_0,
            _ => return None,
        })
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            TensorType::F32 | TensorType::F16 => 1,
            TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q8_0 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            TensorType::F32 => 4,
            TensorType::F16 => 2,
            TensorType::Q4_0 => 18,
            TensorType::Q4_1 => 20,
            TensorType::Q8_0 => 34,
        }
    }
}

/// GGML's name for a type id, for error messages.
pub fn ggml_type_name(id: u32) -> String {
    let known = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
        "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
        "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    known
        .get(id as usize)
        .map_or_else(|| format!("type {id}"), |n| n.to_string())
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

/// One tensor's description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name, such as `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, fastest-varying first (`dims[0]` is the row length).
    pub dims: Vec<usize>,
    /// Element type.
    pub ty: TensorType,
    /// Byte range of its data within the file.
    pub range: std::ops::Range<usize>,
}

impl TensorInfo {
    /// Elements in the tensor.
    pub fn elems(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A GGUF file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// Reading the file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file: the magic is {found:#010x}, expected {MAGIC:#010x} (\"GGUF\")")]
    BadMagic {
        /// The first four bytes, little-endian.
        found: u32,
    },
    /// A GGUF version this reader does not know.
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    UnsupportedVersion(u32),
    /// The file ends inside something.
    #[error("the file is truncated: it ends inside {what} (at byte {at})")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where.
        at: usize,
    },
    /// A string is not UTF-8.
    #[error("{what} is not valid UTF-8")]
    BadString {
        /// What was being read.
        what: String,
    },
    /// A metadata value type id outside the specification.
    #[error("metadata `{key}` has unknown value type {ty}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type id.
        ty: u32,
    },
    /// A tensor type this engine cannot compute with.
    #[error(
        "tensor `{tensor}` has type {ty}, which is not supported (F32, F16, Q4_0, Q4_1, Q8_0 are)"
    )]
    UnsupportedTensorType {
        /// The tensor.
        tensor: String,
        /// GGML's name for its type.
        ty: String,
    },
    /// A tensor whose shape does not divide into blocks or whose data is outside the file.
    #[error("tensor `{tensor}`: {reason}")]
    BadTensor {
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// A required metadata key is absent or of the wrong type.
    #[error("metadata `{key}` is missing or not {expected}")]
    MissingKey {
        /// The key.
        key: String,
        /// The type expected.
        expected: &'static str,
    },
    /// A required tensor is absent.
    #[error("tensor `{0}` is missing")]
    MissingTensor(String),
    /// The model is not of an architecture this engine runs.
    #[error("architecture `{0}` is not supported (llama is)")]
    UnsupportedArchitecture(String),
}

/// A parsed GGUF file: its bytes, metadata and tensor table.
pub struct Gguf {
    data: Vec<u8>,
    header_len: usize,
    /// GGUF version.
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.data.len())
            .ok_or_else(|| GgufError::Truncated {
                what: what(),
                at: self.pos,
            })?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn len(&mut self, what: &dyn Fn() -> String) -> Result<usize, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        // A length can never exceed what is left of the file; checking here keeps a hostile
        // length from turning into a huge allocation.
        usize::try_from(n)
            .ok()
            .filter(|n| *n <= self.data.len() - self.pos)
            .ok_or_else(|| GgufError::Truncated { what: what(), at })
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let n = self.len(what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadString { what: what() })
    }

    fn value(&mut self, ty: u32, key: &str) -> Result<Value, GgufError> {
        let what = || format!("metadata `{key}`");
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>(&what)?[0])),
            1 => Value::I64(i64::from(i8::from_le_bytes(self.array(&what)?))),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array(&what)?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array(&what)?))),
            4 => Value::U64(u64::from(self.u32(&what)?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array(&what)?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array(&what)?))),
            7 => Value::Bool(self.array::<1>(&what)?[0] != 0),
            8 => Value::Str(self.string(&what)?),
            9 => {
                let item_ty = self.u32(&what)?;
                let n = self.len(&what)?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(item_ty, key)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ty => {
                return Err(GgufError::UnknownValueType {
                    key: key.to_string(),
                    ty,
                });
            }
        })
    }
}

impl Gguf {
    /// Reads and parses a file.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let data = std::fs::read(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Gguf::parse(data)
    }

    /// Parses a whole file held in memory.
    pub fn parse(data: Vec<u8>) -> Result<Gguf, GgufError> {
        let mut c = Cursor {
            data: &data,
            pos: 0,
        };
        let header = || "the header".to_string();
        let magic = c.u32(&header)?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = c.u32(&header)?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = c.len(&header)?;
        let n_kv = c.len(&header)?;

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let ty = c.u32(&|| format!("metadata `{key}`"))?;
            let value = c.value(ty, &key)?;
            metadata.insert(key, value);
        }

        let mut infos = Vec::with_capacity(n_tensors.min(1 << 16));
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor info #{i}"))?;
            let what = || format!("tensor info `{name}`");
            let n_dims = c.u32(&what)? as usize;
            if n_dims > 4 {
                return Err(GgufError::BadTensor {
                    tensor: name,
                    reason: format!("{n_dims} dimensions (at most 4)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&what)?);
            }
            let ty_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            infos.push((name, dims, ty_id, offset));
        }

        let alignment = match metadata.get("general.alignment") {
            Some(Value::U64(a)) if *a > 0 => *a,
            _ => DEFAULT_ALIGNMENT,
        };
        let header_len = c.pos;
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;

        let mut tensors = BTreeMap::new();
        for (name, dims, ty_id, offset) in infos {
            let ty =
                TensorType::from_id(ty_id).ok_or_else(|| GgufError::UnsupportedTensorType {
                    tensor: name.clone(),
                    ty: ggml_type_name(ty_id),
                })?;
            let bad = |reason: String| GgufError::BadTensor {
                tensor: name.clone(),
                reason,
            };
            let dims: Vec<usize> = dims
                .iter()
                .map(|d| usize::try_from(*d).ok().filter(|d| *d > 0))
                .collect::<Option<_>>()
                .ok_or_else(|| bad(format!("bad dimensions {dims:?}")))?;
            let elems = dims
                .iter()
                .try_fold(1usize, |a, d| a.checked_mul(*d))
                .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
            if !dims[0].is_multiple_of(ty.block_elems()) {
                return Err(bad(format!(
                    "row length {} is not a multiple of the block size {}",
                    dims[0],
                    ty.block_elems()
                )));
            }
            let bytes = elems / ty.block_elems() * ty.block_bytes();
            let start = data_start
                .checked_add(offset)
                .and_then(|s| usize::try_from(s).ok());
            let range = start
                .and_then(|s| s.checked_add(bytes).map(|e| s..e))
                .filter(|r| r.end <= data.len())
                .ok_or_else(|| GgufError::Truncated {
                    what: format!("the data of tensor `{name}` ({bytes} bytes at offset {offset})"),
                    at: data.len(),
                })?;
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    ty,
                    range,
                },
            );
        }
        Ok(Gguf {
            data,
            header_len,
            version,
            metadata,
            tensors,
        })
    }

    /// A tensor's description, or the named error.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }

    /// A tensor's raw bytes.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.data[info.range.clone()]
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Takes the file's bytes (tensor ranges index into them).
    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }

    /// The header: magic, metadata and tensor table (what the model fingerprint hashes).
    pub fn header(&self) -> &[u8] {
        &self.data[..self.header_len]
    }

    /// An unsigned integer metadata value.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        match self.metadata.get(key) {
            Some(Value::U64(v)) => Ok(*v),
            Some(Value::I64(v)) if *v >= 0 => Ok(*v as u64),
            _ => Err(GgufError::MissingKey {
                key: key.to_string(),
                expected: "an unsigned integer",
            }),
        }
    }

    /// A float metadata value.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        match self.metadata.get(key) {
            Some(Value::F64(v)) => Ok(*v),
            Some(Value::U64(v)) => Ok(*v as f64),
            _ => Err(GgufError::MissingKey {
                key: key.to_string(),
                expected: "a number",
            }),
        }
    }

    /// A string metadata value.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        match self.metadata.get(key) {
            Some(Value::Str(s)) => Ok(s),
            _ => Err(GgufError::MissingKey {
                key: key.to_string(),
                expected: "a string",
            }),
        }
    }

    /// A string-array metadata value.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let missing = || GgufError::MissingKey {
            key: key.to_string(),
            expected: "an array of strings",
        };
        match self.metadata.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::Str(s) => Ok(s.as_str()),
                    _ => Err(missing()),
                })
                .collect(),
            _ => Err(missing()),
        }
    }

    /// An integer-array metadata value.
    pub fn ints(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let missing = || GgufError::MissingKey {
            key: key.to_string(),
            expected: "an array of integers",
        };
        match self.metadata.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::I64(i) => Ok(*i),
                    Value::U64(u) => Ok(*u as i64),
                    _ => Err(missing()),
                })
                .collect(),
            _ => Err(missing()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{GgufWriter, WValue};
    use super::*;

    fn tiny() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.kv("general.architecture", WValue::Str("llama".into()));
        w.kv("a.list", WValue::StrArray(vec!["x".into(), "y".into()]));
        w.tensor_f32("t", &[4, 2], &[1.0; 8]);
        w.finish()
    }

    #[test]
    fn round_trips_metadata_and_tensors() {
        let g = Gguf::parse(tiny()).unwrap();
        assert_eq!(g.str("general.architecture").unwrap(), "llama");
        assert_eq!(g.strings("a.list").unwrap(), ["x", "y"]);
        let t = g.tensor("t").unwrap();
        assert_eq!((t.dims.clone(), t.ty), (vec![4, 2], TensorType::F32));
        assert_eq!(g.tensor_bytes(t).len(), 32);
    }

    #[test]
    fn named_errors_for_bad_input() {
        let mut bad = tiny();
        bad[0] = b'X';
        assert!(matches!(Gguf::parse(bad), Err(GgufError::BadMagic { .. })));

        let good = tiny();
        for cut in [3, 10, 30, good.len() - 1] {
            let err = Gguf::parse(good[..cut].to_vec()).unwrap_err();
            assert!(
                matches!(err, GgufError::Truncated { .. }),
                "cut {cut}: {err}"
            );
        }

        let mut w = GgufWriter::new();
        w.raw_tensor("blk.0.weird", &[32], 12, vec![0; 144]);
        let err = Gguf::parse(w.finish()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tensor `blk.0.weird` has type Q4_K, which is not supported (F32, F16, Q4_0, Q4_1, Q8_0 are)"
        );
    }
}
