//! Half-precision weights: F16 and BF16 safetensors load wherever weights do (converted
//! to f32 exactly), `inspect` names their dtype, and `--save-dtype bf16|f16` writes them
//! rounded to nearest even, bit for bit as PyTorch rounds (a table PyTorch made, pasted
//! below with the script that made it); through the library and through the binary
//! (`train --save-dtype`, `inspect`, `eval`, `train --init`; `predict` loads through the same `weights::load`).

use std::process::{Command, Output};

use lockstep::models::{self, ConvnetOptions};
use lockstep::weights::{self, SaveDtype};

/// (f32 bits, bf16 bits, f16 bits) made by PyTorch 2.15.0 (CPU) with this script:
///
/// ```python
/// import torch
/// vals = [1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -2.0, 0.1, -3.3e-5, 7e20, 1e-40,
///         3.0e38, 65504.0, 65519.0, 65520.0, 6e-8, 2.9e-8, 1e-10, float("inf"), float("-inf"),
///         float("nan"), -0.0, 1.0 / 3.0]
/// vals += [(i * 0.7368 - 11.3) * 10.0 ** ((i % 13) - 6) for i in range(28)]
/// x = torch.tensor(vals, dtype=torch.float32)
/// f32 = x.view(torch.int32).tolist()
/// bf = x.to(torch.bfloat16).view(torch.int16).tolist()
/// hf = x.to(torch.float16).view(torch.int16).tolist()
/// for a, b, c in zip(f32, bf, hf):
///     print(f"(0x{a & 0xFFFFFFFF:08X}, 0x{b & 0xFFFF:04X}, 0x{c & 0xFFFF:04X}),")
/// ```
///
/// The first rows are the cases that matter: ties to even (1 + 2^-8 → 0x3F80, 1 + 3·2^-8 →
/// 0x3F82), just past a tie (→ 0x3F81), bf16 keeping an f32 subnormal (1e-40 → 0x0001),
/// f16 at its edge (65519 → 65504 = 0x7BFF, 65520 → ∞), f16 subnormals (6e-8 → 0x0001),
/// ±∞, NaN (row 18), −0.
const PYTORCH: [(u32, u16, u16); 48] = [
    (0x3F808000, 0x3F80, 0x3C04),
    (0x3F818000, 0x3F82, 0x3C0C),
    (0x3F808008, 0x3F81, 0x3C04),
    (0xC0000000, 0xC000, 0xC000),
    (0x3DCCCCCD, 0x3DCD, 0x2E66),
    (0xB80A697B, 0xB80A, 0x822A),
    (0x6217C9CE, 0x6218, 0x7C00),
    (0x000116C2, 0x0001, 0x0000),
    (0x7F61B1E6, 0x7F62, 0x7C00),
    (0x477FE000, 0x4780, 0x7BFF),
    (0x477FEF00, 0x4780, 0x7BFF),
    (0x477FF000, 0x4780, 0x7C00),
    (0x3380D959, 0x3381, 0x0001),
    (0x32F91BAD, 0x32F9, 0x0000),
    (0x2EDBE6FF, 0x2EDC, 0x0000),
    (0x7F800000, 0x7F80, 0x7C00),
    (0xFF800000, 0xFF80, 0xFC00),
    (0x7FC00000, 0xFFFF, 0x7E00),
    (0x80000000, 0x8000, 0x8000),
    (0x3EAAAAAB, 0x3EAB, 0x3555),
    (0xB73D9521, 0xB73E, 0x80BE),
    (0xB8DD86C0, 0xB8DE, 0x86EC),
    (0xBA80CBED, 0xBA81, 0x9406),
    (0xBC14EC8C, 0xBC15, 0xA0A7),
    (0xBDAB10BA, 0xBDAB, 0xAD59),
    (0xBF42F838, 0xBF43, 0xBA18),
    (0xC0DC2268, 0xC0DC, 0xC6E1),
    (0xC275B22D, 0xC276, 0xD3AE),
    (0xC40723D7, 0xC407, 0xE039),
    (0xC591E666, 0xC592, 0xEC8F),
    (0xC7199800, 0xC71A, 0xF8CD),
    (0xC89C0400, 0xC89C, 0xFC00),
    (0xCA160C80, 0xCA16, 0xFC00),
    (0xB5E711BA, 0xB5E7, 0x801D),
    (0xB72538D7, 0xB725, 0x80A5),
    (0xB7D00998, 0xB7D0, 0x81A0),
    (0x3A0022D0, 0x3A00, 0x1001),
    (0x3C48CD64, 0x3C49, 0x2246),
    (0x3E48F323, 0x3E49, 0x3248),
    (0x402CBFB1, 0x402D, 0x4166),
    (0x420970A4, 0x4209, 0x504C),
    (0x43D0A3D7, 0x43D1, 0x5E85),
    (0x45996CCD, 0x4599, 0x6CCB),
    (0x475C9000, 0x475D, 0x7AE4),
    (0x491BD700, 0x491C, 0x7C00),
    (0x4AD94900, 0x4AD9, 0x7C00),
    (0x3703D0B3, 0x3704, 0x0084),
    (0x38B4388A, 0x38B4, 0x05A2),
];

#[test]
fn rounding_is_pytorchs_bit_for_bit() {
    for (i, &(x, bf, hf)) in PYTORCH.iter().enumerate() {
        let v = f32::from_bits(x);
        let ours_bf = u16::from_le_bytes(SaveDtype::Bf16.encode(&[v])[..].try_into().unwrap());
        let ours_hf = u16::from_le_bytes(SaveDtype::F16.encode(&[v])[..].try_into().unwrap());
        if v.is_nan() {
            // PyTorch's vectorised CPU conversion writes 0xFFFF for NaN, its scalar one
            // (c10::BFloat16's round_to_nearest_even) 0x7FC0, which we write: both NaN.
            assert!(f32::from_bits((ours_bf as u32) << 16).is_nan() && f32::from_bits((bf as u32) << 16).is_nan());
            assert_eq!(ours_hf, hf, "row {i}: f16 of NaN");
            continue;
        }
        assert_eq!(ours_bf, bf, "row {i}: bf16 of {v:e} (0x{x:08X})");
        assert_eq!(ours_hf, hf, "row {i}: f16 of {v:e} (0x{x:08X})");
    }
}

/// Saved as BF16 or F16, the convnet's file names that dtype in `inspect`, loads, and holds
/// exactly the rounded values (every bf16 and f16 value is an f32: the conversion back is
/// exact); f32 saves and loads bitwise, as before.
#[test]
fn half_precision_files_load_as_their_rounded_values() {
    let model = models::convnet(ConvnetOptions::default()).unwrap();
    let store = model.init(3);
    let dir = tempfile::tempdir().unwrap();
    // Half an ulp: 8 significant bits (bf16) make it 2^-8 of the value at most, 11 (f16) 2^-11.
    for (dtype, name, half_ulp) in [(SaveDtype::Bf16, "BF16", 1.0 / 256.0), (SaveDtype::F16, "F16", 1.0 / 2048.0)] {
        let path = dir.path().join(format!("{name}.safetensors"));
        weights::save_as(&model, &store, &path, dtype).unwrap();
        let rows = weights::inspect(&path).unwrap();
        assert!(rows.iter().all(|(_, d, _)| d == name), "{rows:?}");
        let loaded = weights::load(&model, &path).unwrap();
        for t in model.param_infos() {
            for (i, (&a, &b)) in store.params[t.range.clone()].iter().zip(&loaded.params[t.range.clone()]).enumerate() {
                let code = SaveDtype::encode(dtype, &[a]);
                let h = u16::from_le_bytes([code[0], code[1]]);
                // The code read back by the `half` crate (exact: every bf16 and f16 is an f32).
                let want = match dtype {
                    SaveDtype::Bf16 => half::bf16::from_bits(h).to_f32(),
                    _ => half::f16::from_bits(h).to_f32(),
                };
                assert_eq!(b.to_bits(), want.to_bits(), "{} [{i}]", t.name);
                // Rounded to nearest: within half an ulp (and 2^-25 for f16's subnormals).
                assert!((a - b).abs() <= half_ulp * a.abs() + 3e-8, "{} [{i}]: {a} → {b}", t.name);
            }
        }
        assert_eq!(loaded.buffers, store.buffers, "running mean 0 and variance 1 are exact in 16 bits");
    }
    let path = dir.path().join("f32.safetensors");
    weights::save_as(&model, &store, &path, SaveDtype::F32).unwrap();
    assert_eq!(weights::load(&model, &path).unwrap(), store);
}

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep")).args(args).output().expect("the binary runs")
}

/// Through the binary: the toy trained and saved as bf16 is named BF16 by `inspect`, and
/// `eval` and `train --init` read it (as f32); `--save-dtype` needs `--save`.
#[test]
fn the_binary_saves_and_reads_bf16_weights() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path().join("toy-bf16.safetensors");
    let w = w.to_str().unwrap();
    let ok = |o: &Output| {
        assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let out = ok(&lockstep(&["train", "--model", "toy", "--save", w, "--save-dtype", "bf16"]));
    assert!(out.contains("(bf16)"), "{out}");
    let out = ok(&lockstep(&["inspect", w]));
    assert!(out.contains("dense0.weight") && out.contains("BF16"), "{out}");
    assert!(!out.contains("F32"), "every tensor is BF16: {out}");
    // The lesson's toy reaches accuracy 1.0 on its two test points; 8-bit mantissas keep it.
    let out = ok(&lockstep(&["eval", "--model", "toy", "--weights", w]));
    assert!(out.contains("accuracy 1.0000"), "{out}");
    let out = ok(&lockstep(&["train", "--model", "toy", "--init", w, "--epochs", "1"]));
    assert!(out.contains("initial weights"), "{out}");
    let o = lockstep(&["train", "--model", "toy", "--save-dtype", "bf16"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--save"));
}
