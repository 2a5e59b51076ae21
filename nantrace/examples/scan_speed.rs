//! Lines per second through the job-output readers (NaN scanner + failure classifier + redaction).
fn main() {
    let lines: Vec<String> = (0..200_000)
        .map(|i| match i % 4 {
            0 => format!(
                "step {i} | loss 2.{} | lr 3.0e-04 | grad_norm 1.02 | 120.3 ms/it",
                i % 997
            ),
            1 => format!(
                "{{'loss': 2.{}, 'grad_norm': 0.9, 'learning_rate': 4.5e-05, 'epoch': 0.52}}",
                i % 991
            ),
            2 => format!(
                "Epoch 3: 45%|████▌     | {i}/1000000 [01:23<01:42, 5.37it/s, loss=0.693, v_num=0]"
            ),
            _ => "node1:1234:1234 [0] NCCL INFO Channel 00/02 :    0   1   2   3   4   5   6   7"
                .to_string(),
        })
        .collect();
    let mut r = nantrace::session::LineReader::new(nantrace::nanscan::Scanner::default());
    let t = std::time::Instant::now();
    let mut n = 0;
    for l in &lines {
        n += usize::from(r.read(l).nonfinite);
    }
    let dt = t.elapsed().as_secs_f64();
    println!(
        "LineReader::read: {:.0} lines/s ({n} nonfinite)",
        lines.len() as f64 / dt
    );
    let t = std::time::Instant::now();
    for l in &lines {
        let _ = nantrace::joblog::classify(l);
    }
    println!(
        "joblog::classify: {:.0} lines/s",
        lines.len() as f64 / t.elapsed().as_secs_f64()
    );
    let t = std::time::Instant::now();
    let s = nantrace::nanscan::Scanner::default();
    for l in &lines {
        let _ = s.scan(l);
    }
    println!(
        "nanscan: {:.0} lines/s",
        lines.len() as f64 / t.elapsed().as_secs_f64()
    );
    parts(&lines);
}

#[allow(dead_code)]
fn parts(lines: &[String]) {
    let t = std::time::Instant::now();
    for l in lines {
        let _ = nantrace::collect::redact::log_line(l.clone());
    }
    println!(
        "redact::log_line: {:.0} lines/s",
        lines.len() as f64 / t.elapsed().as_secs_f64()
    );
    let t = std::time::Instant::now();
    let mut r = nantrace::joblog::Reader::default();
    for l in lines {
        let _ = r.line(l);
    }
    println!(
        "joblog::Reader: {:.0} lines/s",
        lines.len() as f64 / t.elapsed().as_secs_f64()
    );
}
