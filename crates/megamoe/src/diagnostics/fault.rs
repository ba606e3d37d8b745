//! Test-only fault injection: reproduce the classic bugs of DESIGN.md's failure modes inside an
//! engine, to show that `megamoe trace` points at the right stage.
//!
//! A fault is chosen with the environment variable `MEGAMOE_FAULT=<name>` (read by
//! [`Fault::from_env`]) or passed explicitly to [`engine_with`]. Weight faults rewrite the
//! engine's copy of the layer the way a buggy weight transform would (so they work for every
//! backend), and so does [`Fault::RoutingWeight`], which doubles the routing scale as code that
//! applies `routed_scaling_factor` twice would. No engine carries fault hooks of its own.
//! Never set `MEGAMOE_FAULT` in production: the engine logs a warning when it is active.

use crate::backend::{create_engine, BackendKind, MoeEngine};
use crate::checkpoint::{MoeLayer, ProjData};
use crate::error::{MegaError, Result};
use crate::formats::scale_layout;
use crate::forward::{ForwardInput, ForwardOutput, Mode};
use crate::trace::StageTrace;
use std::sync::Arc;

/// Name of the environment variable that selects a fault.
pub const ENV: &str = "MEGAMOE_FAULT";

/// A deliberately injected bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Row-major block scales read through the 128x4 swizzled layout (failure mode 4): every
    /// expert GEMM uses the wrong scales -> first divergence at `l1_gate` / `l1_up`.
    ScaleLayout,
    /// The two E2M1 codes of each byte swapped (failure mode 11) -> `l1_gate`.
    NibbleOrder,
    /// Gate and up projections exchanged (failure mode 2) -> `l1_gate`.
    GateUpSwap,
    /// NVFP4 global scales used as divisors (failure mode 6) -> `l1_gate`.
    GlobalScaleReciprocal,
    /// `routed_scaling_factor` applied twice (failure mode 7) -> `topk_weights`.
    RoutingWeight,
}

impl Fault {
    /// Every fault.
    pub const ALL: [Fault; 5] = [
        Fault::ScaleLayout,
        Fault::NibbleOrder,
        Fault::GateUpSwap,
        Fault::GlobalScaleReciprocal,
        Fault::RoutingWeight,
    ];

    /// The name used in `MEGAMOE_FAULT`.
    pub fn name(self) -> &'static str {
        match self {
            Fault::ScaleLayout => "scale_layout",
            Fault::NibbleOrder => "nibble_order",
            Fault::GateUpSwap => "gate_up_swap",
            Fault::GlobalScaleReciprocal => "global_scale_reciprocal",
            Fault::RoutingWeight => "routing_weight",
        }
    }

    /// Parses a fault name.
    pub fn parse(s: &str) -> Result<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == s.trim()).ok_or_else(|| {
            let names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
            MegaError::Input(format!("unknown fault `{s}` in {ENV} (expected one of {})", names.join(", ")))
        })
    }

    /// The fault named by `MEGAMOE_FAULT`, if set and non-empty (an unknown name is an error).
    pub fn from_env() -> Result<Option<Fault>> {
        match std::env::var(ENV) {
            Ok(s) if !s.trim().is_empty() => Fault::parse(&s).map(Some),
            _ => Ok(None),
        }
    }

    /// The layer as a buggy weight transform would leave it (unchanged for runtime faults).
    pub fn apply_to_layer(self, layer: &MoeLayer) -> MoeLayer {
        let mut l = layer.clone();
        match self {
            Fault::GateUpSwap => std::mem::swap(&mut l.w1, &mut l.w3),
            Fault::ScaleLayout | Fault::NibbleOrder | Fault::GlobalScaleReciprocal => {
                for p in [&mut l.w1, &mut l.w2, &mut l.w3] {
                    let (rows, cols, experts) = (p.rows, p.cols, p.experts);
                    let Some(block) = p.format().block_size() else { continue };
                    let (packed, scales, global) = match &mut p.data {
                        ProjData::Nvfp4 { packed, scales, global_scale, .. } => {
                            (packed, scales, Some(global_scale))
                        }
                        ProjData::Mxfp4 { packed, scales } => (packed, scales, None),
                        ProjData::Bf16 { .. } => continue,
                    };
                    match self {
                        Fault::NibbleOrder => packed.iter_mut().for_each(|b| *b = b.rotate_left(4)),
                        Fault::GlobalScaleReciprocal => {
                            if let Some(g) = global {
                                g.iter_mut().for_each(|x| *x = 1.0 / *x);
                            }
                        }
                        _ => {
                            // Read each expert's row-major scales as if they were swizzled.
                            let sc = cols / block;
                            let per = rows * sc;
                            let padded = scale_layout::swizzled_len(rows, sc);
                            for e in 0..experts {
                                let mut buf = vec![0u8; padded];
                                buf[..per].copy_from_slice(&scales[e * per..(e + 1) * per]);
                                if let Ok(v) = scale_layout::from_swizzled(&buf, rows, sc) {
                                    scales[e * per..(e + 1) * per].copy_from_slice(&v);
                                }
                            }
                        }
                    }
                }
            }
            Fault::RoutingWeight => l.config.routed_scaling_factor *= l.config.routed_scaling_factor,
        }
        l
    }
}

/// An engine that runs another one with a fault injected.
pub struct FaultyEngine {
    inner: Box<dyn MoeEngine>,
    fault: Fault,
}

impl MoeEngine for FaultyEngine {
    fn describe(&self) -> String {
        format!("{} with injected fault `{}`", self.inner.describe(), self.fault.name())
    }
    fn forward(
        &mut self,
        input: &ForwardInput<'_>,
        mode: Mode,
        trace: Option<&mut StageTrace>,
    ) -> Result<ForwardOutput> {
        self.inner.forward(input, mode, trace)
    }
}

/// Builds an engine for `layer` on `kind`, with `fault` injected when given.
pub fn engine_with(
    kind: BackendKind,
    layer: Arc<MoeLayer>,
    max_tokens: usize,
    fault: Option<Fault>,
) -> Result<Box<dyn MoeEngine>> {
    let Some(fault) = fault else { return create_engine(kind, layer, max_tokens) };
    tracing::warn!("{ENV}: injecting fault `{}` into the {kind:?} engine (testing only)", fault.name());
    let inner = create_engine(kind, Arc::new(fault.apply_to_layer(&layer)), max_tokens)?;
    Ok(Box::new(FaultyEngine { inner, fault }))
}

/// [`engine_with`] with the fault from `MEGAMOE_FAULT`.
pub fn engine(kind: BackendKind, layer: Arc<MoeLayer>, max_tokens: usize) -> Result<Box<dyn MoeEngine>> {
    engine_with(kind, layer, max_tokens, Fault::from_env()?)
}
