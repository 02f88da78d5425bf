//! Writes GGUF files: the tiny random-weight test model and malformed inputs for tests.

use half::f16;

use super::{DEFAULT_ALIGNMENT, MAGIC, TensorType};

/// A metadata value to write.
#[derive(Debug, Clone)]
pub enum WValue {
    /// u32.
    U32(u32),
    /// f32.
    F32(f32),
    /// bool.
    Bool(bool),
    /// string.
    Str(String),
    /// array of strings.
    StrArray(Vec<String>),
    /// array of i32.
    I32Array(Vec<i32>),
}

/// Builds a GGUF v3 file in memory.
#[derive(Default)]
pub struct GgufWriter {
    kvs: Vec<(String, WValue)>,
    tensors: Vec<(String, Vec<usize>, u32, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata entry.
    pub fn kv(&mut self, key: &str, value: WValue) {
        self.kvs.push((key.to_string(), value));
    }

    /// Adds a tensor with raw bytes of GGML type `ty_id`.
    pub fn raw_tensor(&mut self, name: &str, dims: &[usize], ty_id: u32, bytes: Vec<u8>) {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty_id, bytes));
    }

    /// Adds an F32 tensor.
    pub fn tensor_f32(&mut self, name: &str, dims: &[usize], values: &[f32]) {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.raw_tensor(name, dims, TensorType::F32.id(), bytes);
    }

    /// Adds a tensor quantized to `ty` from `values` (row-major, rows of `dims[0]`).
    pub fn tensor_quantized(&mut self, name: &str, dims: &[usize], ty: TensorType, values: &[f32]) {
        let bytes = quantize(ty, values);
        self.raw_tensor(name, dims, ty.id(), bytes);
    }

    /// The file's bytes.
    pub fn finish(self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(MAGIC.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            put_value(&mut out, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend((*d as u64).to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + bytes.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        }
        let start = (out.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        out.resize(start as usize, 0);
        for ((_, _, _, bytes), off) in self.tensors.iter().zip(offsets) {
            out.resize((start + off) as usize, 0);
            out.extend(bytes);
        }
        out
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &WValue) {
    match v {
        WValue::U32(x) => {
            out.extend(4u32.to_le_bytes());
            out.extend(x.to_le_bytes());
        }
        WValue::F32(x) => {
            out.extend(6u32.to_le_bytes());
            out.extend(x.to_le_bytes());
        }
        WValue::Bool(x) => {
            out.extend(7u32.to_le_bytes());
            out.push(u8::from(*x));
        }
        WValue::Str(s) => {
            out.extend(8u32.to_le_bytes());
            put_str(out, s);
        }
        WValue::StrArray(items) => {
            out.extend(9u32.to_le_bytes());
            out.extend(8u32.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for s in items {
                put_str(out, s);
            }
        }
        WValue::I32Array(items) => {
            out.extend(9u32.to_le_bytes());
            out.extend(5u32.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for x in items {
                out.extend(x.to_le_bytes());
            }
        }
    }
}

/// Quantizes `values` into GGML blocks of `ty` (the reference rounding of ggml-quants.c).
pub fn quantize(ty: TensorType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    match ty {
        TensorType::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        TensorType::F16 => out.extend(values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes())),
        TensorType::Q4_0 => {
            for b in values.chunks(32) {
                let amax = b
                    .iter()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
                let d = amax / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let q = |x: f32| ((x * id + 8.5) as i32).clamp(0, 15) as u8;
                    out.push(q(b[j]) | (q(b[j + 16]) << 4));
                }
            }
        }
        TensorType::Q4_1 => {
            for b in values.chunks(32) {
                let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let q = |x: f32| (((x - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    out.push(q(b[j]) | (q(b[j + 16]) << 4));
                }
            }
        }
        TensorType::Q8_0 => {
            for b in values.chunks(32) {
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|x| (x * id).round() as i8 as u8));
            }
        }
    }
    out
}
