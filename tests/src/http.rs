//! Plain HTTP GETs against the processes' metrics servers (loopback only).

use std::time::Duration;

/// GETs `url` and returns the status code and the body as text. Transport errors (refused,
/// timed out) are `Err`; any HTTP status, including 4xx/5xx, is `Ok`.
pub fn get(url: &str) -> Result<(u16, String), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut resp = agent
        .get(url)
        .call()
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("GET {url}: reading the body: {e}"))?;
    Ok((status, body))
}
