//! The CI smoke run of the fuzz entry points: a bounded, seeded set of inputs (mutations of the
//! fixture's own files plus random bytes) through each target. A panic anywhere fails the test
//! with the input that caused it. The long runs are libFuzzer's (`fuzz/`, see its README).

use megamoe_fuzz::{checkpoint, config_json, fixture_dir, safetensors_file};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `base` with a few random edits: byte flips, overwrites with interesting bytes, cuts, splices.
fn mutate(rng: &mut StdRng, base: &[u8], limit: usize) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..rng.gen_range(1..=4) {
        if v.is_empty() {
            v.push(rng.gen());
            continue;
        }
        let at = rng.gen_range(0..v.len().min(limit.max(1)));
        match rng.gen_range(0..6) {
            0 => v[at] ^= 1 << rng.gen_range(0..8),
            1 => v[at] = [0u8, 0xFF, b'9', b'-', b'"', b'e', 0x7F][rng.gen_range(0..7)],
            2 => v.truncate(at),
            3 => {
                let n = rng.gen_range(1..16).min(v.len() - at);
                v.drain(at..at + n);
            }
            4 => {
                let digits: Vec<u8> = format!("{}", rng.gen::<u64>()).into_bytes();
                v.splice(at..at, digits);
            }
            _ => v.insert(at, rng.gen()),
        }
    }
    v
}

/// Runs every input through `target`; returns how many it accepted. A panic fails with the input.
fn run(name: &str, inputs: impl Iterator<Item = Vec<u8>>, target: fn(&[u8]) -> bool) -> usize {
    let (mut n, mut accepted) = (0, 0);
    for input in inputs {
        match std::panic::catch_unwind(|| target(&input)) {
            Ok(ok) => accepted += usize::from(ok),
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
                let head = &input[..input.len().min(64)];
                panic!("{name} panicked on input {n} ({} bytes, {head:?}...): {msg:?}", input.len());
            }
        }
        n += 1;
    }
    eprintln!("{name}: {n} inputs, {accepted} accepted, no panic");
    accepted
}

#[test]
fn config_json_never_panics() {
    let dir = fixture_dir();
    let cfg = std::fs::read(dir.join("config.json")).unwrap();
    let q = std::fs::read(dir.join("hf_quant_config.json")).unwrap();
    let both: Vec<u8> = [cfg.as_slice(), &[0], q.as_slice()].concat();
    let mut rng = StdRng::seed_from_u64(1);
    let mut inputs = vec![cfg.clone(), both.clone(), b"{}".to_vec(), b"[]".to_vec(), b"null".to_vec()];
    inputs.push(
        br#"{"hidden_size": 1e300, "moe_intermediate_size": -1, "n_routed_experts": 18446744073709551615}"#
            .to_vec(),
    );
    for i in 0..6000 {
        let base = if i % 2 == 0 { &cfg } else { &both };
        inputs.push(mutate(&mut rng, base, usize::MAX));
    }
    // The untouched config must pass, or the mutations test nothing.
    assert!(config_json(&cfg) && config_json(&both));
    assert!(run("config_json", inputs.into_iter(), config_json) > 2);
}

#[test]
fn safetensors_files_never_panic() {
    let shard = std::fs::read(fixture_dir().join("golden.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(shard[..8].try_into().unwrap()) as usize;
    let mut rng = StdRng::seed_from_u64(2);
    let mut inputs = vec![shard.clone(), vec![], vec![0; 7], shard[..header].to_vec()];
    for _ in 0..1500 {
        inputs.push(mutate(&mut rng, &shard, header));
    }
    for _ in 0..500 {
        let n = rng.gen_range(0..64);
        inputs.push((0..n).map(|_| rng.gen()).collect());
    }
    assert!(safetensors_file(&shard));
    assert!(run("safetensors_file", inputs.into_iter(), safetensors_file) > 1);
}

#[test]
fn damaged_checkpoints_never_panic() {
    let dir = fixture_dir();
    let cfg = std::fs::read(dir.join("config.json")).unwrap();
    let q = std::fs::read(dir.join("hf_quant_config.json")).unwrap();
    let index = br#"{"weight_map": {"model.layers.1.mlp.gate.weight": "shard-1.safetensors"}}"#.to_vec();
    let mut rng = StdRng::seed_from_u64(3);
    let mut inputs = Vec::new();
    for i in 0..600u32 {
        let op = (i % 5) as u8;
        let rest = match op {
            0 => mutate(&mut rng, &cfg, usize::MAX),
            1 => mutate(&mut rng, &q, usize::MAX),
            2 => rng.gen::<u32>().to_le_bytes().to_vec(),
            3 => (0..rng.gen_range(1..8) * 5).map(|_| rng.gen()).collect(),
            _ => mutate(&mut rng, &index, usize::MAX),
        };
        inputs.push([&[op][..], &rest].concat());
    }
    assert!(checkpoint(&[3]), "the undamaged fixture must load");
    assert!(run("checkpoint", inputs.into_iter(), checkpoint) > 1);
}
