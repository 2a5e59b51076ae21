//! The check's comparisons, findings and exit codes on made-up results; the embedded PTX.
use super::*;

fn gpu(i: u32, fp: &str, mism: Value, mem_errs: u64) -> Value {
    json!({ "index": i, "name": "NVIDIA H200", "pci": format!("0000:{:02x}:00.0", i),
        "compute": { "fp16": { "reps": 20, "fingerprint": fp, "mismatching_reps": mism, "seconds": 1.0 } },
        "memory": { "bytes_tested": 1u64 << 30, "patterns": [{ "pattern": "address", "errors": mem_errs, "first_bad_word": if mem_errs > 0 { json!(77) } else { Value::Null } }], "seconds": 1.0 } })
}

#[test]
fn diff_finds_the_first_differing_element() {
    let a: Vec<u8> = (0..64).collect();
    let mut b = a.clone();
    assert_eq!(diff(&a, &b, 4), None);
    b[13] ^= 0x10;
    b[40] ^= 0x01;
    let d = diff(&a, &b, 4).unwrap();
    assert_eq!((d.first_index, d.differing), (3, 2));
    assert_eq!(d.want_bits ^ d.got_bits, 0x10 << 8);
    assert_ne!(fingerprint(&a), fingerprint(&b));
}

#[test]
fn a_gpu_that_disagrees_with_its_peers_is_named() {
    let v = json!({ "gpus": [gpu(0, "aa", json!([]), 0), gpu(1, "aa", json!([]), 0), gpu(2, "bb", json!([{ "rep": 3, "first_index": 12345, "want_bits": "0x3c00", "got_bits": "0x3c01" }, { "rep": 7 }]), 0), gpu(3, "aa", json!([]), 0)] });
    let f = findings(&v);
    assert!(f.iter().any(|x| x == "GPU 2 (0000:02:00.0) gave different FP16 results in 2 of 20 runs (first in repetition 3, element 12345: 0x3c01 instead of 0x3c00)"), "{f:?}");
    assert!(f.iter().any(|x| x.starts_with("GPU 2 gave different FP16 results than its NVIDIA H200 peers (GPU 0, GPU 1, GPU 3) [3 of 4 agree]")), "{f:?}");
    assert_eq!(f.len(), 2, "{f:?}");
    assert!(summary(&v).contains("fp16 20 runs DIFFER"));
}

#[test]
fn clean_gpus_and_memory_errors() {
    let clean = json!({ "gpus": [gpu(0, "aa", json!([]), 0), gpu(1, "aa", json!([]), 0)] });
    assert!(findings(&clean).is_empty());
    assert!(summary(&clean).contains("bit-identical"));
    let mem = json!({ "gpus": [gpu(0, "aa", json!([]), 5)] });
    assert_eq!(
        findings(&mem),
        vec![
            "GPU 0 (0000:00:00.0): 5 memory errors with the address pattern (first bad word 77)"
                .to_string()
        ]
    );
}

/// A GPU in MIG mode, or one another process computes on, is said and not checked; our
/// own context is not "another process".
#[test]
fn busy_and_mig_gpus_are_not_checked() {
    let me = 100;
    assert_eq!(skip_reason(&GpuState::default(), me, false), None);
    assert_eq!(
        skip_reason(
            &GpuState {
                mig: false,
                holders: vec![(me, "nantrace".into())]
            },
            me,
            false
        ),
        None
    );
    let busy = skip_reason(
        &GpuState {
            mig: false,
            holders: vec![(me, "nantrace".into()), (4242, "python3".into())],
        },
        me,
        false,
    )
    .unwrap();
    assert!(
        busy.starts_with("busy: python3 4242 compute(s) on it"),
        "{busy}"
    );
    let mig = GpuState {
        mig: true,
        holders: vec![(4242, "python3".into())],
    };
    let why = skip_reason(&mig, me, false).unwrap();
    assert!(
        why.starts_with("MIG mode is on") && why.contains("CUDA_VISIBLE_DEVICES=MIG-"),
        "{why}"
    );
    // Instances named in CUDA_VISIBLE_DEVICES are checked, whatever runs on the others.
    assert_eq!(skip_reason(&mig, me, true), None);
}

/// Exit codes: a disagreement or memory error is 1 whatever else happened; a GPU left out
/// (busy, MIG), a check that did not complete or could not run is 2; all clean is 0.
#[test]
fn a_gpu_left_out_is_a_finding_and_exit_code_2() {
    let skipped = json!({ "index": 1, "name": "NVIDIA H200", "pci": "0000:01:00.0", "skipped": "busy: python3 4242 compute(s) on it; not checked while another process uses the GPU" });
    let v = json!({ "gpus": [gpu(0, "aa", json!([]), 0), skipped.clone()] });
    assert_eq!(findings(&v), vec!["GPU 1 (0000:01:00.0) not checked: busy: python3 4242 compute(s) on it; not checked while another process uses the GPU".to_string()]);
    assert_eq!(exit_code(&v), 2);
    assert!(
        summary(&v).contains("gpucheck: GPU 1 (0000:01:00.0) not checked: busy"),
        "{}",
        summary(&v)
    );
    let bad = json!({ "gpus": [gpu(0, "aa", json!([]), 3), skipped] });
    assert_eq!(exit_code(&bad), 1);
    assert_eq!(
        exit_code(&json!({ "gpus": [gpu(0, "aa", json!([]), 0)] })),
        0
    );
    assert_eq!(
        exit_code(&json!({ "error": "no NVIDIA driver", "gpus": [] })),
        2
    );
}

#[test]
fn without_a_driver_the_check_says_so() {
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        eprintln!("NOTE: an NVIDIA driver is present here: the no-driver path is not exercised");
        return;
    }
    let v = run(&Opts {
        reps: 1,
        iters: 10,
        ..Opts::default()
    });
    assert_eq!(v["schema"], SCHEMA);
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .starts_with("no NVIDIA driver: libcuda.so.1 cannot be loaded"),
        "{v}"
    );
    assert_eq!(
        findings(&v)[0],
        format!("the check could not run: {}", v["error"].as_str().unwrap())
    );
}

#[test]
fn the_embedded_ptx_has_every_kernel() {
    for k in KERNELS {
        assert!(PTX.contains(&format!(".visible .entry {k}(")), "{k}");
    }
    assert!(
        PTX.contains("fma.rn.f32") && PTX.contains("fma.rn.f16") && PTX.contains("fma.rn.bf16")
    );
}
