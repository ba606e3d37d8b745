//! Every load-time error: a broken copy of a fixture is written with the checkpoint writer, and
//! the error message must name the offending tensor (or config field) and what was expected.

use megamoe::checkpoint::writer::{read_checkpoint_dir, write_checkpoint};
use megamoe::checkpoint::{Checkpoint, LoadOptions, ProjData};
use megamoe::config::MoeConfig;
use megamoe::forward::Mode;
use megamoe::tensor_io::OwnedTensor;
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Tensors = BTreeMap<String, OwnedTensor>;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn broken(src: &str, edit: impl FnOnce(&mut Value, &mut Option<Value>, &mut Tensors)) -> tempfile::TempDir {
    let (mut cfg, mut q, mut t) = read_checkpoint_dir(&fixture(src)).unwrap();
    edit(&mut cfg, &mut q, &mut t);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &cfg, q.as_ref(), &t, 1).unwrap();
    dir
}

/// The error of opening the copy and loading `layer` (panics if it loads).
fn load_err(dir: &Path, layer: usize, opts: &LoadOptions) -> String {
    match Checkpoint::open(dir).and_then(|ck| ck.load_layer_with(layer, opts)) {
        Ok(_) => panic!("layer {layer} of {} loaded but should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message lacks `{p}`: {msg}");
    }
}

fn set_scalar(t: &mut Tensors, name: &str, x: f32) {
    t.insert(name.into(), OwnedTensor::f32(&[], &[x]));
}

const DEF: LoadOptions = LoadOptions { require_input_scale: false, progress: Some(false) };
const W4A4: LoadOptions = LoadOptions { require_input_scale: true, progress: Some(false) };

#[test]
fn missing_tensor() {
    let n = "layers.1.ffn.experts.5.w3.weight_scale";
    let d = broken("nvfp4-tiny", |_, _, t| {
        t.remove(n);
    });
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "missing"]);
    // A whole expert missing: the first of its tensors is named.
    let d = broken("mxfp4-tiny", |_, _, t| t.retain(|k, _| !k.starts_with("layers.0.ffn.experts.9.")));
    assert_has(&load_err(d.path(), 0, &DEF), &["layers.0.ffn.experts.9.w1.weight", "missing"]);
    // Router and shared expert.
    let d = broken("nvfp4-tiny", |_, _, t| {
        t.remove("layers.1.ffn.gate.weight");
    });
    assert_has(&load_err(d.path(), 1, &DEF), &["layers.1.ffn.gate.weight", "missing"]);
    let d = broken("mxfp4-tiny", |_, _, t| {
        t.remove("layers.1.ffn.shared_experts.w2.weight");
    });
    assert_has(&load_err(d.path(), 1, &DEF), &["layers.1.ffn.shared_experts.w2.weight", "missing"]);
}

#[test]
fn missing_tid2eid_on_hash_layer() {
    let d = broken("mxfp4-tiny", |_, _, t| {
        t.remove("layers.0.ffn.gate.tid2eid");
    });
    assert_has(&load_err(d.path(), 0, &DEF), &["layers.0.ffn.gate.tid2eid", "hash-routed"]);
}

#[test]
fn wrong_shape() {
    // Same bytes, different shape.
    let n = "layers.1.ffn.experts.2.w2.weight";
    let d = broken("nvfp4-tiny", |_, _, t| t.get_mut(n).unwrap().shape = vec![128, 128]);
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "shape [128, 128]", "expected [256, 64]"]);
    let n = "layers.0.ffn.experts.4.w1.scale";
    let d = broken("mxfp4-tiny", |_, _, t| t.get_mut(n).unwrap().shape = vec![256, 4]);
    assert_has(&load_err(d.path(), 0, &DEF), &[n, "shape [256, 4]", "expected [128, 8]"]);
    let n = "layers.1.ffn.shared_experts.w1.weight";
    let d = broken("nvfp4-tiny", |_, _, t| t.get_mut(n).unwrap().shape = vec![256, 128]);
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "shape [256, 128]"]);
}

#[test]
fn wrong_dtype() {
    let n = "layers.1.ffn.experts.6.w1.weight_scale";
    let d = broken("nvfp4-tiny", |_, _, t| t.get_mut(n).unwrap().dtype = Dtype::I8);
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "dtype I8", "F8_E4M3"]);
    let n = "layers.1.ffn.gate.weight";
    let d = broken("mxfp4-tiny", |_, _, t| {
        let g = t.get_mut(n).unwrap();
        g.dtype = Dtype::I16;
    });
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "dtype I16"]);
    let n = "layers.0.ffn.gate.tid2eid";
    let d = broken("mxfp4-tiny", |_, _, t| t.get_mut(n).unwrap().dtype = Dtype::F64);
    assert_has(&load_err(d.path(), 0, &DEF), &[n, "dtype F64"]);
}

#[test]
fn bad_weight_scale_2() {
    let n = "layers.0.ffn.experts.11.w2.weight_scale_2";
    for bad in [0.0f32, -0.5, f32::NAN, f32::INFINITY] {
        let d = broken("nvfp4-tiny", |_, _, t| set_scalar(t, n, bad));
        assert_has(&load_err(d.path(), 0, &DEF), &[n, "expected a finite positive global scale"]);
    }
    let d = broken("nvfp4-tiny", |_, _, t| {
        t.insert(n.into(), OwnedTensor::f32(&[2], &[1.0, 1.0]));
    });
    assert_has(&load_err(d.path(), 0, &DEF), &[n, "scalar"]);
}

#[test]
fn bad_input_scale_is_a_warning_unless_w4a4() {
    let n = "layers.1.ffn.experts.7.w1.input_scale";
    for bad in [Some(0.0f32), Some(f32::NAN), Some(-1.0), None] {
        let d = broken("nvfp4-tiny", |_, _, t| match bad {
            Some(x) => set_scalar(t, n, x),
            None => {
                t.remove(n);
            }
        });
        assert_has(&load_err(d.path(), 1, &W4A4), &[n]);
        let ck = Checkpoint::open(d.path()).unwrap();
        let l = ck.load_layer_for(1, Mode::W4A16).unwrap();
        let ProjData::Nvfp4 { input_scale, .. } = &l.layer.w1.data else { panic!() };
        assert!(input_scale.is_none());
        // W2 and W3 keep theirs.
        let ProjData::Nvfp4 { input_scale, .. } = &l.layer.w3.data else { panic!() };
        assert!(input_scale.is_some());
        assert!(l.warnings.iter().any(|w| w.contains(n) && w.contains("W4A4")), "{:?}", l.warnings);
    }
}

#[test]
fn nan_e4m3_block_scales() {
    let n = "layers.1.ffn.experts.0.w3.weight_scale";
    let d = broken("nvfp4-tiny", |_, _, t| {
        let b = &mut t.get_mut(n).unwrap().bytes;
        b[16 * 5 + 3] = 0x7F;
        b[16 * 9] = 0xFF;
        b[16 * 100 + 15] = 0x7F;
    });
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "3 NaN", "first at [5, 3]", "0x7F"]);
}

#[test]
fn nan_e8m0_scales() {
    let n = "layers.0.ffn.experts.15.w2.scale";
    let d = broken("mxfp4-tiny", |_, _, t| {
        t.get_mut(n).unwrap().bytes[4 * 7 + 2] = 0xFF;
    });
    assert_has(&load_err(d.path(), 0, &DEF), &[n, "1 NaN", "first at [7, 2]"]);
    // FP8 shared expert with a NaN e8m0 block scale.
    let d = broken("mxfp4-tiny", |_, _, t| {
        let m = "layers.1.ffn.shared_experts.w1";
        t.insert(
            format!("{m}.weight"),
            OwnedTensor { dtype: Dtype::F8_E4M3, shape: vec![128, 256], bytes: vec![0x38; 128 * 256] },
        );
        t.insert(
            format!("{m}.scale"),
            OwnedTensor { dtype: Dtype::F8_E8M0, shape: vec![1, 2], bytes: vec![127, 0xFF] },
        );
    });
    assert_has(&load_err(d.path(), 1, &DEF), &["layers.1.ffn.shared_experts.w1.scale", "1 NaN", "[0, 1]"]);
    // ... and a NaN e4m3 weight byte.
    let d = broken("mxfp4-tiny", |_, _, t| {
        let m = "layers.1.ffn.shared_experts.w1";
        let mut w = vec![0x38; 128 * 256];
        w[256 * 2 + 10] = 0xFF;
        t.insert(
            format!("{m}.weight"),
            OwnedTensor { dtype: Dtype::F8_E4M3, shape: vec![128, 256], bytes: w },
        );
        t.insert(
            format!("{m}.scale"),
            OwnedTensor { dtype: Dtype::F8_E8M0, shape: vec![1, 2], bytes: vec![127, 127] },
        );
    });
    assert_has(&load_err(d.path(), 1, &DEF), &["layers.1.ffn.shared_experts.w1.weight", "[2, 10]"]);
}

#[test]
fn tid2eid_out_of_range_and_wrong_shape() {
    let n = "layers.0.ffn.gate.tid2eid";
    let d = broken("nvfp4-tiny", |_, _, t| {
        let b = &mut t.get_mut(n).unwrap().bytes;
        b[8 * 41..8 * 42].copy_from_slice(&16i64.to_le_bytes());
        b[8 * 999..8 * 1000].copy_from_slice(&(-1i64).to_le_bytes());
    });
    assert_has(&load_err(d.path(), 0, &DEF), &[n, "2 expert id(s) outside 0..16", "first: 16 at [10, 1]"]);
    let d = broken("nvfp4-tiny", |_, _, t| t.get_mut(n).unwrap().shape = vec![2000, 2]);
    assert_has(&load_err(d.path(), 0, &DEF), &[n, "shape [2000, 2]", "expected [1000, 4]"]);
}

#[test]
fn router_bias_shape_and_values() {
    let n = "layers.1.ffn.gate.bias";
    let d = broken("mxfp4-tiny", |_, _, t| {
        t.insert(n.into(), OwnedTensor::f32(&[8], &[0.0; 8]));
    });
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "shape [8]", "expected [16]"]);
    let d = broken("mxfp4-tiny", |_, _, t| {
        let mut b = vec![0.0f32; 16];
        b[4] = f32::NAN;
        t.insert(n.into(), OwnedTensor::f32(&[16], &b));
    });
    assert_has(&load_err(d.path(), 1, &DEF), &[n, "non-finite", "[4]"]);
    // A missing bias on a score-routed layer is a warning.
    let d = broken("mxfp4-tiny", |_, _, t| {
        t.remove(n);
    });
    let l = Checkpoint::open(d.path()).unwrap().load_layer(1).unwrap();
    assert!(l.layer.router.bias.is_none());
    assert!(l.warnings.iter().any(|w| w.contains(n)), "{:?}", l.warnings);
}

#[test]
fn config_fields_missing() {
    for field in [
        "hidden_size",
        "moe_intermediate_size",
        "n_routed_experts",
        "num_experts_per_tok",
        "scoring_func",
        "routed_scaling_factor",
        "num_hidden_layers",
        "vocab_size",
    ] {
        let d = broken("nvfp4-tiny", |c, _, _| {
            c.as_object_mut().unwrap().remove(field);
        });
        let err = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert_has(&err, &["config.json", field]);
    }
    let d = broken("nvfp4-tiny", |c, _, _| c["scoring_func"] = "relu".into());
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["scoring_func", "relu"]);
    let d = broken("nvfp4-tiny", |c, _, _| c["hidden_size"] = "256".into());
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["hidden_size", "integer"]);
    let d = broken("nvfp4-tiny", |c, _, _| c["num_experts_per_tok"] = 17.into());
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["num_experts_per_tok", "exceeds"]);
}

#[test]
fn config_inconsistent_with_tensors() {
    let cases: Vec<(&str, Value, usize, Vec<&str>)> = vec![
        (
            "moe_intermediate_size",
            64.into(),
            1,
            vec!["layers.1.ffn.experts.0.w1.weight", "expected [64, 128]"],
        ),
        ("hidden_size", 512.into(), 1, vec!["layers.1.ffn.gate.weight", "expected [16, 512]"]),
        ("n_routed_experts", 8.into(), 1, vec!["layers.1.ffn.gate.weight", "expected [8, 256]"]),
        ("num_experts_per_tok", 2.into(), 0, vec!["layers.0.ffn.gate.tid2eid", "expected [1000, 2]"]),
        ("vocab_size", 500.into(), 0, vec!["layers.0.ffn.gate.tid2eid", "expected [500, 4]"]),
        ("n_shared_experts", 0.into(), 1, vec!["shared_experts", "n_shared_experts = 0"]),
        (
            "n_shared_experts",
            2.into(),
            1,
            vec!["layers.1.ffn.shared_experts.w1.weight", "expected [256, 256]"],
        ),
    ];
    for (field, val, layer, parts) in cases {
        let d = broken("nvfp4-tiny", |c, _, _| c[field] = val.clone());
        assert_has(&load_err(d.path(), layer, &DEF), &parts);
    }
    // Layers beyond num_hidden_layers.
    let d = broken("nvfp4-tiny", |c, _, _| c["num_hidden_layers"] = 1.into());
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["layer 1", "num_hidden_layers = 1"]);
    // Experts beyond n_routed_experts.
    let d = broken("mxfp4-tiny", |_, _, t| {
        for s in ["w1.weight", "w1.scale"] {
            let v = t[&format!("layers.1.ffn.experts.0.{s}")].clone();
            t.insert(format!("layers.1.ffn.experts.16.{s}"), v);
        }
    });
    assert_has(&load_err(d.path(), 1, &DEF), &["expert 16", "n_routed_experts = 16"]);
    // Hash layers need a hash table even when only the config changed.
    let d = broken("mxfp4-tiny", |c, _, _| c["num_hash_layers"] = 2.into());
    assert_has(&load_err(d.path(), 1, &DEF), &["layers.1.ffn.gate.tid2eid", "missing"]);
}

#[test]
fn quant_config_errors() {
    let d = broken("nvfp4-tiny", |_, q, _| q.as_mut().unwrap()["quantization"]["group_size"] = 32.into());
    assert_has(
        &Checkpoint::open(d.path()).unwrap_err().to_string(),
        &["hf_quant_config.json", "group_size 32"],
    );
    let d =
        broken("nvfp4-tiny", |_, q, _| q.as_mut().unwrap()["quantization"]["exclude_modules"] = "x".into());
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["exclude_modules", "list"]);
    // Declared MXFP4 but the tensors are NVFP4: the tensor is named.
    let d =
        broken("nvfp4-tiny", |_, q, _| q.as_mut().unwrap()["quantization"]["quant_algo"] = "MXFP4".into());
    assert_has(
        &load_err(d.path(), 1, &DEF),
        &["layers.1.ffn.experts.0.w1.weight_scale", "dtype F8_E4M3", "F8_E8M0"],
    );
    let d =
        broken("nvfp4-tiny", |_, q, _| q.as_mut().unwrap()["quantization"]["quant_algo"] = "W4A8_AWQ".into());
    assert_has(&load_err(d.path(), 1, &DEF), &["W4A8_AWQ", "NVFP4, MXFP4, BF16"]);
}

#[test]
fn file_level_errors() {
    let d = tempfile::tempdir().unwrap();
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["config.json", "missing"]);
    std::fs::copy(fixture("nvfp4-tiny").join("config.json"), d.path().join("config.json")).unwrap();
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["model.safetensors"]);
    std::fs::write(d.path().join("model.safetensors"), b"not a safetensors file").unwrap();
    assert_has(
        &Checkpoint::open(d.path()).unwrap_err().to_string(),
        &["model.safetensors", "not a safetensors file"],
    );
    std::fs::write(d.path().join("config.json"), b"{ nope").unwrap();
    assert_has(&Checkpoint::open(d.path()).unwrap_err().to_string(), &["config.json", "invalid JSON"]);
    // An index naming a tensor its shard lacks.
    let (cfg, q, t) = read_checkpoint_dir(&fixture("mxfp4-tiny")).unwrap();
    let d = tempfile::tempdir().unwrap();
    write_checkpoint(d.path(), &cfg, q.as_ref(), &t, 2).unwrap();
    let idx = d.path().join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&idx).unwrap()).unwrap();
    v["weight_map"]["layers.5.ffn.gate.weight"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(&idx, serde_json::to_string(&v).unwrap()).unwrap();
    assert_has(
        &Checkpoint::open(d.path()).unwrap_err().to_string(),
        &["layers.5.ffn.gate.weight", "does not hold it"],
    );
}

#[test]
fn config_json_names_and_defaults() {
    let v4: Value = serde_json::json!({
        "dim": 7168, "moe_inter_dim": 3072, "n_routed_experts": 384, "n_activated_experts": 6,
        "n_shared_experts": 1, "score_func": "sqrtsoftplus", "route_scale": 2.5, "n_hash_layers": 3,
        "n_layers": 61, "vocab_size": 129280, "swiglu_limit": 10.0
    });
    let c = MoeConfig::from_json(&v4).unwrap();
    assert_eq!(
        (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok),
        (7168, 3072, 384, 6)
    );
    assert_eq!(
        (c.num_hash_layers, c.num_hidden_layers, c.routed_scaling_factor, c.swiglu_limit),
        (3, 61, 2.5, 10.0)
    );
    assert!(c.norm_topk_prob);
    let mut hf = v4.clone();
    let o = hf.as_object_mut().unwrap();
    o.remove("swiglu_limit");
    o.remove("n_hash_layers");
    o.insert("score_func".into(), "sigmoid".into());
    let c = MoeConfig::from_json(&hf).unwrap();
    assert_eq!((c.swiglu_limit, c.num_hash_layers), (0.0, 0));
    assert_eq!(c.scoring_func, megamoe::config::ScoringFunc::Sigmoid);
    let c = MoeConfig::from_file(fixture("nvfp4-tiny").join("config.json")).unwrap();
    assert_eq!(c.vocab_size, 1000);
    let mut v = v4.clone();
    v.as_object_mut().unwrap().remove("moe_inter_dim");
    let err = MoeConfig::from_json(&v).unwrap_err().to_string();
    assert_has(&err, &["moe_intermediate_size", "moe_inter_dim"]);
}

/// A shard cut short (an interrupted download or copy), a file shorter than the 8-byte header
/// length, and a header length past the end: each error names the file and says it is truncated,
/// with the sizes, instead of only what the parser reports.
#[test]
fn truncated_shards_say_so_with_the_sizes() {
    let dir = broken("nvfp4-tiny", |_, _, _| {});
    let shard = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a shard");
    let bytes = std::fs::read(&shard).unwrap();
    let name = shard.file_name().unwrap().to_string_lossy().to_string();
    let open_err = |content: &[u8]| {
        std::fs::write(&shard, content).unwrap();
        match Checkpoint::open(dir.path()) {
            Ok(_) => panic!("a broken {name} opened"),
            Err(e) => e.to_string(),
        }
    };
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let data = bytes.len() - 8 - n;
    let msg = open_err(&bytes[..bytes.len() - 100]);
    assert_has(
        &msg,
        &[&name, "truncated", &format!("describes {data} bytes"), &format!("holds {}", data - 100)],
    );
    let msg = open_err(&bytes[..5]);
    assert_has(&msg, &[&name, "truncated", "5 bytes", "8-byte header length"]);
    let msg = open_err(&bytes[..8 + n / 2]);
    assert_has(&msg, &[&name, "truncated", &format!("says {n} bytes")]);
}
