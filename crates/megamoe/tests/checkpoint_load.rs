//! Loading the golden fixtures: struct contents against the raw safetensors bytes, sharded copies,
//! one-layer extracts, HF naming, exclude_modules, FP8 shared experts, W1/W3 scale mismatch.

use megamoe::checkpoint::writer::{read_checkpoint_dir, write_checkpoint};
use megamoe::checkpoint::{Checkpoint, DenseData, LoadOptions, MoeLayer, Naming, ProjData};
use megamoe::config::{QuantSource, WeightQuant};
use megamoe::formats::WeightFormat;
use megamoe::tensor_io::OwnedTensor;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn layer_fingerprint(l: &MoeLayer) -> String {
    // MoeLayer has no PartialEq (a contract struct); its Debug text covers every byte and value.
    format!("{l:?}")
}

fn f32_scalar(st: &SafeTensors<'_>, name: &str) -> f32 {
    let d = st.tensor(name).unwrap();
    f32::from_le_bytes(d.data()[..4].try_into().unwrap())
}

#[test]
fn fixtures_load_every_layer_with_the_files_bytes() {
    for (name, fmt) in [("nvfp4-tiny", WeightFormat::Nvfp4), ("mxfp4-tiny", WeightFormat::Mxfp4)] {
        let dir = fixture(name);
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(ck.naming(), Naming::DeepSeekV4);
        assert_eq!(ck.moe_layers(), vec![0, 1]);
        let cfg = ck.config().clone();
        assert_eq!((cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts), (256, 128, 16));
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for l in [0usize, 1] {
            let loaded = ck.load_layer(l).unwrap();
            // ModelOpt quantized W1 and W3 separately: their global scales differ (a warning), nothing else.
            if fmt == WeightFormat::Nvfp4 {
                assert_eq!(loaded.warnings.len(), 1, "{name} layer {l}: {:?}", loaded.warnings);
                assert!(loaded.warnings[0].contains("w3/w1"));
            } else {
                assert!(loaded.warnings.is_empty(), "{name} layer {l}: {:?}", loaded.warnings);
            }
            let layer = &loaded.layer;
            assert_eq!(layer.index, l);
            assert_eq!(layer.format(), fmt);
            assert_eq!(layer.is_hash(), l == 0);
            // Router.
            let gw = st.tensor(&format!("layers.{l}.ffn.gate.weight")).unwrap();
            let g0 = half::bf16::from_le_bytes([gw.data()[2 * 300], gw.data()[2 * 300 + 1]]).to_f32();
            assert_eq!(layer.router.weight.len(), 16 * 256);
            assert_eq!(layer.router.weight[300], g0);
            if l == 0 {
                let t = st.tensor("layers.0.ffn.gate.tid2eid").unwrap();
                let ids = layer.router.tid2eid.as_ref().unwrap();
                assert_eq!(ids.len(), 1000 * 4);
                for i in [0usize, 1, 2, 3, 1234, 3999] {
                    let v = i64::from_le_bytes(t.data()[8 * i..8 * i + 8].try_into().unwrap());
                    assert_eq!(ids[i] as i64, v);
                }
            } else {
                let b = st.tensor("layers.1.ffn.gate.bias").unwrap();
                let bias = layer.router.bias.as_ref().unwrap();
                assert_eq!(bias.len(), 16);
                for (x, c) in bias.iter().zip(b.data().chunks_exact(4)) {
                    assert_eq!(*x, f32::from_le_bytes(c.try_into().unwrap()));
                }
            }
            // Experts: stacked bytes equal each expert's tensor.
            for (p, proj) in [("w1", &layer.w1), ("w2", &layer.w2), ("w3", &layer.w3)] {
                let (rows, cols) = if p == "w2" { (256, 128) } else { (128, 256) };
                assert_eq!((proj.experts, proj.rows, proj.cols), (16, rows, cols));
                for e in [0usize, 7, 15] {
                    let m = format!("layers.{l}.ffn.experts.{e}.{p}");
                    let w = st.tensor(&format!("{m}.weight")).unwrap();
                    let pk = rows * cols / 2;
                    match &proj.data {
                        ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => {
                            assert_eq!(&packed[e * pk..(e + 1) * pk], w.data());
                            let s = st.tensor(&format!("{m}.weight_scale")).unwrap();
                            let sc = rows * cols / 16;
                            assert_eq!(&scales[e * sc..(e + 1) * sc], s.data());
                            assert_eq!(global_scale[e], f32_scalar(&st, &format!("{m}.weight_scale_2")));
                            assert_eq!(
                                input_scale.as_ref().unwrap()[e],
                                f32_scalar(&st, &format!("{m}.input_scale"))
                            );
                        }
                        ProjData::Mxfp4 { packed, scales } => {
                            assert_eq!(&packed[e * pk..(e + 1) * pk], w.data());
                            let s = st.tensor(&format!("{m}.scale")).unwrap();
                            let sc = rows * cols / 32;
                            assert_eq!(&scales[e * sc..(e + 1) * sc], s.data());
                        }
                        ProjData::Bf16 { .. } => panic!("fixture experts are not BF16"),
                    }
                }
            }
            // Shared expert (BF16 in both fixtures).
            let sh = layer.shared.as_ref().unwrap();
            for (p, d) in [("w1", &sh.w1), ("w2", &sh.w2), ("w3", &sh.w3)] {
                let t = st.tensor(&format!("layers.{l}.ffn.shared_experts.{p}.weight")).unwrap();
                assert_eq!(d.rows * d.cols, 128 * 256);
                let DenseData::Bf16(w) = &d.data else { panic!("shared expert should be BF16") };
                let raw: &[u8] = bytemuck::cast_slice(w);
                assert_eq!(raw, t.data());
            }
        }
    }
}

#[test]
fn quant_descriptions_of_the_fixtures() {
    let nv = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    assert_eq!(nv.quant().source, QuantSource::HfQuantConfig);
    assert_eq!(nv.quant().experts, WeightQuant::Nvfp4);
    assert_eq!(nv.quant().exclude_modules.len(), 3);
    assert!(nv.quant().is_excluded("layers.0.ffn.shared_experts.w1"));
    assert!(nv.quant().is_excluded("layers.1.ffn.gate"));
    assert!(!nv.quant().is_excluded("layers.1.ffn.experts.3.w1"));
    let mx = Checkpoint::open(fixture("mxfp4-tiny")).unwrap();
    assert_eq!(mx.quant().source, QuantSource::ConfigJson);
    assert_eq!(mx.quant().experts, WeightQuant::Mxfp4);
    assert_eq!(mx.quant().dense, WeightQuant::Fp8Block);
}

#[test]
fn raw_access_views_the_files() {
    let ck = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    assert!(ck.has("layers.1.ffn.experts.0.w1.weight_scale_2"));
    assert!(!ck.has("layers.1.ffn.experts.99.w1.weight"));
    let v = ck.tensor("layers.1.ffn.experts.0.w1.weight_scale").unwrap();
    assert_eq!(v.dtype(), Dtype::F8_E4M3);
    assert_eq!(v.shape(), &[128, 16]);
    assert!(ck.names().contains(&"layers.0.ffn.gate.tid2eid"));
    let err = ck.tensor("nope").unwrap_err().to_string();
    assert!(err.contains("nope"), "{err}");
    assert_eq!(ck.experts_present(1), (0..16).collect::<Vec<_>>());
}

fn write_edit(
    src: &str,
    shards: usize,
    edit: impl FnOnce(&mut serde_json::Value, &mut Option<serde_json::Value>, &mut BTreeMap<String, OwnedTensor>),
) -> tempfile::TempDir {
    let (mut cfg, mut q, mut t) = read_checkpoint_dir(&fixture(src)).unwrap();
    edit(&mut cfg, &mut q, &mut t);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), &cfg, q.as_ref(), &t, shards).unwrap();
    dir
}

#[test]
fn sharded_copy_loads_identically() {
    for name in ["nvfp4-tiny", "mxfp4-tiny"] {
        let orig = Checkpoint::open(fixture(name)).unwrap();
        let dir = write_edit(name, 3, |_, _, _| {});
        assert!(dir.path().join("model.safetensors.index.json").exists());
        assert!(dir.path().join("model-00003-of-00003.safetensors").exists());
        assert!(!dir.path().join("model.safetensors").exists());
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.store().files().len(), 3);
        assert_eq!(ck.names(), orig.names());
        for l in ck.moe_layers() {
            let a = orig.load_layer(l).unwrap().layer;
            let b = ck.load_layer(l).unwrap().layer;
            assert_eq!(layer_fingerprint(&a), layer_fingerprint(&b), "{name} layer {l}");
        }
    }
}

#[test]
fn one_layer_extract_loads_and_missing_layer_errors() {
    let orig = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    let dir = write_edit("nvfp4-tiny", 1, |_, _, t| t.retain(|k, _| k.starts_with("layers.1.")));
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.moe_layers(), vec![1]);
    let a = orig.load_layer(1).unwrap().layer;
    let b = ck.load_layer(1).unwrap().layer;
    assert_eq!(layer_fingerprint(&a), layer_fingerprint(&b));
    let err = ck.load_layer(0).unwrap_err().to_string();
    assert!(err.contains("layer 0") && err.contains("[1]"), "{err}");
}

#[test]
fn hf_naming_loads_identically() {
    for name in ["nvfp4-tiny", "mxfp4-tiny"] {
        let orig = Checkpoint::open(fixture(name)).unwrap();
        let dir = write_edit(name, 2, |_, _, t| {
            *t = std::mem::take(t)
                .into_iter()
                .map(|(k, v)| (Naming::DeepSeekV4.rename(&k, Naming::Hf), v))
                .collect();
        });
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.naming(), Naming::Hf);
        assert!(ck.has("model.layers.1.mlp.gate.e_score_correction_bias"));
        assert!(ck.has("model.layers.0.mlp.experts.3.down_proj.weight"));
        assert_eq!(ck.moe_layers(), vec![0, 1]);
        for l in [0, 1] {
            let a = orig.load_layer(l).unwrap().layer;
            let b = ck.load_layer(l).unwrap().layer;
            assert_eq!(layer_fingerprint(&a), layer_fingerprint(&b), "{name} layer {l}");
        }
    }
}

#[test]
fn w1_w3_global_scale_mismatch_warns_and_keeps_both() {
    let dir = write_edit("nvfp4-tiny", 1, |_, _, t| {
        // Tie every W3 global scale to its W1 one, except expert 3's, which gets twice W1's.
        for e in 0..16 {
            let w1 = format!("layers.1.ffn.experts.{e}.w1.weight_scale_2");
            let g = f32::from_le_bytes(t[&w1].bytes[..4].try_into().unwrap());
            let g3 = if e == 3 { g * 2.0 } else { g };
            t.insert(format!("layers.1.ffn.experts.{e}.w3.weight_scale_2"), OwnedTensor::f32(&[], &[g3]));
        }
    });
    let ck = Checkpoint::open(dir.path()).unwrap();
    let loaded = ck.load_layer(1).unwrap();
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
    let w = &loaded.warnings[0];
    assert!(w.contains("1 expert(s)") && w.contains("expert 3: w3/w1 = 2.000000"), "{w}");
    let (ProjData::Nvfp4 { global_scale: g1, .. }, ProjData::Nvfp4 { global_scale: g3, .. }) =
        (&loaded.layer.w1.data, &loaded.layer.w3.data)
    else {
        panic!("NVFP4 expected")
    };
    assert_eq!(g3[3], g1[3] * 2.0);
    assert_eq!(g3[4], g1[4]);
}

/// Experts of layer 1 replaced by BF16 weights: loads as BF16 when `exclude_modules` covers them,
/// and is an error naming the tensor when it does not (the description says NVFP4).
#[test]
fn exclude_modules_make_experts_bf16() {
    let to_bf16 = |t: &mut BTreeMap<String, OwnedTensor>| {
        t.retain(|k, _| !(k.starts_with("layers.1.ffn.experts.")));
        for e in 0..16 {
            for (p, r, c) in [("w1", 128, 256), ("w2", 256, 128), ("w3", 128, 256)] {
                let w: Vec<half::bf16> =
                    (0..r * c).map(|i| half::bf16::from_f32(((i + e) % 7) as f32 * 0.125 - 0.375)).collect();
                t.insert(format!("layers.1.ffn.experts.{e}.{p}.weight"), OwnedTensor::bf16(&[r, c], &w));
            }
        }
    };
    let dir = write_edit("nvfp4-tiny", 1, |_, q, t| {
        to_bf16(t);
        let q = q.as_mut().unwrap();
        q["quantization"]["exclude_modules"].as_array_mut().unwrap().push("layers.1.ffn.experts.*".into());
    });
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.load_layer(0).unwrap().layer.format(), WeightFormat::Nvfp4);
    let l1 = ck.load_layer(1).unwrap().layer;
    assert_eq!(l1.format(), WeightFormat::Bf16);
    let ProjData::Bf16 { weight } = &l1.w2.data else { panic!() };
    assert_eq!(weight[256 * 128 * 5 + 3].to_f32(), ((3 + 5) % 7) as f32 * 0.125 - 0.375);

    let dir = write_edit("nvfp4-tiny", 1, |_, _, t| to_bf16(t));
    let err = Checkpoint::open(dir.path()).unwrap().load_layer(1).unwrap_err().to_string();
    assert!(err.contains("layers.1.ffn.experts.0.w1.weight") && err.contains("BF16"), "{err}");
}

/// A shared expert stored as FP8 e4m3 with 128x128 block scales (official e8m0 `scale`, and HF
/// `weight_scale_inv` f32) becomes `DenseData::Fp8Block` with f32 multipliers.
#[test]
fn fp8_block_shared_expert() {
    for hf in [false, true] {
        let dir = write_edit("mxfp4-tiny", 1, |_, _, t| {
            for (p, r, c) in [("w1", 128usize, 256usize), ("w2", 256, 128), ("w3", 128, 256)] {
                let m = format!("layers.1.ffn.shared_experts.{p}");
                let w: Vec<u8> = (0..r * c).map(|i| (i % 120) as u8).collect();
                t.insert(
                    format!("{m}.weight"),
                    OwnedTensor { dtype: Dtype::F8_E4M3, shape: vec![r, c], bytes: w },
                );
                let (br, bc) = (r.div_ceil(128), c.div_ceil(128));
                if hf {
                    let s: Vec<f32> = (0..br * bc).map(|i| 0.5 + i as f32).collect();
                    t.insert(format!("{m}.weight_scale_inv"), OwnedTensor::f32(&[br, bc], &s));
                } else {
                    let s: Vec<u8> = (0..br * bc).map(|i| 120 + i as u8).collect();
                    t.insert(
                        format!("{m}.scale"),
                        OwnedTensor { dtype: Dtype::F8_E8M0, shape: vec![br, bc], bytes: s },
                    );
                }
            }
        });
        let l = Checkpoint::open(dir.path()).unwrap().load_layer(1).unwrap().layer;
        let sh = l.shared.unwrap();
        let DenseData::Fp8Block { weight, scale } = &sh.w2.data else { panic!("FP8 expected") };
        assert_eq!(weight.len(), 256 * 128);
        assert_eq!(weight[130], 10);
        assert_eq!(scale.len(), 2);
        if hf {
            assert_eq!(scale, &vec![0.5, 1.5]);
        } else {
            assert_eq!(scale, &vec![2f32.powi(-7), 2f32.powi(-6)]);
        }
        // Layer 0 keeps its BF16 shared expert.
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert!(matches!(ck.load_layer(0).unwrap().layer.shared.unwrap().w1.data, DenseData::Bf16(_)));
    }
}

#[test]
fn load_options_for_modes() {
    use megamoe::forward::Mode;
    assert!(LoadOptions::for_mode(Mode::W4A4).require_input_scale);
    assert!(!LoadOptions::for_mode(Mode::W4A16).require_input_scale);
    let ck = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    let l = ck.load_layer_for(1, Mode::W4A4).unwrap();
    let ProjData::Nvfp4 { input_scale, .. } = &l.layer.w2.data else { panic!() };
    assert_eq!(input_scale.as_ref().unwrap().len(), 16);
}

/// Synthetic layers written with the writer load back identically, in every format and naming.
#[test]
fn synthetic_layers_round_trip_through_the_writer() {
    use megamoe::checkpoint::writer::write_layers;
    let cfg = megamoe::synthetic::tiny_config();
    for fmt in [WeightFormat::Nvfp4, WeightFormat::Mxfp4, WeightFormat::Bf16] {
        for (naming, shards) in [(Naming::DeepSeekV4, 1), (Naming::Hf, 3)] {
            let layers = [
                megamoe::synthetic::random_layer(&cfg, fmt, 0, true, 5),
                megamoe::synthetic::random_layer(&cfg, fmt, 1, false, 6),
            ];
            let dir = tempfile::tempdir().unwrap();
            write_layers(dir.path(), &layers, naming, shards).unwrap();
            let ck = Checkpoint::open(dir.path()).unwrap();
            assert_eq!(ck.naming(), naming);
            assert_eq!(ck.config(), &cfg);
            for l in &layers {
                let back = ck.load_layer(l.index).unwrap().layer;
                assert_eq!(
                    layer_fingerprint(&back),
                    layer_fingerprint(l),
                    "{fmt:?} {naming:?} layer {}",
                    l.index
                );
            }
        }
    }
}
