//! Phase clocks of the decode kernels — the fused kernel (`moe_df_*`) and the slice kernel
//! (`moe_slice`): a diagnostic build, not a hot path.
//!
//! With `MEGAMOE_PHASE_PROBE=1` the tensor-core modules are compiled with `DS_PROBE` (a module of
//! their own: the define is part of the compile cache key) and every CTA of a probed launch stamps
//! `%clock64` at each phase boundary into a `__device__` array (`ds_probe`, `gemm_tc_stream.cu`),
//! plus `%globaltimer` at its start and end; nothing is passed to the kernel. After a launch the
//! array is read back ([`crate::backend::cuda::LayerWeights::phase_probe`]) and summarised per
//! phase: where a decode step's time goes, CTA by CTA (`megamoe bench forward` prints it under each
//! rank row that ran one of the two kernels). Each launch overwrites the array: it holds the last one.

use super::params::{
    PROBE_BAR1_ARRIVE, PROBE_BAR1_PASSED, PROBE_BAR2, PROBE_END, PROBE_L1_DONE, PROBE_L1_FIRST,
    PROBE_L1_ISSUED, PROBE_L1_LAST, PROBE_L2_DONE, PROBE_L2_FIRST, PROBE_L2_LAST, PROBE_PLAN, PROBE_SL_ACT,
    PROBE_SL_EXPERTS, PROBE_SL_INBOX, PROBE_SL_ISSUED, PROBE_SL_L1_FIRST, PROBE_SL_L2_DONE,
    PROBE_SL_LAST_ACT, PROBE_SL_LAST_L2, PROBE_SL_SENT, PROBE_SL_X, PROBE_START, PROBE_TIME_END,
    PROBE_TIME_START,
};

/// CTA rows of the probe array (`params::PROBE_CTAS`): at least the fused grid (3 CTAs per SM).
pub const PROBE_CTAS: usize = super::params::PROBE_CTAS as usize;
/// Slots per CTA (`params::PROBE_SLOTS`).
pub const PROBE_SLOTS: usize = super::params::PROBE_SLOTS as usize;

/// The fused kernel's clock slots (the kernel ABI's `PROBE_*`), in the order a CTA passes them,
/// with what each marks. `PROBE_START` is the origin of the others; the `%globaltimer` slots at the
/// start and end give the SM clock each CTA ran at.
pub const PHASES: [(i32, &str); 12] = [
    (PROBE_PLAN, "plan built (shared memory)"),
    (PROBE_L1_ISSUED, "L1 copies issued (producer)"),
    (PROBE_L1_FIRST, "first L1 stage landed"),
    (PROBE_L1_LAST, "last L1 stage landed"),
    (PROBE_L1_DONE, "L1 done (K parts finished)"),
    (PROBE_BAR1_ARRIVE, "barrier 1 arrival"),
    (PROBE_BAR1_PASSED, "barrier 1 passed (producer)"),
    (PROBE_L2_FIRST, "first L2 stage landed"),
    (PROBE_L2_LAST, "last L2 stage landed"),
    (PROBE_L2_DONE, "L2 done (K parts finished)"),
    (PROBE_BAR2, "barrier 2 passed"),
    (PROBE_END, "end (combine done)"),
];

/// The slice kernel's clock slots (`PROBE_SL_*`, thread 0 = warp 0, which finalises its CTA's
/// slab; the first and the last of the CTA's units), in the order a CTA passes them.
pub const SLICE_PHASES: [(i32, &str); 11] = [
    (PROBE_SL_EXPERTS, "experts listed, cluster synced"),
    (PROBE_SL_X, "token rows landed"),
    (PROBE_SL_L1_FIRST, "first L1 stage landed"),
    (PROBE_SL_SENT, "unit 1: L1 partial sent"),
    (PROBE_SL_INBOX, "unit 1: partials in"),
    (PROBE_SL_ACT, "unit 1: activations in"),
    (PROBE_SL_L2_DONE, "unit 1: L2 done"),
    (PROBE_SL_LAST_ACT, "last unit: activations in"),
    (PROBE_SL_LAST_L2, "last unit: L2 done"),
    (PROBE_SL_ISSUED, "producer: last copy issued"),
    (PROBE_END, "end (partials stored)"),
];

/// Which decode kernel a probe read belongs to (the slots mean different phases in each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbedKernel {
    /// The fused decode kernel (`moe_df_*`): [`PHASES`].
    Fused,
    /// The slice-parallel decode kernel (`moe_slice`): [`SLICE_PHASES`].
    Slice,
}

impl ProbedKernel {
    fn phases(self) -> &'static [(i32, &'static str)] {
        match self {
            ProbedKernel::Fused => &PHASES,
            ProbedKernel::Slice => &SLICE_PHASES,
        }
    }
    fn name(self) -> &'static str {
        match self {
            ProbedKernel::Fused => "fused",
            ProbedKernel::Slice => "slice",
        }
    }
}

const START: usize = PROBE_START as usize;
const END: usize = PROBE_END as usize;
const GT_START: usize = PROBE_TIME_START as usize;
const GT_END: usize = PROBE_TIME_END as usize;

/// The last fused launch's stamps, one row per CTA that ran in it.
#[derive(Clone, Debug)]
pub struct PhaseProbe {
    /// `[cta][slot]` raw stamps of the launch's CTAs (CTA index order).
    pub ctas: Vec<[u64; PROBE_SLOTS]>,
}

impl PhaseProbe {
    /// The rows of the last launch from the raw array (`PROBE_CTAS * PROBE_SLOTS` u64): the CTAs
    /// whose start lies within 1 ms of the latest start (older rows are earlier launches').
    pub fn from_raw(raw: &[u64]) -> Self {
        let rows: Vec<[u64; PROBE_SLOTS]> = raw
            .chunks_exact(PROBE_SLOTS)
            .map(|c| c.try_into().expect("PROBE_SLOTS values"))
            .filter(|r: &[u64; PROBE_SLOTS]| r[GT_START] != 0)
            .collect();
        let latest = rows.iter().map(|r| r[GT_START]).max().unwrap_or(0);
        PhaseProbe { ctas: rows.into_iter().filter(|r| latest - r[GT_START] < 1_000_000).collect() }
    }

    /// Microseconds from each CTA's start to slot `slot` (CTAs that passed it), at the SM clock
    /// each CTA ran at (clock ticks over globaltimer time between its start and end).
    pub fn micros(&self, slot: i32) -> Vec<f64> {
        let slot = slot as usize;
        self.ctas
            .iter()
            .filter_map(|r| {
                let (ticks, ns) = (r[END].checked_sub(r[START])?, r[GT_END].checked_sub(r[GT_START])?);
                if ticks == 0 || ns == 0 {
                    return None;
                }
                let d = r[slot].checked_sub(r[START])?;
                (d <= ticks).then(|| d as f64 * ns as f64 / ticks as f64 / 1e3)
            })
            .collect()
    }

    /// A table of `kernel`'s phases: per phase, the CTAs that passed it and the min / median / max
    /// microseconds from a CTA's start; then the spread of the CTAs' starts and the kernel's span.
    pub fn table(&self, kernel: ProbedKernel) -> String {
        let mut out = format!(
            "phase clocks of the last {} launch ({} CTAs), us from each CTA's start:\n",
            kernel.name(),
            self.ctas.len()
        );
        out.push_str(&format!("  {:<30} {:>5} {:>8} {:>8} {:>8}\n", "phase", "CTAs", "min", "median", "max"));
        for &(slot, name) in kernel.phases() {
            let mut v = self.micros(slot);
            if v.is_empty() {
                continue;
            }
            v.sort_by(f64::total_cmp);
            out.push_str(&format!(
                "  {:<30} {:>5} {:>8.2} {:>8.2} {:>8.2}\n",
                name,
                v.len(),
                v[0],
                v[v.len() / 2],
                v[v.len() - 1]
            ));
        }
        let starts = self.ctas.iter().map(|r| r[GT_START]);
        let (first, last) = (starts.clone().min().unwrap_or(0), starts.max().unwrap_or(0));
        let end = self.ctas.iter().map(|r| r[GT_END]).max().unwrap_or(0);
        out.push_str(&format!(
            "  CTA starts spread over {:.2} us; first start to last end {:.2} us\n",
            (last - first) as f64 / 1e3,
            end.saturating_sub(first) as f64 / 1e3
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One CTA row: start at clock 1000, each listed slot `ticks` later, 2 GHz (2 ticks per ns).
    fn row(start_ns: u64, stamps: &[(i32, u64)]) -> [u64; PROBE_SLOTS] {
        let mut r = [0u64; PROBE_SLOTS];
        r[START] = 1000;
        for &(s, t) in stamps {
            r[s as usize] = 1000 + t;
        }
        r[GT_START] = start_ns;
        r[GT_END] = start_ns + r[END].saturating_sub(1000) / 2;
        r
    }

    #[test]
    fn each_kernels_phase_slots_are_distinct_and_leave_the_clock_slots_alone() {
        for kernel in [ProbedKernel::Fused, ProbedKernel::Slice] {
            let mut seen = vec![START, GT_START, GT_END];
            for &(slot, name) in kernel.phases() {
                let slot = slot as usize;
                assert!(slot < PROBE_SLOTS && !seen.contains(&slot), "{kernel:?} {name}: slot {slot}");
                seen.push(slot);
            }
        }
    }

    #[test]
    fn the_last_launch_is_kept_and_clocks_become_micros() {
        let mut raw = vec![0u64; PROBE_CTAS * PROBE_SLOTS];
        // An older launch (5 ms earlier), then two CTAs of the last one; the rest never ran.
        raw[..PROBE_SLOTS].copy_from_slice(&row(10_000_000, &[(PROBE_PLAN, 100), (PROBE_END, 200)]));
        raw[PROBE_SLOTS..2 * PROBE_SLOTS]
            .copy_from_slice(&row(15_000_000, &[(PROBE_PLAN, 4000), (PROBE_END, 40_000)]));
        raw[2 * PROBE_SLOTS..3 * PROBE_SLOTS]
            .copy_from_slice(&row(15_000_500, &[(PROBE_PLAN, 6000), (PROBE_END, 50_000)]));
        let p = PhaseProbe::from_raw(&raw);
        assert_eq!(p.ctas.len(), 2);
        // 4000 ticks at 2 ticks per ns = 2 us; 6000 = 3 us.
        let plan = p.micros(PROBE_PLAN);
        assert!((plan[0] - 2.0).abs() < 1e-9 && (plan[1] - 3.0).abs() < 1e-9, "{plan:?}");
        // A slot a CTA never passed (0) or stamped after its end is left out.
        assert!(p.micros(PROBE_BAR2).is_empty());
        let t = p.table(ProbedKernel::Fused);
        assert!(t.contains("plan built") && t.contains("2 CTAs"), "{t}");
        assert!(!t.contains("barrier 2"), "{t}");
        // The same stamps read as the slice kernel's phases: its names, its own slot meanings.
        let t = p.table(ProbedKernel::Slice);
        assert!(t.contains("last slice launch") && t.contains("experts listed"), "{t}");
        assert!(!t.contains("plan built"), "{t}");
    }
}
