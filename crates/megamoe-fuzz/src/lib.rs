//! Fuzz entry points for everything megamoe parses from outside: `config.json` and
//! `hf_quant_config.json`, safetensors shards and their index, and whole checkpoints loaded layer
//! by layer. Each entry point takes arbitrary bytes and must return, never panic, never allocate
//! without bound: every failure is an error value. The cargo-fuzz targets in `fuzz/` call these
//! (libFuzzer, long runs); `tests/smoke.rs` replays a bounded, seeded set of inputs in CI.

use megamoe::checkpoint::store::TensorStore;
use megamoe::checkpoint::{Checkpoint, LoadOptions};
use megamoe::config::{MoeConfig, QuantConfig};
use megamoe::forward::Mode;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The golden checkpoint the checkpoint target mutates (NVFP4, two MoE layers).
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../megamoe/tests/data/nvfp4-tiny")
}

/// `data` as `config.json` (and, after a NUL byte, `hf_quant_config.json`): parse, build the
/// MoE and quantization configs, validate. Returns whether the config was accepted.
pub fn config_json(data: &[u8]) -> bool {
    let (cfg, quant) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let Ok(cfg) = serde_json::from_slice::<serde_json::Value>(cfg) else { return false };
    let quant = quant.and_then(|q| serde_json::from_slice::<serde_json::Value>(q).ok());
    let mut accepted = false;
    if let Ok(c) = MoeConfig::from_json(&cfg) {
        accepted = c.validate().is_ok();
        for layer in 0..c.num_hidden_layers.min(4) {
            let _ = c.is_hash_layer(layer);
        }
    }
    if let Ok(q) = QuantConfig::from_json(&cfg, quant.as_ref()) {
        let _ = q.expert_quant("model.layers.1.mlp.experts.0.w1").expert_format();
        let _ = q.dense_quant("model.layers.1.mlp.shared_experts.w1");
    }
    accepted
}

/// A scratch directory per thread (fuzzers run one input at a time per thread).
fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a scratch directory")).path()
}

/// `data` as one safetensors shard: map it, list its tensors and read every tensor's bytes.
/// Returns whether the shard opened.
pub fn safetensors_file(data: &[u8]) -> bool {
    let path = scratch().join(format!("shard-{:?}.safetensors", std::thread::current().id()));
    if std::fs::write(&path, data).is_err() {
        return false;
    }
    let Ok(store) = TensorStore::open_files(std::slice::from_ref(&path)) else { return false };
    let names: Vec<String> = store.names().map(str::to_string).collect();
    for name in names {
        if let Ok(view) = store.tensor(&name) {
            let _ = view.data().iter().fold(0u8, |a, &b| a ^ b);
        }
    }
    true
}

/// The fixture checkpoint with one file replaced or damaged as `data` says, opened and every
/// layer loaded (all modes' options) and validated.
///
/// `data[0] % 5` picks the damage: 0 `config.json` = the rest; 1 `hf_quant_config.json` = the
/// rest; 2 the shard truncated at a position from the next 4 bytes; 3 the shard with bytes
/// overwritten (pairs of a 4-byte position and a byte); 4 an index file = the rest, the shard
/// renamed beside it. Returns whether at least one layer loaded and validated.
pub fn checkpoint(data: &[u8]) -> bool {
    let Some((&op, rest)) = data.split_first() else { return false };
    let dir = match tempfile::tempdir_in(scratch()) {
        Ok(d) => d,
        Err(_) => return false,
    };
    let src = fixture_dir();
    let copy = |name: &str| std::fs::copy(src.join(name), dir.path().join(name)).is_ok();
    if !(copy("config.json") && copy("hf_quant_config.json")) {
        return false;
    }
    let shard = std::fs::read(src.join("model.safetensors")).unwrap_or_default();
    let pos = |b: &[u8]| b.get(..4).map(|p| u32::from_le_bytes(p.try_into().unwrap()) as usize);
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.path().join(name), bytes).is_ok();
    let ok = match op % 5 {
        0 => write("config.json", rest) && write("model.safetensors", &shard),
        1 => write("hf_quant_config.json", rest) && write("model.safetensors", &shard),
        2 => {
            let at = pos(rest).map_or(0, |p| p % (shard.len() + 1));
            write("model.safetensors", &shard[..at])
        }
        3 => {
            let mut s = shard.clone();
            for c in rest.chunks_exact(5) {
                // Positions land in the header half the time: that is where the parser lives.
                let p = pos(c).unwrap_or(0);
                let header = 8 + u64::from_le_bytes(shard[..8].try_into().unwrap()) as usize;
                let at = if p & 1 == 0 { p % header.min(s.len()) } else { p % s.len() };
                s[at] = c[4];
            }
            write("model.safetensors", &s)
        }
        _ => write("model.safetensors.index.json", rest) && write("shard-1.safetensors", &shard),
    };
    if !ok {
        return false;
    }
    let Ok(ck) = Checkpoint::open(dir.path()) else { return false };
    let mut loaded = false;
    for layer in ck.moe_layers() {
        for mode in Mode::ALL {
            if let Ok(l) = ck.load_layer_with(layer, &LoadOptions::for_mode(mode)) {
                loaded |= l.layer.validate_scale_bytes().is_ok();
            }
        }
    }
    loaded
}
