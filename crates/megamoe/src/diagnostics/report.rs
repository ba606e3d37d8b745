//! What the doctor found: findings with a severity and a location, plus the per-tensor table of
//! the `--reference` comparison.

use serde::Serialize;

/// How bad a finding is. Ordered: `Info < Warning < Error`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Worth knowing; the output is still right.
    Info,
    /// Suspicious: right in megamoe, but likely wrong in some kernels, or an unusual checkpoint.
    Warning,
    /// The output of this layer / expert will be wrong (NaN, garbage) or it cannot be loaded.
    Error,
}

impl Severity {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }
}

impl std::fmt::Display for Severity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One finding: where, how bad, a stable machine-readable `code`, and a one-line explanation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// MoE layer, when the finding is about one.
    pub layer: Option<usize>,
    /// Routed expert, when the finding is about one.
    pub expert: Option<usize>,
    /// Full tensor name, when the finding is about one tensor.
    pub tensor: Option<String>,
    /// Stable identifier of the kind of finding (e.g. `nan_block_scales`; listed in
    /// `docs/TROUBLESHOOTING.md`).
    pub code: &'static str,
    /// One-line explanation: what was seen and what it usually means.
    pub message: String,
}

impl Finding {
    /// A finding without location; add it with the builder methods.
    pub fn new(severity: Severity, code: &'static str, message: impl Into<String>) -> Finding {
        Finding { severity, layer: None, expert: None, tensor: None, code, message: message.into() }
    }
    /// Sets the layer.
    pub fn layer(mut self, layer: usize) -> Finding {
        self.layer = Some(layer);
        self
    }
    /// Sets the expert.
    pub fn expert(mut self, expert: usize) -> Finding {
        self.expert = Some(expert);
        self
    }
    /// Sets the tensor name.
    pub fn tensor(mut self, tensor: impl Into<String>) -> Finding {
        self.tensor = Some(tensor.into());
        self
    }
    /// `layer L expert E` / `layer L` / `-`, for tables.
    pub fn location(&self) -> String {
        match (self.layer, self.expert) {
            (Some(l), Some(e)) => format!("layer {l} expert {e}"),
            (Some(l), None) => format!("layer {l}"),
            (None, Some(e)) => format!("expert {e}"),
            (None, None) => "-".into(),
        }
    }
}

/// One row of the `--reference` comparison: a stored projection against its BF16 original.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReferenceRow {
    /// Layer.
    pub layer: usize,
    /// Expert.
    pub expert: usize,
    /// Checkpoint tensor name of the packed weight.
    pub tensor: String,
    /// Relative L2 error of the stored (dequantized) weight against the reference.
    pub stored_error: f64,
    /// Relative L2 error that a correct quantization of the reference gives.
    pub expected_error: f64,
    /// `ok`, or the diagnosed cause (a finding code) when the stored error is far above expected.
    pub verdict: String,
}

/// Everything the doctor found in one checkpoint.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// The checkpoint directory.
    pub checkpoint: String,
    /// Layers examined.
    pub layers: Vec<usize>,
    /// Number of expert projections examined.
    pub tensors_examined: usize,
    /// Findings, sorted by layer, expert, severity (worst first) and code.
    pub findings: Vec<Finding>,
    /// The `--reference` comparison, one row per projection found in the reference.
    pub reference: Vec<ReferenceRow>,
}

impl Report {
    /// The worst severity found, if any finding.
    pub fn worst(&self) -> Option<Severity> {
        self.findings.iter().map(|f| f.severity).max()
    }

    /// The process exit code: 0 nothing or only info, 1 warnings, 2 errors.
    pub fn exit_code(&self) -> i32 {
        match self.worst() {
            None | Some(Severity::Info) => 0,
            Some(Severity::Warning) => 1,
            Some(Severity::Error) => 2,
        }
    }

    /// Number of findings of `severity`.
    pub fn count(&self, severity: Severity) -> usize {
        self.findings.iter().filter(|f| f.severity == severity).count()
    }

    /// Findings with `code`.
    pub fn with_code<'a>(&'a self, code: &'a str) -> impl Iterator<Item = &'a Finding> + 'a {
        self.findings.iter().filter(move |f| f.code == code)
    }

    /// Whether some finding of at least `min` severity names `layer` and `expert`, optionally with
    /// a given `code`.
    pub fn names(&self, layer: usize, expert: usize, code: Option<&str>, min: Severity) -> bool {
        self.findings.iter().any(|f| {
            f.layer == Some(layer)
                && f.expert == Some(expert)
                && f.severity >= min
                && code.is_none_or(|c| c == f.code)
        })
    }

    /// Sorts findings into the canonical order (layer, expert, worst first, code, tensor).
    pub fn sort(&mut self) {
        self.findings.sort_by(|a, b| {
            (a.layer, a.expert, std::cmp::Reverse(a.severity), a.code, &a.tensor).cmp(&(
                b.layer,
                b.expert,
                std::cmp::Reverse(b.severity),
                b.code,
                &b.tensor,
            ))
        });
    }

    /// A plain-text table of the findings and the counts per severity, for terminals.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        if !self.reference.is_empty() {
            out.push_str(
                "reference comparison (relative L2 error of the stored weights vs the BF16 originals)\n",
            );
            out.push_str(&format!(
                "  {:<48} {:>10} {:>10} {:>7}  verdict\n",
                "tensor", "stored", "expected", "ratio"
            ));
            for r in &self.reference {
                let ratio = r.stored_error / r.expected_error.max(1e-12);
                out.push_str(&format!(
                    "  {:<48} {:>10.3e} {:>10.3e} {:>7.1}  {}\n",
                    r.tensor, r.stored_error, r.expected_error, ratio, r.verdict
                ));
            }
            out.push('\n');
        }
        if self.findings.is_empty() {
            out.push_str("no findings\n");
        } else {
            let loc_w = self.findings.iter().map(|f| f.location().len()).max().unwrap_or(0).max(8);
            let code_w = self.findings.iter().map(|f| f.code.len()).max().unwrap_or(0).max(4);
            out.push_str(&format!(
                "{:<7}  {:<loc_w$}  {:<code_w$}  message\n",
                "severity", "location", "code"
            ));
            for f in &self.findings {
                out.push_str(&format!(
                    "{:<7}  {:<loc_w$}  {:<code_w$}  {}{}\n",
                    f.severity.name(),
                    f.location(),
                    f.code,
                    f.message,
                    f.tensor.as_ref().map(|t| format!(" [{t}]")).unwrap_or_default()
                ));
            }
        }
        out.push_str(&format!(
            "\nsummary: {} layer(s), {} expert projection(s) examined; {} error(s), {} warning(s), {} info\n",
            self.layers.len(),
            self.tensors_examined,
            self.count(Severity::Error),
            self.count(Severity::Warning),
            self.count(Severity::Info)
        ));
        out
    }
}
