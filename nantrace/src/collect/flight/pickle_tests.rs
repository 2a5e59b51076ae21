use super::*;

/// The dumps torch wrote (tests/flight/make_dumps.py), with what Python's pickle.load read.
pub(crate) fn fixtures() -> Vec<(String, Vec<u8>, serde_json::Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/flight");
    let mut out = Vec::new();
    for s in ["stopped", "mismatch", "two_pgs", "p2p"] {
        for r in 0..3 {
            let p = dir.join(format!("{s}/fr_{r}"));
            let Ok(b) = std::fs::read(&p) else { continue };
            let j = std::fs::read(p.with_extension("json"))
                .ok()
                .or_else(|| std::fs::read(format!("{}.json", p.display())).ok())
                .expect("the expected JSON beside each dump");
            out.push((
                format!("{s}/fr_{r}"),
                b,
                serde_json::from_slice(&j).unwrap(),
            ));
        }
    }
    assert!(out.len() >= 10, "the fixtures are there: {}", out.len());
    out
}

#[test]
fn torchs_own_dumps_decode_as_pythons_pickle_reads_them() {
    for (name, b, want) in fixtures() {
        let got = decode(&b).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.to_json(), want, "{name}");
    }
}

#[test]
fn memo_references_are_the_same_object_and_a_filled_list_is_fetched_filled() {
    // EMPTY_LIST BINPUT 0 MARK BININT1 7 APPENDS ; BINGET 0 ; TUPLE2 STOP
    let b = [
        0x80, 2, b']', b'q', 0, b'(', b'K', 7, b'e', b'h', 0, 0x86, b'.',
    ];
    assert_eq!(
        decode(&b).unwrap(),
        Py::Tuple(vec![Py::List(vec![Py::Int(7)]), Py::List(vec![Py::Int(7)])])
    );
    // LONG1 of 8 bytes (a time in ns), negative BININT, BINFLOAT.
    let t: i64 = 1_796_415_358_250_361_939;
    let mut b = vec![0x80, 2, b'(', 0x8a, 8];
    b.extend(t.to_le_bytes());
    b.extend([b'J']);
    b.extend((-1i32).to_le_bytes());
    b.push(b'G');
    b.extend(1.5f64.to_be_bytes());
    b.extend([b't', b'.']);
    assert_eq!(
        decode(&b).unwrap(),
        Py::Tuple(vec![Py::Int(t), Py::Int(-1), Py::Float(1.5)])
    );
}

#[test]
fn objects_code_and_garbage_are_refused_with_a_reason() {
    // A pickle that would call os.system: GLOBAL is refused by name.
    let evil = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85R.";
    assert!(matches!(
        decode(evil),
        Err(Error::Refused { name: "GLOBAL", .. })
    ));
    assert!(matches!(decode(b""), Err(Error::NoStop)));
    assert!(matches!(
        decode(b"\x80\x02X\xff\xff\xff\x7f"),
        Err(Error::Truncated(_))
    ));
    assert!(matches!(
        decode(b"\x80\x02h\x05."),
        Err(Error::Malformed(..))
    ));
    assert!(matches!(decode(b"\x80\x02."), Err(Error::Malformed(..))));
    assert!(matches!(
        decode(&vec![b'N'; INPUT_MAX + 1]),
        Err(Error::TooBig(_))
    ));
    // MARK depth.
    assert!(matches!(decode(&[b'('; 100]), Err(Error::Limit(_))));
}

/// Memo references make a DAG: each level doubles what a full expansion would make. The
/// decoder counts every value materialised and stops at its budget, fast.
#[test]
fn shared_references_cannot_blow_up() {
    // v0 = [["x" * 1000]]; v(i+1) = (v(i), v(i)) 60 times: 2^60 leaves expanded.
    let mut b = vec![0x80, 2, b'X'];
    b.extend(1000u32.to_le_bytes());
    b.extend([b'x'; 1000]);
    b.extend([b'q', 0]);
    for i in 0..60u8 {
        b.extend([b'h', i, b'h', i, 0x86, b'q', i + 1]);
    }
    b.push(b'.');
    let t = std::time::Instant::now();
    let r = decode(&b);
    assert!(matches!(r, Err(Error::Limit(_))), "{r:?}");
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
    // A list that holds itself: the depth bound, not a loop.
    let b = [0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'];
    assert!(matches!(decode(&b), Err(Error::Limit(_))));
}

/// A deterministic mutation loop over torch's dumps: every truncation, byte flips and
/// insertions at every position: never a panic, and each decode bounded in time.
#[test]
fn mutated_dumps_never_panic() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut runs = 0;
    let t = std::time::Instant::now();
    for (_, b, _) in fixtures().into_iter().take(4) {
        for cut in 0..b.len() {
            let _ = decode(&b[..cut]);
            runs += 1;
        }
        for _ in 0..3000 {
            let mut m = b.clone();
            for _ in 0..1 + next() % 4 {
                let i = (next() as usize) % m.len();
                match next() % 3 {
                    0 => m[i] = next() as u8,
                    1 => m[i] ^= 1 << (next() % 8),
                    _ => m.insert(i, next() as u8),
                }
            }
            let _ = decode(&m);
            runs += 1;
        }
    }
    assert!(runs > 10_000);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        t.elapsed()
    );
}

/// A DUP of a MARK (review finding: the mark count underflowed, a panic in a debug build).
#[test]
fn a_dup_of_a_mark_is_an_error_not_a_panic() {
    assert!(decode(b"(2tt].").is_err());
    assert!(decode(b"(2t0.").is_err());
}
