//! Binary-level tests of the `megamoe` command line: each test runs the built binary on the golden
//! fixtures in `crates/megamoe/tests/data/` and checks exit codes, key output lines and the files
//! written.
//!
//! The full `demo` builds a V4-Pro-sized checkpoint (H 7168 x I 3072, at least 6 experts), which
//! takes about a minute on a small machine, so it is `#[ignore]`d here; run it with
//! `cargo test -p megamoe-cli --test cli -- --ignored`.

use half::bf16;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The golden fixtures directory.
fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../megamoe/tests/data")
}

/// One finished run of the binary.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// stdout and stderr together (for messages that may go to either).
    fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }

    /// Panics with the full output unless the exit code is `code`.
    #[track_caller]
    fn expect_code(&self, code: i32) -> &Self {
        assert_eq!(
            self.code, code,
            "exit code {} (expected {code})\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.stdout, self.stderr
        );
        self
    }

    /// Panics unless the output (stdout or stderr) contains every one of `needles`.
    #[track_caller]
    fn expect_output(&self, needles: &[&str]) -> &Self {
        let all = self.all();
        for n in needles {
            assert!(all.contains(n), "output lacks {n:?}\n{all}");
        }
        self
    }

    /// Panics unless this was a clean failure: exit code 1, an `error:` line naming every one of
    /// `needles`, no panic.
    #[track_caller]
    fn expect_error(&self, needles: &[&str]) -> &Self {
        self.expect_code(1);
        let line = self.stderr.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| {
            panic!("no `error:` line on stderr\n--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
        });
        eprintln!("{line}");
        for n in needles {
            assert!(line.contains(n), "error line lacks {n:?}: {line}");
        }
        self
    }
}

/// Runs `megamoe args...` with `env` set and returns its exit code and output.
fn run_env(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_megamoe"));
    cmd.args(args).env_remove("MEGAMOE_FAULT").env_remove("MEGAMOE_CACHE").env("MEGAMOE_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let Output { status, stdout, stderr } = cmd.output().expect("spawn megamoe");
    let run = Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
    };
    // Whatever the command does, it must never panic or die from a signal.
    assert!(
        status.code().is_some() && !run.stderr.contains("panicked"),
        "megamoe {args:?} crashed ({status})\n--- stdout\n{}\n--- stderr\n{}",
        run.stdout,
        run.stderr
    );
    run
}

fn run(args: &[&str]) -> Run {
    run_env(args, &[])
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> SafeTensors<'a> {
    SafeTensors::deserialize(bytes).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// A float tensor (F32 or BF16) as f32.
fn floats(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let v = st.tensor(name).unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    let data = match v.dtype() {
        Dtype::F32 => v.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        Dtype::BF16 => v
            .data()
            .chunks_exact(2)
            .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        d => panic!("{name}: unexpected dtype {d:?}"),
    };
    (v.shape().to_vec(), data)
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|&b| (b as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Writes `tensors` (name -> dtype, shape, little-endian bytes) as a safetensors file.
fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, shape, bytes)| (n.to_string(), TensorView::new(*d, shape.clone(), bytes).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()
}

/// Raw bytes of a tensor, with its dtype and shape.
fn raw(st: &SafeTensors<'_>, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
    let v = st.tensor(name).unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    (v.dtype(), v.shape().to_vec(), v.data().to_vec())
}

// ---------------------------------------------------------------- help

#[test]
fn help_of_every_subcommand() {
    let top = run(&["--help"]);
    top.expect_code(0);
    let subs = [
        "demo",
        "quantize",
        "dequantize",
        "inspect",
        "forward",
        "verify",
        "bench",
        "run-model",
        "doctor",
        "trace",
        "soak",
    ];
    for sub in subs {
        assert!(top.stdout.contains(sub), "top-level help lacks `{sub}`\n{}", top.stdout);
        let r = run(&[sub, "--help"]);
        r.expect_code(0);
        assert!(r.stdout.contains("Usage: megamoe"), "`{sub} --help`:\n{}", r.stdout);
    }
    run(&["--version"]).expect_code(0).expect_output(&["megamoe"]);
    // An unknown subcommand / missing argument is a usage error (clap's exit code 2), not a panic.
    assert_eq!(run(&["frobnicate"]).code, 2);
    assert_eq!(run(&["forward"]).code, 2);
}

/// The soak command on the CPU (its smoke run; the 10 000-forward runs go to the GPU): random
/// batches including empty ones, every mode, hash and scored layers, checked against the reference.
#[test]
fn soak_smoke_run_on_the_cpu_passes() {
    run(&[
        "soak",
        "--backend",
        "cpu",
        "--tiny",
        "--forwards",
        "60",
        "--check-every",
        "6",
        "--max-tokens",
        "24",
    ])
    .expect_code(0)
    .expect_output(&["soak: 60 forwards", "reference checks", "soak: PASS"]);
}

// ---------------------------------------------------------------- quantize / dequantize

/// `quantize` of a fixture's BF16 sources gives tensors byte-equal to the fixture checkpoint's.
fn quantize_matches_fixture(fixture: &str, format: &str, suffixes: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let src = data().join(fixture).join("source.safetensors");
    let out = tmp.path().join("q.safetensors");
    run(&["quantize", "--input", s(&src), "--output", s(&out), "--format", format])
        .expect_code(0)
        .expect_output(&["quantized 24 tensors"]);

    let (sb, qb) = (read(&src), read(&out));
    let mb = read(&data().join(fixture).join("model.safetensors"));
    let (sst, qst, mst) = (parse(&src, &sb), parse(&out, &qb), parse(Path::new("model"), &mb));
    let weights: Vec<String> =
        sst.names().into_iter().filter(|n| n.ends_with(".weight")).map(str::to_string).collect();
    assert_eq!(weights.len(), 24);
    let mut compared = 0;
    for w in &weights {
        let module = w.strip_suffix(".weight").unwrap();
        for suffix in suffixes {
            let name = format!("{module}.{suffix}");
            assert_eq!(raw(&qst, &name), raw(&mst, &name), "{fixture}: `{name}` differs from the fixture");
            compared += 1;
        }
    }
    assert_eq!(compared, 24 * suffixes.len());
}

#[test]
fn quantize_nvfp4_is_byte_exact() {
    quantize_matches_fixture("nvfp4-tiny", "nvfp4", &["weight", "weight_scale", "weight_scale_2"]);
}

#[test]
fn quantize_mxfp4_is_byte_exact() {
    quantize_matches_fixture("mxfp4-tiny", "mxfp4", &["weight", "scale"]);
}

#[test]
fn quantize_refuses_to_overwrite_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("source.safetensors");
    std::fs::copy(data().join("nvfp4-tiny/source.safetensors"), &src).unwrap();
    let before = read(&src);
    run(&["quantize", "--input", s(&src), "--output", s(&src), "--format", "nvfp4"])
        .expect_error(&["source.safetensors", "overwrite"]);
    assert!(read(&src) == before, "the input was modified");
    // The same file through another spelling of its path.
    let other = tmp.path().join(".").join("source.safetensors");
    run(&["dequantize", "--input", s(&other), "--output", s(&src)]).expect_error(&["overwrite"]);
    assert!(read(&src) == before, "the input was modified");
}

#[test]
fn quantize_bad_shape_names_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("bad.safetensors");
    let out = tmp.path().join("out.safetensors");
    let name = "layers.0.ffn.experts.0.w1.weight";
    // K = 24: not a multiple of NVFP4's 16-element block.
    write(&src, &[(name, Dtype::BF16, vec![4, 24], bf16_bytes(&[0.5; 96]))]);
    run(&["quantize", "--input", s(&src), "--output", s(&out), "--format", "nvfp4"]).expect_error(&[name]);
    assert!(!out.exists(), "a failed quantize left an output file");
}

#[test]
fn dequantize_round_trip_writes_bf16_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let src = data().join("nvfp4-tiny/source.safetensors");
    let q = tmp.path().join("q.safetensors");
    let dq = tmp.path().join("dq.safetensors");
    run(&["quantize", "--input", s(&src), "--output", s(&q), "--format", "nvfp4"]).expect_code(0);
    run(&["dequantize", "--input", s(&q), "--output", s(&dq)])
        .expect_code(0)
        .expect_output(&["dequantized 24 tensors"]);
    let (sb, db) = (read(&src), read(&dq));
    let (sst, dst) = (parse(&src, &sb), parse(&dq, &db));
    let weights: Vec<&str> = sst.names().into_iter().filter(|n| n.ends_with(".weight")).collect();
    for w in &weights {
        let v = dst.tensor(w).unwrap_or_else(|e| panic!("dequantized file lacks {w}: {e}"));
        assert_eq!(v.dtype(), Dtype::BF16, "{w}");
        let ((ss, sv), (ds, dv)) = (floats(&sst, w), floats(&dst, w));
        assert_eq!(ss, ds, "{w}: shape");
        // NVFP4 keeps ~3 bits: the round trip is close to, but not equal to, the source.
        let err = rel_l2(&dv, &sv);
        assert!(err > 1e-3 && err < 0.15, "{w}: round-trip rel L2 error {err}");
    }
    // Only the weights: scales are folded in, not copied.
    assert!(dst.names().iter().all(|n| n.ends_with(".weight")), "{:?}", dst.names());
}

// ---------------------------------------------------------------- inspect

#[test]
fn inspect_fixtures() {
    for (fixture, fmt) in [("nvfp4-tiny", "nvfp4"), ("mxfp4-tiny", "mxfp4")] {
        let r = run(&["inspect", "--checkpoint", s(&data().join(fixture))]);
        r.expect_code(0);
        assert!(r.stdout.to_lowercase().contains(fmt), "{fixture}: no {fmt}\n{}", r.stdout);
        let layer0 = r.stdout.lines().find(|l| l.starts_with("layer   0")).expect("a `layer 0` line");
        assert!(layer0.contains("hash"), "{fixture}: layer 0 is hash-routed: {layer0}");
        let layer1 = r.stdout.lines().find(|l| l.starts_with("layer   1")).expect("a `layer 1` line");
        assert!(layer1.contains("scored"), "{fixture}: {layer1}");
        assert!(r.stdout.contains("16/16 present"), "{}", r.stdout);
    }
    // --validate loads every layer with all checks.
    run(&["inspect", "--checkpoint", s(&data().join("nvfp4-tiny")), "--validate", "--w4a4"])
        .expect_code(0)
        .expect_output(&["validate: ok"]);
}

#[test]
fn inspect_missing_dir_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-checkpoint");
    run(&["inspect", "--checkpoint", s(&missing)]).expect_error(&["no-such-checkpoint"]);
    // A layer that is not there is reported, with a failing exit code.
    run(&["inspect", "--checkpoint", s(&data().join("nvfp4-tiny")), "--layers", "7"])
        .expect_code(1)
        .expect_output(&["not in the checkpoint"]);
}

// ---------------------------------------------------------------- forward

/// Modes the fixture's golden file has outputs for.
fn golden_modes(golden: &SafeTensors<'_>, layer: usize) -> Vec<String> {
    let prefix = format!("{layer}.out_");
    let mut m: Vec<String> =
        golden.names().iter().filter_map(|n| n.strip_prefix(&prefix).map(str::to_string)).collect();
    m.sort();
    m
}

fn tolerance(mode: &str) -> f64 {
    if mode == "w4a16" {
        2e-3
    } else {
        2e-2
    }
}

/// Runs `forward --backend BACKEND` and returns the run and the output `y`.
fn forward(
    fixture: &str,
    layer: usize,
    input: &Path,
    mode: &str,
    backend: &str,
    out: &Path,
) -> (Run, Vec<f32>) {
    let ck = data().join(fixture);
    let l = layer.to_string();
    let r = run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        &l,
        "--input",
        s(input),
        "--output",
        s(out),
        "--mode",
        mode,
        "--backend",
        backend,
    ]);
    r.expect_code(0).expect_output(&[&format!("layer {layer}: 33 tokens x H 256 in {mode}")]);
    let bytes = read(out);
    let st = parse(out, &bytes);
    let (shape, y) = floats(&st, "y");
    assert_eq!(shape, [33, 256]);
    assert_eq!(st.tensor("topk_ids").unwrap().shape(), [33, 4]);
    assert_eq!(st.tensor("topk_weights").unwrap().shape(), [33, 4]);
    (r, y)
}

/// Every layer and mode of a fixture on the CPU backend against its golden outputs.
fn forward_matches_golden(fixture: &str, input_for: impl Fn(usize) -> PathBuf) -> usize {
    let tmp = tempfile::tempdir().unwrap();
    let gp = data().join(fixture).join("golden.safetensors");
    let gb = read(&gp);
    let golden = parse(&gp, &gb);
    let mut checked = 0;
    for layer in [0, 1] {
        let modes = golden_modes(&golden, layer);
        assert!(modes.len() >= 2, "{fixture} layer {layer}: modes {modes:?}");
        for mode in &modes {
            let out = tmp.path().join(format!("y-{layer}-{mode}.safetensors"));
            let (r, y) = forward(fixture, layer, &input_for(layer), mode, "cpu", &out);
            assert!(r.stdout.contains(" on cpu"), "{}", r.stdout);
            let (_, want) = floats(&golden, &format!("{layer}.out_{mode}"));
            let err = rel_l2(&y, &want);
            assert!(err <= tolerance(mode), "{fixture} layer {layer} {mode}: rel L2 error {err}");
            checked += 1;
        }
    }
    checked
}

#[test]
fn forward_nvfp4_every_layer_and_mode() {
    let n = forward_matches_golden("nvfp4-tiny", |l| {
        data().join(format!("activations/nvfp4-L{l}-in.safetensors"))
    });
    assert_eq!(n, 6, "nvfp4-tiny has w4a16, w4a8 and w4a4 on two layers");
}

/// An input file from the golden file's `L.x` and `input_ids` (optionally without the ids).
fn golden_input(fixture: &str, layer: usize, dir: &Path, with_ids: bool) -> PathBuf {
    let gp = data().join(fixture).join("golden.safetensors");
    let gb = read(&gp);
    let golden = parse(&gp, &gb);
    let mut tensors = vec![raw(&golden, &format!("{layer}.x"))];
    let mut names = vec!["x"];
    if with_ids {
        tensors.push(raw(&golden, "input_ids"));
        names.push("input_ids");
    }
    let path = dir.join(format!("{fixture}-L{layer}-{with_ids}.safetensors"));
    let t: Vec<_> = names.iter().zip(tensors).map(|(n, (d, sh, b))| (*n, d, sh, b)).collect();
    write(&path, &t);
    path
}

#[test]
fn forward_mxfp4_every_layer_and_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let n = forward_matches_golden("mxfp4-tiny", |l| golden_input("mxfp4-tiny", l, tmp.path(), true));
    assert_eq!(n, 4, "mxfp4-tiny has w4a16 and w4a8 on two layers");
}

#[test]
fn forward_w4a4_on_mxfp4_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let input = golden_input("mxfp4-tiny", 1, tmp.path(), true);
    let out = tmp.path().join("y.safetensors");
    let ck = data().join("mxfp4-tiny");
    run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        "1",
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--mode",
        "w4a4",
        "--backend",
        "cpu",
    ])
    .expect_error(&["w4a4", "NVFP4"]);
    assert!(!out.exists());
}

#[test]
fn forward_auto_backend_falls_back_without_a_gpu() {
    let tmp = tempfile::tempdir().unwrap();
    let input = data().join("activations/nvfp4-L1-in.safetensors");
    let out = tmp.path().join("y.safetensors");
    let (r, y) = forward("nvfp4-tiny", 1, &input, "w4a16", "auto", &out);
    if r.stdout.contains(" on cpu") {
        // No usable GPU: the fallback is announced, not silent.
        assert!(
            r.stderr.contains("running on the CPU") || r.stderr.contains("falling back"),
            "the CPU fallback is not announced\n{}",
            r.stderr
        );
    }
    let gp = data().join("nvfp4-tiny/golden.safetensors");
    let gb = read(&gp);
    let (_, want) = floats(&parse(&gp, &gb), "1.out_w4a16");
    let err = rel_l2(&y, &want);
    assert!(err <= 2e-3, "rel L2 error {err}");
}

#[test]
fn forward_refuses_to_overwrite_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.safetensors");
    std::fs::copy(data().join("activations/nvfp4-L1-in.safetensors"), &input).unwrap();
    let before = read(&input);
    let ck = data().join("nvfp4-tiny");
    run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        "1",
        "--input",
        s(&input),
        "--output",
        s(&input),
        "--backend",
        "cpu",
    ])
    .expect_error(&["in.safetensors", "overwrite"]);
    assert!(read(&input) == before, "the input was modified");
}

#[test]
fn forward_hash_layer_without_input_ids_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let input = golden_input("nvfp4-tiny", 0, tmp.path(), false);
    let out = tmp.path().join("y.safetensors");
    let ck = data().join("nvfp4-tiny");
    run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        "0",
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--backend",
        "cpu",
    ])
    .expect_error(&["input_ids"]);
    assert!(!out.exists());
    // A score-routed layer does not need them.
    let input1 = golden_input("nvfp4-tiny", 1, tmp.path(), false);
    run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        "1",
        "--input",
        s(&input1),
        "--output",
        s(&out),
        "--backend",
        "cpu",
    ])
    .expect_code(0);
}

#[test]
fn forward_bad_layer_or_input_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = data().join("nvfp4-tiny");
    let input = data().join("activations/nvfp4-L1-in.safetensors");
    let out = tmp.path().join("y.safetensors");
    let fwd = |layer: &str, input: &Path| {
        run(&[
            "forward",
            "--checkpoint",
            s(&ck),
            "--layer",
            layer,
            "--input",
            s(input),
            "--output",
            s(&out),
            "--backend",
            "cpu",
        ])
    };
    fwd("5", &input).expect_error(&["layer 5", "present"]);
    // A file without `x` (the golden file holds `L.x`).
    fwd("1", &ck.join("golden.safetensors")).expect_error(&["`x`"]);
    fwd("1", &tmp.path().join("missing.safetensors")).expect_error(&["missing.safetensors"]);
    assert!(!out.exists());
    // An explicit CUDA backend without a GPU is an error, not a silent fallback.
    let r = run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        "1",
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--backend",
        "cuda",
    ]);
    if r.code != 0 {
        r.expect_error(&["cuda"]);
    }
}

#[test]
fn forward_nan_input_names_x() {
    let tmp = tempfile::tempdir().unwrap();
    let src = data().join("activations/nvfp4-L1-in.safetensors");
    let sb = read(&src);
    let st = parse(&src, &sb);
    let (_, mut x) = floats(&st, "x");
    x[5 * 256 + 17] = f32::NAN;
    let input = tmp.path().join("nan.safetensors");
    let (d, sh, ids) = raw(&st, "input_ids");
    write(&input, &[("x", Dtype::BF16, vec![33, 256], bf16_bytes(&x)), ("input_ids", d, sh, ids)]);
    let out = tmp.path().join("y.safetensors");
    let ck = data().join("nvfp4-tiny");
    run(&[
        "forward",
        "--checkpoint",
        s(&ck),
        "--layer",
        "1",
        "--input",
        s(&input),
        "--output",
        s(&out),
        "--backend",
        "cpu",
    ])
    .expect_error(&["`x`"]);
    assert!(!out.exists());
}

// ---------------------------------------------------------------- doctor

fn doctor_json(args: &[&str]) -> serde_json::Value {
    let mut a = vec!["doctor", "--json"];
    a.extend_from_slice(args);
    let r = run(&a);
    r.expect_code(0);
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("doctor --json: {e}\n{}", r.stdout))
}

/// Findings worse than info.
fn problems(report: &serde_json::Value) -> Vec<serde_json::Value> {
    report["findings"]
        .as_array()
        .expect("findings array")
        .iter()
        .filter(|f| f["severity"] != "info")
        .cloned()
        .collect()
}

#[test]
fn doctor_clean_fixtures() {
    for fixture in ["nvfp4-tiny", "mxfp4-tiny"] {
        let ck = data().join(fixture);
        // Table: exit 0 (per its docs: nothing or only info), no error or warning rows.
        let r = run(&["doctor", "--checkpoint", s(&ck)]);
        r.expect_code(0).expect_output(&["0 error(s), 0 warning(s)", "exit code 0 (ok)"]);
        for l in r.stdout.lines() {
            assert!(!l.starts_with("error") && !l.starts_with("warning"), "{fixture}: {l}");
        }
        let report = doctor_json(&["--checkpoint", s(&ck)]);
        assert_eq!(report["layers"], serde_json::json!([0, 1]), "{report}");
        assert_eq!(report["tensors_examined"], 96);
        assert!(problems(&report).is_empty(), "{fixture}: {report}");
    }
}

#[test]
fn doctor_with_reference_finds_no_cause() {
    for fixture in ["nvfp4-tiny", "mxfp4-tiny"] {
        let ck = data().join(fixture);
        let src = ck.join("source.safetensors");
        let report = doctor_json(&["--checkpoint", s(&ck), "--reference", s(&src)]);
        assert!(problems(&report).is_empty(), "{fixture}: {report}");
        let rows = report["reference"].as_array().expect("reference rows");
        assert_eq!(rows.len(), 24, "{fixture}: every source weight is compared");
        for row in rows {
            assert_eq!(row["verdict"], "ok", "{fixture}: {row}");
        }
    }
}

#[test]
fn doctor_missing_dir_is_an_error_row() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("gone");
    // Documented: 2 when the checkpoint cannot be opened at all.
    run(&["doctor", "--checkpoint", s(&missing)]).expect_code(2).expect_output(&["checkpoint_unreadable"]);
}

// ---------------------------------------------------------------- trace

fn trace_args<'a>(ck: &'a Path, input: &'a Path, expect: &'a Path) -> Vec<&'a str> {
    vec![
        "trace",
        "--backend",
        "cpu",
        "--checkpoint",
        s(ck),
        "--layer",
        "1",
        "--input",
        s(input),
        "--expect",
        s(expect),
    ]
}

#[test]
fn trace_clean_and_dump() {
    let tmp = tempfile::tempdir().unwrap();
    let (ck, act) = (data().join("nvfp4-tiny"), data().join("activations"));
    let (input, expect) = (act.join("nvfp4-L1-in.safetensors"), act.join("nvfp4-L1-expect.safetensors"));
    let dump = tmp.path().join("dump");
    let mut args = trace_args(&ck, &input, &expect);
    args.extend(["--dump", s(&dump)]);
    let r = run(&args);
    r.expect_code(0).expect_output(&["no stage diverges", "stages written to"]);
    assert!(!r.stdout.contains("first divergence"), "{}", r.stdout);
    for f in ["backend.safetensors", "reference.safetensors"] {
        let p = dump.join(f);
        let b = read(&p);
        let st = parse(&p, &b);
        assert!(st.len() >= 5, "{f}: only {:?}", st.names());
    }
}

#[test]
fn trace_finds_an_injected_scale_layout_fault() {
    let (ck, act) = (data().join("nvfp4-tiny"), data().join("activations"));
    let (input, expect) = (act.join("nvfp4-L1-in.safetensors"), act.join("nvfp4-L1-expect.safetensors"));
    let r = run_env(&trace_args(&ck, &input, &expect), &[("MEGAMOE_FAULT", "scale_layout")]);
    r.expect_code(1).expect_output(&["first divergence: l1_gate"]);
    assert!(!r.stdout.contains("no stage diverges"), "{}", r.stdout);
}

#[test]
fn trace_json_and_hash_layer_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = data().join("nvfp4-tiny");
    let input = data().join("activations/nvfp4-L0-in.safetensors");
    let r = run(&[
        "trace",
        "--backend",
        "cpu",
        "--checkpoint",
        s(&ck),
        "--layer",
        "0",
        "--input",
        s(&input),
        "--json",
    ]);
    r.expect_code(0);
    let report: serde_json::Value =
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("trace --json: {e}\n{}", r.stdout));
    assert!(report["first_divergence"].is_null(), "{report}");
    assert!(report["rows"].as_array().is_some_and(|rows| !rows.is_empty()), "{report}");
    // Layer 0 is hash-routed: without `input_ids` it cannot be routed.
    let no_ids = golden_input("nvfp4-tiny", 0, tmp.path(), false);
    run(&["trace", "--backend", "cpu", "--checkpoint", s(&ck), "--layer", "0", "--input", s(&no_ids)])
        .expect_error(&["input_ids"]);
    run(&[
        "trace",
        "--backend",
        "cpu",
        "--checkpoint",
        s(&ck),
        "--layer",
        "0",
        "--input",
        s(&input),
        "--mode",
        "w4a2",
    ])
    .expect_error(&["w4a2"]);
}

// ---------------------------------------------------------------- demo

#[test]
fn demo_rejects_bad_sizes_before_building() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    run(&["demo", "--backend", "cpu", "--experts", "2", "--cache", s(&cache)]).expect_error(&["--experts"]);
    run(&["demo", "--backend", "cpu", "--tokens", "0", "--cache", s(&cache)]).expect_error(&["--tokens"]);
    assert!(!cache.exists(), "a rejected demo wrote to its cache");
}

/// The smallest demo (6 experts of V4-Pro size, 1 token), twice: the second run reuses the cache.
/// About a minute and 700 MB of disk on a small machine, hence ignored by default.
#[test]
#[ignore]
fn demo_cpu_builds_then_reuses_its_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let args = ["demo", "--backend", "cpu", "--experts", "6", "--tokens", "1", "--cache", s(&cache)];
    let first = run(&args);
    first.expect_code(0).expect_output(&["built in", "PASS"]);
    assert!(!first.stdout.contains("(cached)"), "{}", first.stdout);
    let second = run(&args);
    second.expect_code(0).expect_output(&["(cached)", "PASS"]);
    assert!(!second.stdout.contains("building"), "{}", second.stdout);
}

// ---------------------------------------------------------------- verify

#[test]
fn verify_without_a_gpu_is_a_clear_error() {
    let timings = run(&["verify", "--timings-only"]);
    if timings.code == 0 {
        return; // a GPU is present: nothing to check here
    }
    // Fails fast, before the 48-expert timing layer is generated, with the reason.
    timings.expect_error(&["--timings needs a usable CUDA GPU"]);
    assert!(!timings.all().contains("layer generated"), "{}", timings.all());
    // The default sweep checks CUDA: without it, one error line (exit 1) names the backend.
    let sweep = run(&["verify", "--quick"]);
    sweep.expect_error(&["cuda"]);
}

#[test]
fn verify_cases_runs_part_of_the_sweep_and_names_unknown_cases() {
    // Only the chosen case's rows (a part of the sweep under a slow tool), all passing.
    let r = run(&["verify", "--backend", "cpu", "--quick", "--cases", "tiny-hash"]);
    r.expect_code(0).expect_output(&["tiny-hash", "verify: all rows PASS"]);
    let rows: Vec<&str> = r.stdout.lines().filter(|l| l.contains("PASS (")).collect();
    assert!(!rows.is_empty() && rows.iter().all(|l| l.starts_with("tiny-hash")), "{}", r.all());
    // A name the sweep does not have is refused up front, with the names it has.
    run(&["verify", "--backend", "cpu", "--quick", "--cases", "tiny,nope"])
        .expect_error(&["no case named \"nope\"", "tiny, tiny-hash, mid-skew"]);
}

// ---------------------------------------------------------------- bench

#[test]
fn bench_forward_cpu_keeps_its_behaviour_and_refuses_cuda_only_flags() {
    run(&["bench", "forward", "--shape", "tiny", "--tokens", "1,3", "--runs", "1"])
        .expect_code(0)
        .expect_output(&["T=1: median", "T=3: median", "on cpu"]);
    for flags in [
        &["--simulate-ep", "4"][..],
        &["--family", "tc"][..],
        &["--json", "out.json"][..],
        &["--whole-layer"][..],
    ] {
        let mut args = vec!["bench", "forward", "--shape", "tiny", "--runs", "1"];
        args.extend_from_slice(flags);
        run(&args).expect_error(&[flags[0], "CUDA"]);
    }
    // Bad expert-parallel layouts are refused before any work, naming the flags.
    run(&["bench", "forward", "--shape", "tiny", "--simulate-ep", "4", "--rank", "4"])
        .expect_error(&["--simulate-ep 4 --rank 4"]);
    run(&["bench", "forward", "--shape", "tiny", "--simulate-ep", "32"]).expect_error(&["16 experts"]);
    run(&["bench", "forward", "--shape", "tiny", "--rank", "1"])
        .expect_error(&["--rank needs --simulate-ep"]);
}

#[test]
fn bench_forward_cuda_without_a_gpu_is_a_clear_error() {
    let r =
        run(&["bench", "forward", "--backend", "cuda", "--shape", "tiny", "--tokens", "1", "--iters", "2"]);
    if r.code == 0 {
        return; // a GPU is present
    }
    r.expect_error(&["cuda"]);
}

// ---------------------------------------------------------------- run-model

/// The per-layer table of a `run-model` output: `(layer, routing)` of each row.
fn run_model_layers(stdout: &str) -> Vec<(usize, String)> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("layer  routing"))
        .skip(1)
        .take_while(|l| !l.starts_with("total eager"))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "per-layer row {l:?}");
            assert!(f[2].parse::<f64>().is_ok_and(|ms| ms > 0.0), "time in {l:?}");
            (f[0].parse().unwrap(), f[1].to_string())
        })
        .collect()
}

/// The drift lines of a `run-model` output: `(layer, drift)`.
fn run_model_drifts(stdout: &str) -> Vec<(usize, f64)> {
    stdout
        .lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("layer ")?;
            let (layer, rest) = rest.split_once(' ')?;
            let d = rest.split_once("drift ")?.1.split(',').next()?;
            Some((layer.parse().ok()?, d.parse().ok()?))
        })
        .collect()
}

#[test]
fn run_model_synthetic_tiny_on_the_cpu() {
    let r = run(&["run-model", "--synthetic", "tiny", "--layers", "3", "--tokens", "4", "--backend", "cpu"]);
    r.expect_code(0).expect_output(&["3 MoE layer(s) [0, 1, 2]", "T=4 tokens", "total eager", "PASS"]);
    let layers = run_model_layers(&r.stdout);
    // Tiny's config hash-routes layer 0 only.
    assert_eq!(
        layers,
        vec![(0, "hash".to_string()), (1, "score".to_string()), (2, "score".to_string())],
        "{}",
        r.stdout
    );
    let drifts = run_model_drifts(&r.stdout);
    assert_eq!(drifts.iter().map(|d| d.0).collect::<Vec<_>>(), vec![0, 2], "{}", r.stdout);
    assert!(drifts.iter().all(|d| d.1 <= 2e-3), "{drifts:?}");
    assert!(r.stdout.contains("0 of 4 tokens excluded"), "{}", r.stdout);
}

#[test]
fn run_model_checkpoint_on_the_cpu() {
    let ck = data().join("nvfp4-tiny");
    let r = run(&["run-model", "--checkpoint", s(&ck), "--tokens", "3", "--backend", "cpu"]);
    r.expect_code(0).expect_output(&["2 MoE layer(s) [0, 1]", "total eager", "PASS"]);
    assert_eq!(run_model_layers(&r.stdout).len(), 2, "{}", r.stdout);
    let drifts = run_model_drifts(&r.stdout);
    assert_eq!(drifts.len(), 2, "{}", r.stdout);
    assert!(drifts.iter().all(|d| d.1 <= 2e-3), "{drifts:?}");
    // A quantized mode runs as well (W4A4 on the NVFP4 fixture's input scales).
    run(&["run-model", "--checkpoint", s(&ck), "--tokens", "2", "--backend", "cpu", "--mode", "w4a4"])
        .expect_code(0)
        .expect_output(&["mode w4a4", "tolerance 2e-2", "PASS"]);
}

#[test]
fn run_model_partial_checkpoint_runs_the_layers_it_holds() {
    use megamoe::checkpoint::naming::Naming;
    use megamoe::formats::WeightFormat;
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg = megamoe::synthetic::tiny_config();
    cfg.num_hidden_layers = 5;
    let layers: Vec<_> = [1usize, 3]
        .iter()
        .map(|&l| {
            megamoe::synthetic::random_layer(&cfg, WeightFormat::Mxfp4, l, cfg.is_hash_layer(l), l as u64)
        })
        .collect();
    megamoe::checkpoint::writer::write_layers(tmp.path(), &layers, Naming::DeepSeekV4, 2).unwrap();
    let r = run(&["run-model", "--checkpoint", s(tmp.path()), "--tokens", "2", "--backend", "cpu"]);
    r.expect_code(0).expect_output(&["2 MoE layer(s) [1, 3]", "PASS"]);
    assert_eq!(run_model_layers(&r.stdout).iter().map(|l| l.0).collect::<Vec<_>>(), vec![1, 3]);
    assert_eq!(run_model_drifts(&r.stdout).iter().map(|d| d.0).collect::<Vec<_>>(), vec![1, 3]);
}

#[test]
fn run_model_bad_arguments_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-checkpoint");
    run(&["run-model", "--checkpoint", s(&missing), "--backend", "cpu"]).expect_error(&[
        "--checkpoint",
        "no-such-checkpoint",
        "not a directory",
    ]);
    // A directory without config.json.
    run(&["run-model", "--checkpoint", s(tmp.path()), "--backend", "cpu"]).expect_error(&["config.json"]);
    run(&["run-model", "--synthetic", "tiny", "--tokens", "0", "--backend", "cpu"])
        .expect_error(&["--tokens"]);
    run(&["run-model", "--synthetic", "tiny", "--layers", "0", "--backend", "cpu"])
        .expect_error(&["--layers"]);
    // Usage errors (clap, exit 2): neither or both sources, synthetic-only flags with a checkpoint.
    assert_eq!(run(&["run-model"]).code, 2);
    let ck = data().join("nvfp4-tiny");
    assert_eq!(run(&["run-model", "--checkpoint", s(&ck), "--synthetic", "tiny"]).code, 2);
    assert_eq!(run(&["run-model", "--checkpoint", s(&ck), "--layers", "2"]).code, 2);
}

// ---------------------------------------------------------------- expert parallelism

#[test]
fn verify_ep_on_cpu_ranks_is_bitwise_and_bench_reports_the_stages() {
    run(&["verify", "--backend", "cpu", "--ep", "3", "--quick"]).expect_code(0).expect_output(&[
        "ep 3 x tp 1",
        "inproc rank 2/3",
        "verify: all rows PASS",
    ]);
    run(&["bench", "forward", "--shape", "tiny", "--ep", "2", "--tp", "2", "--tokens", "5", "--runs", "1"])
        .expect_code(0)
        .expect_output(&["dispatch", "experts", "combine", "holds"]);
    // TP that breaks W2's scale blocks is a clear error naming the block.
    let r = run(&[
        "bench", "forward", "--shape", "tiny", "--ep", "1", "--tp", "16", "--tokens", "1", "--runs", "1",
    ]);
    r.expect_error(&["--tp 16", "scale blocks"]);
    run(&["verify", "--backend", "cpu", "--tp", "2", "--quick"]).expect_error(&["--tp needs --ep"]);
    // The device-resident exchange is the CUDA backend's: a CPU run says so.
    run(&[
        "bench",
        "forward",
        "--backend",
        "cpu",
        "--shape",
        "tiny",
        "--ep",
        "2",
        "--exchange",
        "device",
        "--tokens",
        "1",
    ])
    .expect_error(&["--exchange device needs the CUDA backend"]);
}

#[test]
fn launch_propagates_a_failing_rank() {
    // Every rank fails (NCCL needs the CUDA backend): the launcher reports it and exits non-zero.
    let r = run(&[
        "launch",
        "--gpus",
        "2",
        "--grace-s",
        "5",
        "--",
        "verify",
        "--backend",
        "cpu",
        "--ep",
        "2",
        "--transport",
        "nccl",
        "--quick",
    ]);
    assert_ne!(r.code, 0, "{}", r.all());
    assert!(r.all().contains("launch: rank"), "{}", r.all());
}
