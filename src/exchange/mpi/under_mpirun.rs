//! The exchange between processes in real processes: copies of this test executable under
//! `mpirun` (`testing::mpirun`), each a process of one MPI world, sum changing slots through
//! [`MpiGroup`] and compare every sum bitwise with the shared-memory exchange of all the
//! world's slots in one process; and the bytes each process hands MPI per sum are the
//! buffers' sizes that the file's docs derive (16-bit codes where the values are a codec's).
//!
//! Needs `mpirun` on PATH (`.ci/run` installs Open MPI and runs `cargo test --release
//! --features mpi --lib mpi`); without it the one skip helper says so.

use std::time::Instant;

use super::MpiGroup;
use crate::exchange::codec::{Codec, Compression};
use crate::exchange::shm::ShmGroup;
use crate::exchange::{Exchange, Host, WaitPolicy};
use crate::testing::mpirun::{self, Scratch};
use crate::testing::test_path;
use crate::world::World;

/// Bytes process 0 of `np` processes × `devices` hands MPI per sum of slots of `len`
/// values whose first `encoded` are encoded (`compression` "none", "bf16", "fp16"), one
/// logical replica per device, derived from the exchange's buffers (the file's docs):
/// - a leaf of this process is its one slot (one device) — codes, 2 bytes a value of the
///   encoded part, fp16 1 byte a block of 1,024 of them, 4 bytes a value of the tail —
///   or the partial sum of its two slots (two devices), f32, 4 bytes a value;
/// - one round, when every other process's leaves come to at most 256 KiB (they do for
///   the small slots here, not for 300,000 values): the leaf whole to each other process;
/// - two rounds: chunk q of the leaf to process q, then this process's summed chunk 0
///   (rounded to the codec: codes) to every other; chunks of len/np values rounded up to
///   a multiple of 1,024 values with a codec (so that each is encoded as the whole sum
///   is), of 16 without.
fn expected_bytes(np: usize, devices: usize, compression: &str, len: usize, encoded: usize) -> usize {
    let coded = |r: std::ops::Range<usize>| -> usize {
        let enc = r.start.min(encoded)..r.end.min(encoded);
        match compression {
            "none" => 4 * r.len(),
            c => 2 * enc.len() + if c == "fp16" { enc.len().div_ceil(1024) } else { 0 } + 4 * (r.len() - enc.len()),
        }
    };
    let leaf = |r: std::ops::Range<usize>| if devices == 1 { coded(r) } else { 4 * r.len() };
    if (np - 1) * leaf(0..len) <= 256 << 10 {
        return (np - 1) * leaf(0..len);
    }
    let align = if compression == "none" { 16 } else { 1024 };
    let chunk0 = 0..len.div_ceil(np).div_ceil(align) * align;
    leaf(0..len) - leaf(chunk0.clone()) + (np - 1) * coded(chunk0)
}

#[test]
fn sixteen_bit_gradients_cross_between_processes_as_16_bit_values() {
    if !mpirun::ready("sixteen_bit_gradients_cross_between_processes_as_16_bit_values") {
        return;
    }
    // 2 × cpu:1: every leaf one slot, codes both ways; 2 × cpu:2: the reduce-scatter's
    // leaves are f32 partial sums, the all-gather codes; 4 × cpu:1: two rounds among 4.
    for (np, devices) in [(2, 1), (2, 2), (4, 1)] {
        let dir = Scratch::new();
        let child = test_path(module_path!(), "child");
        let what = format!("exchange-{devices}");
        let (o, _) = mpirun::finish(mpirun::spawn(np, &[], &child, &what, dir.dir()), Instant::now());
        let out = mpirun::text(&o);
        assert!(o.status.success(), "{out}");
        let mut seen = 0;
        // (A process's first line follows the harness's "test <path> ... ".)
        for line in out.lines().filter_map(|l| Some(&l[l.find("exchange ")? + 9..])) {
            // "bf16 len 300000 encoded 299000 process 0: 601000 B per sum, bitwise true"
            let w: Vec<&str> = line.split_whitespace().collect();
            let (c, len, encoded): (&str, usize, usize) = (w[0], w[2].parse().unwrap(), w[4].parse().unwrap());
            assert_eq!(w[12], "true", "{np} × cpu:{devices}: not the one-process sum: {line}");
            if w[6] == "0:" {
                let got: usize = w[7].parse().unwrap();
                assert_eq!(got, expected_bytes(np, devices, c, len, encoded), "{np} × cpu:{devices}: {line}");
                seen += 1;
            }
        }
        // 3 slot lengths × 3 formats, said by process 0.
        assert_eq!(seen, 9, "{out}");
    }
    // The figure the codec halves, spelled out for the two-round slot on 2 × cpu:1:
    // 299,000 codes and 1,000 f32 against 300,000 f32; fp16 adds 292 block exponents
    // (299,000 / 1,024 rounded up).
    assert_eq!(expected_bytes(2, 1, "bf16", 300_000, 299_000), 2 * 299_000 + 4 * 1000);
    assert_eq!(expected_bytes(2, 1, "none", 300_000, 299_000), 4 * 300_000);
    assert_eq!(expected_bytes(2, 1, "fp16", 300_000, 299_000), 2 * 299_000 + 292 + 4 * 1000);
}

/// A process of the test above, started by it under mpirun (does nothing otherwise).
#[test]
#[ignore = "a process of the MPI exchange test, started by it under mpirun"]
fn child() {
    let Some((what, dir)) = mpirun::child_case() else { return };
    let world = crate::world::init().expect("the world starts");
    std::fs::write(dir.join(format!("pid-{}", world.process())), std::process::id().to_string()).unwrap();
    let devices = what.strip_prefix("exchange-").and_then(|d| d.parse().ok());
    exchange(world, devices.unwrap_or_else(|| panic!("{what}: not exchange-<devices per process>")));
}

/// Shard `shard`'s value at element `i` in sum `step`: many significant bits (the
/// codecs round them), and magnitudes from 1e-3 to 1e3 from one codec block to the
/// next (fp16's exponents differ).
fn value(shard: usize, step: usize, i: usize) -> f32 {
    let scale = 10f32.powi(((i / 1024 + shard) % 7) as i32 - 3);
    let sign = if (i + shard + step).is_multiple_of(3) { -1.0 } else { 1.0 };
    sign * scale * (1.0 + 0.123_457 * (shard + 1) as f32 + 1.3e-4 * (i % 4099) as f32 + 0.01 * step as f32)
}

/// The whole sum `x` holds, piece by piece.
fn whole_sum(x: &impl Exchange<Mem = Host>) -> Vec<f32> {
    let mut out = vec![0.0f32; x.width()];
    x.for_each_sum(|off, piece| {
        out[off..off + piece.len()].copy_from_slice(piece);
        Ok(())
    })
    .unwrap();
    out
}

/// The exchange between processes alone, `devices` threads a process, one logical
/// replica each: per case (format, slot length, encoded part), three sums of
/// changing values, each compared bitwise with the shared-memory exchange of all the
/// world's slots in this one process; prints, per process, the bytes it handed MPI
/// per sum and whether every sum was bitwise the one-process sum.
fn exchange(world: &World, devices: usize) {
    let (process, shards) = (world.process(), world.size() * devices);
    // Two rounds with a 1,000-value f32 tail; one round; the eager blocks.
    for (len, encoded) in [(300_000, 299_000), (3000, 2500), (1500, 1200)] {
        for compression in [Compression::None, Compression::Bf16, Compression::Fp16] {
            let codec = Codec::new(compression, encoded);
            let group = MpiGroup::new(world, devices, shards, len, WaitPolicy::Park, codec).unwrap();
            let one = ShmGroup::with_codec(1, shards, len, WaitPolicy::Park, codec).unwrap();
            let mut bitwise = true;
            for step in 0..3 {
                let mut whole = one.member(0);
                for shard in 0..shards {
                    whole.with_slot(shard, |s| s.iter_mut().enumerate().for_each(|(i, v)| *v = value(shard, step, i)));
                }
                whole.sum().unwrap();
                let want = whole_sum(&whole);
                let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..devices)
                        .map(|d| {
                            let group = &group;
                            s.spawn(move || {
                                let mut me = group.member(d);
                                let shard = process * devices + d;
                                me.with_slot(0, |s| {
                                    s.iter_mut().enumerate().for_each(|(i, v)| *v = value(shard, step, i))
                                });
                                me.sum().unwrap();
                                whole_sum(&me)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                bitwise &= sums.iter().all(|got| got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
            }
            println!(
                "exchange {} len {len} encoded {encoded} process {process}: {} B per sum, bitwise {bitwise}",
                compression.name(),
                group.bytes_sent() / 3
            );
        }
    }
    world.finalize();
}
