//! `kvpush demo --layerwise compare`: the same requests pushed whole and layer by layer, and how
//! much of each transfer is left after prefill.
//!
//! A request's *exposed* time is from P's last layer computed (the [`super::procs::Event::Ready`]
//! of a workload with per-layer compute) to D having the whole request: what the transfer adds to
//! the time to first token. [`compare`] summarizes two [`ModeReport`]s of the same workload, one
//! pushed whole and one layer by layer: percentiles of each, the ratio of the medians over the
//! requests of at least [`LARGE_TOKENS`] tokens, and the same per token-count bucket (powers of two).

use serde::Serialize;

use super::stages::StageSplit;
use super::{pct, ModeReport};

/// The requests `ratio_p50` is taken over: at least this many tokens.
pub const LARGE_TOKENS: u64 = 4096;

/// The `"layerwise"` object of the demo's JSON.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerwiseReport {
    /// Median exposed time pushed layer by layer (µs).
    pub exposed_us_p50: u64,
    /// 99th percentile of the same (µs).
    pub exposed_us_p99: u64,
    /// Median exposed time of the same requests pushed whole (µs).
    pub whole_exposed_us_p50: u64,
    /// 99th percentile of the same (µs).
    pub whole_exposed_us_p99: u64,
    /// Layer-wise median over whole median, requests of at least [`LARGE_TOKENS`] tokens (`None`
    /// when there are none).
    pub ratio_p50: Option<f64>,
    /// Requests compared (received in both runs).
    pub requests: u64,
    /// The same per token-count bucket.
    pub by_tokens: Vec<TokensBucket>,
    /// What layer by layer costs: P's posts (WRITEs) in the layer-wise run...
    pub producer_posts: u64,
    /// ...and in the whole run.
    pub whole_producer_posts: u64,
    /// Median engine-thread time per request, both engines, layer-wise run (µs)...
    pub engine_us_p50: f64,
    /// ...and whole run.
    pub whole_engine_us_p50: f64,
    /// Where the layer-wise run's exposed time went, per stage (two processes: from the engines'
    /// timelines, [`super::stages`])...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages: Option<StageSplit>,
    /// ...and the whole run's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub whole_stages: Option<StageSplit>,
}

/// One bucket of [`LayerwiseReport::by_tokens`]: requests of `min_tokens..=max_tokens` tokens.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TokensBucket {
    /// Smallest token count of the bucket (a power of two).
    pub min_tokens: u64,
    /// Largest token count of the bucket.
    pub max_tokens: u64,
    /// Requests in it.
    pub requests: u64,
    /// Median exposed time layer by layer (µs).
    pub exposed_us_p50: u64,
    /// Median exposed time whole (µs).
    pub whole_exposed_us_p50: u64,
    /// The first over the second (`None` when the whole median is 0).
    pub ratio_p50: Option<f64>,
}

/// The exposed times of the requests both runs received, paired by request: `(tokens, layer-wise
/// µs, whole µs)`.
fn paired(whole: &ModeReport, layered: &ModeReport) -> Vec<(u64, u64, u64)> {
    let by_req: std::collections::HashMap<usize, (u64, u64)> =
        whole.exposed.iter().map(|&(req, tokens, us)| (req, (tokens, us))).collect();
    layered
        .exposed
        .iter()
        .filter_map(|&(req, tokens, us)| {
            by_req.get(&req).filter(|(t, _)| *t == tokens).map(|&(_, whole_us)| (tokens, us, whole_us))
        })
        .collect()
}

fn medians(rows: &[&(u64, u64, u64)]) -> (u64, u64) {
    let mut l: Vec<u64> = rows.iter().map(|r| r.1).collect();
    let mut w: Vec<u64> = rows.iter().map(|r| r.2).collect();
    l.sort_unstable();
    w.sort_unstable();
    (pct(&l, 0.5), pct(&w, 0.5))
}

fn ratio(layered: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| layered as f64 / whole as f64)
}

/// Compares the same workload pushed whole (`whole`) and layer by layer (`layered`).
pub fn compare(whole: &ModeReport, layered: &ModeReport) -> LayerwiseReport {
    let rows = paired(whole, layered);
    let mut l: Vec<u64> = rows.iter().map(|r| r.1).collect();
    let mut w: Vec<u64> = rows.iter().map(|r| r.2).collect();
    l.sort_unstable();
    w.sort_unstable();
    let large: Vec<&(u64, u64, u64)> = rows.iter().filter(|r| r.0 >= LARGE_TOKENS).collect();
    let ratio_p50 = if large.is_empty() {
        None
    } else {
        let (lm, wm) = medians(&large);
        ratio(lm, wm)
    };
    let mut by_tokens = Vec::new();
    let mut lo = 1u64;
    let max = rows.iter().map(|r| r.0).max().unwrap_or(0);
    while lo <= max {
        let hi = lo * 2 - 1;
        let bucket: Vec<&(u64, u64, u64)> = rows.iter().filter(|r| (lo..=hi).contains(&r.0)).collect();
        if !bucket.is_empty() {
            let (lm, wm) = medians(&bucket);
            by_tokens.push(TokensBucket {
                min_tokens: lo,
                max_tokens: hi,
                requests: bucket.len() as u64,
                exposed_us_p50: lm,
                whole_exposed_us_p50: wm,
                ratio_p50: ratio(lm, wm),
            });
        }
        lo *= 2;
    }
    LayerwiseReport {
        exposed_us_p50: pct(&l, 0.5),
        exposed_us_p99: pct(&l, 0.99),
        whole_exposed_us_p50: pct(&w, 0.5),
        whole_exposed_us_p99: pct(&w, 0.99),
        ratio_p50,
        requests: rows.len() as u64,
        by_tokens,
        producer_posts: layered.producer_posts,
        whole_producer_posts: whole.producer_posts,
        engine_us_p50: layered.engine_us_p50,
        whole_engine_us_p50: whole.engine_us_p50,
        stages: layered.stages.clone(),
        whole_stages: whole.stages.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(exposed: &[(usize, u64, u64)]) -> ModeReport {
        ModeReport { exposed: exposed.to_vec(), ..ModeReport::default() }
    }

    #[test]
    fn pairs_by_request_and_buckets_by_powers_of_two() {
        // Requests 0..4: 256 and 300 tokens (bucket 256..=511), 4096 and 5000 (4096..=8191); request
        // 4 only in the whole run.
        let whole = report(&[(0, 256, 100), (1, 300, 120), (2, 4096, 1000), (3, 5000, 2000), (4, 64, 9)]);
        let layered = report(&[(3, 5000, 150), (2, 4096, 90), (1, 300, 130), (0, 256, 100)]);
        let r = compare(&whole, &layered);
        assert_eq!(r.requests, 4);
        // Over 4096+: layered median of {90, 150} and whole of {1000, 2000} (upper middle, as pct).
        assert_eq!(r.ratio_p50, Some(150.0 / 2000.0));
        assert_eq!(r.by_tokens.len(), 2);
        assert_eq!((r.by_tokens[0].min_tokens, r.by_tokens[0].max_tokens, r.by_tokens[0].requests), (256, 511, 2));
        assert_eq!((r.by_tokens[0].exposed_us_p50, r.by_tokens[0].whole_exposed_us_p50), (130, 120));
        assert_eq!((r.by_tokens[1].min_tokens, r.by_tokens[1].requests), (4096, 2));
        assert_eq!((r.exposed_us_p50, r.whole_exposed_us_p50), (130, 1000));
        assert_eq!((r.exposed_us_p99, r.whole_exposed_us_p99), (150, 2000));
    }

    #[test]
    fn no_large_request_has_no_ratio() {
        let r = compare(&report(&[(0, 100, 10)]), &report(&[(0, 100, 5)]));
        assert_eq!(r.ratio_p50, None);
        assert_eq!(r.by_tokens[0].ratio_p50, Some(0.5));
    }
}
