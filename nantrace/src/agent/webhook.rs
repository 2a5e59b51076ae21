//! The incident webhook: a JSON POST over plain HTTP, with a timeout and retries, on a task of
//! its own (a bounded queue: the recorder never waits for it).
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

/// `http://host:port/path` -> (host:port, host, path).
fn split(url: &str) -> Option<(String, String, String)> {
    let rest = url.strip_prefix("http://")?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let host = hostport
        .rsplit_once(':')
        .map_or(hostport, |(h, _)| h)
        .to_string();
    let hp = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    Some((hp, host, path.to_string()))
}

async fn post_once(url: &str, body: &str, timeout: Duration) -> Result<u16, String> {
    let (hp, host, path) = split(url).ok_or("not an http:// URL")?;
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(&hp)
            .await
            .map_err(|e| format!("connect {hp}: {e}"))?;
        let req = format!("POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nUser-Agent: nantrace/{}\r\n\r\n{body}", body.len(), env!("CARGO_PKG_VERSION"));
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut head = vec![0u8; 1024];
        let n = s.read(&mut head).await.map_err(|e| e.to_string())?;
        let line = String::from_utf8_lossy(&head[..n]);
        line.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse::<u16>().ok())
            .ok_or_else(|| "no HTTP status in the answer".to_string())
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

/// Deliveries at once: a dead endpoint (each incident: every retry's timeout and back-off)
/// does not make the queue wait for one incident after another (redteam3: strictly serial
/// delivery lagged 14 minutes behind a full queue).
pub const PARALLEL: usize = 4;

/// Start the sender; returns the queue (64 incidents; beyond that, counted as failures). At
/// most [`PARALLEL`] incidents are delivered at once, each with its own retries.
pub fn spawn(
    url: String,
    timeout: Duration,
    retries: u32,
    metrics: std::sync::Arc<super::metrics::Metrics>,
) -> mpsc::Sender<serde_json::Value> {
    let (tx, mut rx) = mpsc::channel::<serde_json::Value>(64);
    let url = std::sync::Arc::new(url);
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(PARALLEL));
    tokio::spawn(async move {
        while let Some(v) = rx.recv().await {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break;
            };
            let (url, metrics) = (url.clone(), metrics.clone());
            tokio::spawn(async move {
                let body = v.to_string();
                let mut ok = false;
                for attempt in 0..=retries {
                    match post_once(&url, &body, timeout).await {
                        Ok(c) if (200..300).contains(&c) => {
                            ok = true;
                            break;
                        }
                        Ok(c) => {
                            crate::say!("nantrace: webhook: HTTP {c} (attempt {})", attempt + 1)
                        }
                        Err(e) => crate::say!(
                            "nantrace: webhook: {} (attempt {})",
                            crate::term::clean(&e),
                            attempt + 1
                        ),
                    }
                    if attempt < retries {
                        tokio::time::sleep(Duration::from_secs(1 << attempt.min(5))).await;
                    }
                }
                if !ok {
                    metrics.inc("nantrace_webhook_failures_total", &[]);
                }
                drop(slot);
            });
        }
    });
    tx
}

#[cfg(test)]
mod tests {
    #[test]
    fn url_parts() {
        assert_eq!(
            super::split("http://hooks.local:8080/x/y"),
            Some((
                "hooks.local:8080".into(),
                "hooks.local".into(),
                "/x/y".into()
            ))
        );
        assert_eq!(
            super::split("http://h"),
            Some(("h:80".into(), "h".into(), "/".into()))
        );
        assert_eq!(super::split("https://h"), None);
    }

    #[tokio::test]
    async fn posts_json_and_retries() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            // The first attempt gets a 500, the second a 204.
            let mut bodies = Vec::new();
            for code in ["500 Internal Server Error", "204 No Content"] {
                let (mut c, _) = l.accept().await.unwrap();
                let mut buf = vec![0u8; 4096];
                let n = c.read(&mut buf).await.unwrap();
                bodies.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                c.write_all(format!("HTTP/1.1 {code}\r\nContent-Length: 0\r\n\r\n").as_bytes())
                    .await
                    .unwrap();
            }
            bodies
        });
        let m = std::sync::Arc::new(super::super::metrics::Metrics::default());
        let tx = super::spawn(
            format!("http://{addr}/hook"),
            std::time::Duration::from_secs(2),
            3,
            m.clone(),
        );
        tx.send(serde_json::json!({ "verdict": "PROBABLY THE MACHINE (GPU)" }))
            .await
            .unwrap();
        let bodies = tokio::time::timeout(std::time::Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap();
        assert!(
            bodies[1].starts_with("POST /hook HTTP/1.1")
                && bodies[1].ends_with(r#"{"verdict":"PROBABLY THE MACHINE (GPU)"}"#),
            "{}",
            bodies[1]
        );
        assert_eq!(m.get("nantrace_webhook_failures_total", &[]), 0.0);
    }

    /// An endpoint that takes the connection and never answers: the next incidents are on
    /// their way meanwhile, up to PARALLEL at once, not one after another.
    #[tokio::test]
    async fn a_hung_endpoint_does_not_hold_the_next_incidents() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let m = std::sync::Arc::new(super::super::metrics::Metrics::default());
        let tx = super::spawn(
            format!("http://{addr}/hook"),
            std::time::Duration::from_secs(30),
            0,
            m.clone(),
        );
        for i in 0..super::PARALLEL + 2 {
            tx.send(serde_json::json!({ "incident": i })).await.unwrap();
        }
        let mut held = Vec::new();
        let open = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while held.len() < super::PARALLEL {
                held.push(l.accept().await.unwrap().0);
            }
        })
        .await;
        assert!(
            open.is_ok(),
            "only {} delivery at a time while one hangs",
            held.len()
        );
        // No more than PARALLEL at once.
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(500), l.accept())
                .await
                .is_err(),
            "more than PARALLEL deliveries at once"
        );
    }
}
