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
    let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h).to_string();
    let hp = if hostport.contains(':') { hostport.to_string() } else { format!("{hostport}:80") };
    Some((hp, host, path.to_string()))
}

async fn post_once(url: &str, body: &str, timeout: Duration) -> Result<u16, String> {
    let (hp, host, path) = split(url).ok_or("not an http:// URL")?;
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(&hp).await.map_err(|e| format!("connect {hp}: {e}"))?;
        let req = format!("POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nUser-Agent: nantrace/{}\r\n\r\n{body}", body.len(), env!("CARGO_PKG_VERSION"));
        s.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
        let mut head = vec![0u8; 1024];
        let n = s.read(&mut head).await.map_err(|e| e.to_string())?;
        let line = String::from_utf8_lossy(&head[..n]);
        line.split_whitespace().nth(1).and_then(|c| c.parse::<u16>().ok()).ok_or_else(|| "no HTTP status in the answer".to_string())
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| format!("no answer within {timeout:?}"))?
}

/// Start the sender; returns the queue (64 incidents; beyond that, counted as failures).
pub fn spawn(url: String, timeout: Duration, retries: u32, metrics: std::sync::Arc<super::metrics::Metrics>) -> mpsc::Sender<serde_json::Value> {
    let (tx, mut rx) = mpsc::channel::<serde_json::Value>(64);
    tokio::spawn(async move {
        while let Some(v) = rx.recv().await {
            let body = v.to_string();
            let mut ok = false;
            for attempt in 0..=retries {
                match post_once(&url, &body, timeout).await {
                    Ok(c) if (200..300).contains(&c) => {
                        ok = true;
                        break;
                    }
                    Ok(c) => crate::say!("nantrace: webhook: HTTP {c} (attempt {})", attempt + 1),
                    Err(e) => crate::say!("nantrace: webhook: {} (attempt {})", crate::term::clean(&e), attempt + 1),
                }
                tokio::time::sleep(Duration::from_secs(1 << attempt.min(5))).await;
            }
            if !ok {
                metrics.inc("nantrace_webhook_failures_total", &[]);
            }
        }
    });
    tx
}

#[cfg(test)]
mod tests {
    #[test]
    fn url_parts() {
        assert_eq!(super::split("http://hooks.local:8080/x/y"), Some(("hooks.local:8080".into(), "hooks.local".into(), "/x/y".into())));
        assert_eq!(super::split("http://h"), Some(("h:80".into(), "h".into(), "/".into())));
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
                c.write_all(format!("HTTP/1.1 {code}\r\nContent-Length: 0\r\n\r\n").as_bytes()).await.unwrap();
            }
            bodies
        });
        let m = std::sync::Arc::new(super::super::metrics::Metrics::default());
        let tx = super::spawn(format!("http://{addr}/hook"), std::time::Duration::from_secs(2), 3, m.clone());
        tx.send(serde_json::json!({ "verdict": "PROBABLY THE MACHINE (GPU)" })).await.unwrap();
        let bodies = tokio::time::timeout(std::time::Duration::from_secs(10), server).await.unwrap().unwrap();
        assert!(bodies[1].starts_with("POST /hook HTTP/1.1") && bodies[1].ends_with(r#"{"verdict":"PROBABLY THE MACHINE (GPU)"}"#), "{}", bodies[1]);
        assert_eq!(m.get("nantrace_webhook_failures_total", &[]), 0.0);
    }
}
