//! The GPU exchanges' tests: how slots and chunks are laid out and which transport a run
//! gets (everywhere), then both transports on real GPUs against sums computed on the host,
//! and the 16-bit codec through the whole GPU exchange against the shared-memory
//! exchange's sum (where a GPU is; the one skip helper says so elsewhere, and
//! `LOCKSTEP_REQUIRE_GPU=1` turns that skip into a failure). With the `mpi` feature, the
//! NCCL clique id that process 0 of an MPI world makes and every process receives.
//!
//! The kernels of the codec are checked beside their launches (`codec.rs`); a whole run on
//! GPUs against one on CPU devices is tests/cuda_train.rs's.
//!
//! Device copies (`cuda:0,0`: several members on GPU 0) sum member 0 + member 1 + ... left
//! to right in f32, so the host reference does the same and the comparison is bitwise,
//! on buffers whose lengths do and do not divide by the number of members, are shorter
//! than it, or empty; every member must hold bitwise the same values. NCCL needs two GPUs;
//! with two members any summation order gives a + b, so it too is compared bitwise.

use std::sync::mpsc;
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream};

use super::codec::tests::codec_slot;
use super::copies::{chunk_ranges, CHUNK_GRANULE};
use super::*;
use crate::cuda::probe::{nccl_status, NcclStatus};
use crate::exchange::codec::Compression;
use crate::exchange::shm::tests::shm_exchange;
use crate::testing::assert_bits;
use crate::testing::skip::{skip, Need};

// ---- layout and the choice of transport (no GPU needed) ----------------------------------

#[test]
fn chunks_cover_the_buffer_in_order() {
    for members in 1..=5 {
        for len in [0, 1, 2, 3, 63, 64, 65, 127, 128, 1000, 4097, 100_003] {
            let c = chunk_ranges(len, members);
            assert_eq!(c.len(), members);
            let mut next = 0;
            for r in &c {
                assert_eq!(r.start, next.min(len), "members {members} len {len}: {c:?}");
                assert!(r.start <= r.end);
                next = r.end;
            }
            assert_eq!(next, len, "members {members} len {len}: {c:?}");
            // Every chunk but the last non-empty one is a whole number of granules.
            let last = c.iter().rposition(|r| !r.is_empty());
            for (i, r) in c.iter().enumerate() {
                if Some(i) != last && !r.is_empty() {
                    assert_eq!(r.len() % CHUNK_GRANULE, 0, "members {members} len {len}: {c:?}");
                }
            }
        }
    }
    // Small buffers: member 0 reduces everything, the others have nothing to do.
    assert_eq!(chunk_ranges(3, 4), vec![0..3, 3..3, 3..3, 3..3]);
    assert_eq!(chunk_ranges(1000, 2), vec![0..512, 512..1000]);
}

#[test]
fn nccl_only_for_distinct_gpus_that_it_can_serve() {
    let yes = || true;
    assert_eq!(choose_transport(&[0, 1], yes), Transport::Nccl);
    assert_eq!(choose_transport(&[3, 1, 2], yes), Transport::Nccl);
    assert_eq!(choose_transport(&[0, 0], yes), Transport::Copies, "one GPU twice");
    assert_eq!(choose_transport(&[0, 1, 0], yes), Transport::Copies, "one GPU twice");
    assert_eq!(choose_transport(&[0], yes), Transport::Copies, "nothing to exchange");
    assert_eq!(choose_transport(&[0, 1], || false), Transport::Copies, "no usable NCCL");
    // The library is not even probed when the answer is already known.
    let probed = std::cell::Cell::new(false);
    choose_transport(&[0, 0], || {
        probed.set(true);
        true
    });
    assert!(!probed.get());
}

#[test]
fn every_slot_and_tensor_view_starts_on_256_bytes() {
    use crate::models::{convnet, toy_mlp, ConvnetOptions, Norm};
    // Device allocations start 256-byte aligned (cuMemAlloc), so offsets of a multiple
    // of 64 f32 are what every view a GPU replica hands to cuBLAS or a kernel needs:
    // slot j at j·stride, a parameter's gradient at its flat offset in the slot, a
    // buffer at np + its offset (the flat layout pads every tensor start: model/graph.rs).
    let aligned = |floats: usize| (floats * std::mem::size_of::<f32>()).is_multiple_of(256);
    let models = [
        ("convnet", convnet(ConvnetOptions::default()).unwrap()),
        ("convnet without BN", convnet(ConvnetOptions { norm: Norm::None, ..ConvnetOptions::default() }).unwrap()),
        ("toy", toy_mlp(2, 2).unwrap()),
    ];
    for (name, model) in &models {
        let (np, nb) = (model.params_len(), model.buffers_len());
        let stride = slot_stride(np + nb);
        assert!(aligned(np) && stride >= np + nb && stride - (np + nb) < SLOT_ALIGN, "{name}: np {np}");
        let mut views = 0;
        for slots in 1..=3 {
            for local in 0..slots {
                let slot = local * stride;
                assert!(aligned(slot), "{name}: slot {local} of {slots} at {slot}");
                for t in model.param_infos() {
                    assert!(aligned(t.range.start) && aligned(slot + t.range.start), "{name}: {}", t.name);
                    views += 1;
                }
                for t in model.buffer_infos() {
                    assert!(aligned(slot + np + t.range.start), "{name}: {}", t.name);
                    views += 1;
                }
            }
        }
        // Every tensor was seen in each of the 1 + 2 + 3 slots.
        let tensors = model.param_infos().len() + model.buffer_infos().len();
        assert_eq!(views, 6 * tensors, "{name}");
    }
    // Widths that are no multiple of the alignment still get aligned slots.
    for width in [1, 63, 65, 772] {
        assert_eq!(slot_stride(width) % SLOT_ALIGN, 0, "width {width}");
    }
}

#[test]
fn a_group_without_gpus_is_an_error() {
    let e = CopyGroup::new(&[], 10).err().expect("no ordinals");
    assert!(matches!(e, Error::Config { .. }), "{e}");
    if driver_available().is_err() {
        let e = CopyGroup::new(&[0, 0], 10).err().expect("no driver");
        assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
        let e = NcclGroup::new(&[0, 1], 10).err().expect("no driver");
        assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
    }
}

// ---- harness of the tests on GPUs -------------------------------------------------------

/// The number of GPUs, or None after the one skip helper said that `test` did not run.
fn gpus_or_skip(test: &str) -> Option<usize> {
    if let Err(e) = driver_available() {
        skip(test, Need::Gpu, &format!("no CUDA driver ({e})"));
        return None;
    }
    match gpu_count() {
        Ok(0) => {
            skip(test, Need::Gpu, "the CUDA driver sees no GPU");
            None
        }
        Ok(n) => Some(n),
        Err(e) => panic!("the CUDA driver is present but cannot count GPUs: {e}"),
    }
}

/// The number of GPUs when there are two or more and NCCL loads; else None after a skip.
fn two_gpus_and_nccl_or_skip(test: &str) -> Option<usize> {
    let n = gpus_or_skip(test)?;
    if n < 2 {
        skip(test, Need::Gpu, "needs 2 GPUs");
        return None;
    }
    match nccl_status() {
        NcclStatus::Available => Some(n),
        other => {
            skip(test, Need::Gpu, &format!("NCCL not usable: {}", other.fix()));
            None
        }
    }
}

/// `n` values uniform in [−1, 1), each scaled by 10^k for k drawn in −3..=3, so that their
/// sums round (the stream of `seed`).
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut g = crate::rng::SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let u = g.next_f32() * 2.0 - 1.0;
            u * 10f32.powi((g.next_u64() % 7) as i32 - 3)
        })
        .collect()
}

/// A member's compute stream on GPU `ordinal`: its own context handle and a fresh stream,
/// as a replica makes them.
fn compute_stream(ordinal: usize) -> Arc<CudaStream> {
    let ctx = CudaContext::new(ordinal).expect("CUDA context");
    ctx.new_stream().expect("compute stream")
}

fn upload(stream: &Arc<CudaStream>, v: &[f32]) -> CudaSlice<f32> {
    if v.is_empty() {
        stream.null().expect("empty device buffer")
    } else {
        stream.clone_htod(v).expect("host to device copy")
    }
}

fn download(stream: &Arc<CudaStream>, d: &CudaSlice<f32>) -> Vec<f32> {
    if d.is_empty() {
        Vec::new()
    } else {
        stream.clone_dtoh(d).expect("device to host copy")
    }
}

/// The copy path's order: 0 + member 0 + member 1 + ..., left to right, in f32.
fn host_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let len = inputs.first().map_or(0, Vec::len);
    (0..len).map(|i| inputs.iter().fold(0.0f32, |acc, v| acc + v[i])).collect()
}

/// Runs one all-reduce on every member of `group` (one thread each, GPU `ordinals[r]`) and
/// returns what every member holds afterwards.
fn all_reduce_everywhere(group: &CopyGroup, ordinals: &[usize], inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ordinals.len())
            .map(|r| {
                let (input, ordinal) = (&inputs[r], ordinals[r]);
                s.spawn(move || {
                    let stream = compute_stream(ordinal);
                    let mut me = group.join(r, &stream).expect("join");
                    let mut buf = upload(&stream, input);
                    me.all_reduce_sum(&mut buf).expect("all-reduce");
                    download(&stream, &buf)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("member thread")).collect()
    })
}

/// Waits at most `secs` for a value on `rx`: a hang becomes a failure, not a stuck test.
fn within<T>(rx: &mpsc::Receiver<T>, secs: u64, what: &str) -> T {
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("{what}: no answer within {secs} s"))
}

// ---- device copies (one GPU is enough) ----------------------------------------------------

#[test]
fn copies_all_reduce_is_the_member_order_sum_on_every_member() {
    let Some(_) = gpus_or_skip("copies_all_reduce_is_the_member_order_sum_on_every_member") else {
        return;
    };
    // (members, len): lengths that divide and do not divide by the number of members or
    // the chunk granule, shorter than the number of members, and empty.
    for (case, (members, len)) in
        [(2, 100_003), (2, 4096), (2, 1000), (2, 65), (2, 1), (2, 0), (3, 2), (3, 1001), (4, 777)]
            .into_iter()
            .enumerate()
    {
        let ordinals = vec![0; members];
        let group = CopyGroup::new(&ordinals, len).expect("group");
        let inputs: Vec<Vec<f32>> = (0..members).map(|r| values(7 + 16 * case as u64 + r as u64, len)).collect();
        let want = host_sum(&inputs);
        let got = all_reduce_everywhere(&group, &ordinals, &inputs);
        for (r, g) in got.iter().enumerate() {
            assert_bits(&format!("members {members} len {len} member {r}"), g, &want);
        }
    }
}

#[test]
fn one_gpu_given_twice_falls_back_to_copies() {
    let Some(_) = gpus_or_skip("one_gpu_given_twice_falls_back_to_copies") else {
        return;
    };
    assert_eq!(transport_for(&[0, 0]), Transport::Copies, "NCCL forbids two members on one GPU");
}

#[test]
fn copies_all_reduce_repeats_and_keeps_stream_order() {
    let Some(_) = gpus_or_skip("copies_all_reduce_repeats_and_keeps_stream_order") else {
        return;
    };
    // Three all-reduces in a row on the same buffers, each followed by queued work on
    // the compute stream (a device copy) that must see the reduced values: the result
    // after three rounds of x -> 2x (two members holding equal values) is 8x, exactly.
    let (members, len) = (2, 3000);
    let group = CopyGroup::new(&[0, 0], len).expect("group");
    let x = values(11, len);
    let out: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..members)
            .map(|r| {
                let (group, x) = (&group, &x);
                s.spawn(move || {
                    let stream = compute_stream(0);
                    let mut me = group.join(r, &stream).expect("join");
                    let mut buf = upload(&stream, x);
                    let mut after_first = stream.alloc_zeros::<f32>(len).expect("alloc");
                    for round in 0..3 {
                        me.all_reduce_sum(&mut buf).expect("all-reduce");
                        if round == 0 {
                            stream.memcpy_dtod(&buf, &mut after_first).expect("copy on the compute stream");
                        }
                    }
                    (download(&stream, &buf), download(&stream, &after_first))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("member thread")).collect()
    });
    let twice: Vec<f32> = x.iter().map(|v| v + v).collect();
    let eight: Vec<f32> = x.iter().map(|v| v * 8.0).collect();
    for (r, (last, first)) in out.iter().enumerate() {
        assert_bits(&format!("member {r} after one round"), first, &twice);
        assert_bits(&format!("member {r} after three rounds"), last, &eight);
    }
}

#[test]
fn copies_broadcast_gives_every_member_the_roots_values() {
    let Some(_) = gpus_or_skip("copies_broadcast_gives_every_member_the_roots_values") else {
        return;
    };
    let (members, len, root) = (3, 1001, 1);
    let group = CopyGroup::new(&vec![0; members], len).expect("group");
    let inputs: Vec<Vec<f32>> = (0..members).map(|r| values(3 + r as u64, len)).collect();
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..members)
            .map(|r| {
                let (group, input) = (&group, &inputs[r]);
                s.spawn(move || {
                    let stream = compute_stream(0);
                    let mut me = group.join(r, &stream).expect("join");
                    assert_eq!(me.index(), r);
                    let mut buf = upload(&stream, input);
                    me.broadcast(&mut buf, root).expect("broadcast");
                    download(&stream, &buf)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("member thread")).collect()
    });
    for (r, g) in got.iter().enumerate() {
        assert_bits(&format!("member {r}"), g, &inputs[root]);
    }
}

#[test]
fn copies_refuse_a_buffer_of_the_wrong_length() {
    let Some(_) = gpus_or_skip("copies_refuse_a_buffer_of_the_wrong_length") else {
        return;
    };
    let group = CopyGroup::new(&[0, 0], 8).expect("group");
    let stream = compute_stream(0);
    let mut me = group.join(0, &stream).expect("join");
    let mut buf = upload(&stream, &[1.0; 7]);
    let e = me.all_reduce_sum(&mut buf).expect_err("7 values for a group of 8");
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}

#[test]
fn copies_abort_releases_a_member_waiting_for_its_peer() {
    let Some(_) = gpus_or_skip("copies_abort_releases_a_member_waiting_for_its_peer") else {
        return;
    };
    let len = 1000;
    let group = Arc::new(CopyGroup::new(&[0, 0], len).expect("group"));
    let (tx, rx) = mpsc::channel();
    // Member 0 calls the all-reduce; member 1 joins but never calls it (a failed worker).
    let g = group.clone();
    let waiting = std::thread::spawn(move || {
        let stream = compute_stream(0);
        let mut me = g.join(0, &stream).expect("join");
        let mut buf = upload(&stream, &vec![1.0; len]);
        let _ = tx.send(me.all_reduce_sum(&mut buf));
    });
    let g = group.clone();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let idle = std::thread::spawn(move || {
        let stream = compute_stream(0);
        let mut me = g.join(1, &stream).expect("join");
        let _ = go_rx.recv(); // the abort has happened
        me.all_reduce_sum(&mut upload(&stream, &vec![1.0; len]))
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(rx.try_recv().is_err(), "member 0 must wait for member 1");
    let g = group.clone();
    std::thread::spawn(move || g.abort()).join().expect("aborting thread");
    let r = within(&rx, 10, "member 0 after the abort");
    assert!(matches!(r, Err(Error::Aborted)), "{r:?}");
    waiting.join().expect("member 0");
    let _ = go_tx.send(());
    let later = idle.join().expect("member 1");
    assert!(matches!(later, Err(Error::Aborted)), "a call after the abort fails at once: {later:?}");
    group.abort(); // any number of times
}

// ---- NCCL (two GPUs) ----------------------------------------------------------------------

#[test]
fn nccl_all_reduce_and_broadcast_on_two_gpus() {
    let Some(_) = two_gpus_and_nccl_or_skip("nccl_all_reduce_and_broadcast_on_two_gpus") else {
        return;
    };
    let ordinals = [0, 1];
    for len in [100_003, 1] {
        assert_eq!(transport_for(&ordinals), Transport::Nccl);
        let group = NcclGroup::new(&ordinals, len).expect("group");
        let inputs: Vec<Vec<f32>> = (0..2).map(|r| values(5 + r as u64, len)).collect();
        // Two members: every order gives a + b (f32 addition commutes), so bitwise.
        let want = host_sum(&inputs);
        let got: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let (group, input) = (&group, &inputs[r]);
                    s.spawn(move || {
                        let stream = compute_stream(ordinals[r]);
                        let mut me = group.join(r, &stream).expect("join");
                        assert_eq!(me.index(), r);
                        let mut buf = upload(&stream, input);
                        me.all_reduce_sum(&mut buf).expect("all-reduce");
                        let sum = download(&stream, &buf);
                        let mut b = upload(&stream, input);
                        me.broadcast(&mut b, 1).expect("broadcast");
                        (sum, download(&stream, &b))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("member thread")).collect()
        });
        for (r, (sum, b)) in got.iter().enumerate() {
            assert_bits(&format!("len {len} member {r} sum"), sum, &want);
            assert_bits(&format!("len {len} member {r} broadcast"), b, &inputs[1]);
        }
    }
}

#[test]
fn nccl_abort_releases_a_member_waiting_to_join() {
    let Some(_) = two_gpus_and_nccl_or_skip("nccl_abort_releases_a_member_waiting_to_join") else {
        return;
    };
    // Only member 0 joins; NCCL's init waits for member 1 until the abort.
    let group = Arc::new(NcclGroup::new(&[0, 1], 16).expect("group"));
    let (tx, rx) = mpsc::channel();
    let g = group.clone();
    std::thread::spawn(move || {
        let stream = compute_stream(0);
        let _ = tx.send(g.join(0, &stream).map(|_| ()));
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(rx.try_recv().is_err(), "member 0 must wait for member 1 to join");
    group.abort();
    let r = within(&rx, 20, "member 0's join after the abort");
    assert!(matches!(r, Err(Error::Aborted)), "{r:?}");
}

#[test]
fn nccl_abort_releases_a_member_whose_peer_never_calls() {
    let Some(_) = two_gpus_and_nccl_or_skip("nccl_abort_releases_a_member_whose_peer_never_calls") else {
        return;
    };
    let len = 4096;
    let group = Arc::new(NcclGroup::new(&[0, 1], len).expect("group"));
    let (joined_tx, joined_rx) = mpsc::channel();
    let (tx, rx) = mpsc::channel();
    let g = group.clone();
    let jt = joined_tx.clone();
    // Member 0 enqueues an all-reduce (the host does not wait) then synchronises its
    // compute stream, which waits for member 1 until the abort stops NCCL's kernel.
    std::thread::spawn(move || {
        let stream = compute_stream(0);
        let mut me = g.join(0, &stream).expect("join");
        let _ = jt.send(());
        let mut buf = upload(&stream, &vec![1.0; len]);
        let first = me.all_reduce_sum(&mut buf);
        let synced = stream.synchronize();
        let second = me.all_reduce_sum(&mut buf);
        let _ = tx.send((first.is_ok() || matches!(first, Err(Error::Aborted)), synced.is_ok(), second));
    });
    let g = group.clone();
    let (idle_tx, idle_rx) = mpsc::channel::<()>();
    let idle = std::thread::spawn(move || {
        let stream = compute_stream(1);
        let me = g.join(1, &stream).expect("join");
        let _ = joined_tx.send(());
        let _ = idle_rx.recv();
        drop(me);
    });
    within(&joined_rx, 60, "both members joined");
    within(&joined_rx, 60, "both members joined");
    std::thread::sleep(Duration::from_millis(500));
    assert!(rx.try_recv().is_err(), "member 0's stream must wait for member 1");
    group.abort();
    let (first_ok, _synced, second) = within(&rx, 20, "member 0 after the abort");
    assert!(first_ok, "the enqueue itself succeeds or reports the abort");
    assert!(matches!(second, Err(Error::Aborted)), "{second:?}");
    let _ = idle_tx.send(());
    idle.join().expect("member 1");
}

// ---- 16-bit gradients through the whole GPU exchange ---------------------------------------

/// Every member's sum of `slots` (R logical replicas, `k` a member) through the GPU
/// exchange with `codec` over the transport `join` joins, member r on GPU `ordinals[r]`.
fn gpu_codec_exchange<C, J>(ordinals: &[usize], join: J, codec: Codec, slots: &[Vec<f32>]) -> Vec<Vec<f32>>
where
    C: DeviceAllReduce,
    J: Fn(usize, &Arc<CudaStream>) -> Result<C> + Sync,
{
    let (members, len) = (ordinals.len(), slots[0].len());
    let k = slots.len() / members;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..members)
            .map(|r| {
                let join = &join;
                s.spawn(move || {
                    let stream = compute_stream(ordinals[r]);
                    let member = join(r, &stream).expect("join");
                    let mut ex = GpuExchange::new(member, len, k).unwrap().with_codec(Some(codec)).unwrap();
                    for j in 0..k {
                        ex.with_slot(j, |mut slot| stream.memcpy_htod(&slots[r * k + j], &mut slot)).unwrap();
                    }
                    ex.sum().unwrap();
                    let mut out = vec![f32::NAN; len];
                    ex.for_each_sum(|off, piece| {
                        out[off..off + piece.len()].copy_from_slice(&stream.clone_dtoh(&piece).unwrap());
                        Ok(())
                    })
                    .unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// 16-bit gradients through the GPU exchange are the CPU exchange's sum: the same slots
/// (the codec checks' slots: blocks from 2^-140 to 2^126, NaNs, infinities, f32
/// subnormals, exact bf16 ties) give, on every member and on cuda:0 (R = 4 on one GPU),
/// cuda:0,0 (device copies) and, with two GPUs, cuda:0,1 (NCCL's all-gather), bitwise
/// the shared-memory exchange's decoded sum — the codec's canonical tree over the R wires
/// — but for which NaN a sum holding a NaN gives (CUDA's canonical NaN; x86 keeps an
/// operand's). Every GPU member holds bitwise the same values, NaNs included: they ran one
/// kernel on the same bytes.
#[test]
fn sixteen_bit_gradients_through_the_gpu_exchange_are_the_cpu_exchanges_sum() {
    let Some(gpus) = gpus_or_skip("sixteen_bit_gradients_through_the_gpu_exchange_are_the_cpu_exchanges_sum") else {
        return;
    };
    let (encoded, raw, shards) = (6 * 1024 + 300, 700, 4);
    for compression in [Compression::Bf16, Compression::Fp16] {
        let codec = Codec::new(compression, encoded).unwrap();
        let mut rng = crate::rng::SplitMix64::new(70 + compression as u64);
        let slots: Vec<Vec<f32>> = (0..shards).map(|s| codec_slot(&mut rng, s, encoded, raw)).collect();
        let cpu = &shm_exchange(1, codec, &slots)[0];
        let mut runs = Vec::new();
        for ordinals in [vec![0], vec![0, 0]] {
            let group = CopyGroup::new(&ordinals, encoded + raw).unwrap();
            runs.push((
                format!("cuda:{ordinals:?}"),
                gpu_codec_exchange(&ordinals, |r, s| group.join(r, s), codec, &slots),
            ));
        }
        if gpus >= 2 && transport_for(&[0, 1]) == Transport::Nccl {
            let group = NcclGroup::new(&[0, 1], encoded + raw).unwrap();
            runs.push(("NCCL on cuda:0,1".into(), gpu_codec_exchange(&[0, 1], |r, s| group.join(r, s), codec, &slots)));
        }
        for (what, members) in &runs {
            for (r, got) in members.iter().enumerate() {
                assert_bits(&format!("{compression:?}, {what}: member {r} vs member 0"), got, &members[0]);
                for (i, (a, b)) in got.iter().zip(cpu).enumerate() {
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{compression:?}, {what}, member {r}: value {i} is {a}, the CPU exchange's {b}"
                    );
                }
            }
        }
    }
}

/// Process 0 of an MPI world makes the NCCL clique id and every process receives it (what
/// a run across processes' GPUs does first): copies of this test executable under
/// `mpirun` (`testing::mpirun`). Needs NCCL's library, not a GPU; without it, or without
/// `mpirun`, the one skip helper says so.
#[cfg(feature = "mpi")]
mod under_mpirun {
    use std::time::Instant;

    use super::new_clique_id;
    use crate::testing::mpirun::{self, Scratch};
    use crate::testing::skip::{skip, Need};
    use crate::testing::test_path;
    use crate::world::World;

    #[test]
    fn process_0_makes_the_nccl_id_and_every_process_gets_it() {
        const TEST: &str = "process_0_makes_the_nccl_id_and_every_process_gets_it";
        if !mpirun::ready(TEST) {
            return;
        }
        let dir = Scratch::new();
        let child = test_path(module_path!(), "child");
        let (o, _) = mpirun::finish(mpirun::spawn(2, &[], &child, "nccl-id", dir.dir()), Instant::now());
        let out = mpirun::text(&o);
        if let Some((_, why)) = out.split_once("nccl-id: skipped: ") {
            skip(TEST, Need::Tool, why.lines().next().unwrap_or(""));
            return;
        }
        assert!(o.status.success(), "{out}");
        let ids: Vec<&str> = out.lines().filter_map(|l| Some(&l[l.find("nccl-id ")? + 8..])).collect();
        assert_eq!(ids.len(), 2, "{out}");
        let (a, b) = (ids[0].split_once(' ').unwrap(), ids[1].split_once(' ').unwrap());
        assert_ne!(a.0, b.0, "two processes: {out}");
        assert_eq!(a.1, b.1, "the same id on both: {out}");
        assert!(a.1.chars().any(|c| c != '0'), "a made id, not zeros: {out}");
    }

    /// A process of the test above, started by it under mpirun (does nothing otherwise).
    #[test]
    #[ignore = "a process of the NCCL id test, started by it under mpirun"]
    fn child() {
        let Some((_, dir)) = mpirun::child_case() else { return };
        let world = crate::world::init().expect("the world starts");
        std::fs::write(dir.join(format!("pid-{}", world.process())), std::process::id().to_string()).unwrap();
        nccl_id(world);
    }

    /// Process 0 makes an id, every process learns whether it could, then receives it and
    /// prints "nccl-id <process> <hex>"; or process 0 prints why it could not.
    fn nccl_id(world: &World) {
        let made = match world.process() {
            0 => new_clique_id().map_err(|e| e.to_string()),
            _ => Ok([0u8; 128]),
        };
        let mut flag = [u8::from(made.is_ok())];
        world.broadcast(0, &mut flag).unwrap();
        if flag[0] == 0 {
            if world.process() == 0 {
                println!("nccl-id: skipped: {}", made.err().unwrap_or_default());
            }
            return world.finalize();
        }
        let mut id = made.unwrap_or([0u8; 128]);
        world.broadcast(0, &mut id).unwrap();
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        println!("nccl-id {} {hex}", world.process());
        world.finalize();
    }
}
