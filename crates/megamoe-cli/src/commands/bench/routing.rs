//! The routing the EP-rank rows of `bench forward` time: drawn here (uniform top-k, as the peers
//! draw it) or read from a file (`--routing`), so that megamoe and a peer can time the *same* draw.
//! `scripts/peer_routing.py` writes the `triton_kernels` peer's own draw in this file's format.
//!
//! File format (JSON): `{"experts": E, "topk": k, "tokens": {"T": {"ids": [T*k ints], "weights":
//! [T*k floats]}, ...}}` — global expert ids, slot `t*k + j` of token `t`; `-1` marks a slot no
//! expert takes. Any other `source` / comment fields are ignored.

use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Per token `k` distinct experts drawn uniformly over all `experts`, and random positive weights
/// (as `../shared/peers/` draw them). Returns `[T, k]` global ids and weights.
pub(crate) fn draw_routing(tokens: usize, experts: usize, k: usize, seed: u64) -> (Vec<i32>, Vec<f32>) {
    assert!(k <= experts, "top-{k} of {experts} experts");
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pool: Vec<i32> = (0..experts as i32).collect();
    let mut ids = Vec::with_capacity(tokens * k);
    let mut wts = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        // A partial Fisher-Yates shuffle: k distinct, uniformly drawn experts.
        for j in 0..k {
            let s = r.gen_range(j..experts);
            pool.swap(j, s);
        }
        ids.extend_from_slice(&pool[..k]);
        wts.extend((0..k).map(|_| r.gen_range(0.05f32..1.0)));
    }
    (ids, wts)
}

/// The slots of `ids` that land on the experts `range` (pairs) and the distinct experts among them
/// (active local experts).
pub(crate) fn rank_load(ids: &[i32], range: &std::ops::Range<usize>) -> (usize, usize) {
    let mut used = vec![false; range.len()];
    let mut pairs = 0;
    for &id in ids {
        if let Ok(g) = usize::try_from(id) {
            if range.contains(&g) {
                pairs += 1;
                used[g - range.start] = true;
            }
        }
    }
    (pairs, used.iter().filter(|&&u| u).count())
}

/// Where the rank rows' routing comes from.
pub(crate) enum RoutingSource {
    /// [`draw_routing`] with a seed per token count.
    Drawn,
    /// Read from `--routing` (validated against the layer when loaded).
    File { path: PathBuf, rows: BTreeMap<usize, (Vec<i32>, Vec<f32>)> },
}

impl RoutingSource {
    /// Reads and checks a routing file for a layer of `experts` experts, top-`k`.
    pub(crate) fn load(path: &Path, experts: usize, k: usize) -> anyhow::Result<Self> {
        let what = || format!("routing file {}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", what()))?;
        let shape =
            "expected {\"experts\": E, \"topk\": k, \"tokens\": {\"T\": {\"ids\": [..], \"weights\": [..]}}}";
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}; {shape}", what()))?;
        let count = |key: &str| doc.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
        let (Some(fe), Some(fk), Some(tokens)) =
            (count("experts"), count("topk"), doc.get("tokens").and_then(|v| v.as_object()))
        else {
            anyhow::bail!("{}: {shape}", what());
        };
        anyhow::ensure!(
            fe == experts && fk == k,
            "{}: drawn for {fe} experts top-{fk}, the layer has {experts} experts top-{k}",
            what()
        );
        let mut rows = BTreeMap::new();
        for (key, row) in tokens {
            let t: usize = key.parse().ok().filter(|&t| t > 0).ok_or_else(|| {
                anyhow::anyhow!("{}: token count {key:?} is not a positive integer", what())
            })?;
            let list = |name: &str| row.get(name).and_then(|v| v.as_array());
            let (Some(rids), Some(rwts)) = (list("ids"), list("weights")) else {
                anyhow::bail!("{}: T={t} needs the arrays \"ids\" and \"weights\"", what());
            };
            anyhow::ensure!(
                rids.len() == t * k && rwts.len() == t * k,
                "{}: T={t} holds {} ids and {} weights, expected T*k = {}",
                what(),
                rids.len(),
                rwts.len(),
                t * k
            );
            let mut ids = Vec::with_capacity(t * k);
            for (s, v) in rids.iter().enumerate() {
                let id = v.as_i64().filter(|&id| id == -1 || (0..experts as i64).contains(&id));
                let Some(id) = id else {
                    anyhow::bail!(
                        "{}: T={t} ids[{s}] = {v}, expected -1 or an expert id in 0..{experts}",
                        what()
                    );
                };
                ids.push(id as i32);
            }
            for (tok, slots) in ids.chunks(k).enumerate() {
                for (j, &id) in slots.iter().enumerate() {
                    anyhow::ensure!(
                        id < 0 || !slots[..j].contains(&id),
                        "{}: T={t} token {tok} names expert {id} twice",
                        what()
                    );
                }
            }
            let mut wts = Vec::with_capacity(t * k);
            for (s, v) in rwts.iter().enumerate() {
                let w = v.as_f64().map(|w| w as f32).filter(|w| w.is_finite());
                let Some(w) = w else {
                    anyhow::bail!("{}: T={t} weights[{s}] = {v}, expected a finite weight", what());
                };
                wts.push(w);
            }
            rows.insert(t, (ids, wts));
        }
        Ok(RoutingSource::File { path: path.to_path_buf(), rows })
    }

    /// The `[T, k]` ids and weights of `tokens` tokens.
    pub(crate) fn routing(
        &self,
        tokens: usize,
        experts: usize,
        k: usize,
    ) -> anyhow::Result<(Vec<i32>, Vec<f32>)> {
        match self {
            RoutingSource::Drawn => {
                Ok(draw_routing(tokens, experts, k, 0x5EED ^ (tokens as u64).wrapping_mul(0x9E37_79B9)))
            }
            RoutingSource::File { path, rows } => rows.get(&tokens).cloned().ok_or_else(|| {
                anyhow::anyhow!(
                    "routing file {} has no routing for T={tokens} (it holds T = {:?})",
                    path.display(),
                    rows.keys().collect::<Vec<_>>()
                )
            }),
        }
    }

    /// One line for the bench's header.
    pub(crate) fn describe(&self) -> String {
        match self {
            RoutingSource::Drawn => "routing drawn uniformly (seed per T)".into(),
            RoutingSource::File { path, .. } => format!("routing read from {}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_draws_distinct_uniform_experts() {
        let (e, k, t) = (384, 6, 4096);
        let (ids, wts) = draw_routing(t, e, k, 7);
        assert_eq!((ids.len(), wts.len()), (t * k, t * k));
        for row in ids.chunks(k) {
            for (j, &id) in row.iter().enumerate() {
                assert!((0..e as i32).contains(&id));
                assert!(!row[..j].contains(&id), "repeated expert in {row:?}");
            }
        }
        assert!(wts.iter().all(|&w| w > 0.0 && w.is_finite()));
        // One EP8 rank (48 experts) receives about T * k / 8 slots.
        let (pairs, active) = rank_load(&ids, &(48..96));
        assert!((2800..3350).contains(&pairs), "{pairs}");
        assert_eq!(active, 48);
        assert_eq!(draw_routing(t, e, k, 7), (ids, wts));
        assert_ne!(draw_routing(3, e, k, 8).0, draw_routing(3, e, k, 7).0);
    }

    #[test]
    fn rank_load_counts_pairs_and_active_experts() {
        assert_eq!(rank_load(&[0, 5, 5, 9, -1, 7, 12], &(5..10)), (4, 3));
        assert_eq!(rank_load(&[0, 1], &(5..10)), (0, 0));
    }

    fn load(text: &str) -> anyhow::Result<RoutingSource> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("routing.json");
        std::fs::write(&p, text).unwrap();
        RoutingSource::load(&p, 8, 2)
    }

    #[test]
    fn routing_file_round_trips_and_names_missing_rows() {
        let src = load(
            r#"{"experts": 8, "topk": 2, "source": "test",
            "tokens": {"2": {"ids": [0, 7, -1, 3], "weights": [0.5, 0.5, 1.0, 0.25]}}}"#,
        )
        .unwrap();
        let (ids, wts) = src.routing(2, 8, 2).unwrap();
        assert_eq!(ids, vec![0, 7, -1, 3]);
        assert_eq!(wts, vec![0.5, 0.5, 1.0, 0.25]);
        let e = src.routing(4, 8, 2).unwrap_err().to_string();
        assert!(e.contains("no routing for T=4") && e.contains("[2]"), "{e}");
        assert!(src.describe().contains("routing.json"));
    }

    #[test]
    fn routing_file_rejects_bad_rows_by_name() {
        let cases = [
            (r#"{"experts": 16, "topk": 2, "tokens": {}}"#, "16 experts top-2"),
            (r#"{"experts": 8, "topk": 2, "tokens": {"0": {"ids": [], "weights": []}}}"#, "\"0\""),
            (r#"{"experts": 8, "topk": 2, "tokens": {"1": {"ids": [1], "weights": [1.0]}}}"#, "T*k = 2"),
            (
                r#"{"experts": 8, "topk": 2, "tokens": {"1": {"ids": [1, 8], "weights": [1, 1]}}}"#,
                "ids[1] = 8",
            ),
            (
                r#"{"experts": 8, "topk": 2, "tokens": {"1": {"ids": [3, 3], "weights": [1, 1]}}}"#,
                "expert 3 twice",
            ),
            (
                r#"{"experts": 8, "topk": 2, "tokens": {"1": {"ids": [1, 2], "weights": [1, 1e300]}}}"#,
                "weights[1]",
            ),
            (r#"{"experts": 8, "topk": 2, "tokens": {"1": {"ids": [1, 2]}}}"#, "\"weights\""),
            (r#"{"experts": 8}"#, "routing file"),
        ];
        for (text, want) in cases {
            let e = match load(text) {
                Ok(_) => panic!("accepted {text}"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(want) && e.contains("routing file"), "{text}: {e}");
        }
        let e = match RoutingSource::load(Path::new("/nonexistent/r.json"), 8, 2) {
            Ok(_) => panic!("read a missing file"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("/nonexistent/r.json"), "{e}");
    }
}
