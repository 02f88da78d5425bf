//! `duet gpu-check`: what this build does on a real GPU, checked against the CPU.
//!
//! Run by `tools/gpu-check.sh` on a machine with a GPU (none here). Each line of the report is
//! one check with its measured figure; the first failure ends the check with its error.
//! Checked: the context's lifecycle (device memory in use back to its level after a context
//! is closed and reopened), the KV pool in device memory (a page run and one layer of a page
//! round-trip byte for byte), the double-buffered staging copy-out (bytes equal a direct read,
//! its GB/s), and every kernel against a CPU computation of the same thing.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::f16;

use super::CudaContextHandle;
use super::kernels::Kernels;
use super::memory::DeviceKvPool;
use super::staging::CudaStaging;
use crate::context::{ComputeContext, ContextFactory, Devices, Incarnation};
use crate::device::{Device, DeviceError};
use crate::kv::{KvDtype, KvLayout};
use crate::staging::stream_out;

/// Runs every check on `cuda:ordinal`; the report's lines, or the first error after them.
pub fn run(ordinal: usize, out: &mut dyn FnMut(String)) -> Result<(), DeviceError> {
    let device = Device::Cuda(ordinal);
    // 1. Lifecycle: memory in use before, with and after a context.
    let mut first = Incarnation::open(&Devices, device)?;
    let base = in_use(&mut first)?;
    let (pool_mib, with_pool) = {
        let handle = match first.context() {
            Some(crate::context::AnyContext::Cuda(h)) => h,
            _ => {
                return Err(DeviceError::Driver(
                    "cuda:N opened a non-CUDA context".into(),
                ));
            }
        };
        let (major, minor) = handle.context().compute_capability()?;
        out(format!(
            "device {device}: {} (compute {major}.{minor}), {} MiB in use with the context open",
            handle.name()?,
            base / (1 << 20)
        ));
        let held = pool_and_staging(handle, out)?;
        kernels(handle, out)?;
        held
    };
    first.close()?;
    let mut second = Incarnation::open(&Devices, device)?;
    let again = in_use(&mut second)?;
    out(format!(
        "lifecycle: closed and reopened; in use {} MiB (was {} MiB at the first open, {} MiB \
         while the first held a {pool_mib} MiB pool): {}",
        again / (1 << 20),
        base / (1 << 20),
        with_pool / (1 << 20),
        if again <= base + (8 << 20) {
            "ok"
        } else {
            "LEAK"
        }
    ));
    second.close()?;
    let _ = Devices.open(Device::Cpu)?;
    Ok(())
}

fn in_use<C: ComputeContext>(inc: &mut Incarnation<C>) -> Result<usize, DeviceError> {
    inc.context()
        .ok_or(DeviceError::Driver("closed".into()))?
        .memory_in_use()
        .map(|m| m.unwrap_or(0))
}

/// SmolLM2-135M's KV shape, f16, 16-token pages.
fn layout() -> KvLayout {
    KvLayout {
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
        page_size: 16,
        dtype: KvDtype::F16,
    }
}

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The pool's MiB and the device memory in use while it was held.
fn pool_and_staging(
    h: &CudaContextHandle,
    out: &mut dyn FnMut(String),
) -> Result<(usize, usize), DeviceError> {
    let layout = layout();
    let pages = 4096;
    let pool = DeviceKvPool::new(h.context(), layout, pages)?;
    let bytes = pattern(layout.run_bytes(0, pages).len(), 7);
    pool.write_run(0, &bytes)?;
    let run = pool.read_run(100, 37)?;
    let want = &bytes[layout.run_bytes(100, 37)];
    let layer = layout.layer_bytes(2000, 17);
    let mut one = vec![0u8; layer.len()];
    pool.memory().read(layer.clone(), &mut one)?;
    let ok = run == want && one == bytes[layer];
    out(format!(
        "kv pool: {pages} pages x {} KiB in device memory (cuMemAlloc); a 37-page run and one \
         layer of a page read back {}",
        layout.page_bytes() / 1024,
        if ok { "equal" } else { "DIFFERENT" }
    ));
    // Staging: three runs through two 1 MiB pinned slots, then the whole pool timed.
    let ranges = [
        layout.run_bytes(3, 40),
        layout.run_bytes(900, 1),
        layout.run_bytes(1200, 300),
    ];
    let mut staging = CudaStaging::new(pool.memory(), h.copy().clone(), 1 << 20)?;
    let mut got = Vec::new();
    stream_out(&mut staging, None, &ranges, |_, b| {
        got.extend_from_slice(b);
        Ok::<_, ()>(())
    })
    .map_err(|e| DeviceError::Driver(format!("{e:?}")))?;
    let want: Vec<u8> = ranges
        .iter()
        .flat_map(|r| bytes[r.clone()].to_vec())
        .collect();
    let all = [layout.run_bytes(0, pages)];
    let mut sink = 0u64;
    let t = Instant::now();
    let n = stream_out(&mut staging, None, &all, |_, b| {
        sink = sink.wrapping_add(u64::from(b[b.len() - 1]));
        Ok::<_, ()>(())
    })
    .map_err(|e| DeviceError::Driver(format!("{e:?}")))?;
    let secs = t.elapsed().as_secs_f64();
    out(format!(
        "staging: 3 runs through two pinned 1 MiB slots {}; whole pool ({} MiB) out at {:.1} GB/s",
        if got == want {
            "equal a direct read"
        } else {
            "DIFFERENT"
        },
        n >> 20,
        n as f64 / secs / 1e9
    ));
    let held = h.memory_in_use()?.unwrap_or(0);
    Ok((layout.run_bytes(0, pages).len() >> 20, held))
}

fn floats(n: usize, seed: u64) -> Vec<f32> {
    pattern(n * 2, seed)
        .chunks(2)
        .map(|c| (f32::from(c[0]) - 127.5) / 128.0 + f32::from(c[1]) / 4096.0)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn up<T: cudarc::driver::DeviceRepr>(
    s: &Arc<CudaStream>,
    v: &[T],
) -> Result<CudaSlice<T>, DeviceError> {
    Ok(s.clone_htod(v)?)
}

fn cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn kernels(h: &CudaContextHandle, out: &mut dyn FnMut(String)) -> Result<(), DeviceError> {
    let ctx: &Arc<CudaContext> = h.context();
    let s = h.compute();
    let t = Instant::now();
    let k = Kernels::load(ctx)?;
    out(format!(
        "kernels: compiled by NVRTC and loaded in {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    ));

    // rms_norm: 4 rows of 576.
    let (rows, dim) = (4usize, 576usize);
    let x = floats(rows * dim, 1);
    let w = floats(dim, 2);
    let mut cpu = vec![0f32; rows * dim];
    for r in 0..rows {
        let row = &x[r * dim..(r + 1) * dim];
        let ss: f32 = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let scale = 1.0 / (ss + 1e-5).sqrt();
        for i in 0..dim {
            cpu[r * dim + i] = row[i] * scale * w[i];
        }
    }
    let (dx, dw) = (up(s, &x)?, up(s, &w)?);
    let mut dout = s.alloc_zeros::<f32>(rows * dim)?;
    let f = k.get("rms_norm")?;
    let (dim_i, eps) = (dim as i32, 1e-5f32);
    // SAFETY: argument types and lengths match the kernel's signature (kernels.cu).
    unsafe {
        s.launch_builder(&f)
            .arg(&dx)
            .arg(&dw)
            .arg(&mut dout)
            .arg(&dim_i)
            .arg(&eps)
            .launch(cfg((rows as u32, 1), 256))?
    };
    let gpu = s.clone_dtoh(&dout)?;
    out(format!(
        "rms_norm: max |gpu - cpu| {:.2e}",
        max_diff(&gpu, &cpu)
    ));

    // matmul_f16: 5 tokens x 576 -> 1536.
    let (tokens, inn, outn) = (5usize, 576usize, 1536usize);
    let x = floats(tokens * inn, 3);
    let wf = floats(outn * inn, 4);
    let wh: Vec<u16> = wf.iter().map(|v| f16::from_f32(*v).to_bits()).collect();
    let mut cpu = vec![0f32; tokens * outn];
    for t in 0..tokens {
        for o in 0..outn {
            cpu[t * outn + o] = (0..inn)
                .map(|i| x[t * inn + i] * f16::from_bits(wh[o * inn + i]).to_f32())
                .sum();
        }
    }
    let (dx, dw) = (up(s, &x)?, up(s, &wh)?);
    let mut dy = s.alloc_zeros::<f32>(tokens * outn)?;
    let f = k.get("matmul_f16")?;
    let (ti, ii, oi) = (tokens as i32, inn as i32, outn as i32);
    // SAFETY: as above.
    unsafe {
        s.launch_builder(&f)
            .arg(&dx)
            .arg(&dw)
            .arg(&mut dy)
            .arg(&ti)
            .arg(&ii)
            .arg(&oi)
            .launch(cfg(
                (outn.div_ceil(8) as u32, tokens.div_ceil(8) as u32),
                256,
            ))?
    };
    let gpu = s.clone_dtoh(&dy)?;
    out(format!(
        "matmul_f16: max |gpu - cpu| {:.2e} (sums of 576 products)",
        max_diff(&gpu, &cpu)
    ));

    // argmax of those rows.
    let f = k.get("argmax")?;
    let mut di = s.alloc_zeros::<i32>(tokens)?;
    // SAFETY: as above.
    unsafe {
        s.launch_builder(&f)
            .arg(&dy)
            .arg(&oi)
            .arg(&mut di)
            .launch(cfg((tokens as u32, 1), 256))?
    };
    let gpu_arg = s.clone_dtoh(&di)?;
    let cpu_arg: Vec<i32> = (0..tokens)
        .map(|t| {
            let row = &gpu[t * outn..(t + 1) * outn];
            let mut best = 0;
            for (i, v) in row.iter().enumerate() {
                if *v > row[best] {
                    best = i;
                }
            }
            best as i32
        })
        .collect();
    out(format!(
        "argmax: {}",
        if gpu_arg == cpu_arg {
            "equal"
        } else {
            "DIFFERENT"
        }
    ));

    attention(&k, s, out)
}

/// kv_write_f32 then attention_f32 for a 9-token chunk at positions 20..29 of one sequence
/// (paged over 16-token pages 5 and 2), against a CPU softmax.
fn attention(
    k: &Kernels,
    s: &Arc<CudaStream>,
    out: &mut dyn FnMut(String),
) -> Result<(), DeviceError> {
    let (n_layers, n_heads, n_kv, hd, ps) = (2usize, 9usize, 3usize, 64usize, 16usize);
    let kv_dim = n_kv * hd;
    let layout = KvLayout {
        n_layers,
        n_kv_heads: n_kv,
        head_dim: hd,
        page_size: ps,
        dtype: KvDtype::F32,
    };
    let table = [5i32, 2];
    let len = 29usize;
    let kk = floats(len * kv_dim, 5);
    let vv = floats(len * kv_dim, 6);
    let pool_elems = layout.page_elems() * 8;
    let mut pool = s.alloc_zeros::<f32>(pool_elems)?;
    let pages: Vec<i32> = (0..len).map(|p| table[p / ps]).collect();
    let slots: Vec<i32> = (0..len).map(|p| (p % ps) as i32).collect();
    let (dk, dv, dp, dsl) = (up(s, &kk)?, up(s, &vv)?, up(s, &pages)?, up(s, &slots)?);
    let f = k.get("kv_write_f32")?;
    let (layer, nl, psi, kvd) = (1i32, n_layers as i32, ps as i32, kv_dim as i32);
    // SAFETY: as above.
    unsafe {
        s.launch_builder(&f)
            .arg(&dk)
            .arg(&dv)
            .arg(&mut pool)
            .arg(&dp)
            .arg(&dsl)
            .arg(&layer)
            .arg(&nl)
            .arg(&psi)
            .arg(&kvd)
            .launch(cfg((len as u32, 1), 128))?
    };
    let chunk: Vec<usize> = (20..29).collect();
    let q = floats(chunk.len() * n_heads * hd, 7);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut cpu = vec![0f32; q.len()];
    for (t, &pos) in chunk.iter().enumerate() {
        for h in 0..n_heads {
            let kvh = h / (n_heads / n_kv);
            let qh = &q[(t * n_heads + h) * hd..][..hd];
            let scores: Vec<f32> = (0..=pos)
                .map(|p| {
                    (0..hd)
                        .map(|d| qh[d] * kk[p * kv_dim + kvh * hd + d])
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let sum: f32 = e.iter().sum();
            for d in 0..hd {
                cpu[(t * n_heads + h) * hd + d] = (0..=pos)
                    .map(|p| e[p] * vv[p * kv_dim + kvh * hd + d])
                    .sum::<f32>()
                    / sum;
            }
        }
    }
    let positions: Vec<i32> = chunk.iter().map(|p| *p as i32).collect();
    let starts = vec![0i32; chunk.len()];
    let (dq, dt, dst, dpos) = (
        up(s, &q)?,
        up(s, &table)?,
        up(s, &starts)?,
        up(s, &positions)?,
    );
    let mut dout = s.alloc_zeros::<f32>(q.len())?;
    let f = k.get("attention_f32")?;
    let (nh, nk, hdi) = (n_heads as i32, n_kv as i32, hd as i32);
    // SAFETY: as above.
    unsafe {
        s.launch_builder(&f)
            .arg(&dq)
            .arg(&pool)
            .arg(&dt)
            .arg(&dst)
            .arg(&dpos)
            .arg(&mut dout)
            .arg(&nh)
            .arg(&nk)
            .arg(&hdi)
            .arg(&layer)
            .arg(&nl)
            .arg(&psi)
            .arg(&scale)
            .launch(cfg((chunk.len() as u32, n_heads as u32), 32))?
    };
    let gpu = s.clone_dtoh(&dout)?;
    out(format!(
        "kv_write + paged attention (9-token chunk at 20..29 over pages [5, 2], GQA 9/3): max |gpu - cpu| {:.2e}",
        max_diff(&gpu, &cpu)
    ));
    Ok(())
}
