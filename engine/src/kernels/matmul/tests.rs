//! The matrix product against an f64 reference, the portable bits and every split.

use super::*;
use crate::gguf::writer::quantize;

use crate::kernels::test_values as random;

/// The portable kernel into a slice.
fn portable(
    w: QRef<'_>,
    x: &[f32],
    tokens: usize,
    first: usize,
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let out = strided(out, tokens, n, stride);
    // SAFETY: `strided` checked every written index inside `out`.
    unsafe { rows_kernel(w, x, tokens, first, n, out, stride) }
}

fn reference(w: &QRef<'_>, x: &[f32], tokens: usize) -> Vec<f32> {
    let mut row = vec![0f32; w.cols];
    let mut out = vec![0f32; tokens * w.rows];
    for n in 0..w.rows {
        w.dequantize_row(n, &mut row);
        for t in 0..tokens {
            let xs = &x[t * w.cols..(t + 1) * w.cols];
            out[t * w.rows + n] = row
                .iter()
                .zip(xs)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>() as f32;
        }
    }
    out
}

#[test]
fn matches_a_f64_reference_for_every_type() {
    let (rows, cols) = (13, 96);
    let values = random(rows * cols, 1);
    let types = [
        TensorType::Q4_1,
        TensorType::Q4_0,
        TensorType::Q8_0,
        TensorType::F16,
        TensorType::F32,
    ];
    for gty in types {
        let raw = quantize(gty, &values);
        for (ty, bytes) in [(Format::Gguf(gty), raw.clone()), repack(gty, &raw, cols)] {
            let w = QRef {
                ty,
                rows,
                cols,
                bytes: &bytes,
            };
            let x = random(5 * cols, 2);
            let mut out = vec![0f32; 5 * rows];
            matmul(w, &x, 5, &mut out, &StepPool::new(2).expect("team"));
            for (a, b) in out.iter().zip(reference(&w, &x, 5)) {
                assert!((a - b).abs() < 1e-4, "{ty:?}: {a} vs {b}");
            }
        }
    }
}

/// Whichever kernel this machine dispatches to (AVX-512, AVX2 or portable) computes the
/// portable kernel's bits, for both repacked formats, every tile edge and token count.
#[test]
fn the_dispatched_kernel_computes_the_portable_bits() {
    // An odd row count, more rows than a many-token panel holds; short rows, the
    // model's longest (1,536: two of AVX-512's column spans) and one that ends in a
    // short span (800).
    for (ty, cols) in [
        (TensorType::Q4_1, 96),
        (TensorType::Q8_0, 96),
        (TensorType::Q4_1, 1536),
        (TensorType::Q8_0, 800),
        // Grouped Q4_1 (on AVX-512): a group and a lone block; the model's 576 columns,
        // four groups and two lone blocks.
        (TensorType::Q4_1, 160),
        (TensorType::Q4_1, 576),
    ] {
        let rows = 37;
        let raw = quantize(ty, &random(rows * cols, 7));
        let (format, bytes) = repack(ty, &raw, cols);
        let w = QRef {
            ty: format,
            rows,
            cols,
            bytes: &bytes,
        };
        // Few tokens take the streaming tiles (on AVX2, 3 to 5 tokens in one pass of 1-row
        // tiles; on AVX-512, 5 to 8 in one pass of 2-row tiles); from `MANY_FROM` (6 on
        // AVX2, 9 on AVX-512) the many-token kernels
        // (every edge of their panels and token groups; from 64 tokens AVX-512's taller
        // tile; 100 tokens of 1,536 columns outgrow its block of activations: a block of
        // 85, then a short one; AVX2's blocks of 42, then 16).
        for tokens in (1..12).chain([16, 32, 35, 70, 100]) {
            let x = random(tokens * cols, 8 + tokens as u64);
            for (first, n) in [(0, rows), (1, 5), (4, 9), (12, 1), (3, 33)] {
                // A stride wider than the rows, as a piece of a split product has.
                let stride = n + 3;
                let mut got = vec![0f32; tokens * stride];
                rows_strided(w, &x, tokens, first, n, &mut got, stride);
                let mut want = vec![0f32; tokens * stride];
                portable(w, &x, tokens, first, n, &mut want, stride);
                assert_eq!(got, want, "{ty:?} {tokens} tokens, rows {first}+{n}");
            }
        }
    }
}

/// The grouped layout moves bytes, not values: every row dequantizes to the wide blocks' bits,
/// with and without lone blocks at the end; and AVX-512 is the level that gets it.
#[test]
fn grouped_q4_1_holds_the_wide_blocks_values() {
    for cols in [32, 96, 128, 160, 576] {
        let rows = 5;
        let raw = quantize(TensorType::Q4_1, &random(rows * cols, 11));
        let (wide_ty, wide) = repack_for(crate::kernels::Isa::Avx2, TensorType::Q4_1, &raw, cols);
        let (grouped_ty, grouped) =
            repack_for(crate::kernels::Isa::Avx512, TensorType::Q4_1, &raw, cols);
        assert_eq!(
            (wide_ty, grouped_ty),
            (Format::Q4_1Wide, Format::Q4_1Grouped)
        );
        assert_eq!(wide.len(), grouped.len());
        if cols >= 32 * GROUP {
            assert_ne!(
                wide, grouped,
                "{cols} columns: a group is stored differently"
            );
        }
        let at = |ty, bytes: &[u8]| {
            let w = QRef {
                ty,
                rows,
                cols,
                bytes,
            };
            let mut all = Vec::new();
            for r in 0..rows {
                let mut row = vec![0f32; cols];
                w.dequantize_row(r, &mut row);
                all.extend(row.iter().map(|v| v.to_bits()));
            }
            all
        };
        assert_eq!(
            at(wide_ty, &wide),
            at(grouped_ty, &grouped),
            "{cols} columns"
        );
    }
    let want = if crate::kernels::isa() == crate::kernels::Isa::Avx512 {
        Format::Q4_1Grouped
    } else {
        Format::Q4_1Wide
    };
    let raw = quantize(TensorType::Q4_1, &random(128, 12));
    assert_eq!(repack(TensorType::Q4_1, &raw, 128).0, want);
}

#[test]
fn batch_size_threads_and_position_do_not_change_a_single_bit() {
    let (rows, cols) = (37, 128);
    let raw = quantize(TensorType::Q4_1, &random(rows * cols, 3));
    let (ty, bytes) = repack(TensorType::Q4_1, &raw, cols);
    let w = QRef {
        ty,
        rows,
        cols,
        bytes: &bytes,
    };
    // Repacking changes the storage, not the values: same bits as the file's blocks.
    let orig = QRef {
        ty: Format::Gguf(TensorType::Q4_1),
        rows,
        cols,
        bytes: &raw,
    };
    let x = random(11 * cols, 4);
    let mut all = vec![0f32; 11 * rows];
    let one_thread = StepPool::new(1).expect("team");
    matmul(w, &x, 11, &mut all, &one_thread);
    let mut from_file = vec![0f32; 11 * rows];
    matmul(orig, &x, 11, &mut from_file, &one_thread);
    assert_eq!(from_file, all);
    // The portable kernel computes the same bits as the one this machine dispatches to.
    let mut portable_out = vec![0f32; 11 * rows];
    portable(w, &x, 11, 0, rows, &mut portable_out, rows);
    assert_eq!(portable_out, all);
    for threads in [1, 2, 3] {
        let team = StepPool::new(threads).expect("team");
        for t in 0..11 {
            let mut one = vec![0f32; rows];
            matmul(w, &x[t * cols..(t + 1) * cols], 1, &mut one, &team);
            assert_eq!(
                one,
                all[t * rows..(t + 1) * rows],
                "token {t}, {threads} threads"
            );
        }
        let mut again = vec![0f32; 6 * rows];
        matmul(w, &x[5 * cols..], 6, &mut again, &team);
        assert_eq!(again, all[5 * rows..]);
        // Enough tokens to split by token (and to take the many-token kernel).
        let many = random(40 * cols, 5);
        let mut singles = vec![0f32; 40 * rows];
        for t in 0..40 {
            matmul(
                w,
                &many[t * cols..(t + 1) * cols],
                1,
                &mut singles[t * rows..(t + 1) * rows],
                &one_thread,
            );
        }
        let (mut a, mut b) = (vec![0f32; 40 * rows], vec![0f32; 40 * rows]);
        matmul(w, &many, 40, &mut a, &one_thread);
        matmul(w, &many, 40, &mut b, &team);
        assert_eq!(a, b);
        assert_eq!(a, singles);
        // Grouped with another matrix: same bits, by token split and by row split.
        for n in [2, 40] {
            let mut g1 = vec![0f32; n * rows];
            let mut g2 = vec![0f32; n * rows];
            matmul_group(
                &[w, w],
                &many[..n * cols],
                n,
                &mut [&mut g1, &mut g2],
                &team,
            );
            assert_eq!(g1, a[..n * rows]);
            assert_eq!(g2, a[..n * rows]);
        }
    }
}

/// A product split by row into pieces (decode batches on several threads) gives every bit
/// one thread gives, for both repacked formats and a group of matrices of different heights:
/// on AVX2 the pieces share one split of the tokens (`split_once`) from three tokens on.
#[test]
fn row_split_pieces_give_one_threads_bits() {
    let cols = 160;
    for gty in [TensorType::Q4_1, TensorType::Q8_0] {
        let mats: Vec<(usize, Vec<u8>, Format)> = [45, 13]
            .into_iter()
            .map(|rows| {
                let raw = quantize(gty, &random(rows * cols, rows as u64));
                let (ty, bytes) = repack(gty, &raw, cols);
                (rows, bytes, ty)
            })
            .collect();
        let ws: Vec<QRef<'_>> = mats
            .iter()
            .map(|(rows, bytes, ty)| QRef {
                ty: *ty,
                rows: *rows,
                cols,
                bytes,
            })
            .collect();
        let one = StepPool::new(1).expect("team");
        for threads in [2, 3] {
            let team = StepPool::new(threads).expect("team");
            for tokens in [2, 3, 5, 16, 33, 70] {
                let x = random(tokens * cols, 7 + tokens as u64);
                let outs = |team: &StepPool| {
                    let mut a = vec![0f32; tokens * ws[0].rows];
                    let mut b = vec![0f32; tokens * ws[1].rows];
                    matmul_group(&ws, &x, tokens, &mut [&mut a, &mut b], team);
                    (a, b)
                };
                assert_eq!(
                    outs(&team),
                    outs(&one),
                    "{gty:?}, {threads} threads, {tokens} tokens"
                );
            }
        }
    }
}
