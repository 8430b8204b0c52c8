//! The GPU collectives (src/exchange/gpu.rs) against sums computed on the host.
//!
//! Copy path: several members on GPU 0 (`cuda:0,0`), forced to device copies, on random
//! buffers whose lengths do and do not divide by the number of members, are shorter than
//! that, or empty. The copy path sums member 0 + member 1 + ... left to right in f32, so
//! the host reference does the same and the comparison is bitwise; every member must also
//! hold bitwise the same values. NCCL path: needs two GPUs; with two members any
//! summation order gives a + b, so it too is compared bitwise.
//!
//! Without a CUDA driver (CI, laptops) each GPU test writes "skipped: no CUDA driver" to
//! stderr and returns: that is the expected outcome there.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lockstep::cuda::probe::{self, NcclStatus};
use lockstep::exchange::gpu::{transport_for, CopyGroup, NcclGroup, Transport};
use lockstep::exchange::Abort;
use lockstep::Error;

// ---- harness ----------------------------------------------------------------------

#[path = "../src/testing/skip.rs"]
mod skip;

/// The one skip helper: every test here needs GPUs (a failure under LOCKSTEP_REQUIRE_GPU=1).
fn loud(test: &str, why: &str) {
    skip::skip(test, skip::Need::Gpu, why);
}

/// The number of GPUs, or None after a loud skip line when there is no driver or no GPU.
fn gpus_or_skip(test: &str) -> Option<usize> {
    if probe::driver_available().is_err() {
        loud(test, "no CUDA driver");
        return None;
    }
    match probe::gpu_count() {
        Ok(0) => {
            loud(test, "no CUDA GPU");
            None
        }
        Ok(n) => Some(n),
        Err(e) => panic!("the CUDA driver is present but cannot count GPUs: {e}"),
    }
}

/// SplitMix64, for test inputs only.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1), scaled by 10^k for k in {-3..3} so that sums round.
    fn value(&mut self) -> f32 {
        let u = ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        u * 10f32.powi((self.next_u64() % 7) as i32 - 3)
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.value()).collect()
    }
}

/// Member r's compute stream on GPU `ordinal`: its own context handle and a fresh stream,
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
    (0..len)
        .map(|i| {
            let mut acc = 0.0f32;
            for v in inputs {
                acc += v[i];
            }
            acc
        })
        .collect()
}

/// Runs one all-reduce on every member of `group` (one thread each, GPU `ordinals[r]`) and
/// returns what every member holds afterwards.
fn all_reduce_everywhere(group: &CopyGroup, ordinals: &[usize], inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ordinals.len())
            .map(|r| {
                let input = &inputs[r];
                let ordinal = ordinals[r];
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

#[track_caller]
fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}[{i}]: got {g}, want {w}");
    }
}

/// Waits at most `secs` for a value on `rx`: a hang becomes a failure, not a stuck test.
fn within<T>(rx: &mpsc::Receiver<T>, secs: u64, what: &str) -> T {
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("{what}: no answer within {secs} s"))
}

// ---- tests that run everywhere -----------------------------------------------------

#[test]
fn without_a_driver_a_group_is_an_error_not_a_panic() {
    if probe::driver_available().is_ok() {
        return; // covered by the GPU tests below
    }
    let e = CopyGroup::new(&[0, 0], 16).err().expect("no driver, no group");
    assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
    let e = NcclGroup::new(&[0, 1], 16).err().expect("no driver, no group");
    assert!(matches!(e, Error::CudaUnavailable(_)), "{e}");
}

// ---- copy path (one GPU is enough) -------------------------------------------------

#[test]
fn copies_all_reduce_is_the_member_order_sum_on_every_member() {
    let Some(_) = gpus_or_skip("copies_all_reduce_is_the_member_order_sum_on_every_member") else {
        return;
    };
    let mut rng = Rng(7);
    // (members, len): lengths that divide and do not divide by the number of members or
    // the chunk granule, shorter than the number of members, and empty.
    for (members, len) in [(2, 100_003), (2, 4096), (2, 1000), (2, 65), (2, 1), (2, 0), (3, 2), (3, 1001), (4, 777)] {
        let ordinals = vec![0; members];
        let group = CopyGroup::new(&ordinals, len).expect("group");
        let inputs: Vec<Vec<f32>> = (0..members).map(|_| rng.vec(len)).collect();
        let want = host_sum(&inputs);
        let got = all_reduce_everywhere(&group, &ordinals, &inputs);
        for (r, g) in got.iter().enumerate() {
            assert_bitwise(&format!("members {members} len {len} member {r}"), g, &want);
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
    let x = Rng(11).vec(len);
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
        assert_bitwise(&format!("member {r} after one round"), first, &twice);
        assert_bitwise(&format!("member {r} after three rounds"), last, &eight);
    }
}

#[test]
fn copies_broadcast_gives_every_member_the_roots_values() {
    let Some(_) = gpus_or_skip("copies_broadcast_gives_every_member_the_roots_values") else {
        return;
    };
    let (members, len, root) = (3, 1001, 1);
    let group = CopyGroup::new(&vec![0; members], len).expect("group");
    let mut rng = Rng(3);
    let inputs: Vec<Vec<f32>> = (0..members).map(|_| rng.vec(len)).collect();
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..members)
            .map(|r| {
                let (group, input) = (&group, &inputs[r]);
                s.spawn(move || {
                    let stream = compute_stream(0);
                    let mut me = group.join(r, &stream).expect("join");
                    let mut buf = upload(&stream, input);
                    me.broadcast(&mut buf, root).expect("broadcast");
                    download(&stream, &buf)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("member thread")).collect()
    });
    for (r, g) in got.iter().enumerate() {
        assert_bitwise(&format!("member {r}"), g, &inputs[root]);
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

// ---- NCCL path (two GPUs) -----------------------------------------------------------

/// The number of GPUs when there are two or more and NCCL loads; else None after a skip line.
fn two_gpus_and_nccl_or_skip(test: &str) -> Option<usize> {
    let n = gpus_or_skip(test)?;
    if n < 2 {
        loud(test, "needs 2 GPUs");
        return None;
    }
    match probe::nccl_status() {
        NcclStatus::Available => Some(n),
        other => {
            loud(test, &format!("NCCL not usable: {}", other.fix()));
            None
        }
    }
}

#[test]
fn nccl_all_reduce_and_broadcast_on_two_gpus() {
    let Some(_) = two_gpus_and_nccl_or_skip("nccl_all_reduce_and_broadcast_on_two_gpus") else {
        return;
    };
    let ordinals = [0, 1];
    for len in [100_003, 1] {
        assert_eq!(transport_for(&ordinals), Transport::Nccl);
        let group = NcclGroup::new(&ordinals, len).expect("group");
        let mut rng = Rng(5);
        let inputs: Vec<Vec<f32>> = (0..2).map(|_| rng.vec(len)).collect();
        // Two members: every order gives a + b (f32 addition commutes), so bitwise.
        let want = host_sum(&inputs);
        let got: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|r| {
                    let (group, input) = (&group, &inputs[r]);
                    s.spawn(move || {
                        let stream = compute_stream(ordinals[r]);
                        let mut me = group.join(r, &stream).expect("join");
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
            assert_bitwise(&format!("len {len} member {r} sum"), sum, &want);
            assert_bitwise(&format!("len {len} member {r} broadcast"), b, &inputs[1]);
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
