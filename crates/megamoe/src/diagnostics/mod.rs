//! Diagnostics: the checkpoint doctor ([`doctor`]), the stage-by-stage tracer ([`trace`]) and
//! test-only fault injection ([`fault`]). See `docs/TROUBLESHOOTING.md`.

pub mod compare;
pub mod doctor;
pub mod fault;
pub mod report;
pub mod trace;

pub use doctor::{examine, DoctorOptions};
pub use report::{Finding, ReferenceRow, Report, Severity};
