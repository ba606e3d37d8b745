//! `Checkpoint::load_layer_experts`: loading one rank's expert range equals slicing the whole
//! layer (tensor by tensor), reads only that range's tensors, names experts by global id, and
//! rejects bad ranges with a clear error.

use megamoe::checkpoint::writer::{read_checkpoint_dir, write_checkpoint, write_layers};
use megamoe::checkpoint::{Checkpoint, DenseData, ExpertProj, MoeLayer, Naming, ProjData};
use megamoe::formats::WeightFormat;
use megamoe::parallel::ExpertShard;
use std::ops::Range;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// Every tensor of a projection as (name, bytes or f32 bits), in a fixed order.
fn proj_tensors(p: &ExpertProj) -> Vec<(&'static str, Vec<u32>)> {
    let bytes = |v: &[u8]| v.iter().map(|&b| b as u32).collect::<Vec<_>>();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    match &p.data {
        ProjData::Nvfp4 { packed, scales, global_scale, input_scale } => vec![
            ("weight", bytes(packed)),
            ("weight_scale", bytes(scales)),
            ("weight_scale_2", bits(global_scale)),
            ("input_scale", input_scale.as_deref().map(bits).unwrap_or_default()),
        ],
        ProjData::Mxfp4 { packed, scales } => vec![("weight", bytes(packed)), ("scale", bytes(scales))],
        ProjData::Bf16 { weight } => {
            vec![("weight", weight.iter().map(|w| w.to_bits() as u32).collect())]
        }
    }
}

/// Asserts that two layers hold the same tensors, naming the first one that differs.
fn assert_same_tensors(a: &MoeLayer, b: &MoeLayer, what: &str) {
    assert_eq!(a.index, b.index, "{what}: index");
    assert_eq!(a.expert_range, b.expert_range, "{what}: expert_range");
    assert_eq!(a.config, b.config, "{what}: config");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.router.weight), bits(&b.router.weight), "{what}: gate.weight");
    assert_eq!(a.router.bias.as_deref().map(bits), b.router.bias.as_deref().map(bits), "{what}: gate.bias");
    assert_eq!(a.router.tid2eid, b.router.tid2eid, "{what}: gate.tid2eid");
    for (p, x, y) in [("w1", &a.w1, &b.w1), ("w2", &a.w2, &b.w2), ("w3", &a.w3, &b.w3)] {
        assert_eq!((x.experts, x.rows, x.cols), (y.experts, y.rows, y.cols), "{what}: experts.{p} shape");
        assert_eq!(x.format(), y.format(), "{what}: experts.{p} format");
        for ((n, u), (_, v)) in proj_tensors(x).into_iter().zip(proj_tensors(y)) {
            assert!(u == v, "{what}: experts.{p}.{n} differs ({} vs {} values)", u.len(), v.len());
        }
    }
    match (&a.shared, &b.shared) {
        (None, None) => {}
        (Some(s), Some(t)) => {
            for (p, x, y) in [("w1", &s.w1, &t.w1), ("w2", &s.w2, &t.w2), ("w3", &s.w3, &t.w3)] {
                assert_eq!((x.rows, x.cols), (y.rows, y.cols), "{what}: shared_experts.{p} shape");
                let same = match (&x.data, &y.data) {
                    (DenseData::Bf16(u), DenseData::Bf16(v)) => u == v,
                    (
                        DenseData::Fp8Block { weight: u, scale: su },
                        DenseData::Fp8Block { weight: v, scale: sv },
                    ) => u == v && bits(su) == bits(sv),
                    _ => false,
                };
                assert!(same, "{what}: shared_experts.{p} differs");
            }
        }
        _ => panic!("{what}: one layer has a shared expert, the other not"),
    }
}

/// The ranges a 16-expert layer is checked with: every rank of several worlds (even and uneven
/// splits) plus a few free ranges.
fn ranges(e: usize) -> Vec<Range<usize>> {
    let mut r: Vec<Range<usize>> = vec![0..e, 3..9, e - 1..e, 0..1];
    for world in [2, 3, 5] {
        r.extend((0..world).map(|rank| ExpertShard::new(e, world, rank).unwrap().experts));
    }
    r
}

fn check_dir(dir: &Path, what: &str) {
    let ck = Checkpoint::open(dir).unwrap();
    let e = ck.config().n_routed_experts;
    for l in ck.moe_layers() {
        let full = ck.load_layer(l).unwrap().layer;
        assert_eq!(full.expert_range, 0..e);
        for r in ranges(e) {
            let part = ck.load_layer_experts(l, r.clone()).unwrap().layer;
            assert_eq!(part.expert_range, r);
            assert_eq!(part.local_experts(), r.len());
            let shard = ExpertShard { rank: 0, world: 1, experts: r.clone() };
            let sliced = shard.slice_layer(&full).unwrap();
            assert_same_tensors(&part, &sliced, &format!("{what} layer {l} experts {r:?}"));
        }
    }
}

#[test]
fn range_loads_equal_slices_of_the_full_load() {
    for name in ["nvfp4-tiny", "mxfp4-tiny"] {
        check_dir(&fixture(name), name);
    }
}

#[test]
fn range_loads_equal_slices_for_bf16_and_hf_naming() {
    let cfg = megamoe::synthetic::tiny_config();
    for (fmt, naming) in [(WeightFormat::Bf16, Naming::DeepSeekV4), (WeightFormat::Nvfp4, Naming::Hf)] {
        let layers = [
            megamoe::synthetic::random_layer(&cfg, fmt, 0, true, 15),
            megamoe::synthetic::random_layer(&cfg, fmt, 1, false, 16),
        ];
        let dir = tempfile::tempdir().unwrap();
        write_layers(dir.path(), &layers, naming, 2).unwrap();
        check_dir(dir.path(), &format!("{fmt} {naming:?}"));
    }
}

#[test]
fn load_layer_is_the_whole_range() {
    let ck = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    let a = ck.load_layer(1).unwrap();
    let b = ck.load_layer_experts(1, 0..16).unwrap();
    assert_same_tensors(&a.layer, &b.layer, "load_layer vs load_layer_experts(0..16)");
    assert_eq!(a.warnings, b.warnings);
}

/// A checkpoint holding only experts 4..8 (a per-rank extract): the range load needs nothing
/// else, the whole-layer load names the first missing tensor.
#[test]
fn a_range_load_reads_only_its_experts() {
    for name in ["nvfp4-tiny", "mxfp4-tiny"] {
        let (cfg, q, mut t) = read_checkpoint_dir(&fixture(name)).unwrap();
        let keep = |k: &str| match k.split('.').nth(4).filter(|_| k.contains(".ffn.experts.")) {
            Some(e) => (4..8).contains(&e.parse::<usize>().unwrap()),
            None => true,
        };
        t.retain(|k, _| keep(k));
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(dir.path(), &cfg, q.as_ref(), &t, 1).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let orig = Checkpoint::open(fixture(name)).unwrap();
        for l in [0, 1] {
            let part = ck.load_layer_experts(l, 4..8).unwrap().layer;
            let want = orig.load_layer_experts(l, 4..8).unwrap().layer;
            assert_same_tensors(&part, &want, &format!("{name} extract layer {l}"));
            let err = ck.load_layer(l).unwrap_err().to_string();
            assert!(
                err.contains(&format!("layers.{l}.ffn.experts.0.w1")) && err.contains("missing"),
                "{err}"
            );
            let err = ck.load_layer_experts(l, 3..8).unwrap_err().to_string();
            assert!(err.contains(&format!("layers.{l}.ffn.experts.3.w1")), "{err}");
        }
    }
}

/// Warnings of a range load name experts by their global ids.
#[test]
fn range_load_warnings_use_global_ids() {
    let ck = Checkpoint::open(fixture("nvfp4-tiny")).unwrap();
    let full = ck.load_layer(1).unwrap();
    assert!(full.warnings[0].contains("expert 0: w3/w1"), "{:?}", full.warnings);
    let part = ck.load_layer_experts(1, 10..13).unwrap();
    assert_eq!(part.warnings.len(), 1, "{:?}", part.warnings);
    let w = &part.warnings[0];
    assert!(w.contains("expert 10: w3/w1") && w.contains("expert 12: w3/w1"), "{w}");
    assert!(!w.contains("expert 0:") && !w.contains("expert 13:"), "{w}");
}

#[test]
fn bad_ranges_are_clear_errors() {
    let ck = Checkpoint::open(fixture("mxfp4-tiny")).unwrap();
    #[allow(clippy::reversed_empty_ranges)]
    let cases: [(Range<usize>, &str); 5] = [
        (5..5, "is empty"),
        (0..0, "is empty"),
        (9..3, "is reversed"),
        (8..17, "goes beyond"),
        (16..20, "goes beyond"),
    ];
    for (r, why) in cases {
        let err = ck.load_layer_experts(1, r.clone()).unwrap_err().to_string();
        for part in ["layer 1", &format!("{r:?}"), why, "E = 16"] {
            assert!(err.contains(part), "range {r:?}: `{part}` missing from: {err}");
        }
    }
    // A layer that does not exist is reported as such, whatever the range.
    let err = ck.load_layer_experts(7, 0..4).unwrap_err().to_string();
    assert!(err.contains("layer 7") && err.contains("[0, 1]"), "{err}");
}
